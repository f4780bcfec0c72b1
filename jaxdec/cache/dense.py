"""The decode cache: one entry per layer and per-row lengths, and the kinds it is made of.

    kind      attention entry          what a slot holds
    dense     entry.KVLayer            keys and values in the activation dtype
    paged     paged.PagedKVLayer       the same, in pages of a pool found through a page table
    int8      quantized.QuantKVLayer   int8 codes + a scale per token and group of 32 channels
    int4      quantized.QuantKVLayer   4-bit codes (two per byte) + a scale and offset per group
    window    window.RingKVLayer       a sliding-window layer's last keys, in a ring (global
                                       layers, and windowed ones whose ring would not be
                                       smaller than the cache, keep dense entries)

Each kind is one file that registers how to make its entries (`jaxdec.cache.registry`);
`--kv-cache` and `jaxdec.load(kv_cache=...)` choose among the registered names. An MLA
layer keeps `entry.LatentLayer` and a Mamba layer `entry.StateLayer`, whatever the kind:
asking a model with such layers for another kind is an error, as is a kind whose own
check (`Kind.fits`) refuses the model. Every entry implements the interface of
`jaxdec.cache.entry`; `lengths[b]` counts the tokens of row b (its next position).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import NamedSharding

from jaxdec import sharding
from jaxdec.cache import paged, quantized, registry, window
from jaxdec.cache.entry import KVLayer, LatentLayer, Slotted, StateLayer
from jaxdec.config import ModelConfig
from jaxdec.errors import JaxdecError
from jaxdec.pytree import LogicalRules

IMPLS = ("xla", "pallas")
Entry = KVLayer | LatentLayer | StateLayer | paged.PagedKVLayer | quantized.QuantKVLayer


@partial(jax.tree_util.register_dataclass, data_fields=["layers", "lengths"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class KVCache:
    layers: tuple[Entry | None, ...]
    lengths: jax.Array  # i32[B]

    @property
    def capacity(self) -> int:
        """The most tokens a row can hold (the largest int32 when no entry limits it)."""
        limits = [e.max_tokens for e in self.layers if e is not None and e.max_tokens is not None]
        return min(limits, default=np.iinfo(np.int32).max - 1)

    @property
    def n_slots(self) -> int:
        """Slots per row of the first slotted entry (1 when there is none)."""
        return next((e.n_slots for e in self.layers if isinstance(e, Slotted)), 1)

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def reset_rows(self, rows) -> "KVCache":
        """The cache with the rows marked in `rows` (bool[B]) emptied, to be reused."""
        rows = jnp.asarray(rows, bool)
        return KVCache(layers=tuple(e if e is None else e.reset_rows(rows) for e in self.layers),
                       lengths=jnp.where(rows, 0, self.lengths))

    def with_pages(self, table, held=None) -> "KVCache":
        """The cache reading every layer's pages through `table` (i32[B, pages_per_row], from
        a `paged.PageAllocator`); rows with held[b] > 0 hold their first held[b] tokens in
        pages shared from another row (`PagedKVLayer.with_table`) and continue from there."""
        layers = tuple(e if e is None else e.with_table(table, held) for e in self.layers)
        lengths = self.lengths if held is None else jnp.maximum(self.lengths, jnp.asarray(held, jnp.int32))
        return KVCache(layers=layers, lengths=lengths)

    def bytes(self) -> int:
        return sum(e.bytes() for e in self.layers if e is not None) + self.lengths.nbytes


def check(kind: str, impl: str, cfg: ModelConfig | None = None) -> None:
    """A one-line error unless `kind` is a registered kind and `impl` exists and (given
    `cfg`) the model can take the kind."""
    spec = registry.get(kind)
    if impl not in IMPLS:
        raise JaxdecError(f"unknown attention implementation {impl!r} (one of {', '.join(IMPLS)})")
    if cfg is None or kind == "dense":
        return
    for i, (mixer, _) in enumerate(cfg.kinds):
        if mixer in ("mla", "mamba"):
            what = "an MLA layer keeps its latent cache" if mixer == "mla" else \
                "a Mamba layer keeps a fixed-size state"
            raise JaxdecError(f"the {kind} KV cache does not apply to layer {i}: {what} "
                              "(use the dense kind)")
    if spec.fits is not None:
        spec.fits(cfg)


def entry_shapes(cfg: ModelConfig, i: int, batch: int, max_len: int, dtype):
    """Layer i's dense-kind entry as (class, {field: (shape, dtype)})."""
    mixer, s = cfg.kinds[i][0], max_len + 1
    if mixer == "attention":
        return KVLayer, KVLayer.shapes(batch, cfg.kv_heads(i), cfg.head_dim, s, dtype)
    if mixer == "mla":
        return LatentLayer, LatentLayer.shapes(batch, cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim, s, dtype)
    if mixer == "mamba":
        shapes = cfg.mamba.state_shapes(batch)
        return StateLayer, {"conv_x": (shapes["conv_x"], dtype), "conv_bc": (shapes["conv_bc"], dtype),
                            "ssm": (shapes["ssm"], jnp.float32)}
    return None, {}


def entry_axes(mixer: str | None):
    """The logical axes of the dense-kind entry of a layer whose mixer is `mixer`, as an
    entry of tuples (the sharding rules map them: rows over `data`, kv heads as the k/v
    projections are split); None for a layer without one."""
    cls = {"attention": KVLayer, "mla": LatentLayer, "mamba": StateLayer}.get(mixer)
    return None if cls is None else cls.axes()


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32,
               shardings: KVCache | None = None, kind: str = "dense", **options) -> KVCache:
    """An empty cache for `batch` rows of up to `max_len` tokens, one entry per layer;
    laid out by `shardings` (`cache_shardings`) when given, each device
    allocating only its own shard. `kind` picks the attention layers' entries (module
    docstring); `options` go to its maker (`registry.Kind.options`; paged: page_size,
    pool_pages, fill, seed; window: margin)."""
    check(kind, "xla", cfg)
    if kind != "dense" and shardings is not None:
        raise JaxdecError(f"a {kind} KV cache is not laid out on a mesh yet: use the dense one")
    # Host arrays copied to the device, one buffer at a time: jnp.zeros compiles a program
    # per shape (~50 ms of a CLI start). may_alias=False: an aliased host buffer would be
    # copied when the cache is first donated instead of being updated in place. Positions
    # start at -1 (empty), everything else at 0.
    def empty(shape, dt, sharding=None, fill=None):
        fill = (-1 if np.dtype(dt) == np.int32 else 0) if fill is None else fill
        if sharding is None:
            return jax.device_put(np.full(shape, fill, dt), may_alias=False)
        return jax.make_array_from_callback(
            shape, sharding, lambda idx: np.full(sharding.shard_shape(shape), fill, dt))

    def entry(i, mixer):
        made = None if mixer != "attention" else registry.make(kind, cfg, i, batch, max_len, dtype, **options)
        if made is not None:
            return made
        cls, fields = entry_shapes(cfg, i, batch, max_len, dtype)
        where = shardings.layers[i] if shardings is not None else None
        return None if cls is None else cls(**{
            f: empty(*sd, None if where is None else getattr(where, f)) for f, sd in fields.items()})

    return KVCache(layers=tuple(entry(i, mixer) for i, (mixer, _) in enumerate(cfg.kinds)),
                   lengths=empty((batch,), np.int32, shardings and shardings.lengths, fill=0))


def bytes_per_token(cfg: ModelConfig, dtype=jnp.float32) -> tuple[int, int]:
    """(bytes that grow with each token, fixed bytes) of one row's dense-kind cache over all
    layers (slot positions included)."""
    grow = fixed = 0
    for i in range(cfg.n_layers):
        size = lambda n: sum(int(np.prod(s)) * np.dtype(dt).itemsize
                             for s, dt in entry_shapes(cfg, i, 1, n, dtype)[1].values())
        grow += size(2) - size(1)
        fixed += 3 * size(1) - 2 * size(2)  # size(L) = fixed + grow * (L + 1 scratch)
    return grow, fixed


def advance(lengths: jax.Array, positions: jax.Array) -> jax.Array:
    """New per-row lengths after writing tokens at `positions` (padding < 0 ignored)."""
    return jnp.maximum(lengths, jnp.max(positions, axis=1) + 1).astype(jnp.int32)


def cache_specs(cfg: ModelConfig, rules: LogicalRules, to=lambda spec: spec) -> KVCache:
    """The PartitionSpecs of a dense-kind `KVCache` of `cfg` (a KVCache of them), each
    passed through `to` (e.g. into a NamedSharding)."""
    one = lambda axes: to(rules.spec(axes))
    layer = lambda axes: None if axes is None else jax.tree.map(
        one, axes, is_leaf=lambda x: isinstance(x, tuple))
    return KVCache(layers=tuple(layer(entry_axes(m)) for m, _ in cfg.kinds), lengths=one(("batch",)))


def cache_shardings(cfg: ModelConfig, mesh, rules: LogicalRules) -> KVCache:
    """The NamedShardings of a dense-kind `KVCache` of `cfg` on `mesh`."""
    return cache_specs(cfg, rules, lambda spec: NamedSharding(mesh, spec))


def constrain(cache: KVCache | None, cfg: ModelConfig):
    """Pin a cache computed inside a jit to its layout (`cache_specs`) when traced under a
    split mesh, so that a donated cache comes back laid out as it went in; else `cache`."""
    if cache is None or not sharding.split_axes():
        return cache
    specs = cache_specs(cfg, sharding.rules_for(cfg, jax.sharding.get_abstract_mesh()))
    return jax.lax.with_sharding_constraint(cache, specs)
