"""Prefill, one decode step, and whole-generation loops inside one jit.

    logits, cache = prefill(params, cache, tokens, prompt_lens, cfg)
    tokens, cache = decode_step(params, cache, last_tokens, rng, sampler, cfg)
    out = generate_tokens(params, cache, prompts, prompt_lens, rng, sampler, cfg, ...)

`decode_step` is jitted with the cache donated, so XLA updates it in place. The generation
loop is one `lax.while_loop`: each row stops at a stop token (EOS, end of turn) or at its
token limit; finished rows stop writing to the cache.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp

from jaxdec.cache import dense
from jaxdec.config import ModelConfig
from jaxdec.models import transformer
from jaxdec.sampling import Sampler


def prompt_positions(lengths: jax.Array, prompt_lens: jax.Array, t: int) -> jax.Array:
    """i32[B, T]: row b's prompt continues at lengths[b]; padding past prompt_lens is -1."""
    steps = jnp.arange(t)[None, :]
    return jnp.where(steps < prompt_lens[:, None], lengths[:, None] + steps, -1)


def prefill(params, cache: dense.KVCache, tokens, prompt_lens, cfg: ModelConfig):
    """Run right-padded prompts [B, T] (row b has prompt_lens[b] real tokens) through the
    model; returns the logits at each row's last prompt token, f32[B, V], and the cache."""
    positions = prompt_positions(cache.lengths, prompt_lens, tokens.shape[1])
    h, cache = transformer.hidden(params, tokens, positions, cache, cfg)
    last = jnp.take_along_axis(h, jnp.maximum(prompt_lens - 1, 0)[:, None, None], axis=1)[:, 0]
    return transformer.logits_from_hidden(params, last), cache


def _step(params, cache, last_tokens, active, key, sampler: Sampler, cfg: ModelConfig):
    """One token per row; inactive rows neither write nor advance their cache."""
    positions = jnp.where(active, cache.lengths, -1)[:, None]
    logits, cache = transformer.forward(params, last_tokens[:, None], positions, cache, cfg)
    return sampler(logits[:, 0], key), cache


@partial(jax.jit, static_argnames=("sampler", "cfg"), donate_argnames=("cache",))
def decode_step(params, cache: dense.KVCache, last_tokens, rng, sampler: Sampler,
                cfg: ModelConfig):
    """i32[B] last tokens -> (i32[B] next tokens, cache). The cache is donated."""
    active = jnp.ones(last_tokens.shape, bool)
    return _step(params, cache, last_tokens, active, rng, sampler, cfg)


@partial(jax.tree_util.register_dataclass,
         data_fields=["tokens", "n_generated", "stopped", "cache"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Generation:
    tokens: jax.Array  # i32[B, max_new]: generated ids; -1 after a row stopped
    n_generated: jax.Array  # i32[B]: ids produced per row, including a final stop token
    stopped: jax.Array  # bool[B]: the row ended on a stop token (not on the limit)
    cache: dense.KVCache


@partial(jax.jit, static_argnames=("sampler", "cfg", "max_new_tokens", "stop_ids", "stream"),
         donate_argnames=("cache",))
def generate_tokens(params, cache: dense.KVCache, prompts, prompt_lens, rng, limits, *,
                    sampler: Sampler, cfg: ModelConfig, max_new_tokens: int,
                    stop_ids: tuple[int, ...] = (), stream: Callable | None = None) -> Generation:
    """Prefill right-padded prompts, then decode until every row stops, in one jit.

    limits: i32[B] per-row token limits (each <= max_new_tokens). The token sampled at
    step i uses the key fold_in(rng, i), so a seed reproduces a generation exactly.
    `stream(step, tokens, active)` is called on the host after each step, if given.
    """
    b = prompts.shape[0]
    logits, cache = prefill(params, cache, prompts, prompt_lens, cfg)
    stops = jnp.asarray(stop_ids or (-1,), jnp.int32)

    def emit(i, tok, active, out, n_gen, stopped):
        out = out.at[:, i].set(jnp.where(active, tok, -1))
        n_gen = n_gen + active
        hit = active & jnp.isin(tok, stops)
        still = active & ~hit & (n_gen < limits)
        if stream is not None:
            jax.debug.callback(stream, i, tok, active, ordered=True)
        return out, n_gen, stopped | hit, still

    first = sampler(logits, jax.random.fold_in(rng, 0))
    out = jnp.full((b, max_new_tokens), -1, jnp.int32)
    out, n_gen, stopped, active = emit(0, first, limits > 0, out, jnp.zeros(b, jnp.int32),
                                       jnp.zeros(b, bool))

    def cond(state):
        i, _, active, *_ = state
        return (i < max_new_tokens) & jnp.any(active)

    def body(state):
        i, tok, active, out, n_gen, stopped, cache = state
        nxt, cache = _step(params, cache, tok, active, jax.random.fold_in(rng, i), sampler, cfg)
        out, n_gen, stopped, active = emit(i, nxt, active, out, n_gen, stopped)
        return i + 1, nxt, active, out, n_gen, stopped, cache

    state = (jnp.int32(1), first, active, out, n_gen, stopped, cache)
    _, _, _, out, n_gen, stopped, cache = jax.lax.while_loop(cond, body, state)
    return Generation(tokens=out, n_generated=n_gen, stopped=stopped, cache=cache)
