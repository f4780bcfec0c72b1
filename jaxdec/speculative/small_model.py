"""A drafter that is an independent small model sharing the target's vocabulary.

It keeps its own decode cache. `draft` feeds what the drafter has not seen yet (the
target's last token, and d_k when the previous round kept every draft) as one ragged
chunk, then decodes k - 1 more tokens autoregressively. `accept` rolls its cache back to
the verified context: the drafts it fed and the target kept stay cached.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from jaxdec.cache import dense
from jaxdec.config import ModelConfig
from jaxdec.models import transformer
from jaxdec.sampling import Greedy, Sampler


@partial(jax.tree_util.register_dataclass, data_fields=["cache", "pending", "n_pending"],
         meta_fields=[])
@dataclasses.dataclass(frozen=True)
class State:
    cache: dense.KVCache  # the drafter's own; lengths = the context it has seen
    pending: jax.Array  # i32[B]: a kept draft not yet fed (d_k of a fully accepted round)
    n_pending: jax.Array  # i32[B]: 0 or 1


def propose(logits: jax.Array, key, sampler: Sampler):
    """(token i32[B], probabilities f32[B, V] or None) drawn from drafter logits [B, V] the
    way the target will be sampled (its filters applied), or their argmax when greedy."""
    if isinstance(sampler, Greedy):
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
    filtered = sampler.filter(logits)
    return (jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32),
            jax.nn.softmax(filtered, axis=-1))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SmallModel:
    """Draft with a small model of the same vocabulary: `params` are its weights."""

    cfg: ModelConfig
    k: int = 4
    taps: tuple[int, ...] = ()
    tree: Any = None  # a chain drafter
    params: Any = dataclasses.field(default=None, compare=False, repr=False)

    def init(self, params, batch, capacity, dtype):
        del params
        cache = dense.init_cache(self.cfg, batch, capacity, dtype)
        z = jnp.zeros(batch, jnp.int32)
        return State(cache=cache, pending=z, n_pending=z)

    def prefill(self, params, state: State, prompts, prompt_lens, feats):
        del feats
        from jaxdec import decode
        _, cache = decode.prefill(params, state.cache, prompts, prompt_lens, self.cfg)
        return dataclasses.replace(state, cache=cache)

    def _forward(self, params, cache, tokens, valid):
        """Feed i32[B, T] where valid; -> (logits at each row's last valid token, cache)."""
        t = tokens.shape[1]
        end = t - 1 - jnp.argmax(valid[:, ::-1], axis=1)  # each row's last valid token
        positions = jnp.where(valid, cache.lengths[:, None] + jnp.cumsum(valid, 1) - 1, -1)
        h, cache = transformer.hidden(params, tokens, positions, cache, self.cfg)
        last = jnp.take_along_axis(h, end[:, None, None], axis=1)[:, 0]
        return transformer.logits_from_hidden(params, last), cache

    def draft(self, params, state: State, last, active, key, sampler):
        tokens = jnp.stack([state.pending, last], axis=1)
        valid = jnp.stack([state.n_pending > 0, active], axis=1)
        logits, cache = self._forward(params, state.cache, tokens, valid)
        keys = jax.random.split(key, self.k)
        tok, q = propose(logits, keys[0], sampler)
        toks, qs = [tok], [q]
        for i in range(1, self.k):  # unrolled: k is small, and XLA:CPU runs it faster
            logits, cache = self._forward(params, cache, tok[:, None], active[:, None])
            tok, q = propose(logits, keys[i], sampler)
            toks.append(tok)
            qs.append(q)
        probs = None if qs[0] is None else jnp.stack(qs, axis=1)
        return jnp.stack(toks, axis=1), probs, State(cache=cache, pending=state.pending,
                                                      n_pending=state.n_pending)

    def accept(self, params, state: State, chunk, feats, n_acc, active):
        """Keep x and the drafts both fed and accepted; d_k, accepted but never fed, waits."""
        del params, feats
        k = self.k
        fed_before = state.cache.lengths - (k - 1)  # the context through x
        lengths = jnp.where(active, fed_before + jnp.minimum(n_acc, k - 1), state.cache.lengths)
        pending = jnp.where(n_acc == k, chunk[:, k], 0)
        cache = dataclasses.replace(state.cache, lengths=lengths.astype(jnp.int32))
        return State(cache=cache, pending=pending,
                     n_pending=(active & (n_acc == k)).astype(jnp.int32))


def truncated(cfg: ModelConfig, params, n_layers: int):
    """(cfg, params) of the target's first `n_layers` layers under its own final norm and
    LM head: a layer-pruned drafter that needs no training (a baseline)."""
    if not 0 < n_layers <= cfg.n_layers:
        from jaxdec.errors import JaxdecError
        raise JaxdecError(f"a truncated drafter keeps 1..{cfg.n_layers} layers (got {n_layers})")
    types = cfg.layer_types[:n_layers] if cfg.layer_types else cfg.layer_types
    small = dataclasses.replace(cfg, n_layers=n_layers, layer_types=types,
                                layer_windows=cfg.layer_windows[:n_layers])
    return small, dataclasses.replace(params, layers=params.layers[:n_layers])
