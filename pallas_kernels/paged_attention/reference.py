"""The numerical truth of paged decode attention, in plain jnp at float32 / highest precision.

q: [B, N, H]; k_pages, v_pages: [K, P, page_size, H] (a pool of P pages); page_table:
i32[B, W] (row b's logical page j is pool page page_table[b, j], ids in [0, P));
lengths: i32[B], row b sees its tokens [0, lengths[b]), token t at offset t % page_size of
page page_table[b, t // page_size]. Returns (out f32[B, N, H], lse f32[B, N]); a row of
length 0 gives 0, -inf.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.decode_attention.reference import attend


def gather_rows(pages, page_table):
    """[K, P, page_size, H] pages, i32[B, W] table -> the rows' dense [B, K, W * page_size, H]."""
    kh, _, ps, h = pages.shape
    b, w = page_table.shape
    return jnp.moveaxis(pages[:, page_table], 0, 1).reshape(b, kh, w * ps, h)


def paged_attention(q, k_pages, v_pages, page_table, lengths, *, scale: float):
    k, v = gather_rows(k_pages, page_table), gather_rows(v_pages, page_table)
    b, kh, s, _ = k.shape
    visible = jnp.broadcast_to(jnp.arange(s)[None, None, :] < lengths[:, None, None], (b, kh, s))
    v = jnp.where(visible[..., None], v, 0)  # unused pages may hold anything, non-finite too
    return attend(q, k, v, visible, scale)
