"""The scheduler's policies: each gives `jaxdec.generate`'s greedy tokens, and each keeps
the schedule it promises.

- static batching admits nothing while a request of its batch decodes;
- prefill-first never mixes decodes and prompt chunks in a step;
- the SLA policy of 2503.05248 admits by predicted KV use (a burst that preempts under fcfs
  preempts nothing) and moves its batch bound by the paper's feedback rule: a cut by a
  factor over the TPOT SLO, one more row under it while requests wait.
"""

from __future__ import annotations

import math
import time
import types

import numpy as np
import pytest

from conftest import assert_one_line_error
from jaxdec.engine import policy as policies
from jaxdec.engine.engine import Engine
from jaxdec.engine.request import Request, SamplingParams
from test_engine import PROMPTS, divergence, drive, reference, smol, tiny  # noqa: F401 (fixtures)


@pytest.mark.parametrize("name", ["static", "prefill-first", "sla"])
def test_every_policy_gives_generates_tokens_and_keeps_its_schedule(smol, reference, name):
    engine = Engine(smol, max_num_seqs=3, max_num_batched_tokens=48, page_size=16, max_model_len=256,
                    policy=name)
    seen = dict(mixed=0, late_admissions=0)

    def watch(engine, before, decoding):
        admitted = {r.id for r in engine.running} - before
        seen["late_admissions"] += bool(admitted) and decoding
        seen["mixed"] += engine.last_step["decode_rows"] > 0 and engine.last_step["prefill_rows"] > 0

    ids = drive(engine, PROMPTS, SamplingParams(max_tokens=20), watch=watch)
    for p, rid in zip(PROMPTS, ids):
        r = engine.requests[rid]
        assert r.output_ids == reference[p], divergence(smol, r.prompt_ids, r.output_ids, reference[p])
    assert engine.stats()["pages_used"] == 0
    if name == "static":
        assert seen["late_admissions"] == 0
    if name == "prefill-first":
        assert seen["mixed"] == 0
    if name == "sla":  # (whatever bound its latency feedback set, the tokens are the same)
        assert engine.policy.b_sla is not None and engine.policy.mean_output is not None


def test_fcfs_mixes_and_admits_while_decoding(tiny):
    """The work-conserving schedule the baselines are measured against does both. Each
    step also records what the SLA feedback reads: its decode batch's own time (without
    the prompt chunks a mixed step runs) and whether a shape ran for its first time."""
    engine = Engine(tiny, max_num_seqs=3, max_num_batched_tokens=48, page_size=16, max_model_len=256)
    seen, steps, step = dict(mixed=0, late=0), [], engine.step

    def timed():
        ran, start = len(engine._ran), time.perf_counter()
        out = step()
        steps.append((dict(engine.last_step), time.perf_counter() - start, len(engine._ran) > ran))
        return out

    def watch(engine, before, decoding):
        seen["late"] += bool({r.id for r in engine.running} - before) and decoding
        seen["mixed"] += engine.last_step["decode_rows"] > 0 and engine.last_step["prefill_rows"] > 0

    engine.step = timed
    rng = np.random.default_rng()
    prompts = [rng.integers(0, 256, int(rng.integers(20, 60))).tolist() for _ in range(8)]
    drive(engine, prompts, SamplingParams(max_tokens=12, ignore_eos=True), watch=watch)
    assert seen["mixed"] > 0 and seen["late"] > 0
    for last, total, new_shape in steps:
        assert (last["decode_seconds"] > 0) == (last["decode_rows"] > 0) and last["decode_seconds"] < total, last
        assert last["first_call"] == new_shape, last
    assert steps[0][0]["first_call"] and not all(last["first_call"] for last, _, _ in steps)


def burst(tiny, policy, rng):
    """8 requests at once whose prompts and outputs need 25 of the pool's 24 pages when 4
    run to their end -> the engine after all finished."""
    engine = Engine(tiny, max_num_seqs=4, max_num_batched_tokens=64, page_size=16, max_model_len=128,
                    num_pages=24, policy=policy)
    params = SamplingParams(max_tokens=80, ignore_eos=True)
    prompts = [rng.integers(0, 256, 20).tolist() for _ in range(8)]
    ids = [engine.add_request(p, params) for p in prompts]
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.stats()["pages_used"])
    assert all(len(engine.requests[i].output_ids) == 80 for i in ids)
    return engine, peak


def test_the_sla_policy_admits_by_predicted_kv_and_does_not_preempt_a_burst(tiny):
    rng = np.random.default_rng()
    fcfs, _ = burst(tiny, "fcfs", rng)
    sla, peak = burst(tiny, "sla", rng)
    assert fcfs.counters["preemptions"] > 0
    assert sla.counters["preemptions"] == 0
    # 3 requests of 100 tokens (7 pages each) fit 0.9 of 24 pages; a fourth does not
    assert peak <= 21


def fake_engine(n_running: int, n_waiting: int, max_num_seqs: int = 16):
    reqs = lambda n: [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=8)) for i in range(n)]
    return types.SimpleNamespace(running=reqs(n_running), waiting=reqs(n_waiting), max_num_seqs=max_num_seqs,
                                 last_step=step_record(n_running, 0.0), page_size=16,
                                 pool=types.SimpleNamespace(n_pages=1000))


def step_record(decode_rows: int, decode_seconds: float, prefill_rows: int = 0, first_call: bool = False):
    """What `Engine.step` leaves in `last_step`."""
    return dict(decode_rows=decode_rows, prefill_rows=prefill_rows, decode_seconds=decode_seconds,
                first_call=first_call)


def decode_step(p, engine, seconds: float) -> None:
    """`p` observes a step of the running requests' decodes alone, `seconds` long."""
    engine.last_step = step_record(len(engine.running), seconds)
    p.observe(engine, seconds, [])


def test_the_sla_bound_follows_the_papers_feedback_rule():
    """Over the SLO the bound is cut to (1 - shrink) of the running batch once it has drained
    to the bound; under (1 - margin) of it, with requests waiting at the bound, it grows by
    one; each decision sees `window` decode steps of an exponential average."""
    rng = np.random.default_rng()
    slo = float(rng.uniform(0.02, 0.2))
    p = policies.SLA(tpot_slo=slo, ttft_slo=1e9, shrink=0.25, margin=0.2, window=4, smoothing=0.3)
    engine = fake_engine(16, 10)
    assert p.row_limit(engine) == 16
    expected = 16
    for _ in range(3):  # slow steps: 16 -> 12 -> 9 -> 6, the batch draining to each bound
        for _ in range(4):
            decode_step(p, engine, slo * 3)
        expected = max(1, math.floor(expected * 0.75))
        assert p.b_sla == expected
        engine.running = engine.running[:expected]
    for _ in range(4):  # still slow, but the batch has not drained to the bound: no cut
        engine.running = fake_engine(expected + 2, 0).running
        decode_step(p, engine, slo * 3)
    assert p.b_sla == expected
    engine.running = fake_engine(expected, 0).running
    while p.banked < 0:  # fast steps: no growth while the slow ones' debt is repaid
        decode_step(p, engine, slo * 0.1)  # (the average still over the SLO at first: one more cut)
        assert p.b_sla <= expected or p.banked >= 0  # (the step that repays it may grow)
        expected = p.b_sla
    for step in range(60):  # requests waiting at the bound: one more per window
        decode_step(p, engine, slo * 0.1)
        engine.running = fake_engine(p.b_sla, 0).running
    assert p.b_sla == 16  # and no further than max_num_seqs
    engine.waiting = []
    for _ in range(8):
        decode_step(p, engine, slo * 0.1)
    assert p.b_sla == 16


def test_the_sla_bound_yields_to_prompts_that_wait_behind_an_overdrawn_bank():
    """Decode batches well under the TPOT SLO, prompts held back by the bank: the bound stays
    while no request has waited half of ttft_slo for its first token, is cut by the same
    factor once one has (admitted and mid-prompt, or waiting), and grows again only once
    the bank is repaid and nothing is overdue."""
    rng = np.random.default_rng()
    slo, ttft = float(rng.uniform(0.02, 0.2)), float(rng.uniform(1, 5))
    p = policies.SLA(tpot_slo=slo, ttft_slo=ttft, shrink=0.25, margin=0.2, window=4,
                     horizon=1e-6)  # (the prompts' share of time forgotten at once: this rule alone)
    engine = fake_engine(16, 10)
    now = time.monotonic()
    for r in engine.waiting + engine.running:
        r.arrival = now - 0.4 * ttft  # (waited, but not half of ttft_slo)
        r.first_token_time = None if r in engine.waiting else now
    engine.last_step = step_record(16, 0.5 * slo, prefill_rows=1)
    p.observe(engine, 40 * slo, [])  # (a prompt chunk: the bank is overdrawn)
    assert p.row_limit(engine) == 16 and p.defers_prompts(engine)
    for _ in range(8):
        decode_step(p, engine, 0.5 * slo)
    assert p.b_sla == 16  # (under the SLO, nobody overdue: the bound holds, and does not grow)
    mid_prompt = engine.running[3]
    mid_prompt.first_token_time, mid_prompt.arrival = None, time.monotonic() - 0.6 * ttft
    expected = 16
    for _ in range(2):  # overdue behind the bank: 16 -> 12 -> 9, the batch draining to each
        for _ in range(4):
            decode_step(p, engine, 0.5 * slo)
        expected = math.floor(expected * 0.75)
        assert p.b_sla == expected and p.banked < 0
        engine.running = engine.running[:expected]  # (mid_prompt, the fourth, stays)
    mid_prompt.first_token_time = time.monotonic()
    engine.waiting[0].arrival = time.monotonic() - 0.6 * ttft  # (overdue while waiting: the same)
    for _ in range(4):
        decode_step(p, engine, 0.5 * slo)
    expected = math.floor(expected * 0.75)
    assert p.b_sla == expected
    engine.running = engine.running[:expected]
    engine.waiting[0].arrival = time.monotonic()
    while p.banked < 0:
        assert p.b_sla == expected  # (nothing overdue, but the bank still owes: no growth)
        decode_step(p, engine, 0.5 * slo)
    expected = p.b_sla  # (the step that repaid it may have grown it)
    engine.waiting[0].arrival = time.monotonic() - 0.6 * ttft
    for _ in range(4):  # overdue, but the bank is repaid: rows, not prompts, hold it back
        decode_step(p, engine, 0.5 * slo)
        engine.running = fake_engine(p.b_sla, 0).running
    assert p.b_sla == expected + 1


def test_the_sla_bound_leaves_prompts_their_share_of_the_slo():
    """The decode batch's target is tpot_slo x (1 - the prompts' share of recent time), that
    share a time-decayed sum checked against float64 NumPy; over the target (though under
    the SLO) the bound is cut, and it grows only under (1 - margin) of the target."""
    rng = np.random.default_rng()
    slo, horizon = float(rng.uniform(0.02, 0.2)), float(rng.uniform(1, 10))
    p = policies.SLA(tpot_slo=slo, window=1 << 30, horizon=horizon)
    engine, steps = fake_engine(8, 4), []
    for _ in range(200):
        decode = float(rng.uniform(0.1, 0.5)) * slo if rng.random() < 0.8 else 0.0
        prompt = float(rng.uniform(0, 10)) * slo if rng.random() < 0.3 or not decode else 0.0
        engine.last_step = step_record(8 * (decode > 0), decode, prefill_rows=int(prompt > 0))
        p.observe(engine, decode + prompt, [])
        steps.append((decode + prompt, prompt))
    total = np.asarray([t for t, _ in steps], np.float64)
    ages = np.cumsum(total[::-1])[::-1] - total  # (seconds since each step ended)
    weights = np.exp(-ages / horizon)
    share = float(np.sum(weights * [q for _, q in steps]) / np.sum(weights * total))
    assert p.decode_target() == pytest.approx(slo * (1 - share), rel=1e-9)
    target = p.decode_target()
    p.window, p.banked, p.b_sla = 1, 0.0, 8
    p._prompt_seconds, p._seconds = 1e12 * (1 - target / slo), 1e12  # (the share held still)
    p.itl = None
    decode_step(p, engine, 0.5 * (target + slo))  # (under the SLO, over the target: a cut)
    assert p.decode_target() == pytest.approx(target) and p.b_sla == 6
    engine.running = engine.running[:6]
    p.itl = None
    decode_step(p, engine, 0.9 * target)  # (under the target, not under 0.8 of it: held)
    assert p.b_sla == 6
    p.itl = None
    decode_step(p, engine, 0.7 * target)  # (requests wait at the bound, the bank is whole)
    assert p.b_sla == 7


def test_the_sla_feedback_skips_first_calls_and_reads_the_decode_batch():
    p = policies.SLA(tpot_slo=0.05)
    engine = fake_engine(4, 2)
    engine.last_step = step_record(4, 0.5, first_call=True)
    p.observe(engine, 0.6, [])
    assert p.itl is None and p.banked == 0
    engine.last_step = step_record(4, 0.02, prefill_rows=1)
    p.observe(engine, 0.9, [])  # (a mixed step of 0.9 s, its decode batch 0.02 s)
    assert p.itl == 0.02 and p.banked == pytest.approx(0.05 - 0.9)  # (the pacing reads the whole step)


@pytest.mark.parametrize("seed", range(4))
def test_the_sla_pacing_keeps_the_mean_step_within_the_slo(seed):
    """Prompt pacing against its definition: while prompts wait, a step that decodes takes a
    chunk unless the bank is overdrawn. Over the first k decoding steps, for every k, the
    mean step time is at most slo + (slo + the longest step) / k; the chunks still run; and
    without the pacing (fcfs: every step takes a chunk) the mean is far above the SLO."""
    rng = np.random.default_rng(seed)
    slo = float(rng.uniform(0.02, 0.2))
    p = policies.SLA(tpot_slo=slo, window=1 << 30)  # (the batch bound held still)
    engine = fake_engine(4, 8)
    times, chunks = [], 0
    for _ in range(2000):
        t = float(rng.uniform(0.1, 0.9)) * slo  # the decode batch alone, under the SLO
        first = rng.random() < 0.02  # (a first call: not banked)
        if not p.defers_prompts(engine):
            chunks += 1
            total = t + float(rng.uniform(1, 12)) * slo
        else:
            total = t
        engine.last_step = step_record(4, t, prefill_rows=int(total > t), first_call=first)
        p.observe(engine, total, [])
        if not first:
            times.append(total)
    times = np.asarray(times, np.float64)
    k = np.arange(1, len(times) + 1)
    assert np.all(np.cumsum(times) / k <= slo + (slo + times.max()) / k + 1e-12)
    assert 0.03 < chunks / 2000 < 0.5  # (the slack went to prompts: about E[slo - t] / E[chunk])
    assert p.b_sla is None or p.b_sla == 16


def test_the_sla_pacing_runs_prompts_alone_once_overdrawn_and_keeps_the_tokens(tiny):
    """A real engine under an SLO no step can meet: once the bank is overdrawn no step that
    decodes also runs prompt tokens (prompts run when nothing decodes), and every request
    gets the tokens fcfs gives it."""
    rng = np.random.default_rng()
    prompts = [rng.integers(0, 256, int(rng.integers(20, 60))).tolist() for _ in range(8)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    engine = Engine(tiny, max_num_seqs=3, max_num_batched_tokens=48, page_size=16, max_model_len=256,
                    enable_prefix_caching=False)
    want = [engine.requests[i].output_ids for i in drive(engine, prompts, params)]
    engine.policy = sla = policies.SLA(tpot_slo=1e-9, window=1 << 30)  # (the same engine: compiled once)
    seen, schedule = dict(overdrawn=0, mixed=0, prompts=0), engine._schedule

    def planned():
        overdrawn, plan = sla.banked < 0, schedule()
        # (a decode: one token of a request with output; a 1-token piece of a prompt is no decode)
        decodes = sum(n == 1 and bool(r.output_ids) for r, n in plan)
        if overdrawn:
            seen["overdrawn"] += decodes > 0
            seen["mixed"] += 0 < decodes < len(plan)
            seen["prompts"] += decodes < len(plan)
        return plan

    engine._schedule = planned
    got = [engine.requests[i].output_ids for i in drive(engine, prompts, params)]
    assert got == want
    assert seen["overdrawn"] > 0 and seen["mixed"] == 0 and seen["prompts"] > 0, seen


def test_the_sla_prediction_is_the_average_finished_output():
    p = policies.SLA()
    r = Request("a", list(range(40)), SamplingParams(max_tokens=100))
    assert p.predicted_tokens(r) == 140  # nothing finished yet: max_tokens
    rng = np.random.default_rng()
    lengths = rng.integers(5, 60, 30)
    engine = fake_engine(0, 0)
    for n in lengths:
        done = Request("d", [1], SamplingParams(max_tokens=100))
        done.output_ids = [0] * int(n)
        p.observe(engine, 0.01, [types.SimpleNamespace(finished=True, finish_reason="length", request=done)])
    mean = float(lengths[0])
    for n in lengths[1:]:
        mean = 0.9 * mean + 0.1 * float(n)
    assert p.predicted_tokens(r) == 40 + math.ceil(mean)
    r.output_ids = [0] * 90
    assert p.predicted_tokens(r) == 40 + 91  # at least what it has and one more


def test_bad_policy_settings_are_one_line_errors(tiny):
    assert_one_line_error(policies.SLA, tpot_slo=0, match="tpot_slo")
    assert_one_line_error(policies.SLA, ttft_slo=float("inf"), match="ttft_slo")
    assert_one_line_error(policies.SLA, tpot_slo=float("nan"), match="tpot_slo")
    assert_one_line_error(policies.SLA, 0.1, shrink=1.0, match="shrink")
    assert_one_line_error(Engine, tiny, policy="lottery", match="unknown scheduling policy")
    assert isinstance(Engine(tiny, max_num_seqs=2, max_model_len=64, policy=policies.SLA(0.05)).policy,
                      policies.SLA)
