"""Pages handed out at run time (`jaxdec.cache.paged`), over random sequences of operations.

Three rows share a pool too small for all of them (10 pages of 8 slots; each row may grow to
6). Hypothesis draws sequences of
- append: feed a row 1-8 more tokens, giving it pages one at a time as it grows;
- share: a row drops what it had and takes another row's full pages as its prefix (they are
  named by both tables and not written again), then goes on from there;
- free: a row gives its pages back and is emptied.
After every operation each page no row holds is filled with NaN. Every chunk's logits must
equal the whole sequence's logits computed afresh without a cache (so nothing a row sees
comes from a page it does not hold, a freed page, or another row), and the allocator's
reference counts must equal the tables' entries, with every page either free or held.
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import pytest
from tiny_hf import VOCAB, build

from jaxdec.cache import dense, paged
from jaxdec.models import transformer
from jaxdec.ops import cpu_kernel

ROWS, PAGE, PER_ROW, POOL, CHUNK = 3, 8, 6, 10, 8
CAPACITY = PAGE * PER_ROW

_, CFG, PARAMS = build("llama", seed=5)
# one program per attention path: the CPU kernel reads only the keys a query sees; XLA's
# reference (what runs on GPU and TPU) reads every slot of the view, masked
FORWARD = {path: jax.jit(transformer.forward, static_argnames="cfg") for path in ("cpu-kernel", "xla")}


def _path(path: str):
    """Within it, attention takes `path` (the XLA reference: as if no CPU kernel)."""
    if path == "xla":
        return mock.patch.object(cpu_kernel, "attends", lambda *args: False)
    return contextlib.nullcontext()


def _fresh(tokens: list[int]) -> np.ndarray:
    """Logits [len, V] of a whole sequence, no cache (padded to one width: one compile)."""
    ids = np.zeros((1, CAPACITY), np.int32)
    ids[0, :len(tokens)] = tokens
    logits, _ = FORWARD["cpu-kernel"](PARAMS, jnp.asarray(ids), jnp.arange(CAPACITY)[None], None, cfg=CFG)
    return np.asarray(logits[0, :len(tokens)])


def _nan_free_pages(cache: dense.KVCache, alloc: paged.FreeList) -> dense.KVCache:
    unused = jnp.asarray(np.flatnonzero(alloc.refs == 0), jnp.int32)
    poison = lambda pool: pool.at[:, unused].set(jnp.nan)
    layers = tuple(dataclasses.replace(e, k_pages=poison(e.k_pages), v_pages=poison(e.v_pages))
                   for e in cache.layers)
    return dense.KVCache(layers=layers, lengths=cache.lengths)


def _check_allocator(alloc: paged.FreeList):
    held = [int(p) for r in range(ROWS) for p in alloc.table[r, :alloc.owned[r]]]
    np.testing.assert_array_equal(alloc.refs, np.bincount(held, minlength=POOL))
    free = [int(p) for p in alloc.free_pages]
    assert len(set(free)) == len(free) and set(free) == set(np.flatnonzero(alloc.refs == 0))
    for r in range(ROWS):
        assert (alloc.table[r, alloc.owned[r]:] == alloc.scratch).all()


OPS = st.lists(st.tuples(st.sampled_from(["append", "append", "share", "free"]),
                         st.integers(0, ROWS - 1), st.integers(0, ROWS - 1), st.integers(1, CHUNK)),
               min_size=1, max_size=14)


@pytest.mark.parametrize("path", sorted(FORWARD))
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, seed=st.integers(0, 2**31 - 1))
def test_pages_given_grown_shared_and_freed_never_change_an_output(path, ops, seed):
    with _path(path):
        _run(FORWARD[path], ops, seed)


def _run(forward, ops, seed):
    rng = np.random.default_rng(seed)
    alloc = paged.FreeList(ROWS, PER_ROW, POOL, seed=seed % 7)
    cache = dense.init_cache(CFG, ROWS, CAPACITY, kind="paged", page_size=PAGE, pool_pages=POOL,
                             fill=np.nan)
    seqs: list[list[int]] = [[] for _ in range(ROWS)]
    checked = 0
    for op, row, other, n in ops:
        mask = np.arange(ROWS) == row
        if op == "append":
            cur = len(seqs[row])
            more = -(-(cur + n) // PAGE) - alloc.owned[row]
            if cur + n > CAPACITY or more > len(alloc.free_pages):
                continue
            alloc.give(row, more)  # one page at a time as the row grows: `more` is 0 or 1
            new = rng.integers(0, VOCAB, n).tolist()
            tokens, positions = np.zeros((ROWS, CHUNK), np.int32), np.full((ROWS, CHUNK), -1, np.int32)
            tokens[row, :n], positions[row, :n] = new, np.arange(cur, cur + n)
            logits, cache = forward(PARAMS, jnp.asarray(tokens), jnp.asarray(positions),
                                     cache.with_pages(alloc.table), cfg=CFG)
            seqs[row] += new
            want = _fresh(seqs[row])[cur:]
            np.testing.assert_allclose(np.asarray(logits[row, :n]), want, rtol=1e-4, atol=1e-4)
            checked += 1
        elif op == "share":
            whole = len(seqs[other]) // PAGE
            if other == row or whole == 0:
                continue
            alloc.share(other, row, whole)
            seqs[row] = seqs[other][:whole * PAGE]
            held = np.where(mask, whole * PAGE, 0)
            cache = cache.reset_rows(jnp.asarray(mask)).with_pages(alloc.table, held)
        else:
            alloc.free(row)
            seqs[row] = []
            cache = cache.reset_rows(jnp.asarray(mask)).with_pages(alloc.table)
        _check_allocator(alloc)
        np.testing.assert_array_equal(np.asarray(cache.lengths), [len(s) for s in seqs])
        cache = _nan_free_pages(cache, alloc)
    for row in range(ROWS):
        alloc.free(row)
    assert len(alloc.free_pages) == POOL and not alloc.refs.any()  # nothing leaks
