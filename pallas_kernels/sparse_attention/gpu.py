"""Block-sparse decode attention on the GPU: Pallas on Triton, split-K over the kept list.

One program per (row, kv head, split): its G query heads (padded to 16 rows for Triton's
dot) against one contiguous share of the (row, kv head)'s kept list, looping over the
listed block ids only and loading each block with `pl.ds`: unlisted blocks and list
entries past `n_kept` are never read. Each split writes an unnormalised partial (output,
log-sum-exp); `common.merge` combines them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import common


def _kernel(
    # inputs
    len_ref,  # i32[B]
    n_kept_ref,  # i32[B, K]
    kept_ref,  # i32[M]: this (row, kv head)'s block ids, in range
    q_ref,  # [Gp, H]
    k_ref,  # [S, H]
    v_ref,  # [S, H], or [H, S] when v_hs
    # outputs
    o_ref,  # f32[Gp, H]
    lse_ref,  # f32[Gp, 1]
    *, block_k: int, entries_per_split: int, scale: float, v_hs: bool,
):
    row, head = pl.program_id(0), pl.program_id(1)
    length = len_ref[row]
    first = pl.program_id(2) * entries_per_split
    n_entries = jnp.clip(n_kept_ref[row, head] - first, 0, entries_per_split)
    n_slots = k_ref.shape[0]
    q = q_ref[...]

    def step(i, carry):
        lo = kept_ref[first + i] * block_k
        start = jnp.minimum(lo, n_slots - block_k)  # the last block stays inside the buffer
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[:, pl.ds(start, block_k)] if v_hs else v_ref[pl.ds(start, block_k), :]
        return common.softmax_step(carry, q, k, v, (start, lo, length), scale, v_hs)

    rows, h = q_ref.shape
    common.store(o_ref, lse_ref, *jax.lax.fori_loop(0, n_entries, step, common.gpu_init_carry(rows, h)))


def block_sparse_attention(q, k, v, lengths, kept, n_kept, *, scale: float, block_k: int,
                           n_splits: int | None, v_hs: bool, interpret: bool):
    """q [B, K, G, H] (grouped), k [B, K, S, H], v [B, K, S|H, H|S] (S >= block_k),
    lengths i32[B], kept i32[B, K, M] (ids in range), n_kept i32[B, K] (in [0, M])
    -> (out f32[B, K, G, H], lse f32[B, K, G, 1])."""
    b, kh, g, h = q.shape
    m = kept.shape[2]
    rows = common.gpu_group_rows(g)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, rows - g), (0, 0)))
    splits = common.split_count(b * kh, m, n_splits)
    per_split = pl.cdiv(m, splits)
    row = lambda i, j, p: (i, j, 0, 0)
    kernel = functools.partial(_kernel, block_k=block_k, entries_per_split=per_split, scale=scale,
                               v_hs=v_hs)
    in_specs = [pl.BlockSpec((b,), lambda i, j, p: (0,)),
                pl.BlockSpec((b, kh), lambda i, j, p: (0, 0)),
                pl.BlockSpec((None, None, m), lambda i, j, p: (i, j, 0)),
                pl.BlockSpec((None, None, rows, h), row),
                pl.BlockSpec((None, None) + k.shape[2:], row),
                pl.BlockSpec((None, None) + v.shape[2:], row)]
    return common.gpu_attention_call(kernel, (lengths, n_kept, kept, q, k, v), in_specs, b=b, kh=kh,
                                     g=g, h=h, splits=splits, interpret=interpret,
                                     name="block_sparse_attention_gpu")
