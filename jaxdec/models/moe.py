"""Mixture-of-experts as pure functions: routers (softmax top-k as Qwen-MoE and Mixtral route;
DeepSeek-V3's sigmoid scores with bias correction and group-limited top-k), dropless expert
dispatch with grouped matmuls, shared experts, and the "moe" sublayer of a model (`block`).

Letters: N tokens (batch and time folded), D model dim, F expert hidden dim, E experts,
k experts per token. Expert weights are stored (in, out) like every jaxdec weight:
w_gate, w_up [E, D, F], w_down [E, F, D]. Experts are SwiGLU MLPs, or squared-ReLU MLPs
without a gate (Nemotron-H: w_gate None), as the model's dense MLPs are.

Expert weights may be arrays or stacks of `QArray`s (int8/int4, quantised per expert);
the two expert products (`jaxdec.ops.qmatmul.expert_matmul`, `ragged_matmul`) dispatch on
the weight, so this module never branches on the format.

Dispatch (`experts`) picks by the static number of (token, expert) pairs N*k:
- at most E pairs (decoding): each pair gathers its expert's weights, so a step reads only
  the k experts each token uses: fewer active experts, fewer bytes;
- more: dropless grouped matmuls over the pairs sorted by expert (`cpu_kernel.ragged_matmul`:
  `jax.lax.ragged_dot` on GPU and TPU; on the CPU a C++ kernel that runs each expert once
  over its own rows, because XLA:CPU lowers `ragged_dot` to a masked dense dot of every
  pair against every expert, E times the work).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxdec import layers, sharding
from jaxdec.config import ModelConfig, MoEConfig
from jaxdec.ops import qmatmul
from jaxdec.pytree import ParamSpec


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


def route(logits, bias, cfg: MoEConfig):
    """Router logits [N, E] (and DeepSeek-V3's correction bias or None) -> (weights f32[N, k],
    experts i32[N, k]), by `cfg.router`."""
    if cfg.router == "softmax":
        return route_softmax(logits, cfg.top_k, cfg.normalize)
    if cfg.router == "sigmoid":
        bias = jnp.zeros(logits.shape[-1], jnp.float32) if bias is None else bias
        return route_grouped_sigmoid(logits, bias, cfg.top_k, cfg.n_group, cfg.topk_group,
                                     cfg.normalize, cfg.scale)
    if bias is not None:  # "select": the top k of logits + bias, each weighted 1
        logits = logits.astype(jnp.float32) + bias.astype(jnp.float32)
    _, idx = jax.lax.top_k(logits.astype(jnp.float32), cfg.top_k)
    return jnp.ones(idx.shape, jnp.float32), idx


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Experts:
    w_gate: jax.Array | None  # [E, D, F]; None: squared-ReLU experts
    w_up: jax.Array  # [E, D, F]
    w_down: jax.Array  # [E, F, D]


def experts_dropless(x, idx, weights, p: Experts):
    """sum_j weights[n, j] * SwiGLU_{idx[n, j]}(x[n]) with no token dropped: the N*k
    (token, expert) pairs are sorted by expert and run as grouped matmuls
    (`qmatmul.ragged_matmul`), each expert over exactly the rows routed to it.
    x [N, D]; idx i32[N, k]; weights [N, k] -> [N, D] in x.dtype. A pair whose index is
    E (another shard's expert) sorts last, past every group, and adds nothing."""
    n, k = idx.shape
    e = p.w_up.shape[0]
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    xs = x[token]
    grouped = lambda a, w: qmatmul.ragged_matmul(a, w, sizes)
    h = layers.mlp_act(None if p.w_gate is None else grouped(xs, p.w_gate), grouped(xs, p.w_up))
    y = grouped(h.astype(x.dtype), p.w_down)
    y = y * weights.reshape(-1)[order][:, None].astype(jnp.float32)
    return jnp.zeros((n, x.shape[1]), jnp.float32).at[token].add(y).astype(x.dtype)


def experts_gathered(x, idx, weights, p: Experts):
    """`experts_dropless` for few pairs: each (token, expert) pair multiplies by its expert's
    weights where they lie (`qmatmul.expert_matmul`: on the CPU dense experts are read in
    place and quantised ones gathered in their stored bytes, so only the chosen experts
    are read). x [N, D]; idx i32[N, k]; weights [N, k]. A pair whose
    index is E (another shard's expert) runs expert 0 at weight 0."""
    n, k = idx.shape
    outside = idx >= p.w_up.shape[0]
    weights = jnp.where(outside, 0, weights)
    slots = jnp.where(outside, 0, idx).reshape(-1)
    xs = jnp.repeat(x, k, axis=0)[:, None, :]  # [N*k, 1, D]
    mm = lambda a, w: qmatmul.expert_matmul(a, w, slots)
    h = layers.mlp_act(None if p.w_gate is None else mm(xs, p.w_gate), mm(xs, p.w_up))  # [N*k, 1, F]
    y = mm(h.astype(x.dtype), p.w_down).reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", y, weights.astype(jnp.float32)).astype(x.dtype)


def experts(x, idx, weights, p: Experts):
    """sum_j weights[n, j] * expert_{idx[n, j]}(x[n]), every pair computed (dropless), by the
    dispatch that suits N*k (see the module docstring). Pairs with index E (experts held by
    another shard, see `experts_sharded`) contribute nothing."""
    n, k = idx.shape
    if n * k <= p.w_up.shape[0]:
        return experts_gathered(x, idx, weights, p)
    return experts_dropless(x, idx, weights, p)


def experts_sharded(x, idx, weights, p: Experts, cfg: ModelConfig):
    """`experts` on a mesh, under `shard_map`: each device holds E / `expert` experts (and
    1 / `model` of each expert's hidden units), runs the pairs routed to its own experts on
    its rows of the batch (`data`), and the partial outputs are summed over `expert` and
    `model` (one all-reduce per MoE layer). Tokens are not moved between devices: at decode
    batch sizes an all-reduce of [N, D] is cheaper than two all-to-alls."""
    mesh = jax.sharding.get_abstract_mesh()
    rules = sharding.rules_for(cfg, mesh)
    spec = lambda *axes: rules.spec(axes)
    rows = spec("batch", None) if x.shape[0] % dict(mesh.shape).get("data", 1) == 0 else spec(None, None)
    summed = tuple(a for a in (rules.mesh_axis("expert"), rules.mesh_axis("expert_mlp")) if a)
    w_in, w_out = spec("expert", None, "expert_mlp"), spec("expert", "expert_mlp", None)
    specs = Experts(w_gate=None if p.w_gate is None else w_in, w_up=w_in, w_down=w_out)

    def local(x, idx, weights, p: Experts):
        e = p.w_up.shape[0]
        axis = rules.mesh_axis("expert")
        first = jax.lax.axis_index(axis) * e if axis else 0
        mine = (idx >= first) & (idx < first + e)
        y = experts(x, jnp.where(mine, idx - first, e), jnp.where(mine, weights, 0), p)
        return jax.lax.psum(y.astype(jnp.float32), summed).astype(x.dtype) if summed else y

    return jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, specs), out_specs=rows,
                         check_vma=False)(x, idx, weights, p)


def shared_expert(x, w_gate, w_up, w_down, gate=None):
    """The always-on expert (a SwiGLU or squared-ReLU MLP); Qwen-MoE scales it by
    sigmoid(x @ gate)."""
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEParams:
    router: jax.Array  # [D, E]
    router_bias: jax.Array | None  # [E]: DeepSeek-V3's correction, used only to choose
    experts: Experts
    shared_gate: jax.Array | None  # [D, F_shared]
    shared_up: jax.Array | None  # [D, F_shared]
    shared_down: jax.Array | None  # [F_shared, D]
    shared_scale: jax.Array | None  # [D, 1]: Qwen-MoE's sigmoid gate on the shared expert


def declare(cfg: ModelConfig) -> MoEParams:
    m, d = cfg.moe, cfg.d_model
    gated = cfg.mlp_act == "silu"
    # a stack of E matmul weights: one batch dim (the expert), then one contracted
    ew = lambda shape, axes: ParamSpec(shape, axes, n_in=1, n_batch=1)
    expert_in = ew((m.n_experts, d, m.d_expert), ("expert", "embed", "expert_mlp"))
    shared = m.d_shared > 0
    lin = lambda shape, axes: ParamSpec(shape, axes, n_in=1) if shared else None
    return MoEParams(
        router=ParamSpec((d, m.n_experts), ("embed", None)),
        router_bias=ParamSpec((m.n_experts,), (None,), init="zeros") if m.router_bias else None,
        experts=Experts(w_gate=expert_in if gated else None, w_up=expert_in,
                        w_down=ew((m.n_experts, m.d_expert, d), ("expert", "expert_mlp", "embed"))),
        shared_gate=lin((d, m.d_shared), ("embed", "mlp")) if gated else None,
        shared_up=lin((d, m.d_shared), ("embed", "mlp")),
        shared_down=lin((m.d_shared, d), ("mlp", "embed")),
        shared_scale=ParamSpec((d, 1), ("embed", None)) if shared and m.shared_gate else None,
    )


def block(x, p: MoEParams, cfg: ModelConfig):
    """The "moe" sublayer: x [B, T, D] -> [B, T, D]. The router runs in float32."""
    b, t, d = x.shape
    xs = x.reshape(b * t, d)
    logits = jnp.dot(xs.astype(jnp.float32), p.router.astype(jnp.float32))
    weights, idx = route(logits, p.router_bias, cfg.moe)
    if sharding.split_axes():
        y = experts_sharded(xs, idx, weights, p.experts, cfg)
    else:
        y = experts(xs, idx, weights, p.experts)
    if p.shared_up is not None:
        y = y + shared_expert(xs, p.shared_gate, p.shared_up, p.shared_down, gate=p.shared_scale)
    return y.reshape(b, t, d)
