"""Benchmark the CPU matmul kernel (quantised and dense weights) against XLA.

For each weight shape [K, N] (SmolLM2-135M and Qwen2.5-0.5B decode matmuls) and M rows of x,
prints the time per call and the effective bandwidth (stored weight bytes / time: f32 weights
for the f32 dot, codes + f16 scales for the quantised variants) of:

  f32 dot    XLA `x @ W` with W f32[K, N]
  bf16 dot   XLA `jnp.dot(x, W, preferred_element_type=f32)` with W bf16[K, N]
  bf16x dot  the same with x rounded to bf16 too (a bf16 model's activations)
  kf32/kbf16 the C++ kernel on W f32 / bf16                    (`dense_matmul`)
  deq8/deq4  XLA dequantise (int8 / int4 codes -> f32) + dot   (`qmatmul_xla`)
  k8/k4      the C++ kernel on int8 / int4 codes               (`qmatmul`)

Each call is timed inside a jitted `fori_loop` of R calls (x feeds back through a tiny add so
nothing is hoisted), so Python dispatch is excluded; medians of several runs, the variants
interleaved so that load from other processes hits them alike.  The same weights every call:
small ones stay in L2/L3.  Then a chain of 30 straight-line calls (576x1536), each with its own
weights (not cache-hot: 30 x 3.5 MB in f32), in one jit exposes per-call overhead and streaming.

The kernel variants always run the kernel here, also at M >= MAX_KERNEL_M / MAX_DENSE_KERNEL_M
where `qmatmul` / `dense_matmul` themselves hand over to XLA: the table is what sets those.
Crossover for dense weights: --m 1,8,32,64,128,512 --variants "f32 dot,kf32,bf16 dot,bf16x dot,kbf16".

    .venv/bin/python scripts/bench_qmatmul.py [--quick] [--m 1,8] [--shapes smol|qwen|all]
        [--variants "f32 dot,kf32,..."] [--chain-only]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxdec.ops import cpu_kernel as ck  # noqa: E402

SMOL = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]
QWEN = [(896, 896), (896, 128), (896, 4864), (4864, 896), (896, 151936)]
G = 32


def make(K, N, rng):
    w = rng.standard_normal((K, N), dtype=np.float32) * 0.05
    q8 = rng.integers(-127, 128, (K, N), dtype=np.int8)
    q4 = rng.integers(0, 256, (K // 2, N), dtype=np.uint8)
    s = (rng.random((K // G, N), dtype=np.float32) * 0.01 + 1e-3).astype(np.float16)
    return w, q8, q4, s


def variants(K, N, rng, offset: bool):
    w, q8, q4, s = make(K, N, rng)
    o = (rng.standard_normal((K // G, N)) * 0.01).astype(np.float16) if offset else None
    sb = s.nbytes * (2 if offset else 1)
    wb = jnp.asarray(w, jnp.bfloat16)
    return {
        "f32 dot": (lambda x, w: x @ w, (jnp.asarray(w),), w.nbytes),
        "kf32": (ck.dense_matmul, (jnp.asarray(w),), w.nbytes),
        "bf16 dot": (ck.dense_matmul_xla, (wb,), wb.nbytes),
        "bf16x dot": (lambda x, w: ck.dense_matmul_xla(x.astype(jnp.bfloat16), w), (wb,), wb.nbytes),
        "kbf16": (ck.dense_matmul, (wb,), wb.nbytes),
        "deq8": (lambda x, q, s, o: ck.qmatmul_xla(x, q, s, o, bits=8, group_size=G),
                 (jnp.asarray(q8), jnp.asarray(s), None if o is None else jnp.asarray(o)), q8.nbytes + sb),
        "deq4": (lambda x, q, s, o: ck.qmatmul_xla(x, q, s, o, bits=4, group_size=G),
                 (jnp.asarray(q4), jnp.asarray(s), None if o is None else jnp.asarray(o)), q4.nbytes + sb),
        "k8": (lambda x, q, s, o: ck.qmatmul(x, q, s, o, bits=8, group_size=G),
               (jnp.asarray(q8), jnp.asarray(s), None if o is None else jnp.asarray(o)), q8.nbytes + sb),
        "k4": (lambda x, q, s, o: ck.qmatmul(x, q, s, o, bits=4, group_size=G),
               (jnp.asarray(q4), jnp.asarray(s), None if o is None else jnp.asarray(o)), q4.nbytes + sb),
    }


def looped(fn, reps):
    """jit(x, *w) -> x after `reps` calls, each feeding a little of y back into x.  The weights
    ride in the loop carry through an optimization barrier together with x, so XLA cannot
    hoist loop-invariant work (the dequantisation) out of the loop."""

    def run(x, *w):
        def body(_, carry):
            x, w = jax.lax.optimization_barrier(carry)
            y = fn(x, *w)
            return x + y[:, :1] * 1e-30, w
        return jax.lax.fori_loop(0, reps, body, (x, w))[0]

    return jax.jit(run)


def time_variants(fns, x, budget_s, min_runs=5):
    """Interleaved medians of per-call seconds for each (name, (jitted, args, reps))."""
    times = {k: [] for k in fns}
    for k, (f, args, reps) in fns.items():  # warm-up (compile)
        jax.block_until_ready(f(x, *args))
    t_end = time.perf_counter() + budget_s
    runs = 0
    while runs < min_runs or (time.perf_counter() < t_end and runs < 50):
        for k, (f, args, reps) in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(x, *args))
            times[k].append((time.perf_counter() - t0) / reps)
        runs += 1
    return {k: float(np.median(v)) for k, v in times.items()}


def estimate_reps(fn, args, x, target_s=0.02):
    f1 = looped(fn, 1)
    jax.block_until_ready(f1(x, *args))
    t0 = time.perf_counter()
    for _ in range(3):
        jax.block_until_ready(f1(x, *args))
    dt = (time.perf_counter() - t0) / 3
    return int(max(1, min(2000, target_s / max(dt, 1e-6))))


def bench_table(shapes, Ms, offset, budget_s, names):
    rng = np.random.default_rng(0)
    hdr = f"{'K':>5} {'N':>6} {'M':>4} | " + " | ".join(f"{n:>19}" for n in names)
    print(hdr)
    print("-" * len(hdr))
    for K, N in shapes:
        vs = variants(K, N, rng, offset)
        for M in Ms:
            x = jnp.asarray(rng.standard_normal((M, K), dtype=np.float32))
            fns = {}
            for n in names:
                fn, args, nbytes = vs[n]
                reps = estimate_reps(fn, args, x)
                fns[n] = (looped(fn, reps), args, reps)
            t = time_variants(fns, x, budget_s)
            cells = []
            for n in names:
                nbytes = vs[n][2]
                cells.append(f"{t[n] * 1e6:9.1f}us {nbytes / t[n] / 1e9:5.1f}GB/s")
            print(f"{K:>5} {N:>6} {M:>4} | " + " | ".join(cells), flush=True)


def bench_chain(n_calls=30, K=576, N=1536, M=1, budget_s=3.0, names=None):
    """n_calls straight-line matmuls in one jit, each with its own weights:
    x -> (x @ W_i)[:, :K] * 0.5 -> ..."""
    rng = np.random.default_rng(1)
    ws = [make(K, N, rng) for _ in range(n_calls)]
    W = [jnp.asarray(w) for w, _, _, _ in ws]
    Wb = [jnp.asarray(w, jnp.bfloat16) for w in W]
    Q8 = [(jnp.asarray(q8), jnp.asarray(s)) for _, q8, _, s in ws]
    Q4 = [(jnp.asarray(q4), jnp.asarray(s)) for _, _, q4, s in ws]

    def chain(matmul, **kw):
        def f(x, ws):
            for w in ws:
                x = matmul(x, *w, **kw)[:, :K] * 0.5
            return x
        return jax.jit(f)

    one = lambda ws: [(w,) for w in ws]
    x = jnp.asarray(rng.standard_normal((M, K), dtype=np.float32))
    fns = {  # name: (jitted chain, weights, bytes of one call's weights)
        "f32 dot": (chain(jnp.matmul), one(W), W[0].nbytes),
        "kf32": (chain(ck.dense_matmul), one(W), W[0].nbytes),
        "bf16 dot": (chain(ck.dense_matmul_xla), one(Wb), Wb[0].nbytes),
        "kbf16": (chain(ck.dense_matmul), one(Wb), Wb[0].nbytes),
        "deq8": (chain(ck.qmatmul_xla, bits=8, group_size=G), [q + (None,) for q in Q8],
                 Q8[0][0].nbytes + Q8[0][1].nbytes),
        "k8": (chain(ck.qmatmul, bits=8, group_size=G), [q + (None,) for q in Q8],
               Q8[0][0].nbytes + Q8[0][1].nbytes),
        "k4": (chain(ck.qmatmul, bits=4, group_size=G), [q + (None,) for q in Q4],
               Q4[0][0].nbytes + Q4[0][1].nbytes),
    }
    if names:
        fns = {k: v for k, v in fns.items() if k in names} or fns
    t = time_variants({k: (f, (w,), n_calls) for k, (f, w, _) in fns.items()}, x, budget_s)
    print(f"\nchain of {n_calls} x ({K}x{N}) calls in one jit, distinct weights, M={M}: "
          "time per call (whole chain)")
    for n, v in t.items():
        nbytes = fns[n][2]
        print(f"  {n:>8}: {v * 1e6:8.1f} us/call  ({v * n_calls * 1e3:6.2f} ms/chain)  "
              f"{nbytes / v / 1e9:5.1f} GB/s", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="all", choices=["smol", "qwen", "all"])
    ap.add_argument("--m", default="1,8,32,64,512", help="comma-separated M values")
    ap.add_argument("--offset", action="store_true", help="asymmetric weights (with offsets)")
    ap.add_argument("--quick", action="store_true", help="shorter timing budget, no M=512")
    ap.add_argument("--budget", type=float, default=None, help="seconds of timing per row")
    ap.add_argument("--threads", type=int, default=0, help="cap kernel threads (0: all)")
    ap.add_argument("--variants", default="f32 dot,kf32,bf16 dot,kbf16,deq8,deq4,k8,k4")
    ap.add_argument("--chain-only", action="store_true", help="only the 30-call chain")
    args = ap.parse_args()

    inf = ck.info()
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, cpu count {os.cpu_count()}")
    print(f"kernel: {inf}")
    if not inf["ok"]:
        print("kernel not available: only XLA numbers are meaningful")
    if args.threads:
        ck.set_threads(args.threads)
    # The kernel variants always run the kernel here, also at M >= MAX_KERNEL_M /
    # MAX_DENSE_KERNEL_M where `qmatmul` / `dense_matmul` would hand over to XLA: the table is
    # what sets those crossovers.
    ck.MAX_KERNEL_M = ck.MAX_AVX2_KERNEL_M = ck.MAX_SCALAR_KERNEL_M = 1 << 30
    ck.MAX_DENSE_KERNEL_M = dict.fromkeys(ck.MAX_DENSE_KERNEL_M, 1 << 30)
    shapes = {"smol": SMOL, "qwen": QWEN, "all": SMOL + QWEN}[args.shapes]
    Ms = [int(m) for m in args.m.split(",")]
    if args.quick:
        Ms = [m for m in Ms if m < 512]
    budget = args.budget if args.budget is not None else (0.5 if args.quick else 1.5)
    names = [n.strip() for n in args.variants.split(",")]
    if not args.chain_only:
        print(f"\nper call (in-jit loop), GB/s = stored weight bytes / time; group size {G}, "
              f"{'with' if args.offset else 'no'} offset\n")
        bench_table(shapes, Ms, args.offset, budget, names)
    bench_chain(budget_s=max(1.0, 2 * budget), names=names)
    if inf["ok"]:
        # The pool falls back to one thread for a while (100 ms to 5 s) when calls look
        # oversubscribed (other processes, XLA's own threads): kernel numbers from such a
        # stretch are single-threaded.
        end = ck.info()
        print(f"\nkernel pool during this run: {end['parallel_calls']} parallel calls, "
              f"{end['bad_parallel_calls']} straggling or preempted, "
              f"{end['serial_fallbacks']} fallbacks to one thread")


if __name__ == "__main__":
    main()
