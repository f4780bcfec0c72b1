"""Paged decode attention on the GPU: Pallas on Triton, split-K over the row's pages.

One program per (row, kv head, split): its G query heads (padded to 16 rows for Triton's
dot) against one contiguous share of the row's used pages, `pages_per_block` pages per
loop iteration. An iteration gathers its key/value rows through the page table (slot r
of the block is row `table[page] * page_size + r % page_size` of the kv head's pool), and
loops only over the pages below the row's length: a block that runs past the last used
page reads that page again (already in cache) in place of the table's unused entries,
whose slots are masked. Each split writes an unnormalised partial (output, log-sum-exp);
`common.merge` combines them.
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
    table_ref,  # i32[W]: the row's page table
    q_ref,  # [Gp, H]
    k_ref,  # [P * page_size, H]: the kv head's pool, pages end to end
    v_ref,  # [P * page_size, H]
    # outputs
    o_ref,  # f32[Gp, H]
    lse_ref,  # f32[Gp, 1]
    *, page_size: int, pages_per_block: int, blocks_per_split: int, scale: float,
):
    length = len_ref[pl.program_id(0)]
    used = pl.cdiv(length, page_size)  # pages holding the row's tokens
    first = pl.program_id(2) * blocks_per_split
    n_blocks = jnp.clip(pl.cdiv(used, pages_per_block) - first, 0, blocks_per_split)
    block = page_size * pages_per_block
    slot = jax.lax.broadcasted_iota(jnp.int32, (block,), 0)
    q = q_ref[...]

    def step(i, carry):
        start = (first + i) * block
        logical = jnp.minimum(jax.lax.div(start + slot, page_size), used - 1)  # never an unused page
        rows = table_ref[logical] * page_size + jax.lax.rem(slot, page_size)
        k, v = k_ref[rows, :], v_ref[rows, :]
        return common.softmax_step(carry, q, k, v, (start, start, length), scale)

    rows, h = q_ref.shape
    common.store(o_ref, lse_ref, *jax.lax.fori_loop(0, n_blocks, step, common.gpu_init_carry(rows, h)))


def paged_attention(q, k_pages, v_pages, page_table, lengths, *, scale: float, pages_per_block: int,
                    n_splits: int | None, interpret: bool):
    """q [B, K, G, H] (grouped), k_pages/v_pages [K, P, page_size, H], page_table i32[B, W]
    (ids in [0, P)), lengths i32[B] (in [0, W * page_size])
    -> (out f32[B, K, G, H], lse f32[B, K, G, 1])."""
    b, kh, g, h = q.shape
    _, n_pages, page_size, _ = k_pages.shape
    w = page_table.shape[1]
    rows = common.gpu_group_rows(g)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, rows - g), (0, 0)))
    k_pages = k_pages.reshape(kh, n_pages * page_size, h)  # free: pages are contiguous
    v_pages = v_pages.reshape(kh, n_pages * page_size, h)
    blocks = pl.cdiv(w, pages_per_block)
    splits = common.split_count(b * kh, blocks, n_splits)
    per_split = pl.cdiv(blocks, splits)
    pool = pl.BlockSpec((None,) + k_pages.shape[1:], lambda i, j, p: (j, 0, 0))
    kernel = functools.partial(_kernel, page_size=page_size, pages_per_block=pages_per_block,
                               blocks_per_split=per_split, scale=scale)
    in_specs = [pl.BlockSpec((b,), lambda i, j, p: (0,)),
                pl.BlockSpec((None, w), lambda i, j, p: (i, 0)),
                pl.BlockSpec((None, None, rows, h), lambda i, j, p: (i, j, 0, 0)),
                pool, pool]
    return common.gpu_attention_call(kernel, (lengths, page_table, q, k_pages, v_pages), in_specs,
                                     b=b, kh=kh, g=g, h=h, splits=splits, interpret=interpret,
                                     name="paged_attention_gpu")
