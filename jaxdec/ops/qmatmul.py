"""The quantised half of `layers.linear`: y = x @ W for a `QArray` W.

On the CPU the matrix products of decoding go to our XLA FFI kernel (`cpu_kernel`), which
streams the int8/int4 codes: XLA's own CPU code has no fast path for them (it
materialises W in float32 on every call). On other backends, without a C++ compiler, and
for very long prompts, it is dequantise-then-dot, which XLA fuses on GPU and TPU.
"""

from __future__ import annotations

import jax

from jaxdec.ops import cpu_kernel
from jaxdec.formats.qarray import QArray, matmul_reference


def qmatmul(x: jax.Array, w: QArray) -> jax.Array:
    """x: [M, K] -> f32[M, N]. 2- and 3-bit codes (quality studies) take the portable
    dequantise-then-dot path everywhere."""
    if w.bits not in (4, 8):
        return matmul_reference(x, w)
    return cpu_kernel.qmatmul(x, w.q, w.scale, w.offset, bits=w.bits, group_size=w.group_size)
