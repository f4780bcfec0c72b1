"""Where batch-1 decode time goes, for the performance work of issue 3.

    python scripts/profile_decode.py [--model smollm2] [--weights gguf] [--steps 30]
    python scripts/profile_decode.py --weights gguf --chunk 256 --steps 5   # a prompt chunk
    python scripts/profile_decode.py --weights gguf --trace 10             # per-op times

Prints the time of one jitted `decode_step` (the cache donated), of the layer stack alone
(no cache, one token), and of the LM head alone, each the mean over `--steps` calls
after warm-up. `--weights` is `jaxdec.load`'s (float32 when left out; `jaxdec serve` and
`jaxdec bench serve` run "gguf").

`--chunk T` times the layer stack on one T-token prompt chunk instead, and prints the
compiled program's temporaries (XLA's memory analysis). `--trace N` records N decode steps
with `jax.profiler` and prints each op's time a step (the XLA:CPU thunks: the kernel's
custom calls, `ffi_call.*`, and XLA's fusions), then one layer's ops in order.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxdec
from jaxdec import decode
from jaxdec.cache import dense
from jaxdec.models import transformer
from jaxdec.sampling import Greedy


def timed(fn, steps: int) -> float:
    jax.block_until_ready(fn())
    start = time.perf_counter()
    for _ in range(steps):
        jax.block_until_ready(fn())
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--weights", default=None, help="f32, bf16, int8, int4, gguf, ... (float32 when left out)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--chunk", type=int, default=0, help="time a prompt chunk of this many tokens")
    ap.add_argument("--trace", type=int, default=0, help="profile this many decode steps")
    args = ap.parse_args()
    model = jaxdec.load(args.model, weights=args.weights)
    cfg, params = model.cfg, model.params
    print(f"{args.model}, weights {args.weights or 'float32'}")
    if args.chunk:
        return chunk(params, cfg, args.chunk, args.steps)
    state = {"cache": dense.init_cache(cfg, 1, 256), "tok": jnp.array([1])}

    def step():
        state["tok"], state["cache"] = decode.decode_step(params, state["cache"], state["tok"],
                                                          jax.random.key(0), Greedy(), cfg)
        return state["tok"]

    stack = jax.jit(lambda p, t: transformer.hidden(p, t, jnp.zeros((1, 1), jnp.int32), None,
                                                    cfg)[0])
    head = jax.jit(transformer.logits_from_hidden)
    h = jnp.ones((1, 1, cfg.d_model), params.final_norm.dtype)  # (the activations' dtype)
    if args.trace:
        return trace(step, args.trace)
    print(f"decode_step      {timed(step, args.steps):7.2f} ms")
    print(f"layers, no cache {timed(lambda: stack(params, jnp.array([[1]])), args.steps):7.2f} ms")
    print(f"lm head          {timed(lambda: head(params, h), args.steps):7.2f} ms")


def chunk(params, cfg, t: int, steps: int) -> None:
    """The layer stack on one t-token chunk: ms a run, and the program's temporaries."""
    stack = jax.jit(lambda p, x: transformer.hidden(p, x, jnp.arange(t)[None], None, cfg)[0])
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, t)), jnp.int32)
    temp = stack.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes
    print(f"layers, [1, {t}] chunk {timed(lambda: stack(params, tokens), steps):7.1f} ms "
          f"(temporaries {temp / 1e6:.1f} MB)")


def trace(step, n: int) -> None:
    """Each XLA:CPU op's mean time a step over n profiled steps, then one layer in order."""
    for _ in range(3):
        jax.block_until_ready(step())
    with tempfile.TemporaryDirectory() as out:
        with jax.profiler.trace(out, create_perfetto_trace=True):
            for _ in range(n):
                jax.block_until_ready(step())
        (path,) = glob.glob(f"{out}/**/*.trace.json.gz", recursive=True)
        events = [e for e in json.load(gzip.open(path))["traceEvents"] if e.get("ph") == "X"]
    ops = [e for e in events if re.match(r"(ffi_call|[a-z_\-]+_fusion|wrapped_)", e["name"])]
    total, count = collections.Counter(), collections.Counter()
    for e in ops:
        kind = re.sub(r"[._]\d+$", "", e["name"])
        total[kind] += e["dur"] / n
        count[kind] += 1 / n
    for kind, us in total.most_common(12):
        print(f"{us / 1000:8.3f} ms a step  {count[kind]:6.1f} a step  {kind}")
    calls = sorted({e["name"] for e in ops if e["name"].startswith("ffi_call.")},
                   key=lambda name: int(name.split(".")[1]))
    first = calls[len(calls) // 2]  # a call in a middle layer, then the 7 after it
    mean = {c: sum(e["dur"] for e in ops if e["name"] == c) / n for c in calls}
    print("calls in order from the middle of the stack (us):",
          " ".join(f"{mean[c]:.0f}" for c in calls[calls.index(first):calls.index(first) + 8]))


if __name__ == "__main__":
    main()
