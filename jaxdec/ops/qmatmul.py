"""The quantised half of `layers.linear`, and the expert matmuls of every weight format.

On the CPU the matrix products of decoding go to our XLA FFI kernel (`cpu_kernel`), which
streams the int8/int4 codes: XLA's own CPU code has no fast path for them (it
materialises W in float32 on every call). On other backends, without a C++ compiler, and
for very long prompts, it is dequantise-then-dot, which XLA fuses on GPU and TPU.

`expert_matmul` and `ragged_matmul` are the MoE layer's two products (`jaxdec.models.moe`),
for experts w [E, K, N] stored as arrays or as a stack of `QArray`s (n_batch = 1): one
entry point each, dispatching on the weight, so the model never branches on quantisation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxdec.ops import cpu_kernel
from jaxdec.formats.qarray import QArray, dequantize, matmul_reference, pad_input, select


def qmatmul(x: jax.Array, w: QArray) -> jax.Array:
    """x: [M, K] -> f32[M, N]. 2- and 3-bit codes (quality studies) take the portable
    dequantise-then-dot path everywhere. A short last group: x is zero-padded to the
    codes' rows, so their padding adds nothing."""
    if w.bits not in (4, 8):
        return matmul_reference(x, w)
    return cpu_kernel.qmatmul(pad_input(x, w), w.q, w.scale, w.offset, bits=w.bits,
                              group_size=w.group_size)


def expert_matmul(x: jax.Array, w, idx: jax.Array) -> jax.Array:
    """y f32[S, M, N] with y[s] = x[s] @ w[idx[s]]: x [S, M, K], w [E, K, N], idx i32[S] in
    [0, E). Dense experts: `cpu_kernel.expert_matmul` (reads the chosen experts in place).
    Quantised: the chosen experts' codes are gathered (S of E matrices, in their stored
    bytes) and each slot runs the quantised matmul kernel on its own matrix."""
    if not isinstance(w, QArray):
        return cpu_kernel.expert_matmul(x, w, idx)
    chosen = select(w, jnp.asarray(idx, jnp.int32))
    one = lambda xs, q, s, o: qmatmul(xs, QArray(q=q, scale=s, offset=o, bits=w.bits,
                                                  group_size=w.group_size, shape=w.shape[1:],
                                                  n_in=w.n_in))
    axes = (0, 0, 0, None if w.offset is None else 0)
    return jax.vmap(one, in_axes=axes)(x, chosen.q, chosen.scale, chosen.offset)


def ragged_matmul(x: jax.Array, w, group_sizes: jax.Array) -> jax.Array:
    """y f32[R, N]: x [R, K] holds each expert's rows in turn (group_sizes i32[E] of them),
    each group times its expert (`cpu_kernel.ragged_matmul`). Quantised experts are
    dequantised to float32 first (a prefill runs every expert over many rows, so the
    dequantisation is paid once per call, not per row)."""
    if isinstance(w, QArray):
        x, w = x.astype(jnp.float32), dequantize(w, jnp.float32)
    return cpu_kernel.ragged_matmul(x, w, group_sizes)
