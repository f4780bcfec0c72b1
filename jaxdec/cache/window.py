"""The sliding-window kind: a ring buffer of a windowed layer's last keys and values.

A layer whose queries see only the last `window` positions needs no more than those, plus
room for the chunk being written: logical slot s is stored at `s % ring`, with
`ring = window + margin`. A chunk of up to `margin + 1` tokens (a decode step, a draft, a
tree) is written before it attends: its earliest query still finds the `window - 1` keys
before it, and a rejected draft never overwrote a key a later query needs. A longer chunk
(a prompt) attends to the ring as it was and to its own keys, then keeps its last `ring`
tokens. Positions are per slot (`entry.Slotted`), so the window mask, not the slot order,
decides what a query sees.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxdec.cache import entry, registry
from jaxdec.errors import JaxdecError

MARGIN = 64  # tokens past the window a ring holds: the longest chunk written before attending


@partial(jax.tree_util.register_dataclass, data_fields=["k", "v", "pos"], meta_fields=["window"])
@dataclasses.dataclass(frozen=True)
class RingKVLayer(entry.KVLayer):
    """Keys and values of a windowed layer, in a ring of `capacity` slots plus scratch."""

    window: int = 0
    max_tokens = None  # a row holds any number of tokens: the ring forgets the oldest

    @property
    def margin(self) -> int:
        """The longest chunk that may be rolled back (a draft, a tree) is margin + 1."""
        return self.capacity - self.window

    def holds_chunk(self, t: int) -> bool:
        """Written first, a chunk of more than margin + 1 tokens would overwrite keys its
        earliest queries see: such a chunk attends to the ring as it was and its own keys."""
        return t <= self.margin + 1

    @staticmethod
    def wraps(window: int, max_len: int, margin: int = MARGIN) -> bool:
        """Whether a ring is smaller than a cache of `max_len` tokens: if not, the ring would
        never wrap and a dense entry is the same cache."""
        if not isinstance(margin, (int, np.integer)) or margin < 0:
            raise JaxdecError(f"the window kind's margin must be a whole number of tokens >= 0 "
                              f"(got {margin!r})")
        return window + margin < max_len

    @classmethod
    def empty(cls, batch: int, k_heads: int, head_dim: int, window: int, max_len: int, dtype,
              margin: int = MARGIN):
        ring = window + margin
        if not cls.wraps(window, max_len, margin):
            raise JaxdecError(f"a sliding window of {window} tokens (+{margin} for chunks) does not "
                              f"fit a cache of {max_len} tokens: use the dense kind")
        fields = cls.shapes(batch, k_heads, head_dim, ring + 1, dtype)
        fill = lambda shape, dt: jax.device_put(np.full(shape, -1 if dt == np.int32 else 0, dt),
                                                may_alias=False)
        return cls(window=window, **{f: fill(*sd) for f, sd in fields.items()})

    def where(self, slots, positions):
        """Slot s at s % ring; of a chunk longer than the ring, only its last `ring` slots
        are kept (the others go to scratch, so no two tokens share a slot)."""
        ring = self.capacity
        last = jnp.max(jnp.where(positions >= 0, slots, -1), axis=1, keepdims=True)
        ok = (positions >= 0) & (slots >= 0) & (slots > last - ring)
        return jnp.where(ok, slots % ring, ring)


def _fits(cfg) -> None:
    if not any(cfg.window(i) for i in range(cfg.n_layers)):
        raise JaxdecError("the window KV cache needs a model with sliding-window layers")


@registry.register("window", summary="a sliding-window layer's last keys in a ring (others dense)",
                   options=("margin",), fits=_fits)
def _make(cfg, layer, batch, max_len, dtype, margin: int = MARGIN):
    w = cfg.window(layer)
    if not w or not RingKVLayer.wraps(w, max_len, margin):
        return None  # a global layer, or a ring no smaller than the cache: the dense entry
    return RingKVLayer.empty(batch, cfg.kv_heads(layer), cfg.head_dim, w, max_len, dtype, margin=margin)
