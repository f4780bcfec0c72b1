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
- bits per weight of the transformer blocks' matmul weights, scales included (the embedding
  and LM head are listed separately: the PTQ methods keep them in float, k-quant recipes
  quantise them).
Rows are cached in a JSON file as they finish, so an interrupted run resumes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import time
from collections.abc import Callable

import jax
import numpy as np

import jaxdec
from jaxdec import corpora, perplexity, prompts
from jaxdec.errors import JaxdecError
from jaxdec.quant import calibrate, kurtail, methods
from jaxdec.quant.actquant import ActQuant
from jaxdec.quant.qarray import QArray

# the paper's claim beside each method (shared/algorithms.md; [U]: our reading, unconfirmed)
CLAIMS = {
    "f32": "baseline (the dequantised GGUF)",
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
    """"gptq:3" -> {"method": "gptq", "bits": 3}; "f32" -> the baseline."""
    if text == "f32":
        return {"method": "f32", "bits": 32}
    method, _, bits = text.partition(":")
    if method not in (*methods.METHODS, *kurtail.TABLE_ROWS) or not bits.isdigit():
        raise JaxdecError(f"bad table row {text!r}: expected f32 or METHOD:BITS with METHOD one of "
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
        if spec["method"] == "f32":
            model, bpw = self.model, 32.0
        elif spec["method"] in kurtail.TABLE_ROWS:  # W4A4KV4 with or without rotations
            params = kurtail.table_row(self.model.params, self.model.cfg, spec["method"],
                                       spec["bits"], self.calib)
            model, bpw = dataclasses.replace(self.model, params=params), block_bits(params)[0]
        else:
            q = methods.QuantSpec(method=spec["method"], bits=spec["bits"],
                                  group_size=self.s.group_size)
            calib = self.calib if q.needs_calibration else None
            params = methods.quantize_model(self.model.params, self.model.cfg, q, calib=calib)
            model, bpw = dataclasses.replace(self.model, params=params), block_bits(params)[0]
        t1 = time.perf_counter()
        out = self.evaluate(model)
        return {**spec, **out, "bpw": bpw, "quantize_s": t1 - t0,
                "eval_s": time.perf_counter() - t1}


def run(models: list[str], rows: list[str], settings: Settings, cache: pathlib.Path,
        log: Callable[[str], None] = print) -> dict:
    """Every (model, row), reusing the rows cached in `cache` under the same settings."""
    specs = [parse_row(r) for r in rows]
    done = json.loads(cache.read_text()) if cache.exists() else {}
    key = json.dumps(dataclasses.asdict(settings), sort_keys=True)
    if done.get("settings") != key:
        done = {"settings": key, "rows": {}}
    for name in models:
        ev = None
        for text, spec in zip(rows, specs):
            k = f"{name} {text}"
            if k in done["rows"]:
                continue
            ev = ev or Evaluator(name, settings)
            done["rows"][k] = {"model": name, **ev.row(spec)}
            tmp = cache.with_suffix(".tmp")
            tmp.write_text(json.dumps(done, indent=1))
            tmp.replace(cache)
            log(format_row(done["rows"][k]))
    return done


def format_row(r: dict) -> str:
    ppl = r["ppl"]
    label = "f32 (baseline)" if r["method"] == "f32" else f"{r['method']} W{r['bits']}"
    return (f"| {r['model']} | {label} | {r['bpw']:.2f} | {ppl['prose']:.3f} | {ppl['code']:.3f} "
            f"| {100 * r['agree']:.1f}% | {r['prefix']:.0f} | {CLAIMS.get(r['method'], '')} |")


def table(done: dict, settings: Settings) -> str:
    head = ("| model | method | bits/weight (blocks) | ppl prose | ppl code | greedy agreement "
            f"({settings.new_tokens} tok, teacher-forced) | shared greedy prefix | paper's claim |\n"
            "|---|---|---|---|---|---|---|---|")
    return "\n".join([head] + [format_row(r) for r in done["rows"].values()])
