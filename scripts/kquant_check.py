"""Quantise a whole model with each llama.cpp recipe; print bits per weight and time, and
(with llama-cpp-python installed) whether the file equals llama.cpp's own quantisation.

For each recipe: the type of every tensor (`kquants.recipe_types`), the bits per weight over
all tensors and over the quantised ones, the time to write the file (`write_gguf`: read,
dequantise, quantise, write), and, with --llama-cpp, `llama_model_quantize` run on the same
source with the same ftype (uniform recipes as llama.cpp's --pure with the output/tied
embedding forced to our Q6_K/Q8_0 choice), then a tensor-by-tensor comparison of types and
bytes. DQ3_K_M has no llama.cpp counterpart.

--throughput Q4_K,Q3_K times `quantize_blocks` alone over every 2-D tensor of the model, its
values taken as rows of 256 whatever the row length (the recipes' fallbacks aside, so each
type's speed over the whole model is measured); wall and process CPU time, since on a shared
machine the wall time says more about the neighbours than about the code.

    .venv/bin/python scripts/kquant_check.py --model smollm2 --recipes Q4_K_M,Q3_K_M \
        [--out /tmp/kq] [--llama-cpp] [--keep] [--throughput Q4_K]
"""

from __future__ import annotations

import argparse
import ctypes
import pathlib
import tempfile
import time

import numpy as np

from jaxdec.checkpoint import registry
from jaxdec.checkpoint.gguf_reader import read_gguf_header
from jaxdec.quant import gguf_writer, kquants

# recipe -> (llama_ftype, pure): pure recipes also force the output / token_embd types
LLAMA_FTYPES = {"Q8_0": (7, False), "Q6_K": (18, False), "Q5_K": (16, False), "Q3_K": (11, False),
                "Q4_K": (14, True), "Q2_K": (10, True), "Q4_K_M": (15, False), "Q3_K_M": (12, False)}


def llama_quantize(src: pathlib.Path, dst: pathlib.Path, recipe: str, types: dict[str, str]) -> float:
    """Run llama.cpp's quantiser; returns its wall time."""
    import gguf
    import llama_cpp as lc

    ftype, pure = LLAMA_FTYPES[recipe]
    params = lc.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = ftype, True, 2
    if pure:
        params.pure = True
        params.output_tensor_type = int(gguf.GGMLQuantizationType[types.get("output.weight", types["token_embd.weight"])])
        params.token_embedding_type = int(gguf.GGMLQuantizationType[types["token_embd.weight"]])
    t = time.perf_counter()
    rc = lc.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize returned {rc}")
    return time.perf_counter() - t


def compare(ours: pathlib.Path, theirs: pathlib.Path) -> str:
    a, b = read_gguf_header(ours), read_gguf_header(theirs)
    if set(a.tensors) != set(b.tensors):
        return "different tensor names"
    diff = [n for n, t in a.tensors.items() if t.qtype != b.tensors[n].qtype]
    if diff:
        return f"{len(diff)} tensors of another type, e.g. {diff[0]}: ours {a.tensors[diff[0]].type_name}, llama.cpp {b.tensors[diff[0]].type_name}"
    for name, t in a.tensors.items():
        u = b.tensors[name]
        x = np.fromfile(ours, np.uint8, count=t.nbytes, offset=t.start)
        y = np.fromfile(theirs, np.uint8, count=u.nbytes, offset=u.start)
        if not np.array_equal(x, y):
            return f"{name} ({t.type_name}): bytes differ"
    meta = {k: v for k, v in a.metadata.items()}
    other = {k: v for k, v in b.metadata.items()}
    keys = set(meta) ^ set(other)
    return "identical tensors" + (f"; metadata keys differ: {sorted(keys)}" if keys else ", same metadata keys")


def throughput(src: pathlib.Path, header, qtypes: list[str]) -> None:
    tensors = [t for t in header.tensors.values() if len(t.shape) >= 2]
    for q in qtypes:
        n, wall, cpu = 0, 0.0, 0.0
        for t in tensors:
            w = kquants.read_tensor_f32(src, t).reshape(-1, 256)
            start, start_cpu = time.perf_counter(), time.process_time()
            kquants.quantize_blocks(w, q)
            wall += time.perf_counter() - start
            cpu += time.process_time() - start_cpu
            n += w.size
        print(f"{q}: {n / 1e6:.1f}M values in {wall:.1f} s wall, {cpu:.1f} s CPU "
              f"({cpu / n * 1e9:.0f} CPU-ns per value)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--recipes", default=",".join(kquants.RECIPES))
    ap.add_argument("--out", default=None, help="folder for the files (default: a temporary one)")
    ap.add_argument("--llama-cpp", action="store_true", help="compare with llama_model_quantize")
    ap.add_argument("--keep", action="store_true", help="keep the written files")
    ap.add_argument("--throughput", default="", help="types to time over the whole model")
    args = ap.parse_args()

    src = registry.resolve(args.model)
    header = read_gguf_header(src)
    sizes = {n: int(np.prod(t.shape)) for n, t in header.tensors.items()}
    out_dir = pathlib.Path(args.out or tempfile.mkdtemp(prefix="kquant_check."))
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"{args.model}: {src} ({sum(sizes.values()) / 1e6:.1f}M values, {len(sizes)} tensors)")
    if args.throughput:
        throughput(src, header, args.throughput.split(","))
    for recipe in args.recipes.split(","):
        t = time.perf_counter()
        types = kquants.recipe_types(src, recipe)
        t_recipe = time.perf_counter() - t
        quantised = {n: q for n, q in types.items() if kquants.is_quantisable(n, header.tensors[n].shape)}
        path = out_dir / f"{args.model}.{recipe}.gguf"
        t = time.perf_counter()
        gguf_writer.write_gguf(src, path, types, file_type=recipe)
        t_write = time.perf_counter() - t
        line = (f"{recipe:8s} bpw {kquants.bits_per_weight_of(types, sizes):.4f} (quantised tensors "
                f"{kquants.bits_per_weight_of(quantised, sizes):.4f})  recipe {t_recipe:5.1f} s  "
                f"write {t_write:6.1f} s  {path.stat().st_size / 2**20:7.1f} MiB")
        if args.llama_cpp and recipe in LLAMA_FTYPES:
            theirs = out_dir / f"{args.model}.{recipe}.llama.gguf"
            t_llama = llama_quantize(src, theirs, recipe, types)
            line += f"  llama.cpp {t_llama:5.1f} s: {compare(path, theirs)}"
            if not args.keep:
                theirs.unlink()
        print(line, flush=True)
        if not args.keep:
            path.unlink()


if __name__ == "__main__":
    main()
