"""`jaxdec bench serve`: its arithmetic against NumPy on random inputs, its client against a
scripted event stream, its report and plot from a synthetic run; and (slow tier) one real
`--quick` run of jaxdec's server beside llama.cpp's."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from jaxdec import cli
from jaxdec.bench import serve_bench, serve_client, serve_report, serve_stats
from jaxdec.bench.serve_stats import Record, Slo
from jaxdec.bench.workload import poisson_arrivals
from conftest import assert_one_line_error

SLO = Slo(ttft_s=0.5, tpot_s=0.05)


def random_records(rng, n: int, failed: int = 0) -> list[Record]:
    """n requests with random send times, first-token delays, chunk gaps and lengths; the
    first `failed` of them end in an error without a token."""
    out = []
    for i in range(n):
        sent = float(rng.uniform(0, 10))
        if i < failed:
            out.append(Record(sent=sent, chunks=(), end=sent + 1.0, output_tokens=0, asked=16,
                              error="HTTP 500: boom"))
            continue
        tokens = int(rng.integers(1, 40))
        gaps = rng.exponential(rng.uniform(0.01, 0.08), size=tokens - 1)
        chunks = sent + rng.exponential(0.4) + np.concatenate([[0.0], np.cumsum(gaps)])
        out.append(Record(sent=sent, chunks=tuple(chunks), end=float(chunks[-1] + rng.uniform(0, 0.01)),
                          output_tokens=tokens, asked=tokens if i % 7 else tokens + 1,
                          prompt_tokens=int(rng.integers(10, 400))))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_summary_equals_numpy(seed):
    rng = np.random.default_rng(seed)
    records = random_records(rng, 60, failed=seed)
    got = serve_stats.summarize(records, SLO)

    ok = [r for r in records if r.error is None]
    sent = np.array([r.sent for r in ok])
    first = np.array([r.chunks[0] for r in ok])
    last = np.array([r.chunks[-1] for r in ok])
    tokens = np.array([r.output_tokens for r in ok])
    ttft = first - sent
    tpot = np.where(tokens > 1, (last - first) / np.maximum(tokens - 1, 1), 0.0)
    itl = np.concatenate([np.diff(r.chunks) for r in ok])
    e2e = np.array([r.end for r in ok]) - sent
    duration = max(r.end for r in records) - min(r.sent for r in records)
    good = np.sum((ttft <= SLO.ttft_s) & (tpot <= SLO.tpot_s))
    for key, x in (("ttft_s", ttft), ("tpot_s", tpot), ("itl_s", itl), ("e2e_s", e2e)):
        np.testing.assert_allclose([got[key]["p50"], got[key]["p99"], got[key]["mean"]],
                                   [np.median(x), np.quantile(x, 0.99), x.mean()], rtol=1e-12)
    np.testing.assert_allclose(got["duration_s"], duration, rtol=1e-12)
    np.testing.assert_allclose(got["output_tok_s"], tokens.sum() / duration, rtol=1e-12)
    np.testing.assert_allclose(got["request_s"], len(ok) / duration, rtol=1e-12)
    np.testing.assert_allclose(got["goodput_req_s"], good / duration, rtol=1e-12)
    np.testing.assert_allclose(got["slo_attainment"], good / len(records), rtol=1e-12)
    np.testing.assert_allclose(got["tpot_attainment"], np.sum(tpot <= SLO.tpot_s) / len(records), rtol=1e-12)
    assert got["failed"] == seed and got["requests"] == 60
    asked = np.array([r.asked for r in ok])
    np.testing.assert_allclose(got["outputs_as_asked"], np.sum(asked == tokens) / len(records))


@pytest.mark.parametrize("seed", range(5))
def test_capacity_is_the_last_rate_of_the_sustained_prefix(seed):
    rng = np.random.default_rng(seed)
    rates = np.sort(rng.choice(np.arange(1, 30) / 2, size=6, replace=False))
    attained = np.clip(1.05 - rates / rng.uniform(5, 30) + rng.normal(0, 0.05, rates.size), 0, 1)
    held = np.cumprod(attained >= serve_stats.ATTAINMENT).astype(bool)
    expected = float(rates[held][-1]) if held.any() else None
    shuffled = rng.permutation(rates.size)  # (the order of the dict does not matter)
    assert serve_stats.capacity({float(rates[i]): float(attained[i]) for i in shuffled}) == expected


def test_capacity_examples():
    assert serve_stats.capacity({1.0: 1.0, 2.0: 0.95, 4.0: 0.5}) == 2.0
    assert serve_stats.capacity({1.0: 1.0, 2.0: 0.5, 4.0: 0.95}) == 1.0  # a lucky high rate
    assert serve_stats.capacity({1.0: 0.89, 2.0: 1.0}) is None
    assert serve_stats.capacity({1.0: 0.9}) == 1.0


@pytest.mark.parametrize("rate", [0.5, 3.0, 40.0])
def test_poisson_schedule_has_its_mean_rate(rate):
    arrivals = poisson_arrivals(np.random.default_rng(0), 20_000, rate)
    gaps = np.diff(np.concatenate([[0.0], arrivals]))
    assert np.all(gaps > 0)
    assert abs(20_000 / arrivals[-1] / rate - 1) < 0.03
    assert abs(np.std(gaps) * rate - 1) < 0.03  # exponential: std = mean
    # one seed: the same draws at every rate, scaled as 1/rate (what make_loads relies on)
    np.testing.assert_allclose(poisson_arrivals(np.random.default_rng(0), 100, 1.0) / rate,
                               arrivals[:100], rtol=1e-12)


def test_every_load_has_prompts_of_its_own():
    """No prompt is sent twice in a run (a repeat would be a prefix-cache hit); the Poisson
    arrivals are one draw scaled as 1/rate; the burst sends at once."""
    from jaxdec.checkpoint.gguf_reader import read_gguf_header
    from jaxdec.checkpoint.tokenizer import Tokenizer

    s = serve_bench.Settings(requests=6, rates=(1.0, 3.0), clients=(1, 4), rounds=3)
    tok = Tokenizer.from_gguf(read_gguf_header(serve_bench.gguf_path("smollm2")).metadata)
    opened, closed, warm = serve_bench.make_loads(tok, s)
    assert [name for name, _, _ in opened] == ["1/s", "3/s", "burst"]
    assert [len(jobs) for _, _, jobs in opened] == [6, 6, 6] and [len(j) for _, j in closed] == [3, 12]
    prompts = [p for _, _, jobs in opened for p, _, _ in jobs] + [p for _, jobs in closed for p, _, _ in jobs]
    prompts += [p for p, _, _ in warm]
    assert len(set(prompts)) == len(prompts) == 6 * 3 + 3 + 12 + 2
    one, three = (np.array([a for *_, a in jobs]) for _, _, jobs in opened[:2])
    assert np.all(np.diff(one) > 0)
    np.testing.assert_allclose(one / 3, three, rtol=1e-12)
    assert all(a == 0.0 for *_, a in opened[2][2])


def test_queue_series_from_known_times():
    t, q = serve_stats.queue_series(sent=[0.0, 1.0, 2.0], left=[3.0, 1.5, 2.5])
    assert t.tolist() == [0.0, 1.0, 1.5, 2.0, 2.5, 3.0]
    assert q.tolist() == [1, 2, 1, 2, 1, 0]
    t, q = serve_stats.queue_series(sent=[0.0, 1.0], left=[1.0, 2.0])  # a tie: departure first
    assert t.tolist() == [0.0, 1.0, 1.0, 2.0] and q.tolist() == [1, 0, 1, 0]


def test_queue_series_counts_waiting_requests():
    rng = np.random.default_rng(3)
    sent = rng.uniform(0, 10, 200)
    left = sent + rng.exponential(1.0, 200)
    t, q = serve_stats.queue_series(sent, left)
    for probe in rng.uniform(0, 12, 50):
        at = np.searchsorted(t, probe, side="right") - 1
        assert q[at] == np.sum(sent <= probe) - np.sum(left <= probe)


@pytest.mark.parametrize("seed", range(3))
def test_queue_growth_is_each_halfs_overlap_with_the_waits(seed):
    """queue_growth's time-averaged queue against each request's wait [sent, first token)
    overlapped with the half: the two are the same integral."""
    rng = np.random.default_rng(seed)
    records = random_records(rng, 80, failed=seed)
    got = serve_stats.queue_growth(records)
    sent = np.array([r.sent for r in records])
    left = np.array([r.chunks[0] if r.chunks else r.end for r in records])
    a, b = sent.min(), sent.max()
    for key, (lo, hi) in (("first_half", (a, (a + b) / 2)), ("second_half", ((a + b) / 2, b))):
        overlap = np.clip(np.minimum(left, hi) - np.maximum(sent, lo), 0, None)
        np.testing.assert_allclose(got[key], overlap.sum() / (hi - lo), rtol=1e-9)
    probes = np.concatenate([sent, left])  # the queue is at its peak just after some send
    assert got["peak"] == max(np.sum((sent <= p) & (left > p)) for p in probes)
    assert serve_stats.summarize(records, SLO)["queue"] == got


def test_queue_growth_tells_a_growing_queue_from_a_level_one():
    sent = np.arange(40) * 0.25
    level = [Record(sent=s, chunks=(s + 0.3,), end=s + 1, output_tokens=1) for s in sent]
    growing = [Record(sent=s, chunks=(1.0 + 0.5 * i,), end=2.0 + 0.5 * i, output_tokens=1)
               for i, s in enumerate(sent)]  # served at 2/s, sent at 4/s
    flat, up = serve_stats.queue_growth(level), serve_stats.queue_growth(growing)
    assert flat["first_half"] == pytest.approx(flat["second_half"], abs=0.1) and flat["peak"] == 2
    assert up["second_half"] > 2 * up["first_half"] and up["peak"] == 40 - 18  # (18 served by the last send)
    burst = serve_stats.queue_growth([Record(sent=0.0, chunks=(t,), end=t, output_tokens=1) for t in (1, 2)])
    assert burst == {"first_half": None, "second_half": None, "peak": 2}


def test_client_reads_a_stream():
    """`send` against a scripted event stream (jaxdec's shape): chunk times for text events
    only, usage from the last chunk, errors in the record, never raised."""
    import httpx2

    events = [{"choices": [{"text": "", "index": 0}]}, {"choices": [{"text": "Hel"}]},
              {"choices": [{"text": "lo"}]}, {"choices": [{"text": "", "finish_reason": "length"}]},
              {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}]
    sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"

    def handler(request):
        sent = json.loads(request.content)
        assert sent["ignore_eos"] and sent["stream"] and sent["stream_options"] == {"include_usage": True}
        if sent["max_tokens"] == 99:
            return httpx2.Response(400, json={"error": {"message": "too long"}})
        return httpx2.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    async def go():
        clock = iter(range(100)).__next__
        async with httpx2.AsyncClient(transport=httpx2.MockTransport(handler)) as client:
            ok = await serve_client.send(client, "http://x/v1", "m", "Hi", 2, clock)
            bad = await serve_client.send(client, "http://x/v1", "m", "Hi", 99, clock)
        return ok, bad

    ok, bad = asyncio.run(go())
    assert ok.ok and ok.sent == 0 and ok.chunks == (1, 2) and ok.end == 3
    assert (ok.output_tokens, ok.prompt_tokens, ok.asked) == (2, 5, 2)
    assert not bad.ok and bad.error.startswith("HTTP 400") and bad.output_tokens == 0


def synthetic_report(rng) -> dict:
    s = serve_bench.Settings(systems=("fcfs", "static", "sla", "llama.cpp"), rates=(1.0, 2.0),
                             requests=12, static_seqs=(4, 16), llama_server="llama-server")
    results = {}
    for system in serve_bench.systems(s):
        loads = []
        for name, rate in (("1/s", 1.0), ("2/s", 2.0), ("burst", None)):
            records = random_records(rng, 12)
            loads.append({"name": name, "rate": rate, **serve_stats.summarize(records, SLO),
                          "records": serve_bench._records(records)})
        closed = [{"clients": c, **serve_stats.summarize(random_records(rng, 8), SLO)} for c in s.clients]
        results[system.name] = {"argv": system.argv(s, "m.gguf", 1234), "policy": system.policy,
                                "max_num_seqs": system.max_num_seqs, "ready_s": 1.0,
                                "loads": loads, "closed": closed}
    caps = serve_bench.capacities(results)
    return {"settings": dataclasses.asdict(s), "systems": results, "capacity_req_s": caps,
            "sla_vs_static": serve_bench.sla_vs_static(results, caps), "ratios": serve_bench.ratios(results)}


def test_report_prints_and_plots(tmp_path, capsys):
    report = synthetic_report(np.random.default_rng(0))
    assert list(report["systems"]) == ["fcfs", "static", "sla", "llama.cpp", "fcfs seqs=4"]
    assert set(report["ratios"]["vs static"]) == {"fcfs", "sla", "llama.cpp", "fcfs seqs=4"}
    fcfs, static = report["systems"]["fcfs"]["loads"][0], report["systems"]["static"]["loads"][0]
    assert report["ratios"]["vs llama.cpp"]["fcfs"]["1/s"]["tpot_p50"] == pytest.approx(
        fcfs["tpot_s"]["p50"] / report["systems"]["llama.cpp"]["loads"][0]["tpot_s"]["p50"])
    assert report["ratios"]["vs static"]["fcfs"]["1/s"]["output_tok_s"] == pytest.approx(
        fcfs["output_tok_s"] / static["output_tok_s"])
    serve_report.print_report(json.loads(json.dumps(report)))  # (as read back from --json)
    out = capsys.readouterr().out
    for text in ("TTFT p50 ms", "goodput", "Queue while the requests were sent", "2nd half", "Closed loop", "Ratios vs static", "Ratios vs llama.cpp",
                 "Capacity", "sla over the best fixed batch limit", "-np 16 -c 16384 -cb -t"):
        assert text in out, text
    serve_report.plot(report, str(tmp_path / "q.png"))
    assert (tmp_path / "q.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sla_over_the_best_fixed_limit():
    results = {"sla": {"policy": "sla"}, "fcfs": {"policy": "fcfs"}, "fcfs seqs=4": {"policy": "fcfs"},
               "llama.cpp": {"policy": None}}
    caps = {"sla": 3.0, "fcfs": 2.0, "fcfs seqs=4": 2.5, "llama.cpp": 6.0}
    v = serve_bench.sla_vs_static(results, caps)
    assert (v["best_fixed"], v["best_fixed_req_s"], v["ratio"]) == ("fcfs seqs=4", 2.5, 1.2)
    assert serve_bench.sla_vs_static(results, {**caps, "fcfs": None, "fcfs seqs=4": None})["ratio"] is None


def test_num_kv_pages_and_the_slos_reach_the_jaxdec_servers_and_not_llama_cpp():
    rng = np.random.default_rng()
    ttft, tpot = round(float(rng.uniform(0.5, 5)), 3), round(float(rng.uniform(0.01, 0.2)), 3)
    s = serve_bench.Settings(systems=("sla", "llama.cpp"), static_seqs=(4,), num_kv_pages=48,
                             llama_server="/bin/llama-server", ttft_slo=ttft, tpot_slo=tpot)
    argv = {system.name: system.argv(s, "m.gguf", 1234) for system in serve_bench.systems(s)}
    assert set(argv) == {"sla", "llama.cpp", "fcfs seqs=4"}
    for name in ("sla", "fcfs seqs=4"):
        assert argv[name][argv[name].index("--num-kv-pages") + 1] == "48"
        flags = cli.build_parser().parse_args(argv[name][argv[name].index("serve"):])  # (jaxdec serve's own parser)
        assert (flags.policy, flags.num_kv_pages) == (name.split()[0], 48)
    sla = cli.build_parser().parse_args(argv["sla"][argv["sla"].index("serve"):])
    assert (sla.ttft_slo, sla.tpot_slo) == (ttft, tpot)  # (the sla server holds the bench's SLOs)
    assert "--num-kv-pages" not in argv["llama.cpp"]
    assert "--num-kv-pages" not in serve_bench.systems(serve_bench.Settings())[0].argv(serve_bench.Settings(), "m", 1)


def test_unprimed_reads_jaxdecs_gauge_and_not_llama_cpps():
    """(The gauge against a live engine loop: test_engine's priming test.)"""
    llama = "# HELP llamacpp:requests_processing Number of requests processing.\n" \
            "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 0\n"
    assert serve_bench.unprimed(llama) is None
    n = int(np.random.default_rng().integers(1, 60))
    assert serve_bench.unprimed(llama + f"# TYPE {serve_bench.UNPRIMED} gauge\n{serve_bench.UNPRIMED} {n}.0\n") == n


def test_llama_server_missing_is_one_line():
    assert_one_line_error(serve_bench.find_llama_server, "/nonexistent/llama-server", match="make llama-server")


def test_cli_bench_keeps_its_flags_and_takes_serve():
    from jaxdec.cli import build_parser

    plain = build_parser().parse_args(["bench", "--weights", "f32", "--json", "x.json"])
    assert plain.bench_command is None and plain.weights == "f32" and plain.json == "x.json"
    serve = build_parser().parse_args(["bench", "serve", "--quick", "--systems", "fcfs", "--json", "y"])
    assert (serve.bench_command, serve.systems, serve.json, serve.quick) == ("serve", "fcfs", "y", True)


@pytest.mark.parametrize("flags, word", [(["--rounds", "0"], "--rounds"), (["--requests", "-2"], "--requests"),
                                         (["--rates", "1,x"], "--rates"), (["--systems", "vllm"], "--systems"),
                                         (["--num-kv-pages", "0"], "--num-kv-pages")])
def test_bench_serve_rejects_bad_flags(flags, word, capsys):
    from jaxdec.cli import main

    assert main(["bench", "serve", "--systems", "fcfs", *flags]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and word in err, err


@pytest.mark.slow
def test_quick_run_of_jaxdec_and_llama_cpp(tmp_path):
    """`jaxdec bench serve --quick` on jaxdec fcfs and llama.cpp's server (`make llama-server`;
    missing, this fails): the JSON has every figure for both, and the plot is written."""
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    r = subprocess.run([sys.executable, "-m", "jaxdec", "bench", "serve", "--quick", "--systems", "fcfs,llama.cpp",
                        "--json", str(out), "--plot", str(png)], capture_output=True, text=True, timeout=2400)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    report = json.loads(out.read_text())
    assert set(report["systems"]) == {"fcfs", "llama.cpp"}
    for name, system in report["systems"].items():
        assert "error" not in system, system.get("error")
        assert [ld["name"] for ld in system["loads"]] == ["1/s", "4/s", "burst"]
        for ld in system["loads"]:
            assert ld["failed"] == 0 and ld["outputs_as_asked"] == 1, (name, ld["name"])
            for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
                assert 0 < ld[key]["p50"] <= ld[key]["p99"], (name, key)
            assert ld["output_tok_s"] > 0 and ld["request_s"] > 0 and ld["goodput_req_s"] >= 0
            assert len(ld["records"]) == 8
        assert [c["clients"] for c in system["closed"]] == [1, 16]
        assert all(c["output_tok_s"] > 0 and c["failed"] == 0 for c in system["closed"])
        assert name in report["capacity_req_s"]
    assert set(report["ratios"]["vs llama.cpp"]["fcfs"]) == {"1/s", "4/s", "burst"}
    assert report["sla_vs_static"]["paper_ratio"] == 1.22
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "Ratios vs llama.cpp" in r.stdout and "Capacity" in r.stdout
