"""The paged KV cache entry: keys and values in fixed-size pages of a shared pool, found
through a per-row page table (vLLM's PagedAttention layout, and what the Pallas
`paged_attention` kernel reads).

Token t of row b lives in pool page `page_table[b, t // page_size]` at offset
`t % page_size`. The pool holds one extra page at its end, the scratch page, which no
table names: padding and tokens past the capacity are written there (as the dense cache's
scratch slot), so every scatter index is in bounds. Which pool pages a row owns is the
allocator's business (the continuous-batching engine's); `init` gives each row its
pages up front in a shuffled order, so the indirection is exercised from the first token.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxdec.errors import JaxdecError

PAGE_SIZE = 32


@partial(jax.tree_util.register_dataclass, data_fields=["k_pages", "v_pages", "page_table"],
         meta_fields=[])
@dataclasses.dataclass(frozen=True)
class PagedKVLayer:
    k_pages: jax.Array  # [K, P + 1, page_size, H]: P pool pages, then the scratch page
    v_pages: jax.Array  # [K, P + 1, page_size, H]
    page_table: jax.Array  # i32[B, pages_per_row]: pool page of each row's logical page

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[2]

    @property
    def capacity(self) -> int:
        return self.page_table.shape[1] * self.page_size

    @property
    def scratch_page(self) -> int:
        return self.k_pages.shape[1] - 1


def shapes(batch: int, k_heads: int, head_dim: int, max_len: int, dtype, page_size: int):
    """{field: (shape, dtype)} of a layer whose rows hold up to `max_len` tokens."""
    if page_size <= 0:
        raise JaxdecError(f"page size must be positive, got {page_size}")
    per_row = -(-max_len // page_size)
    pool = (k_heads, batch * per_row + 1, page_size, head_dim)
    return {"k_pages": (pool, dtype), "v_pages": (pool, dtype),
            "page_table": ((batch, per_row), np.int32)}


def page_table(batch: int, per_row: int, seed: int = 0) -> np.ndarray:
    """i32[batch, per_row]: every row's pages, a shuffled partition of the pool."""
    pages = np.random.default_rng(seed).permutation(batch * per_row).astype(np.int32)
    return pages.reshape(batch, per_row)


def write(layer: PagedKVLayer, k: jax.Array, v: jax.Array, positions: jax.Array) -> PagedKVLayer:
    """Scatter new keys/values [B, T, K, H] at `positions` (i32[B, T]); padding (< 0) and
    overflow (>= capacity) go to the scratch page."""
    ps = layer.page_size
    inside = (positions >= 0) & (positions < layer.capacity)
    logical = jnp.where(inside, positions, 0) // ps
    page = jnp.where(inside, jnp.take_along_axis(layer.page_table, logical, axis=1),
                     layer.scratch_page)
    offset = jnp.where(inside, positions % ps, 0)

    def put(pool, new):  # pool [K, P+1, ps, H], new [B, T, K, H]
        return pool.at[:, page, offset].set(jnp.moveaxis(new, 2, 0).astype(pool.dtype),
                                            mode="promise_in_bounds")

    return dataclasses.replace(layer, k_pages=put(layer.k_pages, k), v_pages=put(layer.v_pages, v))


def dense_view(layer: PagedKVLayer):
    """The layer as a dense entry's (k [B, K, S + 1, H], v [B, K, H, S + 1]), S the
    capacity, the last slot a scratch slot: a gather of every row's pages, for the XLA
    attention of prompts (decode steps read the pages in place)."""
    k_heads, _, ps, h = layer.k_pages.shape
    b, per_row = layer.page_table.shape

    def gather(pool):  # -> [B, K, S + 1, H]
        rows = jnp.moveaxis(pool[:, layer.page_table], 0, 1).reshape(b, k_heads, per_row * ps, h)
        return jnp.pad(rows, ((0, 0), (0, 0), (0, 1), (0, 0)))

    return gather(layer.k_pages), gather(layer.v_pages).swapaxes(2, 3)
