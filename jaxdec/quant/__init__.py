"""Quantised weights: the `QArray` pytree and its quantisers (the GGUF block mapping is
`jaxdec.quant.gguf_blocks`, imported by the GGUF reader only)."""

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
    "QArray", "dequantize", "matmul_reference", "pack_int4", "quantize", "take_columns",
    "unpack_int4", "validate",
]
