"""Batch-1 decode speed of this tree against another revision, interleaved in one run.

    python scripts/ab_decode.py --base b9aa3ae --weights f32,gguf --pairs 5

The base revision is checked out in a temporary git worktree; each measurement is a fresh
process that imports jaxdec from one tree (PYTHONPATH), loads the model, warms up, and times
`jaxdec.generate` of `--new-tokens` greedy tokens (best of `--repeats`). The trees alternate,
and which goes first alternates too, so this host's drift (20-30% over minutes) moves both
alike; the report gives each pair's ratio and their median.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent

# the measurement, run in a child process against one tree's jaxdec
CHILD = r"""
import json, sys, time
import jaxdec
model = jaxdec.load(sys.argv[1], weights=sys.argv[2])
prompt, n = "The history of the printing press", int(sys.argv[3])
jaxdec.generate(model, prompt, max_new_tokens=n)  # compile and warm up
best = 0.0
for _ in range(int(sys.argv[4])):
    t = time.perf_counter()
    out = jaxdec.generate(model, prompt, max_new_tokens=n)
    best = max(best, len(out.token_ids[0]) / (time.perf_counter() - t))
print(json.dumps({"tok_s": best, "tokens": out.token_ids[0]}))
"""


def measure(tree: pathlib.Path, model: str, weights: str, new: int, repeats: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    r = subprocess.run([sys.executable, "-c", CHILD, model, weights, str(new), str(repeats)],
                       env=env, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{tree}: {r.stderr.strip().splitlines()[-1]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the revision to compare against (e.g. HEAD~1)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--weights", default="f32,gguf")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = pathlib.Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), a.base],
                       check=True, capture_output=True)
        try:
            for weights in a.weights.split(","):
                ratios = []
                for i in range(a.pairs):
                    order = [("this", ROOT), ("base", base)][:: 1 if i % 2 == 0 else -1]
                    got = {name: measure(tree, a.model, weights, a.new_tokens, a.repeats) for name, tree in order}
                    same = got["this"]["tokens"] == got["base"]["tokens"]
                    ratios.append(got["this"]["tok_s"] / got["base"]["tok_s"])
                    print(f"{a.model} {weights} pair {i + 1}: this {got['this']['tok_s']:.1f} tok/s, "
                          f"base {got['base']['tok_s']:.1f} tok/s, ratio {ratios[-1]:.3f}, "
                          f"same tokens: {same}", flush=True)
                print(f"{a.model} {weights}: median ratio this/base {statistics.median(ratios):.3f} "
                      f"over {a.pairs} interleaved pairs")
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)],
                           capture_output=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
