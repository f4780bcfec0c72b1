"""The engine's step time per compiled shape: decode batches of 1, 2, 4, ... rows and a few
prefill batches, on random tokens over a filled table, median of `--reps` runs each.

    python scripts/engine_steps.py --model smollm2 --max-num-seqs 16 --context 1024
    python scripts/engine_steps.py --first-calls [--cache DIR]   # what each shape's first call costs
    python scripts/engine_steps.py --maps [--cache DIR]          # each shape's load time and memory maps

`--first-calls` times, for every shape the engine can run (`Engine.shapes()`), its first
call after it was compiled (or loaded from jaxdec's executable cache, `--cache`) and a second
call: the difference is what a fresh server pays the first time its load reaches that shape.

What the decode-row buckets buy: a row costs compute on a CPU, so a lone request's step at
[1, 1] is several times faster than one padded to [max_num_seqs, 1]; 16 x t(1) / t(16) is
the most that batching decode rows can raise the token rate on this host.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

import jaxdec
from jaxdec import exec_cache
from jaxdec.engine.engine import Engine


def step_ms(engine: Engine, b: int, c: int, p: int, reps: int, rng: np.random.Generator) -> float:
    """Median ms of the step of shape [b, c] over a table of width p: each row's c new tokens
    after 100 cached ones, in pages of its own (the first run, which warms caches, left out)."""
    return float(np.median(calls_ms(engine, b, c, p, reps + 1, rng)[1:]))


def calls_ms(engine: Engine, b: int, c: int, p: int, n: int, rng: np.random.Generator) -> list[float]:
    """The ms of n calls in a row of the step of shape [b, c] over a table of width p."""
    args = list(engine._inputs([], b, c, p)[0])
    args[2] = (np.arange(b * p, dtype=np.int32).reshape(b, p)) % engine.pool.n_pages
    args[3] = rng.integers(0, engine.cfg.vocab_size, (b, c)).astype(np.int32)
    args[4] = np.tile(np.arange(100, 100 + c, dtype=np.int32), (b, 1))
    args[5] = np.full(b, 100, np.int32)
    args[6] = np.full(b, c - 1, np.int32)
    run = engine._executable(b, c, p, tuple(args))
    times = []
    for _ in range(n):
        args[1] = engine.pools
        start = time.perf_counter()
        out = run(*args)
        jax.block_until_ready(out[0])
        times.append(1000 * (time.perf_counter() - start))
        engine.pools = out[3]
    return times


def first_calls(engine: Engine, rng: np.random.Generator) -> None:
    """Each shape's first and second call, after `warmup` compiled or loaded them all."""
    start = time.perf_counter()
    n = engine.warmup()
    print(f"{n} shapes compiled or loaded in {time.perf_counter() - start:.1f} s")
    total = [0.0, 0.0]
    for b, c, p in engine.shapes():
        first, second = calls_ms(engine, b, c, p, 2, rng)
        total[0] += first
        total[1] += second
        print(f"  [{b}, {c}] over {p} pages: first call {first:.0f} ms, second {second:.0f} ms "
              f"(+{first - second:.0f})")
    print(f"every shape once: first calls {total[0] / 1000:.1f} s, second calls {total[1] / 1000:.1f} s "
          f"(the first calls' extra: {(total[0] - total[1]) / 1000:.1f} s)")


def maps(engine: Engine) -> None:
    """Each shape compiled (or loaded from `--cache`) one at a time: its seconds and the memory
    maps it added (XLA:CPU's JIT; the process dies at vm.max_map_count)."""
    from jaxdec.engine.engine import memory_maps

    start, limit = memory_maps()
    for s in engine.shapes():
        before, t = memory_maps()[0], time.perf_counter()
        engine._executable(*s, engine._inputs([], *s)[0])
        print(f"  {list(s[:2])} over {s[2]} pages: {time.perf_counter() - t:.2f} s, "
              f"+{memory_maps()[0] - before} maps", flush=True)
    print(f"{len(engine.shapes())} shapes: +{memory_maps()[0] - start} maps, {memory_maps()[0]} of {limit}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--weights", default="gguf")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--context", type=int, default=1024, help="--max-model-len")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--first-calls", action="store_true", help="each shape's first call against its second")
    ap.add_argument("--maps", action="store_true", help="each shape's compile or load time and memory maps")
    ap.add_argument("--cache", help="jaxdec's executable cache (as `jaxdec serve` keeps it)")
    args = ap.parse_args()
    if args.cache:
        exec_cache.enable(args.cache)
    engine = Engine(jaxdec.load(args.model, weights=args.weights), max_num_seqs=args.max_num_seqs,
                    max_model_len=args.context)
    rng = np.random.default_rng()
    if args.first_calls:
        return first_calls(engine, rng)
    if args.maps:
        return maps(engine)
    widths = engine.sizes["pages"]
    p = widths[min(1, len(widths) - 1)]  # (a short context has one width)
    rows = engine.sizes["decode_rows"]
    decode = {b: step_ms(engine, b, 1, p, args.reps, rng) for b in rows}
    print(f"decode step, {p} pages a row ({args.model}, {jax.devices()[0].platform}):")
    for b, ms in decode.items():
        print(f"  [{b}, 1]: {ms:.1f} ms ({ms / b:.2f} ms a token)")
    print(f"  batching ceiling: {rows[-1]} x t(1) / t({rows[-1]}) = {rows[-1] * decode[1] / decode[rows[-1]]:.2f}x")
    c = engine.sizes["prefill_chunk"][-1]
    need = -(-(100 + c) // engine.page_size)  # (100 cached tokens, then the chunk)
    for b in (1, engine.sizes["prefill_rows"][-1]):
        for p in dict.fromkeys((next((w for w in widths if w >= need), widths[-1]), widths[-1])):
            ms = step_ms(engine, b, c, p, args.reps, rng)
            print(f"prefill [{b}, {c}] over {p} pages: {ms:.0f} ms ({ms / (b * c):.2f} ms a token)")

if __name__ == "__main__":
    main()
