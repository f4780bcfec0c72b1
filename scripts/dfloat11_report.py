"""DFloat11 on the real models: sizes, exponent entropy, decompression time and memory.

    python scripts/dfloat11_report.py                      # both models
    python scripts/dfloat11_report.py --models smollm2 --memory

Per model, for its DFloat11-compressed tensors (every matmul weight and embedding table):
bfloat16 bytes, DFloat11 bytes (everything stored: codes, sign+mantissa, gaps, block
positions, tables), their fraction, the exponents' Shannon entropy and the bits a weight;
then the same for Gaussian weights of the same shapes and standard deviations (the paper's
~70% is about trained weights; a Gaussian is the reference point). Decompression is timed
layer by layer, as the model decodes it (`decompress_many` per layer, the head alone),
compiled first. `--memory` adds a decode step's XLA buffer sizes (arguments + temporaries),
the RSS once loaded and the peak RSS of a `generate` run, bf16 against DFloat11, each read
from an orbax checkpoint in a fresh process; then the bytes of every array jax holds (the
weights: no decoded copy survives a step) and the RSS once glibc returns the heap the
compilers freed (`malloc_trim`), so compiled programs and weights remain.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxdec
from jaxdec.models import transformer
from jaxdec.formats import dfloat11 as df


def gaussian_like(pairs, seed: int = 0):
    """(bf16 Gaussian of the same shape and std as each weight, its DF11Array)."""
    rng = np.random.default_rng(seed)
    out = []
    for w, _ in pairs:
        std = float(np.asarray(w, np.float32).std())
        g = (rng.standard_normal(w.shape, np.float32) * std).astype(jnp.bfloat16)
        out.append((g, df.compress(g)))
    return out


def line(label: str, s: df.Stats) -> str:
    return (f"  {label:<22} {s.n:>12,} weights  bf16 {s.bf16_bytes / 2**20:8.1f} MiB  "
            f"DF11 {s.df11_bytes / 2**20:8.1f} MiB  {s.fraction:6.1%}  entropy "
            f"{s.entropy_bits:.3f} bits  {s.bits_per_weight:.2f} bits/weight")


def time_decompression(params) -> tuple[float, float]:
    """(compile seconds, run seconds) of decoding every DF11Array of `params`, one call
    per layer (as `transformer.decoder_layer` does) and one per other tensor."""
    units = [list(filter(df.is_df11, jax.tree.leaves(layer, is_leaf=df.is_df11)))
             for layer in params.layers]
    units += [[a] for a in (params.embed, params.lm_head) if df.is_df11(a)]
    run = jax.jit(df.decompress_many)
    compiled, t0 = [], time.perf_counter()
    for unit in units:
        compiled.append(run.lower(unit).compile())
    t1 = time.perf_counter()
    for c, unit in zip(compiled, units):
        jax.block_until_ready(c(unit))
    return t1 - t0, time.perf_counter() - t1


def report(name: str) -> dict:
    model = jaxdec.load(name, dtype="bfloat16")
    t0 = time.perf_counter()
    params = df.compress_params(model.params, transformer.declare(model.cfg))
    t_compress = time.perf_counter() - t0
    pairs = df.pairs(model.params, params)
    real, gauss = df.stats(pairs), df.stats(gaussian_like(pairs))
    compile_s, run_s = time_decompression(params)
    print(f"{name}: {len(pairs)} tensors compressed in {t_compress:.1f} s")
    print(line("trained weights", real))
    print(line("Gaussian, same shapes", gauss))
    print(f"  decompression of all {real.n:,} weights: {run_s:.2f} s "
          f"({1e9 * run_s / real.n:.1f} ns a weight; compiling it: {compile_s:.1f} s)")
    as_dict = lambda s: {"n": s.n, "bf16_bytes": s.bf16_bytes, "df11_bytes": s.df11_bytes,
                         "fraction": s.fraction, "entropy_bits": s.entropy_bits,
                         "bits_per_weight": s.bits_per_weight}
    return {"model": name, "real": as_dict(real), "gaussian": as_dict(gauss),
            "compress_s": t_compress, "decompress_s": run_s, "decompress_compile_s": compile_s}


# ---- memory -----------------------------------------------------------------------------
def _child(source: str, new_tokens: int) -> None:
    """In a fresh process: load, compile a decode step and a generation (warm-up), then
    measure the RSS high-water mark over a second generation."""
    from jaxdec import api, decode
    from jaxdec.sampling import Greedy

    rss = lambda key: int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
    model = jaxdec.load(source, dtype="bfloat16")
    loaded = rss("VmRSS:")
    cache = api.init_cache(model, 1, 128)
    step = decode.decode_step.lower(model.params, cache, jnp.zeros(1, jnp.int32),
                                    jax.random.key(0), sampler=Greedy(), cfg=model.cfg).compile()
    mem = step.memory_analysis()
    prompt = "The capital of France is"
    jaxdec.generate(model, prompt, max_new_tokens=new_tokens)
    pathlib.Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark
    before = rss("VmRSS:")
    jaxdec.generate(model, prompt, max_new_tokens=new_tokens)
    peak = rss("VmHWM:")
    live = sum(a.nbytes for a in jax.live_arrays())  # every array jax holds: the weights
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what the compilers freed but glibc kept
    print(json.dumps({"args": mem.argument_size_in_bytes, "temp": mem.temp_size_in_bytes,
                      "rss_loaded": loaded, "rss_before": before, "rss_peak": peak,
                      "live_arrays": live, "rss_trimmed": rss("VmRSS:")}))


def memory(name: str, new_tokens: int) -> dict:
    model = jaxdec.load(name, dtype="bfloat16")
    small = dataclasses.replace(model, params=df.compress_params(
        model.params, transformer.declare(model.cfg)))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:  # both from orbax: the same loading path
        plain = jaxdec.save(model, pathlib.Path(tmp) / "bf16")
        path = jaxdec.save(small, pathlib.Path(tmp) / "df11")
        for label, source in (("bf16", str(plain)), ("dfloat11", str(path))):
            out = subprocess.run([sys.executable, __file__, "--child", source, "--new-tokens",
                                  str(new_tokens)], capture_output=True, text=True,
                                 env=dict(os.environ, JAXDEC_XLA_CACHE=""))
            if out.returncode:
                raise SystemExit(out.stderr)
            results[label] = json.loads(out.stdout.strip().splitlines()[-1])
    mib = lambda b: f"{b / 2**20:7.1f} MiB"
    print(f"{name}: decode step buffers (XLA) and RSS of a {new_tokens}-token generation")
    for label, r in results.items():
        print(f"  {label:<9} params {mib(r['args'])}  step temporaries {mib(r['temp'])}  "
              f"RSS loaded {mib(r['rss_loaded'])}, after a warm-up generation "
              f"{mib(r['rss_before'])} -> peak {mib(r['rss_peak'])} "
              f"(+{mib(r['rss_peak'] - r['rss_before'])}); live arrays {mib(r['live_arrays'])}, "
              f"RSS after malloc_trim {mib(r['rss_trimmed'])}")
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2,qwen2.5-coder-0.5b")
    p.add_argument("--memory", action="store_true", help="also measure decode-step memory")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--json", default=None, help="write every figure to this file")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return _child(args.child, args.new_tokens)
    out = []
    for name in args.models.split(","):
        entry = report(name)
        if args.memory:
            entry["memory"] = memory(name, args.new_tokens)
        out.append(entry)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
