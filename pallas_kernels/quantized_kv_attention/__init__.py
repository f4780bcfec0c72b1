"""Quantised-KV decode attention: one query step against an int8/int4 KV cache
(`jaxdec.formats.kvquant.QuantKV`), dequantised inside the kernel, with GQA."""

from pallas_kernels.quantized_kv_attention.api import bytes_moved, quantized_kv_attention

__all__ = ["quantized_kv_attention", "bytes_moved"]
