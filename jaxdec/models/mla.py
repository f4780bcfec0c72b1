"""Multi-head latent attention (DeepSeek-V2/V3) as pure functions.

Each token's keys and values are stored as one latent c = RMSNorm(x @ W_DKV) of
`kv_lora_rank` values plus one RoPE key k_r of `qk_rope_head_dim` values shared by every head:
that pair is all an MLA cache holds per token. Per head h, with W_UK[h] and W_UV[h] the slices
of the up-projection `kv_b`:

    score(h, s) = scale * (q_nope[h] . (c_s @ W_UK[h]) + q_rope[h] . k_r,s)
    out[h]      = sum_s p(h, s) (c_s @ W_UV[h])

`attend(..., absorbed=False)` computes it like that ("expanded": keys and values per head,
for prefill); `absorbed=True` folds W_UK[h] into the query and W_UV[h] into the output, so
the softmax runs against the latents themselves (decode: nothing per head is materialised
for the cache). Both are the same function up to rounding.

RoPE uses YaRN scaling as DeepSeek configs set it (`yarn`), on interleaved rotary pairs when
`rope_interleave` (DeepSeek's checkpoints).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxdec import layers


@dataclasses.dataclass(frozen=True)
class Yarn:
    """YaRN RoPE scaling (HF rope_parameters with rope_type "yarn")."""

    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, theta: float, y: Yarn) -> tuple[np.ndarray, float]:
    """(f32[dim/2] inverse frequencies, the factor on cos/sin): dimensions that turn more
    than beta_fast times over the original context keep their frequency, those under
    beta_slow are interpolated by `factor`, a linear ramp in between."""
    pos = np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extrapolate, interpolate = 1.0 / pos, 1.0 / (np.float32(y.factor) * pos)

    def corr_dim(rotations):
        return dim * math.log(y.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = corr_dim(y.beta_fast), corr_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    inv_freq = (interpolate * (1 - keep) + extrapolate * keep).astype(np.float32)
    if y.mscale and y.mscale_all_dim:
        attn = _yarn_mscale(y.factor, y.mscale) / _yarn_mscale(y.factor, y.mscale_all_dim)
    else:
        attn = _yarn_mscale(y.factor)
    return inv_freq, float(attn)


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    d_model: int
    n_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_interleave: bool = True
    yarn: Yarn | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        """Softmax scale: qk_head_dim^-1/2, times mscale(factor, mscale_all_dim)^2 under YaRN."""
        s = self.qk_head_dim ** -0.5
        if self.yarn is not None and self.yarn.mscale_all_dim:
            s *= _yarn_mscale(self.yarn.factor, self.yarn.mscale_all_dim) ** 2
        return s

    def rope_tables(self) -> tuple[np.ndarray, float]:
        if self.yarn is None:
            return layers.rope_inv_freq(self.qk_rope_head_dim, self.rope_theta, None), 1.0
        return yarn_inv_freq(self.qk_rope_head_dim, self.rope_theta, self.yarn)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MLAParams:
    q: jax.Array | None  # [D, N, qk_head_dim] (no query LoRA)
    q_a: jax.Array | None  # [D, q_lora_rank]
    q_a_norm: jax.Array | None  # [q_lora_rank]
    q_b: jax.Array | None  # [q_lora_rank, N, qk_head_dim]
    kv_a: jax.Array  # [D, kv_lora_rank + qk_rope_head_dim]
    kv_a_norm: jax.Array  # [kv_lora_rank]
    kv_b: jax.Array  # [kv_lora_rank, N, qk_nope_head_dim + v_head_dim]
    o: jax.Array  # [N, v_head_dim, D]


def _rope(x, positions, cfg: MLAConfig):
    """x [B, T, n, r]: interleaved pairs are laid out as halves first (the same permutation for
    queries and keys, so scores are unchanged), then rotate-half RoPE, times YaRN's factor."""
    if cfg.rope_interleave:
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    inv_freq, attn_factor = cfg.rope_tables()
    out = layers.rope(x, jnp.maximum(positions, 0), inv_freq)
    return out * jnp.asarray(attn_factor, out.dtype) if attn_factor != 1.0 else out


def queries(p: MLAParams, x, positions, cfg: MLAConfig):
    """x [B, T, D] -> (q_nope [B, T, N, nope], q_rope [B, T, N, rope], roped)."""
    if p.q is not None:
        q = layers.linear(x, p.q)
    else:
        q = layers.linear(layers.rms_norm(layers.linear(x, p.q_a), p.q_a_norm, cfg.eps), p.q_b)
    q_nope, q_rope = jnp.split(q, [cfg.qk_nope_head_dim], axis=-1)
    return q_nope, _rope(q_rope, positions, cfg)


def latents(p: MLAParams, x, positions, cfg: MLAConfig):
    """What the cache stores per token: (c [B, T, kv_lora_rank], k_rope [B, T, rope])."""
    ckv = layers.linear(x, p.kv_a)
    c, k_rope = jnp.split(ckv, [cfg.kv_lora_rank], axis=-1)
    c = layers.rms_norm(c, p.kv_a_norm, cfg.eps)
    return c, _rope(k_rope[:, :, None, :], positions, cfg)[:, :, 0, :]


def attend(p: MLAParams, q_nope, q_rope, c, k_rope, mask, cfg: MLAConfig, *, absorbed: bool):
    """Attention of the queries over latents c [B, S, R], k_rope [B, S, rope] with
    mask bool[B, T, S] -> [B, T, D] (after the output projection)."""
    w_uk, w_uv = jnp.split(p.kv_b, [cfg.qk_nope_head_dim], axis=-1)  # [R, N, nope], [R, N, v]
    f32 = jnp.float32
    rope_scores = jnp.einsum("btnr,bsr->bnts", q_rope, k_rope, preferred_element_type=f32)
    if absorbed:
        q_lat = jnp.einsum("btnk,rnk->btnr", q_nope, w_uk, preferred_element_type=f32)
        scores = jnp.einsum("btnr,bsr->bnts", q_lat.astype(c.dtype), c, preferred_element_type=f32)
    else:
        k_nope = jnp.einsum("bsr,rnk->bsnk", c, w_uk)
        scores = jnp.einsum("btnk,bsnk->bnts", q_nope, k_nope, preferred_element_type=f32)
    scores = jnp.where(mask[:, None], (scores + rope_scores) * cfg.scale, layers.NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1)
    if absorbed:
        out_lat = jnp.einsum("bnts,bsr->btnr", probs.astype(c.dtype), c, preferred_element_type=f32)
        out = jnp.einsum("btnr,rnv->btnv", out_lat.astype(c.dtype), w_uv, preferred_element_type=f32)
    else:
        v = jnp.einsum("bsr,rnv->bsnv", c, w_uv)
        out = jnp.einsum("bnts,bsnv->btnv", probs.astype(v.dtype), v, preferred_element_type=f32)
    return layers.linear(out.astype(q_nope.dtype), p.o, n_in=2)
