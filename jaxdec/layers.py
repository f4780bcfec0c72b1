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
from jaxdec.ops import cpu_kernel
from jaxdec.formats import dfloat11
from jaxdec.ops.qmatmul import qmatmul
from jaxdec.formats.actquant import ActQuant, quantize_input, quantize_output
from jaxdec.formats.actquant import validate as validate_act
from jaxdec.formats.qarray import QArray, dequantize
from jaxdec.formats.tap import Tap, record
from jaxdec.sharding import split_axes

NEG_INF = -1e30  # finite, so fully masked rows (padding) stay finite instead of NaN


def linear(x: jax.Array, w: jax.Array, n_in: int = 1, *, dtype=None) -> jax.Array:
    """The one matmul entry point: contract the last `n_in` axes of x with the first `n_in`
    axes of w, accumulating in float32. x: [..., *in], w: [*in, *out] -> [..., *out].

    A `QArray` weight goes to the quantised matmul (`jaxdec.ops.qmatmul`); model code
    never branches on quantisation. Weights are stored (in, out) so the contraction streams them. Both sides are flattened
    to one 2-D dot ([M, K] @ [K, N]) so XLA never relayouts a weight to match an
    activation (it did: a [N, H, D] output projection was transposed on every step). The
    result comes back in `dtype`, by default the activation's, as a framework's bf16
    Linear does.
    """
    if isinstance(w, dfloat11.DF11Array):  # lossless DFloat11: decoded just before its use
        if n_in == 1 and dfloat11.slice_rows(w) is not None:  # big: a slice at a time
            y = dfloat11.matmul_sliced(x, w, lambda xs, ws: linear(xs, ws, dtype=jnp.float32))
            return y.astype(dtype or x.dtype)
        w = dfloat11.decompress(w, after=x)
    in_shape, out_shape = tuple(w.shape[:n_in]), tuple(w.shape[n_in:])
    if x.shape[x.ndim - n_in:] != in_shape:
        raise ValueError(f"linear: x {x.shape} does not end in w's input axes {in_shape}")
    k = math.prod(in_shape)
    if isinstance(w, Tap):  # a calibration pass records this input (`jaxdec.formats.tap`)
        record(w.name, x.reshape(-1, k))
        w = w.w
    if isinstance(w, ActQuant):  # input quantised at run time (W8A8, W4A4, LLM.int8())
        xq = quantize_input(x.reshape(-1, k), validate_act(w, k))
        y = linear(xq.reshape(x.shape), w.w, n_in, dtype=dtype or x.dtype)
        return quantize_output(y, w, x.ndim - n_in)  # y itself unless w.out_bits (KV4)
    if isinstance(w, QArray):
        if w.n_in != n_in:
            raise ValueError(f"linear: QArray contracts {w.n_in} axes, not {n_in}")
        y = qmatmul(x.reshape(-1, k), w)
    elif split_axes():  # on a mesh: one dot_general over w's own axes, which the SPMD
        # partitioner splits as they are (flattening a split axis that is not the major
        # one of its fold, as Mamba's [D, 2, groups, state], would gather the weight)
        return jnp.tensordot(x, w, axes=n_in, preferred_element_type=jnp.float32).astype(dtype or x.dtype)
    else:  # the CPU kernel for few rows (decode), XLA's dot otherwise
        y = cpu_kernel.dense_matmul(x.reshape(-1, k), w.reshape(k, -1))
    return y.reshape(*x.shape[:x.ndim - n_in], *out_shape).astype(dtype or x.dtype)


def weight_value(w) -> jax.Array:
    """The values of a weight of any format as an array of its logical shape: a float array
    as it is, a `QArray` dequantised (float32, exactly its stored values), a DFloat11 one
    decompressed. For the products that are not `linear` (MLA's per-head absorbed
    up-projections contract a weight's output axes)."""
    if isinstance(w, QArray):
        return dequantize(w, jnp.float32)
    if isinstance(w, dfloat11.DF11Array):
        return dfloat11.decompress(w)
    return w


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32, cast back to x.dtype before the scale (as HF Llama does)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return w * x32.astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """f32[H/2] inverse frequencies, with optional llama3 / linear / yarn scaling."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    inv_freq = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return (inv_freq / scaling.factor).astype(np.float32)
    if scaling.kind == "yarn":
        return _yarn_scale(inv_freq, head_dim, theta, scaling)
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


def _yarn_scale(inv_freq: np.ndarray, dim: int, theta: float, s: RopeScaling) -> np.ndarray:
    """YaRN: a frequency index below the one turning `beta_fast` times over the original
    context keeps its frequency, above the one turning `beta_slow` times is divided by
    `factor`, with a linear ramp between."""

    def index(rotations: float) -> float:  # the dimension turning `rotations` times
        return dim * math.log(s.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = index(s.beta_fast), index(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    keep = 1 - np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    interpolated = inv_freq / np.float32(s.factor)
    return (interpolated * (1 - keep) + inv_freq * keep).astype(np.float32)


def rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, factor: float = 1.0) -> jax.Array:
    """Rotate-half (NEOX/HF) rotary embedding. x: [B, T, n, H]; positions: i32[B, T];
    `factor` scales cos and sin (YaRN's attention factor)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, H/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def gated_mlp(x: jax.Array, w_gate, w_up, w_down, act: str = "silu") -> jax.Array:
    """down(act(x @ gate) * (x @ up)) (SwiGLU; GeGLU for act "gelu_tanh"); without a gate
    (`w_gate` None) the squared ReLU MLP down(relu(x @ up)^2) of Nemotron-H. x: [..., D]."""
    with jax.named_scope("mlp"):
        gate = None if w_gate is None else linear(x, w_gate)
        return linear(mlp_act(gate, linear(x, w_up), act), w_down)


def mlp_act(gate, up, act: str = "silu"):
    """The MLP's hidden activations from its two projections: act(gate) * up, act silu
    (SwiGLU) or the tanh-approximated GELU ("gelu_tanh", Gemma's GeGLU), or relu(up)^2
    without a gate (Nemotron-H). Dense MLPs and MoE experts share it."""
    if gate is None:
        return jnp.square(jax.nn.relu(up))
    return (jax.nn.gelu(gate, approximate=True) if act == "gelu_tanh" else jax.nn.silu(gate)) * up


def attention(q: jax.Array, *blocks: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
    """GQA attention over one or more key blocks sharing one softmax.

    q: [B, T, N, H]; each block is (k, v, mask) with k: [B, K, S_i, H], v: [B, K, H, S_i]
    (the dense cache's layouts) and mask: bool[B, T, S_i] (True = visible). A chunk attends
    to two blocks, the cache as it was before it and its own keys (prefill, tree
    verification), or, on the CPU kernel, to the cache alone after its keys were written
    there (decode steps, draft chains: every query then sums its keys in slot order,
    whatever the chunk's length; see `transformer.attention_block`). Scores and softmax
    in float32; returns [B, T, N, H] in q.dtype. Short query chunks (decode) run the CPU
    kernel (`cpu_kernel.attention`), which reads only the visible keys; `attention_reference`
    is the definition, and what runs elsewhere.
    """
    out = cpu_kernel.attention(q, blocks, scale=1.0 / math.sqrt(q.shape[-1]),
                               xla=attention_reference)
    return out.astype(q.dtype)


def attention_reference(q: jax.Array, *blocks: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
    """`attention` in plain XLA ops (any backend): scores, masks, one softmax, values."""
    b, t, n, h = q.shape
    kv = blocks[0][0].shape[1]
    qg = q.reshape(b, t, kv, n // kv, h) * jnp.asarray(1.0 / math.sqrt(h), q.dtype)
    scores = [jnp.where(mask[:, None, None, :, :],
                        jnp.einsum("btkgh,bksh->bkgts", qg, k, preferred_element_type=jnp.float32),
                        NEG_INF) for k, _, mask in blocks]
    # the probabilities stay float32 and bfloat16 values are widened: XLA:CPU's runtime dot
    # has no bf16 x bf16 -> f32 (DotThunk), which it falls back to for some layouts of P @ V
    out = sum(jnp.einsum("bkgts,bkhs->btkgh", p, v.astype(jnp.float32))
              for p, (_, v, _) in zip(block_softmax(scores), blocks))
    return out.reshape(b, t, n, h).astype(q.dtype)


def block_softmax(scores: list[jax.Array]) -> list[jax.Array]:
    """One softmax over the last axis of several key blocks' scores (f32, masked entries
    NEG_INF), split back into per-block probabilities: attention over a cache and a chunk
    that are never concatenated."""
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
    splits = np.cumsum([s.shape[-1] for s in scores])[:-1].tolist()
    return jnp.split(probs, splits, axis=-1)
