"""The dense KV cache: fixed capacity, per-row lengths.

Invariants:
- `lengths[b]` is the number of valid tokens in row b; slots `[0, lengths[b])` hold them,
  in position order (slot index == token position).
- Slots at or past `lengths[b]` hold stale values; attention masks them by position, and
  the next write overwrites them. Rolling a row back (speculative decoding) is therefore
  just lowering `lengths`, with no copy.
- Tokens whose position is negative are padding: they are not counted and never become
  visible. They (and tokens past the capacity) are written to one extra scratch slot at
  index `capacity`, which no query sees. Writing there instead of dropping keeps every
  scatter index in bounds, so XLA updates the buffer in place: a dropped write compiled
  to read-old/select/write plus three copies of each layer's buffer per decode step.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxdec.config import ModelConfig


@partial(jax.tree_util.register_dataclass, data_fields=["k", "v"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class KVLayer:
    k: jax.Array  # [B, K, S + 1, H]: S usable slots, then the scratch slot
    v: jax.Array  # [B, K, H, S + 1]: slots minor, the layout XLA's CPU dot wants for P @ V
    # (with V stored [.., S, H] it transposed every layer's V on every decode step)


@partial(jax.tree_util.register_dataclass, data_fields=["layers", "lengths"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class KVCache:
    layers: tuple[KVLayer, ...]
    lengths: jax.Array  # i32[B]

    @property
    def capacity(self) -> int:
        return self.n_slots - 1

    @property
    def n_slots(self) -> int:
        return self.layers[0].k.shape[2]

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    shape = (batch, cfg.n_kv_heads, max_len + 1, cfg.head_dim)
    shape_v = (batch, cfg.n_kv_heads, cfg.head_dim, max_len + 1)
    # Host zeros copied to the device, one buffer at a time: jnp.zeros compiles a program
    # per shape (~50 ms of a CLI start). may_alias=False: an aliased host buffer would be
    # copied when the cache is first donated instead of being updated in place.
    zeros = lambda s, dt: jax.device_put(np.zeros(s, dt), may_alias=False)
    layer = lambda: KVLayer(k=zeros(shape, dtype), v=zeros(shape_v, dtype))
    return KVCache(layers=tuple(layer() for _ in range(cfg.n_layers)),
                   lengths=zeros((batch,), jnp.int32))


def write(layer: KVLayer, k: jax.Array, v: jax.Array, positions: jax.Array) -> KVLayer:
    """Scatter new keys/values ([B, T, K, H]) into their slots; padding goes to scratch."""
    b, _ = positions.shape
    capacity = layer.k.shape[2] - 1
    slots = jnp.where((positions >= 0) & (positions < capacity), positions, capacity)
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], positions.shape)
    put_k = lambda buf, new: buf.at[rows, :, slots, :].set(new.astype(buf.dtype),
                                                           mode="promise_in_bounds")
    put_v = lambda buf, new: buf.at[rows, :, :, slots].set(new.astype(buf.dtype),
                                                           mode="promise_in_bounds")
    return KVLayer(k=put_k(layer.k, k), v=put_v(layer.v, v))


def advance(lengths: jax.Array, positions: jax.Array) -> jax.Array:
    """New per-row lengths after writing tokens at `positions` (padding < 0 ignored)."""
    return jnp.maximum(lengths, jnp.max(positions, axis=1) + 1).astype(jnp.int32)


def before(lengths: jax.Array, positions: jax.Array, n_slots: int) -> jax.Array:
    """bool[B, T, n_slots]: the cached slots a chunk of queries sees, those filled before
    the chunk: below both the row's length and the chunk's first position (the chunk's own
    keys are attended separately). Padding queries see nothing, nobody sees scratch."""
    first = jnp.min(jnp.where(positions >= 0, positions, n_slots), axis=1)
    end = jnp.minimum(lengths, first)
    slots = jnp.arange(n_slots)[None, None, :]
    return (slots < end[:, None, None]) & (positions[:, :, None] >= 0)
