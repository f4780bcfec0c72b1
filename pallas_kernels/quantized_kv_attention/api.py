"""`quantized_kv_attention`: decode attention over a quantised KV cache, dequantised inside
the kernel, so that HBM moves only the compressed bytes.

    out = quantized_kv_attention(q, k, v, lengths, implementation="pallas", interpret=False)

q: [B, N, H]; k, v: `jaxdec.formats.kvquant.QuantKV` of logical shape [B, K, S, H], each in
its own format (int8 or packed int4; scales per token, per group of channels or per
channel), e.g. keys per channel and values per token; lengths: i32[B], row b sees slots
[0, lengths[b]) (lengths outside [0, S] are clamped). Returns [B, N, H] in q's dtype, and
with `return_lse` also the float32 log-sum-exp of each head's scores [B, N] (-inf for an
empty row), as `decode_attention` does.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxdec.formats.kvquant import QuantKV, validate_kv
from jaxdec.errors import JaxdecError
from pallas_kernels import common
from pallas_kernels.quantized_kv_attention import gpu, reference, tpu

OP = "quantized_kv_attention"
FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)


class Format(NamedTuple):
    """The static format of one quantised tensor, as the kernel bodies read it."""

    bits: int
    granularity: str
    group_size: int
    has_offset: bool
    head_dim: int

    @property
    def parts(self) -> int:
        """Head parts a slot unpacks into: the two nibble halves of int4, or the whole head."""
        return 2 if self.bits == 4 else 1


def operands(x: QuantKV) -> tuple[Format, tuple]:
    """(format, kernel operands): codes [B, K, S, H | H/2], then scale and offset as
    stored, except per-channel ones [B, K, 1, H], handed over as [B, K, parts, 1, H / parts]
    (a free reshape: a kernel picks a nibble half's by a leading index, slicing no lanes)."""
    b, kh, _, h = x.shape
    fmt = Format(x.bits, x.granularity, x.group_size, x.offset is not None, h)
    params = [x.scale] + ([] if x.offset is None else [x.offset])
    if x.granularity == "channel":
        params = [p.reshape(b, kh, fmt.parts, 1, h // fmt.parts) for p in params]
    return fmt, (x.codes, *params)


def check_inputs(op: str, q, k, v, lengths) -> tuple[int, int, int, int, int]:
    """(B, N, K, S, H) of valid inputs, or a one-line `KernelError`."""
    common.check(q.ndim == 3, op, f"q has shape {tuple(q.shape)}, expected [B, N, H]")
    for name, x in (("k", k), ("v", v)):
        common.check(isinstance(x, QuantKV), op, f"{name} must be a QuantKV, got "
                     + (f"an array of shape {tuple(x.shape)}" if hasattr(x, "shape") else type(x).__name__))
        try:
            validate_kv(x)
        except JaxdecError as e:
            raise common.KernelError(f"{op}: {name}: {e}") from None
    b, n, h = q.shape
    kh, s = k.shape[1], k.shape[2]
    common.check(tuple(k.shape) == (b, kh, s, h), op,
                 f"k has logical shape {k.shape}, expected {(b, kh, s, h)} for q {tuple(q.shape)}")
    common.check(tuple(v.shape) == tuple(k.shape), op, f"v has logical shape {v.shape}, k {k.shape}")
    common.check(n % kh == 0, op, f"{n} query heads do not share {kh} kv heads evenly")
    common.check_dtype(op, "q", q, FLOATS)
    common.check_dtype(op, "lengths", lengths, (jnp.int32,))
    common.check_shape(op, "lengths", lengths, (b,))
    return b, n, kh, s, h


def check_kernel_args(op: str, k: QuantKV, v: QuantKV, block_k: int, platform: str) -> None:
    """A one-line `KernelError` unless the kernel of `platform` tiles this head dim and block
    (on the GPU, an int4 half is a dot operand: at least 16 wide)."""
    h = k.head_dim
    common.check_head_dim(op, h, platform)
    common.check_block(op, "block_k", block_k, platform)
    for name, x in (("k", k), ("v", v)):
        common.check(platform != "gpu" or x.bits == 8 or h >= 32, op,
                     f"head_dim={h} with 4-bit {name}: each half must be >= 16 wide for the GPU kernel")


@functools.partial(jax.jit, static_argnames=(
    "implementation", "interpret", "platform", "block_k", "n_splits", "scale", "return_lse"))
def quantized_kv_attention(q, k: QuantKV, v: QuantKV, lengths, *, implementation: str = "pallas",
                           interpret: bool = False, platform: str | None = None, block_k: int = 128,
                           n_splits: int | None = None, scale: float | None = None,
                           return_lse: bool = False):
    """See the module docstring. `block_k` (keys per block) and `n_splits` (GPU split-K
    shares per row and kv head; default: enough to fill the GPU) are static."""
    b, n, kh, s, h = check_inputs(OP, q, k, v, lengths)
    where = common.resolve(OP, implementation, interpret, platform)
    scale = 1.0 / math.sqrt(h) if scale is None else scale
    lengths = jnp.clip(lengths, 0, s)
    if where is None:
        out, lse = reference.quantized_kv_attention(q, k, v, lengths, scale=scale)
    else:
        check_kernel_args(OP, k, v, block_k, where)
        (k_fmt, k_ops), (v_fmt, v_ops) = operands(pad_slots(k, block_k)), operands(pad_slots(v, block_k))
        qg = common.group_queries(q, kh)  # [B, K, G, H] -> split like the key parts:
        qg = jnp.moveaxis(qg.reshape(b, kh, n // kh, k_fmt.parts, h // k_fmt.parts), 3, 2)
        run = dict(k_fmt=k_fmt, v_fmt=v_fmt, scale=scale, block_k=block_k, interpret=interpret)
        if where == "gpu":
            out, lse = gpu.quantized_kv_attention(qg, k_ops, v_ops, lengths, n_splits=n_splits, **run)
        else:
            out, lse = tpu.quantized_kv_attention(qg, k_ops, v_ops, lengths, **run)
        out, lse = out.reshape(b, n, h), lse.reshape(b, n)
    out = out.astype(q.dtype)
    return (out, lse) if return_lse else out


def pad_slots(x: QuantKV, block: int) -> QuantKV:
    """A tensor shorter than one block is padded to one (a copy of at most `block` slots);
    longer ones are used as they are (a partial last block is masked)."""
    s = x.codes.shape[2]
    if s >= block:
        return x
    pad = lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, block - s), (0, 0)))
    if x.granularity == "channel":  # no slot axis in the parameters
        return dataclasses.replace(x, codes=pad(x.codes))
    return dataclasses.replace(x, codes=pad(x.codes), scale=pad(x.scale),
                               offset=None if x.offset is None else pad(x.offset))


def _tensor_bytes(x: QuantKV, slots: int, rows: int) -> int:
    """Bytes of one tensor the kernels read: codes and per-slot parameters of `slots`
    (summed over rows) per kv head, and per-channel parameters once per visited row."""
    b, kh, _, h = x.shape
    params = [x.scale] + ([] if x.offset is None else [x.offset])
    per_slot = x.codes.shape[3] * np.dtype(x.codes.dtype).itemsize
    if x.granularity == "channel":
        fixed = sum(common.nbytes(p.shape[3:], p.dtype) for p in params)
        return kh * (slots * per_slot + rows * fixed)
    per_slot += sum(common.nbytes(p.shape[3:], p.dtype) for p in params)
    return kh * slots * per_slot


def bytes_moved(q, k: QuantKV, v: QuantKV, lengths, *, block_k: int = 128) -> common.Bytes:
    """HBM bytes of one call: q, the codes, scales and offsets of the visible key blocks
    (whole blocks, as the kernels read them; per-channel parameters once per row that
    reads any), the output. `lengths` must be concrete; k, v may hold ShapeDtypeStructs."""
    s = k.shape[2]
    lengths = np.clip(np.asarray(lengths), 0, s)
    slots = int(np.minimum(-(-lengths // block_k) * block_k, s).sum())
    rows = int((lengths > 0).sum())
    kv = _tensor_bytes(k, slots, rows) + _tensor_bytes(v, slots, rows)
    return common.Bytes(read=common.nbytes(q.shape, q.dtype) + kv + 4 * lengths.size,
                        written=common.nbytes(q.shape, q.dtype))
