"""Mamba2 (SSD) as pure functions: the selective state-space scan (chunked for prefill, one
step for decode), the causal depthwise conv1d with its conv-state cache, the gated RMSNorm,
and the mixer layer that wires them (HF `Mamba2Mixer`), and the sublayer a model's "mamba"
layers run (`block`).

Shapes (one vocabulary with layers.py where letters overlap): B batch, T time, nh heads,
hd head dim, ng groups (heads share B/C within a group: head h uses group h // (nh // ng)),
ds state size, C channels of the conv.

The recurrence, per head, with a = dt * A (A < 0, so exp(a) in (0, 1]):

    s_t = exp(a_t) * s_{t-1} + dt_t * outer(x_t, B_t)        s: [hd, ds]
    y_t = s_t @ C_t + D * x_t

A token with dt = 0 leaves the state as it was: padding and finished rows pass dt = 0.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxdec import layers
from jaxdec.cache import entry
from jaxdec.config import MambaConfig, ModelConfig
from jaxdec.pytree import ParamSpec


def _heads_per_group(nh: int, ng: int) -> int:
    if ng <= 0 or nh % ng:
        raise ValueError(f"{nh} heads do not split into {ng} groups")
    return nh // ng


def ssd_step(state, x, dt, A, B, C, D):
    """One token per row. state f32[B, nh, hd, ds]; x [B, nh, hd]; dt [B, nh] (after
    softplus; 0 for rows that must not advance); A [nh]; B, C [B, ng, ds]; D [nh].
    Returns (y f32[B, nh, hd], new state). Heads are viewed as [ng, rep] (the heads of a
    group are contiguous), so B and C broadcast over a group's heads without a copy per
    head, and a mesh that splits groups with their heads needs no communication."""
    b, nh, hd = x.shape
    ng = B.shape[1]
    rep = _heads_per_group(nh, ng)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    grouped = lambda a: a.reshape(b, ng, rep, *a.shape[2:])
    x, dt, s = grouped(f32(x)), grouped(f32(dt)), grouped(state)
    decay = jnp.exp(dt * f32(A).reshape(ng, rep))[..., None, None]
    s = decay * s + (dt[..., None] * x)[..., None] * f32(B)[:, :, None, None, :]
    y = jnp.einsum("bgrpn,bgn->bgrp", s, f32(C)) + f32(D).reshape(ng, rep)[None, :, :, None] * x
    return y.reshape(b, nh, hd), s.reshape(state.shape)


def ssd_chunked(x, dt, A, B, C, D, *, chunk: int = 64, state=None):
    """The same recurrence over a whole sequence, computed chunk by chunk (the SSD form:
    within a chunk a masked quadratic attention-like product, between chunks a scan over the
    chunk states). x [B, T, nh, hd]; dt [B, T, nh]; A [nh]; B, C [B, T, ng, ds]; D [nh];
    state f32[B, nh, hd, ds] or None (zeros). Returns (y f32[B, T, nh, hd], final state)."""
    b, t, nh, hd = x.shape
    ng, ds = B.shape[2], B.shape[3]
    rep = _heads_per_group(nh, ng)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    x, dt, B, C = f32(x), f32(dt), f32(B), f32(C)
    if state is None:
        state = jnp.zeros((b, nh, hd, ds), jnp.float32)
    pad = -t % chunk
    if pad:  # dt = 0 past the end: the padding changes nothing
        widen = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        x, dt, B, C = map(widen, (x, dt, B, C))
    nc = (t + pad) // chunk
    split = lambda a: a.reshape(b, nc, chunk, *a.shape[2:])
    x, dt, B, C = map(split, (x, dt, B, C))  # [b, nc, L, ...]
    a = dt * f32(A)  # [b, nc, L, nh], log decays
    cum = jnp.cumsum(a, axis=2)
    # within a chunk: y_i += sum_{j<=i} (C_i . B_j) exp(cum_i - cum_j) dt_j x_j
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    diff = cum[:, :, :, None, :] - cum[:, :, None, :, :]  # [b, nc, i, j, nh]
    decay = jnp.exp(jnp.where(causal[None, None, :, :, None], diff, -jnp.inf))
    cb = jnp.repeat(jnp.einsum("bcign,bcjgn->bcijg", C, B), rep, axis=-1)  # [b, nc, i, j, nh]
    y = jnp.einsum("bcijh,bcjh,bcjhp->bcihp", cb * decay, dt, x)
    # each chunk's own contribution to the state at its end
    to_end = jnp.exp(cum[:, :, -1:, :] - cum) * dt  # [b, nc, L, nh]
    Bh = jnp.repeat(B, rep, axis=3)  # [b, nc, L, nh, ds]
    chunk_states = jnp.einsum("bcjh,bcjhp,bcjhn->bchpn", to_end, x, Bh)
    chunk_decay = jnp.exp(cum[:, :, -1, :])  # [b, nc, nh]

    def carry(s, inputs):
        cs, cd = inputs
        return cd[:, :, None, None] * s + cs, s  # emit the state entering the chunk

    final, entering = jax.lax.scan(carry, state, (jnp.moveaxis(chunk_states, 1, 0),
                                                   jnp.moveaxis(chunk_decay, 1, 0)))
    entering = jnp.moveaxis(entering, 0, 1)  # [b, nc, nh, hd, ds]
    Ch = jnp.repeat(C, rep, axis=3)  # [b, nc, L, nh, ds]
    y = y + jnp.einsum("bcih,bcihn,bchpn->bcihp", jnp.exp(cum), Ch, entering)
    y = y.reshape(b, nc * chunk, nh, hd)[:, :t] + f32(D)[None, None, :, None] * f32(x.reshape(
        b, nc * chunk, nh, hd)[:, :t])
    return y, final


def causal_conv1d(x, w, bias, conv_state, lengths):
    """Depthwise causal conv over right-padded rows, continuing from a conv-state cache.
    x [B, T, *C]; w [K, *C] (tap k multiplies the input k steps before the last, reversed as
    torch's Conv1d weight[c, 0, :]: w[K-1] is the newest tap); bias [*C];
    conv_state [B, K-1, *C] (the last K-1 inputs before this chunk, oldest first);
    lengths i32[B]: real tokens of each row in this chunk. Returns (y [B, T, *C] without the
    activation, the new conv state: the last K-1 real inputs). The channels *C may be any
    shape (heads x head dim, say), so that a mesh can split them by head."""
    k = w.shape[0]
    full = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)  # [B, K-1+T, *C]
    t = x.shape[1]
    y = sum(full[:, i:i + t] * w[i] for i in range(k)) + bias
    # new state: inputs at positions lengths .. lengths+K-2 of `full` (the last K-1 real ones)
    idx = lengths[:, None] + jnp.arange(k - 1)[None, :]
    new_state = jnp.take_along_axis(full, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)
    return y, new_state.astype(conv_state.dtype)


def gated_rms_norm(y, z, w, eps: float, groups: int):
    """Mamba2's gated RMSNorm: the RMSNorm (as `layers.rms_norm`) of y * silu(z) over each of
    `groups` equal runs of heads. y, z [..., nh, hd]; w [nh, hd]. Computed in f32, returned
    in y.dtype."""
    nh, hd = y.shape[-2:]
    if nh % groups:
        raise ValueError(f"{nh} heads do not split into {groups} norm groups")
    g = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
    g = g.reshape(*y.shape[:-2], groups, nh // groups, hd)
    g = g * jax.lax.rsqrt(jnp.mean(g * g, axis=(-2, -1), keepdims=True) + eps)
    return (w.astype(jnp.float32) * g.reshape(y.shape)).astype(y.dtype)


def in_proj_parts(m: MambaConfig) -> dict[str, tuple[int, int]]:
    """Where each of jaxdec's in-projections lies in the fused HF `in_proj` (its output rows:
    z, x, B then C (group-major), dt)."""
    di, gn = m.d_inner, m.n_groups * m.d_state
    return {"in_z": (0, di), "in_x": (di, 2 * di), "in_bc": (2 * di, 2 * di + 2 * gn),
            "in_dt": (2 * di + 2 * gn, 2 * di + 2 * gn + m.n_heads)}


def conv_parts(m: MambaConfig) -> dict[str, tuple[int, int]]:
    """The x channels and the B, C channels of the fused HF conv1d."""
    return {"x": (0, m.d_inner), "bc": (m.d_inner, m.conv_dim)}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MixerParams:
    """HF's fused in-projection and conv are stored split, by head where they act per head
    (z, x, dt) and by group for B and C, so that a mesh's `model` axis splits the mixer by
    head like attention (`in_proj_parts`, `conv_parts` say where each part lies in HF's)."""

    in_z: jax.Array  # [D, nh, hd]: the gate
    in_x: jax.Array  # [D, nh, hd]
    in_bc: jax.Array  # [D, 2, ng, ds]: B then C
    in_dt: jax.Array  # [D, nh]
    conv_x_w: jax.Array  # [d_conv, nh, hd]
    conv_x_b: jax.Array  # [nh, hd]
    conv_bc_w: jax.Array  # [d_conv, 2, ng, ds]
    conv_bc_b: jax.Array  # [2, ng, ds]
    dt_bias: jax.Array  # [nh]
    A_log: jax.Array  # [nh]; A = -exp(A_log)
    D: jax.Array  # [nh]
    norm: jax.Array  # [nh, hd]
    out_proj: jax.Array  # [nh, hd, D]


def declare(cfg: ModelConfig) -> MixerParams:
    m, d = cfg.mamba, cfg.d_model
    nh, hd, bc = m.n_heads, m.head_dim, (2, m.n_groups, m.d_state)
    heads, groups = ("mamba_heads", None), (None, "mamba_groups", None)
    vec = lambda init="normal": ParamSpec((nh,), ("mamba_heads",), init=init)
    return MixerParams(
        in_z=ParamSpec((d, nh, hd), ("embed", *heads), n_in=1),
        in_x=ParamSpec((d, nh, hd), ("embed", *heads), n_in=1),
        in_bc=ParamSpec((d, *bc), ("embed", *groups), n_in=1),
        in_dt=ParamSpec((d, nh), ("embed", "mamba_heads"), n_in=1),
        conv_x_w=ParamSpec((m.d_conv, nh, hd), (None, *heads), scale=0.3),
        conv_x_b=ParamSpec((nh, hd), heads, init="zeros"),
        conv_bc_w=ParamSpec((m.d_conv, *bc), (None, *groups), scale=0.3),
        conv_bc_b=ParamSpec(bc, groups, init="zeros"),
        dt_bias=vec(), A_log=vec(), D=vec("ones"),
        norm=ParamSpec((nh, hd), heads, init="ones"),
        out_proj=ParamSpec((nh, hd, d), (*heads, "embed"), n_in=2),
    )


def from_fused(in_proj, conv_w, conv_b, dt_bias, A_log, D, norm, out_proj, cfg: MambaConfig):
    """`MixerParams` from HF's fused layout, transposed to (in, out): in_proj [D, 2*di +
    2*ng*ds + nh], conv_w [d_conv, conv_dim], conv_b [conv_dim], norm [di], out_proj [di, D]."""
    parts, chans = in_proj_parts(cfg), conv_parts(cfg)
    d, nh, hd, bc = in_proj.shape[0], cfg.n_heads, cfg.head_dim, (2, cfg.n_groups, cfg.d_state)
    cols = lambda name, shape: in_proj[:, slice(*parts[name])].reshape(d, *shape)
    return MixerParams(
        in_z=cols("in_z", (nh, hd)), in_x=cols("in_x", (nh, hd)), in_bc=cols("in_bc", bc),
        in_dt=cols("in_dt", (nh,)),
        conv_x_w=conv_w[:, slice(*chans["x"])].reshape(-1, nh, hd),
        conv_x_b=conv_b[slice(*chans["x"])].reshape(nh, hd),
        conv_bc_w=conv_w[:, slice(*chans["bc"])].reshape(-1, *bc),
        conv_bc_b=conv_b[slice(*chans["bc"])].reshape(bc),
        dt_bias=dt_bias, A_log=A_log, D=D, norm=norm.reshape(nh, hd),
        out_proj=out_proj.reshape(nh, hd, -1))


def init_state(cfg: MambaConfig, batch: int, dtype=jnp.float32):
    """((conv_x [B, d_conv-1, nh, hd], conv_bc [B, d_conv-1, 2, ng, ds]), ssm_state
    f32[B, nh, hd, ds]): the per-row decode state of one Mamba layer, the same size at any
    sequence length."""
    shapes = cfg.state_shapes(batch)
    return ((jnp.zeros(shapes["conv_x"], dtype), jnp.zeros(shapes["conv_bc"], dtype)),
            jnp.zeros(shapes["ssm"], jnp.float32))


def block(x, p: MixerParams, positions, state: entry.StateLayer | None, cfg: ModelConfig):
    """The Mamba sublayer of a model: x [B, T, D] -> ([B, T, D], updated state). Rows are
    right-padded (positions < 0 mark padding and inactive rows, which leave the state as it
    was); without a cache entry the scan starts from zeros."""
    lengths = jnp.sum(positions >= 0, axis=1).astype(jnp.int32)
    if state is None:
        conv, ssm = init_state(cfg.mamba, x.shape[0], x.dtype)
    else:
        conv, ssm = (state.conv_x, state.conv_bc), state.ssm
    y, conv, ssm = mixer(p, x, conv, ssm, lengths, cfg.mamba, cfg.norm_eps)
    return y, (None if state is None else entry.StateLayer(conv_x=conv[0], conv_bc=conv[1], ssm=ssm))


def mixer(p: MixerParams, x, conv_state, ssm_state, lengths, cfg: MambaConfig, eps: float):
    """x [B, T, D], right-padded (row b has lengths[b] real tokens; 0 leaves a row's state as
    it was); conv_state (conv_x, conv_bc) -> (y [B, T, D] in x.dtype, conv_state,
    ssm_state). T == 1 is the decode step."""
    b, t, _ = x.shape
    z = layers.linear(x, p.in_z)  # [B, T, nh, hd]
    xs, conv_x = causal_conv1d(layers.linear(x, p.in_x), p.conv_x_w, p.conv_x_b, conv_state[0], lengths)
    bc, conv_bc = causal_conv1d(layers.linear(x, p.in_bc), p.conv_bc_w, p.conv_bc_b, conv_state[1],
                                lengths)
    xs, bc = jax.nn.silu(xs), jax.nn.silu(bc)
    B, C = bc[:, :, 0], bc[:, :, 1]  # [B, T, ng, ds]
    dt = layers.linear(x, p.in_dt)
    dt = jax.nn.softplus(dt.astype(jnp.float32) + p.dt_bias.astype(jnp.float32))
    dt = jnp.clip(dt, cfg.dt_min, cfg.dt_max)
    dt = jnp.where(jnp.arange(t)[None, :, None] < lengths[:, None, None], dt, 0.0)
    A = -jnp.exp(p.A_log.astype(jnp.float32))
    if t == 1:
        y, ssm_state = ssd_step(ssm_state, xs[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], p.D)
        y = y[:, None]
    else:
        y, ssm_state = ssd_chunked(xs, dt, A, B, C, p.D, chunk=min(cfg.chunk, t), state=ssm_state)
    y = gated_rms_norm(y.astype(x.dtype), z, p.norm, eps, cfg.n_groups)
    return layers.linear(y, p.out_proj, n_in=2), (conv_x, conv_bc), ssm_state
