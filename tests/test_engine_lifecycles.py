"""The engine's pages over random request lifecycles (hypothesis, stateful), on a tiny
model whose pool starts as NaN and whose freed pages are poisoned with NaN again.

Requests arrive (some sharing prefixes, so pages are shared through the prefix cache),
the engine steps, requests are aborted and preempted at random. After every operation:
each page's reference count is the number of running requests holding it (so nothing
leaks and no running request's page is ever free, hence never evicted), the free rows and
the running rows partition the rows, and each running row's page table is its pages. Every
request that finished (not aborted) produced plain greedy generation's tokens, which NaN in
a page it could have read would have broken. About 25 examples of ~20 requests each: over
500 lifecycles.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxdec import api
from jaxdec.engine.engine import Engine
from jaxdec.engine.request import SamplingParams, Status
from jaxdec.errors import JaxdecError
from tiny_hf import build, byte_tokenizer

_, CFG, PARAMS = build("llama", seed=5)
MODEL = api.Model(cfg=CFG, params=PARAMS, tokenizer=byte_tokenizer(), source="tiny")
BASES = [np.random.default_rng(s).integers(0, 256, 40).tolist() for s in range(3)]
REFERENCE: dict[tuple, list[int]] = {}


def reference(prompt: list[int], n: int) -> list[int]:
    key = (tuple(prompt), n)
    if key not in REFERENCE:
        REFERENCE[key] = api.generate_ids(MODEL, [prompt], max_new_tokens=n, stop_ids=()).token_ids[0]
    return REFERENCE[key]


class Lifecycles(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.engine = Engine(MODEL, max_num_seqs=3, max_num_batched_tokens=24, page_size=4,
                             num_pages=14, max_model_len=64, fill=float("nan"))
        self.aborted: set[str] = set()

    @rule(base=st.sampled_from(BASES), cut=st.integers(0, 40), tail=st.lists(st.integers(0, 255), max_size=8),
          n=st.integers(1, 12))
    def add(self, base, cut, tail, n):
        prompt = base[:cut] + tail
        if not prompt:
            return
        params = SamplingParams(max_tokens=n, ignore_eos=True)
        if -(-(len(prompt) + n) // 4) > self.engine.pool.n_pages:  # could never fit: refused
            with pytest.raises(JaxdecError, match="the pool has"):
                self.engine.add_request(prompt, params)
            return
        self.engine.add_request(prompt, params)

    @rule()
    def step(self):
        self.engine.step()

    @precondition(lambda self: self.engine.has_unfinished())
    @rule(data=st.data())
    def abort(self, data):
        live = [r.id for r in self.engine.running + self.engine.waiting]
        rid = data.draw(st.sampled_from(live))
        self.engine.abort(rid)
        self.aborted.add(rid)

    @precondition(lambda self: self.engine.running)
    @rule(data=st.data())
    def preempt(self, data):
        self.engine.preempt(data.draw(st.sampled_from([r.id for r in self.engine.running])))

    @invariant()
    def pages_and_rows_add_up(self):
        e = self.engine
        refs = np.zeros(e.pool.n_pages, np.int32)
        for r in e.running:
            assert r.status is Status.RUNNING and len(set(r.pages)) == len(r.pages)
            refs[r.pages] += 1
            np.testing.assert_array_equal(e.table[r.row, :len(r.pages)], r.pages)
            assert (e.table[r.row, len(r.pages):] == e.scratch).all()
        np.testing.assert_array_equal(e.pool.refs, refs)
        assert e.pool.n_free == int((refs == 0).sum())
        rows = sorted([r.row for r in e.running] + e.free_rows)
        assert rows == list(range(e.max_num_seqs))
        assert all(r.pages == [] and r.row is None for r in e.waiting)

    def teardown(self):
        e = self.engine
        while e.has_unfinished():
            e.step()
        assert e.pool.n_used == 0 and sorted(e.free_rows) == list(range(e.max_num_seqs))
        for rid, r in e.requests.items():
            if rid not in self.aborted:
                assert r.finish_reason == "length", (rid, r.finish_reason)
                assert r.output_ids == reference(r.prompt_ids, r.params.max_tokens), rid


TestLifecycles = Lifecycles.TestCase
TestLifecycles.settings = settings(max_examples=25, stateful_step_count=40, deadline=None)
