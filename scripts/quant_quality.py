"""The compression quality table (`docs/quantization.md`): every method and bit width on the
real models, on the same text, beside the paper's claim.

    python scripts/quant_quality.py --models smollm2,qwen2.5-coder-0.5b
    python scripts/quant_quality.py --models smollm2 --rows f32,rtn:4,gptq:4 --windows 4
    python scripts/quant_quality.py --models smollm2,qwen2.5-coder-0.5b --cached \
        --out docs/quantization.md        # the table of every cached row, into the doc

Finished rows are cached per model in --cache (JSON, kept in the repository beside the doc:
the rows take hours on a small CPU) and reused by a rerun with the same settings.
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
from jaxdec.files import write_text_atomic

DEFAULT_ROWS = ("f32,bf16,df11,rtn:8,rtn:4,rtn:3,rtn:2,gptq:4,gptq:3,gptq:2,awq:4,awq:3,hqq:4,"
                "hqq:3,hqq:2,zeroquant:8,zeroquant:4,llm_int8:8,smoothquant:8,w4a4:4,hadamard:4,"
                "kurtail:4,Q8_0,Q4_K_M,Q3_K_M,DQ3_K_M")


BEGIN, END = "<!-- quality table: scripts/quant_quality.py -->", "<!-- end of quality table -->"


def write_between_markers(path: pathlib.Path, text: str) -> None:
    """Put `text` between BEGIN and END in `path` (the rest of the document kept), or make
    `path` hold just the marked table when it has no markers."""
    block = f"{BEGIN}\n{text}\n{END}"
    old = path.read_text() if path.exists() else ""
    if BEGIN in old and END in old:
        new = old[:old.index(BEGIN)] + block + old[old.index(END) + len(END):]
    else:
        new = (old + "\n" if old else "") + block + "\n"
    write_text_atomic(path, new)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2,qwen2.5-coder-0.5b")
    p.add_argument("--rows", default=DEFAULT_ROWS, help="comma-separated f32 or METHOD:BITS")
    s = quant_table.Settings()
    for field in ("windows", "window", "calib_windows", "calib_window", "n_prompts",
                  "new_tokens", "group_size"):
        p.add_argument("--" + field.replace("_", "-"), type=int, default=getattr(s, field))
    p.add_argument("--cache", default="docs/quant_table/{model}.json",
                   help="cache file per model ({model} is filled in)")
    p.add_argument("--cached", action="store_true",
                   help="only print the table of every row cached for --models")
    p.add_argument("--out", default=None,
                   help="put the markdown table in this file (between its table markers)")
    args = p.parse_args(argv)
    settings = quant_table.Settings(**{f: getattr(args, f) for f in (
        "windows", "window", "calib_windows", "calib_window", "n_prompts", "new_tokens",
        "group_size")})
    models = args.models.split(",")
    try:
        if args.cached:
            done = quant_table.load_cached(models, args.cache)
        else:
            done = quant_table.run(models, args.rows.split(","), settings, args.cache)
    except JaxdecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    text = quant_table.table(done)
    print(text)
    if args.out:
        write_between_markers(pathlib.Path(args.out), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
