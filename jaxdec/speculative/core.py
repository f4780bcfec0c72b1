"""Speculative decoding: draft k tokens, verify them in one target forward, accept, repeat.

    progress, cache = generate(tparams, dparams, cache, prompts, prompt_lens, rng, limits,
                               sampler=..., cfg=..., drafter=..., max_new_tokens=..., stop_ids=...)

One round, inside one `lax.while_loop`:
1. the drafter proposes k tokens d_1..d_k after the row's last token x (`Drafter.draft`),
   with their proposal distributions q_i when sampling;
2. the target runs once over [x, d_1..d_k] at the row's next positions, writing their keys
   and values into its cache, and gives p_0..p_k;
3. acceptance: greedy keeps d_i while d_i == argmax p_{i-1}; sampling keeps d_i with
   probability min(1, p(d_i)/q(d_i)) and, at the first rejection, draws the replacement
   from norm(max(0, p - q)); when all k are kept, a bonus token is drawn from p_k. Either
   way a row emits its a accepted drafts and one target token, so the output is the
   target's own (greedy: identical tokens; sampling: the target distribution);
4. roll back: the cache's `lengths` are set to cover x and the accepted drafts; the
   rejected drafts' slots are stale and the next round overwrites them (no copy). The
   drafter is told what was accepted (`Drafter.accept`) and rolls its own state back.

Rows accept different numbers of tokens: every row has its own length and emission count.
A tree draft (EAGLE-2's dynamic tree, `jaxdec.speculative.tree`) verifies every branch at once
under a tree attention mask and keeps the longest accepted path.

The Drafter protocol (a frozen dataclass, static under jit; its params travel separately):
    k: int                          draft tokens per round (the tree depth for tree drafts)
    taps: tuple[int, ...]           target layers whose input features it reads (EAGLE)
    tree: TreeSpec | None           a tree draft instead of a chain
    init(params, batch, capacity, dtype) -> state
    prefill(params, state, prompts, prompt_lens, feats) -> state
        after the target's prefill; feats: the prompt's tapped features ([B, T, D] each)
    draft(params, state, last, active, key, sampler) -> (tokens i32[B, k], q f32[B, k, V] | None, state)
        rows not active must leave their state as it is; q: the proposal probabilities over the target's vocabulary (None when greedy)
    accept(params, state, chunk i32[B, k+1], feats, n_acc i32[B], active bool[B]) -> state
        chunk = [x, d_1..d_k] as verified, feats its tapped features, n_acc the drafts kept
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from jaxdec import decode
from jaxdec.cache import dense
from jaxdec.config import ModelConfig
from jaxdec.errors import JaxdecError
from jaxdec.models import transformer
from jaxdec.sampling import Greedy, Sampler

DEFAULT_K = 4  # drafts per round when a drafter is made without k


@partial(jax.tree_util.register_dataclass,
         data_fields=["last", "active", "n_generated", "stopped", "tokens", "rounds",
                      "accepted", "drafter"],
         meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SpecProgress:
    """Where a batch of speculative generations stands (the target cache travels apart)."""

    last: jax.Array  # i32[B]: each row's latest token, not yet in the target cache
    active: jax.Array  # bool[B]
    n_generated: jax.Array  # i32[B]: tokens emitted per row (a final stop token included)
    stopped: jax.Array  # bool[B]: the row ended on a stop token
    tokens: jax.Array  # i32[B, max_new + k + 1]: emitted ids, -1 past n_generated
    rounds: jax.Array  # i32[B]: verification rounds each row took part in
    accepted: jax.Array  # i32[k + 1]: rounds (over rows) that accepted exactly i drafts
    drafter: Any  # the drafter's state


def check(cfg: ModelConfig, cache: dense.KVCache, drafter, prompt_width: int,
          max_new_tokens: int) -> None:
    """Refuse what speculation cannot do: roll back a Mamba state, or draft past the cache
    (shapes are static, so `generate` checks this when it is traced)."""
    if any(mixer == "mamba" for mixer, _ in cfg.kinds):
        raise JaxdecError("speculative decoding needs a cache it can roll back, and this "
                          "model has Mamba layers")
    width = draft_width(drafter)
    short = [i for i, e in enumerate(cache.layers) if e is not None and not e.holds_chunk(width)]
    if short:  # (a sliding-window ring holds margin + 1 tokens it may roll back)
        raise JaxdecError(f"a draft of {width} tokens is more than layer {short[0]}'s cache entry "
                          "can write and roll back")
    if width > cache.capacity:
        raise JaxdecError(f"a draft of {width - 1} tokens (+1 verified) does not fit the "
                          f"cache's capacity of {cache.capacity} tokens")
    if need_capacity(prompt_width, max_new_tokens, drafter) > cache.capacity:
        raise JaxdecError(f"prompts of {prompt_width} tokens + {max_new_tokens} new + a draft "
                          f"of {width} do not fit the cache's capacity of {cache.capacity} tokens")


# ---------------------------------------------------------------------------- acceptance


def leading(ok: jax.Array) -> jax.Array:
    """i32[B]: how many leading entries of bool[B, k] are True."""
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)


def accept_greedy(logits: jax.Array, draft: jax.Array):
    """Keep drafts while each is the target's argmax -> (n_acc i32[B], next i32[B])."""
    best = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, k+1]
    n_acc = leading(draft == best[:, :-1])
    return n_acc, jnp.take_along_axis(best, n_acc[:, None], axis=1)[:, 0]


def target_probs(logits: jax.Array, sampler: Sampler) -> jax.Array:
    """f32[B, T, V]: the distribution plain decoding samples from, at every position."""
    b, t, v = logits.shape
    return jax.nn.softmax(sampler.filter(logits.reshape(b * t, v)), axis=-1).reshape(b, t, v)


def accept_sample(logits: jax.Array, draft: jax.Array, q: jax.Array, key, sampler: Sampler):
    """Speculative sampling (Leviathan et al.; Chen et al.) -> (n_acc i32[B], next i32[B]).

    logits f32[B, k+1, V] (target), draft i32[B, k], q f32[B, k, V] (proposal)."""
    p = target_probs(logits, sampler)
    pick = lambda x: jnp.take_along_axis(x[:, : draft.shape[1]], draft[..., None], axis=2)[..., 0]
    u_key, r_key = jax.random.split(key)
    u = jax.random.uniform(u_key, draft.shape)
    n_acc = leading(u * pick(q) < pick(p))
    q_next = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # q_{k} = 0: the bonus draws p_k
    at = lambda x: jnp.take_along_axis(x, n_acc[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(at(p) - at(q_next), 0.0)
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, at(p))
    nxt = jax.random.categorical(r_key, jnp.log(residual), axis=-1).astype(jnp.int32)
    return n_acc, nxt


# ---------------------------------------------------------------------------- one round


def _emit(p: SpecProgress, chunk, n_acc, nxt, limits, stops) -> SpecProgress:
    """Append each active row's accepted drafts and its target token, up to a stop token
    or the row's limit, and retire rows that finished."""
    k = chunk.shape[1] - 1
    out = jnp.concatenate([chunk[:, 1:], nxt[:, None]], axis=1)  # [B, k+1]
    j = jnp.arange(k + 1)[None]
    out = jnp.where(j < n_acc[:, None], out, jnp.where(j == n_acc[:, None], nxt[:, None], -1))
    valid = j <= n_acc[:, None]
    hit = valid & jnp.isin(out, stops)
    first_stop = jnp.where(hit.any(1), jnp.argmax(hit, axis=1), k + 1)
    room = limits - p.n_generated
    n_emit = jnp.where(p.active, jnp.minimum(jnp.minimum(n_acc + 1, first_stop + 1), room), 0)
    cols = p.n_generated[:, None] + j
    cols = jnp.where(j < n_emit[:, None], cols, p.tokens.shape[1])  # out of range: dropped
    tokens = jax.vmap(lambda row, c, o: row.at[c].set(o, mode="drop"))(p.tokens, cols, out)
    n_gen = p.n_generated + n_emit
    stopped = p.stopped | (p.active & (first_stop < n_emit))
    hist = jnp.zeros(k + 1, jnp.int32).at[n_acc].add(p.active.astype(jnp.int32))
    return dataclasses.replace(
        p, last=jnp.where(p.active, nxt, p.last), tokens=tokens, n_generated=n_gen,
        stopped=stopped, active=p.active & ~stopped & (n_gen < limits),
        rounds=p.rounds + p.active, accepted=p.accepted + hist)


def _round(tparams, dparams, cache, p: SpecProgress, key, limits, stops, *, sampler, cfg,
           drafter):
    """Draft, verify, accept and roll back once -> (progress, cache)."""
    d_key, v_key = jax.random.split(key)
    greedy = isinstance(sampler, Greedy)
    if drafter.tree is not None and greedy:
        from jaxdec.speculative import tree
        return tree.round(tparams, dparams, cache, p, d_key, limits, stops, cfg=cfg,
                          drafter=drafter, emit=_emit)
    draft, q, dstate = drafter.draft(dparams, p.drafter, p.last, p.active, d_key, sampler)
    chunk = jnp.concatenate([p.last[:, None], draft], axis=1)  # [B, k+1]
    base = cache.lengths
    positions = jnp.where(p.active[:, None], base[:, None] + jnp.arange(chunk.shape[1]), -1)
    h, cache, feats = transformer.hidden_and_taps(tparams, chunk, positions, cache, cfg,
                                                  taps=drafter.taps)
    logits = transformer.logits_from_hidden(tparams, h)
    if greedy:
        n_acc, nxt = accept_greedy(logits, draft)
    else:
        n_acc, nxt = accept_sample(logits, draft, q, v_key, sampler)
    cache = dataclasses.replace(cache, lengths=jnp.where(p.active, base + n_acc + 1, base))
    dstate = drafter.accept(dparams, dstate, chunk, feats, n_acc, p.active)
    p = dataclasses.replace(p, drafter=dstate)
    return _emit(p, chunk, n_acc, nxt, limits, stops), cache


# ---------------------------------------------------------------------------- generation


def _start(tparams, dparams, cache, prompts, prompt_lens, rng, limits, *, sampler, cfg,
           drafter, max_new_tokens, stop_ids):
    check(cfg, cache, drafter, prompts.shape[1], max_new_tokens)
    b = prompts.shape[0]
    positions = decode.prompt_positions(cache.lengths, prompt_lens, prompts.shape[1])
    h, cache, feats = transformer.hidden_and_taps(tparams, prompts, positions, cache, cfg,
                                                  taps=drafter.taps)
    last_h = jnp.take_along_axis(h, jnp.maximum(prompt_lens - 1, 0)[:, None, None], axis=1)[:, 0]
    first = sampler(transformer.logits_from_hidden(tparams, last_h), jax.random.fold_in(rng, 0))
    dstate = drafter.init(dparams, b, cache.capacity, h.dtype)
    dstate = drafter.prefill(dparams, dstate, prompts, prompt_lens, feats)
    k = drafter.k
    p = SpecProgress(last=jnp.zeros(b, jnp.int32), active=limits > 0,
                     n_generated=jnp.zeros(b, jnp.int32), stopped=jnp.zeros(b, bool),
                     tokens=jnp.full((b, max_new_tokens + k + 1), -1, jnp.int32),
                     rounds=jnp.zeros(b, jnp.int32), accepted=jnp.zeros(k + 1, jnp.int32),
                     drafter=dstate)
    # the first token is the prefill's: emit it as a round that accepted no drafts
    fake = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.full((b, k), -1, jnp.int32)], 1)
    p = _emit(p, fake, jnp.zeros(b, jnp.int32), first, limits, decode.stop_array(stop_ids))
    return dataclasses.replace(p, rounds=jnp.zeros(b, jnp.int32),
                               accepted=jnp.zeros(k + 1, jnp.int32)), cache


def _advance(tparams, dparams, cache, p: SpecProgress, rng, limits, max_rounds, *, sampler,
             cfg, drafter, stop_ids):
    stops = decode.stop_array(stop_ids)
    start = jnp.max(p.rounds)

    def cond(carry):
        p, _ = carry
        return jnp.any(p.active) & (jnp.max(p.rounds) < start + max_rounds)

    def body(carry):
        p, cache = carry
        key = jax.random.fold_in(rng, jnp.max(p.rounds) + 1)
        return _round(tparams, dparams, cache, p, key, limits, stops, sampler=sampler,
                      cfg=cfg, drafter=drafter)

    return jax.lax.while_loop(cond, body, (p, cache))


_STATIC = ("sampler", "cfg", "drafter", "max_new_tokens", "stop_ids")


@partial(jax.jit, static_argnames=_STATIC, donate_argnames=("cache",),
         compiler_options=decode.COMPILER_OPTIONS)
def generate(tparams, dparams, cache: dense.KVCache, prompts, prompt_lens, rng, limits, *,
             sampler: Sampler, cfg: ModelConfig, drafter, max_new_tokens: int,
             stop_ids: tuple[int, ...] = ()):
    """Prefill, then speculate until every row stops, in one jit -> (SpecProgress, cache).

    The cache needs room for each row's prompt, its `max_new_tokens` and one draft beyond
    (`need_capacity`)."""
    p, cache = _start(tparams, dparams, cache, prompts, prompt_lens, rng, limits,
                      sampler=sampler, cfg=cfg, drafter=drafter, max_new_tokens=max_new_tokens,
                      stop_ids=stop_ids)
    return _advance(tparams, dparams, cache, p, rng, limits, max_new_tokens, sampler=sampler,
                    cfg=cfg, drafter=drafter, stop_ids=stop_ids)


@partial(jax.jit, static_argnames=_STATIC, donate_argnames=("cache",),
         compiler_options=decode.COMPILER_OPTIONS)
def start(tparams, dparams, cache, prompts, prompt_lens, rng, limits, *, sampler, cfg, drafter,
          max_new_tokens, stop_ids=()):
    """Prefill and the first token -> (SpecProgress, cache); `advance` continues (streaming)."""
    return _start(tparams, dparams, cache, prompts, prompt_lens, rng, limits, sampler=sampler,
                  cfg=cfg, drafter=drafter, max_new_tokens=max_new_tokens, stop_ids=stop_ids)


@partial(jax.jit, static_argnames=("sampler", "cfg", "drafter", "stop_ids"),
         donate_argnames=("cache",), compiler_options=decode.COMPILER_OPTIONS)
def advance(tparams, dparams, cache, progress, rng, limits, max_rounds, *, sampler, cfg, drafter,
            stop_ids=()):
    """Up to `max_rounds` more rounds (traced: one compile serves every chunk)."""
    return _advance(tparams, dparams, cache, progress, rng, limits, max_rounds, sampler=sampler,
                    cfg=cfg, drafter=drafter, stop_ids=stop_ids)


def stats(progress: SpecProgress) -> dict:
    """Rounds, mean accepted length (tokens per target forward, the prefill's token aside)
    and acceptance by draft position (the share of rounds that kept draft i)."""
    rounds = int(jnp.sum(progress.rounds))
    emitted = int(jnp.sum(progress.n_generated)) - int(jnp.sum(progress.n_generated > 0))
    hist = [int(x) for x in progress.accepted]
    kept = [sum(hist[i:]) / max(rounds, 1) for i in range(1, len(hist))]
    return {"rounds": rounds, "tokens": emitted, "mean_accepted": emitted / max(rounds, 1),
            "accept_by_position": kept, "accepted_hist": hist}


def draft_width(drafter) -> int:
    """Tokens one verification writes past a row's length: the chain, or the tree's nodes."""
    return drafter.tree.budget + 1 if drafter.tree is not None else drafter.k + 1


def need_capacity(prompt_len: int, max_new_tokens: int, drafter) -> int:
    return prompt_len + max_new_tokens + draft_width(drafter)
