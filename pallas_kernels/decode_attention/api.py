"""`decode_attention`: one query step per row against a ragged-length KV cache, with GQA.

    out = decode_attention(q, k, v, lengths, implementation="pallas", interpret=False)

q: [B, N, H]; k: [B, K, S, H]; v: [B, K, S, H] (v_layout="sh") or [B, K, H, S] ("hs",
the layout of `jaxdec.cache.entry.KVLayer.v`); lengths: i32[B], row b sees slots
[0, lengths[b]) (lengths outside [0, S] are clamped). Returns [B, N, H] in q's dtype, and
with `return_lse` also the float32 log-sum-exp of each head's scores [B, N] (-inf for an
empty row), with which partial attentions over disjoint keys merge (`common.merge`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import common
from pallas_kernels.decode_attention import gpu, reference, tpu

OP = "decode_attention"
FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)


def check_inputs(op: str, q, k, v, lengths, v_layout: str) -> tuple[int, int, int, int, int]:
    """(B, N, K, S, H) of valid decode-attention inputs, or a one-line `KernelError`."""
    common.check(v_layout in ("sh", "hs"), op, f"v_layout={v_layout!r}, expected 'sh' or 'hs'")
    common.check(q.ndim == 3, op, f"q has shape {tuple(q.shape)}, expected [B, N, H]")
    common.check(k.ndim == 4, op, f"k has shape {tuple(k.shape)}, expected [B, K, S, H]")
    b, n, h = q.shape
    kh, s = k.shape[1], k.shape[2]
    common.check_shape(op, "k", k, (b, kh, s, h))
    common.check_shape(op, "v", v, (b, kh, s, h) if v_layout == "sh" else (b, kh, h, s))
    common.check(n % kh == 0, op, f"{n} query heads do not share {kh} kv heads evenly")
    for name, x in (("q", q), ("k", k), ("v", v)):
        common.check_dtype(op, name, x, FLOATS)
    common.check(k.dtype == v.dtype, op, f"k is {k.dtype} but v is {v.dtype}")
    common.check_dtype(op, "lengths", lengths, (jnp.int32,))
    common.check_shape(op, "lengths", lengths, (b,))
    return b, n, kh, s, h


@functools.partial(jax.jit, static_argnames=(
    "implementation", "interpret", "platform", "block_k", "n_splits", "v_layout", "scale",
    "return_lse"))
def decode_attention(q, k, v, lengths, *, implementation: str = "pallas", interpret: bool = False,
                     platform: str | None = None, block_k: int = 128, n_splits: int | None = None,
                     v_layout: str = "sh", scale: float | None = None, return_lse: bool = False):
    """See the module docstring. `block_k` (keys per block) and `n_splits` (GPU split-K
    shares per row and kv head; default: enough to fill the GPU) are static."""
    b, n, kh, s, h = check_inputs(OP, q, k, v, lengths, v_layout)
    where = common.resolve(OP, implementation, interpret, platform)
    scale = 1.0 / math.sqrt(h) if scale is None else scale
    lengths = jnp.clip(lengths, 0, s)
    if where is None:
        out, lse = reference.decode_attention(q, k, v, lengths, scale=scale, v_layout=v_layout)
    else:
        common.check_head_dim(OP, h, where)
        common.check_block(OP, "block_k", block_k, where)
        k, v = pad_slots(k, v, block_k, v_layout == "hs")
        qg = common.group_queries(q, kh)
        if where == "gpu":
            out, lse = gpu.decode_attention(qg, k, v, lengths, scale=scale, block_k=block_k,
                                            n_splits=n_splits, v_hs=v_layout == "hs", interpret=interpret)
        else:
            out, lse = tpu.decode_attention(qg, k, v, lengths, scale=scale, block_k=block_k,
                                            v_hs=v_layout == "hs", interpret=interpret)
        out, lse = out.reshape(b, n, h), lse.reshape(b, n)
    out = out.astype(q.dtype)
    return (out, lse) if return_lse else out


def pad_slots(k, v, block: int, v_hs: bool):
    """A cache shorter than one block is padded to one (a copy of at most `block` slots);
    longer caches are used as they are (a partial last block is masked)."""
    s = k.shape[2]
    if s >= block:
        return k, v
    pad = [(0, 0)] * 4
    k = jnp.pad(k, pad[:2] + [(0, block - s), (0, 0)])
    v = jnp.pad(v, pad[:3] + [(0, block - s)] if v_hs else pad[:2] + [(0, block - s), (0, 0)])
    return k, v


def bytes_moved(q, k, lengths, *, block_k: int = 128) -> common.Bytes:
    """HBM bytes of one call: q, the K and V blocks of the visible slots (whole blocks, as
    the kernels read them), the output. `lengths` must be concrete."""
    b, kh, s, h = k.shape
    lengths = np.clip(np.asarray(lengths), 0, s)
    slots = int(np.minimum(-(-lengths // block_k) * block_k, s).sum())
    kv = 2 * slots * kh * h * np.dtype(k.dtype).itemsize
    return common.Bytes(read=common.nbytes(q.shape, q.dtype) + kv + 4 * lengths.size,
                        written=common.nbytes(q.shape, q.dtype))
