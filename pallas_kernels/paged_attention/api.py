"""`paged_attention`: one query step per row against KV pages of a shared pool, with GQA.

    out = paged_attention(q, k_pages, v_pages, page_table, lengths, implementation="pallas")

q: [B, N, H]; k_pages, v_pages: [K, P, page_size, H] (a pool of P pages, the layout of
`jaxdec.cache.paged.PagedKVLayer`); page_table: i32[B, W], row b's logical page j is pool
page page_table[b, j]; lengths: i32[B], row b sees its tokens [0, lengths[b]), token t at
offset t % page_size of page page_table[b, t // page_size] (lengths are clamped to
[0, W * page_size]). Entries of a row's table past its used pages may hold anything: no
kernel reads through them. Page ids: a concrete page_table whose used entries (all of
them when `lengths` is traced) leave [0, P) is refused at trace time; a traced table is
clamped into [0, P), so a bad id reads some pool page rather than memory outside it.
Returns [B, N, H] in q's dtype, and with `return_lse` also the float32 log-sum-exp of
each head's scores [B, N] (-inf for an empty row), exactly as `decode_attention`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import common
from pallas_kernels.paged_attention import gpu, reference, tpu

OP = "paged_attention"
FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)


def check_inputs(op: str, q, k_pages, v_pages, page_table, lengths) -> tuple[int, ...]:
    """(B, N, K, P, page_size, W, H) of valid paged-attention inputs, or a one-line
    `KernelError`."""
    common.check(q.ndim == 3, op, f"q has shape {tuple(q.shape)}, expected [B, N, H]")
    common.check(k_pages.ndim == 4, op,
                 f"k_pages has shape {tuple(k_pages.shape)}, expected [K, P, page_size, H]")
    common.check(page_table.ndim == 2, op,
                 f"page_table has shape {tuple(page_table.shape)}, expected [B, pages_per_row]")
    b, n, h = q.shape
    kh, pool, ps = k_pages.shape[:3]
    common.check_shape(op, "k_pages", k_pages, (kh, pool, ps, h))
    common.check_shape(op, "v_pages", v_pages, k_pages.shape)
    common.check_shape(op, "page_table", page_table, (b, page_table.shape[1]))
    common.check(n % kh == 0, op, f"{n} query heads do not share {kh} kv heads evenly")
    for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        common.check_dtype(op, name, x, FLOATS)
    common.check(k_pages.dtype == v_pages.dtype, op,
                 f"k_pages is {k_pages.dtype} but v_pages is {v_pages.dtype}")
    common.check_dtype(op, "page_table", page_table, (jnp.int32,))
    common.check_dtype(op, "lengths", lengths, (jnp.int32,))
    common.check_shape(op, "lengths", lengths, (b,))
    return b, n, kh, pool, ps, page_table.shape[1], h


def check_page_ids(op: str, page_table, lengths, pool: int, page_size: int) -> None:
    """Refuse a concrete page table whose entries that a row uses leave [0, pool): with
    concrete lengths the row's used pages, else every entry. A traced table is not checked."""
    if isinstance(page_table, jax.core.Tracer):
        return
    table = np.asarray(page_table)
    used = np.ones(table.shape, bool)
    if not isinstance(lengths, jax.core.Tracer):
        n_used = -(-np.clip(np.asarray(lengths), 0, table.shape[1] * page_size) // page_size)
        used = np.arange(table.shape[1])[None, :] < n_used[:, None]
    bad = used & ((table < 0) | (table >= pool))
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        common.check(False, op, f"row {row} names page {table[row, col]} (page_table[{row}, {col}]), "
                     f"outside the pool's pages [0, {pool})")


def check_pages(op: str, page_size: int, pages_per_block: int, dtype, platform: str) -> None:
    """The page size and pages per block each body can tile."""
    common.check(pages_per_block >= 1, op, f"pages_per_block={pages_per_block} must be >= 1")
    if platform == "gpu":
        common.check(page_size >= 16 and page_size & (page_size - 1) == 0, op,
                     f"page_size={page_size} must be a power of two >= 16 on the GPU")
        common.check(pages_per_block & (pages_per_block - 1) == 0, op,
                     f"pages_per_block={pages_per_block} must be a power of two on the GPU")
    else:
        sublanes = 8 * (4 // np.dtype(dtype).itemsize)  # a 16-bit tile packs 16 rows
        common.check(page_size % sublanes == 0, op, f"page_size={page_size} must be a multiple of "
                     f"{sublanes} for {np.dtype(dtype).name} pages on the TPU")


def paged_attention(q, k_pages, v_pages, page_table, lengths, *, implementation: str = "pallas",
                    interpret: bool = False, platform: str | None = None, pages_per_block: int = 1,
                    n_splits: int | None = None, scale: float | None = None, return_lse: bool = False):
    """See the module docstring. `pages_per_block` (pages per kernel step) and `n_splits`
    (GPU split-K shares per row and kv head; default: enough to fill the GPU) are static.
    The page ids of a concrete table are checked here, outside the jitted body."""
    _, _, _, pool, ps, _, _ = check_inputs(OP, q, k_pages, v_pages, page_table, lengths)
    check_page_ids(OP, page_table, lengths, pool, ps)
    return _paged_attention(q, k_pages, v_pages, page_table, lengths, implementation=implementation,
                            interpret=interpret, platform=platform, pages_per_block=pages_per_block,
                            n_splits=n_splits, scale=scale, return_lse=return_lse)


@functools.partial(jax.jit, static_argnames=(
    "implementation", "interpret", "platform", "pages_per_block", "n_splits", "scale", "return_lse"))
def _paged_attention(q, k_pages, v_pages, page_table, lengths, *, implementation: str,
                     interpret: bool, platform: str | None, pages_per_block: int,
                     n_splits: int | None, scale: float | None, return_lse: bool):
    b, n, kh, pool, ps, w, h = check_inputs(OP, q, k_pages, v_pages, page_table, lengths)
    where = common.resolve(OP, implementation, interpret, platform)
    scale = 1.0 / math.sqrt(h) if scale is None else scale
    lengths = jnp.clip(lengths, 0, w * ps)
    page_table = jnp.clip(page_table, 0, pool - 1)  # a traced table's ids, kept inside the pool
    if where is None:
        out, lse = reference.paged_attention(q, k_pages, v_pages, page_table, lengths, scale=scale)
    else:
        common.check_head_dim(OP, h, where)
        check_pages(OP, ps, pages_per_block, k_pages.dtype, where)
        qg = common.group_queries(q, kh)
        if where == "gpu":
            out, lse = gpu.paged_attention(qg, k_pages, v_pages, page_table, lengths, scale=scale,
                                           pages_per_block=pages_per_block, n_splits=n_splits,
                                           interpret=interpret)
        else:
            out, lse = tpu.paged_attention(qg, k_pages, v_pages, page_table, lengths, scale=scale,
                                           pages_per_block=pages_per_block, interpret=interpret)
        out, lse = out.reshape(b, n, h), lse.reshape(b, n)
    out = out.astype(q.dtype)
    return (out, lse) if return_lse else out


def bytes_moved(q, k_pages, page_table, lengths) -> common.Bytes:
    """HBM bytes of one call: q, the K and V pages each row uses (whole pages, as the
    kernels read them), the page-table entries that name them, lengths, the output.
    `lengths` must be concrete."""
    kh, _, ps, h = k_pages.shape
    lengths = np.clip(np.asarray(lengths), 0, page_table.shape[1] * ps)
    pages = int((-(-lengths // ps)).sum())
    kv = 2 * pages * kh * ps * h * np.dtype(k_pages.dtype).itemsize
    q_bytes = common.nbytes(q.shape, q.dtype)
    return common.Bytes(read=q_bytes + kv + 4 * pages + 4 * lengths.size, written=q_bytes)
