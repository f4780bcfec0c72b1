"""Decode attention on the GPU: Pallas on Triton, split-K (flash decoding).

One program per (row, kv head, split): its G query heads (padded to 16 rows for Triton's
dot) against the key blocks of one contiguous share of the row's slots, looping only over
the blocks below the row's length: the bytes past it are never read. Each split writes
an unnormalised partial (output, log-sum-exp); `common.merge` combines them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common


def _kernel(
    # inputs
    len_ref,  # i32[B]
    q_ref,  # [Gp, H]
    k_ref,  # [S, H]
    v_ref,  # [S, H], or [H, S] when v_hs
    # outputs
    o_ref,  # f32[Gp, H]
    lse_ref,  # f32[Gp, 1]
    *, block_k: int, blocks_per_split: int, scale: float, v_hs: bool,
):
    length = len_ref[pl.program_id(0)]
    first = pl.program_id(2) * blocks_per_split
    n_blocks = jnp.clip(pl.cdiv(length, block_k) - first, 0, blocks_per_split)
    n_slots = k_ref.shape[0]
    q = q_ref[...]

    def step(i, carry):
        lo = (first + i) * block_k
        start = jnp.minimum(lo, n_slots - block_k)  # the last block stays inside the buffer
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[:, pl.ds(start, block_k)] if v_hs else v_ref[pl.ds(start, block_k), :]
        return common.softmax_step(carry, q, k, v, (start, lo, length), scale, v_hs)

    rows, h = q_ref.shape
    init = (jnp.full((rows, 1), common.MASKED, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, h), jnp.float32))
    out, lse = common.finish(*jax.lax.fori_loop(0, n_blocks, step, init))
    o_ref[...] = out
    lse_ref[...] = lse


def split_count(rows: int, blocks: int, n_splits: int | None) -> int:
    """Splits per (row, kv head): enough programs for ~2 waves on a 132-SM GPU."""
    if n_splits is None:
        n_splits = pl.cdiv(264, rows)
    return max(1, min(n_splits, blocks))


def decode_attention(q, k, v, lengths, *, scale: float, block_k: int, n_splits: int | None,
                     v_hs: bool, interpret: bool):
    """q [B, K, G, H] (grouped), k [B, K, S, H], v [B, K, S|H, H|S], lengths i32[B]
    (S >= block_k) -> (out f32[B, K, G, H], lse f32[B, K, G, 1])."""
    b, kh, g, h = q.shape
    s = k.shape[2]
    rows = common.gpu_group_rows(g)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, rows - g), (0, 0)))
    blocks = pl.cdiv(s, block_k)
    splits = split_count(b * kh, blocks, n_splits)
    per_split = pl.cdiv(blocks, splits)
    row = lambda i, j, p: (i, j, 0, 0)
    kernel = functools.partial(_kernel, block_k=block_k, blocks_per_split=per_split, scale=scale, v_hs=v_hs)
    out, lse = pl.pallas_call(
        kernel,
        grid=(b, kh, splits),
        in_specs=[pl.BlockSpec((b,), lambda i, j, p: (0,)),
                  pl.BlockSpec((None, None, rows, h), row),
                  pl.BlockSpec((None, None) + k.shape[2:], row),
                  pl.BlockSpec((None, None) + v.shape[2:], row)],
        out_specs=[pl.BlockSpec((None, None, None, rows, h), lambda i, j, p: (i, j, p, 0, 0)),
                   pl.BlockSpec((None, None, None, rows, 1), lambda i, j, p: (i, j, p, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, kh, splits, rows, h), jnp.float32),
                   jax.ShapeDtypeStruct((b, kh, splits, rows, 1), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="decode_attention_gpu",
    )(lengths, q, k, v)
    out, lse = common.merge(out, lse, axis=2)
    return out[:, :, :g], lse[:, :, :g]
