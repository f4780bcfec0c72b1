"""Building blocks shared by every model family: norms, rotary embeddings, gated MLPs,
the one matmul entry point, and the reference attention.

Einsum letters (one vocabulary for the whole project): B batch, T query length, S key
length, N query heads, K kv heads, G group (N // K), H head dim, D model dim, F ffn dim,
V vocab.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxdec.config import RopeScaling

NEG_INF = -1e30  # finite, so fully masked rows (padding) stay finite instead of NaN


def linear(x: jax.Array, w: jax.Array, spec: str) -> jax.Array:
    """The one matmul entry point: `einsum(spec, x, w)` accumulated in float32.

    Weights are stored (in, out) so the contraction streams them. The result comes back
    in the activation dtype, as a framework's bf16 Linear does.
    """
    y = jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32, cast back to x.dtype before the scale (as HF Llama does)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return w * x32.astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """f32[H/2] inverse frequencies, with optional llama3 / linear scaling."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    inv_freq = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return (inv_freq / scaling.factor).astype(np.float32)
    return _llama3_scale(inv_freq, scaling)


def _llama3_scale(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    """Meta's llama3 rule: long wavelengths slowed by `factor`, short ones kept, the band
    between interpolated linearly in 1/wavelength."""
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate-half (NEOX/HF) rotary embedding. x: [B, T, n, H]; positions: i32[B, T]."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, H/2]
    cos = jnp.cos(angles)[:, :, None, :].astype(x.dtype)
    sin = jnp.sin(angles)[:, :, None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def gated_mlp(x: jax.Array, w_gate, w_up, w_down) -> jax.Array:
    """SwiGLU: down(silu(x @ gate) * (x @ up)). x: [B, T, D]."""
    with jax.named_scope("mlp"):
        h = jax.nn.silu(linear(x, w_gate, "btd,df->btf")) * linear(x, w_up, "btd,df->btf")
        return linear(h, w_down, "btf,fd->btd")


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Reference GQA attention.

    q: [B, T, N, H]; k, v: [B, K, S, H]; mask: bool[B, T, S] (True = visible).
    Scores and softmax in float32; returns [B, T, N, H] in q.dtype.
    """
    b, t, n, h = q.shape
    kv = k.shape[1]
    qg = q.reshape(b, t, kv, n // kv, h)
    scores = jnp.einsum("btkgh,bksh->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / math.sqrt(h))
    scores = jnp.where(mask[:, None, None, :, :], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bksh->btkgh", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, n, h).astype(q.dtype)
