"""Weight-only quantised matmul on the GPU: Pallas on Triton.

One program per (row block, column block) of the output. It loops over K in steps of
`block_k` rows that each lie inside one quantisation group, so a step is one dot of x
against the raw codes (small integers, exact in x's dtype) and the group's scale and
offset rows are applied to the partial product, never to a dequantised tile:

    acc += (x_k @ codes_k) * scale[group] + rowsum(x_k) * offset[group]

The codes are read once from HBM and W is never dequantised there. For int4, x arrives
de-interleaved as [2, M, K/2] (its even columns, then its odd ones), which meet the low
and the high nibbles of the packed codes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def codes(q, part: int, bits: int):
    """The codes of one part of a [rows, N] block: int8 as stored, or the low (part 0) or
    high (part 1) nibbles of packed int4 bytes."""
    return q if bits == 8 else (q >> (4 * part)) & 0x0F


def _kernel(
    # inputs
    x_ref,  # [P, bm, K / P] (P = 8 // bits parts of x's columns)
    q_ref,  # i8[K, bn] or u8[K / 2, bn]
    s_ref,  # f16[K / g, bn]
    off_ref,  # f16[K / g, bn], or None
    # outputs
    o_ref,  # [bm, bn]
    *, block_k: int, group_size: int, bits: int,
):
    parts = x_ref.shape[0]
    rows, group_rows = block_k // parts, group_size // parts  # packed rows per step / group
    dt = x_ref.dtype
    precision = jax.lax.Precision.HIGHEST if dt == jnp.float32 else None

    def step(i, acc):
        start = i * rows
        q = q_ref[pl.ds(start, rows), :]
        part, xsum = jnp.zeros(acc.shape, jnp.float32), jnp.zeros((acc.shape[0], 1), jnp.float32)
        for p in range(parts):
            x = x_ref[p, :, pl.ds(start, rows)]
            part += jax.lax.dot(x, codes(q, p, bits).astype(dt), precision=precision,
                                preferred_element_type=jnp.float32)
            xsum += jnp.sum(x.astype(jnp.float32), axis=1, keepdims=True)
        group = pl.ds(start // group_rows, 1)
        acc += part * s_ref[group, :].astype(jnp.float32)
        if off_ref is not None:
            acc += xsum * off_ref[group, :].astype(jnp.float32)
        return acc

    n_steps = x_ref.shape[2] // rows
    acc = jax.lax.fori_loop(0, n_steps, step, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _symmetric_kernel(x_ref, q_ref, s_ref, o_ref, **static):
    """`_kernel` without offsets (symmetric int8)."""
    _kernel(x_ref, q_ref, s_ref, None, o_ref, **static)


def quantized_matmul(x, q, scale, offset, *, bits: int, group_size: int, block_m: int,
                     block_n: int, block_k: int, out_dtype, interpret: bool):
    """x [P, M, K / P] (M a multiple of block_m), q i8[K, N] | u8[K / 2, N], scale and
    offset (or None) f16[K / g, N] -> [M, N] in out_dtype."""
    parts, m, kp = x.shape
    groups, n = scale.shape
    body = _kernel if offset is not None else _symmetric_kernel
    kernel = functools.partial(body, block_k=block_k, group_size=group_size, bits=bits)
    cols = lambda i, j: (0, j)
    in_specs = [pl.BlockSpec((parts, block_m, kp), lambda i, j: (0, i, 0)),
                pl.BlockSpec((q.shape[0], block_n), cols),
                pl.BlockSpec((groups, block_n), cols)]
    in_specs += [] if offset is None else [pl.BlockSpec((groups, block_n), cols)]
    return pl.pallas_call(
        kernel,
        grid=(m // block_m, n // block_n),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name="quantized_matmul_gpu",
    )(x, q, scale, *([] if offset is None else [offset]))
