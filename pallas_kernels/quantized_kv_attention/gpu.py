"""Quantised-KV decode attention on the GPU: Pallas on Triton, split-K (flash decoding).

One program per (row, kv head, split), as in `decode_attention.gpu`: its G query heads
(padded to 16 rows for Triton's dot) against the key blocks of one share of the row's
slots, looping only over the blocks below the row's length. Each block loads the int8 or
packed-int4 codes and their scales/offsets (only the compressed bytes leave HBM) and
dequantises them in registers: a 4-bit byte gives the two halves of the head (low and
high nibble), scored as q_lo . k_lo + q_hi . k_hi, with one output accumulator per half;
a per-group scale [S_b, H/g] is broadcast to channels as [S_b, H/g, g] -> [S_b, H].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import common


def _param(ref, fmt, part: int, rows, width: int):
    """The scale or offset of head part `part` for the slots `rows`, as f32 broadcastable
    to [S_b, width]. ref: [S, 1] (token), [S, H/g] (group) or [parts, 1, width] (channel)."""
    if fmt.granularity == "channel":
        return ref[part].astype(jnp.float32)  # [1, width]
    if fmt.granularity == "token":
        return ref[rows, :].astype(jnp.float32)  # [S_b, 1]
    g = fmt.group_size
    per_part = width // g
    p = ref[rows, pl.ds(part * per_part, per_part)].astype(jnp.float32)  # [S_b, width / g]
    n = p.shape[0]
    return jnp.broadcast_to(p[:, :, None], (n, per_part, g)).reshape(n, width)


def _dequantize(refs, fmt, rows):
    """The key or value block of slots `rows` as f32 head parts ([S_b, H] for int8, the
    two halves [S_b, H/2] for int4). refs: codes [S, H | H/2], scale, offset if any."""
    codes = refs[0][rows, :]
    parts = (codes & 0x0F, codes >> 4) if fmt.bits == 4 else (codes,)
    width = codes.shape[1]
    out = []
    for i, c in enumerate(parts):
        x = c.astype(jnp.float32) * _param(refs[1], fmt, i, rows, width)
        out.append(x + _param(refs[2], fmt, i, rows, width) if fmt.has_offset else x)
    return tuple(out)


def _kernel(
    # inputs
    len_ref,  # i32[B]
    q_ref,  # [Pk, Gp, H / Pk]: the query heads split like the key parts
    *refs,  # K: codes [S, H | H/2], scale, offset if any; then V likewise
    # outputs (the last two refs): o_ref f32[Pv, Gp, H / Pv], lse_ref f32[Gp, 1]
    k_fmt, v_fmt, block_k: int, blocks_per_split: int, scale: float,
):
    nk = 2 + k_fmt.has_offset
    k_refs, v_refs, (o_ref, lse_ref) = refs[:nk], refs[nk:-2], refs[-2:]
    length = len_ref[pl.program_id(0)]
    first = pl.program_id(2) * blocks_per_split
    n_blocks = jnp.clip(pl.cdiv(length, block_k) - first, 0, blocks_per_split)
    n_slots = k_refs[0].shape[0]
    qs = tuple(q_ref[i] for i in range(k_fmt.parts))

    def step(i, carry):
        lo = (first + i) * block_k
        start = jnp.minimum(lo, n_slots - block_k)  # the last block stays inside the buffer
        rows = pl.ds(start, block_k)
        ks, vs = _dequantize(k_refs, k_fmt, rows), _dequantize(v_refs, v_fmt, rows)
        return common.step_parts(carry, qs, ks, vs, (start, lo, length), scale)

    _, gp, _ = q_ref.shape
    carry = jax.lax.fori_loop(0, n_blocks, step, common.gpu_init_carry(gp, v_fmt.head_dim, v_fmt.parts))
    common.store(o_ref, lse_ref, *carry)


def _whole_slice(x):
    """The BlockSpec of a (row, kv head)'s whole slice of x [B, K, ...]."""
    return pl.BlockSpec((None, None) + x.shape[2:], lambda i, j, p: (i, j) + (0,) * (x.ndim - 2))


def quantized_kv_attention(q, k_ops, v_ops, lengths, *, k_fmt, v_fmt, scale: float, block_k: int,
                           n_splits: int | None, interpret: bool):
    """q [B, K, Pk, G, H / Pk] (grouped, split into the key parts); k_ops / v_ops: the
    operands of `api.operands` (S >= block_k); lengths i32[B]
    -> (out f32[B, K, G, H], lse f32[B, K, G, 1])."""
    b, kh, pk, g, width_q = q.shape
    s = k_ops[0].shape[2]
    rows = common.gpu_group_rows(g)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, rows - g), (0, 0)))
    blocks = pl.cdiv(s, block_k)
    splits = common.split_count(b * kh, blocks, n_splits)
    per_split = pl.cdiv(blocks, splits)
    kernel = functools.partial(_kernel, k_fmt=k_fmt, v_fmt=v_fmt, block_k=block_k,
                               blocks_per_split=per_split, scale=scale)
    in_specs = ([pl.BlockSpec((b,), lambda i, j, p: (0,)),
                 pl.BlockSpec((None, None, pk, rows, width_q), lambda i, j, p: (i, j, 0, 0, 0))]
                + [_whole_slice(x) for x in k_ops + v_ops])
    return common.gpu_attention_call(kernel, (lengths, q, *k_ops, *v_ops), in_specs, b=b, kh=kh, g=g,
                                     h=v_fmt.head_dim, splits=splits, parts=v_fmt.parts,
                                     interpret=interpret, name="quantized_kv_attention_gpu")
