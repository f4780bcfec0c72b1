"""The serving engine on an accelerator: what 16 concurrent clients get over one, where a
decode step is bound by reading the weights rather than by compute.

    python scripts/device_engine.py --out DIR [--smoke]

Run by scripts/device_engine.sh on a lent GPU. Issue 42 asks that 16 concurrent clients get
at least 5x one client's output tokens/s. On the 2-core CPU hosts a decode row costs compute
(`scripts/engine_steps.py` prints the ceiling 16 x t(1) / t(16), 3.7x there), so the target
can only be met where a step reads its weights once for every row: this script measures it
there. The model is Qwen2.5-Coder-0.5B's architecture with random bf16 weights (the
checkpoint cannot travel to the device machine; speed does not depend on the values), in
the `Engine` that `jaxdec serve` runs (16 rows, 512-token context, prefix caching off so
every prompt is computed).

Reported, each shape compiled and run once before it is timed (each closed loop runs once
untimed first: compiling all 44 shapes up front would take minutes on a GPU):
- the decode step at 1, 2, 4, ... 16 rows, and the batching ceiling 16 x t(1) / t(16);
- a [1, 256] prompt chunk;
- closed loops (each client sends its next request when its last finished) of 1 and of 16
  clients over the same kind of requests: prompts of 32-256 random tokens, 16-128 output
  tokens (EOS ignored), drawn from a seeded generator; output tokens/s and the ratio.
`--smoke` runs a tiny config with 4 rows on whatever backend is present (the slow tier runs
it on the CPU so this script cannot rot); its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from closed_loop import closed_loop  # noqa: E402 (scripts/, beside this one)
from device_bench import QWEN, TINY  # noqa: E402
from engine_steps import step_ms  # noqa: E402
from jaxdec.api import Model  # noqa: E402
from jaxdec.engine.engine import Engine  # noqa: E402
from jaxdec.models import transformer  # noqa: E402
from jaxdec.pytree import init_params  # noqa: E402

TARGET = 5.0  # issue 42: 16 clients / 1 client


class Ids:
    """The tokenizer of a random-weight model: stops on no id, and its outputs are timed,
    never read, so it decodes no text (on a real server detokenizing costs some
    microseconds a token on the host)."""

    stop_ids = ()

    def stream(self, skip_special_tokens: bool = True):
        return self

    def put(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


def jobs(vocab: int, n: int, seed: int, prompt=(32, 256), output=(16, 128)) -> list:
    """n requests [(prompt ids, output tokens, 0.0)] with lengths uniform in the ranges."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab, int(rng.integers(prompt[0], prompt[1] + 1))).tolist(),
             int(rng.integers(output[0], output[1] + 1)), 0.0) for _ in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    cfg, rows = (TINY, 4) if args.smoke else (QWEN, 16)
    loops = {1: 2, rows: 2 * rows} if args.smoke else {1: 6, rows: 4 * rows}  # clients -> requests
    params = init_params(transformer.declare(cfg), jax.random.key(0), jnp.bfloat16)
    model = Model(cfg=cfg, params=params, tokenizer=Ids(), source="random")
    engine = Engine(model, max_num_seqs=rows, max_model_len=512, enable_prefix_caching=False)
    device = jax.devices()[0]
    report = {"device": str(device.device_kind), "backend": jax.default_backend(), "jax": jax.__version__}
    rng = np.random.default_rng(0)
    widths = engine.sizes["pages"]
    p = widths[min(1, len(widths) - 1)]
    decode = {b: step_ms(engine, b, 1, p, 5, rng) for b in engine.sizes["decode_rows"]}
    report["decode_ms"] = {str(b): round(ms, 3) for b, ms in decode.items()}
    report["ceiling"] = round(rows * decode[1] / decode[rows], 2)
    chunk = engine.sizes["prefill_chunk"][-1]
    report[f"prefill_1x{chunk}_ms"] = round(step_ms(engine, 1, chunk, widths[-1], 3, rng), 2)
    report["closed"] = {}
    for i, (clients, n) in enumerate(loops.items()):
        closed_loop(engine, jobs(cfg.vocab_size, n, seed=i), clients)  # (compiles its shapes, untimed)
        seconds, tokens = closed_loop(engine, jobs(cfg.vocab_size, n, seed=i), clients)
        report["closed"][str(clients)] = {"requests": n, "output_tokens": tokens,
                                          "seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 1)}
    one, many = (report["closed"][str(c)]["tok_s"] for c in loops)
    report["ratio"] = round(many / one, 2)
    report["shapes"] = len(engine._steps)
    lines = [f"{report['device']} ({report['backend']}), {report['shapes']} step shapes",
             "decode step: " + ", ".join(f"[{b}, 1] {ms:.2f} ms" for b, ms in decode.items()),
             f"batching ceiling {rows} x t(1) / t({rows}): {report['ceiling']}x",
             f"prefill [1, {chunk}]: {report[f'prefill_1x{chunk}_ms']} ms",
             *(f"closed loop, {c} clients: {r['tok_s']} output tok/s ({r['requests']} requests, "
               f"{r['seconds']} s)" for c, r in report["closed"].items()),
             f"{rows} clients / 1: {report['ratio']}x (issue 42's target: {TARGET:g}x)"]
    text = "\n".join(lines)
    print(text)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "device_engine.txt").write_text(text + "\n")
    (out / "device_engine.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
