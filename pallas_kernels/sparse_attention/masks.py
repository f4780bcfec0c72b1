"""Kept block lists from block masks: the static patterns of sparse decoding.

A block mask is bool[K, n_blocks] (one pattern per kv head, shared by every row) or
bool[B, K, n_blocks] (per row); `blocks_from_mask` turns it into the (kept, n_kept) lists
that `block_sparse_attention` reads. `sink_local_mask` is the streaming-LLM pattern
(Xiao et al. 2023): the first `sink_blocks` blocks plus the `local_blocks` most recent ones
of each row.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def blocks_from_mask(mask):
    """mask bool[..., K, n_blocks] -> (kept i32[..., K, M], n_kept i32[..., K]): the set
    blocks of each list in ascending order, then (past n_kept) unset ones. A NumPy mask
    (static) gives NumPy lists as long as the longest one (M >= 1); a jax mask (concrete or
    traced) gives M = n_blocks, the bound known at trace time."""
    if isinstance(mask, np.ndarray):
        n_kept = mask.sum(axis=-1).astype(np.int32)
        order = np.argsort(~mask, axis=-1, kind="stable").astype(np.int32)
        return order[..., :max(int(n_kept.max(initial=0)), 1)], n_kept
    order = jnp.argsort(~mask, axis=-1, stable=True).astype(jnp.int32)
    return order, mask.sum(axis=-1, dtype=jnp.int32)


def sink_local_mask(n_blocks: int, sink_blocks: int, local_blocks: int, lengths, *,
                    block_k: int, kv_heads: int = 1):
    """bool[B, kv_heads, n_blocks]: of the blocks holding row b's tokens [0, lengths[b]),
    the first `sink_blocks` and the last `local_blocks` (ending with the block of the row's
    last token). NumPy lengths give a NumPy mask (static lists), jax lengths a jax one."""
    xp = jnp if hasattr(lengths, "aval") else np
    lengths = xp.asarray(lengths)
    used = -(-lengths // block_k)[:, None]  # [B, 1]: blocks holding written slots
    block = xp.arange(n_blocks)[None, :]
    mask = (block < used) & ((block < sink_blocks) | (block >= used - local_blocks))
    return xp.broadcast_to(mask[:, None, :], (lengths.shape[0], kv_heads, n_blocks))
