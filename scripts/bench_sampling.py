"""The engine's sampler (`sampling.sample_rows`: 16 rows of 49152 logits drawn from N(0, 3))
at an earlier revision and in this tree, side by side, for each setting.

    .venv/bin/python scripts/bench_sampling.py [REV]     (default 3d46067, before the change)
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from jaxdec import sampling  # noqa: E402

ROWS, VOCAB = 16, 49152
SETTINGS = {"temperature 1": dict(temperature=1.0), "top_k 50": dict(top_k=50),
            "min_p 0.05": dict(min_p=0.05), "temperature 0.7, top_p 0.9": dict(temperature=0.7, top_p=0.9)}


def module_at(rev: str):
    """jaxdec/sampling.py as it was at `rev`, imported under its own name."""
    src = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:jaxdec/sampling.py"],
                         capture_output=True, text=True, check=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "sampling_then.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("sampling_then", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sampling_then"] = mod
    spec.loader.exec_module(mod)
    return mod


def ms_per_call(mod, logits, keys, knobs, repeats=5) -> float:
    p = mod.RowParams.of([mod.Sample(**knobs)] * ROWS)
    f = jax.jit(mod.sample_rows)
    f(logits, p, keys).block_until_ready()
    t = time.perf_counter()
    for _ in range(repeats):
        f(logits, p, keys).block_until_ready()
    return (time.perf_counter() - t) / repeats * 1e3


def main() -> None:
    rev = sys.argv[1] if len(sys.argv) > 1 else "3d46067"
    then = module_at(rev)
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((ROWS, VOCAB)).astype(np.float32) * 3)
    keys = jax.random.split(jax.random.key(0), ROWS)
    print(f"sample_rows, {ROWS} rows of {VOCAB}: {rev} | this tree")
    for name, knobs in SETTINGS.items():
        a, b = ms_per_call(then, logits, keys, knobs), ms_per_call(sampling, logits, keys, knobs)
        print(f"  {name:28s} {a:8.1f} ms | {b:7.1f} ms  ({a / b:.1f}x)")


if __name__ == "__main__":
    main()
