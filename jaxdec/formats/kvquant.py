"""`QuantKV`: a quantised K or V cache tensor as a pytree, with its quantiser and writer
(the format of the int8/int4 cache kinds, `jaxdec.cache.quantized`).

A `QuantKV` stands for one float tensor X of logical shape [B, K, S, H] (rows, kv heads,
slots, head dim). Each slot holds integer codes plus a (scale, offset) pair per group of
channels, in one of three granularities:

    token    one pair per token and kv head             scale [B, K, S, 1]
    group    one pair per token and `group_size` channels  scale [B, K, S, H // group_size]
    channel  one pair per channel and kv head, shared by all tokens (KIVI-style keys):
             fixed when the tensor is quantised (at prefill), new tokens are written
             against it, clipped to the code range       scale [B, K, 1, H]

    X[b, k, s, c] = f32(code[b, k, s, c]) * f32(scale[.., c // g]) + f32(offset[.., c // g])

(the offset term is dropped when `offset` is None, symmetric int8). 4-bit codes are packed
two per byte "half-split": byte j of a slot holds channel j in its low nibble and channel
j + H/2 in its high nibble, so unpacking yields the two halves of the head with no lane
interleave (what the attention kernels want). `dequantize_kv` is the numerical truth.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdec.errors import JaxdecError
from jaxdec.formats.qarray import check_array, stored_bytes

GRANULARITIES = ("token", "group", "channel")
SCALE_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))
# bits, symmetric -> (lowest, highest) code fed to round(); 4-bit symmetric codes are stored
# as code + 8 in 0..15 with offset = -8 * scale, so every 4-bit tensor has an offset.
_CODES = {(8, True): (-127, 127), (8, False): (-128, 127), (4, True): (-8, 7), (4, False): (0, 15)}



def put_rows(buf: jax.Array, new: jax.Array, slots: jax.Array, axis: int) -> jax.Array:
    """Row b of `new` ([B, T, ...]) into row b of `buf` at `slots[b]` (i32[B, T]) along
    `axis` of a row, where the T new entries take the place of that axis. The rows are a
    scatter batch dimension (vmap), so a mesh that splits the batch scatters each row where
    it lives, with no gathered indices. (Every cache kind writes its slots with it.)"""
    def one(b, n, s):
        index = (slice(None),) * axis + (s,)
        return b.at[index].set(jnp.moveaxis(n, 0, axis).astype(b.dtype), mode="promise_in_bounds")
    return jax.vmap(one)(buf, new, slots)


def take_rows(buf: jax.Array, slots: jax.Array, axis: int) -> jax.Array:
    """Row b of `buf` at `slots[b]` (i32[B, P]) along `axis` of a row -> [B, P, ...]."""
    return jax.vmap(lambda b, s: jnp.moveaxis(jnp.take(b, s, axis=axis), axis, 0))(buf, slots)


@partial(jax.tree_util.register_dataclass, data_fields=["codes", "scale", "offset"],
         meta_fields=["bits", "granularity", "group_size"])
@dataclasses.dataclass(frozen=True)
class QuantKV:
    """A quantised K or V tensor of logical shape [B, K, S, H].

    Invariants (checked by `validate_kv`, never in the constructor, so that jax can rebuild
    the pytree with placeholder leaves):
    - `bits` is 4 or 8; `granularity` is "token", "group" or "channel".
    - bits=8: `codes` is int8[B, K, S, H]. bits=4: `codes` is uint8[B, K, S, H // 2],
      packed half-split (see the module docstring); H is even.
    - `group_size` is H for "token", 0 for "channel", and for "group" a positive g dividing
      H (and H // 2 when bits=4, so that no group straddles the two nibble halves).
    - `scale` is float32 or bfloat16, of shape [B, K, S, 1] (token), [B, K, S, H // g]
      (group) or [B, K, 1, H] (channel). `offset` has the same shape and dtype, or is None
      (symmetric int8 only: a 4-bit tensor always has one). The offset is the zero point
      pre-multiplied by the scale (offset = -zero_point * scale), as in `QArray`.
    - Scales may be zero (a constant group); codes then are 0 and X is the offset.
    Leaves may be numpy or jax arrays (or `jax.ShapeDtypeStruct`s under `eval_shape`).
    """

    codes: Any           # bits=8: i8[B, K, S, H]; bits=4: u8[B, K, S, H // 2]
    scale: Any           # f32|bf16[B, K, S, 1 | H // g] or [B, K, 1, H]
    offset: Any | None   # like scale, or None
    bits: int
    granularity: str
    group_size: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The logical [B, K, S, H]."""
        b, kh, s, hc = self.codes.shape
        return b, kh, s, hc * (2 if self.bits == 4 else 1)

    @property
    def head_dim(self) -> int:
        return self.shape[3]

    @property
    def symmetric(self) -> bool:
        """True only for int8 without offset (what `write_kv` quantises new tokens as)."""
        return self.offset is None

    @property
    def nbytes(self) -> int:
        """Bytes actually stored: codes, scales and offsets."""
        return stored_bytes(self.codes, self.scale, self.offset)


def _fail(msg: str):
    raise JaxdecError(f"invalid QuantKV: {msg}")


def _check_array(name: str, x: Any, dtypes, shape: tuple[int, ...]):
    check_array(name, x, tuple(dtypes), shape, fail=_fail)


def param_shape(b: int, kh: int, s: int, h: int, granularity: str, group_size: int) -> tuple:
    """The shape of the scale (and offset) of a [B, K, S, H] tensor."""
    if granularity == "channel":
        return b, kh, 1, h
    return b, kh, s, h // group_size


def _check_format(bits, granularity, group_size, h: int, who: str = "invalid QuantKV"):
    """A one-line `JaxdecError` "who: ..." unless (bits, granularity, group_size) is a
    format for head dim h."""
    def fail(msg):
        raise JaxdecError(f"{who}: {msg}")

    if bits not in (4, 8):
        fail(f"bits={bits!r}, expected 4 or 8")
    if granularity not in GRANULARITIES:
        fail(f"granularity={granularity!r}, expected one of {GRANULARITIES}")
    want = {"token": h, "channel": 0}.get(granularity)
    if want is not None and group_size != want:
        fail(f"group_size={group_size!r} for granularity {granularity!r}, expected {want}")
    span = h // 2 if bits == 4 else h
    if granularity == "group" and (not isinstance(group_size, int) or group_size <= 0
                                   or span % group_size):
        fail(f"group_size={group_size!r} must divide {span}"
             + (" (half the head dim, for 4-bit)" if bits == 4 else ""))


def validate_kv(qkv: QuantKV) -> QuantKV:
    """Check every invariant of the class docstring; raise `JaxdecError` naming the first
    broken one. Works on concrete arrays, tracers and ShapeDtypeStructs. Returns `qkv`."""
    if not isinstance(qkv, QuantKV):
        _fail(f"expected a QuantKV, got {type(qkv).__name__}")
    codes = qkv.codes
    if not hasattr(codes, "shape") or len(codes.shape) != 4:
        _fail(f"codes must be a 4-d array [B, K, S, H], got {getattr(codes, 'shape', codes)!r}")
    _check_format(qkv.bits, qkv.granularity, qkv.group_size, qkv.head_dim)
    _check_array("codes", codes, [np.int8 if qkv.bits == 8 else np.uint8], tuple(codes.shape))
    shape = param_shape(*qkv.shape, qkv.granularity, qkv.group_size)
    _check_array("scale", qkv.scale, SCALE_DTYPES, shape)
    if qkv.offset is None:
        if qkv.bits == 4:
            _fail("offset is None, but 4-bit codes are unsigned and need one")
    else:
        _check_array("offset", qkv.offset, [qkv.scale.dtype], shape)
    return qkv


# ---- 4-bit packing (half-split) ----------------------------------------------------------------
def pack_halves(codes):
    """u8[..., H] codes in 0..15 -> u8[..., H // 2]: channel j low, channel j + H/2 high."""
    half = codes.shape[-1] // 2
    codes = codes.astype(jnp.uint8)
    return (codes[..., :half] & 0x0F) | (codes[..., half:] << 4)


def unpack_halves(packed):
    """u8[..., H // 2] -> u8[..., H], the inverse of `pack_halves`."""
    return jnp.concatenate([packed & 0x0F, packed >> 4], axis=-1)


# ---- dequantisation --------------------------------------------------------------------------
def _expand(p, qkv: QuantKV):
    """A scale/offset broadcastable against the logical [B, K, S, H] tensor."""
    p = jnp.asarray(p).astype(jnp.float32)
    return jnp.repeat(p, qkv.group_size, axis=-1) if qkv.granularity == "group" else p


def dequantize_kv(qkv: QuantKV) -> jax.Array:
    """The logical tensor f32[B, K, S, H]."""
    validate_kv(qkv)
    codes = jnp.asarray(qkv.codes)
    codes = unpack_halves(codes) if qkv.bits == 4 else codes
    x = codes.astype(jnp.float32) * _expand(qkv.scale, qkv)
    return x if qkv.offset is None else x + _expand(qkv.offset, qkv)


# ---- quantisation ----------------------------------------------------------------------------
def _toward(x, dtype, up: bool):
    """float32 -> the nearest `dtype` value on one side (>= x when up, <= x when down)."""
    xd = x.astype(dtype)
    back = xd.astype(jnp.float32)
    wrong = back < x if up else back > x
    return jnp.where(wrong, jnp.nextafter(xd, jnp.array(jnp.inf if up else -jnp.inf, dtype)), xd)


def _fit(x, axis: int, lo: int, hi: int, symmetric: bool, dtype):
    """Round-to-nearest (scale, offset) over `axis` of f32 x (kept as a size-1 axis):
    scales rounded up to `dtype`, offsets down first, so every (x - offset) / scale lies in
    [lo, hi] against the stored values. A constant group gets scale 0 (or the smallest
    that covers the offset's rounding), never NaN."""
    gmin, gmax = x.min(axis=axis, keepdims=True), x.max(axis=axis, keepdims=True)
    if symmetric:
        scale = _toward(jnp.maximum(jnp.maximum(gmax / hi, gmin / lo), 0.0), dtype, up=True)
        return scale, None
    offset = _toward(gmin - lo * (gmax - gmin) / (hi - lo), dtype, up=False)
    off = offset.astype(jnp.float32)
    span = (gmax - off) / hi
    if lo < 0:
        span = jnp.maximum(span, (gmin - off) / lo)
    return _toward(jnp.maximum(span, 0.0), dtype, up=True), offset


def _encode(x, scale, offset, lo: int, hi: int):
    """i32 codes round((x - offset) / scale) clipped to [lo, hi] (a zero scale gives 0)."""
    x = x if offset is None else x - offset.astype(jnp.float32)
    s = scale.astype(jnp.float32)
    return jnp.clip(jnp.round(x / jnp.where(s == 0, 1.0, s)), lo, hi).astype(jnp.int32)


def _store(codes, scale, offset, lo: int, bits: int):
    """Codes as stored: int8, or 4-bit shifted to 0..15 (offset absorbing the shift) and packed."""
    if bits == 8:
        return codes.astype(jnp.int8), offset
    if lo:  # symmetric 4-bit: code + 8 with offset = -8 * scale (exact in float)
        offset = (scale.astype(jnp.float32) * lo).astype(scale.dtype)
    return pack_halves(codes - lo), offset


def _format(granularity: str, group_size: int, h: int) -> int:
    """The stored `group_size` of a format: H (token), 0 (channel) or the given g."""
    return {"token": h, "channel": 0}.get(granularity, group_size)


def quantize_kv(x, *, bits: int, granularity: str = "group", group_size: int = 32,
                symmetric: bool | None = None, scale_dtype=jnp.float32) -> QuantKV:
    """Round-to-nearest quantisation of x f[B, K, S, H] (per-group min/max).

    - bits=8, symmetric (default): scale = absmax / 127, codes in -127..127, no offset.
    - bits=8, asymmetric: codes in -128..127 with an offset.
    - bits=4, asymmetric (default): codes in 0..15, offset ~ group min.
    - bits=4, symmetric: codes round(x / scale) + 8, offset = -8 * scale.
    `group_size` is used by "group" only ("token" groups the whole head, "channel" every
    token of one channel). Scales are rounded up to `scale_dtype` (offsets down) before the
    codes are computed, so |dequantize_kv(q) - x| <= scale / 2 up to float32 rounding.
    Pure jnp: jit it with the keywords static.
    """
    symmetric = (bits == 8) if symmetric is None else bool(symmetric)
    if len(jnp.shape(x)) != 4:
        raise JaxdecError(f"quantize_kv: x has shape {jnp.shape(x)}, expected [B, K, S, H]")
    b, kh, s, h = (int(d) for d in jnp.shape(x))
    group_size = _format(granularity, group_size, h)
    _check_format(bits, granularity, group_size, h, "quantize_kv")
    if np.dtype(scale_dtype) not in SCALE_DTYPES:
        raise JaxdecError(f"quantize_kv: scale_dtype {np.dtype(scale_dtype).name}, expected "
                          "float32 or bfloat16")
    lo, hi = _CODES[(bits, symmetric)]
    x = jnp.asarray(x).astype(jnp.float32)
    if granularity != "channel":
        x = x.reshape(b, kh, s, h // group_size, group_size)
    axis = 2 if granularity == "channel" else 4
    scale, offset = _fit(x, axis, lo, hi, symmetric, scale_dtype)
    codes = _encode(x, scale, offset, lo, hi).reshape(b, kh, s, h)
    shape = param_shape(b, kh, s, h, granularity, group_size)
    scale = scale.reshape(shape)
    offset = None if offset is None else offset.reshape(shape)
    codes, offset = _store(codes, scale, offset, lo, bits)
    return validate_kv(QuantKV(codes=codes, scale=scale, offset=offset, bits=bits,
                               granularity=granularity, group_size=group_size))


def _check_write(qkv: QuantKV, new, slots):
    """A one-line `JaxdecError` unless new is [B, T, K, H] and slots [B, T] for `qkv`, with
    concrete slots in [0, S)."""
    b, kh, s, h = qkv.shape
    t = new.shape[1] if new.ndim == 4 else -1
    if tuple(new.shape) != (b, t, kh, h) or tuple(slots.shape) != (b, t):
        raise JaxdecError(f"write_kv: new {tuple(new.shape)} and slots {tuple(slots.shape)} do not "
                          f"fit a [B={b}, K={kh}, S, H={h}] tensor (expected [B, T, K, H] and [B, T])")
    if isinstance(slots, jax.core.Tracer):
        return
    slots = np.asarray(slots)
    if slots.size and (slots.min() < 0 or slots.max() >= s):
        raise JaxdecError(f"write_kv: slots {slots.min()}..{slots.max()} outside [0, {s}) "
                          "(the cache sends padding to its scratch slot)")


def quantize_like(qkv: QuantKV, x) -> QuantKV:
    """x f[B, K, T, H] quantised in the "token" or "group" format of `qkv` (its bits,
    groups, symmetry and scale dtype): the new tokens a cache writes."""
    return quantize_kv(x, bits=qkv.bits, granularity=qkv.granularity, group_size=qkv.group_size,
                       symmetric=qkv.bits == 8 and qkv.symmetric, scale_dtype=qkv.scale.dtype)


def write_kv(qkv: QuantKV, new, slots) -> QuantKV:
    """`qkv` with new tokens f[B, T, K, H] quantised in its format and scattered into
    `slots` i32[B, T] along S (in bounds: the cache sends padding to its scratch slot;
    concrete slots are checked). "token"/"group": the new tokens get their own scales,
    symmetric iff `qkv.offset` is None (a 4-bit tensor's new tokens are asymmetric: the
    same format). "channel": they are coded against the stored per-channel scale and
    offset, clipped to the code range."""
    validate_kv(qkv)
    _check_write(qkv, new, slots)
    x = jnp.swapaxes(jnp.asarray(new), 1, 2).astype(jnp.float32)  # [B, K, T, H]
    put = lambda buf, part: put_rows(buf, jnp.swapaxes(part, 1, 2), slots, 1)
    if qkv.granularity == "channel":
        lo, hi = (0, 15) if qkv.bits == 4 else _CODES[(8, qkv.symmetric)]
        codes, _ = _store(_encode(x, qkv.scale, qkv.offset, lo, hi), qkv.scale, qkv.offset, 0, qkv.bits)
        return dataclasses.replace(qkv, codes=put(qkv.codes, codes))
    part = quantize_like(qkv, x)
    offset = None if qkv.offset is None else put(qkv.offset, part.offset)
    return dataclasses.replace(qkv, codes=put(qkv.codes, part.codes),
                               scale=put(qkv.scale, part.scale), offset=offset)


def empty_kv(batch: int, k_heads: int, slots: int, head_dim: int, *, bits: int,
             granularity: str = "group", group_size: int = 32, scale_dtype=jnp.float32,
             symmetric: bool | None = None) -> QuantKV:
    """An all-zero tensor of logical shape [batch, k_heads, slots, head_dim]: codes, scales
    and offsets 0, except "channel" scales, 1 (offset 0) until the tensor is quantised."""
    symmetric = (bits == 8) if symmetric is None else bool(symmetric)
    group_size = _format(granularity, group_size, head_dim)
    _check_format(bits, granularity, group_size, head_dim, "empty_kv")
    codes = jnp.zeros((batch, k_heads, slots, head_dim // (8 // bits)),
                      jnp.int8 if bits == 8 else jnp.uint8)
    shape = param_shape(batch, k_heads, slots, head_dim, granularity, group_size)
    scale = (jnp.ones if granularity == "channel" else jnp.zeros)(shape, scale_dtype)
    offset = None if bits == 8 and symmetric else jnp.zeros(shape, scale_dtype)
    return validate_kv(QuantKV(codes=codes, scale=scale, offset=offset, bits=bits,
                               granularity=granularity, group_size=group_size))


def kv_bytes_per_token(head_dim: int, *, bits: int, granularity: str = "group",
                       group_size: int = 32, scale_dtype=jnp.float32,
                       symmetric: bool | None = None) -> int:
    """Bytes stored per token per kv head: codes plus the per-token scales and offsets
    ("channel" parameters are per tensor, not per token, and count 0)."""
    symmetric = (bits == 8) if symmetric is None else bool(symmetric)
    group_size = _format(granularity, group_size, head_dim)
    _check_format(bits, granularity, group_size, head_dim, "kv_bytes_per_token")
    params = 0 if granularity == "channel" else head_dim // group_size
    pairs = 1 if bits == 8 and symmetric else 2
    return head_dim * bits // 8 + params * pairs * np.dtype(scale_dtype).itemsize

