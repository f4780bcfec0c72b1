"""Distillation data: the target's own continuations of prompts from the project's corpora.

    prompts = prompt_set(model.tokenizer, split="train", n=256)
    data = make_dataset(model, prompts, n_new=64, taps=(2, 15, 27), batch=8)
    batch = data.batch(step, batch_size=8, seed=0)     # a function of (seed, step) only

Prompts are the first `prompt_len` tokens of the documents of `jaxdec.corpora` (fortunes;
the stdlib modules cut at their top-level definitions, so code gives hundreds of prompts,
not thirty). Document `i` of a corpus is held out when `i % 10 == 9`, as the corpora's
own windows are; the two corpora are interleaved so any first `n` prompts mix both.

A dataset row is a prompt followed by what the target generated (greedy by default),
scored once more causally to record what a drafter learns from: the target's final-norm
hidden states ("final": its logits are `logits_from_hidden(target, final)`) and the
residual stream entering each tapped layer ("taps"), both bfloat16. `mask` is 1 exactly on
generated tokens (a stop token included, nothing after it). Datasets are cached as .npz
files keyed by everything that defines them, so a second run loads instead of generating;
a request for fewer taps is cut from a cached file of the same continuations.

With `n_new=0` nothing is generated: the rows are scored as they are (teacher forcing) and
every token after a row's first is to be predicted. `window_rows` cuts such rows from the
training documents, so the same target distributions come from far more text than the
prompts' continuations, at the cost of one causal pass each (no decode loop):

    windows = window_rows(model.tokenizer, window=128, n=4096)
    data = concat([data, make_dataset(model, windows, n_new=0, taps=(2, 15, 27), batch=8)])
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import sys
import tempfile
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxdec import corpora
from jaxdec.errors import JaxdecError
from jaxdec.models import transformer

SPLITS = ("train", "heldout")
_CODE_JOIN = "\n\n\n"  # code documents are a module's top-level blocks, split here
FORMAT = "jaxdec-distill-1"
_BF16 = np.dtype(jnp.bfloat16)


def default_cache_dir() -> pathlib.Path:
    """`data/distill` beside the corpora's `data/corpora` in a source checkout."""
    return corpora.data_dir().parent / "distill"


# ---------------------------------------------------------------------------- prompts


def documents(corpus: str) -> tuple[str, ...]:
    """The corpus's prompt documents: each fortune; each top-level block of a stdlib module
    (the text between two blank lines, where PEP 8 puts them), in file order."""
    docs = corpora.corpus_documents(corpus)
    if corpus == "code":
        docs = tuple(piece for d in docs for piece in d.split(_CODE_JOIN) if piece.strip())
    return docs


def prompt_set(tokenizer, *, split: str = "train", prompt_len: int = 32, n: int | None = None,
               corpus_names: tuple[str, ...] = corpora.CORPORA) -> list[list[int]]:
    """Token rows of `prompt_len` tokens (the tokenizer's BOS policy applies) from the
    documents of `split` that are at least that long, corpora interleaved; the first `n`."""
    if split not in SPLITS:
        raise JaxdecError(f"unknown prompt split {split!r} (known: {', '.join(SPLITS)})")
    if prompt_len < 1:
        raise JaxdecError(f"prompt_len must be positive (got {prompt_len})")
    return _from_documents(corpus_names, split == "heldout", n, f"{split} prompts of "
                           f"{prompt_len} tokens", lambda name, docs: _prefixes(
                               tokenizer, docs, prompt_len, n))


def _from_documents(corpus_names, held: bool, n: int | None, what: str, rows_of) -> list:
    """`rows_of(corpus name, its documents of the split)` for each corpus, interleaved; the
    first `n` (a one-line error if there are fewer). Document `i` is held out when
    `i % 10 == 9`."""
    per_corpus = [rows_of(name, [d for i, d in enumerate(documents(name)) if (i % 10 == 9) == held])
                  for name in corpus_names]
    mixed = [row for group in _interleave(per_corpus) for row in group]
    if n is not None and n > len(mixed):
        raise JaxdecError(f"asked for {n} {what}; the corpora have {len(mixed)}")
    return mixed[:n]


def _prefixes(tokenizer, docs, prompt_len: int, n: int | None, chunk: int = 256):
    """The first `prompt_len` tokens of each document that has them; the first `n` such."""
    rows = []
    for start in range(0, len(docs), chunk):
        # a prefix of 12 chars per token encodes to at least prompt_len tokens if the
        # document does (the cut only changes the last tokens, which are dropped)
        ids = tokenizer.encode_batch([d[: 12 * prompt_len] for d in docs[start: start + chunk]])
        rows += [r[:prompt_len] for r in ids if len(r) >= prompt_len]
        if n is not None and len(rows) >= n:
            return rows[:n]
    return rows


def _interleave(lists: list[list]) -> list[list]:
    """Round-robin groups: [[a0, b0], [a1, b1], ..., [a_k]] once the shorter list ends."""
    longest = max((len(x) for x in lists), default=0)
    return [[x[i] for x in lists if i < len(x)] for i in range(longest)]


def window_rows(tokenizer, *, window: int = 128, n: int | None = None,
                corpus_names: tuple[str, ...] = corpora.CORPORA) -> list[list[int]]:
    """Consecutive, non-overlapping rows of `window` tokens of each corpus's training
    documents joined as they were split (held-out documents are never in them), corpora
    interleaved; the first `n`."""
    if window < 2 or (n is not None and n < 1):
        raise JaxdecError(f"windows need at least 2 tokens each and a positive count (got "
                          f"{n} of {window})")

    def rows_of(name, docs):
        ids = np.asarray(tokenizer.encode((_CODE_JOIN if name == "code" else corpora.SEPARATOR)
                                          .join(docs)), np.int32)
        whole = len(ids) // window
        return [list(map(int, r)) for r in ids[: whole * window].reshape(whole, window)]

    return _from_documents(corpus_names, False, n, f"windows of {window} tokens of the "
                           "training documents", rows_of)


def heldout_prompts(tokenizer, n: int, *, prompt_len: int = 32) -> list[list[int]]:
    """`n` held-out prompt rows (never trained on): for evaluating drafters. The first
    ones: the benches take these."""
    return prompt_set(tokenizer, split="heldout", prompt_len=prompt_len, n=n)


def validation_prompts(tokenizer, n: int, *, prompt_len: int = 32,
                       corpus_names: tuple[str, ...] = corpora.CORPORA) -> list[list[int]]:
    """`n` held-out prompt rows for validation during training: each corpus's held-out
    prompts taken from the end, interleaved as the benches' first ones are (so both mix the
    corpora alike), and none of the benches' as long as a bench takes fewer of a corpus's
    held-out prompts than it has minus its share of `n`."""
    per_corpus = [prompt_set(tokenizer, split="heldout", prompt_len=prompt_len,
                             corpus_names=(name,))[::-1] for name in corpus_names]
    rows = [row for group in _interleave(per_corpus) for row in group]
    if not 0 < n <= len(rows):
        raise JaxdecError(f"asked for {n} validation prompts of {prompt_len} tokens; the "
                          f"corpora's held-out documents have {len(rows)}")
    return rows[:n]


# ---------------------------------------------------------------------------- dataset


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Dataset:
    """Target-generated training rows (see the module docstring)."""

    tokens: np.ndarray  # i32[N, T]: prompt, continuation, then 0s
    mask: np.ndarray  # f32[N, T]: 1 on generated tokens
    taps: np.ndarray  # bf16[N, T, n_taps, D]: residual stream entering each tapped layer
    final: np.ndarray  # bf16[N, T, D]: the target's final-norm hidden states
    meta: dict  # what defines the data (target, prompts digest, settings)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return tuple(self.meta["taps"])

    def rows(self, idx) -> dict[str, np.ndarray]:
        return {"tokens": self.tokens[idx], "mask": self.mask[idx], "taps": self.taps[idx],
                "final": self.final[idx]}

    def batch(self, step: int, batch_size: int, seed: int) -> dict[str, np.ndarray]:
        """Training batch `step` of a run with `seed` (see `batch_rows`)."""
        return self.rows(batch_rows(len(self), batch_size, seed, step))


def concat(parts: list[Dataset]) -> Dataset:
    """One dataset of the rows of `parts` (same target and taps), narrower rows padded
    (mask 0) to the widest."""
    if not parts:
        raise JaxdecError("concat needs at least one dataset")
    if len(parts) == 1:
        return parts[0]
    first = parts[0].meta
    for p in parts[1:]:
        if (p.meta["target"], p.meta["weights"], p.tap_layers) != (
                first["target"], first["weights"], parts[0].tap_layers):
            raise JaxdecError("datasets of different targets or taps cannot be joined")
    width = max(p.tokens.shape[1] for p in parts)
    pad = lambda x: np.pad(x, [(0, 0), (0, width - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
    meta = {"format": FORMAT, "target": first["target"], "weights": first["weights"],
            "taps": list(parts[0].tap_layers), "parts": [p.meta for p in parts]}
    return Dataset(**{f: np.concatenate([pad(getattr(p, f)) for p in parts])
                      for f in ("tokens", "mask", "taps", "final")}, meta=meta)


def batch_rows(n: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """i64[batch_size]: the rows of batch `step`: epochs are permutations drawn from
    `default_rng((seed, epoch))`, cut into whole batches (a ragged tail is skipped), so the
    batch depends on (seed, step) alone and a resumed run sees the batches it would have."""
    if not 0 < batch_size <= n:
        raise JaxdecError(f"a batch of {batch_size} rows needs a dataset of at least that "
                          f"many (it has {n})")
    per_epoch = n // batch_size
    epoch, i = divmod(step, per_epoch)
    perm = np.random.default_rng((seed, epoch)).permutation(n)
    return perm[i * batch_size: (i + 1) * batch_size]


def make_dataset(model, prompts, *, n_new: int, taps: tuple[int, ...] = (), batch: int = 8,
                 temperature: float = 0.0, seed: int = 0, samples: int = 1,
                 cache_dir: str | pathlib.Path | None = None) -> Dataset:
    """The target `model`'s continuations of `prompts` (token rows) of `n_new` tokens, made
    `batch` rows at a time, and their taps; loaded from `cache_dir` when made before.
    `samples` > 1 (with a temperature): that many sampled continuations of each prompt (the
    rows are the prompts `samples` times over, each pass in other batches, so with other
    keys): more of the target's own text from a bounded set of prompts.
    `n_new=0`: the rows themselves, scored (teacher forcing; see the module docstring)."""
    _check_request(model.cfg, prompts, n_new, taps, batch)
    if samples < 1 or (samples > 1 and not (n_new and temperature > 0)):
        raise JaxdecError(f"{samples} samples per prompt: samples must be >= 1, and more than "
                          "one needs generated tokens (n_new > 0) and a temperature > 0 (greedy "
                          "continuations are all the same)")
    extra = {"samples": samples} if samples > 1 else {}  # the cache keys of 1 are unchanged
    prompts = [p for _ in range(samples) for p in prompts]
    meta = _meta(model, prompts, n_new=n_new, taps=tuple(taps), batch=batch,
                 temperature=temperature, seed=seed, **extra)
    path = pathlib.Path(cache_dir or default_cache_dir()) / _file_name(model, meta)
    if path.is_file():
        return load_dataset(path, meta)
    data = _from_wider(path, meta)
    if data is not None:
        return data
    t0 = time.perf_counter()
    data = _generate(model, prompts, meta)
    save_dataset(path, data)
    print(f"distillation data: {len(data)} rows, {int(data.mask.sum())} target tokens "
          f"{'generated' if n_new else 'scored'} in {time.perf_counter() - t0:.0f} s: {path}",
          file=sys.stderr)
    return data


def _check_request(cfg, prompts, n_new: int, taps, batch: int) -> None:
    if not prompts or min(len(p) for p in prompts) == 0:
        raise JaxdecError("make_dataset needs at least one non-empty prompt")
    if n_new < 0 or batch < 1:
        raise JaxdecError(f"n_new must be >= 0 and batch positive (got {n_new}, {batch})")
    if any(not 0 <= t < cfg.n_layers for t in taps):
        raise JaxdecError(f"taps {tuple(taps)} name layers outside 0..{cfg.n_layers - 1}")
    if max(len(p) for p in prompts) + n_new > cfg.max_position:
        raise JaxdecError(f"prompts + {n_new} new tokens exceed the context of "
                          f"{cfg.max_position} tokens")


def _meta(model, prompts, **settings) -> dict:
    rows = hashlib.sha256(json.dumps([list(map(int, p)) for p in prompts]).encode())
    return {"format": FORMAT, "target": model.source, "vocab_size": model.cfg.vocab_size,
            "d_model": model.cfg.d_model, "weights": params_digest(model.params),
            "prompts": rows.hexdigest()[:16], "n_prompts": len(prompts), **settings,
            "taps": list(settings["taps"])}


def params_digest(params) -> str:
    """A short fingerprint of a parameter pytree: every leaf's shape, dtype and first
    KiB of bytes (cheap on a 0.5B model, and tells two random test models apart)."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        arr = np.asarray(leaf)
        h.update(f"{arr.shape}{arr.dtype}".encode())
        h.update(arr.reshape(-1)[:1024 // max(arr.itemsize, 1)].tobytes())
    return h.hexdigest()[:16]


def _file_name(model, meta: dict) -> str:
    key = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:16]
    name = "".join(c if c.isalnum() or c in "-._" else "_" for c in
                   pathlib.Path(str(model.source) or "model").name)
    return f"{name}-{key}.npz"


def _generate(model, prompts, meta: dict) -> Dataset:
    """Generate and score `prompts` in batches of meta["batch"] rows (the last one padded
    with idle rows, so every batch runs the same compiled programs)."""
    from tqdm import tqdm

    from jaxdec.batching import pad_rows

    b, taps = meta["batch"], tuple(meta["taps"])
    width = max(len(p) for p in prompts)
    parts = []
    starts = range(0, len(prompts), b)
    what = "generating" if meta["n_new"] else "scoring"
    for j, start in enumerate(tqdm(starts, desc=f"{what} distillation data", unit="batch",
                                   file=sys.stderr, disable=None)):
        chunk = list(prompts[start: start + b])
        k = len(chunk)
        rows = chunk + [chunk[0]] * (b - k)
        if meta["n_new"]:
            tokens, positions, mask = _continue(model, rows, k, width, meta, j)
        else:  # teacher forcing: the row's first token is the prompt, the rest "generated"
            tokens, lens = pad_rows(rows, width=width)
            tokens, positions, mask = _assemble(tokens[:, :1], np.minimum(lens, 1),
                                                tokens[:, 1:], lens - 1)
        tapped, final = _score(model.params, tokens, positions, cfg=model.cfg, taps=taps)
        parts.append((tokens[:k], mask[:k], np.asarray(tapped)[:k], np.asarray(final)[:k]))
    tokens, mask, tapped, final = (np.concatenate(x) for x in zip(*parts))
    return Dataset(tokens=tokens, mask=mask, taps=tapped, final=final, meta=meta)


def _continue(model, rows, n_real: int, width: int, meta: dict, index: int):
    """Generate for one batch -> (tokens i32[B, width + n_new], positions, mask)."""
    from jaxdec import decode
    from jaxdec.batching import pad_rows
    from jaxdec.cache import dense
    from jaxdec.sampling import make_sampler

    b, n_new = len(rows), meta["n_new"]
    prompts, lens = pad_rows(rows, width=width)
    limits = np.where(np.arange(b) < n_real, n_new, 0).astype(np.int32)
    capacity = -(-(width + n_new) // 64) * 64
    cache = dense.init_cache(model.cfg, b, capacity, model.dtype)
    key = jax.random.fold_in(jax.random.key(meta["seed"]), index)
    progress, _ = decode.generate_tokens(
        model.params, cache, prompts, lens, key, limits,
        sampler=make_sampler(temperature=meta["temperature"]), cfg=model.cfg,
        max_new_tokens=n_new, stop_ids=tuple(model.cfg.eos_ids))
    return _assemble(prompts, lens, np.asarray(progress.tokens), np.asarray(progress.n_generated))


def _assemble(prompts, lens, generated, n_generated):
    """Right-aligned rows [prompt, generated, 0s] with their positions (-1 on padding) and
    the mask of generated tokens."""
    b, width = prompts.shape
    t = width + generated.shape[1]
    tokens = np.zeros((b, t), np.int32)
    mask = np.zeros((b, t), np.float32)
    for i in range(b):
        p, g = lens[i], n_generated[i]
        tokens[i, :p] = prompts[i, :p]
        tokens[i, p: p + g] = generated[i, :g]
        mask[i, p: p + g] = 1.0
    total = (lens + n_generated)[:, None]
    positions = np.where(np.arange(t)[None] < total, np.arange(t)[None], -1).astype(np.int32)
    return tokens, positions, mask


@partial(jax.jit, static_argnames=("cfg", "taps"))
def _score(params, tokens, positions, *, cfg, taps):
    """One causal pass -> (taps bf16[B, T, n_taps, D], final bf16[B, T, D])."""
    final, _, tapped = transformer.hidden_and_taps(params, tokens, positions, None, cfg, taps=taps)
    b, t, d = final.shape
    stacked = jnp.stack(tapped, axis=2) if taps else jnp.zeros((b, t, 0, d), final.dtype)
    return stacked.astype(jnp.bfloat16), final.astype(jnp.bfloat16)


# ---------------------------------------------------------------------------- files


def save_dataset(path: pathlib.Path, data: Dataset) -> pathlib.Path:
    """Write `data` as an .npz (bf16 arrays as their uint16 bits), atomically."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, tokens=data.tokens, mask=data.mask, taps=data.taps.view(np.uint16),
                     final=data.final.view(np.uint16), meta=np.array(json.dumps(data.meta)))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def _from_wider(path: pathlib.Path, meta: dict) -> Dataset | None:
    """The data `meta` defines, cut from a cached file of the same continuations that
    carries more taps (a PARD run reuses an EAGLE-3 run's data instead of regenerating it:
    the generation is the cost); None when there is no such file."""
    want = meta["taps"]
    for other in sorted(path.parent.glob(path.name.rsplit("-", 1)[0] + "-*.npz")):
        try:
            with np.load(other, allow_pickle=False) as f:
                have = json.loads(str(f["meta"]))
                if {**have, "taps": want} == meta and set(want) <= set(have["taps"]):
                    return _read(f, meta, [have["taps"].index(t) for t in want])
        except (OSError, ValueError, KeyError):
            continue  # not ours to judge here: it is only a candidate
    return None


def _read(f, meta: dict, cols: list[int] | None = None) -> Dataset:
    """The Dataset in an open .npz `f`, keeping the taps in `cols` (None: all)."""
    tokens, final = f["tokens"], f["final"].view(_BF16)
    if cols == []:  # no taps: do not read them
        taps = np.zeros((*tokens.shape, 0, final.shape[-1]), _BF16)
    else:
        taps = f["taps"].view(_BF16)
        taps = taps if cols is None else taps[:, :, cols]
    return Dataset(tokens=tokens, mask=f["mask"], taps=taps, final=final, meta=meta)


def load_dataset(path: pathlib.Path, expect: dict | None = None) -> Dataset:
    """Read a dataset file; JaxdecError if it is damaged or (given `expect`) not the one
    those settings define."""
    try:
        with np.load(path, allow_pickle=False) as f:
            meta = json.loads(str(f["meta"]))
            data = _read(f, meta)
    except (OSError, ValueError, KeyError) as e:
        raise JaxdecError(f"{path}: unreadable distillation data ({e.__class__.__name__}); "
                          "delete it to regenerate") from None
    if expect is not None and meta != expect:
        raise JaxdecError(f"{path}: holds other distillation data than asked for; delete it")
    return data
