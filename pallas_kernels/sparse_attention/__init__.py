"""Block-sparse decode attention: each (row, kv head) attends only to the key blocks of
its kept list; the lists come from static block masks (`masks`) or from Quest's
query-aware page selection (`quest`)."""

from pallas_kernels.sparse_attention.api import block_sparse_attention, bytes_moved
from pallas_kernels.sparse_attention.masks import blocks_from_mask, sink_local_mask
from pallas_kernels.sparse_attention.quest import (
    page_bounds, page_scores, quest_attention, quest_select, update_bounds)

__all__ = ["block_sparse_attention", "bytes_moved", "blocks_from_mask", "sink_local_mask",
           "page_bounds", "update_bounds", "page_scores", "quest_select", "quest_attention"]
