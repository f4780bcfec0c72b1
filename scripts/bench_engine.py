"""The engine under load, each figure beside its reference in the same run.

    python scripts/bench_engine.py --model smollm2 [--parts decode,mixed,prefix] [--json out.json]

1. **Batch-32 decode.** 32 concurrent greedy requests through the engine against the
   one-jit batch-32 decode that `jaxdec bench` times (`decode.start` + `decode.advance`,
   no stops), as output tok/s of the decode phase; the engine's rate counts the steps
   after every prompt ran.
2. **Mixed workload.** 64 requests whose prompts and output lengths come from the corpora
   (a prose or code document's opening; output lengths drawn from the lengths of other
   documents, clipped to [8, 128]; `jaxdec.bench.workload`, which `jaxdec bench serve`
   sends to the HTTP servers), arriving as a Poisson process, through the engine
   against static batching of the same requests: groups of `max_num_seqs` in arrival
   order, each group run to completion by `jaxdec.generate` once its last request arrived.
   Reported: the time until the last request finished (makespan), and its ratio.
3. **Prefix caching.** A 1,000-token prompt twice through one engine: the second prefill
   (time to first token) over the first, with identical tokens.

Everything is warmed before it is timed (the engine compiles all its buckets first).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from jaxdec.bench.workload import workload


def one_jit_decoder(model, prompt, batch: int, n_new: int):
    """-> a function timing one decode phase of `jaxdec bench`'s batch generation (output
    tok/s), compiled by a first run."""
    import jax

    from jaxdec import decode
    from jaxdec.cache import dense
    from jaxdec.sampling import Greedy

    tokens = np.tile(np.asarray(prompt, np.int32), (batch, 1))
    lens = np.full(batch, len(prompt), np.int32)
    limits = np.full(batch, n_new, np.int32)
    static = dict(sampler=Greedy(), cfg=model.cfg, stop_ids=())

    def rate() -> float:
        cache = dense.init_cache(model.cfg, batch, -(-(len(prompt) + n_new) // 64) * 64, model.dtype)
        p, cache = decode.start(model.params, cache, tokens, lens, jax.random.key(0), limits,
                                max_new_tokens=n_new, **static)
        jax.block_until_ready(p)
        t = time.perf_counter()
        p, cache = decode.advance(model.params, cache, p, jax.random.key(0), limits, n_new, **static)
        jax.block_until_ready(p)
        return batch * (n_new - 1) / (time.perf_counter() - t)

    rate()
    return rate


def engine_decoder(model, prompt, batch: int, n_new: int):
    """-> a function timing the decode phase of `batch` concurrent greedy requests through
    one warmed engine (output tok/s of the steps after every prompt ran)."""
    from jaxdec.engine.engine import Engine
    from jaxdec.engine.request import SamplingParams

    engine = Engine(model, max_num_seqs=batch, max_num_batched_tokens=max(256, len(prompt) * 4),
                    max_model_len=-(-(len(prompt) + n_new) // 64) * 64)
    engine.warmup()
    params = SamplingParams(max_tokens=n_new, ignore_eos=True)

    def rate() -> float:
        ids = [engine.add_request(list(prompt), params) for _ in range(batch)]
        while any(engine.requests[i].n_computed < len(prompt) for i in ids):
            engine.step()
        done = engine.counters["generation_tokens"]
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return (engine.counters["generation_tokens"] - done) / (time.perf_counter() - t)

    return rate


def decode_rates(model, prompt, batch: int, n_new: int, pairs: int = 3) -> list[tuple[float, float]]:
    """(engine, one-jit) tok/s, measured in alternation `pairs` times: a pair shares the
    machine's state, so their ratio holds when the host's speed drifts."""
    one_jit, engine = one_jit_decoder(model, prompt, batch, n_new), engine_decoder(model, prompt, batch, n_new)
    return [(engine(), one_jit()) for _ in range(pairs)]


def run_engine(model, load, max_num_seqs: int) -> tuple[float, list]:
    from jaxdec.engine.engine import Engine
    from jaxdec.engine.request import SamplingParams

    engine = Engine(model, max_num_seqs=max_num_seqs, max_num_batched_tokens=256, max_model_len=576)
    engine.warmup()
    start, pending, ids = time.perf_counter(), list(load), []
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0][2] <= now:
            prompt, m, _ = pending.pop(0)
            ids.append(engine.add_request(prompt, SamplingParams(max_tokens=m, ignore_eos=True)))
        if engine.has_unfinished():
            engine.step()
        else:
            time.sleep(min(0.01, max(0.0, pending[0][2] - now)))
    return time.perf_counter() - start, [engine.requests[i].output_ids for i in ids]


def run_static(model, load, max_num_seqs: int) -> tuple[float, list]:
    from jaxdec import api

    groups = [load[i:i + max_num_seqs] for i in range(0, len(load), max_num_seqs)]
    for g in groups[:2]:  # warm the shapes static batching will use
        api.generate_ids(model, [p for p, _, _ in g], max_new_tokens=max(m for _, m, _ in g), stop_ids=())
    start, outs = time.perf_counter(), []
    for g in groups:
        wait = g[-1][2] - (time.perf_counter() - start)
        if wait > 0:
            time.sleep(wait)
        res = api.generate_ids(model, [p for p, _, _ in g], max_new_tokens=max(m for _, m, _ in g),
                               stop_ids=())
        outs += [ids[:m] for ids, (_, m, _) in zip(res.token_ids, g)]
    return time.perf_counter() - start, outs


def prefix_caching(model, n_tokens: int = 1000):
    from jaxdec import corpora
    from jaxdec.engine.engine import Engine
    from jaxdec.engine.request import SamplingParams

    text = " ".join(corpora.corpus_documents("prose")[:400])
    prompt = model.tokenizer.encode(text)[:n_tokens]
    engine = Engine(model, max_num_seqs=2, max_num_batched_tokens=256, max_model_len=1088)
    engine.warmup()
    runs = []
    for _ in range(2):
        rid = engine.add_request(prompt, SamplingParams(max_tokens=8))
        t = time.perf_counter()
        while not engine.requests[rid].output_ids:
            engine.step()
        runs.append(time.perf_counter() - t)
        while engine.has_unfinished():
            engine.step()
    first, second = (engine.requests[f"req-{i}"] for i in range(2))
    return runs, second.n_cached, first.output_ids == second.output_ids


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--weights", default="f32")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=3, help="alternated decode measurements")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parts", default="decode,mixed,prefix", help="which of the three to run")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    parts = set(a.parts.split(","))
    if not parts <= {"decode", "mixed", "prefix"}:
        ap.error(f"--parts takes decode, mixed and prefix, not {a.parts}")

    import jaxdec

    model = jaxdec.load(a.model, weights=a.weights)
    report = {"model": a.model, "weights": a.weights}
    prompt = model.tokenizer.encode("The history of the printing press begins")

    if "decode" in parts:
        pairs = decode_rates(model, prompt, a.batch, a.new_tokens, a.pairs)
        ratios = [e / o for e, o in pairs]
        report["decode"] = dict(batch=a.batch, pairs=[dict(engine_tok_s=round(e, 1), one_jit_tok_s=round(o, 1))
                                                      for e, o in pairs], median_ratio=round(float(np.median(ratios)), 3))
        for e, o in pairs:  # (a step makes one token per row: ms per step = batch / rate)
            print(f"batch-{a.batch} decode: engine {e:.1f} tok/s ({1e3 * a.batch / e:.0f} ms a step), one-jit "
                  f"bench {o:.1f} tok/s ({1e3 * a.batch / o:.0f} ms a step), ratio {e / o:.3f}")
        print(f"batch-{a.batch} decode: median ratio {np.median(ratios):.3f} over {len(pairs)} pairs "
              "(target >= 0.8)", flush=True)
    if "mixed" in parts:
        mixed(model, a, report)
    if "prefix" in parts:
        prefix_report(model, report)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def mixed(model, a, report) -> None:
    load = workload(model.tokenizer, a.requests, a.rate, a.seed)
    t_engine, out_engine = run_engine(model, load, a.max_num_seqs)
    t_static, out_static = run_static(model, load, a.max_num_seqs)
    same = sum(x == y for x, y in zip(out_engine, out_static))
    report["mixed"] = dict(requests=a.requests, rate=a.rate, max_num_seqs=a.max_num_seqs,
                           engine_s=round(t_engine, 2), static_s=round(t_static, 2),
                           speedup=round(t_static / t_engine, 3), same_tokens=same)
    print(f"mixed workload ({a.requests} requests, {a.rate}/s): engine {t_engine:.1f} s, static "
          f"batching {t_static:.1f} s, {t_static / t_engine:.2f}x (target >= 2); identical tokens "
          f"in {same}/{a.requests}", flush=True)


def prefix_report(model, report) -> None:
    (first, second), cached, same = prefix_caching(model)
    report["prefix"] = dict(first_ttft_s=round(first, 3), second_ttft_s=round(second, 3),
                            ratio=round(second / first, 3), cached_tokens=cached, same_tokens=same)
    print(f"1000-token prompt: first prefill {first:.2f} s, repeated {second:.3f} s "
          f"({second / first:.3f}; target <= 0.1), {cached} tokens from the cache, "
          f"identical tokens: {same}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
