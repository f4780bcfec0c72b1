"""The compression quality table: every method and bit width on the real models, on the same
text, beside the paper's claim.

Per model, the baseline is the model as loaded in float32 (the GGUF dequantised: the real
models here are themselves quantised files, so "uncompressed" means that float32 model).
Per row:
- perplexity on the `eval` windows of both corpora (`jaxdec.perplexity`, the core harness);
- greedy agreement: the baseline's greedy continuation (`new_tokens` per prompt) is fed to
  the compressed model, and we count the positions where its argmax is the baseline's token
  (teacher-forced top-1 agreement), and the mean number of leading tokens it reproduces
  before the first disagreement (what free-running greedy decoding would share);
- bits per weight of the transformer blocks' matmul weights, scales included (the PTQ
  methods keep the embedding and LM head in float; k-quant recipes quantise them too, and
  their rows give the whole file's bits per weight as well).
Rows:
- "f32", "bf16": the baseline, and the model in bfloat16 (weights and activations);
- "df11": DFloat11 of the bf16 weights (lossless: the bf16 row's numbers, bit for bit);
- "METHOD:BITS" for the PTQ methods (`methods.METHODS`) and the W4A4KV4 rotation rows
  (`kurtail.TABLE_ROWS`): the weight transform METHOD (`jaxdec.transforms`) at BITS;
- a k-quant recipe ("Q4_K_M", "Q3_K_M", "DQ3_K_M", "Q8_0", ...): the model's GGUF written by
  `gguf_writer.write_gguf` with `kquants.recipe_types` and read back (dequantised) by
  `jaxdec.load`; DQ3_K_M's sensitivity is each tensor's measured output KL
  (`kquants.kl_sensitivity`) on calibration windows.
Rows are cached per model in a JSON file as they finish, so an interrupted run resumes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import tempfile
import time
from collections.abc import Callable

import jax
import numpy as np

import jaxdec
from jaxdec import corpora, perplexity, prompts, transforms
from jaxdec.errors import JaxdecError
from jaxdec.files import write_text_atomic
from jaxdec.checkpoint import registry
from jaxdec.checkpoint.gguf_reader import read_gguf_header
from jaxdec.models import transformer
from jaxdec.quant import calibrate, gguf_writer, kquants, kurtail, methods
from jaxdec.formats import dfloat11
from jaxdec.formats.actquant import ActQuant
from jaxdec.formats.qarray import QArray

# the paper's claim beside each method (shared/algorithms.md; [U]: our reading, unconfirmed)
CLAIMS = {
    "f32": "baseline (the dequantised GGUF)",
    "bf16": "bfloat16 weights and activations",
    "df11": "lossless: ~70% of bf16; weights bit-exact, bf16's greedy tokens",
    "Q8_0": "llama.cpp: +0.0004 ppl on LLaMA-7B (wikitext)",
    "Q4_K_M": "llama.cpp: +0.0535 ppl on LLaMA-7B; the usual default",
    "Q3_K_M": "llama.cpp: +0.2437 ppl on LLaMA-7B",
    "DQ3_K_M": "dynamic 3-bit (per-tensor bits by sensitivity) beats uniform Q3_K_M [U]",
    "rtn": "the baseline every method is measured against",
    "zeroquant": "W8A8 close to fp16 on GPT-3-style models; W4/8 needs LKD distillation",
    "llm_int8": "no degradation up to 175B (outliers >= 6 kept in fp16)",
    "smoothquant": "W8A8 matches fp16 (alpha 0.5; OPT/BLOOM/Llama)",
    "gptq": "3-4 bit with negligible loss on large models; beats RTN clearly at 3 bit",
    "awq": "beats RTN at 4 bit g128; ~ GPTQ without reconstruction",
    "hqq": "close to GPTQ at 4 bit without calibration data [U]",
    # W{b}A{b}KV{b}: GPTQ per output channel, activations per token, KV per token and head
    "w4a4": "no rotation: the outliers break 4-bit activations (the rotations' baseline)",
    "hadamard": "QuaRot: random (block-)Hadamard rotations make W4A4KV4 usable",
    "kurtail": "vs QuaRot +13.3% MMLU, -15.5% Wiki ppl; vs SpinQuant +2.6% MMLU, -2.9% ppl",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    windows: int = 16            # eval windows per corpus
    window: int = 512
    calib_windows: int = 32
    calib_window: int = 256
    n_prompts: int = 10
    new_tokens: int = 256
    group_size: int = 64


def parse_row(text: str) -> dict:
    """"gptq:3" -> {"method": "gptq", "bits": 3}; "f32" -> the baseline; "Q4_K_M" -> a k-quant
    recipe; "bf16", "df11"."""
    if text in ("f32", "bf16", "df11"):
        return {"method": text, "bits": {"f32": 32, "bf16": 16, "df11": 16}[text]}
    if text.upper() in kquants.RECIPES:
        return {"method": text.upper(), "bits": 0}
    method, _, bits = text.partition(":")
    if method not in (*methods.METHODS, *kurtail.TABLE_ROWS) or not bits.isdigit():
        raise JaxdecError(f"bad table row {text!r}: expected f32, bf16, df11, a k-quant recipe "
                          f"({', '.join(kquants.RECIPES)}) or METHOD:BITS with METHOD one of "
                          f"{', '.join((*methods.METHODS, *kurtail.TABLE_ROWS))}")
    return {"method": method, "bits": int(bits)}


def block_bits(params) -> tuple[float, int]:
    """(bits per weight, number of weights) over the blocks' matmul weights."""
    is_w = lambda x: isinstance(x, (QArray, ActQuant))
    total = count = 0
    for w in jax.tree.leaves(params.layers, is_leaf=is_w):
        if isinstance(w, ActQuant):
            w = w.w
        if isinstance(w, QArray):
            n = math.prod(w.shape)
            total, count = total + w.bits_per_weight * n, count + n
    return (total / count if count else float("nan")), count


class Evaluator:
    """One model's baseline and the shared evaluation of any compressed variant of it."""

    def __init__(self, name: str, settings: Settings):
        self.name, self.s = name, settings
        self.model = jaxdec.load(name)
        enc = lambda t: self.model.tokenizer.encode(t, add_special_tokens=False)
        self.encode = enc
        self.windows = {c: np.asarray(corpora.make_windows(corpora.corpus_token_ids(c, enc),
                                                           window=settings.window, split="eval",
                                                           max_windows=settings.windows))
                        for c in corpora.CORPORA}
        rows = [enc(p) for p in prompts.PROMPTS[:settings.n_prompts]]
        out = jaxdec.api.generate_ids(self.model, rows, max_new_tokens=settings.new_tokens,
                                      stop_ids=[])
        self.prompt_lens = [len(r) for r in rows]
        self.greedy = [r + list(map(int, g)) for r, g in zip(rows, out.token_ids)]
        self._calib = None

    @property
    def calib(self) -> np.ndarray:
        if self._calib is None:
            self._calib = calibrate.calibration_tokens(self.encode, n_windows=self.s.calib_windows,
                                                       window=self.s.calib_window)
        return self._calib

    def evaluate(self, model) -> dict:
        ppl = {c: perplexity.perplexity(lambda b: jaxdec.api.score(model, b), w).ppl
               for c, w in self.windows.items()}
        hits, prefix = [], []
        for b in range(0, len(self.greedy), 5):  # a few rows per call bounds the logits' memory
            rows = self.greedy[b:b + 5]
            logits = jaxdec.api.score(model, rows)
            for row, n0, lg in zip(rows, self.prompt_lens[b:b + 5], logits):
                same = lg[n0 - 1:len(row) - 1].argmax(-1) == np.asarray(row[n0:])
                hits.append(same.mean())
                prefix.append(int(np.argmin(same)) if not same.all() else len(same))
        return {"ppl": ppl, "agree": float(np.mean(hits)), "prefix": float(np.mean(prefix))}

    def row(self, spec: dict) -> dict:
        t0 = time.perf_counter()
        extra = {}
        if spec["method"] == "f32":
            model, bpw = self.model, 32.0
        elif spec["method"] in ("bf16", "df11"):
            model = jaxdec.load(self.name, dtype="bfloat16")
            bpw = 16.0
            if spec["method"] == "df11":
                params = dfloat11.compress_params(model.params, transformer.declare(model.cfg))
                st = dfloat11.stats(dfloat11.pairs(model.params, params))
                model, bpw = dataclasses.replace(model, params=params), 16 * st.fraction
                extra = {"entropy_bits": st.entropy_bits}
        elif spec["method"] in kquants.RECIPES:
            model, bpw, extra = self._kquant(spec["method"])
        else:  # a weight transform: a PTQ method, or W4A4KV4 with or without rotations
            model = self._transformed(spec)
            bpw = block_bits(model.params)[0]
        t1 = time.perf_counter()
        out = self.evaluate(model)
        return {**spec, **out, **extra, "bpw": bpw, "quantize_s": t1 - t0,
                "eval_s": time.perf_counter() - t1, "settings": dataclasses.asdict(self.s)}

    def _transformed(self, spec: dict):
        """The model under the weight transform of row `spec` (`jaxdec.transforms`): its
        bits, and the table's group size for the PTQ methods."""
        name = spec["method"]
        options = {"bits": spec["bits"]}
        if name in methods.METHODS:
            options["group_size"] = self.s.group_size
        calib = self.calib if transforms.get(name).needs_calib else None
        params, cfg = transforms.apply(name, self.model.params, self.model.cfg, calib, **options)
        return dataclasses.replace(self.model, cfg=cfg, params=params)

    def _kquant(self, recipe: str):
        """The model's GGUF under `recipe`, written and read back: (model, bits per weight of
        the blocks' matmul weights, {"file_bpw": the whole file's}, and for DQ3_K_M "kl":
        each tensor's measured output KL and "types": the type it got)."""
        src = registry.resolve(self.name)
        measured = None
        if recipe == "DQ3_K_M":
            measured = kquants.kl_sensitivity(self.model.params, self.model.cfg, self.calib)
        types = kquants.recipe_types(src, recipe, measured=measured)
        tensors = read_gguf_header(src).tensors
        sizes = {n: int(math.prod(t.shape)) for n, t in tensors.items()}
        blocks = {n: q for n, q in types.items() if n.startswith("blk.") and len(tensors[n].shape) == 2}
        with tempfile.TemporaryDirectory() as d:
            path = gguf_writer.write_gguf(src, pathlib.Path(d) / f"{recipe}.gguf", types,
                                          file_type=recipe)
            model = jaxdec.load(path)
        extra = {"file_bpw": kquants.bits_per_weight_of(types, sizes)}
        if measured is not None:  # what the allocation saw, and what it chose
            extra |= {"kl": measured, "types": {n: types[n] for n in measured}}
        return model, kquants.bits_per_weight_of(blocks, sizes), extra


def cache_path(pattern: str, model: str) -> pathlib.Path:
    """The cache file of one model: `pattern` with {model} filled in."""
    return pathlib.Path(pattern.format(model=model))


def run(models: list[str], rows: list[str], settings: Settings, cache: str,
        log: Callable[[str], None] = print) -> dict[str, dict]:
    """Every (model, row): {model: {row text: result}}, reusing the rows cached in each
    model's file (`cache_path(cache, model)`) under the same settings."""
    specs = [parse_row(r) for r in rows]
    key = json.dumps(dataclasses.asdict(settings), sort_keys=True)
    out = {}
    for name in models:
        path = cache_path(cache, name)
        done = json.loads(path.read_text()) if path.exists() else {}
        if done.get("settings") != key:
            done = {"settings": key, "rows": {}}
        ev = None
        for text, spec in zip(rows, specs):
            k = f"{name} {text}"
            if k in done["rows"]:
                continue
            ev = ev or Evaluator(name, settings)
            done["rows"][k] = {"model": name, **ev.row(spec)}
            write_text_atomic(path, json.dumps(done, indent=1))
            log(format_row(done["rows"][k]))
        out[name] = {text: done["rows"][f"{name} {text}"] for text in rows}
    return out


def load_cached(models: list[str], cache: str) -> dict[str, dict]:
    """Every row cached for `models`: {model: {row text: result}}, with its settings."""
    out = {}
    for name in models:
        path = cache_path(cache, name)
        if path.exists():
            done = json.loads(path.read_text())
            settings = json.loads(done["settings"])
            out[name] = {k.split(" ", 1)[1]: {"settings": settings, **r} for k, r in done["rows"].items()}
    return out


def _label(r: dict) -> str:
    m = r["method"]
    if m in ("f32", "bf16", "df11") or m in kquants.RECIPES:
        return {"f32": "f32 (baseline)", "df11": "DFloat11"}.get(m, m)
    rotation = {"w4a4": "no rotation", "hadamard": "block-Hadamard", "kurtail": "KurTail"}
    if m in rotation:
        return f"W{r['bits']}A{r['bits']}KV{r['bits']} {rotation[m]}"
    return f"{m} W{r['bits']}" + ("A8" if m in ("zeroquant", "smoothquant", "llm_int8") else "")


def format_row(r: dict) -> str:
    ppl = r["ppl"]
    bpw = f"{r['bpw']:.2f}" + (f" ({r['file_bpw']:.2f} file)" if "file_bpw" in r else "")
    return (f"| {r['model']} | {_label(r)} | {bpw} | {ppl['prose']:.3f} | {ppl['code']:.3f} "
            f"| {100 * r['agree']:.1f}% | {r['prefix']:.0f} | {CLAIMS.get(r['method'], '')} |")


def table(results: dict[str, dict]) -> str:
    """The markdown table of `run`'s or `load_cached`'s results, one settings line per model."""
    head = ("| model | method | bits/weight (blocks) | ppl prose | ppl code | greedy agreement "
            "(teacher-forced) | shared greedy prefix | paper's claim |\n"
            "|---|---|---|---|---|---|---|---|")
    lines, notes = [head], []
    for name, rows in results.items():
        lines += [format_row(r) for r in rows.values()]
        s = next(iter(rows.values()), {}).get("settings")
        if s:
            notes.append(f"{name}: {s['windows']} eval windows x {s['window']} tokens per corpus; "
                         f"agreement over {s['n_prompts']} prompts x {s['new_tokens']} greedy "
                         f"tokens; group size {s['group_size']}; calibration {s['calib_windows']}"
                         f" x {s['calib_window']} tokens")
    return "\n".join(lines + [""] + notes)
