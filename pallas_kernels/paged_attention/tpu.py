"""Paged decode attention on the TPU: Pallas on Mosaic, one grid step per block of pages.

Grid (row, kv head, page block), the last axis a reduction carried in VMEM scratch (the
running max, sum and output of the online softmax). A block of `pages_per_block` pages
comes in as that many key inputs and as many value inputs (the same pool passed again,
each with its own index map), one [page_size, H] page each, so the pipeline fetches a
block's pages together and no page is ever stitched to another in VMEM. The row lengths and
the page table are prefetched into SMEM and steer the index maps:
- page t of block n is the row's logical page n * pages_per_block + t, fetched from pool
  page table[row, that];
- a logical page past the row's last used page keeps the block index it had one block
  earlier (or, in the first block, takes the last used page), and every block past the
  last used one repeats that block's indices: the pipeline fetches nothing new, so the
  unused table entries are never followed, and the compute of those pages is skipped.
An empty row still fetches one page per input (its first table entry, whatever it
holds; clamped into the pool), as every grid step has its blocks; nothing of it is used.
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
    table_ref,  # i32[B * W] (SMEM): the page table, rows end to end
    # inputs
    q_ref,  # [G, H]
    *refs,  # k pages [page_size, H] x pages_per_block, then v pages [page_size, H] x same;
    # outputs: o f32[G, H], lse f32[G, 1]; scratch: m, l f32[G, 1], acc f32[G, H]
    page_size: int, pages_per_block: int, scale: float,
):
    k_refs, v_refs = refs[:pages_per_block], refs[pages_per_block:2 * pages_per_block]
    o_ref, lse_ref, m_ref, l_ref, acc_ref = refs[2 * pages_per_block:]
    n = pl.program_id(2)
    length = len_ref[pl.program_id(0)]
    first = n * pages_per_block * page_size

    def step(carry):  # pages past the length see nothing: no-ops of the online softmax
        for t in range(pages_per_block):
            start = first + t * page_size
            carry = common.softmax_step(carry, q_ref[...], k_refs[t][...], v_refs[t][...],
                                        (start, start, length), scale)
        return carry

    common.tpu_reduction(n, pl.num_programs(2) - 1, first < length,
                         (o_ref, lse_ref, m_ref, l_ref, acc_ref), step)


def logical_page(lens_ref, row, n, t: int, page_size: int, pages_per_block: int):
    """The logical page that input t reads at block n (see the module docstring)."""
    last = jnp.maximum(pl.cdiv(lens_ref[row], page_size) - 1, 0)
    block = jnp.minimum(n, jax.lax.div(last, pages_per_block))  # last >= 0: no floor needed
    page = block * pages_per_block + t
    earlier = jnp.where(block > 0, page - pages_per_block, last)
    return jnp.where(page > last, earlier, page)


def paged_attention(q, k_pages, v_pages, page_table, lengths, *, scale: float, pages_per_block: int,
                    interpret: bool):
    """q [B, K, G, H], k_pages/v_pages [K, P, page_size, H], page_table i32[B, W] (ids in
    [0, P)), lengths i32[B] (in [0, W * page_size]) -> (out f32[B, K, G, H], lse f32[B, K, G, 1])."""
    b, kh, g, h = q.shape
    page_size = k_pages.shape[2]
    w = page_table.shape[1]

    def page_spec(t: int):
        def index(i, j, n, lens, table):
            return (j, table[i * w + logical_page(lens, i, n, t, page_size, pages_per_block)], 0, 0)
        return pl.BlockSpec((None, None, page_size, h), index)

    fixed = lambda i, j, n, lens, table: (i, j, 0, 0)
    pages = [page_spec(t) for t in range(pages_per_block)]
    kernel = functools.partial(_kernel, page_size=page_size, pages_per_block=pages_per_block,
                               scale=scale)
    args = (lengths, page_table.reshape(-1), q, *[k_pages] * pages_per_block,
            *[v_pages] * pages_per_block)
    return common.tpu_attention_call(kernel, args, [pl.BlockSpec((None, None, g, h), fixed)] + pages + pages,
                                     grid=(b, kh, pl.cdiv(w, pages_per_block)), n_prefetch=2,
                                     g=g, h=h, interpret=interpret, name="paged_attention_tpu")
