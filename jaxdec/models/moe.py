"""Mixture-of-experts as pure functions: routers (softmax top-k as Qwen-MoE and Mixtral route;
DeepSeek-V3's sigmoid scores with bias correction and group-limited top-k), dropless expert
dispatch with grouped matmuls, shared experts. Model configs and HF loading come with the
architectures issue.

Letters: N tokens (batch and time folded), D model dim, F expert hidden dim, E experts,
k experts per token. Expert weights are stored (in, out) like every jaxdec weight:
w_gate, w_up [E, D, F], w_down [E, F, D].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxdec import layers


def route_softmax(logits, k: int, normalize: bool):
    """Softmax over all experts (f32), then the top k; with `normalize` the k weights are
    rescaled to sum to 1 (Mixtral's softmax over the top-k logits is the same thing).
    logits [N, E] -> (weights f32[N, k], experts i32[N, k])."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, idx = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, idx


def route_grouped_sigmoid(logits, bias, k: int, n_group: int, topk_group: int, normalize: bool,
                          scale: float):
    """DeepSeek-V3: scores = sigmoid(logits); experts are chosen on scores + bias (the load-
    balancing correction), only within the `topk_group` groups whose two best corrected
    scores sum highest; the weights are the uncorrected scores of the chosen experts,
    normalised (with `normalize`) and multiplied by `scale` (routed_scaling_factor)."""
    n, e = logits.shape
    if e % n_group:
        raise ValueError(f"{e} experts do not split into {n_group} groups")
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores + bias.astype(jnp.float32)
    group_scores = jnp.sum(jax.lax.top_k(choice.reshape(n, n_group, -1), 2)[0], axis=-1)
    _, groups = jax.lax.top_k(group_scores, topk_group)
    allowed = jnp.zeros((n, n_group), bool).at[jnp.arange(n)[:, None], groups].set(True)
    choice = jnp.where(jnp.repeat(allowed, e // n_group, axis=1), choice, -jnp.inf)
    _, idx = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, idx, axis=1)
    if normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * scale, idx


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Experts:
    w_gate: jax.Array  # [E, D, F]
    w_up: jax.Array  # [E, D, F]
    w_down: jax.Array  # [E, F, D]


def experts_dropless(x, idx, weights, p: Experts):
    """sum_j weights[n, j] * SwiGLU_{idx[n, j]}(x[n]) with no token dropped: the N*k
    (token, expert) pairs are sorted by expert and run as grouped matmuls
    (`jax.lax.ragged_dot`), each expert over exactly the rows routed to it.
    x [N, D]; idx i32[N, k]; weights [N, k] -> [N, D] in x.dtype."""
    n, k = idx.shape
    e = p.w_gate.shape[0]
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    xs = x[token]
    h = (jax.nn.silu(jax.lax.ragged_dot(xs, p.w_gate, sizes, preferred_element_type=jnp.float32))
         * jax.lax.ragged_dot(xs, p.w_up, sizes, preferred_element_type=jnp.float32))
    y = jax.lax.ragged_dot(h.astype(x.dtype), p.w_down, sizes, preferred_element_type=jnp.float32)
    y = y * weights.reshape(-1)[order][:, None].astype(jnp.float32)
    return jnp.zeros((n, x.shape[1]), jnp.float32).at[token].add(y).astype(x.dtype)


def shared_expert(x, w_gate, w_up, w_down, gate=None):
    """The always-on expert (a SwiGLU MLP); Qwen-MoE scales it by sigmoid(x @ gate)."""
    y = layers.gated_mlp(x, w_gate, w_up, w_down)
    if gate is not None:
        y = y * jax.nn.sigmoid(layers.linear(x, gate, dtype=jnp.float32)).astype(y.dtype)
    return y


def moefy(w_gate, w_up, w_down, n_experts: int, order=None) -> Experts:
    """MoEfication: split a dense SwiGLU MLP's F hidden neurons into `n_experts` experts of
    F / n_experts neurons each, in `order` (a permutation of the neurons, e.g. grouped by
    co-activation; default: as stored). Each neuron's gate, up and down weights move
    together, so with every expert active at weight 1 the layer is the dense MLP, its F
    products summed in n_experts groups. w_gate, w_up [D, F], w_down [F, D]."""
    d, f = w_gate.shape
    if n_experts <= 0 or f % n_experts:
        raise ValueError(f"{f} MLP neurons do not split into {n_experts} experts")
    perm = jnp.arange(f) if order is None else jnp.asarray(order)
    per = f // n_experts
    split_in = lambda w: jnp.moveaxis(w[:, perm].reshape(d, n_experts, per), 1, 0)  # [E, D, F/E]
    return Experts(w_gate=split_in(w_gate), w_up=split_in(w_up),
                   w_down=w_down[perm].reshape(n_experts, per, d))
