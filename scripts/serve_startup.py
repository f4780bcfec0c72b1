"""How long `jaxdec serve` takes from its start to its first answered request.

    python scripts/serve_startup.py [--model smollm2] [--runs 2] [--cache DIR] [-- serve flags]

Each run starts `jaxdec serve` on a free port as a fresh process (`serve_bench.serving`,
which waits until GET /health answers), sends one completion with the official `openai`
client and stops it. The first run on an empty `--cache` (a temporary folder by default)
is a cold start: it compiles every step shape and stores the executables; the runs after
it are warm starts, which load them. Printed: seconds to ready and to the first answer.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time


def one_start(model: str, cache: str, extra: list[str]) -> tuple[float, float]:
    import openai

    from jaxdec.bench.serve_bench import serving
    from jaxdec.serve.server import free_port

    argv = [sys.executable, "-m", "jaxdec", "serve", "--model", model, "--port", str(free_port()), *extra]
    os.environ["JAXDEC_XLA_CACHE"] = cache  # (the child's compilation caches)
    start = time.monotonic()
    with serving(argv, pathlib.Path(cache, "server.log"), timeout_s=1800) as url:
        ready = time.monotonic() - start
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)
        client.completions.create(model=model, prompt="Hello", max_tokens=4)
        return ready, time.monotonic() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--cache", default=None, help="compilation cache (default: a fresh temporary folder)")
    ap.add_argument("extra", nargs="*", help="more `jaxdec serve` flags (after --)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cache = a.cache or tmp
        pathlib.Path(cache).mkdir(parents=True, exist_ok=True)
        for i in range(a.runs):
            kind = "warm" if any(pathlib.Path(cache).rglob("*.exe")) else "cold"  # (stored executables)
            ready, answered = one_start(a.model, cache, a.extra)
            print(f"run {i + 1} ({kind}): ready in {ready:.1f} s, first answer at {answered:.1f} s", flush=True)


if __name__ == "__main__":
    main()
