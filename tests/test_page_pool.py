"""The engine's page pool against a model of what each page holds.

A stateful hypothesis test admits prompts that share prefixes, grows them token by token,
publishes their full pages, and finishes them in random orders, over a pool too small for
all of them. After every step: each page's reference count is the number of live requests
holding it, the free queue is exactly the pages nobody holds, and a prefix hit returns only
pages whose tokens (as written, tracked here) are the prompt's own, never a page that was
reused for other tokens since it was published.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxdec.cache.pages import PagePool, prefix_keys
from jaxdec.errors import JaxdecError

PAGE = 4
BASES = [tuple(np.random.default_rng(s).integers(0, 50, 24).tolist()) for s in range(3)]


class Pool(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = PagePool(n_pages=12)
        self.live: dict[int, dict] = {}   # request -> {"tokens", "pages", "published"}
        self.held: dict[int, tuple] = {}  # page -> the tokens written into it
        self.next_id = 0
        self.hits = 0

    def _write(self, req, start):
        """Record tokens[start:] as written into the request's pages; publish full pages."""
        toks, pages = req["tokens"], req["pages"]
        for i in range(start // PAGE, len(pages)):
            self.held[pages[i]] = tuple(toks[i * PAGE:(i + 1) * PAGE])
        keys = prefix_keys(toks, PAGE)
        for i in range(req["published"], len(keys)):
            self.pool.publish(pages[i], keys[i])
        req["published"] = len(keys)

    @rule(base=st.sampled_from(BASES), cut=st.integers(0, 24), tail=st.lists(st.integers(0, 50), max_size=9))
    def admit(self, base, cut, tail):
        prompt = list(base[:cut]) + tail
        if not prompt:
            return
        keys = prefix_keys(prompt, PAGE)
        hit = self.pool.match(keys)[:(len(prompt) - 1) // PAGE]  # the last token is recomputed
        for i, page in enumerate(hit):  # a hit holds this prompt's own tokens
            assert self.held[page] == tuple(prompt[i * PAGE:(i + 1) * PAGE]), (page, i)
        need = -(-len(prompt) // PAGE) - len(hit)
        reusable = sum(self.pool.refs[p] == 0 for p in hit)
        if need > self.pool.n_free - reusable:
            with pytest.raises(JaxdecError):
                self.pool.allocate(self.pool.n_free + 1)
            return
        self.pool.acquire(hit)
        self.hits += len(hit)
        req = {"tokens": prompt, "pages": hit + self.pool.allocate(need), "published": len(hit)}
        self.live[self.next_id] = req
        self.next_id += 1
        self._write(req, len(hit) * PAGE)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), new=st.lists(st.integers(0, 50), min_size=1, max_size=6))
    def grow(self, data, new):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        req = self.live[rid]
        start = len(req["tokens"])
        need = -(-(start + len(new)) // PAGE) - len(req["pages"])
        if need > self.pool.n_free:
            return
        req["pages"] += self.pool.allocate(need)
        req["tokens"] = req["tokens"] + new
        self._write(req, start)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.pool.release(self.live.pop(rid)["pages"])

    @invariant()
    def counts_match_holders(self):
        refs = np.zeros(self.pool.n_pages, np.int32)
        for req in self.live.values():
            assert len(set(req["pages"])) == len(req["pages"])
            for page in req["pages"]:
                refs[page] += 1
        np.testing.assert_array_equal(self.pool.refs, refs)
        assert self.pool.n_free == int((refs == 0).sum())

    @invariant()
    def cached_pages_hold_their_prefix(self):
        for key, page in self.pool._page_of.items():  # noqa: SLF001 (the test reads the index)
            assert self.pool._key_of[page] == key
            assert len(self.held[page]) == PAGE


TestPagePool = Pool.TestCase
TestPagePool.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_a_freed_prefix_is_hit_until_its_pages_are_reused():
    pool = PagePool(n_pages=4)
    prompt = [5, 6, 7, 8, 9]
    keys = prefix_keys(prompt, 2)
    assert len(keys) == 2 and keys[1] != hashlib.sha256(np.int32([7, 8]).tobytes()).digest()
    pages = pool.allocate(3)
    for page, key in zip(pages, keys):
        pool.publish(page, key)
    pool.release(pages)
    assert pool.n_free == 4 and pool.match(keys) == pages[:2]
    other = pool.allocate(1)  # the never-used page first, then the released tail first
    assert other == [3] and pool.match(keys) == pages[:2]
    pool.allocate(1)
    assert pool.match(keys) == pages[:2] and pool.evictions == 0
    pool.allocate(1)  # the second page's prefix goes; the first stays hittable
    assert pool.match(keys) == pages[:1] and pool.evictions == 1


def test_misuse_is_a_one_line_error():
    pool = PagePool(n_pages=2)
    with pytest.raises(JaxdecError, match="free pages"):
        pool.allocate(3)
    with pytest.raises(JaxdecError, match="released more often"):
        pool.release([0])
    with pytest.raises(JaxdecError, match="not held"):
        pool.publish(1, b"k")
    with pytest.raises(JaxdecError, match="caches nothing"):
        pool.acquire([0])
