"""Quantised weights: the `QArray` pytree, its quantisers and the GGUF block mapping."""

from jaxdec.quant.gguf_blocks import gguf_block_bits, qarray_from_gguf
from jaxdec.quant.qarray import (
    QArray,
    dequantize,
    matmul_reference,
    pack_int4,
    quantize,
    take_columns,
    unpack_int4,
    validate,
)

__all__ = [
    "QArray", "dequantize", "gguf_block_bits", "matmul_reference", "pack_int4",
    "qarray_from_gguf", "quantize", "take_columns", "unpack_int4", "validate",
]
