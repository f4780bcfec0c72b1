"""Quest (Tang et al. 2024, "Query-aware sparsity for efficient long-context LLM
inference"): per page of the KV cache keep the elementwise min and max of its keys; at
each decode step score every page by the upper bound they give on a query's dot product,
sum_h max(q_h * kmin_h, q_h * kmax_h), and attend to the top_k pages only.

Bounds: kmin, kmax f32[B, K, n_pages, H] over the written tokens of each page. An empty
page holds kmin = +inf, kmax = -inf (the identities of min and max, so `update_bounds` is a
plain min/max); the scoring reads kmin > kmax as "empty" and gives it -inf.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.sparse_attention.api import OP, block_count, block_sparse_attention

HIGHEST = jax.lax.Precision.HIGHEST


@functools.partial(jax.jit, static_argnames=("page_size",))
def page_bounds(k, lengths, page_size: int):
    """k [B, K, S, H], lengths i32[B] -> (kmin, kmax) f32[B, K, cdiv(S, page_size), H]
    over the tokens [0, lengths[b]) of each page."""
    b, kh, s, h = k.shape
    n_pages = block_count(s, page_size)
    kf = jnp.pad(k.astype(jnp.float32), ((0, 0), (0, 0), (0, n_pages * page_size - s), (0, 0)))
    kf = kf.reshape(b, kh, n_pages, page_size, h)
    written = jnp.arange(n_pages * page_size) < jnp.clip(lengths, 0, s)[:, None]
    written = written.reshape(b, 1, n_pages, page_size, 1)
    return (jnp.where(written, kf, jnp.inf).min(axis=3),
            jnp.where(written, kf, -jnp.inf).max(axis=3))


@functools.partial(jax.jit, static_argnames=("page_size",))
def update_bounds(kmin, kmax, k_new, positions, *, page_size: int):
    """The bounds after writing k_new [B, K, H] at slot positions[b] of each row (a negative
    or past-the-end position writes nothing). Overwriting a slot only widens its page's
    bounds: they stay upper bounds, no longer tight."""
    b, _, n_pages, _ = kmin.shape
    page = jnp.where(positions >= 0, positions // page_size, n_pages)  # n_pages: dropped
    rows = jnp.arange(b)
    new = k_new.astype(jnp.float32)
    return (kmin.at[rows, :, page].min(new, mode="drop"),
            kmax.at[rows, :, page].max(new, mode="drop"))


def page_scores(q, kmin, kmax, lengths, page_size: int):
    """f32[B, K, n_pages]: the Quest bound of each page, per query head, maxed over the G
    heads of each kv head; -inf for an empty page or one past the row's length, +inf for
    the page of the row's last token. max(x, y) = (x + y) / 2 + |x - y| / 2 makes it two
    small matmuls: q . (kmin + kmax) / 2 + |q| . (kmax - kmin) / 2."""
    kh, n_pages = kmin.shape[1], kmin.shape[2]
    qg = common.group_queries(q.astype(jnp.float32), kh)  # [B, K, G, H]
    empty = kmin[..., 0] > kmax[..., 0]  # bool[B, K, P]
    mid = jnp.where(empty[..., None], 0.0, (kmin + kmax) / 2)
    half = jnp.where(empty[..., None], 0.0, (kmax - kmin) / 2)
    s = (jnp.einsum("bkgh,bkph->bkgp", qg, mid, precision=HIGHEST)
         + jnp.einsum("bkgh,bkph->bkgp", jnp.abs(qg), half, precision=HIGHEST)).max(axis=2)
    used = -(-jnp.clip(lengths, 0, n_pages * page_size) // page_size)[:, None, None]
    page = jnp.arange(n_pages)
    s = jnp.where(empty | (page >= used), -jnp.inf, s)
    return jnp.where(page == used - 1, jnp.inf, s)


@functools.partial(jax.jit, static_argnames=("top_k", "page_size"))
def quest_select(q, kmin, kmax, lengths, top_k: int, page_size: int):
    """q [B, N, H] and the bounds -> (kept i32[B, K, min(top_k, n_pages)], n_kept i32[B, K]):
    the best-scoring pages first, always with the page of the row's last token; fewer than
    top_k where a row has fewer written pages."""
    common.check(top_k >= 1, OP, f"top_k={top_k} must be at least 1")
    b, n, h = q.shape
    common.check(kmin.ndim == 4 and kmin.shape[0] == b and kmin.shape[3] == h, OP,
                 f"kmin has shape {tuple(kmin.shape)}, expected [{b}, K, n_pages, {h}]")
    common.check_shape(OP, "kmax", kmax, kmin.shape)
    common.check(n % kmin.shape[1] == 0, OP,
                 f"{n} query heads do not share {kmin.shape[1]} kv heads evenly")
    scores = page_scores(q, kmin, kmax, lengths, page_size)
    top, kept = jax.lax.top_k(scores, min(top_k, kmin.shape[2]))
    return kept.astype(jnp.int32), (top > -jnp.inf).sum(axis=-1, dtype=jnp.int32)


@functools.partial(jax.jit, static_argnames=(
    "top_k", "page_size", "implementation", "interpret", "platform", "n_splits", "v_layout",
    "scale", "return_lse"))
def quest_attention(q, k, v, lengths, kmin, kmax, *, top_k: int, page_size: int,
                    implementation: str = "pallas", interpret: bool = False,
                    platform: str | None = None, n_splits: int | None = None,
                    v_layout: str = "sh", scale: float | None = None, return_lse: bool = False):
    """Quest decode attention: `quest_select` then `block_sparse_attention` with
    block_k = page_size (so on the TPU page_size is a multiple of 128)."""
    b, kh, s, h = k.shape
    common.check_shape(OP, "kmin", kmin, (b, kh, block_count(s, page_size), h))
    kept, n_kept = quest_select(q, kmin, kmax, lengths, top_k, page_size)
    return block_sparse_attention(
        q, k, v, lengths, kept, n_kept, block_k=page_size, implementation=implementation,
        interpret=interpret, platform=platform, n_splits=n_splits, v_layout=v_layout,
        scale=scale, return_lse=return_lse)
