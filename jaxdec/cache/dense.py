"""The decode cache: one entry per layer, chosen by the layer's mixer, and per-row lengths.

- attention: `KVLayer`, keys and values per kv head per slot;
- mla: `LatentLayer`, one latent and one RoPE key per slot (shared by every head);
- mamba: `StateLayer`, the conv window and the SSM state: the same size at any length;
- a layer without a mixer (a lone MLP or MoE) has no entry (None).

Invariants of the slotted entries (KV and latent):
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
from jaxdec.errors import JaxdecError


@partial(jax.tree_util.register_dataclass, data_fields=["k", "v"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class KVLayer:
    k: jax.Array  # [B, K, S + 1, H]: S usable slots, then the scratch slot
    v: jax.Array  # [B, K, H, S + 1]: slots minor, the layout XLA's CPU dot wants for P @ V
    # (with V stored [.., S, H] it transposed every layer's V on every decode step)


@partial(jax.tree_util.register_dataclass, data_fields=["c", "k_rope"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class LatentLayer:
    c: jax.Array  # [B, S + 1, kv_lora_rank]: the normed latent of each token
    k_rope: jax.Array  # [B, S + 1, qk_rope_head_dim]: its rotated key, shared by all heads


@partial(jax.tree_util.register_dataclass, data_fields=["conv_x", "conv_bc", "ssm"],
         meta_fields=[])
@dataclasses.dataclass(frozen=True)
class StateLayer:
    conv_x: jax.Array  # [B, d_conv - 1, n_heads, head_dim]: the last inputs of the causal conv
    conv_bc: jax.Array  # [B, d_conv - 1, 2, n_groups, d_state]: ... of its B, C channels
    ssm: jax.Array  # f32[B, n_heads, head_dim, d_state]


def _slots(entry) -> int | None:
    if isinstance(entry, KVLayer):
        return entry.k.shape[2]
    if isinstance(entry, LatentLayer):
        return entry.c.shape[1]
    if entry is None or isinstance(entry, StateLayer):
        return None
    from jaxdec.cache import kinds  # paged and quantised attention entries
    return kinds.n_slots(entry)


@partial(jax.tree_util.register_dataclass, data_fields=["layers", "lengths"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class KVCache:
    layers: tuple[KVLayer | LatentLayer | StateLayer | None, ...]
    lengths: jax.Array  # i32[B]

    @property
    def capacity(self) -> int:
        return self.n_slots - 1

    @property
    def n_slots(self) -> int:
        """Slots per row of the slotted entries (1, the scratch slot only, when a model has
        none: a pure Mamba model's cache has no capacity to run out of)."""
        return next((n for n in map(_slots, self.layers) if n is not None), 1)

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]


def entry_shapes(cfg: ModelConfig, mixer: str | None, batch: int, max_len: int, dtype):
    """The cache entry of one layer whose mixer is `mixer`, as (class, {field: (shape, dtype)})."""
    s = max_len + 1
    if mixer == "attention":
        k, h = cfg.n_kv_heads, cfg.head_dim
        return KVLayer, {"k": ((batch, k, s, h), dtype), "v": ((batch, k, h, s), dtype)}
    if mixer == "mla":
        m = cfg.mla
        return LatentLayer, {"c": ((batch, s, m.kv_lora_rank), dtype),
                             "k_rope": ((batch, s, m.qk_rope_head_dim), dtype)}
    if mixer == "mamba":
        shapes = cfg.mamba.state_shapes(batch)
        return StateLayer, {"conv_x": (shapes["conv_x"], dtype), "conv_bc": (shapes["conv_bc"], dtype),
                            "ssm": (shapes["ssm"], jnp.float32)}
    return None, {}


def entry_axes(mixer: str | None):
    """The logical axes of the cache entry of a layer whose mixer is `mixer`, as an entry
    of tuples (the sharding rules map them: rows over `data`, kv heads as the k/v
    projections are split); None for a layer without one."""
    if mixer == "attention":
        return KVLayer(k=("batch", "kv_heads", None, "head_dim"),
                       v=("batch", "kv_heads", "head_dim", None))
    if mixer == "mla":
        return LatentLayer(c=("batch", None, "kv_lora"), k_rope=("batch", None, None))
    if mixer == "mamba":
        return StateLayer(conv_x=("batch", None, "mamba_heads", None),
                          conv_bc=("batch", None, None, "mamba_groups", None),
                          ssm=("batch", "mamba_heads", None, None))
    return None


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32,
               shardings: KVCache | None = None, kind: str = "dense", **options) -> KVCache:
    """An empty cache for `batch` rows of up to `max_len` tokens, one entry per layer;
    laid out by `shardings` (`jaxdec.sharding.cache_shardings`) when given, each device
    allocating only its own shard. `kind` picks the attention layers' entries (dense,
    paged, int8, int4: `jaxdec.cache.kinds`; `options` such as page_size go to them)."""
    if kind != "dense":
        from jaxdec.cache import kinds
        kinds.check(kind, "xla")
        if shardings is not None:
            raise JaxdecError(f"a {kind} KV cache is not laid out on a mesh yet: use the dense one")
    # Host zeros copied to the device, one buffer at a time: jnp.zeros compiles a program
    # per shape (~50 ms of a CLI start). may_alias=False: an aliased host buffer would be
    # copied when the cache is first donated instead of being updated in place.
    def zeros(shape, dt, sharding=None):
        if sharding is None:
            return jax.device_put(np.zeros(shape, dt), may_alias=False)
        return jax.make_array_from_callback(
            shape, sharding, lambda idx: np.zeros(sharding.shard_shape(shape), dt))

    def entry(i, mixer):
        if mixer == "attention" and kind != "dense":
            return kinds.attention_entry(kind, cfg, batch, max_len, dtype, **options)
        cls, fields = entry_shapes(cfg, mixer, batch, max_len, dtype)
        where = shardings.layers[i] if shardings is not None else None
        return None if cls is None else cls(**{
            f: zeros(*sd, None if where is None else getattr(where, f)) for f, sd in fields.items()})

    return KVCache(layers=tuple(entry(i, mixer) for i, (mixer, _) in enumerate(cfg.kinds)),
                   lengths=zeros((batch,), jnp.int32, shardings and shardings.lengths))


def bytes_per_token(cfg: ModelConfig, dtype=jnp.float32) -> tuple[int, int]:
    """(bytes that grow with each token, fixed bytes) of one row's cache over all layers."""
    grow = fixed = 0
    for mixer, _ in cfg.kinds:
        _, one = entry_shapes(cfg, mixer, 1, 1, dtype)
        _, two = entry_shapes(cfg, mixer, 1, 2, dtype)
        size = lambda f: sum(int(np.prod(s)) * jnp.dtype(dt).itemsize for s, dt in f.values())
        grow += size(two) - size(one)
        fixed += 3 * size(one) - 2 * size(two)  # size(L) = fixed + grow * (L + 1 scratch)
    return grow, fixed


def slot_index(positions: jax.Array, capacity: int) -> jax.Array:
    """i32[B, T]: the slots to scatter a chunk into; padding and overflow go to scratch."""
    return jnp.where((positions >= 0) & (positions < capacity), positions, capacity)


def _put(buf: jax.Array, new: jax.Array, slots: jax.Array, axis: int) -> jax.Array:
    """Row b of `new` ([B, T, ...]) into row b of `buf` at `slots[b]` (i32[B, T]) along
    `axis` of a row, where the T new entries take the place of that axis. The rows
    are a scatter batch dimension (vmap), so a mesh that splits the batch scatters each
    row where it lives, with no gathered indices."""
    def one(b, n, s):
        index = (slice(None),) * axis + (s,)
        return b.at[index].set(jnp.moveaxis(n, 0, axis).astype(b.dtype), mode="promise_in_bounds")
    return jax.vmap(one)(buf, new, slots)


def write(layer: KVLayer, k: jax.Array, v: jax.Array, positions: jax.Array) -> KVLayer:
    """Scatter new keys/values ([B, T, K, H]) into their slots; padding goes to scratch."""
    slots = slot_index(positions, layer.k.shape[2] - 1)
    # per row, the T new slots go along axis 1 of k [K, S, H] and axis 2 of v [K, H, S]
    return KVLayer(k=_put(layer.k, k, slots, 1), v=_put(layer.v, v, slots, 2))


def write_latent(layer: LatentLayer, c: jax.Array, k_rope: jax.Array, positions) -> LatentLayer:
    """Scatter new latents [B, T, R] and RoPE keys [B, T, r] into their slots."""
    slots = slot_index(positions, layer.c.shape[1] - 1)
    return LatentLayer(c=_put(layer.c, c, slots, 0), k_rope=_put(layer.k_rope, k_rope, slots, 0))


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


def with_chunk(past: jax.Array, positions: jax.Array, mask: jax.Array) -> jax.Array:
    """bool[B, T, n_slots]: `past` (from `before`) plus the chunk's own keys at the slots
    they were written to, as `mask` (bool[B, T, T], queries by keys) shows them: the
    visibility for attending over the cache after writing the chunk into it. A key past
    the capacity (written to scratch) is seen by nobody."""
    n = past.shape[-1]
    slots = jnp.arange(n)[None, None, :]
    own = (positions[:, :, None] == slots) & (slots < n - 1)  # [B, T keys, n_slots]
    return past | jnp.any(mask[:, :, :, None] & own[:, None, :, :], axis=2)


def chunk_mask(positions: jax.Array) -> jax.Array:
    """bool[B, T, T]: causal by position, padding (position < 0) sees and is seen by nothing."""
    q, k = positions[:, :, None], positions[:, None, :]
    return (k <= q) & (k >= 0) & (q >= 0)
