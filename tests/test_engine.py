"""The engine against plain generation: continuous batching with chunked prefill, prefix
caching and preemption give `jaxdec.generate`'s greedy tokens on SmolLM2; seeded sampling
does not depend on the requests beside it; a warm engine compiles nothing new; requests
that can never run are refused at once in one line."""

from __future__ import annotations

import asyncio
import time
import types

import jax
import numpy as np
import pytest

import jaxdec
from conftest import assert_one_line_error, jax_model
from jaxdec import api
from jaxdec.bench import serve_bench
from jaxdec.engine.engine import Engine
from jaxdec.engine.request import SamplingParams
from jaxdec.engine.step import run_rows
from jaxdec.errors import JaxdecError
from jaxdec.serve.async_engine import AsyncEngine, Submission
from jaxdec.serve.metrics import Metrics
from tiny_hf import build, byte_tokenizer

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "日本語で自己紹介をしてください。",
    "Once upon a time, in a land far away, there lived a dragon who " * 4,
    "SELECT name, COUNT(*) FROM users GROUP BY",
    "List three colours:",
]


@pytest.fixture(scope="module")
def smol():
    return jax_model("smollm2")


@pytest.fixture(scope="module")
def reference(smol):
    """jaxdec.generate's greedy tokens, each prompt alone (no batch padding involved)."""
    return {p: list(jaxdec.generate(smol, [p], max_new_tokens=20).token_ids[0]) for p in PROMPTS}


def divergence(model, prompt_ids, ours, theirs) -> str:
    """Where two greedy continuations part, with the reference's top-2 logit gap there (a
    near-tie or a bug)."""
    i = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    logits = np.asarray(jaxdec.score(model, [prompt_ids + theirs[:i]]))[0, -1]
    top = np.sort(logits)[-2:]
    return f"first difference at token {i}: ours {ours[i:i + 3]}, generate's {theirs[i:i + 3]}, " \
           f"top-2 gap there {top[1] - top[0]:.2e}"


def test_continuous_batching_gives_generates_tokens(smol, reference):
    """7 prompts through 3 rows with a 48-token budget: rows are reused, prompts run in
    chunks, and steps mix decode tokens with prompt chunks."""
    engine = Engine(smol, max_num_seqs=3, max_num_batched_tokens=48, page_size=16, max_model_len=256)
    ids = [engine.add_request(p, SamplingParams(max_tokens=20)) for p in PROMPTS]
    mixed = 0
    while engine.has_unfinished():
        before = {r.id: r.n_computed for r in engine.running}
        engine.step()
        mixed += engine.last_step["decode_rows"] > 0 and engine.last_step["prefill_rows"] > 0
        assert engine.last_step["tokens"] <= 48
    assert mixed > 0 and engine.counters["steps"] > 0
    for p, rid in zip(PROMPTS, ids):
        r = engine.requests[rid]
        assert r.finished and r.finish_reason in ("stop", "length")
        assert r.output_ids == reference[p], divergence(smol, r.prompt_ids, r.output_ids, reference[p])
        assert engine.text(rid) == smol.tokenizer.decode(r.output_ids)
    assert engine.stats()["pages_used"] == 0 and engine.stats()["running"] == 0


def test_a_prefix_hit_gives_the_tokens_of_a_miss(smol):
    shared = PROMPTS[4]
    prompts = [shared + "The dragon's name was", shared + "One day, a knight"]
    engine = Engine(smol, max_num_seqs=2, max_num_batched_tokens=64, page_size=16, max_model_len=256)
    first = engine.generate(prompts[:1], SamplingParams(max_tokens=8))[0]
    second = engine.generate(prompts[1:], SamplingParams(max_tokens=12))[0]
    assert first.n_cached == 0
    n_shared = len(smol.tokenizer.encode(shared))
    assert second.n_cached >= (n_shared // 16 - 1) * 16 > 0, (second.n_cached, n_shared)
    assert engine.stats()["prefix_hit_tokens"] == second.n_cached
    miss = Engine(smol, max_num_seqs=1, max_num_batched_tokens=64, page_size=16, max_model_len=256)
    fresh = miss.generate(prompts[1:], SamplingParams(max_tokens=12))[0]
    assert fresh.n_cached == 0 and second.output_ids == fresh.output_ids
    # the same prompt again: everything but the last page comes from the cache
    again = engine.generate(prompts[1:], SamplingParams(max_tokens=12))[0]
    assert again.n_cached >= len(again.prompt_ids) - 16 and again.output_ids == fresh.output_ids


def test_preemption_by_recompute_gives_the_same_tokens(smol, reference):
    """A pool of 6 pages of 16 tokens for 3 rows of up to 60 tokens: requests are preempted
    (the newest first), recomputed later, and still give generate's tokens; at over four
    times the pool's capacity in requests, every one finishes."""
    prompts = PROMPTS[:3] + PROMPTS[5:]
    engine = Engine(smol, max_num_seqs=3, max_num_batched_tokens=64, page_size=16, num_pages=6,
                    max_model_len=256)
    results = engine.generate(prompts, SamplingParams(max_tokens=20))
    assert engine.counters["preemptions"] > 0
    assert any(r.n_preempted for r in results)
    for p, r in zip(prompts, results):
        assert r.output_ids == reference[p], divergence(smol, r.prompt_ids, r.output_ids, reference[p])
    assert engine.stats()["pages_used"] == 0


def test_seeded_sampling_does_not_depend_on_its_neighbours(smol):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    alone = Engine(smol, max_num_seqs=4, max_num_batched_tokens=64, page_size=16, max_model_len=256)
    solo = alone.generate([PROMPTS[0]], params)[0].output_ids
    crowd = Engine(smol, max_num_seqs=4, max_num_batched_tokens=64, page_size=16, max_model_len=256)
    others = [SamplingParams(max_tokens=n, temperature=1.0, seed=s) for n, s in ((5, 1), (19, 2), (9, None))]
    out = crowd.generate([PROMPTS[3], PROMPTS[0], PROMPTS[4], PROMPTS[6]], [others[0], params, *others[1:]])
    assert out[1].output_ids == solo
    unseeded = crowd.generate([PROMPTS[0]] * 2, SamplingParams(max_tokens=16, temperature=0.9))
    assert unseeded[0].output_ids != unseeded[1].output_ids  # a drawn seed each


def test_stop_strings_stop_tokens_and_abort(smol, reference):
    text = smol.tokenizer.decode(reference[PROMPTS[2]])
    stop = text[12:17]  # inside the continuation, not at token boundaries in general
    engine = Engine(smol, max_num_seqs=2, max_num_batched_tokens=64, page_size=16, max_model_len=256)
    r = engine.generate([PROMPTS[2]], SamplingParams(max_tokens=20, stop=(stop,)))[0]
    assert r.finish_reason == "stop" and engine.text(r.id) == text[:text.index(stop)]
    ref = reference[PROMPTS[0]]
    token = ref[3]
    r = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=20, stop_token_ids=(token,)))[0]
    assert r.finish_reason == "stop" and r.output_ids == ref[:ref.index(token) + 1]
    # abort: the request ends at once, its row and pages go back
    rid = engine.add_request(PROMPTS[4], SamplingParams(max_tokens=20))
    engine.add_request(PROMPTS[1], SamplingParams(max_tokens=20))
    for _ in range(3):
        engine.step()
    used = engine.stats()["pages_used"]
    engine.abort(rid)
    assert engine.stats()["pages_used"] < used and engine.stats()["running"] == 1
    outs = engine.step()
    assert any(o.request_id == rid and o.finished and o.finish_reason == "abort" for o in outs)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["pages_used"] == 0


def test_the_stream_of_one_request_while_others_run(smol, reference):
    engine = Engine(smol, max_num_seqs=3, max_num_batched_tokens=64, page_size=16, max_model_len=256)
    engine.add_request(PROMPTS[4], SamplingParams(max_tokens=20))
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=20, logprobs=5))
    outs = list(engine.stream(rid))
    assert outs[-1].finished and sum(1 for o in outs if o.finished) == 1
    assert [t for o in outs for t in o.token_ids] == reference[PROMPTS[0]]
    assert "".join(o.text for o in outs) == smol.tokenizer.decode(reference[PROMPTS[0]])
    assert all(len(o.logprobs) == len(o.token_ids) for o in outs)
    lp, top = outs[0].logprobs[0]
    assert len(top) == 5 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    assert top[0][0] == outs[0].token_ids[0] and abs(top[0][1] - lp) < 1e-6 and lp <= 0


@pytest.fixture(scope="module")
def tiny():
    _, cfg, params = build("llama", seed=3)
    return api.Model(cfg=cfg, params=params, tokenizer=byte_tokenizer(), source="tiny")


def test_a_warm_engine_compiles_nothing_new(tiny):
    engine = Engine(tiny, max_num_seqs=4, max_num_batched_tokens=64, page_size=8, max_model_len=160)
    assert engine.warmup() == len(engine._steps)
    compiled = []

    def listen(event, secs, **kw):
        if event.endswith("backend_compile_duration"):
            compiled.append(event)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        run_random_requests(engine)
        assert not compiled and run_rows._cache_size() == 0  # (every step ran a warmed executable)
        assert len(engine._steps) == engine.warmup()
        jax.jit(lambda x: x * 3 + 1)(np.arange(int(np.random.default_rng().integers(2, 99))))
        assert compiled  # (the listener does hear a compile)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def test_compiling_past_the_hosts_memory_maps_is_a_clear_error(tiny, monkeypatch):
    """XLA:CPU maps each compiled kernel apart, and its JIT dies once the process holds
    vm.max_map_count maps. With the limit just above what the process holds now, the
    engine compiles shapes until its maps pass 90% of the limit, then refuses the next
    with a one-line error."""
    from jaxdec.engine import engine as engine_module

    real = engine_module.memory_maps
    used, limit = real()
    with open("/proc/self/maps", "rb") as f:
        assert 0 < used < limit and abs(used - sum(1 for _ in f)) < 50
    engine = Engine(tiny, max_num_seqs=1, max_num_batched_tokens=8, page_size=8, max_model_len=64)
    # (four shapes, and a limit whose 90% the first compiled shape's maps pass: a step of
    # even this tiny model holds about 300, a thread of warmup's pool two, and the pool's
    # two threads may both start before either has compiled)
    fake = int((real()[0] + 8) / engine_module.MAP_SHARE)
    monkeypatch.setattr(engine_module, "memory_maps", lambda: (real()[0], fake))
    assert_one_line_error(engine.warmup, match="memory maps .*vm.max_map_count.*--max-num-seqs")
    assert 0 < len(engine._steps) < len(engine.shapes()) and real()[0] > 0.9 * fake


def test_a_deferred_warmup_loads_the_wider_shapes_while_idle(tiny, tmp_path):
    """With every shape stored in jaxdec's executable cache, `warmup(defer=True)` loads
    only the narrowest table width's shapes; a request that needs a wider table loads its
    shape when it runs, `prime` loads the rest, nothing compiles, and the tokens are those
    of an engine that loaded everything."""
    from jaxdec import exec_cache

    kw = dict(max_num_seqs=1, max_num_batched_tokens=8, page_size=8, max_model_len=64)
    rng = np.random.default_rng()
    prompt = rng.integers(0, 256, int(rng.integers(30, 40))).tolist()  # (a table of 8 pages)
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=int(rng.integers(1 << 40)))
    exec_cache.disable()
    exec_cache.stats.clear()
    exec_cache.enable(tmp_path / "exec")
    try:
        full = Engine(tiny, **kw)
        assert full.warmup(defer=True) == len(full.shapes()) == 4  # (nothing stored yet: all compile)
        want = [t for o in full.stream(full.add_request(prompt, params)) for t in o.token_ids]
        exec_cache.disable()  # (as a new process: nothing loaded)
        exec_cache.enable(tmp_path / "exec")
        engine = Engine(tiny, **kw)
        narrow = min(p for *_, p in engine.shapes())
        assert engine.warmup(defer=True) == len(engine._steps) == 2
        assert {p for *_, p in engine._steps} == {narrow} and set(engine.unprimed()) == set(engine.shapes())
        got = [t for o in engine.stream(engine.add_request(prompt, params)) for t in o.token_ids]
        assert got == want and len(engine._steps) > 2
        for shape in engine.unprimed():
            engine.prime(shape)
        assert engine.unprimed() == [] and set(engine._steps) == set(engine.shapes())
        assert exec_cache.stats["compiled"] == 4 and exec_cache.stats["disk"] == 4
    finally:
        exec_cache.disable()


def pages_but_scratch(engine) -> list[np.ndarray]:
    """Every pool's pages but the scratch page (the last along the page axis), on the host."""
    return [np.asarray(x)[:, :engine.scratch] for pool in engine.pools if pool is not None
            for x in jax.tree.leaves(pool)]


def test_priming_runs_each_warmed_shape_on_the_scratch_page_only(tiny):
    """`prime` runs every compiled shape once on padding rows: no page but the scratch page
    changes, and a request half-way through its output ends with the tokens it has unprimed."""
    rng = np.random.default_rng()
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(10, 40, 3)]
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=int(rng.integers(1 << 40)))

    def run(prime: bool):  # (few shapes: one chunk size, two table widths, rows 1 and 2)
        engine = Engine(tiny, max_num_seqs=2, max_num_batched_tokens=32, page_size=8, max_model_len=64,
                        fill=float("nan"))
        ids = [engine.add_request(p, params) for p in prompts]
        for _ in range(4):
            engine.step()
        if prime:
            engine.warmup()
            ran = set(engine._steps) - set(engine.unprimed())
            assert ran and engine.unprimed()  # (the steps so far ran some shapes, not all)
            before = pages_but_scratch(engine)
            for shape in engine.unprimed():
                engine.prime(shape)
            assert engine.unprimed() == []
            for a, b in zip(before, pages_but_scratch(engine), strict=True):
                assert np.array_equal(a, b, equal_nan=True)
        while engine.has_unfinished():
            engine.step()
        return [engine.requests[i].output_ids for i in ids]

    assert run(prime=True) == run(prime=False)


def test_the_server_loop_primes_while_idle(tiny):
    """`AsyncEngine` runs every warmed shape once while no request is queued; a request that
    arrives meanwhile gets the tokens of an engine that never primes."""
    rng = np.random.default_rng()
    prompt = rng.integers(0, 256, int(rng.integers(10, 40))).tolist()
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=int(rng.integers(1 << 40)))
    make = lambda: Engine(tiny, max_num_seqs=2, max_num_batched_tokens=32, page_size=8, max_model_len=64)
    want = make().generate([prompt], params)[0].output_ids
    engine = make()
    engine.warmup()
    front = AsyncEngine(engine)

    async def ask():
        queue = await front.submit([Submission("a", prompt, params, time.monotonic())])
        out = []
        while not out or not out[-1].finished:
            out.append(await queue.get())
        return [t for o in out for t in o.token_ids]

    # (what `jaxdec bench serve` waits on: the server's /metrics gauge of shapes left to prime)
    gauge = lambda: serve_bench.unprimed(Metrics(lambda: front.stats).render().decode())
    assert gauge() == len(engine.unprimed()) > 0
    front.start()
    try:
        assert asyncio.run(ask()) == want
        deadline = time.monotonic() + 60
        while gauge():
            assert time.monotonic() < deadline and front.alive, engine.unprimed()
            time.sleep(0.05)
        assert engine.unprimed() == []
    finally:
        front.shutdown()
    assert front.alive is False and front.error is None


@pytest.mark.parametrize("page_size,max_model_len,budget", [(8, 160, 64), (32, 1024, 256), (16, 300, 100)])
def test_every_reachable_step_shape_is_warmed(tiny, page_size, max_model_len, budget):
    """Each (tokens already in the row, tokens this step, rows) a step can hold runs a shape
    that `warmup` compiles, and every shape it compiles is one of those: no shape that the
    token budget makes unreachable (two chunks of more than budget / 2 tokens) is compiled."""
    engine = Engine(tiny, max_num_seqs=4, max_num_batched_tokens=budget, page_size=page_size,
                    max_model_len=max_model_len)
    shapes = set(engine.shapes())
    assert len(shapes) == len(engine.shapes())
    row = lambda done: types.SimpleNamespace(n_computed=done)
    reached, end = set(), engine.max_model_len
    for n in range(1, budget + 1):
        most = min(engine.max_num_seqs if n == 1 else engine.max_prefill_seqs, budget // n)
        for done in [*range(0, end - n + 1, page_size), end - n]:  # (every table width the row can need)
            for k in range(1, most + 1):
                shape = engine.shape([(row(done), n)] * k, decode=n == 1)
                assert shape in shapes, (done, n, k)
                reached.add(shape)
    assert reached == shapes
    widths = {p for b, c, p in shapes if c > 1}
    assert min(widths) < engine.pages_per_row  # (prefill reads a narrower table when it can)


def test_prompt_chunks_run_one_batch_per_chunk_bucket(tiny):
    """A step's prompt chunks run in one batch per chunk bucket (a batch pads each row to
    its longest chunk), in ascending buckets, then the decode rows as one batch."""
    engine = Engine(tiny, max_num_seqs=8, max_num_batched_tokens=256, page_size=8, max_model_len=512)
    rng = np.random.default_rng()
    lengths = [int(rng.integers(2, 33)), int(rng.integers(129, 257)), *map(int, rng.integers(2, 257, 2)), 1, 1, 1]  # (at most 4 chunks, two buckets at least)
    plan = [(types.SimpleNamespace(id=i, n_computed=0), n) for i, n in enumerate(rng.permutation(lengths).tolist())]
    groups = engine._groups(plan)
    assert sorted((r.id, n) for g in groups for r, n in g) == sorted((r.id, n) for r, n in plan)
    buckets = [2 ** int(np.ceil(np.log2(max(n, 32)))) for n in lengths if n > 1]  # (32, 64, 128, 256)
    assert len(groups) == len(set(buckets)) + 1 and all(n == 1 for _, n in groups[-1])
    for g, want in zip(groups, sorted(set(buckets))):
        assert {2 ** int(np.ceil(np.log2(max(n, 32)))) for _, n in g} == {want}
        assert engine.shape(g, decode=False)[1] == want


def run_random_requests(engine):
    """20 random (prompt length, max tokens, stop set, sampling) combinations, the extremes
    of the prompt lengths among them."""
    rng = np.random.default_rng()
    for n in [1, 100, *rng.integers(1, 101, 18)]:
        params = SamplingParams(max_tokens=int(rng.integers(1, 40)), temperature=float(rng.choice([0, 0.7])),
                                top_k=int(rng.choice([0, 5])), top_p=float(rng.choice([1.0, 0.9])),
                                stop=tuple(rng.choice(["ab", "\n", "zz"], size=int(rng.integers(0, 3)))),
                                seed=int(rng.integers(1 << 40)))
        engine.add_request(rng.integers(0, 256, int(n)).tolist(), params)
    while engine.has_unfinished():
        engine.step()


def test_requests_that_can_never_run_are_refused_at_once(tiny):
    engine = Engine(tiny, max_num_seqs=2, max_num_batched_tokens=32, page_size=8, max_model_len=64,
                    num_pages=4)
    add = engine.add_request
    assert_one_line_error(add, [1] * 60, SamplingParams(max_tokens=10), match="context of 64")
    assert_one_line_error(add, [1] * 30, SamplingParams(max_tokens=10), match="the pool has 4")
    assert_one_line_error(add, [], match="empty prompt")
    assert_one_line_error(add, [1, 400], match="out of range")
    rid = add([1, 2], request_id="x")
    assert_one_line_error(add, [1, 2], request_id="x", match="already in use")
    for bad, match in (({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"),
                       ({"top_p": 0.0}, "top_p"), ({"top_k": -2}, "top_k"), ({"stop": ("",)}, "stop")):
        with pytest.raises(JaxdecError, match=match):
            SamplingParams(**bad)
    assert_one_line_error(Engine, tiny, max_num_seqs=0, match="max_num_seqs")
    assert_one_line_error(Engine, tiny, num_pages=0, match="num_pages")
    assert_one_line_error(Engine, tiny, policy="lifo", match="unknown scheduling policy")
    assert engine.waiting[0].id == rid and engine.stats()["waiting"] == 1


# ---- exactness under the schedule ---------------------------------------------------
def sixteen_prompts() -> list[str]:
    """16 prompts: the fixed set, and 6 that share long prefixes with them (cache hits)."""
    from jaxdec.prompts import PROMPTS as FIXED
    shared = [FIXED[0] + " and", FIXED[0] + ", slowly,", FIXED[1] + "    left = ",
              FIXED[4] + " the", FIXED[4] + " chlorophyll", FIXED[9] + " a cave"]
    return list(FIXED) + shared


def drive(engine, prompts, params, per_step=2, watch=None):
    """Staggered arrivals: add prompts `per_step` at a time, stepping between; after each
    step `watch(engine, running ids before it, whether one of them was decoding)` -> the
    request ids, in the prompts' order."""
    queue, ids = list(prompts), []
    while queue or engine.has_unfinished():
        ids += [engine.add_request(p, params) for p in queue[:per_step]]
        queue = queue[per_step:]
        before = {r.id for r in engine.running}
        decoding = any(r.output_ids for r in engine.running)
        engine.step()
        if watch:
            watch(engine, before, decoding)
    return ids


def run_schedule(model, prompts, *, max_chunk, prefix, preempt_every=4, max_tokens=16):
    """Arrivals two per step; every `preempt_every` steps the newest running request is
    preempted (and recomputed later) while another runs -> {prompt index: output ids}, the
    engine. (A lone request is spared: one that needs more than `preempt_every` steps would
    be recomputed forever.)"""
    engine = Engine(model, max_num_seqs=4, max_num_batched_tokens=48, max_chunk=max_chunk,
                    page_size=16, max_model_len=256, enable_prefix_caching=prefix, fill=float("nan"))

    steps = iter(range(1, 1 << 30))

    def preempt(engine, before, decoding):
        if next(steps) % preempt_every == 0 and len(engine.running) > 1:
            engine.preempt(max(engine.running, key=lambda r: r.arrival).id)

    ids = drive(engine, prompts, SamplingParams(max_tokens=max_tokens), watch=preempt)
    return {i: engine.requests[rid].output_ids for i, rid in enumerate(ids)}, engine


@pytest.mark.parametrize("model_name", ["smollm2", "qwen2.5-coder-0.5b"])
@pytest.mark.parametrize("prefix", [True, False], ids=["prefix-cache", "no-prefix-cache"])
@pytest.mark.parametrize("max_chunk", [1, 7, 32])
def test_exact_under_staggered_arrivals_chunks_and_forced_preemption(model_name, max_chunk, prefix):
    model = jax_model(model_name)
    prompts = sixteen_prompts()
    ref = jaxdec.generate(model, prompts, max_new_tokens=16)
    # one prompt token a step: preempting every 4 steps would recompute more than it runs
    got, engine = run_schedule(model, prompts, max_chunk=max_chunk, prefix=prefix,
                               preempt_every=4 if max_chunk > 1 else 16)
    assert engine.counters["preemptions"] > 0
    assert (engine.counters["prefix_hit_tokens"] > 0) == prefix
    for i, p in enumerate(prompts):
        want = list(ref.token_ids[i])
        assert got[i] == want, divergence(model, list(ref.prompt_ids[i]), got[i], want)
    assert engine.stats()["pages_used"] == 0


def test_generate_compiles_nothing_new_after_warmup(tiny):
    """jaxdec.generate's (and generate_ids') shapes are bucketed (prompt width, output buffer) and its stop ids
    are data: once each bucket ran, 20 random (prompt length, max tokens, stop set)
    combinations compile nothing."""
    from jaxdec import decode
    for width, new in ((32, 16), (64, 16), (128, 16), (32, 32), (64, 32), (128, 32)):
        api.generate_ids(tiny, [list(range(1, width + 1))], max_new_tokens=new)
    compiled = decode.generate_tokens._cache_size()
    rng = np.random.default_rng()
    for _ in range(20):
        prompt = rng.integers(0, 256, int(rng.integers(1, 129))).tolist()
        stops = rng.integers(0, 300, int(rng.integers(0, 6))).tolist()
        out = api.generate_ids(tiny, [prompt], max_new_tokens=int(rng.integers(1, 33)), stop_ids=stops)
        assert len(out.token_ids[0]) >= 1
    assert decode.generate_tokens._cache_size() == compiled


def test_generate_stops_on_any_of_its_stop_ids_as_data(tiny):
    """Stop ids as data still stop each row at its first stop id, as before."""
    prompt = list(range(40, 60))
    free = api.generate_ids(tiny, [prompt], max_new_tokens=24, stop_ids=[]).token_ids[0]
    assert len(free) == 24
    stop = free[5]
    cut = api.generate_ids(tiny, [prompt], max_new_tokens=24, stop_ids=[stop, 299]).token_ids[0]
    assert cut == free[:free.index(stop) + 1]


def test_cli_generate_through_the_engine(reference):
    """`jaxdec generate --engine` prints jaxdec.generate's greedy text, and refuses what
    the engine cannot do in one line."""
    from test_cli import assert_one_line_error as one_line, run
    prompt = PROMPTS[0]
    r = run("generate", "--engine", "-p", prompt, "--max-new-tokens", "20", "--no-stream")
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == jax_model("smollm2").tokenizer.decode(reference[prompt])
    assert "engine" in r.stderr
    one_line(run("generate", "--engine", "--draft", "layers:8", "-p", prompt), "--engine")
    one_line(run("generate", "--engine", "--kv-cache", "window", "-p", prompt), "window")


@pytest.mark.parametrize("weights", ["gguf", "int8", "int4", "bf16"])
def test_every_weight_format_runs_in_the_engine(weights):
    """The engine runs the model's own matmul entry point, so every weight format works: its
    greedy tokens are jaxdec.generate's for the same weights (the pool in the activation
    dtype: bfloat16 for bf16 weights)."""
    model = jaxdec.load("smollm2", weights=weights)
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[5]]
    ref = jaxdec.generate(model, prompts, max_new_tokens=12)
    engine = Engine(model, max_num_seqs=2, max_num_batched_tokens=32, page_size=16, max_model_len=128)
    assert engine.pools[0][0].dtype == model.dtype
    for p, r, want in zip(prompts, engine.generate(prompts, SamplingParams(max_tokens=12)), ref.token_ids):
        assert r.output_ids == list(want), divergence(model, r.prompt_ids, r.output_ids, list(want))


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_quantised_pool_holds_more_tokens_per_byte(kind):
    """The engine sizes its pool from `kv_cache_memory` in its own format: an int8 (int4)
    pool holds as many more pages as the format's bytes per token say (`kv_bytes_per_token`)."""
    from jaxdec.cache.quantized import kind_format
    from jaxdec.formats.kvquant import kv_bytes_per_token

    memory, cfg = 64 << 20, jax_model("smollm2").cfg
    settings = dict(max_num_seqs=256, max_model_len=1024, page_size=32, kv_cache_memory=memory)
    plain = Engine(jax_model("smollm2"), **settings)
    quant = Engine(jaxdec.load("smollm2", kv_cache=kind), **settings)
    per_token = 2 * cfg.n_layers * cfg.kv_heads(0) * kv_bytes_per_token(cfg.head_dim, **kind_format(kind, cfg.head_dim))
    assert quant.pool.n_pages == memory // (32 * per_token)
    assert plain.pool.n_pages == memory // (32 * 2 * cfg.n_layers * cfg.kv_heads(0) * cfg.head_dim * 4)
    assert quant.pool.n_pages > (3.5 if kind == "int8" else 5) * plain.pool.n_pages


def top2_gap(model, prompt_ids, ids) -> float:
    logits = np.sort(np.asarray(jaxdec.score(model, [prompt_ids + ids]))[0, -1])
    return float(logits[-1] - logits[-2])


def test_an_int8_pool_is_schedule_free_and_follows_generate():
    """Over an int8 page pool, the engine's greedy tokens depend on the schedule only at
    near-ties: chunks of 7 with prefix hits and a forced preemption every 4 steps give what
    chunks of 32 without either give, but where a top-2 gap is small. Against
    jaxdec.generate with the int8 cache kind (which stores the same codes for the same keys:
    test_cache_kinds) they agree up to near-ties too: a prompt's attention runs on XLA's
    dots, whose sums are ordered by the chunk's shape ([4, 32] rows here, [16, 64] there),
    and a key that rounds to the neighbouring code moves a logit by ~1e-3, so a request may
    part only where the top-2 logits are close (it prints what parts: with -s; a wrong page
    moves logits by whole units)."""
    model = jaxdec.load("smollm2", kv_cache="int8")
    prompts = sixteen_prompts()
    got, engine = run_schedule(model, prompts, max_chunk=7, prefix=True)
    assert engine.counters["preemptions"] > 0 and engine.counters["prefix_hit_tokens"] > 0
    plain, _ = run_schedule(model, prompts, max_chunk=32, prefix=False, preempt_every=10**6)
    ref = jaxdec.generate(model, prompts, max_new_tokens=16)

    def parts(ours, theirs, what):
        """(request, first differing token, their top-2 gap there) of each request that parts."""
        out = []
        for i in range(len(prompts)):
            want, ids = list(theirs[i]), list(ref.prompt_ids[i])
            if ours[i] != want:
                at = next(j for j, (a, b) in enumerate(zip(ours[i], want)) if a != b)
                out.append((i, at, round(top2_gap(model, ids, want[:at]), 4)))
                assert out[-1][2] < 0.25, divergence(model, ids, ours[i], want)
        print(f"int8 pool against {what}: {len(out)} of 16 requests part (request, token, gap): {out}")
        assert len(out) <= 3, f"{len(out)} of 16 requests parted from {what}'s tokens: {out}"

    # (chunks of 7 and of 32 are dots of other shapes too: on the AVX-512 path a key can round
    # to the neighbouring code between them, 2 of 16 requests parted at near-ties, 2026-12-07)
    parts(got, plain, "chunks of 32")
    parts(got, ref.token_ids, "generate")


def test_forget_drops_a_finished_request_only(tiny):
    engine = Engine(tiny, max_num_seqs=2, max_num_batched_tokens=32, page_size=16, max_model_len=128)
    done, running = engine.add_request([5, 6, 7], SamplingParams(max_tokens=1)), engine.add_request([8, 9])
    while not engine.requests[done].finished:
        engine.step()
    assert_one_line_error(engine.forget, running, match="has not finished")
    engine.forget(done)
    assert done not in engine.requests and done not in engine._streams and running in engine.requests
