"""Weight-only quantised matmul on the TPU: Pallas on Mosaic.

Grid (row block, column block, K block), the last axis a reduction into a float32 VMEM
accumulator. Each step dequantises its [block_k, block_n] tile of codes in VMEM and
feeds it to the MXU in x's dtype:

    acc += x_k @ (f32(codes_k) * scale_k + offset_k)

(with bf16 x the dequantised tile is rounded to bf16 for the MXU: bf16-level error, where
the GPU body, scaling after an exact dot of the codes, is exact up to f32 accumulation).

The per-group scale rows reach the tile's rows without moving data between lanes: the
scales arrive as [K/g, 1, N] (one row per group, a free reshape in HBM), are broadcast
along sublanes to [groups, rows per group, block_n] and merged into [rows, block_n]
(rows per group a multiple of 8: whole sublane tiles). The scales and offsets are
float16 in the `QArray`; the TPU has no float16 vector unit and Mosaic's float16 support
is not one we can rely on, so the wrapper converts them to float32 (an extra XLA pass
over them, counted in `bytes_moved`). For int4, x arrives de-interleaved as [2, M, K/2]
(its even columns, then its odd ones), which meet the low and high nibbles of the codes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def codes(q, part: int, bits: int):
    """The codes of one part of a block as int32: int8 as stored, or the low (part 0) or
    high (part 1) nibbles of packed int4 bytes."""
    q = q.astype(jnp.int32)
    return q if bits == 8 else (q >> (4 * part)) & 0x0F


def expand(rows_of_groups, rows: int):
    """f32[groups, 1, bn] -> f32[rows, bn]: each group's row repeated rows // groups times
    (a sublane broadcast, then a merge of whole sublane tiles)."""
    groups, _, bn = rows_of_groups.shape
    return jnp.broadcast_to(rows_of_groups, (groups, rows // groups, bn)).reshape(rows, bn)


def _kernel(
    # inputs
    x_ref,  # [P, bm, bk / P] (P = 8 // bits parts of x's columns)
    q_ref,  # i8[bk, bn] or u8[bk / 2, bn]
    s_ref,  # f32[groups in the block, 1, bn]
    off_ref,  # f32[groups in the block, 1, bn], or None
    # outputs
    o_ref,  # [bm, bn]
    # scratch
    acc_ref,  # f32[bm, bn]
    *, bits: int,
):
    kk = pl.program_id(2)
    dt = x_ref.dtype
    precision = jax.lax.Precision.HIGHEST if dt == jnp.float32 else None

    @pl.when(kk == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    rows = q_ref.shape[0]
    scale = expand(s_ref[...], rows)
    offset = None if off_ref is None else expand(off_ref[...], rows)
    q = q_ref[...]
    acc = acc_ref[...]
    for p in range(x_ref.shape[0]):
        w = codes(q, p, bits).astype(jnp.float32) * scale
        w = w if offset is None else w + offset
        acc += jax.lax.dot(x_ref[p], w.astype(dt), precision=precision,
                           preferred_element_type=jnp.float32)
    acc_ref[...] = acc

    @pl.when(kk == pl.num_programs(2) - 1)
    def _finish():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _symmetric_kernel(x_ref, q_ref, s_ref, o_ref, acc_ref, **static):
    """`_kernel` without offsets (symmetric int8)."""
    _kernel(x_ref, q_ref, s_ref, None, o_ref, acc_ref, **static)


def quantized_matmul(x, q, scale, offset, *, bits: int, group_size: int, block_m: int,
                     block_n: int, block_k: int, out_dtype, interpret: bool):
    """x [P, M, K / P] (M a multiple of block_m), q i8[K, N] | u8[K / 2, N], scale and
    offset (or None) f32[K / g, 1, N] -> [M, N] in out_dtype."""
    parts, m, kp = x.shape
    n = scale.shape[2]
    k_steps = kp * parts // block_k
    groups = max(block_k // group_size, 1)  # scale rows per K block

    def scale_map(i, j, kk):  # block_k < g: several K blocks share one scale row
        return (jax.lax.div(kk * block_k, groups * group_size), 0, j)  # (no sign op)

    in_specs = [pl.BlockSpec((parts, block_m, block_k // parts), lambda i, j, kk: (0, i, kk)),
                pl.BlockSpec((block_k // parts, block_n), lambda i, j, kk: (kk, j)),
                pl.BlockSpec((groups, 1, block_n), scale_map)]
    in_specs += [] if offset is None else [pl.BlockSpec((groups, 1, block_n), scale_map)]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=0,
        grid=(m // block_m, n // block_n, k_steps),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j, kk: (i, j)),
        scratch_shapes=[pltpu.VMEM((block_m, block_n), jnp.float32)],
    )
    body = _kernel if offset is not None else _symmetric_kernel
    return pl.pallas_call(
        functools.partial(body, bits=bits),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="quantized_matmul_tpu",
    )(x, q, scale, *([] if offset is None else [offset]))
