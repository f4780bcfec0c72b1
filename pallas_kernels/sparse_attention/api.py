"""`block_sparse_attention`: decode attention that reads only listed key blocks.

    out = block_sparse_attention(q, k, v, lengths, kept, n_kept, block_k=128)

q: [B, N, H]; k: [B, K, S, H]; v: [B, K, S, H] (v_layout="sh") or [B, K, H, S] ("hs");
lengths: i32[B] (clamped to [0, S]); kept: i32[B, K, M] block ids; n_kept: i32[B, K].
Query head n of row b (kv head kh = n // G) attends to the slots of the blocks
kept[b, kh, :n_kept[b, kh]], block i being slots [i * block_k, (i + 1) * block_k)
intersected with [0, lengths[b]). kept may also be [K, M] with n_kept [K]: one list per kv
head, shared by every row. Entries past n_kept are ignored (they may hold anything).

Kept ids may come in any order but must be distinct: the kernels would read a repeated
block twice (the reference's mask sees it once). Block ids must lie in [0, cdiv(S, block_k))
and n_kept in [0, M]: concrete (non-traced) lists outside that raise a one-line
`KernelError` naming the row and kv head; traced ones are clamped into range.

Returns [B, N, H] in q's dtype, and with `return_lse` also the float32 log-sum-exp [B, N]
(-inf where a head sees nothing), like `decode_attention`.

Keep M tight: the TPU body takes M grid steps per (row, kv head) whatever n_kept is (those
past n_kept fetch nothing and compute nothing, but each costs a step), and the whole list
sits in SMEM. The entry point is a thin Python layer over one jitted call, so that
concrete lists can be checked before tracing.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import common
from pallas_kernels.decode_attention.api import check_inputs, pad_slots
from pallas_kernels.sparse_attention import gpu, reference, tpu

OP = "block_sparse_attention"


def check_lists(op: str, kept, n_kept, b: int, kh: int):
    """kept, n_kept as [B, K, M], [B, K] (a shared [K, M], [K] broadcast), or a `KernelError`."""
    common.check_dtype(op, "kept", kept, (jnp.int32,))
    common.check_dtype(op, "n_kept", n_kept, (jnp.int32,))
    common.check(kept.ndim in (2, 3) and kept.shape[-1] >= 1, op,
                 f"kept has shape {tuple(kept.shape)}, expected [B, K, M] or [K, M] with M >= 1")
    lead = (b, kh) if kept.ndim == 3 else (kh,)
    common.check_shape(op, "kept", kept, lead + kept.shape[-1:])
    common.check_shape(op, "n_kept", n_kept, lead)
    if kept.ndim == 3:
        return kept, n_kept
    xp = np if isinstance(kept, np.ndarray) and isinstance(n_kept, np.ndarray) else jnp
    return xp.broadcast_to(kept, (b,) + kept.shape), xp.broadcast_to(n_kept, (b, kh))


def check_ids(op: str, kept, n_kept, n_blocks: int) -> None:
    """Concrete lists: n_kept in [0, M], listed ids in [0, n_blocks); traced ones pass."""
    if isinstance(kept, jax.core.Tracer) or isinstance(n_kept, jax.core.Tracer):
        return
    kept, n_kept = np.asarray(kept), np.asarray(n_kept)
    m = kept.shape[-1]
    bad = np.argwhere((n_kept < 0) | (n_kept > m))
    if bad.size:
        i, j = bad[0]
        raise common.KernelError(f"{op}: n_kept[{i}, {j}]={n_kept[i, j]} is outside [0, {m}]")
    listed = np.arange(m) < n_kept[..., None]
    bad = np.argwhere(listed & ((kept < 0) | (kept >= n_blocks)))
    if bad.size:
        i, j, e = bad[0]
        raise common.KernelError(f"{op}: kept[{i}, {j}, {e}]={kept[i, j, e]} (row {i}, kv head {j}) "
                                 f"is not a block id in [0, {n_blocks})")


def block_sparse_attention(q, k, v, lengths, kept, n_kept, *, block_k: int = 128,
                           implementation: str = "pallas", interpret: bool = False,
                           platform: str | None = None, n_splits: int | None = None,
                           v_layout: str = "sh", scale: float | None = None,
                           return_lse: bool = False):
    """See the module docstring. `block_k` (slots per block), `n_splits` (GPU split-K shares
    of each kept list; default: enough to fill the GPU) and the rest are static."""
    b, _, kh, s, _ = check_inputs(OP, q, k, v, lengths, v_layout)
    kept, n_kept = check_lists(OP, kept, n_kept, b, kh)
    common.check(block_k > 0, OP, f"block_k={block_k} must be positive")
    check_ids(OP, kept, n_kept, block_count(s, block_k))
    return _block_sparse_attention(
        q, k, v, lengths, kept, n_kept, block_k=block_k, implementation=implementation,
        interpret=interpret, platform=platform, n_splits=n_splits, v_layout=v_layout,
        scale=scale, return_lse=return_lse)


def block_count(n_slots: int, block_k: int) -> int:
    """How many blocks of `block_k` slots cover `n_slots` (the last one may be partial)."""
    return -(-n_slots // block_k)


@functools.partial(jax.jit, static_argnames=(
    "block_k", "implementation", "interpret", "platform", "n_splits", "v_layout", "scale",
    "return_lse"))
def _block_sparse_attention(q, k, v, lengths, kept, n_kept, *, block_k, implementation, interpret,
                            platform, n_splits, v_layout, scale, return_lse):
    b, n, h = q.shape
    kh, s = k.shape[1], k.shape[2]
    where = common.resolve(OP, implementation, interpret, platform)
    scale = 1.0 / math.sqrt(h) if scale is None else scale
    lengths = jnp.clip(lengths, 0, s)
    kept = jnp.clip(kept, 0, block_count(s, block_k) - 1)
    n_kept = jnp.clip(n_kept, 0, kept.shape[-1])
    if where is None:
        out, lse = reference.block_sparse_attention(q, k, v, lengths, kept, n_kept, scale=scale,
                                                    block_k=block_k, v_layout=v_layout)
    else:
        common.check_head_dim(OP, h, where)
        common.check_block(OP, "block_k", block_k, where)
        k, v = pad_slots(k, v, block_k, v_layout == "hs")
        qg = common.group_queries(q, kh)
        kwargs = dict(scale=scale, block_k=block_k, v_hs=v_layout == "hs", interpret=interpret)
        if where == "gpu":
            out, lse = gpu.block_sparse_attention(qg, k, v, lengths, kept, n_kept,
                                                  n_splits=n_splits, **kwargs)
        else:
            out, lse = tpu.block_sparse_attention(qg, k, v, lengths, kept, n_kept, **kwargs)
        out, lse = out.reshape(b, n, h), lse.reshape(b, n)
    out = out.astype(q.dtype)
    return (out, lse) if return_lse else out


def bytes_moved(q, k, kept, n_kept, *, block_k: int = 128) -> common.Bytes:
    """HBM bytes of one call: q, the K and V slots of the listed blocks (whole blocks, as the
    kernels read them; a block listed twice counts twice), the kept lists, n_kept, lengths,
    the output. `kept` and `n_kept` must be concrete ([B, K, M] and [B, K])."""
    b, kh, s, h = k.shape
    kept = np.clip(np.asarray(kept), 0, block_count(s, block_k) - 1)
    n_kept = np.clip(np.asarray(n_kept), 0, kept.shape[-1])
    listed = np.arange(kept.shape[-1]) < n_kept[..., None]
    slots = np.minimum((kept + 1) * block_k, s) - kept * block_k
    kv = 2 * int(np.where(listed, slots, 0).sum()) * h * np.dtype(k.dtype).itemsize
    lists = 4 * (kept.size + n_kept.size + b)
    return common.Bytes(read=common.nbytes(q.shape, q.dtype) + kv + lists,
                        written=common.nbytes(q.shape, q.dtype))
