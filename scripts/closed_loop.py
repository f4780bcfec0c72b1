"""An in-process closed loop over the engine: c clients, each sending its next request as soon
as its last one finished; prompts and output lengths from the corpora (`bench.workload`,
which `jaxdec bench serve` sends over HTTP). Prints output tokens/s with no HTTP in the way.

    python scripts/closed_loop.py --clients 16 --requests 96
    python scripts/closed_loop.py --clients 16 --requests 32 --ab-one-prefill-batch --runs 4

`--ab-one-prefill-batch` alternates runs of the engine as it is with runs of the engine as it
was before 43ae556, when a step's prompt chunks ran as one batch padded to its longest chunk
(a 200-token chunk beside three short ones ran [4, 256]). Prefix caching is off, so every
run computes every prompt; each variant runs once untimed first (it compiles its shapes).
"""

from __future__ import annotations

import argparse
import time
import types

import numpy as np

import jaxdec
from jaxdec import exec_cache
from jaxdec.bench.workload import workload
from jaxdec.engine.engine import Engine
from jaxdec.engine.request import SamplingParams


def one_prefill_batch(engine: Engine, plan):
    """The step's rows as before 43ae556: every prompt chunk in one batch, then the decodes."""
    chunks, decode = [x for x in plan if x[1] > 1], [x for x in plan if x[1] == 1]
    return [g for g in (chunks, decode) if g]


def closed_loop(engine: Engine, jobs, clients: int) -> tuple[float, int]:
    """Run `jobs` [(prompt ids, output tokens, _)] by `clients` clients -> (seconds, output tokens)."""
    pending = iter(jobs)

    def send():
        job = next(pending, None)
        if job is not None:
            engine.add_request(job[0], SamplingParams(max_tokens=job[1], ignore_eos=True))

    for _ in range(clients):
        send()
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens += len(out.request.output_ids)
                engine.forget(out.request_id)
                send()
    return time.perf_counter() - start, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--weights", default="gguf")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--context", type=int, default=1024, help="--max-model-len")
    ap.add_argument("--runs", type=int, default=1, help="timed runs (of each variant with --ab-...)")
    ap.add_argument("--ab-one-prefill-batch", action="store_true",
                    help="alternate with the engine before 43ae556 (one padded prefill batch a step)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", help="jaxdec's executable cache (as `jaxdec serve` keeps it)")
    args = ap.parse_args()
    if args.cache:
        exec_cache.enable(args.cache)
    model = jaxdec.load(args.model, weights=args.weights)
    engine = Engine(model, max_num_seqs=args.max_num_seqs, max_model_len=args.context,
                    enable_prefix_caching=False)
    engine.warmup()
    jobs = workload(model.tokenizer, args.requests, 1.0, args.seed)
    print(f"{len(jobs)} requests, {args.clients} clients: prompts {np.mean([len(j[0]) for j in jobs]):.0f} "
          f"tokens, outputs {np.mean([j[1] for j in jobs]):.0f} on average")
    variants = {"by chunk bucket": Engine._groups}
    if args.ab_one_prefill_batch:
        variants["one prefill batch"] = one_prefill_batch
    rates = {name: [] for name in variants}
    for run in range(args.runs + 1):  # (run 0 compiles what warmup did not, untimed)
        for name, groups in variants.items():
            engine._groups = types.MethodType(groups, engine)
            seconds, tokens = closed_loop(engine, jobs, args.clients)
            if run:
                rates[name].append(tokens / seconds)
                print(f"  run {run}, {name}: {tokens} tokens in {seconds:.1f} s, {tokens / seconds:.1f} tok/s")
    for name, r in rates.items():
        print(f"{name}: {np.median(r):.1f} tok/s (median of {len(r)})")
    if args.ab_one_prefill_batch:
        base = np.median(rates["one prefill batch"])
        print("by chunk bucket / one prefill batch, run by run: "
              + ", ".join(f"{a / b:.2f}x" for a, b in zip(rates["by chunk bucket"], rates["one prefill batch"]))
              + f"; medians {np.median(rates['by chunk bucket']) / base:.2f}x")


if __name__ == "__main__":
    main()
