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

RoPE uses the model's scaling (YaRN in DeepSeek's configs), on interleaved rotary pairs when
`cfg.mla.rope_interleave` (DeepSeek's checkpoints).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxdec import layers
from jaxdec.cache import entry
from jaxdec.config import ModelConfig, yarn_mscale
from jaxdec.pytree import ParamSpec

# Query chunks up to this long attend in the absorbed form (decode, speculative verification).
MAX_ABSORBED_T = 16


def softmax_scale(cfg: ModelConfig) -> float:
    """qk_head_dim^-1/2, times mscale(factor, mscale_all_dim)^2 under YaRN (as DeepSeek)."""
    s = cfg.mla.qk_head_dim ** -0.5
    y = cfg.rope_scaling
    if y is not None and y.kind == "yarn" and y.mscale_all_dim:
        s *= yarn_mscale(y.factor, y.mscale_all_dim) ** 2
    return s


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


def _rope(x, positions, cfg: ModelConfig):
    """x [B, T, n, r]: interleaved pairs are laid out as halves first (the same permutation for
    queries and keys, so scores are unchanged), then rotate-half RoPE, times YaRN's factor."""
    if cfg.mla.rope_interleave:
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    inv_freq = layers.rope_inv_freq(cfg.mla.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
    factor = cfg.rope_scaling.attention_factor if cfg.rope_scaling else 1.0
    return layers.rope(x, jnp.maximum(positions, 0), inv_freq, factor)


def queries(p: MLAParams, x, positions, cfg: ModelConfig):
    """x [B, T, D] -> (q_nope [B, T, N, nope], q_rope [B, T, N, rope], roped)."""
    if p.q is not None:
        q = layers.linear(x, p.q)
    else:
        q = layers.linear(layers.rms_norm(layers.linear(x, p.q_a), p.q_a_norm, cfg.norm_eps), p.q_b)
    q_nope, q_rope = jnp.split(q, [cfg.mla.qk_nope_head_dim], axis=-1)
    return q_nope, _rope(q_rope, positions, cfg)


def latents(p: MLAParams, x, positions, cfg: ModelConfig):
    """What the cache stores per token: (c [B, T, kv_lora_rank], k_rope [B, T, rope])."""
    ckv = layers.linear(x, p.kv_a)
    c, k_rope = jnp.split(ckv, [cfg.mla.kv_lora_rank], axis=-1)
    c = layers.rms_norm(c, p.kv_a_norm, cfg.norm_eps)
    return c, _rope(k_rope[:, :, None, :], positions, cfg)[:, :, 0, :]


def attend(p: MLAParams, q_nope, q_rope, blocks, cfg: ModelConfig, *, absorbed: bool):
    """Attention of the queries over one or more blocks of latents sharing one softmax ->
    [B, T, D] (after the output projection). Each block is (c [B, S_i, R], k_rope [B, S_i,
    rope], mask bool[B, T, S_i]): decoding passes the cache as it was and the chunk's own
    latents, so the cache is read where it lies and only the loop carry updates it."""
    # [R, N, nope], [R, N, v]: the per-head products contract kv_b's output axes, which no
    # quantised matmul does, so a quantised kv_b is used at its dequantised values
    kv_b = layers.weight_value(p.kv_b)
    w_uk, w_uv = jnp.split(kv_b, [cfg.mla.qk_nope_head_dim], axis=-1)
    f32 = jnp.float32
    # products accumulate in float32 from float32 operands: a bf16 x bf16 -> f32 batched dot
    # has no XLA:CPU thunk (the absorbed decode step failed on bf16 weights), and widening
    # bf16 is exact, so the sums are the same
    mm = lambda spec, a, b: jnp.einsum(spec, a.astype(f32), b.astype(f32))
    if absorbed:
        q_lat = mm("btnk,rnk->btnr", q_nope, w_uk)

    def block_scores(c, k_rope, mask):
        s = mm("btnr,bsr->bnts", q_rope, k_rope)
        if absorbed:
            s += mm("btnr,bsr->bnts", q_lat.astype(c.dtype), c)
        else:
            s += mm("btnk,bsnk->bnts", q_nope, jnp.einsum("bsr,rnk->bsnk", c, w_uk).astype(c.dtype))
        return jnp.where(mask[:, None], s * softmax_scale(cfg), layers.NEG_INF)

    probs = layers.block_softmax([block_scores(*blk) for blk in blocks])
    out = 0.0
    for pb, (c, _, _) in zip(probs, blocks):
        if absorbed:
            out_lat = mm("bnts,bsr->btnr", pb.astype(c.dtype), c)
            out += mm("btnr,rnv->btnv", out_lat.astype(c.dtype), w_uv)
        else:
            v = jnp.einsum("bsr,rnv->bsnv", c, w_uv).astype(c.dtype)
            out += mm("bnts,bsnv->btnv", pb.astype(v.dtype), v)
    return layers.linear(out.astype(q_nope.dtype), p.o, n_in=2)


def declare(cfg: ModelConfig) -> MLAParams:
    m, d, n = cfg.mla, cfg.d_model, cfg.n_heads
    full_q = m.q_lora_rank is None
    return MLAParams(
        q=ParamSpec((d, n, m.qk_head_dim), ("embed", "q_heads", "head_dim"), n_in=1) if full_q else None,
        q_a=None if full_q else ParamSpec((d, m.q_lora_rank), ("embed", "q_lora"), n_in=1),
        q_a_norm=None if full_q else ParamSpec((m.q_lora_rank,), ("norm",), init="ones"),
        q_b=None if full_q else ParamSpec((m.q_lora_rank, n, m.qk_head_dim),
                                          ("q_lora", "q_heads", "head_dim"), n_in=1),
        kv_a=ParamSpec((d, m.kv_lora_rank + m.qk_rope_head_dim), ("embed", "kv_lora"), n_in=1),
        kv_a_norm=ParamSpec((m.kv_lora_rank,), ("norm",), init="ones"),
        kv_b=ParamSpec((m.kv_lora_rank, n, m.qk_nope_head_dim + m.v_head_dim),
                       ("kv_lora", "q_heads", "head_dim"), n_in=1),
        o=ParamSpec((n, m.v_head_dim, d), ("q_heads", "head_dim", "embed"), n_in=2),
    )


def block(x, p: MLAParams, positions, kv: entry.LatentLayer | None, past, cfg: ModelConfig,
          tree=None):
    """The attention sublayer of an MLA model: x [B, T, D] -> ([B, T, D], updated cache
    entry). Queries see the cached latents by their positions (or as `past`, bool[B, T,
    S + 1], marks them) and the chunk's own, causally. Short chunks (decode, verification) run absorbed, so the cache is read
    as latents; long ones (prefill) expand keys and values per head."""
    q_nope, q_rope = queries(p, x, positions, cfg)
    c, k_rope = latents(p, x, positions, cfg)
    mask, slots = (entry.chunk_mask(positions), positions) if tree is None else tree
    absorbed = x.shape[1] <= MAX_ABSORBED_T
    chunk = (c, k_rope, mask)
    if kv is None:
        return attend(p, q_nope, q_rope, [chunk], cfg, absorbed=absorbed), None
    past = kv.before(positions) if past is None else past
    out = attend(p, q_nope, q_rope, [(kv.c, kv.k_rope, past), chunk], cfg, absorbed=absorbed)
    return out, kv.write(c, k_rope, slots, positions)
