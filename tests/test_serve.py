"""`jaxdec serve` driven by the official `openai` client, over HTTP on 127.0.0.1.

The server (uvicorn in a thread, around an Engine on SmolLM2) is checked against other
numbers: greedy texts of concurrent requests are `jaxdec.generate`'s, usage counts are the
tokenizer's and the chat template's, log-probabilities are a float64 log-softmax of
`jaxdec.score`'s logits. Streams equal whole answers; stop strings, `n`, seeds and the
prefix cache hold; bad requests get OpenAI's error shape at once and the server keeps
serving; a client that leaves gives back its row and pages; a dead engine loop is a 503.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import subprocess
import sys
import threading
import time

import httpx2
import numpy as np
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

import jaxdec
from conftest import jax_model
from jaxdec.engine.engine import Engine
from jaxdec.serve import server as serve_server
from jaxdec.serve.app import make_app

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "SELECT name, COUNT(*) FROM users GROUP BY",
    "List three colours:",
]
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"}]
LONG = "The quick brown fox jumps over the lazy dog while the farmer sleeps. " * 13  # ~200 tokens
MAX = 20


@contextlib.contextmanager
def running(app):
    """Serve `app` with uvicorn on a free port of 127.0.0.1, in a thread -> its base URL."""
    sock = serve_server.listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


@pytest.fixture(scope="module")
def smol():
    return jax_model("smollm2")


@pytest.fixture(scope="module")
def url(smol):
    # (one prompt chunk size, two prefill row counts and two table widths: 10 step shapes to
    # compile, so every request here stays within 256 tokens)
    engine = Engine(smol, max_num_seqs=4, max_num_batched_tokens=32, max_prefill_seqs=2, max_model_len=256)
    with running(make_app(engine, "smollm2")) as url:
        assert httpx2.get(f"{url}/health").status_code == 200
        yield url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def reference(smol):
    """jaxdec.generate's greedy ids, each prompt alone; the chat prompt through its template."""
    out = {p: jaxdec.generate(smol, [p], max_new_tokens=MAX) for p in PROMPTS}
    out["chat"] = jaxdec.generate(smol, [CHAT], chat=True, max_new_tokens=MAX)
    return {k: (r.prompt_ids[0], r.token_ids[0], r.texts[0]) for k, r in out.items()}


def complete(client, prompt, **kw):
    kw = dict(model="smollm2", max_tokens=MAX, temperature=0.0) | kw
    return client.completions.create(prompt=prompt, **kw)


def stats(url) -> dict:
    """/metrics as {sample name: value} (label-free samples) plus the families."""
    text = httpx2.get(f"{url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    values = {s.name: s.value for f in families.values() for s in f.samples if not s.labels}
    return values | {"families": families}


def test_concurrent_greedy_texts_equal_generate(client, smol, reference):
    """Five requests at once over four rows (one waits), one prompt as token ids."""
    def ask(i, p):
        return complete(client, reference[p][0] if i == 1 else p)

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(ask, range(len(PROMPTS)), PROMPTS))
    for p, r in zip(PROMPTS, answers):
        prompt_ids, ids, text = reference[p]
        (choice,) = r.choices
        assert choice.text == text, (p, choice.text, text)
        assert r.usage.prompt_tokens == len(smol.tokenizer.encode(p)) == len(prompt_ids)
        assert r.usage.completion_tokens == len(ids)
        assert r.usage.total_tokens == len(prompt_ids) + len(ids)
        assert choice.finish_reason == ("length" if len(ids) == MAX and ids[-1] not in smol.tokenizer.stop_ids
                                        else "stop")


def test_a_list_of_prompts_gives_n_choices_each(client, reference):
    r = complete(client, PROMPTS[:2], n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [reference[p][2] for p in PROMPTS[:2] for _ in range(2)]
    assert r.usage.prompt_tokens == sum(len(reference[p][0]) for p in PROMPTS[:2])
    assert r.usage.completion_tokens == 2 * sum(len(reference[p][1]) for p in PROMPTS[:2])


def test_chat_text_and_usage_are_the_templates(client, reference):
    prompt_ids, ids, text = reference["chat"]
    r = client.chat.completions.create(model="smollm2", messages=CHAT, max_completion_tokens=MAX, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == len(ids)
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # (under a page: never cached)


def _streamed(chunks, key):
    pieces, reasons, usage = {}, [], None
    for c in chunks:
        if c.usage is not None:
            assert c.choices == []
            usage = c.usage
        for ch in c.choices:
            pieces.setdefault(ch.index, []).append(key(ch) or "")
            if ch.finish_reason is not None:
                reasons.append((ch.index, ch.finish_reason))
    return {i: "".join(p) for i, p in pieces.items()}, reasons, usage


def test_streamed_text_equals_whole_text(client):
    whole = complete(client, PROMPTS[1], max_tokens=30)
    chunks = list(complete(client, PROMPTS[1], max_tokens=30, stream=True,
                           stream_options={"include_usage": True}))
    texts, reasons, usage = _streamed(chunks, lambda ch: ch.text)
    assert texts == {0: whole.choices[0].text}
    assert reasons == [(0, whole.choices[0].finish_reason)]
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_streamed_chat_equals_whole_chat(client):
    kw = dict(model="smollm2", messages=CHAT, max_tokens=MAX, temperature=0.0, n=2)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    texts, reasons, usage = _streamed(chunks, lambda ch: ch.delta.content)
    assert usage is None and all(c.usage is None for c in chunks)
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert sorted(reasons) == sorted((c.index, c.finish_reason) for c in whole.choices)
    assert {ch.index for c in chunks for ch in c.choices if ch.delta.role == "assistant"} == {0, 1}


def test_n_choices_draw_seed_plus_i(client):
    kw = dict(max_tokens=12, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    r = complete(client, PROMPTS[4], n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.text for c in r.choices]
    assert len(set(texts)) > 1, texts
    assert r.usage.completion_tokens == 3 * 12
    assert r.usage.prompt_tokens == complete(client, PROMPTS[4], max_tokens=1).usage.prompt_tokens
    assert complete(client, PROMPTS[4], n=1, **kw | dict(seed=8)).choices[0].text == texts[1]
    assert [c.text for c in complete(client, PROMPTS[4], n=3, **kw).choices] == texts


def test_stop_strings_cut_the_text(client):
    full = complete(client, PROMPTS[0], max_tokens=30).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip() and stop in full, full
    r = complete(client, PROMPTS[0], max_tokens=30, stop=[stop, "never seen 123"])
    assert stop not in r.choices[0].text
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    chunks = list(complete(client, PROMPTS[0], max_tokens=30, stop=stop, stream=True))
    assert _streamed(chunks, lambda ch: ch.text)[:2] == ({0: r.choices[0].text}, [(0, "stop")])


def _ttft(client, prompt) -> tuple[float, str, object]:
    """Seconds from sending a streamed request to its first text, the whole text, and usage."""
    start, first, text, usage = time.monotonic(), None, "", None
    for chunk in complete(client, prompt, max_tokens=4, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        if chunk.choices and chunk.choices[0].text:
            first = first or time.monotonic()
            text += chunk.choices[0].text
    return first - start, text, usage


def test_a_repeated_long_prompt_reports_cached_tokens_and_a_lower_ttft(client, smol):
    """A fresh ~150-token prompt runs in 5 chunks of this server's 32-token budget; sent
    again, its whole pages come from the cache and its first token from one step. (A
    first prompt of the same length compiles the wider steps, so that neither timing
    holds a compile.)"""
    rng = np.random.default_rng()
    words = ["river", "stone", "lantern", "orbit", "copper", "meadow", "signal", "harbor", "velvet"]
    other, prompt = (" ".join(rng.choice(words, 150)) + "." for _ in range(2))
    n = len(smol.tokenizer.encode(prompt))
    assert 128 < n < 250, n
    _ttft(client, other)
    cold, text, first = _ttft(client, prompt)
    warm, again, second = _ttft(client, prompt)
    assert again == text
    assert first.prompt_tokens == second.prompt_tokens == n
    assert first.prompt_tokens_details.cached_tokens == 0
    assert second.prompt_tokens_details.cached_tokens == (n - 1) // 32 * 32  # (its whole pages)
    assert warm < 0.5 * cold, (warm, cold)


def test_a_seed_gives_the_same_text_whatever_runs_beside_it(client):
    kw = dict(max_tokens=16, temperature=0.9, top_p=0.95, seed=123)
    alone = complete(client, PROMPTS[1], **kw).choices[0].text
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        others = [pool.submit(complete, client, p, max_tokens=30, temperature=1.0) for p in PROMPTS[2:5]]
        time.sleep(0.05)
        busy = pool.submit(complete, client, PROMPTS[1], **kw).result().choices[0].text
        [f.result() for f in others]
    assert busy == alone


def _log_softmax64(logits):
    x = np.asarray(logits, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_logprobs_are_the_models_log_softmax(client, smol, reference):
    """The greedy tokens' log-probabilities and their top 3 against a float64 log-softmax of
    `jaxdec.score`'s logits over the prompt and those tokens."""
    ids, out = reference[PROMPTS[0]][0], reference[PROMPTS[0]][1][:6]
    r = complete(client, PROMPTS[0], max_tokens=6, logprobs=3)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == smol.tokenizer.decode(out) == "".join(lp.tokens)
    logits = np.asarray(jaxdec.score(smol, [ids + out]))[0]
    ref = _log_softmax64(logits[len(ids) - 1:len(ids) - 1 + len(out)])
    for t, token_id in enumerate(out):
        assert abs(lp.token_logprobs[t] - ref[t, token_id]) < 1e-4
        best = np.argsort(ref[t])[::-1][:3]
        want = {smol.tokenizer.decode([int(i)]): ref[t, i] for i in best}
        assert set(lp.top_logprobs[t]) == set(want)
        assert all(abs(lp.top_logprobs[t][k] - v) < 1e-4 for k, v in want.items())
    assert lp.text_offset == list(np.cumsum([0] + [len(x) for x in lp.tokens[:-1]]))
    chat = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    for c in content:
        assert bytes(c.bytes).decode() == c.token and len(c.top_logprobs) == 2
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob


def _post(url, body, path="/v1/completions"):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx2.post(f"{url}{path}", content=content, headers={"content-type": "application/json"},
                       timeout=5)


BAD = [
    ({"temperature": -1}, 400, "temperature"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": ""}, 400, "empty prompt"),
    ({"prompt": "hello " * 300}, 400, "context of 256"),
    ({"prompt": [1, 2, 10**9]}, 400, ""),
    ({"model": "gpt-4"}, 404, "gpt-4"),
    ({"n": 0}, 400, "n"),
    ({"top_p": 0}, 400, "top_p"),
    ({"seed": -1}, 400, "seed"),
    ({"logprobs": 21}, 400, "logprobs"),
    ({"echo": True}, 400, "echo"),
    ({"best_of": 3}, 400, "best_of"),
    ({"suffix": "x"}, 400, "suffix"),
    ({"presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"frobnicate": 1}, 400, "frobnicate"),
    ({"prompt": None}, 400, "prompt"),
    (b'{"model": "smollm2", "prompt": "hi"', 400, "JSON"),
]
BAD_CHAT = [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, ""),
    ({"top_logprobs": 2}, 400, "top_logprobs"),
    ({"response_format": {"type": "json_object"}}, 400, "response_format"),
]


def test_bad_requests_get_openais_error_shape_at_once(url, client):
    cases = [(b, s, m, "/v1/completions") for b, s, m in BAD]
    cases += [(b, s, m, "/v1/chat/completions") for b, s, m in BAD_CHAT]
    for change, status, needle, path in cases:
        base = {"model": "smollm2", "max_tokens": 4} | (
            {"prompt": "hi"} if path == "/v1/completions" else {"messages": CHAT})
        body = change if isinstance(change, bytes) else base | change
        start = time.monotonic()
        r = _post(url, body, path)
        assert time.monotonic() - start < 1.0, change
        assert r.status_code == status, (change, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["type"] == "invalid_request_error" and needle in error["message"], (change, error)
        assert "\n" not in error["message"]
    with pytest.raises(openai.BadRequestError, match="temperature"):
        complete(client, "hi", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT)
    assert complete(client, PROMPTS[0], max_tokens=2).choices[0].finish_reason == "length"


def test_models_and_health(url, client):
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    assert httpx2.get(f"{url}/health").status_code == 200
    r = httpx2.get(f"{url}/v1/nothing")
    assert r.status_code == 404 and "message" in r.json()["error"]


def _back_to(url, baseline: dict, within: float = 1.0) -> float:
    start = time.monotonic()
    while True:
        now = stats(url)
        if all(now[k] == v for k, v in baseline.items()):
            return time.monotonic() - start
        assert time.monotonic() - start < within, (now, baseline)
        time.sleep(0.02)


KEYS = ("jaxdec:num_requests_running", "jaxdec:num_requests_waiting", "jaxdec:kv_pages_used")


def test_a_client_leaving_mid_stream_frees_its_row_and_pages(url):
    baseline = {k: stats(url)[k] for k in KEYS}
    assert baseline["jaxdec:num_requests_running"] == 0
    body = {"model": "smollm2", "prompt": PROMPTS[2], "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx2.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        # (the iterator is held: one dropped by `break` closes the response as it is
        # collected, and the server, seeing its client leave, could free the row before
        # /metrics is read below)
        start, read, lines = time.monotonic(), [], r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                read.append(json.loads(line[6:])["choices"][0])
            if len(read) == 3:
                break
        during = stats(url)
        seen = f"after {time.monotonic() - start:.1f} s: {read}"
        assert during["jaxdec:num_requests_running"] == 1 and during["jaxdec:kv_pages_used"] > 0, seen
    _back_to(url, baseline)


def test_a_client_leaving_a_whole_request_frees_its_row_and_pages(url):
    baseline = {k: stats(url)[k] for k in KEYS}
    body = {"model": "smollm2", "prompt": PROMPTS[2], "max_tokens": 230, "ignore_eos": True}
    with pytest.raises(httpx2.TimeoutException):
        httpx2.post(f"{url}/v1/completions", json=body, timeout=0.5)
    _back_to(url, baseline, within=1.5)  # (a waiting request polls for its client every 0.25 s)


def test_metrics_parse_and_have_the_histograms(url, client):
    rng = np.random.default_rng()
    prompt = " ".join(rng.choice(["amber", "delta", "quartz", "willow", "falcon", "ember"], 120)) + "."
    for _ in range(2):  # (the second sends whole cached pages: a prefix hit of its own)
        complete(client, prompt, max_tokens=8)
    s = stats(url)
    families = s["families"]
    for name in ("jaxdec:time_to_first_token_seconds", "jaxdec:time_per_output_token_seconds",
                 "jaxdec:inter_token_latency_seconds"):
        assert families[name].type == "histogram"
        assert s[f"{name}_count"] > 0 and s[f"{name}_sum"] > 0
    for name in ("jaxdec:num_requests_running", "jaxdec:num_requests_waiting", "jaxdec:kv_pages_used",
                 "jaxdec:kv_pages_free", "jaxdec:prefix_cache_hit_rate", "jaxdec:step_shapes_unprimed"):
        assert families[name].type == "gauge"
    assert 0 < s["jaxdec:prefix_cache_hit_rate"] < 1  # the repeated prompt hit
    assert s["jaxdec:prefix_cache_hit_tokens_total"] > 0
    assert s["jaxdec:generation_tokens_total"] > 0 and s["jaxdec:prompt_tokens_total"] > 0
    assert s["jaxdec:num_preemptions_total"] >= 0


def test_four_times_the_pools_capacity_all_finish_through_preemption(smol):
    """Another server, on a pool of 4 pages of 32 tokens: 11 concurrent requests of about 50
    tokens each ask for 4x what it holds. Every one finishes with all its tokens, requests
    for the same prompt get the same text, preemptions happened, and the pages come back."""
    engine = Engine(smol, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, num_pages=4)
    with running(make_app(engine, "small-pool")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=300)
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(11)]
        demand = sum(len(smol.tokenizer.encode(p)) + 40 for p in prompts)
        assert demand >= 4 * 4 * 32, demand
        with concurrent.futures.ThreadPoolExecutor(11) as pool:
            futures = [pool.submit(client.completions.create, model="small-pool", prompt=p, max_tokens=40,
                                   temperature=0.0, extra_body={"ignore_eos": True}) for p in prompts]
            answers = [f.result() for f in futures]
        texts = {}
        for p, a in zip(prompts, answers):
            assert a.usage.completion_tokens == 40 and a.choices[0].finish_reason == "length"
            assert texts.setdefault(p, a.choices[0].text) == a.choices[0].text
        after = stats(url)
        assert after["jaxdec:num_preemptions_total"] > 0
        assert after["jaxdec:num_requests_running"] == after["jaxdec:num_requests_waiting"] == 0
        assert after["jaxdec:kv_pages_used"] == 0


def test_a_request_the_pool_can_never_hold_is_refused_and_a_dead_loop_is_a_503(smol):
    """Another server, on a pool of 4 pages: a request needing more is a 400 at once; then
    its engine's step raises, and the server answers 503 from then on."""
    engine = Engine(smol, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=512, num_pages=4)
    with running(make_app(engine, "tiny-pool")) as url:
        body = {"model": "tiny-pool", "prompt": LONG, "max_tokens": 10}
        r = _post(url, body)
        assert r.status_code == 400 and "the pool has 4" in r.json()["error"]["message"], r.text

        real = engine.step  # the loop busy in a 2-second step: the refusal does not wait for it
        def slow():
            time.sleep(2.0)
            return real()
        engine.step = slow
        busy = threading.Thread(target=httpx2.post, args=(f"{url}/v1/completions",),
                                kwargs=dict(json={"model": "tiny-pool", "prompt": "hi", "max_tokens": 1}, timeout=30))
        busy.start()
        time.sleep(0.5)
        start = time.monotonic()
        r = _post(url, body)
        assert time.monotonic() - start < 1.0 and r.status_code == 400, r.text
        busy.join()

        def broken():
            raise RuntimeError("device lost")
        engine.step = broken
        r = _post(url, {"model": "tiny-pool", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and "device lost" in r.json()["error"]["message"], r.text
        assert httpx2.get(f"{url}/health").status_code == 503
        r = _post(url, {"model": "tiny-pool", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def test_an_int8_page_pool_serves_its_engines_texts(smol):
    """Another server, on SmolLM2 loaded with the int8 cache kind (`jaxdec serve --kv-cache
    int8`): its page pool holds int8 codes, over 3x the pages of the float pool in the same
    bytes, and /metrics reports them; each greedy answer, and each concurrent one, is the
    text the same engine gives that prompt offline, alone (the same step shapes)."""
    import jax

    model = jaxdec.load("smollm2", kv_cache="int8")
    settings = dict(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_seqs=2, max_model_len=512,
                    kv_cache_memory=24 << 20)
    engine = Engine(model, **settings)
    assert {x.dtype for x in jax.tree.leaves(engine.pools) if x.dtype.itemsize == 1} == {np.dtype("int8")}
    assert engine.pool.n_pages > 3 * Engine(smol, **settings).pool.n_pages
    offline = Engine(model, **settings)
    want = {}
    for p in PROMPTS[:4]:
        (r,) = offline.generate([p], jaxdec.SamplingParams(max_tokens=MAX))
        want[p] = offline.text(r.id)
    with running(make_app(engine, "int8")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=300)
        for p in PROMPTS[:4]:
            assert complete(client, p, model="int8").choices[0].text == want[p], p
        values = stats(url)
        assert values["jaxdec:kv_pages_free"] + values["jaxdec:kv_pages_used"] == engine.pool.n_pages
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda p: complete(client, p, model="int8"), PROMPTS[:4]))
        # four at once run [4, 1] decode steps where alone ran [1, 1]: equal up to near-ties
        same = sum(a.choices[0].text == want[p] for p, a in zip(PROMPTS[:4], answers))
        assert same >= 3, [(a.choices[0].text, want[p]) for p, a in zip(PROMPTS[:4], answers)]


def _cli(*args, timeout=120):
    env = dict(os.environ, JAXDEC_XLA_CACHE=os.environ.get("JAXDEC_XLA_CACHE", ""))
    return subprocess.run([sys.executable, "-m", "jaxdec", "serve", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("flags,needle", [
    (["--kv-cache", "window"], "window"),  # (no page pool of that kind: refused, not ignored)
    (["--policy", "lottery"], "--policy"),
    (["--port", "70000"], "--port"),
    (["--max-num-seqs", "0"], "max_num_seqs"),
    (["--num-kv-pages", "0"], "--num-kv-pages"),
])
def test_bad_serve_flags_are_one_line_errors(flags, needle):
    r = _cli(*flags)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxdec: error:") and needle in lines[0], r.stderr


@pytest.mark.slow
def test_the_cli_serves_a_chat_completion():
    port = serve_server.free_port()
    env = dict(os.environ, JAXDEC_XLA_CACHE=os.environ.get("JAXDEC_XLA_CACHE", ""))
    proc = subprocess.Popen([sys.executable, "-m", "jaxdec", "serve", "--model", "smollm2", "--port",
                             str(port), "--num-kv-pages", "40"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = iter(proc.stderr.readline, "")
        ready = next((line for line in lines if "ready on" in line), "the server exited")
        assert f"ready on http://127.0.0.1:{port}/v1" in ready, ready
        assert httpx2.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        pool = stats(f"http://127.0.0.1:{port}")
        assert (pool["jaxdec:kv_pages_used"], pool["jaxdec:kv_pages_free"]) == (0, 40)  # (--num-kv-pages)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=8, temperature=0)
        assert r.choices[0].message.content and r.usage.completion_tokens <= 8
    finally:
        proc.terminate()
        assert proc.wait(30) in (0, -15)  # (uvicorn re-raises the SIGTERM it shut down on)
