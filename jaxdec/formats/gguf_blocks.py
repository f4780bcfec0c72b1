"""Keep a GGUF file's own quantised blocks when they map onto `QArray` exactly.

GGUF stores a linear weight in HF orientation, rows [out, in], each row a run of blocks of
32 values along `in` (the contraction axis). A block is:

    Q8_0: f16 d, i8 q[32]                       value = d * q
    Q4_0: f16 d, u8 qs[16]                      value = d * (nibble - 8)
    Q4_1: f16 d, f16 m, u8 qs[16]               value = d * nibble + m

where element j < 16 is the low nibble of qs[j] and element j + 16 its high nibble.
These are `QArray`s of the logical [in, out] matrix with group_size 32: scale d, offset
None / -8d / m, and the nibbles repacked into our along-K pairs. The mapping is exact:
d * q (an 11-bit significand times a small integer) is exact in float32, -8d is exact in
float16, so `dequantize` reproduces `gguf.quants.dequantize` bit for bit (Q4_1 with the
same single rounding of d * q + m; the sign of an exact zero may differ for Q4_0).
Numpy only: the result holds numpy arrays; `jax.device_put` it when it is needed.
"""

from __future__ import annotations

import gguf
import numpy as np

from jaxdec.errors import JaxdecError
from jaxdec.formats.qarray import QArray, validate

_Q = gguf.GGMLQuantizationType
BLOCK = 32
# GGML type -> (bits, bytes per block)
_BLOCK_TYPES = {_Q.Q8_0: (8, 34), _Q.Q4_0: (4, 18), _Q.Q4_1: (4, 20)}


def gguf_block_bits(ggml_type: int) -> int | None:
    """4 or 8 for the GGML types that map onto a QArray (Q4_0, Q4_1, Q8_0), else None."""
    entry = _BLOCK_TYPES.get(_ggml_type(ggml_type))
    return None if entry is None else entry[0]


def _ggml_type(ggml_type: int):
    try:
        return _Q(int(ggml_type))
    except ValueError:
        return None


def _f16_field(blocks: np.ndarray, start: int) -> np.ndarray:
    """u8[out, nb, bytes] -> f16[nb, out], the half float at byte `start` of each block."""
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0].T


def _lane_mask(pattern: str) -> np.uint64:
    return np.uint64(int(pattern * 4, 16))


def _repack_nibbles(qs: np.ndarray) -> np.ndarray:
    """u8[out, nb, 16] GGUF nibbles (element j low of byte j, j + 16 high) -> u8[in // 2, out]
    along-K pairs (element 2p low, 2p + 1 high).

    Read bytes (2p, 2p + 1) as one little-endian 16-bit lane: its nibbles, low to high, are
    elements 2p, 2p + 16, 2p + 1, 2p + 17. Swapping the middle two gives a lane whose low
    byte is our pair p and whose high byte is our pair 8 + p; four lanes per uint64.
    """
    out_dim, n_blocks = qs.shape[:2]
    x = np.ascontiguousarray(qs).view("<u8")  # u64[out, nb, 2]
    four = np.uint64(4)
    lanes = ((x & _lane_mask("000F")) | ((x >> four) & _lane_mask("00F0"))
             | ((x << four) & _lane_mask("0F00")) | (x & _lane_mask("F000")))
    pair_bytes = lanes.view(np.uint8).reshape(out_dim, n_blocks, 8, 2)  # [.., p, low/high]
    # (block, low/high, p, out): row block * 16 + half * 8 + p of the [in // 2, out] result
    return np.ascontiguousarray(pair_bytes.transpose(1, 3, 2, 0)).reshape(n_blocks * 16, out_dim)


def qarray_from_gguf(raw: np.ndarray, ggml_type: int, out_dim: int, in_dim: int) -> QArray | None:
    """The logical [in_dim, out_dim] weight (K = in, N = out) of a GGUF tensor stored as
    [out_dim, in_dim] rows, keeping its blocks; None for GGML types other than Q8_0, Q4_0
    and Q4_1 (and for a Q4_0 scale so large that -8d overflows float16).

    `raw` is the tensor's bytes as uint8, any shape (e.g. `GGUFReader(...).tensors[i].data`).
    """
    qtype = _ggml_type(ggml_type)
    if qtype not in _BLOCK_TYPES:
        return None
    bits, block_bytes = _BLOCK_TYPES[qtype]
    if in_dim % BLOCK:
        raise JaxdecError(f"{qtype.name} tensor: in_dim {in_dim} is not a multiple of {BLOCK}")
    n_blocks = in_dim // BLOCK
    if raw.dtype != np.uint8 or raw.size != out_dim * n_blocks * block_bytes:
        raise JaxdecError(f"{qtype.name} tensor [{out_dim}, {in_dim}]: expected "
                          f"{out_dim * n_blocks * block_bytes} uint8 bytes, got {raw.size} {raw.dtype}")
    blocks = raw.reshape(out_dim, n_blocks, block_bytes)
    d = _f16_field(blocks, 0)  # f16[in // 32, out]
    if qtype == _Q.Q8_0:
        q = np.ascontiguousarray(blocks[..., 2:].view(np.int8).reshape(out_dim, in_dim).T)
        offset = None
    elif qtype == _Q.Q4_0:
        if np.any(np.abs(d.astype(np.float32)) > 65504.0 / 8):
            return None
        q, offset = _repack_nibbles(blocks[..., 2:]), np.ascontiguousarray(d * np.float16(-8))
    else:
        q, offset = _repack_nibbles(blocks[..., 4:]), np.ascontiguousarray(_f16_field(blocks, 2))
    qa = QArray(q=q, scale=np.ascontiguousarray(d), offset=offset, bits=bits,
                group_size=BLOCK, shape=(int(in_dim), int(out_dim)), n_in=1)
    return validate(qa)
