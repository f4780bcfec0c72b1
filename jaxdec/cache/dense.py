"""The dense KV cache: fixed capacity, per-row lengths.

Invariants:
- `lengths[b]` is the number of valid tokens in row b; slots `[0, lengths[b])` hold them,
  in position order (slot index == token position).
- Slots at or past `lengths[b]` hold stale values; attention masks them by position, and
  the next write overwrites them. Rolling a row back (speculative decoding) is therefore
  just lowering `lengths`, with no copy.
- Tokens whose position is negative are padding: they are not written and not counted.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from jaxdec.config import ModelConfig


@partial(jax.tree_util.register_dataclass, data_fields=["k", "v"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class KVLayer:
    k: jax.Array  # [B, K, S, H]
    v: jax.Array  # [B, K, S, H]


@partial(jax.tree_util.register_dataclass, data_fields=["layers", "lengths"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class KVCache:
    layers: tuple[KVLayer, ...]
    lengths: jax.Array  # i32[B]

    @property
    def capacity(self) -> int:
        return self.layers[0].k.shape[2]

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    shape = (batch, cfg.n_kv_heads, max_len, cfg.head_dim)
    layer = lambda: KVLayer(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
    return KVCache(layers=tuple(layer() for _ in range(cfg.n_layers)),
                   lengths=jnp.zeros((batch,), jnp.int32))


def write(layer: KVLayer, k: jax.Array, v: jax.Array, positions: jax.Array) -> KVLayer:
    """Scatter new keys/values ([B, T, K, H]) into their slots; padding is dropped."""
    b, _ = positions.shape
    capacity = layer.k.shape[2]
    slots = jnp.where(positions >= 0, positions, capacity)  # out of range -> dropped
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], positions.shape)
    put = lambda buf, new: buf.at[rows, :, slots, :].set(new.astype(buf.dtype), mode="drop")
    return KVLayer(k=put(layer.k, k), v=put(layer.v, v))


def advance(lengths: jax.Array, positions: jax.Array) -> jax.Array:
    """New per-row lengths after writing tokens at `positions` (padding < 0 ignored)."""
    return jnp.maximum(lengths, jnp.max(positions, axis=1) + 1).astype(jnp.int32)


def visible(positions: jax.Array, capacity: int) -> jax.Array:
    """bool[B, T, S]: query at position p sees slots 0..p (causal over the cache)."""
    slots = jnp.arange(capacity)
    return (slots[None, None, :] <= positions[:, :, None]) & (positions[:, :, None] >= 0)
