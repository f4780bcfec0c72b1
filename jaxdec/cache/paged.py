"""The paged kind: keys and values in fixed-size pages of a shared pool, found through a
per-row page table (vLLM's PagedAttention layout, and what the Pallas `paged_attention`
kernel reads).

Logical slot s of row b lives in pool page `page_table[b, s // page_size]` at offset
`s % page_size`. The page table is data: which pages a row owns is decided on the host by
a `PageAllocator` (`give`, `free`, `share`) and installed with `with_table`; the engine
builds its allocator on this interface. The pool holds one extra page at its end, the
scratch page: padding, tokens past the capacity and table entries a row was not given
point there, so every scatter index is in bounds. A pool holds keys and values in the
activation dtype, or quantised (`QuantKV` codes with a scale per token and group of
channels, the int8 and int4 kinds' format, `page_pool`): more tokens per byte. Slots keep their positions per row (as
every slotted kind, `entry.Slotted`), so rows that share pages each know what they see,
and pages nobody was given may hold anything (NaN included) without changing an output.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxdec.cache import entry, registry
from jaxdec.cache.quantized import kind_format
from jaxdec.cache.pages import PagePool
from jaxdec.errors import JaxdecError
from jaxdec.formats.kvquant import QuantKV, dequantize_kv, empty_kv, put_rows, quantize_like, take_rows
from jaxdec.ops import cpu_kernel

PAGE_SIZE = 32


Pool = jax.Array | QuantKV  # pages [K, P + 1, page_size, H] (a QuantKV: of that logical shape)


def _leaf(pool: Pool) -> jax.Array:
    return pool.codes if isinstance(pool, QuantKV) else pool


@partial(jax.tree_util.register_dataclass, data_fields=["k_pages", "v_pages", "page_table", "pos"],
         meta_fields=[])
@dataclasses.dataclass(frozen=True)
class PagedKVLayer(entry.Slotted):
    k_pages: Pool  # [K, P + 1, page_size, H]: P pool pages, then the scratch page
    v_pages: Pool  # [K, P + 1, page_size, H]
    page_table: jax.Array  # i32[B, pages_per_row]: pool page of each row's logical page
    pos: jax.Array  # i32[B, pages_per_row * page_size + 1]: by logical slot

    @property
    def page_size(self) -> int:
        return _leaf(self.k_pages).shape[2]

    @property
    def scratch_page(self) -> int:
        return _leaf(self.k_pages).shape[1] - 1

    @property
    def quantized(self) -> bool:
        return isinstance(self.k_pages, QuantKV)

    @property
    def writes_first(self) -> bool:
        """A quantised pool's chunks attend to their own keys as stored (as the int8 kind)."""
        return self.quantized

    @classmethod
    def axes(cls):
        return cls(k_pages=("kv_heads", None, None, "head_dim"), v_pages=("kv_heads", None, None, "head_dim"),
                   page_table=("batch", None), pos=("batch", None))

    def _pages(self, at: jax.Array):
        """(pool page, offset) of storage slots `at` (i32[B, T]); scratch to the scratch page."""
        ps, inside = self.page_size, at < self.capacity
        logical = jnp.where(inside, at, 0) // ps
        page = jnp.where(inside, jnp.take_along_axis(self.page_table, logical, axis=1), self.scratch_page)
        return page, jnp.where(inside, at % ps, 0)

    def write(self, k, v, slots, positions):
        """Keys and values [B, T, K, H] at logical `slots`, remembering `positions`."""
        at = self.where(slots, positions)
        page, offset = self._pages(at)

        def put(pool, new):  # pool [K, P+1, ps, H], new [B, T, K, H]: each of their fields
            if isinstance(pool, QuantKV):
                new = jax.tree.map(lambda x: x.swapaxes(1, 2), quantize_like(pool, new.swapaxes(1, 2)))
            return jax.tree.map(lambda p, n: p.at[:, page, offset].set(jnp.moveaxis(n, 2, 0).astype(p.dtype),
                                                                       mode="promise_in_bounds"), pool, new)

        pos = put_rows(self.pos, jnp.where(at == self.capacity, -1, positions), at, 0)
        return dataclasses.replace(self, k_pages=put(self.k_pages, k), v_pages=put(self.v_pages, v), pos=pos)

    def move(self, src, dst):
        src_at, dst_at = self.where(src, src), self.where(dst, dst)
        (sp, so), (dp, do) = self._pages(src_at), self._pages(dst_at)
        move = lambda pool: jax.tree.map(lambda p: p.at[:, dp, do].set(p[:, sp, so], mode="promise_in_bounds"),
                                         pool)
        pos = jnp.where(dst_at == self.capacity, -1, take_rows(self.pos, src_at, 0))
        return dataclasses.replace(self, k_pages=move(self.k_pages), v_pages=move(self.v_pages),
                                   pos=put_rows(self.pos, pos, dst_at, 0))

    def view(self, dtype):
        """The entry as a dense one's (k [B, K, S + 1, H], v [B, K, H, S + 1]): a gather of
        every row's pages (dequantised), empty slots zeroed (a page may hold NaN where
        nobody wrote)."""
        b, per_row = self.page_table.shape
        live = (self.pos >= 0)[:, None, :, None]

        def rows(field):  # [K, P+1, ps, X] -> [B, K, S + 1, X]
            k_heads, _, ps, x = field.shape
            out = jnp.moveaxis(field[:, self.page_table], 0, 1).reshape(b, k_heads, per_row * ps, x)
            return jnp.pad(out, ((0, 0), (0, 0), (0, 1), (0, 0)))

        def gather(pool):
            x = jax.tree.map(rows, pool)
            x = dequantize_kv(x) if isinstance(x, QuantKV) else x
            return jnp.where(live, x, jnp.zeros((), x.dtype)).astype(dtype)

        return gather(self.k_pages), gather(self.v_pages).swapaxes(2, 3)

    def attention(self, q, seen):
        """Short chunks (decode steps) on the CPU kernel read the visible slots in their
        pages (`cpu_kernel.paged_attention`, the dense kernel's sums); others, and a
        quantised pool, the view."""
        if self.quantized:
            return super().attention(q, seen)
        return cpu_kernel.paged_attention(
            q, self.k_pages, self.v_pages, self.page_table, seen[:, :, :-1], scale=1.0 / math.sqrt(q.shape[-1]),
            xla=lambda: super(PagedKVLayer, self).attention(q, seen)).astype(q.dtype)

    def kernel(self, q, lengths):
        if self.quantized:
            raise JaxdecError("no Pallas kernel reads a quantised page pool yet: use attention_impl='xla'")
        from pallas_kernels.paged_attention import paged_attention
        return paged_attention(q, self.k_pages, self.v_pages, self.page_table, lengths,
                               **entry.pallas_run())

    def with_table(self, table, held=None) -> "PagedKVLayer":
        """The entry reading through `table` (i32[B, pages_per_row]; the scratch page for a
        logical page a row was not given). `held` (i32[B], optional) marks each row's first
        held[b] slots as holding positions 0..held[b] - 1 without writing them: the pages
        of a prefix another row filled (`PageAllocator.share`); 0 leaves a row as it is."""
        table = jnp.asarray(table, jnp.int32)
        if table.shape != self.page_table.shape:
            raise JaxdecError(f"a page table of shape {tuple(table.shape)} does not fit this "
                              f"cache's {tuple(self.page_table.shape)}")
        pos = self.pos
        if held is not None:
            slots = jnp.arange(self.n_slots, dtype=jnp.int32)[None]
            pos = jnp.where(slots < jnp.asarray(held, jnp.int32)[:, None], slots, pos)
        return dataclasses.replace(self, page_table=table, pos=pos)


@registry.register("paged", summary=f"pages of {PAGE_SIZE} tokens in a pool, through a page table",
                   options=("page_size", "pool_pages", "fill", "seed"))
def _make(cfg, layer, batch, max_len, dtype, **options):
    return empty(batch, cfg.kv_heads(layer), cfg.head_dim, max_len, dtype, **options)


def page_pool(k_heads: int, head_dim: int, pages: int, page_size: int, dtype, *, quant: str | None = None,
              fill: float = 0.0) -> Pool:
    """A pool of `pages` pages plus the scratch page, on the host: keys (or values) in
    `dtype` filled with `fill`, or with `quant` ("int8" or "int4") the codes of that cache
    kind (zero) with its scales and offsets in `dtype` filled with `fill` (NaN: every slot
    reads as NaN until written)."""
    shape = (k_heads, pages + 1, page_size, head_dim)
    if quant is None:
        return np.full(shape, fill, dtype)
    codes = jax.eval_shape(lambda: empty_kv(*shape, scale_dtype=dtype, **kind_format(quant, head_dim)))
    return jax.tree.map(lambda s: np.full(s.shape, 0 if s.dtype.kind in "iu" else fill, s.dtype), codes)


def empty(batch: int, k_heads: int, head_dim: int, max_len: int, dtype, page_size: int = PAGE_SIZE,
          pool_pages: int | None = None, fill: float = 0.0, seed: int = 0) -> PagedKVLayer:
    """An empty paged entry for `batch` rows of up to `max_len` tokens over a pool of
    `pool_pages` pages (default: enough for every row), filled with `fill`. Every row is
    given its pages up front by a `FreeList` shuffled by `seed` (so the indirection is
    exercised from the first token) when the pool holds them all, else none."""
    if page_size <= 0:
        raise JaxdecError(f"page size must be positive, got {page_size}")
    per_row = -(-max_len // page_size)
    pool_pages = batch * per_row if pool_pages is None else pool_pages
    if pool_pages <= 0:
        raise JaxdecError(f"a page pool needs at least one page, got {pool_pages}")
    allocator = FreeList(batch, per_row, pool_pages, seed=seed)
    if pool_pages >= batch * per_row:
        for row in range(batch):
            allocator.give(row, per_row)
    pool = page_pool(k_heads, head_dim, pool_pages, page_size, dtype, fill=fill)
    put = lambda x: jax.device_put(x, may_alias=False)
    return PagedKVLayer(k_pages=put(pool), v_pages=put(pool.copy()), page_table=put(allocator.table),
                        pos=put(np.full((batch, per_row * page_size + 1), -1, np.int32)))


class PageAllocator:
    """The host-side interface that decides which pool pages each row reads: `table` is
    the page table to install (`with_table`), the scratch page where a row has no page."""

    table: np.ndarray  # i32[B, pages_per_row]

    def give(self, row: int, n: int) -> list[int]:
        """Give `row` n more pages (appended to its logical pages) -> their ids."""
        raise NotImplementedError

    def free(self, row: int) -> None:
        """Take back every page of `row` (shared pages once no row holds them)."""
        raise NotImplementedError

    def share(self, src: int, dst: int, n: int) -> None:
        """Make `dst`'s first n logical pages `src`'s first n (a shared prefix)."""
        raise NotImplementedError


class FreeList(PageAllocator):
    """A `PageAllocator` over a `pages.PagePool` (a free list with a reference count per
    page): rows' page tables for tests and the paged kind's up-front deal."""

    def __init__(self, batch: int, pages_per_row: int, pool_pages: int, seed: int | None = None):
        self.scratch = pool_pages
        self.table = np.full((batch, pages_per_row), pool_pages, np.int32)
        self.owned = [0] * batch  # logical pages each row holds
        order = None if seed is None else np.random.default_rng(seed).permutation(pool_pages)
        self.pool = PagePool(pool_pages, order=order)

    @property
    def refs(self) -> np.ndarray:
        return self.pool.refs

    @property
    def free_pages(self) -> list[int]:
        return self.pool.free_pages()

    def give(self, row: int, n: int) -> list[int]:
        have = self.owned[row]
        if have + n > self.table.shape[1]:
            raise JaxdecError(f"row {row} holds {have} of its {self.table.shape[1]} pages: "
                              f"{n} more do not fit its page table")
        pages = self.pool.allocate(n)
        self.table[row, have:have + n] = pages
        self.owned[row] = have + n
        return pages

    def free(self, row: int) -> None:
        self.pool.release(list(self.table[row, :self.owned[row]]))
        self.table[row] = self.scratch
        self.owned[row] = 0

    def share(self, src: int, dst: int, n: int) -> None:
        if n > self.owned[src]:
            raise JaxdecError(f"row {src} holds {self.owned[src]} pages, not {n} to share")
        self.free(dst)
        self.table[dst, :n] = self.table[src, :n]
        self.pool.acquire(list(self.table[src, :n]))
        self.owned[dst] = n
