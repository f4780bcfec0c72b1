"""Prefill, one decode step, and whole-generation loops inside one jit.

    logits, cache = prefill(params, cache, tokens, prompt_lens, cfg)
    tokens, cache = decode_step(params, cache, last_tokens, rng, sampler, cfg)
    progress, cache = generate_tokens(params, cache, prompts, prompt_lens, rng, limits, ...)

`decode_step` is jitted with the cache donated, so XLA updates it in place. The generation
loop is one `lax.while_loop`: each row stops at a stop token (EOS, end of turn) or at its
token limit; finished rows stop writing to the cache. Streaming runs the same loop body in
chunks (`start`, then `advance` until done) so every executable stays free of host
callbacks, and therefore cacheable by JAX's persistent compilation cache.
"""

from __future__ import annotations

import dataclasses
from functools import partial
import jax
import jax.numpy as jnp

from jaxdec import sharding
from jaxdec.cache import dense
from jaxdec.config import ModelConfig
from jaxdec.models import transformer
from jaxdec.sampling import Sampler


# XLA:CPU's default copy insertion copies every donated cache buffer that is both read
# (attention over the cache as it was) and updated in place (the new token's slot) in one
# step: two full copies of each layer's K and V per decode step. Its region analysis proves
# the read happens first and drops them all (checked on the compiled HLO by
# tests/test_decode_hlo.py). Steps and draft chains on the CPU attention kernel write first
# and attend after, which needs no copy either way; a speculative tree's verification (the
# kernel over the cache as it was, then the write) still needs the option.
COMPILER_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}


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


@partial(jax.jit, static_argnames=("sampler", "cfg"), donate_argnames=("cache",),
         compiler_options=COMPILER_OPTIONS)
def decode_step(params, cache: dense.KVCache, last_tokens, rng, sampler: Sampler,
                cfg: ModelConfig):
    """i32[B] last tokens -> (i32[B] next tokens, cache). The cache is donated."""
    active = jnp.ones(last_tokens.shape, bool)
    return _step(params, cache, last_tokens, active, rng, sampler, cfg)


def sharded_decode_step(mesh, params_shardings, cache_shardings, sampler: Sampler,
                        cfg: ModelConfig):
    """`decode_step` jitted for `mesh` with explicit input and output shardings (params and
    cache as laid out by `jaxdec.sharding`, the tokens' rows over `data`, the key
    replicated), the cache donated, and traced under the mesh (`jax.set_mesh`) so the
    model's code sees how it is split. Returns step(params, cache, last_tokens, rng)."""
    from jax.sharding import NamedSharding, PartitionSpec

    rows = NamedSharding(mesh, PartitionSpec("data" if "data" in mesh.shape else None))
    step = jax.jit(partial(decode_step.__wrapped__, sampler=sampler, cfg=cfg),
                   in_shardings=(params_shardings, cache_shardings, rows, NamedSharding(mesh, PartitionSpec())),
                   out_shardings=(rows, cache_shardings), donate_argnums=1,
                   compiler_options=COMPILER_OPTIONS)

    def run(params, cache, last_tokens, rng):
        with jax.set_mesh(mesh):
            return step(params, cache, last_tokens, rng)

    return run


def data_parallel_decode_step(mesh, sampler: Sampler, cfg: ModelConfig):
    """The pmap layout without `jax.pmap` (legacy in current JAX): `decode_step` itself,
    unchanged, mapped by `shard_map` over the mesh's `data` axis. Each device holds the
    whole model (params replicated) and its rows of the cache and the batch, and runs the
    single-device program (the CPU kernels included: inside shard_map the axes are manual),
    with no collectives. Returns step(params, cache, last_tokens, rng); the key is shared,
    so each device's rows sample as the same rows would in one program only under greedy
    decoding (a sampler's draws depend on the row count)."""
    from jax.sharding import PartitionSpec as P

    from jaxdec.pytree import LogicalRules

    rows = P("data")
    cache_spec = dense.cache_specs(cfg, LogicalRules((("batch", "data"),)))
    local = partial(decode_step.__wrapped__, sampler=sampler, cfg=cfg)  # the body, unjitted
    mapped = jax.shard_map(local, mesh=mesh, in_specs=(P(), cache_spec, rows, P()),
                           out_specs=(rows, cache_spec), check_vma=False)
    return jax.jit(mapped, donate_argnums=1, compiler_options=COMPILER_OPTIONS)


@partial(jax.tree_util.register_dataclass,
         data_fields=["step", "last", "active", "n_generated", "stopped", "tokens"],
         meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Progress:
    """Where a batch of generations stands (small arrays; the cache travels separately so
    that it alone is donated and these stay readable while the next chunk runs)."""

    step: jax.Array  # i32[]: ids produced so far per row slot (next column of `tokens`)
    last: jax.Array  # i32[B]: the latest sampled ids, fed to the next step
    active: jax.Array  # bool[B]: rows still generating
    n_generated: jax.Array  # i32[B]: ids produced per row, including a final stop token
    stopped: jax.Array  # bool[B]: the row ended on a stop token (not on its limit)
    tokens: jax.Array  # i32[B, max_new]: generated ids; -1 where a row produced none


def _emit(p: Progress, tok, limits, stops) -> Progress:
    """Record the ids sampled at step p.step for the active rows and retire finished rows."""
    tokens = p.tokens.at[:, p.step].set(jnp.where(p.active, tok, -1))
    n_gen = p.n_generated + p.active
    hit = p.active & jnp.isin(tok, stops)
    return sharding.replicated(Progress(step=p.step + 1, last=tok, active=p.active & ~hit & (n_gen < limits),
                    n_generated=n_gen, stopped=p.stopped | hit, tokens=tokens))


def stop_array(stop_ids: tuple[int, ...], stops=None) -> jax.Array:
    """The stop ids as an array: `stops` (traced: i32[S], -1 as padding) when given, so a
    new stop set compiles nothing, else the static `stop_ids`."""
    return jnp.asarray(stop_ids or (-1,), jnp.int32) if stops is None else stops


def _start(params, cache, prompts, prompt_lens, rng, limits, sampler, cfg, max_new_tokens,
           stop_ids, stops=None):
    b = prompts.shape[0]
    logits, cache = prefill(params, cache, prompts, prompt_lens, cfg)
    empty = Progress(step=jnp.int32(0), last=jnp.zeros(b, jnp.int32), active=limits > 0,
                     n_generated=jnp.zeros(b, jnp.int32), stopped=jnp.zeros(b, bool),
                     tokens=jnp.full((b, max_new_tokens), -1, jnp.int32))
    first = sampler(logits, jax.random.fold_in(rng, 0))
    return _emit(empty, first, limits, stop_array(stop_ids, stops)), cache


def _advance(params, cache, p: Progress, rng, limits, stop_at, sampler, cfg, stop_ids, stops=None):
    """Decode until step `stop_at` (or the buffer end), or until every row has stopped."""
    stops, end = stop_array(stop_ids, stops), jnp.minimum(stop_at, p.tokens.shape[1])

    def cond(carry):
        p, _ = carry
        return (p.step < end) & jnp.any(p.active)

    def body(carry):
        p, cache = carry
        key = jax.random.fold_in(rng, p.step)
        tok, cache = _step(params, cache, p.last, p.active, key, sampler, cfg)
        return _emit(p, tok, limits, stops), cache

    return jax.lax.while_loop(cond, body, (p, cache))


_STATIC = ("sampler", "cfg", "max_new_tokens", "stop_ids")


@partial(jax.jit, static_argnames=_STATIC, donate_argnames=("cache",),
         compiler_options=COMPILER_OPTIONS)
def start(params, cache, prompts, prompt_lens, rng, limits, stops=None, *, sampler: Sampler,
          cfg: ModelConfig, max_new_tokens: int, stop_ids: tuple[int, ...] = ()):
    """Prefill right-padded prompts and sample each row's first id -> (Progress, cache).
    `stops` (i32[S], -1 padding), if given, are the stop ids instead of `stop_ids`."""
    return _start(params, cache, prompts, prompt_lens, rng, limits, sampler, cfg,
                  max_new_tokens, stop_ids, stops)


@partial(jax.jit, static_argnames=("sampler", "cfg", "stop_ids"), donate_argnames=("cache",),
         compiler_options=COMPILER_OPTIONS)
def advance(params, cache, progress: Progress, rng, limits, stop_at, stops=None, *,
            sampler: Sampler, cfg: ModelConfig, stop_ids: tuple[int, ...] = ()):
    """Continue a generation up to step `stop_at` (a traced scalar: one compile serves every
    chunk). Streaming calls this chunk after chunk, reading each chunk's ids while the next
    one runs."""
    return _advance(params, cache, progress, rng, limits, stop_at, sampler, cfg, stop_ids, stops)


@partial(jax.jit, static_argnames=_STATIC, donate_argnames=("cache",),
         compiler_options=COMPILER_OPTIONS)
def generate_tokens(params, cache: dense.KVCache, prompts, prompt_lens, rng, limits,
                    stops=None, *, sampler: Sampler, cfg: ModelConfig, max_new_tokens: int,
                    stop_ids: tuple[int, ...] = ()):
    """Prefill, then decode until every row stops, in one jit -> (Progress, cache).

    limits: i32[B] per-row token limits (each <= max_new_tokens). The id sampled at step i
    uses the key fold_in(rng, i), so a seed reproduces a generation exactly, whether it
    runs here in one call or chunk by chunk through `start` and `advance`.
    """
    p, cache = _start(params, cache, prompts, prompt_lens, rng, limits, sampler, cfg,
                      max_new_tokens, stop_ids, stops)
    return _advance(params, cache, p, rng, limits, max_new_tokens, sampler, cfg, stop_ids, stops)
