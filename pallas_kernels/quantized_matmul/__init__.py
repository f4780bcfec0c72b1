"""Weight-only quantised matmul: x @ W for a group-wise int8/int4 `QArray` W."""

from pallas_kernels.quantized_matmul.api import bytes_moved, quantized_matmul

__all__ = ["quantized_matmul", "bytes_moved"]
