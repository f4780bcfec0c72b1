"""The int8 and int4 cache kinds: keys and values as `QuantKV` tensors
(`jaxdec.formats.kvquant`) behind the cache-entry interface (`jaxdec.cache.entry`)."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from jaxdec.cache import entry, registry
from jaxdec.errors import JaxdecError
from jaxdec.formats.kvquant import QuantKV, dequantize_kv, empty_kv, put_rows, take_rows, write_kv


GROUP = 32  # channels per scale of the int8/int4 cache kinds


def kind_format(kind: str, head_dim: int) -> dict:
    """The `QuantKV` format of the "int8" or "int4" cache kind for heads of `head_dim`."""
    group = GROUP if head_dim % (2 * GROUP) == 0 else head_dim // 2
    return dict(bits=8 if kind == "int8" else 4, granularity="group", group_size=group)


@partial(jax.tree_util.register_dataclass, data_fields=["k", "v", "pos"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class QuantKVLayer(entry.Slotted):
    """The int8 and int4 kinds: keys and values as `QuantKV` codes with a scale (and
    offset) per token and group of channels. Short chunks (decode steps, drafts) write
    first and then attend, so their queries read every key, their own included, as stored."""

    k: QuantKV  # logical [B, K, S + 1, H]: S slots, then the scratch slot
    v: QuantKV  # logical [B, K, S + 1, H]
    pos: jax.Array  # i32[B, S + 1]
    writes_first = True

    @classmethod
    def empty(cls, kind: str, batch: int, k_heads: int, head_dim: int, slots: int, dtype):
        make = lambda: empty_kv(batch, k_heads, slots, head_dim, scale_dtype=dtype,
                                **kind_format(kind, head_dim))
        return cls(k=make(), v=make(), pos=jnp.full((batch, slots), -1, jnp.int32))

    @classmethod
    def axes(cls, kind: str = "int8"):
        one = QuantKV(codes=("batch", "kv_heads", None, None), scale=("batch", "kv_heads", None, None),
                      offset=None if kind == "int8" else ("batch", "kv_heads", None, None),
                      bits=8 if kind == "int8" else 4, granularity="group", group_size=GROUP)
        return cls(k=one, v=one, pos=("batch", None))

    def write(self, k, v, slots, positions):
        at = self.where(slots, positions)
        pos = put_rows(self.pos, jnp.where(at == self.capacity, -1, positions), at, 0)
        return QuantKVLayer(k=write_kv(self.k, k, at), v=write_kv(self.v, v, at), pos=pos)

    def move(self, src, dst):
        src_at, dst_at = self.where(src, src), self.where(dst, dst)
        shift = lambda x: None if x is None else put_rows(x, take_rows(x, src_at, 1), dst_at, 1)
        tensor = lambda t: dataclasses.replace(t, codes=shift(t.codes), scale=shift(t.scale),
                                               offset=shift(t.offset))
        pos = jnp.where(dst_at == self.capacity, -1, take_rows(self.pos, src_at, 0))
        return QuantKVLayer(k=tensor(self.k), v=tensor(self.v), pos=put_rows(self.pos, pos, dst_at, 0))

    def view(self, dtype):
        return (dequantize_kv(self.k).astype(dtype), dequantize_kv(self.v).astype(dtype).swapaxes(2, 3))

    def kernel(self, q, lengths):
        from pallas_kernels.quantized_kv_attention import quantized_kv_attention
        return quantized_kv_attention(q, self.k, self.v, lengths, **entry.pallas_run())


def _fits(kind: str):
    def fits(cfg) -> None:
        fmt = kind_format(kind, cfg.head_dim)
        if cfg.head_dim % 2 or cfg.head_dim % fmt["group_size"] or (kind == "int4" and fmt["group_size"] % 2):
            raise JaxdecError(f"the {kind} KV cache cannot group heads of {cfg.head_dim} channels "
                              f"(groups of {GROUP}, or half a head, and an even head size)")
    return fits


def _register(kind: str, what: str):
    @registry.register(kind, summary=f"{what} codes + a scale per token and group of {GROUP} channels",
                       fits=_fits(kind))
    def make(cfg, layer, batch, max_len, dtype):
        return QuantKVLayer.empty(kind, batch, cfg.kv_heads(layer), cfg.head_dim, max_len + 1, dtype)


KINDS = {"int8": "int8", "int4": "4-bit (two per byte)"}  # the quantised kinds (what their codes are)
for _kind, _what in KINDS.items():
    _register(_kind, _what)
