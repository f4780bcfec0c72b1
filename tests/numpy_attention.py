"""A float64 NumPy definition of GQA decode attention: the independent check of every
attention op's XLA path (which is also the reference its kernels are tested against)."""

import numpy as np


def attention_f64(q, k, v, visible, scale: float, v_layout: str = "sh") -> np.ndarray:
    """q [B, N, H], k [B, K, S, H], v [B, K, S, H] ("sh") or [B, K, H, S] ("hs"), visible
    bool[B, K, S] -> f64[B, N, H]; a head that sees nothing gives 0."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    if v_layout == "hs":
        v = v.swapaxes(2, 3)
    b, n, h = q.shape
    kh = k.shape[1]
    out = np.zeros((b, n, h))
    for row in range(b):
        for head in range(n):
            j = head // (n // kh)
            seen = np.asarray(visible[row, j], bool)
            if not seen.any():
                continue
            s = k[row, j][seen] @ q[row, head] * scale
            p = np.exp(s - s.max())
            out[row, head] = p @ v[row, j][seen] / p.sum()
    return out


def prefix_visible(lengths, k_heads: int, slots: int) -> np.ndarray:
    """bool[B, K, S]: row b sees slots [0, lengths[b]) (lengths clamped into [0, S])."""
    lengths = np.clip(np.asarray(lengths), 0, slots)
    return np.broadcast_to((np.arange(slots)[None, :] < lengths[:, None])[:, None, :],
                           (len(lengths), k_heads, slots))
