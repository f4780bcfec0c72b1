"""Decode attention: one query step against a ragged-length KV cache, with GQA."""

from pallas_kernels.decode_attention.api import bytes_moved, decode_attention

__all__ = ["decode_attention", "bytes_moved"]
