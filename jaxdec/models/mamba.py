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
from jaxdec.cache import dense
from jaxdec.config import MambaConfig, ModelConfig
from jaxdec.pytree import ParamSpec


def _heads_per_group(nh: int, ng: int) -> int:
    if ng <= 0 or nh % ng:
        raise ValueError(f"{nh} heads do not split into {ng} groups")
    return nh // ng


def ssd_step(state, x, dt, A, B, C, D):
    """One token per row. state f32[B, nh, hd, ds]; x [B, nh, hd]; dt [B, nh] (after
    softplus; 0 for rows that must not advance); A [nh]; B, C [B, ng, ds]; D [nh].
    Returns (y f32[B, nh, hd], new state)."""
    rep = _heads_per_group(x.shape[1], B.shape[1])
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    x, dt, Bh, Ch = f32(x), f32(dt), jnp.repeat(f32(B), rep, axis=1), jnp.repeat(f32(C), rep, axis=1)
    decay = jnp.exp(dt * f32(A))[:, :, None, None]
    state = decay * state + (dt[:, :, None] * x)[..., None] * Bh[:, :, None, :]
    y = jnp.einsum("bhpn,bhn->bhp", state, Ch) + f32(D)[None, :, None] * x
    return y, state


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
    x [B, T, C]; w [K, C] (tap k multiplies the input k steps before the last, reversed as
    torch's Conv1d weight[c, 0, :]: w[K-1] is the newest tap); bias [C];
    conv_state [B, K-1, C] (the last K-1 inputs before this chunk, oldest first);
    lengths i32[B]: real tokens of each row in this chunk. Returns (y [B, T, C] without the
    activation, the new conv state: the last K-1 real inputs)."""
    k = w.shape[0]
    full = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
    t = x.shape[1]
    y = sum(full[:, i:i + t, :] * w[i] for i in range(k)) + bias
    # new state: inputs at positions lengths .. lengths+K-2 of `full` (the last K-1 real ones)
    idx = lengths[:, None] + jnp.arange(k - 1)[None, :]
    new_state = jnp.take_along_axis(full, idx[:, :, None], axis=1)
    return y, new_state.astype(conv_state.dtype)


def gated_rms_norm(y, z, w, eps: float, groups: int):
    """Mamba2's gated RMSNorm: `layers.rms_norm` of y * silu(z) over each of `groups` equal
    slices of the last axis. Computed in f32, returned in y.dtype."""
    d = y.shape[-1]
    if d % groups:
        raise ValueError(f"{d} channels do not split into {groups} norm groups")
    g = (y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32)))
    g = g.reshape(*y.shape[:-1], groups, d // groups)
    out = layers.rms_norm(g, w.astype(jnp.float32).reshape(groups, d // groups), eps)
    return out.reshape(y.shape).astype(y.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MixerParams:
    in_proj: jax.Array  # [D, d_inner + conv_dim + n_heads]: z, xBC, dt
    conv_w: jax.Array  # [d_conv, conv_dim]
    conv_b: jax.Array  # [conv_dim]
    dt_bias: jax.Array  # [n_heads]
    A_log: jax.Array  # [n_heads]; A = -exp(A_log)
    D: jax.Array  # [n_heads]
    norm: jax.Array  # [d_inner]
    out_proj: jax.Array  # [d_inner, D]


def declare(cfg: ModelConfig) -> MixerParams:
    m, d = cfg.mamba, cfg.d_model
    vec = lambda n, init="normal": ParamSpec((n,), ("mamba_heads",), init=init)
    return MixerParams(
        in_proj=ParamSpec((d, m.d_inner + m.conv_dim + m.n_heads), ("embed", "mamba_in"), n_in=1),
        conv_w=ParamSpec((m.d_conv, m.conv_dim), (None, "mamba_conv"), scale=0.3),
        conv_b=ParamSpec((m.conv_dim,), ("mamba_conv",), init="zeros"),
        dt_bias=vec(m.n_heads), A_log=vec(m.n_heads), D=vec(m.n_heads, "ones"),
        norm=ParamSpec((m.d_inner,), ("norm",), init="ones"),
        out_proj=ParamSpec((m.d_inner, d), ("mamba_inner", "embed"), n_in=1),
    )


def init_state(cfg: MambaConfig, batch: int, dtype=jnp.float32):
    """(conv_state [B, d_conv-1, conv_dim], ssm_state f32[B, n_heads, head_dim, d_state]):
    the per-row decode state of one Mamba layer, the same size at any sequence length."""
    shapes = cfg.state_shapes(batch)
    return jnp.zeros(shapes["conv"], dtype), jnp.zeros(shapes["ssm"], jnp.float32)


def block(x, p: MixerParams, positions, entry: dense.StateLayer | None, cfg: ModelConfig):
    """The Mamba sublayer of a model: x [B, T, D] -> ([B, T, D], updated state). Rows are
    right-padded (positions < 0 mark padding and inactive rows, which leave the state as it
    was); without a cache entry the scan starts from zeros."""
    lengths = jnp.sum(positions >= 0, axis=1).astype(jnp.int32)
    if entry is None:
        conv, ssm = init_state(cfg.mamba, x.shape[0], x.dtype)
    else:
        conv, ssm = entry.conv, entry.ssm
    y, conv, ssm = mixer(p, x, conv, ssm, lengths, cfg.mamba, cfg.norm_eps)
    return y, (None if entry is None else dense.StateLayer(conv=conv, ssm=ssm))


def mixer(p: MixerParams, x, conv_state, ssm_state, lengths, cfg: MambaConfig, eps: float):
    """x [B, T, D], right-padded (row b has lengths[b] real tokens; 0 leaves a row's state as
    it was) -> (y [B, T, D] in x.dtype, conv_state, ssm_state). T == 1 is the decode step."""
    b, t, _ = x.shape
    zxbcdt = layers.linear(x, p.in_proj)
    z, xbc, dt = jnp.split(zxbcdt, [cfg.d_inner, cfg.d_inner + cfg.conv_dim], axis=-1)
    xbc, conv_state = causal_conv1d(xbc, p.conv_w, p.conv_b, conv_state, lengths)
    xbc = jax.nn.silu(xbc)
    xs, B, C = jnp.split(xbc, [cfg.d_inner, cfg.d_inner + cfg.n_groups * cfg.d_state], axis=-1)
    xs = xs.reshape(b, t, cfg.n_heads, cfg.head_dim)
    B = B.reshape(b, t, cfg.n_groups, cfg.d_state)
    C = C.reshape(b, t, cfg.n_groups, cfg.d_state)
    dt = jax.nn.softplus(dt.astype(jnp.float32) + p.dt_bias.astype(jnp.float32))
    dt = jnp.clip(dt, cfg.dt_min, cfg.dt_max)
    dt = jnp.where(jnp.arange(t)[None, :, None] < lengths[:, None, None], dt, 0.0)
    A = -jnp.exp(p.A_log.astype(jnp.float32))
    if t == 1:
        y, ssm_state = ssd_step(ssm_state, xs[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], p.D)
        y = y[:, None]
    else:
        y, ssm_state = ssd_chunked(xs, dt, A, B, C, p.D, chunk=min(cfg.chunk, t), state=ssm_state)
    y = gated_rms_norm(y.reshape(b, t, cfg.d_inner).astype(x.dtype), z, p.norm, eps,
                       cfg.n_groups)
    return layers.linear(y, p.out_proj), conv_state, ssm_state
