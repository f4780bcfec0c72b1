"""Decode attention on the TPU: Pallas on Mosaic, one grid step per key block.

Grid (row, kv head, key block), the last axis a reduction carried in VMEM scratch (the
running max, sum and output of the online softmax). The row lengths are prefetched into
SMEM and steer the key/value index maps: every block past a row's length maps to its last
visible block, which the pipeline does not fetch again, and its compute is skipped, so
the HBM traffic is the visible slots only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import common


def _kernel(
    # scalar prefetch
    len_ref,  # i32[B] (SMEM)
    # inputs
    q_ref,  # [G, H]
    k_ref,  # [block_k, H]
    v_ref,  # [block_k, H], or [H, block_k] when v_hs
    # outputs
    o_ref,  # f32[G, H]
    lse_ref,  # f32[G, 1]
    # scratch
    m_ref, l_ref, acc_ref,  # f32[G, 1], f32[G, 1], f32[G, H]
    *, block_k: int, scale: float, v_hs: bool,
):
    j = pl.program_id(2)
    length = len_ref[pl.program_id(0)]

    def step(carry):
        start = j * block_k
        return common.softmax_step(carry, q_ref[...], k_ref[...], v_ref[...],
                                   (start, start, length), scale, v_hs)

    common.tpu_reduction(j, pl.num_programs(2) - 1, j * block_k < length,
                         (o_ref, lse_ref, m_ref, l_ref, acc_ref), step)


def last_block(lengths_ref, row, block: int):
    """The last block row `row` has to read (0 for an empty row)."""
    return jnp.maximum(pl.cdiv(lengths_ref[row], block) - 1, 0)


def decode_attention(q, k, v, lengths, *, scale: float, block_k: int, v_hs: bool, interpret: bool):
    """q [B, K, G, H], k [B, K, S, H], v [B, K, S|H, H|S], lengths i32[B]
    -> (out f32[B, K, G, H], lse f32[B, K, G, 1])."""
    b, kh, g, h = q.shape
    s = k.shape[2]

    def kv_map(i, j, n, lens):
        return (i, j, jnp.minimum(n, last_block(lens, i, block_k)), 0)

    def v_map(i, j, n, lens):
        return (i, j, 0, jnp.minimum(n, last_block(lens, i, block_k))) if v_hs else kv_map(i, j, n, lens)

    fixed = lambda i, j, n, lens: (i, j, 0, 0)
    v_block = (None, None, h, block_k) if v_hs else (None, None, block_k, h)
    in_specs = [pl.BlockSpec((None, None, g, h), fixed),
                pl.BlockSpec((None, None, block_k, h), kv_map),
                pl.BlockSpec(v_block, v_map)]
    kernel = functools.partial(_kernel, block_k=block_k, scale=scale, v_hs=v_hs)
    return common.tpu_attention_call(kernel, (lengths, q, k, v), in_specs,
                                     grid=(b, kh, pl.cdiv(s, block_k)), n_prefetch=1, g=g, h=h,
                                     interpret=interpret, name="decode_attention_tpu")
