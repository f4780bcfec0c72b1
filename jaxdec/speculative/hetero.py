"""Speculative decoding with a drafter whose vocabulary is not the target's (Timor et al.,
2025, "Accelerating LLM Inference with Lossless Speculative Decoding Algorithms for
Heterogeneous Vocabularies", arXiv 2502.05202). Both algorithms are lossless.

    ids, stats = generate(target_model, drafter_model, prompt_ids_rows, method="tli", k=4,
                          max_new_tokens=64, sampler=Greedy(), seed=0)

- TLI (token-level intersection): V_both holds the tokens both vocabularies spell with the
  same bytes (an added/special token pairs only with an added token of the same content).
  The drafter samples from its distribution restricted to V_both and renormalised; each
  draft maps to its target id, and q, that restricted distribution scattered onto the
  target's vocabulary, is a proposal over the target's vocabulary: standard verification
  (`core.accept_greedy`, `core.accept_sample`) keeps the output the target's.
- SLEM (string-level exact match): the drafter drafts k tokens of its own vocabulary; the
  target tokenizes their text (a window starting a few committed tokens back, keeping the
  tokens past the committed text) and keeps them while each equals its own greedy choice,
  or its own sample; the first mismatch is replaced by the target's token. Only the
  target's own choices are ever emitted.

A round: the drafter (jitted) catches up on the text committed last round and drafts k
tokens from its cache; the target (jitted) verifies [last, t_1..t_m], padded to k + 1 so it
compiles once; the host keeps the books: acceptance, stop tokens, and the drafter's view of
the text, which is the committed text tokenized in the drafter's own vocabulary (its cache
is rolled back to where that tokenization first differs from what it holds). Caches are
donated; rolling back lowers `lengths`. Rows are independent: each has its own prompt,
accepted counts and drafter context.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time
from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxdec import decode
from jaxdec.batching import check_context, check_ids, pad_rows
from jaxdec.cache import dense
from jaxdec.checkpoint.tokenizer import token_pieces
from jaxdec.config import ModelConfig
from jaxdec.errors import JaxdecError
from jaxdec.models import transformer
from jaxdec.sampling import Greedy, Sampler
from jaxdec.speculative import core, small_model

METHODS = ("tli", "slem")
_BACK = 4  # drafter tokens re-tokenized behind the committed end each round
_TARGET_BACK = 2  # committed target tokens in front of a SLEM draft's text
_FEED = 4  # drafter tokens one draft call catches up on (more go through `_feed` first)


@dataclasses.dataclass(frozen=True)
class CrossVocab:
    """A drafter model with another vocabulary: "tli" (token-level intersection, lossless
    under sampling too) or "slem" (string-level exact match)."""

    model: object
    method: str = "tli"
    k: int = core.DEFAULT_K


# ---------------------------------------------------------------------------- vocabularies


@dataclasses.dataclass(frozen=True, eq=False)
class Vocab:
    """A vocabulary as bytes: what each model row spells, and how to spell bytes.

    Invariant: `pieces` has one entry per row of the model's embedding; None where a row
    spells nothing (rows past the tokenizer, `[PADn]` fillers)."""

    pieces: tuple[bytes | None, ...]
    added: frozenset[int]  # ids matched whole in raw text (special and added tokens)
    encode_text: Callable[[str], list[int]]  # str -> ids (no BOS)
    byte_ids: tuple[int | None, ...]  # [256]: the plain single-byte token of each byte
    bos: int | None = None  # prepended to a drafter's context when its tokenizer adds one

    @classmethod
    def from_strings(cls, strings: Sequence[str], *, added: Sequence[int] = ()) -> "Vocab":
        """A vocabulary given as token strings (id = index); encodes by longest match."""
        pieces = tuple(s.encode("utf-8") for s in strings)
        return cls(pieces=pieces, added=frozenset(added), byte_ids=_byte_ids(pieces, added),
                   encode_text=partial(_longest_match, pieces))

    def encode(self, data: bytes) -> list[int]:
        """Ids spelling `data`: its valid UTF-8 runs through the tokenizer, stray bytes
        (half a character at a window's edge) as single-byte tokens."""
        out = []
        for run in _RUNS.findall(data.decode("utf-8", errors="surrogateescape")):
            if "\udc80" <= run[0] <= "\udcff":
                out += [i for c in run if (i := self.byte_ids[ord(c) - 0xDC00]) is not None]
            else:
                out += self.encode_text(run)
        return out

    def spell(self, ids: Sequence[int]) -> bytes:
        return b"".join(self.pieces[i] or b"" for i in ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.spell(ids).decode("utf-8", errors="replace")


_RUNS = re.compile("[\udc80-\udcff]+|[^\udc80-\udcff]+")


def _byte_ids(pieces, added) -> tuple[int | None, ...]:
    ids = {p[0]: i for i, p in reversed(list(enumerate(pieces)))
           if p is not None and len(p) == 1 and i not in added}
    return tuple(ids.get(b) for b in range(256))


def _longest_match(pieces: tuple[bytes, ...], text: str) -> list[int]:
    table = {p: i for i, p in reversed(list(enumerate(pieces))) if p}
    data, longest, i, out = text.encode("utf-8"), max(map(len, table)), 0, []
    while i < len(data):
        n = next((n for n in range(min(longest, len(data) - i), 0, -1)
                  if data[i:i + n] in table), 0)
        if n:
            out.append(table[data[i:i + n]])
        i += max(n, 1)  # a byte this vocabulary cannot spell is dropped
    return out


@functools.lru_cache(maxsize=8)
def vocab_of(tokenizer, rows: int) -> Vocab:
    """The `Vocab` of a jaxdec `Tokenizer` for a model with `rows` embedding rows."""
    if isinstance(tokenizer, Vocab):
        return tokenizer
    backend = tokenizer.backend
    added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
    pieces = token_pieces(tokenizer, rows)
    encode = lambda text: backend.encode(text, add_special_tokens=False).ids
    return Vocab(pieces=pieces, added=frozenset(added), encode_text=encode,
                 byte_ids=_byte_ids(pieces, added),
                 bos=tokenizer.bos_id if tokenizer.add_bos else None)


def intersection(drafter: Vocab, target: Vocab, *, min_overlap: float = 0.5):
    """V_both as (drafter ids, target ids), i32[n] each: tokens spelling the same bytes,
    added tokens only with added tokens. Refuses a drafter that shares fewer than
    `min_overlap` of its text-bearing tokens with the target."""
    index = {}
    for i, p in enumerate(target.pieces):  # the lowest id wins a tie
        if p is not None:
            index.setdefault((i in target.added, p), i)
    pairs = [(i, index[key]) for i, p in enumerate(drafter.pieces)
             if p is not None and (key := (i in drafter.added, p)) in index]
    n_text = sum(p is not None for p in drafter.pieces)
    if not pairs or len(pairs) < min_overlap * n_text:
        raise JaxdecError(f"TLI needs the drafter to share at least {min_overlap:.0%} of its "
                          f"{n_text} tokens with the target's vocabulary; it shares "
                          f"{len(pairs)} ({len(pairs) / max(n_text, 1):.0%})")
    d_ids, t_ids = np.asarray(pairs, np.int32).T
    return d_ids, t_ids


# ---------------------------------------------------------------------------- jitted steps


_JIT = dict(donate_argnames=("cache",), compiler_options=decode.COMPILER_OPTIONS)


@partial(jax.jit, static_argnames=("cfg", "sampler"), **_JIT)
def _prefill(params, cache, tokens, lens, key, *, cfg: ModelConfig, sampler: Sampler):
    """The target's prompts -> (each row's first token i32[B], cache)."""
    logits, cache = decode.prefill(params, cache, tokens, lens, cfg)
    return sampler(logits, key), cache


def _chunk(params, cache, keep, tokens, n, cfg):
    """Roll row b back to keep[b] tokens, then append the first n[b] of tokens [B, T]
    -> (hidden [B, T, D], cache)."""
    cache = dataclasses.replace(cache, lengths=keep)
    steps = jnp.arange(tokens.shape[1])[None]
    positions = jnp.where(steps < n[:, None], keep[:, None] + steps, -1)
    return transformer.hidden(params, tokens, positions, cache, cfg)


@partial(jax.jit, static_argnames=("cfg",), **_JIT)
def _feed(params, cache, keep, tokens, n, *, cfg: ModelConfig):
    """The drafter catches up on a long stretch of text (its prompt, say)."""
    return _chunk(params, cache, keep, tokens, n, cfg)[1]


def propose(logits, allowed, key, sampler: Sampler):
    """A draft from drafter logits f32[B, V_d] restricted to `allowed` (bool[V_d]) and
    renormalised -> (token i32[B], q f32[B, V_d], or None when greedy)."""
    return small_model.propose(jnp.where(allowed, logits, -jnp.inf), key, sampler)


@partial(jax.jit, static_argnames=("cfg", "sampler", "k"), **_JIT)
def _draft(params, cache, keep, tokens, n, allowed, key, *, cfg: ModelConfig,
           sampler: Sampler, k: int):
    """Catch up on tokens [B, F] (row b: its first n[b]; rows with n = 0 sit out), then
    draft k tokens -> (drafts i32[B, k], q f32[B, k, V_d] or None, cache)."""
    h, cache = _chunk(params, cache, keep, tokens, n, cfg)
    h = jnp.take_along_axis(h, jnp.maximum(n - 1, 0)[:, None, None], axis=1)[:, 0]
    logits, active, keys = transformer.logits_from_hidden(params, h), n > 0, jax.random.split(key, k)
    toks, qs = [], []
    for i in range(k):  # unrolled: k is small
        tok, q = propose(logits, allowed, keys[i], sampler)
        toks, qs = toks + [tok], qs + [q]
        if i + 1 < k:
            positions = jnp.where(active, cache.lengths, -1)[:, None]
            logits, cache = transformer.forward(params, tok[:, None], positions, cache, cfg)
            logits = logits[:, 0]
    return jnp.stack(toks, axis=1), None if qs[0] is None else jnp.stack(qs, axis=1), cache


def accept_match(logits, drafts, key, sampler: Sampler):
    """SLEM's rule: the target samples every position itself; drafts are kept while they
    equal its samples, and its own sample follows -> (n_acc i32[B], next i32[B])."""
    b, t, v = logits.shape
    filtered = sampler.filter(logits.reshape(b * t, v)).reshape(b, t, v)
    own = jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)
    n_acc = core.leading(drafts == own[:, :-1])
    return n_acc, jnp.take_along_axis(own, n_acc[:, None], axis=1)[:, 0]


def _accept_tli(logits, drafts, q, pairs, key, sampler: Sampler):
    """Speculative sampling with q scattered onto the target's vocabulary; a row that
    drafted nothing (drafts all -1) samples p_0 itself."""
    d_ids, t_ids = pairs
    q_t = jnp.zeros(drafts.shape + logits.shape[-1:], jnp.float32)
    q_t = q_t.at[:, :, t_ids].add(q[:, :, d_ids])
    a_key, p_key = jax.random.split(key)
    n_acc, nxt = core.accept_sample(logits, jnp.maximum(drafts, 0), q_t, a_key, sampler)
    own = jax.random.categorical(p_key, sampler.filter(logits[:, 0]), axis=-1)
    none = drafts[:, 0] < 0
    return jnp.where(none, 0, n_acc), jnp.where(none, own, nxt).astype(jnp.int32)


@partial(jax.jit, static_argnames=("cfg", "sampler", "method"), **_JIT)
def _verify(params, cache, chunk, m, active, key, q, pairs, *, cfg: ModelConfig,
            sampler: Sampler, method: str):
    """Score chunk [B, k+1] = [last, t_1..t_k] (row b drafted m[b]) at each active row's
    next positions and accept -> (n_acc i32[B], next i32[B], cache holding last and the
    kept drafts)."""
    base = cache.lengths
    positions = jnp.where(active[:, None], base[:, None] + jnp.arange(chunk.shape[1]), -1)
    logits, cache = transformer.forward(params, chunk, positions, cache, cfg)
    drafts = jnp.where(jnp.arange(chunk.shape[1] - 1) < m[:, None], chunk[:, 1:], -1)
    if isinstance(sampler, Greedy):
        n_acc, nxt = core.accept_greedy(logits, drafts)
    elif method == "slem":
        n_acc, nxt = accept_match(logits, drafts, key, sampler)
    else:
        n_acc, nxt = _accept_tli(logits, drafts, q, pairs, key, sampler)
    lengths = jnp.where(active, base + n_acc + 1, base)
    return n_acc, nxt, dataclasses.replace(cache, lengths=lengths)


# ---------------------------------------------------------------------------- host books


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Plan:
    """What a generation fixes before its first round (host side)."""

    method: str
    k: int
    target: Vocab
    drafter: Vocab
    allowed: jax.Array  # bool[V_d]: the drafts the drafter may propose
    pairs: tuple[jax.Array, jax.Array]  # V_both: (drafter ids, target ids), i32[n] each
    to_target: np.ndarray  # i32[V_d]: a drafter id's target id (TLI), -1 outside V_both
    stops: frozenset[int]
    max_new: int
    drafter_capacity: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Row:
    """One row's books between rounds."""

    target: tuple[int, ...]  # committed target ids; the last one is not in its cache yet
    n_new: int  # ids emitted (a final stop id included)
    text: bytes  # what `target` spells
    want: tuple[int, ...]  # the drafter's tokens for `text`
    ends: tuple[int, ...]  # where each of `want` ends in `text`
    cached: tuple[int, ...] = ()  # the drafter ids its cache holds, slot by slot
    stable: int = 0  # cached[:stable] == want[:stable]
    done: bool = False
    stopped: bool = False
    drafting: bool = True  # False once the drafter's cache is full: the row decodes plainly


def _tokenize(dv: Vocab, want, ends, text: bytes, back: int):
    """`text` in the drafter's vocabulary, re-tokenized from `back` tokens before the end
    of its tokens so far `want` -> (want, ends, index of the first token that may differ)."""
    j = max(0 if dv.bos is None else 1, len(want) - back)
    start = ends[j - 1] if j else 0
    new = dv.encode(text[start:])
    offsets = start + np.cumsum([len(dv.pieces[i]) for i in new], dtype=np.int64)
    return want[:j] + tuple(new), ends[:j] + tuple(offsets.tolist()), j


def _start_row(plan: _Plan, prompt: Sequence[int], first: int) -> _Row:
    text, dv = plan.target.spell(prompt), plan.drafter
    bos = () if dv.bos is None else (dv.bos,)
    want, ends, _ = _tokenize(dv, bos, (0,) * len(bos), text, 0)
    row = _Row(target=tuple(prompt), n_new=0, text=text, want=want, ends=ends)
    return _commit(plan, row, [first])


def _commit(plan: _Plan, row: _Row, emitted: Sequence[int]) -> _Row:
    """Append a round's ids up to a stop id or the row's limit; re-tokenize for the drafter."""
    ids = []
    for t in emitted[: plan.max_new - row.n_new]:
        ids.append(int(t))
        if t in plan.stops:
            break
    stopped = bool(ids) and ids[-1] in plan.stops
    n_new, text = row.n_new + len(ids), row.text + plan.target.spell(ids)
    row = dataclasses.replace(row, target=row.target + tuple(ids), n_new=n_new, text=text,
                              stopped=stopped, done=stopped or n_new >= plan.max_new)
    if row.done:
        return row
    want, ends, j = _tokenize(plan.drafter, row.want, row.ends, text, _BACK)
    return dataclasses.replace(row, want=want, ends=ends, stable=min(row.stable, j))


def _pending(row: _Row) -> tuple[int, tuple[int, ...]]:
    """(keep, feed): the drafter keeps the first `keep` tokens it holds and is fed the rest
    of `want` (at least one token: its logits are the first draft's)."""
    i, n = row.stable, min(len(row.cached), len(row.want))
    while i < n and row.cached[i] == row.want[i]:
        i += 1
    keep = min(i, len(row.want) - 1)
    return keep, row.want[keep:]


def _catch_up(plan: _Plan, dmodel, rows, dcache):
    """Feed the drafter, through `_feed`, all but the last `_FEED` tokens of a long
    pending stretch (a prompt) -> (rows, cache)."""
    plans = [_pending(r) if r.drafting and not r.done else None for r in rows]
    long = [p is not None and len(p[1]) > _FEED for p in plans]
    if not any(long):
        return rows, dcache
    keep = np.array([p[0] if is_long else len(r.cached)
                     for r, p, is_long in zip(rows, plans, long)], np.int32)
    seqs = [p[1][:-_FEED] if is_long else () for p, is_long in zip(plans, long)]
    tokens, n = pad_rows(seqs, 32)
    dcache = _feed(dmodel.params, dcache, keep, tokens, n, cfg=dmodel.cfg)
    rows = [dataclasses.replace(r, cached=r.want[: keep[b] + n[b]], stable=int(keep[b] + n[b]))
            if long[b] else r for b, r in enumerate(rows)]
    return rows, dcache


def _draft_rows(plan: _Plan, dmodel, rows, dcache, key, sampler):
    """Each drafting row catches up and drafts k tokens -> (drafts i32[B, k] on the host,
    -1 for rows that do not draft; q or None; rows; cache)."""
    rows = [dataclasses.replace(r, drafting=False)
            if r.drafting and len(r.want) + plan.k > plan.drafter_capacity else r for r in rows]
    rows, dcache = _catch_up(plan, dmodel, rows, dcache)
    live = [r.drafting and not r.done for r in rows]
    plans = [_pending(r) if on else (len(r.cached), ()) for r, on in zip(rows, live)]
    tokens, n = pad_rows([p[1] for p in plans], width=_FEED)
    keep = np.array([p[0] for p in plans], np.int32)
    drafts, q, dcache = _draft(dmodel.params, dcache, keep, tokens, n, plan.allowed, key,
                               cfg=dmodel.cfg, sampler=sampler, k=plan.k)
    drafts = np.where(np.array(live)[:, None], np.asarray(drafts), -1)
    rows = [dataclasses.replace(r, cached=r.want + tuple(map(int, drafts[b, :-1])),
                                stable=len(r.want)) if live[b] else r
            for b, r in enumerate(rows)]
    return drafts, q, rows, dcache


def _slem_tokens(plan: _Plan, row: _Row, drafts: np.ndarray) -> list[int]:
    """The target's tokens for the drafts' text: a window of committed text in front of
    it is tokenized with it, and the tokens past the window kept (the draft text alone
    when no token boundary falls where the window ends)."""
    tv, draft = plan.target, plan.drafter.spell(drafts)
    window = tv.spell(row.target[-_TARGET_BACK:])
    ids = tv.encode(window + draft)
    ends = np.cumsum([len(tv.pieces[i]) for i in ids])
    at = np.flatnonzero(ends == len(window))
    return (ids[at[0] + 1:] if at.size else tv.encode(draft))[: plan.k]


def _target_chunk(plan: _Plan, rows, drafts: np.ndarray):
    """[last, t_1..t_m, 0...] i32[B, k+1] and m i32[B]."""
    seqs = []
    for b, r in enumerate(rows):
        if drafts[b, 0] < 0:
            new = []
        elif plan.method == "tli":
            new = plan.to_target[drafts[b]].tolist()
        else:
            new = _slem_tokens(plan, r, drafts[b])
        seqs.append([r.target[-1], *new])
    chunk, n = pad_rows(seqs, width=plan.k + 1)
    return chunk, n - 1


# ---------------------------------------------------------------------------- generation


def _check(target_model, drafter_model, prompts, *, method, k, max_new_tokens, capacity):
    """Refuse bad input in one line -> the target cache's capacity."""
    if method not in METHODS:
        raise JaxdecError(f"unknown method {method!r} (one of {', '.join(METHODS)})")
    if not isinstance(k, (int, np.integer)) or k < 1:
        raise JaxdecError(f"the draft length k must be a positive integer (got {k})")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise JaxdecError(f"max_new_tokens must be a positive integer (got {max_new_tokens})")
    if not prompts or min(map(len, prompts)) == 0:
        raise JaxdecError("every prompt needs at least one token id")
    check_ids(prompts, target_model.cfg.vocab_size)
    for m in (target_model, drafter_model):
        if any(mixer == "mamba" for mixer, _ in m.cfg.kinds):
            raise JaxdecError("speculative decoding needs caches it can roll back: "
                              f"{m.cfg.name or 'a model'} has Mamba layers")
    longest = max(map(len, prompts))
    check_context(target_model.cfg, longest, max_new_tokens + k + 1)
    need = longest + max_new_tokens + k + 1
    if capacity is not None and need > capacity:
        raise JaxdecError(f"a draft of k={k} tokens (+1 verified) past a prompt of {longest} "
                          f"and {max_new_tokens} new tokens needs a cache of {need} tokens "
                          f"(capacity {capacity})")
    return capacity or -(-need // 64) * 64


def _plan(target_model, drafter_model, *, method, k, max_new_tokens, stop_ids,
          min_overlap) -> _Plan:
    tv = vocab_of(target_model.tokenizer, target_model.cfg.vocab_size)
    dv = vocab_of(drafter_model.tokenizer, drafter_model.cfg.vocab_size)
    to_target = np.full(len(dv.pieces), -1, np.int32)
    if method == "tli":
        d_ids, t_ids = intersection(dv, tv, min_overlap=min_overlap)
        to_target[d_ids] = t_ids
        allowed = to_target >= 0
    else:
        d_ids = t_ids = np.zeros(0, np.int32)
        allowed = np.array([p is not None for p in dv.pieces])
    stops = target_model.cfg.eos_ids if stop_ids is None else stop_ids
    return _Plan(method=method, k=int(k), target=tv, drafter=dv, allowed=jnp.asarray(allowed),
                 pairs=(jnp.asarray(d_ids), jnp.asarray(t_ids)), to_target=to_target,
                 stops=frozenset(map(int, stops)), max_new=int(max_new_tokens),
                 drafter_capacity=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Tally:
    """Acceptance counts over the row-rounds so far."""

    rounds: int = 0
    row_rounds: int = 0
    accepted: int = 0  # drafts kept, summed
    drafted: np.ndarray  # i64[k]: row-rounds that drafted position i
    kept: np.ndarray  # i64[k]: ... and kept it

    def add(self, active, m, n_acc) -> "_Tally":
        pos = np.arange(len(self.drafted))[None]
        return dataclasses.replace(
            self, rounds=self.rounds + 1, row_rounds=self.row_rounds + int(active.sum()),
            accepted=self.accepted + int(n_acc[active].sum()),
            drafted=self.drafted + ((pos < m[:, None]) & active[:, None]).sum(0),
            kept=self.kept + ((pos < n_acc[:, None]) & active[:, None]).sum(0))

    def stats(self, seconds: dict) -> dict:
        per = max(self.row_rounds, 1)
        return {"rounds": self.rounds, "row_rounds": self.row_rounds,
                "mean_accepted": (self.accepted + self.row_rounds) / per,
                "drafts_kept": self.accepted / per,
                "accept_by_position": (self.kept / per).tolist(),
                "kept_when_drafted": (self.kept / np.maximum(self.drafted, 1)).tolist(),
                "mean_drafted": float(self.drafted.sum()) / per,
                **{f"seconds_{k}": v for k, v in seconds.items()},
                "seconds": sum(seconds.values())}


def generate(target_model, drafter_model, prompt_ids_rows: Sequence[Sequence[int]], *,
             method: str = "tli", k: int = 4, max_new_tokens: int = 64,
             sampler: Sampler = Greedy(), seed: int = 0, stop_ids: Sequence[int] | None = None,
             capacity: int | None = None, min_overlap: float = 0.5):
    """Generate from `target_model` with `drafter_model` drafting in its own vocabulary
    -> (generated target ids per row, a final stop id included; stats).

    `prompt_ids_rows` are target ids (rows may differ in length). `method`: "tli" or
    "slem" (module docstring). `capacity` sizes the target's cache (default: just enough);
    `min_overlap` is the share of the drafter's tokens TLI needs in V_both. Stats: rounds,
    mean_accepted (tokens per row-round, as `core.stats`), drafts_kept (per row-round),
    accept_by_position (the share of row-rounds that kept draft i), kept_when_drafted
    (kept / drafted at position i), and seconds (prefill, draft, verify, host)."""
    prompts = [list(map(int, r)) for r in prompt_ids_rows]
    cap = _check(target_model, drafter_model, prompts, method=method, k=k,
                 max_new_tokens=max_new_tokens, capacity=capacity)
    plan = _plan(target_model, drafter_model, method=method, k=k,
                 max_new_tokens=max_new_tokens, stop_ids=stop_ids, min_overlap=min_overlap)
    tm, dm, rng = target_model, drafter_model, jax.random.key(seed)
    seconds = dict.fromkeys(("prefill", "draft", "verify", "host"), 0.0)
    clock = time.perf_counter()
    tokens, lens = pad_rows(prompts, 32)
    tcache = dense.init_cache(tm.cfg, len(prompts), cap, tm.dtype)
    first, tcache = _prefill(tm.params, tcache, tokens, lens, jax.random.fold_in(rng, 0),
                             cfg=tm.cfg, sampler=sampler)
    rows = [_start_row(plan, p, f) for p, f in zip(prompts, np.asarray(first).tolist())]
    room = max(map(len, (r.want for r in rows))) + 2 * (plan.max_new + plan.k) + 64
    plan = dataclasses.replace(plan, drafter_capacity=-(-room // 64) * 64)
    dcache = dense.init_cache(dm.cfg, len(prompts), plan.drafter_capacity, dm.dtype)
    tally = _Tally(drafted=np.zeros(plan.k, np.int64), kept=np.zeros(plan.k, np.int64))
    seconds["prefill"], clock = time.perf_counter() - clock, time.perf_counter()
    while not all(r.done for r in rows):
        d_key, v_key = jax.random.split(jax.random.fold_in(rng, tally.rounds + 1))
        drafts, q, rows, dcache = _draft_rows(plan, dm, rows, dcache, d_key, sampler)
        seconds["draft"] += time.perf_counter() - clock
        clock = time.perf_counter()
        chunk, m = _target_chunk(plan, rows, drafts)
        active = np.array([not r.done for r in rows])
        seconds["host"] += time.perf_counter() - clock
        clock = time.perf_counter()
        n_acc, nxt, tcache = _verify(tm.params, tcache, chunk, m, active, v_key, q, plan.pairs,
                                     cfg=tm.cfg, sampler=sampler, method=plan.method)
        n_acc, nxt = np.asarray(n_acc), np.asarray(nxt)
        seconds["verify"] += time.perf_counter() - clock
        clock = time.perf_counter()
        tally = tally.add(active, m, n_acc)
        rows = [r if r.done else _commit(plan, r, [*chunk[b, 1:1 + n_acc[b]], nxt[b]])
                for b, r in enumerate(rows)]
        seconds["host"] += time.perf_counter() - clock
        clock = time.perf_counter()
    ids = [list(r.target[len(p):]) for r, p in zip(rows, prompts)]
    return ids, tally.stats(seconds)
