"""The numerical truth of the quantised matmul, in plain jnp at float32 / highest precision.

x: [M, K]; w: a `jaxdec.formats.qarray.QArray` stored as [K, N] (int8 codes, or int4 codes
packed two rows to a byte) with float16 scales and offsets per group of g rows. Returns
f32[M, N] = f32(x) @ dequantize(w): W is dequantised in float32, then one float32 dot at
highest precision. It is `qarray.matmul_reference`, the library's one definition.
"""

from __future__ import annotations

import jax

from jaxdec.formats import qarray


def quantized_matmul(x: jax.Array, w: qarray.QArray) -> jax.Array:
    """x [M, K] -> f32[M, N]."""
    return qarray.matmul_reference(x, w)
