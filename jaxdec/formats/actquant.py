"""`ActQuant`: a linear weight whose input activations are quantised at run time.

The activation side of W8A8 / W4A4 methods (ZeroQuant, LLM.int8(), SmoothQuant, KurTail)
as a pytree wrapper around a weight, so that a method stays a weight transform
(`params -> params`) and `layers.linear` dispatches on the type. For an input x [M, K]:

    x <- x * in_scale                       (per input feature; optional: SmoothQuant/AWQ
                                             scales that could not be folded upstream)
    x <- block_hadamard(x, rotate)          (optional: an online rotation, KurTail/QuaRot's
                                             down-projection input; `w` holds H^T W)
    x <- fake_quant_tokens(x, act_bits)     (per-token symmetric absmax, dynamic), except
                                             for the input features with some |x| >=
                                             `outlier_threshold` in this call, which stay
                                             in float (LLM.int8()'s mixed decomposition);
                                             act_bits None: x stays in float
    y  = x @ w                              (`w` an array or a `QArray`)

and optionally the OUTPUT y [M, N] is fake-quantised too (`quantize_output`: the KV cache
of a W4A4KV4 method, on the key and value projections), per token and per group of
`out_group` consecutive outputs (one attention head):

    y <- y + out_shift                      (optional: the bias added after the matmul,
                                             Qwen2's bk/bv, so that what is quantised is
                                             what the cache would hold)
    y <- block_hadamard(y, out_rotate)      (optional: QuaRot's online Hadamard of the
                                             head dim, within each group)
    y <- fake_quant_tokens(y, out_bits)     (per token and group, symmetric absmax)
    y <- block_hadamard(y, out_rotate) - out_shift   (H is its own inverse: undone)

The activations are fake-quantised (quantise, dequantise, float matmul): it measures the
methods' quality exactly, not their integer-kernel speed.
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

ACT_BITS = (4, 8)


@partial(jax.tree_util.register_dataclass, data_fields=["w", "in_scale", "out_shift"],
         meta_fields=["act_bits", "outlier_threshold", "rotate", "out_bits", "out_group",
                      "out_rotate"])
@dataclasses.dataclass(frozen=True)
class ActQuant:
    """Weight `w` [*in, *out] whose input is quantised to `act_bits` (4 or 8; None: not
    quantised) per token, and whose output optionally to `out_bits` per token and group.

    Invariants (`validate`): `in_scale` is None or f32[K] (K = the product of the contracted
    axes, which `layers.linear` gets from `w`); `rotate` is None or a power of two dividing
    K; `outlier_threshold` is None or > 0. With N = the product of the output axes:
    `out_bits` is None or 4 or 8; `out_group` is None (one group of N) or divides N;
    `out_rotate` is None or a power of two dividing the group; `out_shift` is None or f32[N].
    """

    w: Any                           # [*in, *out] array or QArray
    in_scale: Any | None             # f32[K] or None
    act_bits: int = 8
    outlier_threshold: float | None = None
    rotate: int | None = None
    out_shift: Any | None = None     # f32[N] or None
    out_bits: int | None = None
    out_group: int | None = None
    out_rotate: int | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.w.shape)

    @property
    def n_in(self) -> int | None:
        return getattr(self.w, "n_in", None)


def validate(a: ActQuant, k: int) -> ActQuant:
    """Check `a`'s invariants for K = k contracted features; raise JaxdecError."""
    if a.act_bits is not None and a.act_bits not in ACT_BITS:
        raise JaxdecError(f"ActQuant: act_bits={a.act_bits!r}, expected one of {ACT_BITS} or None")
    if a.in_scale is not None and tuple(a.in_scale.shape) != (k,):
        raise JaxdecError(f"ActQuant: in_scale has shape {tuple(a.in_scale.shape)}, expected ({k},)")
    if a.rotate is not None and (a.rotate & (a.rotate - 1) or k % a.rotate):
        raise JaxdecError(f"ActQuant: rotate={a.rotate} must be a power of two dividing K={k}")
    if a.outlier_threshold is not None and not a.outlier_threshold > 0:
        raise JaxdecError(f"ActQuant: outlier_threshold={a.outlier_threshold!r} must be > 0")
    return _validate_output(a, math.prod(a.shape) // k)


def _validate_output(a: ActQuant, n: int) -> ActQuant:
    if a.out_bits is None:
        return a
    group = a.out_group or n
    if a.out_bits not in ACT_BITS:
        raise JaxdecError(f"ActQuant: out_bits={a.out_bits!r}, expected one of {ACT_BITS} or None")
    if group < 1 or n % group:
        raise JaxdecError(f"ActQuant: out_group={a.out_group!r} must divide N={n}")
    if a.out_rotate is not None and (a.out_rotate < 1 or a.out_rotate & (a.out_rotate - 1)
                                     or group % a.out_rotate):
        raise JaxdecError(f"ActQuant: out_rotate={a.out_rotate} must be a power of two dividing "
                          f"the output group {group}")
    if a.out_shift is not None and tuple(a.out_shift.shape) != (n,):
        raise JaxdecError(f"ActQuant: out_shift has shape {tuple(a.out_shift.shape)}, expected ({n},)")
    return a


def fake_quant_tokens(x: jax.Array, bits: int) -> jax.Array:
    """Per-row symmetric absmax quantise-dequantise of x [..., K] to signed `bits` codes in
    [-(2^(b-1) - 1), 2^(b-1) - 1], in float32 (a zero row stays zero)."""
    qmax = 2.0 ** (bits - 1) - 1
    x32 = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x32), axis=-1, keepdims=True) / qmax
    safe = jnp.where(scale > 0, scale, 1.0)
    return jnp.clip(jnp.round(x32 / safe), -qmax, qmax) * scale


def hadamard(n: int) -> np.ndarray:
    """The orthonormal Sylvester-Hadamard matrix f32[n, n] (n a power of two)."""
    if n < 1 or n & (n - 1):
        raise JaxdecError(f"hadamard: size {n} is not a power of two")
    h = np.ones((1, 1), np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / math.sqrt(n)).astype(np.float32)


def largest_pow2_block(k: int, cap: int = 1024) -> int:
    """The largest power of two dividing k, at most `cap`: the block of a block-diagonal
    Hadamard rotation for a dimension that is not a power of two (576 = 9 x 64)."""
    return min(k & -k, cap)


def block_hadamard(x: jax.Array, block: int) -> jax.Array:
    """x [..., K] @ blockdiag(H_block, ..., H_block): an orthogonal rotation of the last
    axis (its own transpose, since H is symmetric)."""
    k = x.shape[-1]
    h = jnp.asarray(hadamard(block))
    y = jnp.einsum("...gb,bc->...gc", x.reshape(*x.shape[:-1], k // block, block).astype(jnp.float32),
                   h, precision=jax.lax.Precision.HIGHEST)
    return y.reshape(x.shape).astype(x.dtype)


def quantize_input(x2d: jax.Array, a: ActQuant) -> jax.Array:
    """x [M, K] -> the (fake-)quantised input that meets `a.w` (module docstring)."""
    x = x2d.astype(jnp.float32)
    if a.in_scale is not None:
        x = x * a.in_scale.astype(jnp.float32)
    if a.rotate is not None:
        x = block_hadamard(x, a.rotate)
    if a.act_bits is None:
        return x
    if a.outlier_threshold is None:
        return fake_quant_tokens(x, a.act_bits)
    outlier = jnp.any(jnp.abs(x) >= a.outlier_threshold, axis=0)  # bool[K], this call
    inlier = fake_quant_tokens(jnp.where(outlier, 0.0, x), a.act_bits)
    return jnp.where(outlier, x, inlier)


def quantize_output(y: jax.Array, a: ActQuant, lead: int) -> jax.Array:
    """y [*lead, *out], the output of `a.w`'s matmul -> y fake-quantised per token and group
    of `a.out_group` outputs (module docstring); y itself when `a.out_bits` is None."""
    if a.out_bits is None:
        return y
    y2 = y.reshape(math.prod(y.shape[:lead]), -1).astype(jnp.float32)
    n = y2.shape[1]
    shift = 0.0 if a.out_shift is None else a.out_shift.astype(jnp.float32).reshape(n)
    group = a.out_group or n
    z = (y2 + shift).reshape(-1, n // group, group)
    if a.out_rotate is not None:
        z = block_hadamard(z, a.out_rotate)
    z = fake_quant_tokens(z, a.out_bits)
    if a.out_rotate is not None:
        z = block_hadamard(z, a.out_rotate)
    return (z.reshape(-1, n) - shift).reshape(y.shape).astype(y.dtype)
