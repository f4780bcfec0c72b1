"""How long `jaxdec serve` takes from its start to its first answered request.

    python scripts/serve_startup.py [--model smollm2] [--runs 2] [--cache DIR] [-- serve flags]

Each run starts `jaxdec serve --port 0` as a fresh process, reads the port from its ready
line, sends one completion with the official `openai` client and stops it. The first run
on an empty `--cache` (a temporary folder by default) is a cold start: it compiles every
step shape and stores the executables; the runs after it are warm starts, which load them.
Printed: seconds to the ready line and to the first answer, for each run.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time


def one_start(model: str, cache: str, extra: list[str]) -> tuple[float, float]:
    import openai

    env = dict(os.environ, JAXDEC_XLA_CACHE=cache)
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "jaxdec", "serve", "--model", model, "--port", "0", *extra],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        for line in proc.stderr:
            found = re.search(r"ready on (http://\S+/v1)", line)
            if found:
                break
        else:
            raise SystemExit(f"jaxdec serve exited with {proc.wait()} before it was ready")
        ready = time.monotonic() - start
        client = openai.OpenAI(base_url=found.group(1), api_key="x", max_retries=0, timeout=120)
        client.completions.create(model=model, prompt="Hello", max_tokens=4)
        return ready, time.monotonic() - start
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--cache", default=None, help="compilation cache (default: a fresh temporary folder)")
    ap.add_argument("extra", nargs="*", help="more `jaxdec serve` flags (after --)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cache = a.cache or tmp
        for i in range(a.runs):
            ready, answered = one_start(a.model, cache, a.extra)
            kind = "cold" if i == 0 and a.cache is None else "warm"
            print(f"run {i + 1} ({kind}): ready in {ready:.1f} s, first answer at {answered:.1f} s", flush=True)


if __name__ == "__main__":
    main()
