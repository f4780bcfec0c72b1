"""`jaxdec bench`: decode speed of jaxdec and its peers, side by side, in one run.

Every system runs in its own process on the same GGUF, prompts and settings (see
`peers` for the protocol), so peak RSS is each one's own. This process measures the
machine's streaming-read bandwidth first; the ceiling of a decode step is the bytes it
must read (every matmul weight once, plus the KV cache of every row at the mean context)
divided by that bandwidth. The CLI's time to first token is measured as the wall time of
`jaxdec generate --max-new-tokens 1`, with an empty compile cache (cold) and again with
it filled (warm).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np

from jaxdec.bench import host, peers
from jaxdec.bench.roofline import bandwidth_gbs, step_bytes

# A fixed English passage: the prompts are its first 32 and 512 tokens (repeated as needed).
TEXT = ("The history of the lighthouse is a history of coastal trade. Before radio and "
        "satellite navigation, a ship approaching land at night relied on a chain of lights, "
        "each with its own rhythm of flashes, to tell one headland from the next. Keepers "
        "trimmed wicks, wound the clockwork that turned the lens, and logged the weather "
        "every few hours. ")


@dataclasses.dataclass(frozen=True)
class Settings:
    model: str = "smollm2"
    weights: tuple[str, ...] = ("f32", "gguf")
    peers: tuple[str, ...] = ("hf", "llama.cpp")
    batches: tuple[int, ...] = (1, 8, 32, 64)
    prompt_len: int = 32
    prefill_len: int = 512
    new_tokens: int = 128
    repeats: int = 3
    threads: int = os.cpu_count() or 1
    ttft: bool = True
    timeout_s: float = 1500.0


def prompts(tokenizer, s: Settings) -> tuple[list[int], list[int]]:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    ids = (ids * (s.prefill_len // len(ids) + 1))
    return ids[: s.prompt_len], ids[: s.prefill_len]


def _cli_ttft(s: Settings, weights: str, cache_dir: str, prompt: str) -> float:
    """Seconds from starting `jaxdec generate` to the first byte of generated text on its
    stdout (streamed: the CLI prints the first id as soon as the prefill has produced it)."""
    cmd = [sys.executable, "-m", "jaxdec", "generate", "--model", s.model, "--weights", weights,
           "--prompt", prompt, "--max-new-tokens", "4"]
    env = {**os.environ, "JAXDEC_XLA_CACHE": cache_dir, "PYTHONUNBUFFERED": "1"}
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = proc.stdout.read(1)
    elapsed = time.perf_counter() - t
    _, err = proc.communicate(timeout=600)
    if proc.returncode != 0 or not first:
        raise RuntimeError(err.decode().strip().splitlines()[-1] if err else "no output")
    return elapsed


def cli_ttft(s: Settings, weights: str, prompt: str) -> dict:
    """Whole-CLI time to first token (start-up, load, compile or cache hit, prefill): cold
    with an empty compile cache, then warm (best of the repeats) with it filled. Each warm
    repeat is a pair, interleaved: first without the list of programs the run before used
    (`exec_cache.prefetch` finds none to load while the model loads), then with it."""
    with tempfile.TemporaryDirectory(prefix="jaxdec_bench_cache_") as cache:
        try:
            cold = _cli_ttft(s, weights, cache, prompt)
            plain, warm = [], []
            for _ in range(max(2, s.repeats)):
                for listed in pathlib.Path(cache, "exec").glob("recent-*.txt"):
                    listed.unlink()
                plain.append(_cli_ttft(s, weights, cache, prompt))  # lists them again
                warm.append(_cli_ttft(s, weights, cache, prompt))
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            return {"error": str(e)}
    return {"cold_s": round(cold, 3), "warm_s": round(min(warm), 3),
            "warm_no_prefetch_s": round(min(plain), 3)}


def run(s: Settings, log=print) -> dict:
    import jaxdec
    from jaxdec.checkpoint import registry

    gguf = str(registry.resolve(s.model)) if s.model in registry.MODELS else s.model
    log("measuring streaming-read bandwidth ...")
    bw = bandwidth_gbs()
    log(f"  {bw:.1f} GB/s")
    base = {"host": host(), "gguf": gguf, "model": s.model, "threads": s.threads, "batches": list(s.batches),
            "new_tokens": s.new_tokens, "repeats": s.repeats}
    short, long = prompts(_tokenizer(s), s)  # the same ids for every system, peers alone too
    base |= {"prompt_ids": short, "prefill_ids": long}
    systems: dict[str, dict] = {}
    ceilings: dict[str, dict] = {}
    for w in s.weights:
        model = jaxdec.load(s.model, weights=w)
        context = s.prompt_len + s.new_tokens // 2
        ceilings[w] = {str(b): round(b * bw * 1e9 / step_bytes(model, b, context), 2)
                       for b in s.batches}
        del model
        log(f"jaxdec [{w}] ...")
        result = peers.run_peer({**base, "peer": "jaxdec", "weights": w}, s.timeout_s)
        if s.ttft and "error" not in result:
            result["cli_ttft"] = cli_ttft(s, w, model_prompt_text(short, s))
        systems[f"jaxdec {w}"] = result
        log(f"  {_brief(result)}")
    for peer in s.peers:
        dtypes = ["float32"] if peer != "llama.cpp" else [None]
        for dtype in dtypes:
            log(f"{peer} ...")
            result = peers.run_peer({**base, "peer": peer, "dtype": dtype}, s.timeout_s)
            systems[peer + (f" {dtype}" if dtype else "")] = result
            log(f"  {_brief(result)}")
    agreement = _agreement(systems)
    return {"settings": dataclasses.asdict(s), "bandwidth_gbs": round(bw, 2),
            "ceiling_tok_s": ceilings, "systems": systems, "greedy_agreement": agreement}


def model_prompt_text(ids: list[int], s: Settings) -> str:
    """The CLI takes text: the 32-token prompt as text (re-encoding gives ~the same ids)."""
    return _tokenizer(s).decode(ids)


def _tokenizer(s: Settings):
    """The model's tokenizer, read from the GGUF header alone (no weights)."""
    from jaxdec.checkpoint import registry
    from jaxdec.checkpoint.gguf_reader import read_gguf_header
    from jaxdec.checkpoint.tokenizer import Tokenizer

    path = registry.resolve(s.model) if s.model in registry.MODELS else s.model
    return Tokenizer.from_gguf(read_gguf_header(path).metadata)


def _brief(r: dict) -> str:
    if "error" in r and not r.get("decode_tok_s"):
        return "error: " + r["error"]
    return f"decode {r.get('decode_tok_s')} tok/s, prefill {r.get('prefill_tok_s')} tok/s"


def _agreement(systems: dict) -> dict:
    """Greedy ids at batch 1 of every system against jaxdec f32 (or the first jaxdec run):
    the number of leading tokens that agree."""
    ref_name = next((n for n in systems if n == "jaxdec f32"), next(iter(systems), None))
    ref = systems.get(ref_name, {}).get("greedy_ids") or []
    out = {}
    for name, r in systems.items():
        ids = r.get("greedy_ids") or []
        same = next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), min(len(ids), len(ref)))
        out[name] = {"vs": ref_name, "leading_tokens_equal": same, "of": len(ref)}
    return out


def table(report: dict) -> str:
    """Rows: metrics; columns: systems; then each jaxdec run's ratio to each peer and to
    its bandwidth ceiling."""
    systems = report["systems"]
    names = list(systems)
    batches = report["settings"]["batches"]
    rows = [("prefill tok/s (512)", lambda r: r.get("prefill_tok_s"))]
    rows += [(f"decode tok/s b={b}", lambda r, b=b: r.get("decode_tok_s", {}).get(str(b)))
             for b in batches]
    rows += [("decode tok/s b=1 streamed", lambda r: r.get("streamed_decode_tok_s")),
             ("TTFT s (in process, warm)", lambda r: r.get("ttft_s")),
             ("CLI TTFT s warm", lambda r: r.get("cli_ttft", {}).get("warm_s")),
             ("CLI TTFT s warm, no prefetch",
              lambda r: r.get("cli_ttft", {}).get("warm_no_prefetch_s")),
             ("CLI TTFT s cold", lambda r: r.get("cli_ttft", {}).get("cold_s")),
             ("load s", lambda r: r.get("load_s")),
             ("peak RSS MiB", lambda r: r.get("peak_rss_mb"))]
    fmt = lambda v: "-" if v is None else (f"{v:.3g}" if isinstance(v, float) and v < 10
                                           else f"{v:.1f}" if isinstance(v, float) else str(v))
    width = max([14, *(len(n) for n in names)])
    out = [f"host: {report.get('host', '?')}",
           f"bandwidth {report['bandwidth_gbs']} GB/s (f32 matvec, {report['settings']['threads']} threads)",
           "metric".ljust(28) + "".join(n.rjust(width + 2) for n in names)]
    for label, get in rows:
        out.append(label.ljust(28) + "".join(fmt(get(systems[n])).rjust(width + 2) for n in names))
    out.append("")
    out.append("ratios (decode tok/s; >1 means jaxdec is faster)")
    for n in names:
        if not n.startswith("jaxdec"):
            continue
        w = n.split(" ", 1)[1]
        for b in batches:
            mine = systems[n].get("decode_tok_s", {}).get(str(b))
            if mine is None:
                continue
            ceil = report["ceiling_tok_s"].get(w, {}).get(str(b))
            parts = [f"{n} b={b}: {mine:.1f} tok/s = {mine / ceil:.2f} of ceiling {ceil:.0f}"
                     if ceil else f"{n} b={b}: {mine:.1f}"]
            for p in names:
                theirs = systems[p].get("decode_tok_s", {}).get(str(b))
                if not p.startswith("jaxdec") and theirs:
                    parts.append(f"{mine / theirs:.2f}x {p}")
            out.append("  " + "; ".join(parts))
        b1 = systems[n].get("decode_tok_s", {}).get("1")
        if b1:
            for b in batches[1:]:
                bb = systems[n].get("decode_tok_s", {}).get(str(b))
                if bb:
                    out.append(f"  {n}: batch {b} / batch 1 throughput = {bb / b1:.1f}x")
            frac = systems[n].get("ceiling_fraction_b1")
            if frac:
                out.append(f"  {n}: batch 1 = {frac:.2f} of its ceiling (interleaved pairs with "
                           f"the bandwidth probe)")
            ratio = systems[n].get("stream_ratio")
            if ratio:
                out.append(f"  {n}: streamed / one-jit decode = {ratio:.2f} (interleaved pairs)")
    out.append("")
    out.append("greedy agreement at batch 1 (leading tokens equal):")
    for n, a in report["greedy_agreement"].items():
        out.append(f"  {n}: {a['leading_tokens_equal']}/{a['of']} vs {a['vs']}")
    errors = [f"  {n}: {r['error']}" for n, r in systems.items() if r.get("error")]
    if errors:
        out += ["", "errors:"] + errors
    return "\n".join(out)


def main(s: Settings, json_path: str | None = None) -> int:
    report = run(s, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(table(report))
    if json_path:
        pathlib.Path(json_path).write_text(json.dumps(report, indent=1))
        print(f"\nwrote {json_path}")
    return 0
