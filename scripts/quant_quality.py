"""The compression quality table (`docs/quantization.md`): every method and bit width on the
real models, on the same text, beside the paper's claim.

    python scripts/quant_quality.py --models smollm2,qwen2.5-coder-0.5b
    python scripts/quant_quality.py --models smollm2 --rows f32,rtn:4,gptq:4 --windows 4

Finished rows are cached in --cache (JSON) and reused by a rerun with the same settings.
"""

import argparse
import os
import pathlib
import sys

# float32 throughout: the CPU kernel's AMX path would round quantised rows' activations to
# bf16 in prefill, which the float32 baseline does not do
os.environ.setdefault("JAXDEC_CPU_AMX", "0")

from jaxdec.bench import quant_table
from jaxdec.errors import JaxdecError

DEFAULT_ROWS = ("f32,rtn:8,rtn:4,rtn:3,rtn:2,gptq:4,gptq:3,gptq:2,awq:4,awq:3,hqq:4,hqq:3,hqq:2,"
                "zeroquant:8,zeroquant:4,llm_int8:8,smoothquant:8")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2,qwen2.5-coder-0.5b")
    p.add_argument("--rows", default=DEFAULT_ROWS, help="comma-separated f32 or METHOD:BITS")
    s = quant_table.Settings()
    for field in ("windows", "window", "calib_windows", "calib_window", "n_prompts",
                  "new_tokens", "group_size"):
        p.add_argument("--" + field.replace("_", "-"), type=int, default=getattr(s, field))
    p.add_argument("--cache", default="runs/quant_table.json")
    p.add_argument("--out", default=None, help="write the markdown table here")
    args = p.parse_args(argv)
    settings = quant_table.Settings(**{f: getattr(args, f) for f in (
        "windows", "window", "calib_windows", "calib_window", "n_prompts", "new_tokens",
        "group_size")})
    cache = pathlib.Path(args.cache)
    cache.parent.mkdir(parents=True, exist_ok=True)
    try:
        done = quant_table.run(args.models.split(","), args.rows.split(","), settings, cache)
    except JaxdecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    text = quant_table.table(done, settings)
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
