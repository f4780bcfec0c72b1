"""The kinds of KV cache an attention layer can keep, and the attention over each.

    kind      entry            what a slot holds
    dense     dense.KVLayer    keys and values in the activation dtype
    paged     PagedKVLayer     the same, in pages of a pool found through a page table
    int8      QuantKVLayer     int8 codes + a scale per token and group of 32 channels
    int4      QuantKVLayer     4-bit codes (two per byte) + a scale and offset per group

Only attention layers change kind: latent (MLA) and Mamba entries stay as they are. A
decode step (one query per row) writes its key and value first, then attends over the
entry in place through the kernel op of its kind, by `cfg.attention_impl`: "pallas" runs
the Pallas kernel (interpret mode on the CPU), "xla" the op's XLA path. Prompts (several
queries per row) attend in XLA over a dense view of the entry. The dense kind with the
"xla" implementation keeps the dense path of `layers.attention` (the CPU kernel).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxdec.cache import dense, paged
from jaxdec.config import ModelConfig
from jaxdec.errors import JaxdecError

KINDS = ("dense", "paged", "int8", "int4")
IMPLS = ("xla", "pallas")
GROUP = 32  # channels per scale of the quantised kinds


@partial(jax.tree_util.register_dataclass, data_fields=["k", "v"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class QuantKVLayer:
    k: "quantized.QuantKV"  # logical [B, K, S + 1, H]: S slots, then the scratch slot
    v: "quantized.QuantKV"  # logical [B, K, S + 1, H]


def check(kind: str, impl: str) -> None:
    if kind not in KINDS:
        raise JaxdecError(f"unknown KV cache kind {kind!r} (one of {', '.join(KINDS)})")
    if impl not in IMPLS:
        raise JaxdecError(f"unknown attention implementation {impl!r} (one of {', '.join(IMPLS)})")


def quant_format(kind: str, head_dim: int) -> dict:
    group = GROUP if head_dim % (2 * GROUP) == 0 else head_dim // 2
    return dict(bits=8 if kind == "int8" else 4, granularity="group", group_size=group)


def attention_entry(kind: str, cfg: ModelConfig, batch: int, max_len: int, dtype,
                    page_size: int = paged.PAGE_SIZE, seed: int = 0):
    """An empty attention-layer entry of `kind` for `batch` rows of up to `max_len` tokens."""
    kh, h = cfg.n_kv_heads, cfg.head_dim
    zeros = lambda shape, dt: jax.device_put(np.zeros(shape, dt), may_alias=False)
    if kind == "paged":
        fields = paged.shapes(batch, kh, h, max_len, dtype, page_size)
        table = paged.page_table(batch, fields["page_table"][0][1], seed)
        return paged.PagedKVLayer(k_pages=zeros(*fields["k_pages"]), v_pages=zeros(*fields["v_pages"]),
                                  page_table=jax.device_put(table))
    from jaxdec.cache import quantized
    make = lambda: quantized.empty_kv(batch, kh, max_len + 1, h, scale_dtype=dtype,
                                      **quant_format(kind, h))
    return QuantKVLayer(k=make(), v=make())


def n_slots(entry) -> int | None:
    if isinstance(entry, paged.PagedKVLayer):
        return entry.capacity + 1
    if isinstance(entry, QuantKVLayer):
        return entry.k.codes.shape[2]
    return None


def write(entry, k, v, positions):
    """The entry with new keys/values [B, T, K, H] written at `positions` (i32[B, T])."""
    if isinstance(entry, dense.KVLayer):
        return dense.write(entry, k, v, positions)
    if isinstance(entry, paged.PagedKVLayer):
        return paged.write(entry, k, v, positions)
    from jaxdec.cache import quantized
    slots = dense.slot_index(positions, entry.k.codes.shape[2] - 1)
    return QuantKVLayer(k=quantized.write_kv(entry.k, k, slots), v=quantized.write_kv(entry.v, v, slots))


def dense_view(entry, dtype):
    """(k [B, K, S + 1, H], v [B, K, H, S + 1]) in `dtype`: the entry as a dense one."""
    if isinstance(entry, dense.KVLayer):
        return entry.k, entry.v
    if isinstance(entry, paged.PagedKVLayer):
        return paged.dense_view(entry)
    from jaxdec.cache import quantized
    return (quantized.dequantize_kv(entry.k).astype(dtype),
            quantized.dequantize_kv(entry.v).astype(dtype).swapaxes(2, 3))


def decode_attention(q, entry, lengths, impl: str):
    """q [B, N, H] (one query per row) over slots [0, lengths[b]) of the entry -> [B, N, H]."""
    run = dict(implementation=impl, interpret=impl == "pallas" and jax.default_backend() == "cpu")
    if isinstance(entry, dense.KVLayer):
        from pallas_kernels.decode_attention import decode_attention as op
        return op(q, entry.k, entry.v, lengths, v_layout="hs", **run)
    if isinstance(entry, paged.PagedKVLayer):
        from pallas_kernels.paged_attention import paged_attention as op
        return op(q, entry.k_pages, entry.v_pages, entry.page_table, lengths, **run)
    from pallas_kernels.quantized_kv_attention import quantized_kv_attention as op
    return op(q, entry.k, entry.v, lengths, **run)
