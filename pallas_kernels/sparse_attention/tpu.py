"""Block-sparse decode attention on the TPU: Pallas on Mosaic, one grid step per kept-list
entry.

Grid (row, kv head, list entry), the last axis a reduction carried in VMEM scratch (the
running max, sum and output of the online softmax). The row lengths and the kept lists
(flattened) are prefetched into SMEM and steer the key/value index maps: step n of
(row, kv head) fetches block kept[row, head, n]; the steps past n_kept map to the last
kept block, which the pipeline does not fetch again, and their compute is skipped, so the
HBM traffic is the kept blocks only. The kept lists live in SMEM whole: B * K * M int32s
must fit there (a few hundred KiB at most).
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
    n_kept_ref,  # i32[B * K] (SMEM)
    kept_ref,  # i32[B * K * M] (SMEM), ids in range
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
    row, head, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    pair = row * pl.num_programs(1) + head

    def step(carry):
        start = kept_ref[pair * pl.num_programs(2) + n] * block_k
        return common.softmax_step(carry, q_ref[...], k_ref[...], v_ref[...],
                                   (start, start, len_ref[row]), scale, v_hs)

    common.tpu_reduction(n, pl.num_programs(2) - 1, n < n_kept_ref[pair],
                         (o_ref, lse_ref, m_ref, l_ref, acc_ref), step)


def kept_block(i, j, n, n_kept_ref, kept_ref, heads: int, entries: int):
    """The block step n of (row i, kv head j) reads: its n-th kept block, or past the list
    the last one (entry 0 of an empty list), which is already in VMEM."""
    pair = i * heads + j
    return kept_ref[pair * entries + jnp.clip(n, 0, jnp.maximum(n_kept_ref[pair] - 1, 0))]


def block_sparse_attention(q, k, v, lengths, kept, n_kept, *, scale: float, block_k: int,
                           v_hs: bool, interpret: bool):
    """q [B, K, G, H], k [B, K, S, H], v [B, K, S|H, H|S], lengths i32[B], kept
    i32[B, K, M] (ids in range), n_kept i32[B, K] (in [0, M])
    -> (out f32[B, K, G, H], lse f32[B, K, G, 1])."""
    b, kh, g, h = q.shape
    m = kept.shape[2]
    block = functools.partial(kept_block, heads=kh, entries=m)

    def k_map(i, j, n, lens, n_kept_ref, kept_ref):
        return (i, j, block(i, j, n, n_kept_ref, kept_ref), 0)

    def v_map(i, j, n, lens, n_kept_ref, kept_ref):
        return (i, j, 0, block(i, j, n, n_kept_ref, kept_ref)) if v_hs else k_map(
            i, j, n, lens, n_kept_ref, kept_ref)

    fixed = lambda i, j, n, *refs: (i, j, 0, 0)
    v_block = (None, None, h, block_k) if v_hs else (None, None, block_k, h)
    in_specs = [pl.BlockSpec((None, None, g, h), fixed),
                pl.BlockSpec((None, None, block_k, h), k_map),
                pl.BlockSpec(v_block, v_map)]
    kernel = functools.partial(_kernel, block_k=block_k, scale=scale, v_hs=v_hs)
    return common.tpu_attention_call(kernel, (lengths, n_kept.reshape(-1), kept.reshape(-1), q, k, v),
                                     in_specs, grid=(b, kh, m), n_prefetch=3, g=g, h=h,
                                     interpret=interpret, name="block_sparse_attention_tpu")
