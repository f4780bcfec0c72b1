"""Decode attention over the KV cache: the CPU kernel against XLA's reference ops.

For a batch of sequences with ragged visible lengths in a cache of fixed capacity, times one
decode step's attention in every layer (each layer with its own K/V, so nothing stays in
cache), with `layers.attention` (the kernel, T <= MAX_ATTENTION_T) and
`layers.attention_reference` (XLA's batched dots), side by side, and prints the ratio and
the bytes the kernel must read (the visible keys and values) per second.

    .venv/bin/python scripts/bench_attention.py [--batch 32] [--capacity 192] [--layers 30]
        [--heads 9 --kv-heads 3 --head-dim 64] [--dtype float32|bfloat16] [--repeats 10]

Defaults are SmolLM2-135M's shapes at batch 32 with 60-140 visible tokens per sequence.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxdec import layers
from jaxdec.ops import cpu_kernel


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--capacity", type=int, default=192)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args(argv)
    dt = jnp.dtype(a.dtype)
    b, n, k, h, s = a.batch, a.heads, a.kv_heads, a.head_dim, a.capacity + 1
    rng = np.random.default_rng(0)
    lengths = rng.integers(min(60, s - 1), min(140, s - 1) + 1, b)
    rand = lambda *shape: jnp.asarray(rng.standard_normal(shape).astype(np.float32), dt)
    q = rand(b, 1, n, h)
    ks = [rand(b, k, s, h) for _ in range(a.layers)]
    vs = [rand(b, k, h, s) for _ in range(a.layers)]
    step_k, step_v = rand(b, k, 1, h), rand(b, k, h, 1)
    mask = jnp.asarray(np.arange(s)[None, None, :] < lengths[:, None, None])
    own = jnp.ones((b, 1, 1), bool)

    def timed(fn) -> float:
        @jax.jit
        def run(q, ks, vs):
            out = q
            for kk, vv in zip(ks, vs):  # the output feeds the next layer: nothing hoisted
                out = fn(out, (kk, vv, mask), (step_k, step_v, own))
            return out
        jax.block_until_ready(run(q, ks, vs))
        best = float("inf")
        for _ in range(a.repeats):
            t = time.perf_counter()
            jax.block_until_ready(run(q, ks, vs))
            best = min(best, time.perf_counter() - t)
        return best

    kernel = timed(layers.attention) if cpu_kernel.available() else float("nan")
    xla = timed(layers.attention_reference)
    visible = float(lengths.sum() + b) * k * h * 2 * dt.itemsize * a.layers
    print(f"decode attention, {a.layers} layers, batch {b}, heads {n}/{k}x{h}, {a.dtype} cache of "
          f"{a.capacity}, {lengths.min()}-{lengths.max()} visible")
    print(f"  kernel          {kernel * 1e3:8.2f} ms/step  ({visible / kernel / 1e9:5.1f} GB/s of visible K/V)")
    print(f"  XLA reference   {xla * 1e3:8.2f} ms/step")
    print(f"  kernel / XLA speed-up: {xla / kernel:.2f}x")


if __name__ == "__main__":
    main()
