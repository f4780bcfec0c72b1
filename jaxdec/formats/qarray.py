"""`QArray`: a group-wise quantised weight matrix as a pytree, with its quantisers.

A `QArray` stands for one logical weight W used as `x @ W`: its leading `n_in` dims are
contracted (K = their product), its trailing dims are the output (N = their product). It
is stored flattened to [K, N] with one (scale, offset) pair per group of `group_size`
consecutive rows of one column:

    W[k, n] = f32(q[k, n]) * f32(scale[k // g, n]) + f32(offset[k // g, n])

(the offset term is dropped when `offset` is None). `matmul_reference` is the numerical
truth every kernel is checked against. Letters: K contracted dim, N output dim, G =
ceil(K / g) groups. When g does not divide K the last group has fewer rows: the codes are
stored padded to G * g rows, and every matmul multiplies the padding by zero inputs.

A stack of such matrices (the experts of a MoE layer, [E, D, F]) is one `QArray` with
`n_batch` leading batch dims: every array then has those dims in front, one matrix each.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdec.errors import JaxdecError

F16_MAX = 65504.0
# bits, symmetric -> (lowest code, highest code, code dtype) of the values fed to round().
_CODES = {
    (8, True): (-127, 127, jnp.int8),
    (8, False): (-128, 127, jnp.int8),
    (4, True): (-8, 7, jnp.uint8),   # stored as code + 8 in 0..15; offset = -8 * scale
    (4, False): (0, 15, jnp.uint8),
    (3, True): (-4, 3, jnp.uint8),   # stored as code + 4 in 0..7; offset = -4 * scale
    (3, False): (0, 7, jnp.uint8),
    (2, True): (-2, 1, jnp.uint8),   # stored as code + 2 in 0..3; offset = -2 * scale
    (2, False): (0, 3, jnp.uint8),
}
BITS = (2, 3, 4, 8)
_NIBBLE_SHIFTS = np.array([0, 4], dtype=np.uint8)


@partial(jax.tree_util.register_dataclass, data_fields=["q", "scale", "offset"],
         meta_fields=["bits", "group_size", "shape", "n_in", "n_batch"])
@dataclasses.dataclass(frozen=True)
class QArray:
    """A quantised weight W of logical shape `shape` = (*batch, *in, *out), `n_batch` batch
    dims (0: one matrix) then `n_in` contracted dims, stored as [*batch, K, N] with
    K = prod(in) and N = prod(out).

    Invariants (checked by `validate`, never in the constructor, so that jax can rebuild
    the pytree with placeholder leaves):
    - `bits` is 2, 3, 4 or 8; `shape` is a tuple of positive ints; n_batch >= 0 and
      1 <= n_in < len(shape) - n_batch.
    - `group_size` g is a positive int; for bits=4 it is even. G = ceil(K / g) groups, the
      codes hold Kp = G * g rows: rows K..Kp-1 are padding (the last group's missing rows),
      multiplied by zero inputs in every matmul and dropped by `dequantize`.
    - (shapes below without the batch dims, which every array has in front)
    - bits=8: `q` is int8[Kp, N] (values -128..127; the quantisers write -127..127 when
      symmetric). bits=4: `q` is uint8[Kp // 2, N], two unsigned 4-bit codes per byte packed
      along K: byte (i, n) holds row 2i in its low nibble and row 2i+1 in its high nibble.
      bits=2, 3: `q` is uint8[Kp, N], one code (0..2^bits - 1) per byte, unpacked: these
      widths serve quality studies (GPTQ/AWQ/HQQ at 2-3 bits) and the portable
      dequantise-then-dot path; `bits_per_weight` reports the packed format's size.
    - `scale` is float16[G, N]; `offset` is None or float16[G, N]. The offset is
      the zero point pre-multiplied by the scale (offset = -zero_point * scale, GGUF Q4_1's
      `m`), so dequantisation is one multiply-add in float32 (see the module docstring).
    - Scales may be negative or zero (GGUF Q4_0 blocks have signed scales).
    Leaves may be numpy or jax arrays (or `jax.ShapeDtypeStruct`s under `eval_shape`).
    """

    q: Any               # bits=8: i8[*batch, Kp, N]; bits=4: u8[*batch, Kp // 2, N]; 2, 3: u8[*batch, Kp, N]
    scale: Any           # f16[*batch, G, N]
    offset: Any | None   # f16[*batch, G, N] or None
    bits: int
    group_size: int
    shape: tuple[int, ...]
    n_in: int = 1
    n_batch: int = 0

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return tuple(self.shape[:self.n_batch])

    @property
    def in_shape(self) -> tuple[int, ...]:
        return tuple(self.shape[self.n_batch:self.n_batch + self.n_in])

    @property
    def out_shape(self) -> tuple[int, ...]:
        return tuple(self.shape[self.n_batch + self.n_in:])

    @property
    def k(self) -> int:
        return math.prod(self.in_shape)

    @property
    def n(self) -> int:
        return math.prod(self.out_shape)

    @property
    def n_groups(self) -> int:
        return -(-self.k // self.group_size)

    @property
    def k_padded(self) -> int:
        """Kp: the rows the codes hold, K rounded up to whole groups."""
        return self.n_groups * self.group_size

    @property
    def has_offset(self) -> bool:
        """False only for symmetric int8 (4-bit symmetric stores offset = -8 * scale)."""
        return self.offset is not None

    @property
    def bits_per_weight(self) -> float:
        """Bits per logical weight of the packed format: codes plus f16 scales (and
        offsets), whatever the in-memory layout (2/3-bit codes are held one per byte)."""
        per_group = 16 * (2 if self.offset is not None else 1)
        return (self.bits * self.k_padded + per_group * self.n_groups) / self.k

    @property
    def nbytes(self) -> int:
        """Bytes actually stored: codes, scales and offsets."""
        return stored_bytes(self.q, self.scale, self.offset)


def stored_bytes(*arrays) -> int:
    """Bytes of `arrays` (None: absent), counted from shapes and dtypes, so abstract
    `ShapeDtypeStruct`s count as their arrays would (quantised weights and KV caches)."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in arrays if x is not None)


def _fail(msg: str):
    raise JaxdecError(f"invalid QArray: {msg}")


def check_array(name: str, x: Any, dtypes, shape: tuple[int, ...], fail=None):
    """`fail(message)` (default: an invalid-QArray error) unless x is an array of one of
    `dtypes` (a dtype or a tuple of them) and of `shape`. Shared with the quantised KV
    cache's `validate_kv`."""
    fail = fail or _fail
    dtypes = tuple(np.dtype(d) for d in (dtypes if isinstance(dtypes, tuple) else (dtypes,)))
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        fail(f"{name} is a {type(x).__name__}, not an array")
    if np.dtype(x.dtype) not in dtypes:
        fail(f"{name} has dtype {np.dtype(x.dtype).name}, expected {' or '.join(d.name for d in dtypes)}")
    if tuple(x.shape) != shape:
        fail(f"{name} has shape {tuple(x.shape)}, expected {shape}")


_check_array = check_array  # (the name the checks below use)


def _check_meta(qa: QArray):
    if qa.bits not in BITS:
        _fail(f"bits={qa.bits!r}, expected one of {BITS}")
    shape = qa.shape
    if not isinstance(shape, tuple) or not all(isinstance(d, int) and d > 0 for d in shape):
        _fail(f"shape {shape!r} is not a tuple of positive ints")
    nb = qa.n_batch
    if not isinstance(nb, int) or not 0 <= nb < len(shape) - 1:
        _fail(f"n_batch={nb!r} must be in [0, {len(shape) - 2}] for shape {shape}")
    if not isinstance(qa.n_in, int) or not 1 <= qa.n_in < len(shape) - nb:
        _fail(f"n_in={qa.n_in!r} must be in [1, {len(shape) - nb - 1}] for shape {shape}")
    g = qa.group_size
    if not isinstance(g, int) or g <= 0:
        _fail(f"group_size={g!r} is not a positive int")
    if qa.bits == 4 and g % 2:
        _fail(f"group_size={g} must be even for 4-bit packing")


def validate(qa: QArray) -> QArray:
    """Check every invariant of the class docstring; raise `JaxdecError` naming the first
    broken one. Works on concrete arrays, tracers and ShapeDtypeStructs. Returns `qa`."""
    if not isinstance(qa, QArray):
        _fail(f"expected a QArray, got {type(qa).__name__}")
    _check_meta(qa)
    kp, n, groups, b = qa.k_padded, qa.n, qa.n_groups, qa.batch_shape
    if qa.bits == 8:
        _check_array("q", qa.q, np.int8, (*b, kp, n))
    else:
        _check_array("q", qa.q, np.uint8, (*b, kp // 2 if qa.bits == 4 else kp, n))
    _check_array("scale", qa.scale, np.float16, (*b, groups, n))
    if qa.offset is not None:
        _check_array("offset", qa.offset, np.float16, (*b, groups, n))
    return qa


# ---- 4-bit packing --------------------------------------------------------------------------
def pack_int4(codes):
    """u8[K, ...] codes in 0..15 -> u8[K // 2, ...]: row 2i in the low nibble, 2i+1 high.
    Works on numpy arrays (returns numpy) and jax arrays (returns jax)."""
    if codes.shape[0] % 2:
        raise JaxdecError(f"pack_int4: leading dim {codes.shape[0]} is odd")
    pairs = codes.astype(np.uint8).reshape(codes.shape[0] // 2, 2, *codes.shape[1:])
    return (pairs[:, 0] & 0x0F) | (pairs[:, 1] << 4)


def unpack_int4(q):
    """u8[K // 2, ...] -> u8[K, ...], the inverse of `pack_int4` (numpy or jax, like it)."""
    shifts = _NIBBLE_SHIFTS.reshape(1, 2, *([1] * (q.ndim - 1)))
    codes = (q[:, None] >> shifts) & 0x0F
    return codes.reshape(2 * q.shape[0], *q.shape[1:])


# ---- dequantisation -------------------------------------------------------------------------
def dequantize_rows(q, scale, offset, bits: int, group_size: int):
    """q: i8[K, ...], u8[K // 2, ...] (4-bit) or u8[K, ...] (2, 3-bit); scale/offset:
    f16[G, ...] -> f32[K, ...]."""
    codes = unpack_int4(q) if bits == 4 else q
    k, rest = codes.shape[0], codes.shape[1:]
    codes = jnp.asarray(codes).astype(jnp.float32).reshape(k // group_size, group_size, *rest)
    w = codes * jnp.asarray(scale).astype(jnp.float32)[:, None]
    if offset is not None:
        w = w + jnp.asarray(offset).astype(jnp.float32)[:, None]
    return w.reshape(k, *rest)


def dequantize(qa: QArray, dtype=jnp.float32) -> jax.Array:
    """The logical weight, shape `qa.shape`, computed in float32 then cast to `dtype` (the
    padding rows of a short last group dropped)."""
    one = lambda q, s, o: dequantize_rows(q, s, o, qa.bits, qa.group_size)[:qa.k]
    for _ in range(qa.n_batch):
        one = jax.vmap(one, in_axes=(0, 0, None if qa.offset is None else 0))
    return one(qa.q, qa.scale, qa.offset).reshape(qa.shape).astype(dtype)


def select(qa: QArray, idx) -> QArray:
    """The matrices `idx` (i32[S]) of a stack (n_batch = 1): a stack of S. Only their
    codes and scales are gathered (a decoding MoE step reads only its tokens' experts)."""
    if qa.n_batch != 1:
        raise JaxdecError(f"select needs a stack of matrices (n_batch=1), not n_batch={qa.n_batch}")
    take = lambda a: None if a is None else jnp.take(jnp.asarray(a), idx, axis=0)
    return QArray(q=take(qa.q), scale=take(qa.scale), offset=take(qa.offset), bits=qa.bits,
                  group_size=qa.group_size, shape=(int(idx.shape[0]), *qa.shape[1:]),
                  n_in=qa.n_in, n_batch=1)


def pad_input(x, qa: QArray):
    """x[..., K] -> x[..., Kp], zeros after K: the padding rows of a short last group then
    add nothing to x @ W."""
    extra = qa.k_padded - qa.k
    if not extra:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def _single(qa: QArray, what: str) -> None:
    if qa.n_batch:
        raise JaxdecError(f"{what} takes one matrix, not a stack of {qa.batch_shape} "
                          "(an expert stack goes through `jaxdec.ops.qmatmul.expert_matmul`)")


def matmul_reference(x, qa: QArray) -> jax.Array:
    """x[..., K] @ W -> f32[..., N]: dequantise, then one float32 dot at highest precision.
    The portable path and the numerical truth for the quantised-matmul kernels."""
    validate(qa)
    _single(qa, "matmul_reference")
    x = jnp.asarray(x)
    if x.shape[-1] != qa.k:
        raise JaxdecError(f"matmul_reference: x has {x.shape[-1]} features, QArray K={qa.k}")
    w = dequantize_rows(qa.q, qa.scale, qa.offset, qa.bits, qa.group_size)[:qa.k]  # f32[K, N]
    return jnp.dot(x.astype(jnp.float32), w,
                   precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def take_columns(qa: QArray, idx) -> jax.Array:
    """W[:, idx] over the flattened N axis -> f32[K, *idx.shape], dequantising only those
    columns (a tied-embedding lookup from a quantised LM head [D, V])."""
    _single(qa, "take_columns")
    idx = jnp.asarray(idx)
    offset = None if qa.offset is None else jnp.asarray(qa.offset)[:, idx]
    return dequantize_rows(jnp.asarray(qa.q)[:, idx], jnp.asarray(qa.scale)[:, idx], offset,
                           qa.bits, qa.group_size)[:qa.k]


# ---- quantisation ---------------------------------------------------------------------------
def _f16_toward(x, up: bool):
    """float32 -> the nearest float16 on one side (>= x when up, <= x when down), clamped
    to the finite float16 range."""
    x16 = x.astype(jnp.float16)
    back = x16.astype(jnp.float32)
    wrong = back < x if up else back > x
    target = jnp.float16(jnp.inf if up else -jnp.inf)
    x16 = jnp.where(wrong, jnp.nextafter(x16, target), x16)
    return jnp.clip(x16, -F16_MAX, F16_MAX).astype(jnp.float16)


def _symmetric_scale(groups, lo: int, hi: int):
    """f32[G, g, N] -> f16[G, N] with every w / scale in [lo, hi] before rounding; rounded
    up to float16 so that holds for the stored scale."""
    top = jnp.maximum(groups.max(axis=1) / hi, groups.min(axis=1) / lo)
    top = jnp.maximum(top, 0.0)
    if hi < 127:  # 2-4 bits: keep offset = lo * scale finite in float16
        top = jnp.minimum(top, F16_MAX / -lo)
    return _f16_toward(top, up=True)


def _asymmetric_params(groups, lo: int, hi: int):
    """f32[G, g, N] -> (scale, offset) f16[G, N]. The offset is rounded down to float16
    first, then the scale (rounded up) is chosen to cover [min, max] from that offset."""
    gmin, gmax = groups.min(axis=1), groups.max(axis=1)
    ideal = (gmax - gmin) / (hi - lo)
    offset = _f16_toward(gmin - lo * ideal, up=False)
    off32 = offset.astype(jnp.float32)
    span = (gmax - off32) / hi
    if lo < 0:
        span = jnp.maximum(span, (gmin - off32) / lo)
    return _f16_toward(jnp.maximum(span, 0.0), up=True), offset


def quantize(w, *, bits: int, group_size: int = 32, symmetric: bool | None = None,
             n_in: int = 1, n_batch: int = 0) -> QArray:
    """Round-to-nearest group-wise quantisation of a float weight of logical shape w.shape
    (after `n_batch` leading batch dims, each index its own matrix, its next `n_in` dims
    contracted). `w` must lie inside float16's finite range (|w| < 65504): scales and
    offsets are stored as float16. Pure jnp: jit it with the keywords static.

    - bits=8, symmetric (default): scale = absmax / 127, q in -127..127, no offset.
    - bits=8, asymmetric: q in -128..127 with an offset.
    - bits=4, asymmetric (default, GGUF Q4_1-like): q in 0..15, offset ~ group min.
    - bits=4, symmetric (GGUF Q4_0-like): q = round(w / scale) + 8, offset = -8 * scale.
    - bits=2, 3: as bits=4 (asymmetric by default), one unpacked u8 code per weight.
    Scales are computed in float32 and rounded UP to float16 (offsets down, for the
    asymmetric case) before q is computed, so |dequantize(qa) - w| <= stored scale / 2 up
    to float32 rounding. A zero scale (constant group) gives q = 0, never NaN. Groups whose
    scale would overflow float16 are clamped (finite, but then outside that bound). When
    `group_size` does not divide K the last group covers the K % group_size rows left (its
    range is theirs: the padding rows repeat the last row).
    """
    shape = tuple(int(d) for d in jnp.shape(w))
    symmetric = (bits == 8) if symmetric is None else bool(symmetric)
    k, n = _check_quantize_args(shape, bits, group_size, n_in, n_batch)
    one = partial(_quantize_matrix, bits=bits, group_size=group_size, symmetric=symmetric)
    for _ in range(n_batch):
        one = jax.vmap(one)
    q, scale, offset = one(jnp.asarray(w).astype(jnp.float32).reshape(*shape[:n_batch], k, n))
    return validate(QArray(q=q, scale=scale, offset=offset, bits=bits, group_size=group_size,
                           shape=shape, n_in=n_in, n_batch=n_batch))


def _quantize_matrix(w, *, bits: int, group_size: int, symmetric: bool):
    """f32[K, N] -> (codes, scale, offset) of `quantize` (padded to whole groups)."""
    k, n = w.shape
    kp = -(-k // group_size) * group_size
    if kp > k:
        w = jnp.pad(w, ((0, kp - k), (0, 0)), mode="edge")
    lo, hi, code_dtype = _CODES[(bits, symmetric)]
    groups = w.reshape(kp // group_size, group_size, n)
    if symmetric:
        scale = _symmetric_scale(groups, lo, hi)
        codes = _round_codes(groups, scale, None, lo, hi)
        offset = None if bits == 8 else (scale.astype(jnp.float32) * lo).astype(jnp.float16)
    else:
        scale, offset = _asymmetric_params(groups, lo, hi)
        codes = _round_codes(groups, scale, offset, lo, hi)
    codes = codes.reshape(kp, n)
    if bits < 8:
        codes = codes - lo  # 0..2^bits - 1 (lo is 0 when asymmetric)
    if bits == 4:
        codes = pack_int4(codes)
    return codes.astype(code_dtype), scale, offset


def from_codes(codes, scale, offset, *, bits: int, group_size: int, shape: tuple[int, ...],
               n_in: int = 1) -> QArray:
    """A `QArray` from unpacked codes u8[K, N] in 0..2^bits - 1 (bits 2-4; i8 for 8), or
    [Kp, N] with the padding rows of a short last group, and per-group scale/offset
    [G, N] (float16-representable; cast here): the constructor that calibrated quantisers
    (GPTQ, AWQ, HQQ) build their results with."""
    k, n = _check_quantize_args(tuple(shape), bits, group_size, n_in)
    kp = -(-k // group_size) * group_size
    codes = np.asarray(codes)
    codes = codes.reshape(codes.size // n, n)[:k]
    if codes.shape[0] != k:
        raise JaxdecError(f"from_codes: {codes.shape[0]} rows of codes for K={k}")
    codes = np.pad(codes, ((0, kp - k), (0, 0)))
    if bits == 4:
        codes = pack_int4(codes.astype(np.uint8))
    code_dtype = np.int8 if bits == 8 else np.uint8
    as16 = lambda a: None if a is None else np.asarray(a, np.float32).astype(np.float16)
    return validate(QArray(q=codes.astype(code_dtype), scale=as16(scale), offset=as16(offset),
                           bits=bits, group_size=group_size, shape=tuple(shape), n_in=n_in))


def _check_quantize_args(shape: tuple[int, ...], bits: int, group_size: int, n_in: int,
                         n_batch: int = 0) -> tuple[int, int]:
    """(K, N) for a weight of logical `shape`, or a JaxdecError naming the bad argument."""
    if bits not in BITS:
        raise JaxdecError(f"quantize: bits={bits!r}, expected one of {BITS}")
    if not 0 <= n_batch < len(shape) - 1:
        raise JaxdecError(f"quantize: n_batch={n_batch} must be in [0, {len(shape) - 2}] for {shape}")
    if not 1 <= n_in < len(shape) - n_batch:
        raise JaxdecError(f"quantize: n_in={n_in} must be in [1, {len(shape) - n_batch - 1}] "
                          f"for {shape}")
    k, n = math.prod(shape[n_batch:n_batch + n_in]), math.prod(shape[n_batch + n_in:])
    if not isinstance(group_size, (int, np.integer)) or group_size <= 0 or (bits == 4 and group_size % 2):
        raise JaxdecError(f"quantize: group_size={group_size} must be a positive int"
                          + (" and even for 4 bits" if bits == 4 else ""))
    return k, n


def _round_codes(groups, scale, offset, lo: int, hi: int):
    """f32[G, g, N] -> i32 codes round((w - offset) / scale) in [lo, hi], against the
    stored f16 scale and offset (None: no offset)."""
    x = groups if offset is None else groups - offset.astype(jnp.float32)[:, None]
    s = scale.astype(jnp.float32)[:, None]
    return jnp.clip(jnp.round(x / jnp.where(s == 0, 1.0, s)), lo, hi).astype(jnp.int32)
