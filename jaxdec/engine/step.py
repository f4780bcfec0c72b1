"""The engine's one jitted step: some rows' new tokens through the model over the page
pool, and a token sampled at each row's last one.

    tokens, pools = run_rows(params, pools, table, tokens, positions, lengths, last,
                             row_params, seeds, counters, cfg=cfg)

Both halves of an engine step call it: the decode rows ([R, 1]) and the rows with a
prefill chunk ([Bp, C]). The pool is every attention layer's `(k_pages, v_pages)`,
donated; a row is its page table (i32[B, P], the scratch page where it has none) and its
length (the tokens already in its pages, which it sees: pages are filled in order, so
slot s of a row holds position s). The step rebuilds each layer's `paged.PagedKVLayer`
from these, so the model runs unchanged: each chunk is written, then attended over.
Padding tokens have position -1 and go to the scratch page.

Each row samples with its own settings (`sampling.RowParams`) and its own key,
`fold_in(key(seed), counter)`, so a request's draws do not depend on the rows beside it.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jaxdec.cache.dense import KVCache
from jaxdec.decode import COMPILER_OPTIONS
from jaxdec.cache.paged import PagedKVLayer
from jaxdec.models import transformer
from jaxdec.sampling import RowParams, sample_rows

TOP_LOGPROBS = 20  # the most alternatives a request may ask for (OpenAI's limit)


def row_keys(seeds: jax.Array, counters: jax.Array) -> jax.Array:
    """Typed PRNG keys [B]: request seed u32[B, 2] (its two words), draw counter i32[B]."""
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.wrap_key_data(s), c))(seeds, counters)


def paged_cache(pools, table, lengths) -> KVCache:
    """The `KVCache` of rows `table` (i32[B, P]) holding `lengths` (i32[B]) tokens each."""
    def entry(pool):
        if pool is None:
            return None
        k_pages, v_pages = pool
        page_size = jax.tree.leaves(k_pages)[0].shape[2]  # (a quantised pool: its codes)
        slots = jnp.arange(table.shape[1] * page_size + 1, dtype=jnp.int32)[None]
        pos = jnp.where(slots < lengths[:, None], slots, -1)
        return PagedKVLayer(k_pages=k_pages, v_pages=v_pages, page_table=table, pos=pos)
    return KVCache(layers=tuple(entry(p) for p in pools), lengths=lengths)


@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("pools",),
         compiler_options=COMPILER_OPTIONS)  # the pool updated in place, as decode's cache
def run_rows(params, pools, table, tokens, positions, lengths, last, row_params: RowParams,
             seeds, counters, want_top, *, cfg):
    """-> (i32[B] sampled tokens, f32[B] their log-probabilities, the TOP_LOGPROBS most
    likely tokens' (f32[B, n] log-probabilities, i32[B, n] ids; zeros unless `want_top`,
    a bool scalar), pools)."""
    h, cache = transformer.hidden(params, tokens, positions, paged_cache(pools, table, lengths), cfg)
    h_last = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]
    logits = transformer.logits_from_hidden(params, h_last)
    # the vocabulary sort of sampling, and the top-k of log-probabilities, only when a row
    # needs them: a greedy batch without logprobs takes neither (they cost more than a
    # decode step of a small model)
    sampled = jax.lax.cond(jnp.any(row_params.temperature > 0),
                           lambda: sample_rows(logits, row_params, row_keys(seeds, counters)),
                           lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32))
    pools = tuple(None if e is None else (e.k_pages, e.v_pages) for e in cache.layers)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, sampled[:, None], axis=1)[:, 0]
    b = logits.shape[0]
    top = jax.lax.cond(want_top, lambda: tuple(jax.lax.top_k(logprobs, TOP_LOGPROBS)),
                       lambda: (jnp.zeros((b, TOP_LOGPROBS), jnp.float32),
                                jnp.zeros((b, TOP_LOGPROBS), jnp.int32)))
    return sampled, chosen, top, pools


@partial(jax.jit, donate_argnames=("pools",))
def fill_pages(pools, pages, value):
    """The pools with pool pages `pages` (i32[n]; the scratch page as padding) set to
    `value`: what a test writes into freed pages (NaN) to show they are never read."""
    return tuple(None if p is None else jax.tree.map(lambda x: x.at[:, pages].set(value.astype(x.dtype)), p)
                 for p in pools)
