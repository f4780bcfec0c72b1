"""Paged decode attention: one query step per row against KV pages of a shared pool,
found through a per-row page table (the layout of `jaxdec.cache.paged`), with GQA."""

from pallas_kernels.paged_attention.api import bytes_moved, paged_attention

__all__ = ["paged_attention", "bytes_moved"]
