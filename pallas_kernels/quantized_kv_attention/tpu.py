"""Quantised-KV decode attention on the TPU: Pallas on Mosaic, one grid step per key block.

Grid (row, kv head, key block) as in `decode_attention.tpu`: the last axis a reduction
carried in VMEM scratch, the prefetched row lengths steering the index maps so that the
blocks past a row's length are neither fetched nor computed. The pipeline moves only the
int8 or packed-int4 codes and their scales/offsets; each block is dequantised in VMEM: a
4-bit byte gives the two halves of the head (low and high nibble), scored as
q_lo . k_lo + q_hi . k_hi with one accumulator per half (no lane concatenation), and a
per-group scale [S_b, H/g] becomes per-channel through a dot with a 0/1 expansion matrix
built from iotas (no lane reshape).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import common


def _expand(p, g: int, first: int, width: int):
    """p [S_b, H/g] (one value per group of g channels) -> f32[S_b, width]: channels
    first .. first + width - 1, by a dot with the 0/1 matrix E[j, c] = (c in group j)."""
    chan = first + jax.lax.broadcasted_iota(jnp.int32, (p.shape[1], width), 1)
    group = jax.lax.broadcasted_iota(jnp.int32, (p.shape[1], width), 0)
    e = ((chan >= group * g) & (chan < (group + 1) * g)).astype(p.dtype)
    exact = jax.lax.Precision.HIGHEST if p.dtype == jnp.float32 else None  # 0/1 x bf16 is exact
    return jax.lax.dot_general(p, e, (((1,), (0,)), ((), ())), precision=exact,
                               preferred_element_type=jnp.float32)


def _param(ref, fmt, part: int, width: int):
    """The scale or offset of head part `part`, as f32 broadcastable to [S_b, width].
    ref: [S_b, 1] (token), [S_b, H/g] (group) or [parts, 1, width] (channel)."""
    if fmt.granularity == "channel":
        return ref[part].astype(jnp.float32)  # [1, width]
    if fmt.granularity == "token":
        return ref[...].astype(jnp.float32)  # [S_b, 1]
    return _expand(ref[...], fmt.group_size, part * width, width)


def _dequantize(refs, fmt):
    """The block as f32 head parts ([S_b, H] for int8, the two halves [S_b, H/2] for
    int4). refs: codes [S_b, H | H/2], scale, offset if any."""
    codes = refs[0][...]
    if fmt.bits == 4:
        codes = codes.astype(jnp.int32)
        parts = (codes & 0x0F, codes >> 4)
    else:
        parts = (codes,)
    width = codes.shape[1]
    out = []
    for i, c in enumerate(parts):
        x = c.astype(jnp.float32) * _param(refs[1], fmt, i, width)
        out.append(x + _param(refs[2], fmt, i, width) if fmt.has_offset else x)
    return tuple(out)


def _kernel(
    # scalar prefetch
    len_ref,  # i32[B] (SMEM)
    # inputs
    q_ref,  # [Pk, G, H / Pk]: the query heads split like the key parts
    *refs,  # K: codes [block_k, H | H/2], scale, offset if any; then V likewise;
    # outputs: o_ref f32[Pv, G, H / Pv], lse_ref f32[G, 1];
    # scratch: m_ref, l_ref f32[G, 1], acc_ref f32[Pv, G, H / Pv]
    k_fmt, v_fmt, block_k: int, scale: float,
):
    nk = 2 + k_fmt.has_offset
    k_refs, v_refs = refs[:nk], refs[nk:-5]
    o_ref, lse_ref, m_ref, l_ref, acc_ref = refs[-5:]
    j = pl.program_id(2)
    length = len_ref[pl.program_id(0)]

    def step(carry):
        start = j * block_k
        qs = tuple(q_ref[i] for i in range(k_fmt.parts))
        return common.step_parts(carry, qs, _dequantize(k_refs, k_fmt),
                                         _dequantize(v_refs, v_fmt), (start, start, length), scale)

    common.tpu_reduction(j, pl.num_programs(2) - 1, j * block_k < length,
                         (o_ref, lse_ref, m_ref, l_ref, acc_ref), step)


def last_block(lengths_ref, row, block: int):
    """The last block row `row` has to read (0 for an empty row)."""
    return jnp.maximum(pl.cdiv(lengths_ref[row], block) - 1, 0)


def _specs(ops, fmt, block_k: int):
    """BlockSpecs of one tensor's operands: key block n of codes and per-slot parameters
    (clamped to the row's last visible block), the whole [parts, 1, H / parts] channel ones."""
    def block(i, j, n, lens):
        return (i, j, jnp.minimum(n, last_block(lens, i, block_k)), 0)

    codes = pl.BlockSpec((None, None, block_k, ops[0].shape[3]), block)
    if fmt.granularity == "channel":
        param = pl.BlockSpec((None, None) + ops[1].shape[2:], lambda i, j, n, lens: (i, j, 0, 0, 0))
    else:
        param = pl.BlockSpec((None, None, block_k, ops[1].shape[3]), block)
    return [codes] + [param] * (len(ops) - 1)


def quantized_kv_attention(q, k_ops, v_ops, lengths, *, k_fmt, v_fmt, scale: float,
                           block_k: int, interpret: bool):
    """q [B, K, Pk, G, H / Pk] (grouped, split into the key parts); k_ops / v_ops: the
    operands of `api.operands`; lengths i32[B] -> (out f32[B, K, G, H], lse f32[B, K, G, 1])."""
    b, kh, pk, g, width_q = q.shape
    s = k_ops[0].shape[2]
    fixed = lambda i, j, n, lens: (i, j, 0, 0, 0)
    in_specs = ([pl.BlockSpec((None, None, pk, g, width_q), fixed)]
                + _specs(k_ops, k_fmt, block_k) + _specs(v_ops, v_fmt, block_k))
    kernel = functools.partial(_kernel, k_fmt=k_fmt, v_fmt=v_fmt, block_k=block_k, scale=scale)
    return common.tpu_attention_call(kernel, (lengths, q, *k_ops, *v_ops), in_specs,
                                     grid=(b, kh, pl.cdiv(s, block_k)), n_prefetch=1, g=g,
                                     h=v_fmt.head_dim, parts=v_fmt.parts, interpret=interpret,
                                     name="quantized_kv_attention_tpu")
