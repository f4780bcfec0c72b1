"""DFloat11 decompression: bf16 weights from Huffman-coded exponents, bit for bit."""

from pallas_kernels.dfloat11.api import decompress

__all__ = ["decompress"]
