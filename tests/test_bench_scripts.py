"""The benchmark scripts run (tiny settings), so they cannot rot between measuring sessions."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from jaxdec.bench import decode_bench, roofline


def test_device_bench_smoke(tmp_path):
    """scripts/device_bench.py on a tiny config on this machine's backend."""
    r = subprocess.run([sys.executable, "scripts/device_bench.py", "--smoke", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads((tmp_path / "device_bench.json").read_text())
    assert [row["batch"] for row in report["rows"]] == [1, 2]
    assert all(row["jaxdec"]["decode_tok_s"] > 0 for row in report["rows"])


def test_device_engine_smoke(tmp_path):
    """scripts/device_engine.py: the engine's step times and closed loops (tiny, 4 rows); each
    loop's requests all ran to their output lengths (EOS ignored)."""
    r = subprocess.run([sys.executable, "scripts/device_engine.py", "--smoke", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads((tmp_path / "device_engine.json").read_text())
    assert list(report["decode_ms"]) == ["1", "2", "4"] and report["ceiling"] > 0
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
    from device_engine import TINY, jobs

    for i, (clients, loop) in enumerate(report["closed"].items()):
        assert loop["output_tokens"] == sum(m for _, m, _ in jobs(TINY.vocab_size, loop["requests"], seed=i))
    one, four = report["closed"]["1"]["tok_s"], report["closed"]["4"]["tok_s"]
    assert report["ratio"] == round(four / one, 2)
    assert "4 clients / 1" in (tmp_path / "device_engine.txt").read_text()


def test_device_kernels_smoke(tmp_path):
    """scripts/device_kernels.py: every kernel checked and timed (tiny, interpret mode)."""
    r = subprocess.run([sys.executable, "scripts/device_kernels.py", "--smoke", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads((tmp_path / "device_kernels.json").read_text())
    assert len(report["rows"]) == 7 and all(row["ok"] and row["mbytes"] > 0 for row in report["rows"])
    assert "% of bw" in (tmp_path / "device_kernels.txt").read_text()


def test_bench_attention_smoke():
    """scripts/bench_attention.py on tiny shapes prints the kernel and XLA side by side."""
    r = subprocess.run([sys.executable, "scripts/bench_attention.py", "--batch", "2", "--layers", "2",
                        "--capacity", "40", "--repeats", "1"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "kernel / XLA speed-up" in r.stdout


def test_cache_bytes_smoke():
    """scripts/cache_bytes.py at a small width: the per-token table (Mamba grows by nothing)
    and one decode step per mixer at two contexts, Mamba's cache the same size at both."""
    r = subprocess.run([sys.executable, "scripts/cache_bytes.py", "--width", "256", "--contexts",
                        "16,48", "--layers", "1", "--repeats", "1"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    mamba = [line.split() for line in r.stdout.splitlines() if line.strip().startswith("Mamba2")]
    assert mamba[0][1] == "0" and mamba[1][1] == mamba[1][5]  # bytes/token; MiB at both contexts


def test_bench_jaxdec_only(tmp_path):
    """`jaxdec bench` end to end for jaxdec alone (batch 1 and 2, 8 new tokens, no peers)."""
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "jaxdec", "bench", "--weights", "gguf", "--peers", "",
                        "--batches", "1,2", "--new-tokens", "8", "--repeats", "1", "--no-ttft",
                        "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(out.read_text())
    run = report["systems"]["jaxdec gguf"]
    assert "error" not in run, run["error"]
    assert set(run["decode_tok_s"]) == {"1", "2"} and run["prefill_tok_s"] > 0
    assert len(run["greedy_ids"]) == 8
    assert run["streamed_decode_tok_s"] > 0 and run["stream_ratio"] > 0
    assert "streamed / one-jit decode" in r.stdout
    assert report["bandwidth_gbs"] > 0 and report["ceiling_tok_s"]["gguf"]["1"] > 0
    assert "ratios" in r.stdout
    # batch 1 against the ceiling from interleaved (probe GB/s, decode tok/s) pairs: the step's
    # bytes are the report's bandwidth over its ceiling, so the fraction follows from the pairs
    pairs = np.asarray(run["ceiling_pairs"])
    assert len(pairs) >= 3 and (pairs > 0).all()
    step = report["bandwidth_gbs"] * 1e9 / report["ceiling_tok_s"]["gguf"]["1"]
    want = np.median(pairs[:, 1] * step / (pairs[:, 0] * 1e9))
    assert run["ceiling_fraction_b1"] == pytest.approx(want, rel=0.02)
    assert 0 < run["ceiling_fraction_b1"] < 1.5 and "of its ceiling (interleaved pairs" in r.stdout


def test_cli_ttft_cold_then_warm_pairs():
    """The bench's whole-CLI time to first token: a cold run (empty cache) that compiles,
    then warm runs paired without and with the prefetch list, all far below the cold one."""
    from jaxdec.bench import decode_bench

    got = decode_bench.cli_ttft(decode_bench.Settings(repeats=2), "gguf",
                                "Write one sentence about the sea and the")
    assert set(got) == {"cold_s", "warm_s", "warm_no_prefetch_s"}, got
    assert 0 < got["warm_s"] < got["cold_s"] and 0 < got["warm_no_prefetch_s"] < got["cold_s"]


@pytest.mark.parametrize("flags, word", [(["--batches", "1,x"], "--batches"),
                                         (["--weights", "", "--peers", ""], "nothing to measure")])
def test_bench_rejects_bad_flags(flags, word):
    r = subprocess.run([sys.executable, "-m", "jaxdec", "bench", *flags],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and word in r.stderr


def test_step_bytes_counts_stored_weights():
    """The ceiling's bytes: an int4 model reads about a sixth of the f32 bytes per step."""
    from jaxdec.models import transformer
    from jaxdec.formats.convert import quantize_params
    from tiny_hf import build

    _, cfg, params = build("llama", seed=5)

    class M:  # the two attributes step_bytes reads
        def __init__(self, p):
            self.params, self.cfg = p, cfg

    f32 = roofline.step_bytes(M(params), 1, 0)
    q4 = roofline.step_bytes(M(quantize_params(params, transformer.declare(cfg), "int4")), 1, 0)
    assert 0.1 < q4 / f32 < 0.25
    assert roofline.step_bytes(M(params), 2, 10) > f32


def test_kernel_bytes_table():
    """scripts/kernel_bytes.py: int8/int4 KV move ~0.53x/~0.31x of bf16's bytes at 32k."""
    r = subprocess.run([sys.executable, "scripts/kernel_bytes.py"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    ratio = {line.split()[1]: float(line.split()[-1]) for line in r.stdout.splitlines()
             if line.startswith("quantized_kv_attention")}
    assert 0.5 < ratio["int8"] < 0.55 and 0.3 < ratio["int4"] < 0.32, ratio


def test_bench_spec_smoke(tmp_path):
    """scripts/bench_spec.py on a tiny saved target (byte tokenizer) drafted by its own
    first layer: a row per drafter, identical tokens, the loop-timed verify forward."""
    from tiny_hf import save_tiny_checkpoint

    target = save_tiny_checkpoint(tmp_path / "tiny", seed=3)
    out = tmp_path / "spec.json"
    r = subprocess.run([sys.executable, "scripts/bench_spec.py", "--target", str(target),
                        "--drafters", "layers:1", "--k", "3", "--n-prompts", "2",
                        "--new-tokens", "8", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(out.read_text())
    plain, spec = report["rows"]
    assert plain["name"] == "plain decode" and spec["identical"] is True
    assert spec["verify_ms"] > 0 and report["plain_step_ms"] > 0 and spec["spec"]["rounds"] > 0
    assert "layers:1" in r.stdout and "acceptance by position" in r.stdout


def test_profile_spec_smoke(tmp_path):
    """scripts/profile_spec.py on a tiny saved target drafted by its first layer: both
    tables, each naming the decode's ops with their shares of the time."""
    from tiny_hf import save_tiny_checkpoint

    target = save_tiny_checkpoint(tmp_path / "tiny", seed=5)
    r = subprocess.run([sys.executable, "scripts/profile_spec.py", "--target", str(target),
                        "--drafter", "layers:1", "--new-tokens", "8", "--top", "5"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    heads = [i for i, line in enumerate(lines) if "ms of ops per" in line]
    assert len(heads) == 2 and "per token" in lines[heads[0]] and "per round" in lines[heads[1]]
    rows = [line for line in lines if line.startswith("  ") and "%" in line]
    assert len(rows) == 10 and not any(row.split()[-1] == "while" for row in rows), r.stdout
    assert any(("matmul" in row or "dot" in row) for row in rows), r.stdout
    # without a drafter: the plain table alone
    r = subprocess.run([sys.executable, "scripts/profile_spec.py", "--target", str(target),
                        "--new-tokens", "8", "--top", "5"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    heads = [line for line in r.stdout.splitlines() if "ms of ops per" in line]
    assert len(heads) == 1 and "per token" in heads[0], r.stdout


def test_draft_vocab_coverage_smoke(tmp_path):
    """scripts/draft_vocab_coverage.py on a tiny saved target: shares grow with the draft
    vocabulary and the whole vocabulary covers everything."""
    from tiny_hf import VOCAB, save_tiny_checkpoint

    target = save_tiny_checkpoint(tmp_path / "tiny", seed=4)
    r = subprocess.run([sys.executable, "scripts/draft_vocab_coverage.py", "--target", str(target),
                        "--n-prompts", "8", "--n-new", "6", "--gen-batch", "8", "--windows", "4",
                        "--heldout", "6", "--vocab", f"4,40,{VOCAB}", "--cache-dir",
                        str(tmp_path / "data")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    shares = [float(line.split()[1].rstrip("%")) for line in r.stdout.splitlines()[2:]]
    assert len(shares) == 3 and shares == sorted(shares) and shares[-1] == 100.0, r.stdout


def test_bench_engine_smoke(tmp_path):
    """scripts/bench_engine.py at small sizes, each part: the report has every figure, and
    the engine's tokens equal static batching's and the cache hit's equal the miss's."""
    out = tmp_path / "engine.json"
    r = subprocess.run([sys.executable, "scripts/bench_engine.py", "--batch", "4", "--new-tokens", "8",
                        "--pairs", "2", "--requests", "6", "--rate", "20", "--max-num-seqs", "2", "--json", str(out)],
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert len(report["decode"]["pairs"]) == 2 and report["decode"]["median_ratio"] > 0
    assert all(p["engine_tok_s"] > 0 and p["one_jit_tok_s"] > 0 for p in report["decode"]["pairs"])
    assert report["mixed"]["same_tokens"] == 6 and report["mixed"]["engine_s"] > 0
    assert report["prefix"]["same_tokens"] and report["prefix"]["cached_tokens"] >= 960


def test_engine_steps_prints_every_decode_bucket_and_the_ceiling():
    """scripts/engine_steps.py on SmolLM2 at 2 rows and a 128-token context: a line per
    decode bucket ([1, 1], [2, 1]), the batching ceiling 2 x t(1) / t(2) as printed, and
    the prefill lines."""
    r = subprocess.run([sys.executable, "scripts/engine_steps.py", "--max-num-seqs", "2", "--context", "128",
                        "--reps", "1"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    times = {}
    for line in r.stdout.splitlines():
        if line.strip().startswith("[") and ", 1]:" in line:
            rows = int(line.split("[")[1].split(",")[0])
            times[rows] = float(line.split(":")[1].split("ms")[0])
    assert sorted(times) == [1, 2] and all(t > 0 for t in times.values()), r.stdout
    ceiling = float(r.stdout.split("batching ceiling:")[1].split("=")[1].strip().rstrip("x\n").split()[0].rstrip("x"))
    assert ceiling == pytest.approx(2 * times[1] / times[2], rel=0.05), r.stdout
    assert r.stdout.count("prefill [") == 2, r.stdout
