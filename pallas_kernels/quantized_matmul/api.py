"""`quantized_matmul`: x @ W for a group-wise quantised (int8 / int4) weight W.

    y = quantized_matmul(x, w, implementation="pallas", interpret=False)

x: [M, K] float32 | bfloat16; w: a `jaxdec.formats.qarray.QArray` stored as [K, N] (see its
docstring: int8 codes, or int4 codes with rows 2i / 2i+1 in the low / high nibble of byte
i; a float16 scale and optional offset per group of g rows of a column). Returns [M, N]
in `out_dtype` (float32 by default) = x @ dequantize(w). implementation="xla" is
`qarray.matmul_reference` (dequantise in float32, then dot); the kernels read the codes
and the scales and dequantise on the chip, never writing a dequantised W to HBM.

Block sizes are static and keyword-only, counted in rows of the logical K (not packed
bytes); by default they are chosen from the shapes (small M: one 16-row GPU / 8-row TPU
block). M need not divide by block_m: x is padded with zero rows.
- GPU: powers of two >= 16 (Triton's dot; for int4 block_k / 2 >= 16), block_n dividing
  N, block_k dividing g (each K step lies inside one group).
- TPU: block_m a multiple of 8; block_n a multiple of 128 dividing N, or N; block_k a
  multiple of 128 (256 for int4: the K/2 packed rows are the lanes of x's halves)
  dividing K, or K, and a multiple or a divisor of g.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxdec.errors import JaxdecError
from jaxdec.formats import qarray
from pallas_kernels import common
from pallas_kernels.quantized_matmul import gpu, reference, tpu

OP = "quantized_matmul"
FLOATS = (jnp.float32, jnp.bfloat16)
OUT_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)


def check_inputs(op: str, x, w, out_dtype) -> tuple[int, int, int]:
    """(M, K, N) of valid inputs, or a one-line `KernelError`."""
    common.check(isinstance(w, qarray.QArray), op, f"w is a {type(w).__name__}, expected a QArray")
    try:
        qarray.validate(w)
    except JaxdecError as e:
        raise common.KernelError(f"{op}: {e}") from None
    common.check(x.ndim == 2, op, f"x has shape {tuple(x.shape)}, expected [M, K]")
    common.check_dtype(op, "x", x, FLOATS)
    common.check(x.shape[1] == w.k, op, f"x has K={x.shape[1]} but the QArray has K={w.k}")
    common.check(np.dtype(out_dtype) in tuple(map(np.dtype, OUT_FLOATS)), op,
                 f"out_dtype={np.dtype(out_dtype).name}, expected a float type")
    return x.shape[0], w.k, w.n


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def gpu_blocks(m: int, n: int, bits: int, g: int, block_m, block_n, block_k):
    """Checked (block_m, block_n, block_k) for the GPU body, defaults filled in."""
    parts = 8 // bits
    block_m = block_m or min(max(16, 1 << (m - 1).bit_length()), 64)
    block_n = block_n or min(n & -n, 64 if m <= 16 else 128)  # more programs when decoding
    block_k = block_k or min(g & -g, 128)
    common.check(_pow2(block_m) and block_m >= 16, OP,
                 f"block_m={block_m} must be a power of two >= 16 on the GPU")
    common.check(_pow2(block_n) and block_n >= 16 and n % block_n == 0, OP,
                 f"block_n={block_n} must be a power of two >= 16 dividing N={n} on the GPU")
    common.check(_pow2(block_k) and block_k // parts >= 16 and g % block_k == 0, OP,
                 f"block_k={block_k} must be a power of two >= {16 * parts} dividing "
                 f"group_size={g} on the GPU")
    return block_m, block_n, block_k


def tpu_blocks(m: int, k: int, n: int, bits: int, g: int, block_m, block_n, block_k):
    """Checked (block_m, block_n, block_k) for the TPU body, defaults filled in."""
    parts = 8 // bits
    lanes = 128 * parts
    fits = lambda b: k % b == 0 and (b % g == 0 or g % b == 0) and (b <= g or (g // parts) % 8 == 0)
    block_m = block_m or -(-m // (8 * -(-m // 256))) * 8  # <= 256 rows, little padding
    block_n = block_n or next((b for b in (512, 256, 128) if n % b == 0), n)
    block_k = block_k or next((b for b in (512, 256, 128) if b % lanes == 0 and fits(b)), k)
    common.check(block_m > 0 and block_m % 8 == 0, OP, f"block_m={block_m} must be a multiple of 8 on the TPU")
    common.check(block_n == n or (block_n % 128 == 0 and n % block_n == 0), OP,
                 f"block_n={block_n} must be N={n} or a multiple of 128 dividing it on the TPU")
    common.check(block_k == k or (block_k > 0 and block_k % lanes == 0 and k % block_k == 0), OP,
                 f"block_k={block_k} must be K={k} or a multiple of {lanes} dividing it on the TPU")
    common.check(block_k % g == 0 or g % block_k == 0, OP,
                 f"block_k={block_k} must be a multiple or a divisor of group_size={g}")
    common.check(block_k <= g or (g // parts) % 8 == 0, OP,
                 f"group_size={g} must be a multiple of {8 * parts} for blocks of several groups on the TPU")
    return block_m, block_n, block_k


def split_columns(x, bits: int, rows: int):
    """[M, K] -> [P, M', K / P], M' = M rounded up to `rows` (zero rows): P = 1 for int8;
    for int4 x's even columns, then its odd ones (they meet the low / high nibbles)."""
    m, k = x.shape
    x = jnp.pad(x, ((0, -m % rows), (0, 0)))
    return x[None] if bits == 8 else x.reshape(x.shape[0], k // 2, 2).transpose(2, 0, 1)


def f32_group_rows(a):
    """f16[K/g, N] -> f32[K/g, 1, N] (None stays None): the TPU body's scale layout."""
    return None if a is None else a.astype(jnp.float32)[:, None, :]


@functools.partial(jax.jit, static_argnames=(
    "implementation", "interpret", "platform", "block_m", "block_n", "block_k", "out_dtype"))
def quantized_matmul(x, w: qarray.QArray, *, implementation: str = "pallas", interpret: bool = False,
                     platform: str | None = None, block_m: int | None = None,
                     block_n: int | None = None, block_k: int | None = None,
                     out_dtype=jnp.float32):
    """See the module docstring."""
    m, k, n = check_inputs(OP, x, w, out_dtype)
    where = common.resolve(OP, implementation, interpret, platform)
    if where is None:
        return reference.quantized_matmul(x, w).astype(out_dtype)
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    g, bits = w.group_size, w.bits
    if where == "gpu":
        bm, bn, bk = gpu_blocks(m, n, bits, g, block_m, block_n, block_k)
        body, scale, offset = gpu.quantized_matmul, w.scale, w.offset
    else:
        bm, bn, bk = tpu_blocks(m, k, n, bits, g, block_m, block_n, block_k)
        body, scale, offset = tpu.quantized_matmul, f32_group_rows(w.scale), f32_group_rows(w.offset)
    out = body(split_columns(x, bits, bm), w.q, scale, offset, bits=bits, group_size=g,
               block_m=bm, block_n=bn, block_k=bk, out_dtype=out_dtype, interpret=interpret)
    return out[:m]


def bytes_moved(x, w: qarray.QArray, *, platform: str = "gpu", out_dtype=jnp.float32) -> common.Bytes:
    """HBM bytes of one call: x, the codes, the scales and offsets, the output. On the TPU
    the float16 scales and offsets also take a conversion pass (read as float16, written
    and read again as float32). The wrapper's copy of x (zero rows, int4 de-interleave;
    O(M K), small next to W's K N when decoding) is not counted."""
    side = common.nbytes(w.scale.shape, jnp.float16) * (2 if w.offset is not None else 1)
    read = common.nbytes(x.shape, x.dtype) + common.nbytes(w.q.shape, w.q.dtype) + side
    written = common.nbytes((x.shape[0], w.n), out_dtype)
    if platform == "tpu":  # f16 -> f32: written once, read by the kernel
        read, written = read + 2 * side, written + 2 * side
    return common.Bytes(read=read, written=written)
