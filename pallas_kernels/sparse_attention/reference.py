"""The numerical truth of block-sparse decode attention, in plain jnp at float32 / highest
precision: decode attention (`decode_attention.reference.attend`) under the visibility mask
that the kept block lists spell out.

q: [B, N, H]; k: [B, K, S, H]; v: [B, K, S, H] ("sh") or [B, K, H, S] ("hs");
lengths: i32[B]; kept: i32[B, K, M] block ids; n_kept: i32[B, K]. Slot s of row b is
visible to kv head kh when s < lengths[b] and s // block_k is among
kept[b, kh, :n_kept[b, kh]]. Returns (out f32[B, N, H], lse f32[B, N]).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.decode_attention.reference import attend


def visible_slots(kept, n_kept, lengths, n_slots: int, block_k: int):
    """bool[B, K, S]: the slots the kept lists make visible (a duplicate id changes nothing
    here; the kernels would count it twice, so kept ids must be distinct)."""
    listed = jnp.arange(kept.shape[-1]) < n_kept[..., None]  # bool[B, K, M]
    block = jnp.arange(n_slots) // block_k  # i32[S]
    hit = (kept[..., :, None] == block) & listed[..., None]  # bool[B, K, M, S]
    written = jnp.arange(n_slots) < lengths[:, None, None]  # bool[B, 1, S]
    return hit.any(axis=2) & written


def block_sparse_attention(q, k, v, lengths, kept, n_kept, *, scale: float, block_k: int,
                           v_layout: str = "sh"):
    visible = visible_slots(kept, n_kept, lengths, k.shape[2], block_k)
    return attend(q, k, v, visible, scale, v_layout)
