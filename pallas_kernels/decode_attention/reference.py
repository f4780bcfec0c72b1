"""The numerical truth of decode attention, in plain jnp at float32 / highest precision.

q: [B, N, H]; k: [B, K, S, H]; v: [B, K, S, H] ("sh") or [B, K, H, S] ("hs", the dense
cache's V); lengths: i32[B], row b sees slots [0, lengths[b]). Head n reads kv head
n // (N // K). Returns (out f32[B, N, H], lse f32[B, N]); a row of length 0 gives 0, -inf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def attend(q, k, v, visible, scale: float, v_layout: str = "sh"):
    """The shared core of every attention reference: q [B, N, H], k [B, K, S, H], v as
    `v_layout`, visible bool[B, K, S] -> (out f32[B, N, H], lse f32[B, N])."""
    b, n, h = q.shape
    kh = k.shape[1]
    qg = q.astype(jnp.float32).reshape(b, kh, n // kh, h)
    s = jnp.einsum("bkgh,bksh->bkgs", qg, k.astype(jnp.float32), precision=HIGHEST) * scale
    s = jnp.where(visible[:, :, None, :], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.where(visible[:, :, None, :], jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    spec = "bkgs,bksh->bkgh" if v_layout == "sh" else "bkgs,bkhs->bkgh"
    out = jnp.einsum(spec, p, v.astype(jnp.float32), precision=HIGHEST)
    return out.reshape(b, n, h), lse.reshape(b, n)


def decode_attention(q, k, v, lengths, *, scale: float, v_layout: str = "sh"):
    s = k.shape[2]
    visible = jnp.arange(s)[None, None, :] < lengths[:, None, None]
    return attend(q, k, v, jnp.broadcast_to(visible, (k.shape[0], k.shape[1], s)), scale, v_layout)
