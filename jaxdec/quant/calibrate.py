"""The one calibration path: the jitted model on a fixed calibration set, layer by layer.

Methods that need activations (GPTQ, AWQ, SmoothQuant, KurTail, LLM.int8() thresholds)
get them here. The calibration set is the `calib` split of the core's corpora (window `i`
with `i % 10 == 9`; the perplexity harness scores only the `eval` windows), half prose and
half code. `run_layers` feeds it through the model one layer at a time:

    x_0 = embed(tokens)
    for each layer l:  stats_l = input statistics of every matmul of layer l, at x_l
                       layer_l' = quantize_layer(l, layer_l, stats_l)
                       x_{l+1}  = layer_l'(x_l)

so each layer is calibrated on the inputs the already-quantised layers before it produce
(GPTQ's sequential recipe). Statistics are accumulated in float64 on the host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxdec import corpora
from jaxdec.errors import JaxdecError
from jaxdec.models import transformer
from jaxdec.pytree import ParamSpec, is_spec
from jaxdec.formats import tap
from jaxdec.train import losses

CALIB_CORPORA = ("prose", "code")


@dataclasses.dataclass
class InputStats:
    """What a method sees of one matmul's input x [M, K] over the calibration set."""

    h: np.ndarray        # f64[K, K]: sum over tokens of x^T x
    abs_sum: np.ndarray  # f64[K]: sum over tokens of |x|
    abs_max: np.ndarray  # f64[K]: max over tokens of |x|
    n_tokens: int

    @property
    def abs_mean(self) -> np.ndarray:
        return self.abs_sum / max(self.n_tokens, 1)

    def add(self, other: "InputStats") -> "InputStats":
        return InputStats(self.h + other.h, self.abs_sum + other.abs_sum,
                          np.maximum(self.abs_max, other.abs_max), self.n_tokens + other.n_tokens)


def calibration_tokens(encode: Callable[[str], list[int]], *, n_windows: int = 32,
                       window: int = 256, min_tokens: int = 0) -> np.ndarray:
    """i32[n_windows, window]: the first calib windows of each corpus, alternating prose and
    code. Raises a one-line JaxdecError when the corpora hold fewer, or when the set is
    smaller than `min_tokens` tokens (a method's floor, e.g. GPTQ's largest K)."""
    if n_windows < 1 or window < 2:
        raise JaxdecError(f"calibration set too small: {n_windows} windows of {window} tokens")
    if n_windows * window < min_tokens:
        raise JaxdecError(f"calibration set too small: {n_windows} x {window} = "
                          f"{n_windows * window} tokens, this method needs at least {min_tokens}")
    per = [(n_windows + 1 - i) // 2 for i in range(len(CALIB_CORPORA))]
    parts = []
    for name, n in zip(CALIB_CORPORA, per):
        ids = corpora.corpus_token_ids(name, encode)
        w = np.asarray(corpora.make_windows(ids, window=window, split="calib", max_windows=n))
        if len(w) < n:
            raise JaxdecError(f"calibration set too small: corpus {name!r} has {len(w)} calib "
                              f"windows of {window} tokens, {n} asked for")
        parts.append(w)
    rows = [r for pair in zip(*[list(p) + [None] * (max(per) - len(p)) for p in parts])
            for r in pair if r is not None]
    return np.stack(rows).astype(np.int32)


def matmul_names(layer_decl) -> list[str]:
    """Key paths (within one layer) of the layer's matmul weights, in declaration order."""
    found = jax.tree_util.tree_flatten_with_path(layer_decl, is_leaf=is_spec)[0]
    return [jax.tree_util.keystr(path) for path, spec in found
            if isinstance(spec, ParamSpec) and spec.n_in is not None and not spec.n_batch]


def _tapped(layer, layer_decl):
    """The layer with every declared matmul weight wrapped in a `Tap` named by its path."""
    def one(path, spec, w):
        if isinstance(spec, ParamSpec) and spec.n_in is not None and not spec.n_batch:
            return tap.Tap(w, jax.tree_util.keystr(path))
        return w
    return jax.tree_util.tree_map_with_path(one, layer_decl, layer,
                                            is_leaf=lambda x: x is None or is_spec(x))


@partial(jax.jit, static_argnames=("cfg", "kind"))
def _layer_out(layer, x, positions, cfg, kind):
    return transformer.decoder_layer(x, layer, positions, None, None, cfg, kind)[0]


@partial(jax.jit, static_argnames=("cfg", "kind", "decl"))
def _layer_stats(layer, x, positions, cfg, kind, decl):
    """Statistics of every matmul input of one layer at x [B, T, D] (float32 sums)."""
    with tap.recording() as seen:
        transformer.decoder_layer(x, _tapped(layer, decl), positions, None, None, cfg, kind)
    out = {}
    for name, xi in seen:
        x32 = xi.astype(jnp.float32)
        out[name] = (jnp.dot(x32.T, x32, precision=jax.lax.Precision.HIGHEST),
                     jnp.abs(x32).sum(0), jnp.abs(x32).max(0))
    return out


def _stats(layer, x, positions, cfg, kind, decl, batch: int) -> dict[str, InputStats]:
    total: dict[str, InputStats] = {}
    for b in range(0, x.shape[0], batch):
        xb = x[b:b + batch]
        part = jax.device_get(_layer_stats(layer, xb, positions[:len(xb)], cfg, kind, decl))
        n = xb.shape[0] * xb.shape[1]
        for name, (h, s, m) in part.items():
            one = InputStats(np.asarray(h, np.float64), np.asarray(s, np.float64),
                             np.asarray(m, np.float64), n)
            total[name] = total[name].add(one) if name in total else one
    return total


def run_layers(params, cfg, tokens: np.ndarray, quantize_layer, *, batch: int = 4,
               progress=None):
    """`params` with layer l replaced by `quantize_layer(l, layer, stats)`, where `stats`
    maps each matmul's key path within the layer (`matmul_names`) to its `InputStats`,
    collected on the inputs the quantised layers before it produce (module docstring).
    `progress(done, total)` is called after each layer."""
    decl = transformer.declare(cfg)
    tokens = np.asarray(tokens, np.int32)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32),
                                 (min(batch, tokens.shape[0]), tokens.shape[1]))
    embed = jax.jit(transformer.embed)
    x = jnp.concatenate([embed(params, tokens[b:b + batch]).astype(jnp.float32)
                         for b in range(0, tokens.shape[0], batch)])
    x = x.astype(params.final_norm.dtype)
    new = []
    for i, (layer, kind) in enumerate(zip(params.layers, cfg.kinds)):
        stats = _stats(layer, x, positions, cfg, kind, decl.layers[i], batch)
        layer = quantize_layer(i, layer, stats)
        x = jnp.concatenate([_layer_out(layer, x[b:b + batch], positions[:len(x[b:b + batch])], cfg, kind)
                             for b in range(0, x.shape[0], batch)])
        new.append(layer)
        if progress is not None:
            progress(i + 1, len(params.layers))
    return dataclasses.replace(params, layers=tuple(new))


def _columns(path, spec, g):
    """A matmul weight's squared gradient summed over its output axes -> f32[K]; None for
    any other parameter."""
    if isinstance(spec, ParamSpec) and spec.n_in is not None and not spec.n_batch:
        return jnp.square(g.astype(jnp.float32)).reshape(int(np.prod(g.shape[:spec.n_in])), -1).sum(1)
    return None


def _fisher_terms(grads, decl, d_model: int):
    """(per layer, a tree shaped like the layer of `_columns`; the embedding table's squared
    gradient summed over the vocabulary, f32[D], zeros when the embedding is tied)."""
    cols = [jax.tree_util.tree_map_with_path(_columns, d, g, is_leaf=lambda x: x is None or is_spec(x))
            for d, g in zip(decl.layers, grads.layers)]
    emb = (jnp.zeros((d_model,), jnp.float32) if grads.embed is None
           else jnp.square(grads.embed.astype(jnp.float32)).sum(0))
    return cols, emb


@partial(jax.jit, static_argnames=("cfg", "decl"))
def _fisher_sums(params, tokens, cfg, decl):
    """`_fisher_terms` of each row of tokens [R, T] (the gradient of that row's mean
    next-token loss), summed over the rows in one loop."""
    pos = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]

    def loss(p, row):
        logits = transformer.forward(p, row[None], pos, None, cfg)[0][:, :-1]
        return losses.cross_entropy(logits, row[None, 1:], jnp.ones(logits.shape[:2]))

    def one(total, row):
        terms = _fisher_terms(jax.grad(loss)(params, row), decl, cfg.d_model)
        return jax.tree.map(jnp.add, total, terms), None

    init = jax.tree.map(jnp.zeros_like, _fisher_terms(params, decl, cfg.d_model))
    return jax.lax.scan(one, init, tokens)[0]


@dataclasses.dataclass
class Fisher:
    """The empirical Fisher information of the calibration loss per input feature."""

    layers: list[dict[str, np.ndarray]]  # per layer {matmul key path: f64[K]}
    embed: np.ndarray | None             # f64[D] for an untied embedding table, else None


def fisher_columns(params, cfg, tokens: np.ndarray, *, chunk: int = 8, progress=None) -> Fisher:
    """The empirical Fisher information of the calibration loss, per input feature: for each
    layer, {matmul key path (`matmul_names`): f64[K]}, the sum over calibration rows of the
    squared gradient of that row's mean next-token loss, summed over the weight's output
    axes (and for an untied embedding table, over the vocabulary). Sum(F_k * dW_kn^2) over a
    weight approximates twice the loss increase that the perturbation dW causes
    (second-order Taylor with the Fisher for the Hessian), so it compares tensors by their
    effect on the model, not on their own output (DQ3's bits). Rows run `chunk` at a time
    in one jitted loop; progress(done, total) follows the rows."""
    decl = transformer.declare(cfg)
    tokens = np.asarray(tokens, np.int32)
    layers, embed = None, None
    for b in range(0, len(tokens), chunk):
        cols, emb = jax.device_get(_fisher_sums(params, tokens[b:b + chunk], cfg, decl))
        part = [{jax.tree_util.keystr(path): np.asarray(v, np.float64)
                 for path, v in jax.tree_util.tree_flatten_with_path(layer)[0]} for layer in cols]
        layers = part if layers is None else [{k: t[k] + p[k] for k in t} for t, p in zip(layers, part)]
        embed = np.asarray(emb, np.float64) + (0 if embed is None else embed)
        if progress is not None:
            progress(min(b + chunk, len(tokens)), len(tokens))
    return Fisher(layers=layers, embed=embed if params.embed is not None else None)


@partial(jax.jit, static_argnames=("cfg",))
def _logits(params, tokens, cfg):
    """f32[B, T, V]: the model's next-token logits at every position of tokens [B, T]."""
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return transformer.forward(params, tokens, pos, None, cfg)[0].astype(jnp.float32)


@partial(jax.jit, static_argnames=("cfg",))
def _kl_sum(params, tokens, base, cfg):
    """The sum over positions of KL(softmax(base) || the model under params), in nats."""
    return jnp.sum(losses.kl(base, _logits(params, tokens, cfg)))


def output_kl(params, cfg, tokens: np.ndarray, *, chunk: int = 2) -> Callable[[object], float]:
    """A function of changed params (same shapes as `params`) -> the mean KL divergence per
    token of its next-token distribution from `params`' own on `tokens` [R, T] (the measured
    damage of a change, such as quantising one tensor). The reference logits are computed
    once, `chunk` rows per call; every call after that reuses one compiled program."""
    tokens = np.asarray(tokens, np.int32)
    parts = [(tokens[b:b + chunk], _logits(params, tokens[b:b + chunk], cfg))
             for b in range(0, len(tokens), chunk)]

    def kl(changed) -> float:
        return max(0.0, float(sum(_kl_sum(changed, t, base, cfg) for t, base in parts)) / tokens.size)
    return kl
