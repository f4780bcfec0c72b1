"""MoEfication: a dense SwiGLU model's MLPs turned into mixtures of experts, with a router
fitted per layer (after Zhang et al., "MoEfication: Transformer Feed-forward Layers are
Mixtures of Experts", 2022).

For each layer, on calibration tokens run through the dense model:

1. the MLP's F hidden activations h = silu(x W_gate) * (x W_up) are collected;
2. the neurons are grouped into E experts of F / E neurons by balanced k-means on their
   (normalised) activation magnitudes over the calibration tokens, so neurons that fire
   together share an expert (`group_neurons`);
3. each expert's importance for a token is the norm of its output, ||h_e W_down_e||, and a
   linear router x -> importance is fitted by ridge regression (`fit_router`).

Optionally the `n_shared` neurons of largest mean contribution |h| * ||W_down row|| are kept
out of the experts and always run, as a shared expert (as LLaMA-MoE-style conversions do):
SwiGLU MLPs are not sparse, and a few neurons carry much of every token's output.

The MoE layer then runs the top-k experts by predicted importance, each at weight 1
(`MoEConfig(router="select")`): with all E experts active it is the dense MLP exactly, its F
products summed in E groups.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxdec import layers, transforms
from jaxdec.config import ModelConfig, MoEConfig
from jaxdec.models import moe, transformer


@partial(jax.jit, static_argnames="cfg")
def ffn_inputs(params: transformer.Params, tokens, cfg: ModelConfig):
    """The normed input of every layer's feed-forward, f32[L, B, T, D], for whole windows
    `tokens` i32[B, T] run through the model as it is."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    x = transformer.embed(params, tokens)
    taps = []
    for p, (mixer, ffn) in zip(params.layers, cfg.kinds):
        x, _ = transformer.decoder_layer(x, p, positions, None, None, cfg, (mixer, None))
        if ffn is not None:
            taps.append(layers.rms_norm(x, p.ffn_norm, cfg.norm_eps).astype(jnp.float32))
        x, _ = transformer.decoder_layer(x, p, positions, None, None, cfg, (None, ffn))
    return jnp.stack(taps)


def group_neurons(acts: np.ndarray, n_experts: int, *, iters: int = 12, seed: int = 0) -> np.ndarray:
    """A permutation of the F neurons, expert by expert (F / n_experts each), from balanced
    k-means over the neurons' activation profiles acts f32[T, F] (|h| per token, each
    neuron's profile scaled to unit norm). Balance: neurons are assigned in order of their
    preference margin to the nearest centroid that still has room."""
    t, f = acts.shape
    if f % n_experts:
        raise ValueError(f"{f} MLP neurons do not split into {n_experts} experts")
    size = f // n_experts
    prof = np.abs(acts).T.astype(np.float64)  # [F, T]
    prof /= np.linalg.norm(prof, axis=1, keepdims=True) + 1e-12
    rng = np.random.default_rng(seed)
    centroids = prof[rng.choice(f, n_experts, replace=False)]
    for _ in range(iters):
        sim = prof @ centroids.T  # [F, E] cosine similarity
        assign = _balanced_assign(sim, size)
        centroids = np.stack([prof[assign == e].mean(0) for e in range(n_experts)])
        centroids /= np.linalg.norm(centroids, axis=1, keepdims=True) + 1e-12
    return np.concatenate([np.flatnonzero(assign == e) for e in range(n_experts)])


def _balanced_assign(sim: np.ndarray, size: int) -> np.ndarray:
    """Each row (neuron) to one column (expert), `size` rows per column, the most decided
    rows (best minus second-best similarity) choosing first."""
    f, e = sim.shape
    order = np.argsort(-sim, axis=1)
    margin = sim[np.arange(f), order[:, 0]] - sim[np.arange(f), order[:, 1]]
    assign, room = np.full(f, -1), np.full(e, size)
    for i in np.argsort(-margin):
        for c in order[i]:
            if room[c]:
                assign[i], room[c] = c, room[c] - 1
                break
    return assign


def fit_router(x: np.ndarray, importance: np.ndarray, *, ridge: float = 1e-2):
    """(W f32[D, E], b f32[E]) minimising ||x W + b - importance||^2 + ridge * T * ||W||^2,
    solved in float64; x f32[T, D], importance f32[T, E]."""
    x64, y64 = np.asarray(x, np.float64), np.asarray(importance, np.float64)
    x_mean, y_mean = x64.mean(axis=0), y64.mean(axis=0)
    xc = x64 - x_mean
    gram = xc.T @ xc + ridge * x64.shape[0] * np.eye(x64.shape[1])
    w = np.linalg.solve(gram, xc.T @ (y64 - y_mean))
    return w.astype(np.float32), (y_mean - x_mean @ w).astype(np.float32)


def moefy_model(params: transformer.Params, cfg: ModelConfig, calib: np.ndarray, *,
                n_experts: int, top_k: int, n_shared: int = 0, batch: int = 4, progress=None):
    """(cfg, params) of the MoEfied model: every "mlp" layer becomes a "moe" layer of
    `n_experts` routed experts, `top_k` active, routed by a router fitted on `calib` windows
    i32[n, T], plus a shared expert of `n_shared` neurons. Attention and everything else is
    shared with the dense model."""
    if cfg.mlp_act != "silu" or any(ffn != "mlp" for _, ffn in cfg.kinds):
        raise ValueError("MoEfication needs a model whose every layer has a SwiGLU MLP")
    if not 0 <= n_shared < cfg.d_ff or (cfg.d_ff - n_shared) % n_experts:
        raise ValueError(f"{cfg.d_ff} MLP neurons less {n_shared} shared do not split into "
                         f"{n_experts} experts")
    taps = np.concatenate([np.asarray(ffn_inputs(params, calib[i:i + batch], cfg))
                           for i in range(0, len(calib), batch)], axis=1)  # [L, n, T, D]
    taps = taps.reshape(taps.shape[0], -1, cfg.d_model)  # [L, tokens, D]
    new_layers = []
    for i, p in enumerate(params.layers):
        ffn = moefy_layer(p.ffn, taps[i], n_experts=n_experts, n_shared=n_shared, seed=i)
        new_layers.append(dataclasses.replace(p, ffn=ffn))
        if progress:
            progress(i + 1, len(params.layers))
    moe_cfg = MoEConfig(n_experts=n_experts, top_k=top_k, d_expert=(cfg.d_ff - n_shared) // n_experts,
                        router="select", router_bias=True, d_shared=n_shared)
    new_cfg = dataclasses.replace(cfg, moe=moe_cfg, layer_types=tuple(
        f"{mixer}+moe" if mixer else "moe" for mixer, _ in cfg.kinds))
    return new_cfg, dataclasses.replace(params, layers=tuple(new_layers))


@transforms.register("moefy", needs_calib=True,
                     summary="SwiGLU MLPs split into routed experts with fitted routers (MoEfication)")
def moefy_transform(params: transformer.Params, cfg: ModelConfig, calib: np.ndarray, **options):
    """`moefy_model` as a weight transform (options: n_experts, top_k, n_shared, batch,
    progress): (params, cfg) of the MoEfied model."""
    new_cfg, new_params = moefy_model(params, cfg, calib, **options)
    return new_params, new_cfg


def moefy_layer(mlp: transformer.MLP, x: np.ndarray, *, n_experts: int, n_shared: int = 0,
                seed: int = 0) -> moe.MoEParams:
    """One SwiGLU MLP as a MoE layer, from its calibration inputs x f32[tokens, D]: the
    `n_shared` neurons of largest mean contribution as a shared expert, the rest clustered
    into `n_experts` experts, a router (with bias) fitted to their output norms."""
    f = mlp.w_up.shape[1]
    h = np.asarray(_hidden(jnp.asarray(x), mlp.w_gate, mlp.w_up))  # [tokens, F]
    contribution = np.abs(h).mean(0) * np.linalg.norm(np.asarray(mlp.w_down, np.float32), axis=1)
    shared = np.sort(np.argsort(-contribution, kind="stable")[:n_shared])
    routed = np.setdiff1d(np.arange(f), shared)
    order = routed[group_neurons(h[:, routed], n_experts, seed=seed)]
    experts = moe.moefy(mlp.w_gate[:, order], mlp.w_up[:, order], mlp.w_down[order], n_experts)
    importance = np.asarray(_importance(jnp.asarray(h[:, order]), experts.w_down))
    router, bias = fit_router(x, importance)
    keep = lambda w: w if n_shared else None
    return moe.MoEParams(router=jnp.asarray(router), router_bias=jnp.asarray(bias), experts=experts,
                         shared_gate=keep(mlp.w_gate[:, shared]), shared_up=keep(mlp.w_up[:, shared]),
                         shared_down=keep(mlp.w_down[shared]), shared_scale=None)


def expert_outputs(p: moe.MoEParams, x) -> tuple[np.ndarray, np.ndarray]:
    """(every routed expert's output f32[T, E, D], the shared expert's f32[T, D] or zeros)
    for inputs x [T, D]: the parts a MoEfied MLP sums (analysis, not the decode path)."""
    x = jnp.asarray(x, jnp.float32)
    e = p.experts
    h = layers.mlp_act(jnp.einsum("td,edf->tef", x, e.w_gate), jnp.einsum("td,edf->tef", x, e.w_up))
    parts = np.asarray(jnp.einsum("tef,efd->ted", h, e.w_down))
    if p.shared_up is None:
        return parts, np.zeros((x.shape[0], x.shape[1]), np.float32)
    return parts, np.asarray(layers.gated_mlp(x, p.shared_gate, p.shared_up, p.shared_down))


@jax.jit
def _hidden(x, w_gate, w_up):
    """The MLP's F hidden activations, f32[T, F], for inputs x f32[T, D]."""
    return layers.mlp_act(x @ w_gate.astype(jnp.float32), x @ w_up.astype(jnp.float32))


@jax.jit
def _importance(h_sorted, w_down):
    """||h_e @ W_down_e|| per token and expert: h_sorted [T, F] in expert order, w_down
    [E, F/E, D] -> f32[T, E]."""
    e, per, _ = w_down.shape
    he = h_sorted.reshape(h_sorted.shape[0], e, per)
    return jnp.linalg.norm(jnp.einsum("tep,epd->ted", he, w_down.astype(jnp.float32)), axis=-1)
