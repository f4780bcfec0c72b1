"""The numerical truth of quantised-KV decode attention: dequantise, then the float32
decode-attention reference at highest precision.

q: [B, N, H]; k, v: `QuantKV` of logical shape [B, K, S, H]; lengths: i32[B], row b sees
slots [0, lengths[b]). Returns (out f32[B, N, H], lse f32[B, N]); a row of length 0 gives
0, -inf.
"""

from __future__ import annotations

from jaxdec.formats.kvquant import QuantKV, dequantize_kv
from pallas_kernels.decode_attention import reference


def quantized_kv_attention(q, k: QuantKV, v: QuantKV, lengths, *, scale: float):
    return reference.decode_attention(q, dequantize_kv(k), dequantize_kv(v), lengths, scale=scale)
