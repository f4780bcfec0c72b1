"""The quantised half of `layers.linear`: y = x @ W for a `QArray` W.

On the CPU the matrix-vector products of decoding go to our XLA FFI kernel
(`cpu_kernel`), which streams the int8/int4 codes; XLA's own CPU code has no fast path
for them (it materialises W in float32 on every call). Elsewhere, and for long prompts
where a dense dot wins, it is the reference: dequantise, then one float32 dot, which
XLA fuses on GPU and TPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxdec.quant.qarray import QArray, matmul_reference


def qmatmul(x: jax.Array, w: QArray) -> jax.Array:
    """x: [M, K] -> f32[M, N]."""
    try:
        from jaxdec.quant import cpu_kernel  # noqa: PLC0415 (builds its library lazily)
    except ImportError:
        cpu_kernel = None
    if cpu_kernel is not None and x.shape[0] <= cpu_kernel.MAX_M and cpu_kernel.available():
        return cpu_kernel.qmatmul(x.astype(jnp.float32), w.q, w.scale, w.offset,
                                  bits=w.bits, group_size=w.group_size)
    return matmul_reference(x, w)
