"""Weight formats: the `QArray` pytree and its quantisers (re-exported here), DFloat11,
run-time activation quantisation and GGUF blocks (`gguf_blocks`, imported by the GGUF reader only)."""

from jaxdec.formats.qarray import (
    QArray,
    dequantize,
    matmul_reference,
    pack_int4,
    quantize,
    select,
    take_columns,
    unpack_int4,
    validate,
)

__all__ = [
    "QArray", "dequantize", "matmul_reference", "pack_int4", "quantize", "select", "take_columns",
    "unpack_int4", "validate",
]
