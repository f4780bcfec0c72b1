"""llama.cpp's block formats, quantised byte for byte as llama.cpp does, and its recipes.

`quantize_blocks(w, qtype)` turns float32 rows into GGUF blocks identical to those of ggml's
reference quantisers (`quantize_row_*_ref` in ggml-quants.c: what `llama_model_quantize`
runs when no importance matrix is given). Dequantisation is `gguf.quants.dequantize`.

    Q8_0  32 values: f16 d, i8 q[32]                                     8.5 bits/weight
    Q6_K 256 values: 16 sub-blocks of 16, i8 scale each, q in [-32, 32)  6.5625
    Q5_K 256 values: 8 sub-blocks of 32, 6-bit scale and min, q < 32     5.5
    Q4_K 256 values: 8 sub-blocks of 32, 6-bit scale and min, q < 16     4.5
    Q3_K 256 values: 16 sub-blocks of 16, 6-bit scale, q in [-4, 4)      3.4375
    Q2_K 256 values: 16 sub-blocks of 16, 4-bit scale and min, q < 4     2.625

Q4_0/Q4_1/Q5_0/Q5_1 (llama.cpp's fallbacks when a row is not a multiple of 256), BF16, F16
and F32 come from `gguf.quants.quantize`, which follows ggml's reference for those types.

Exactness. ggml-base is compiled without fast-math or FMA contraction, so its quantisers
are plain IEEE float32: every operation rounded once, sums accumulated element by element
in index order. Here every array is float32 and every expression keeps the C operation
order; a sum over a sub-block is an explicit loop (`_seq_sum`), never numpy's pairwise
sum; `nearest_int` is llama.cpp's own trick (add 1.5 * 2^23 and read the mantissa bits):
round-half-even within +-2^22 and the same bits beyond; Q8_0 rounds half away from zero
(`roundf`); scales go through float16 with round-to-nearest-even. The C code loops over
sub-blocks one at a time; here all sub-blocks move together, each element of a sub-block
is a row of an [S, M] array (S values per sub-block, M sub-blocks), and each data-dependent
branch becomes a masked update (`np.where`) in the same iteration order.

Recipes (`recipe_types`) follow `llama_tensor_get_type` in llama.cpp's llama-quant.cpp for
dense llama/qwen2-like models; `dq3_recipe` allocates bits by measured sensitivity.
"""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import re
from typing import Callable, Mapping, Sequence

import gguf
import numpy as np

from jaxdec.errors import JaxdecError

_Q = gguf.GGMLQuantizationType
F32 = np.float32
QK_K = 256
_ROWS_PER_CHUNK_ELEMS = 1 << 19  # values quantised per numpy pass (bounds temporaries)
_THREADS = min(4, os.cpu_count() or 1)  # chunks quantised in parallel


# --------------------------------------------------------------------------------------------
# Types
# --------------------------------------------------------------------------------------------

def qtype_of(qtype: str | int | gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
    """A GGML type from its name ("Q4_K", case-insensitive) or enum value."""
    try:
        if isinstance(qtype, str):
            return _Q[qtype.upper()]
        return _Q(int(qtype))
    except (KeyError, ValueError):
        raise JaxdecError(f"unknown GGML type {qtype!r}") from None


def bits_per_weight(qtype) -> float:
    """Storage bits per value of a GGML type (Q4_K: 4.5)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype_of(qtype)]
    return 8.0 * size / block


def block_size(qtype) -> int:
    return gguf.GGML_QUANT_SIZES[qtype_of(qtype)][0]


# --------------------------------------------------------------------------------------------
# Shared numerics: llama.cpp's float32 helpers over [S, M] sub-block arrays
# --------------------------------------------------------------------------------------------

def _nearest_int(v: np.ndarray) -> np.ndarray:
    """f32[...] -> i32[...]: ggml's nearest_int, bit for bit (1.5 * 2^23 trick)."""
    bits = (np.asarray(v, F32) + F32(12582912.0)).view(np.int32)
    return (bits & 0x7FFFFF) - 0x400000


def _clamp(v: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """i32 -> f32, MAX(lo, MIN(hi, v)) (the quant levels, as floats for the float sums)."""
    return np.clip(v, lo, hi).astype(F32)


def _seq_sum(terms: np.ndarray) -> np.ndarray:
    """f32[S, M] -> f32[M]: ((0 + t0) + t1) + ... in float32, as `for (i..) s += t[i]`."""
    acc = terms[0] + F32(0)
    for t in terms[1:]:
        acc += t
    return acc


def _fp16(v: np.ndarray) -> np.ndarray:
    """f32 -> f16 (round to nearest even, overflow to inf), as GGML_FP32_TO_FP16."""
    with np.errstate(over="ignore"):
        return np.asarray(v, F32).astype(np.float16)


def _abs_argmax(x: np.ndarray) -> np.ndarray:
    """f32[S, M] -> f32[M]: the signed value of largest magnitude (the first on ties)."""
    return np.take_along_axis(x, np.abs(x).argmax(axis=0)[None], axis=0)[0]


def _make_qx_quants(x: np.ndarray, nmax: int):
    """make_qx_quants(rmse_type=1, no weights) for every column of f32[S, M]: a symmetric
    scale searched over 19 candidates, weights x^2. Returns (L f32[S, M] in [0, 2 nmax),
    scale f32[M])."""
    vmax = _abs_argmax(x)
    zero = np.abs(vmax) < F32(1e-15)
    w = x * x

    def levels(iscale):
        l = _clamp(_nearest_int(iscale * x), -nmax, nmax - 1)
        return l, _seq_sum(w * x * l), _seq_sum(w * l * l)

    l, sumlx, suml2 = levels(F32(-nmax) / vmax)
    big_l = l + F32(nmax)
    scale = np.where(suml2 != 0, sumlx / suml2, F32(0))
    best = scale * sumlx
    for step in (*range(-9, 0), *range(1, 10)):
        l, sumlx, suml2 = levels(-(F32(nmax) + F32(0.1) * F32(step)) / vmax)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        big_l = np.where(better, l + F32(nmax), big_l)
        scale = np.where(better, sumlx / suml2, scale)
        best = np.where(better, scale * sumlx, best)
    return np.where(zero, F32(0), big_l), np.where(zero, F32(0), scale)


def _make_q3_quants(x: np.ndarray, nmax: int):
    """make_q3_quants(do_rmse=true) for every column of f32[S, M]: start from the max-based
    scale, then up to 5 passes of coordinate descent on each level (weights x^2). A pass that
    changes nothing leaves the state as it was, so running all 5 everywhere is the C loop's
    early exit. Returns (L f32[S, M] in [0, 2 nmax), scale f32[M])."""
    vmax = _abs_argmax(x)
    zero = np.abs(vmax) < F32(1e-15)
    w = x * x
    L = _clamp(_nearest_int((F32(-nmax) / vmax) * x), -nmax, nmax - 1)
    sumlx, suml2 = _seq_sum(w * x * L), _seq_sum(w * L * L)
    for _ in range(5):
        for i in range(x.shape[0]):
            xi, wi, li = x[i], w[i], L[i]
            slx = sumlx - wi * xi * li
            sl2 = suml2 - wi * li * li
            new = _clamp(_nearest_int(xi * sl2 / slx), -nmax, nmax - 1)
            slx_new = slx + wi * xi * new
            sl2_new = sl2 + wi * new * new
            take = ((slx > 0) & (new != li) & (sl2_new > 0)
                    & (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new))
            L[i] = np.where(take, new, li)
            sumlx = np.where(take, slx_new, sumlx)
            suml2 = np.where(take, sl2_new, suml2)
    scale = np.where(suml2 > 0, sumlx / suml2, F32(0))
    return np.where(zero, F32(0), L + F32(nmax)), np.where(zero, F32(0), scale)


def _err(d: np.ndarray, use_mad: bool) -> np.ndarray:
    return np.abs(d) if use_mad else d * d


def _make_qkx2_quants(x, w, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool):
    """make_qkx2_quants for every column of f32[S, M] with weights w f32[S, M]: an affine
    (scale, min <= 0) fit, searching nstep + 1 scales; each improvement also moves the min
    the next candidates are computed from. Returns (L f32[S, M] in [0, nmax], scale f32[M],
    the_min f32[M] = -min)."""
    lo0 = np.minimum(x.min(axis=0), F32(0))
    hi = x.max(axis=0)
    flat = hi == lo0
    sum_w, sum_x = _seq_sum(w), _seq_sum(w * x)
    iscale = F32(nmax) / (hi - lo0)
    scale = F32(1) / iscale
    L = _clamp(_nearest_int(iscale * (x - lo0)), 0, nmax)
    best = _seq_sum(w * _err(scale * L + lo0 - x, use_mad))
    lo = lo0
    for step in range(nstep + 1):
        iscale = (F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)) / (hi - lo)
        l = _clamp(_nearest_int(iscale * (x - lo)), 0, nmax)
        wl = w * l
        sum_l, sum_l2, sum_xl = _seq_sum(wl), _seq_sum(wl * l), _seq_sum(wl * x)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        clip = this_min > 0
        this_min = np.where(clip, F32(0), this_min)
        this_scale = np.where(clip, sum_xl / sum_l2, this_scale)
        cur = _seq_sum(w * _err(this_scale * l + this_min - x, use_mad))
        better = (D > 0) & (cur < best)
        L = np.where(better, l, L)
        best = np.where(better, cur, best)
        scale = np.where(better, this_scale, scale)
        lo = np.where(better, this_min, lo)
    return (np.where(flat, F32(0), L), np.where(flat, F32(0), scale),
            -np.where(flat, lo0, lo))


def _subblocks(x: np.ndarray, size: int) -> np.ndarray:
    """f32[nb, 256] super-blocks -> f32[size, nb * 256 // size]: column m is sub-block m."""
    return np.ascontiguousarray(x.reshape(-1, size).T)


def _requant(x, d, offset, L_prev, lo: int, hi: int):
    """The final pass of every k-quant: L = clamp(nearest((x + offset) / d)) for sub-blocks
    whose d != 0; the others keep the search's levels. x f32[S, M]; d, offset f32[M]."""
    l = _clamp(_nearest_int((x + offset) / d), lo, hi)
    return np.where(d != 0, l, L_prev).astype(np.int32)


def _pack2(L: np.ndarray) -> np.ndarray:
    """i32[nb, 256] 2-bit levels -> u8[nb, 64]: byte 32h + l holds L[128h + l + 32k] << 2k."""
    q = L.reshape(-1, 2, 4, 32)
    return (q[:, :, 0] | q[:, :, 1] << 2 | q[:, :, 2] << 4 | q[:, :, 3] << 6).reshape(-1, 64)


def _pack_scales_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """u8-valued i32[nb, 8] 6-bit scales and mins -> u8[nb, 12] (get_scale_min_k4's layout)."""
    out = np.empty((ls.shape[0], 12), np.int32)
    out[:, 0:4] = ls[:, :4] | (ls[:, 4:] >> 4) << 6
    out[:, 4:8] = lm[:, :4] | (lm[:, 4:] >> 4) << 6
    out[:, 8:12] = (ls[:, 4:] & 0xF) | (lm[:, 4:] & 0xF) << 4
    return out


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    """f16[nb] -> u8[nb, 2]."""
    return np.ascontiguousarray(v).view(np.uint8).reshape(-1, 2)


def _u8(*parts: np.ndarray) -> np.ndarray:
    return np.concatenate([p.astype(np.uint8) for p in parts], axis=1)


# --------------------------------------------------------------------------------------------
# The block quantisers: f32[nb, block] -> u8[nb, bytes per block]
# --------------------------------------------------------------------------------------------

def _q8_0(x: np.ndarray) -> np.ndarray:
    d = np.abs(x).max(axis=1) / F32(127)
    inv = np.where(d != 0, F32(1) / np.where(d != 0, d, F32(1)), F32(0))
    v = x * inv[:, None]
    t = np.trunc(v)
    q = np.where(np.abs(v - t) == F32(0.5), t + np.sign(v), np.round(v))  # roundf
    return _u8(_f16_bytes(_fp16(d)), q.astype(np.int8).view(np.uint8))


def _q6_k(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    xs = _subblocks(x, 16)
    L, scales = _make_qx_quants(xs, 32)
    scales = scales.reshape(nb, 16)
    max_scale = _abs_argmax(scales.T)
    empty = np.abs(max_scale) < F32(1e-15)
    iscale = F32(-128) / np.where(empty, F32(1), max_scale)
    d16 = _fp16(F32(1) / iscale)
    sc = np.minimum(127, _nearest_int(iscale[:, None] * scales)).astype(np.int8)
    d = (d16.astype(F32)[:, None] * sc.astype(F32)).reshape(-1)
    L = _requant(xs, d, F32(0), L - F32(32), -32, 31) + 32
    L = L.T.reshape(nb, 2, 4, 32)  # [block, half, quarter, l]
    ql = (L[:, :, 0:2] & 0xF) | (L[:, :, 2:4] & 0xF) << 4
    qh = (L[:, :, 0] >> 4) | (L[:, :, 1] >> 4) << 2 | (L[:, :, 2] >> 4) << 4 | (L[:, :, 3] >> 4) << 6
    block = _u8(ql.reshape(nb, 128), qh.reshape(nb, 64), sc.view(np.uint8), _f16_bytes(d16))
    block[empty] = 0
    return block


def _qkx_block(x: np.ndarray, nmax: int, rmin: float, nstep: int):
    """Q4_K/Q5_K: 8 sub-blocks of 32 with av_x + |x| weights -> (L i32[nb, 256], 12 scale
    bytes, d16, dmin16)."""
    nb = x.shape[0]
    xs = _subblocks(x, 32)
    av_x = np.sqrt(_seq_sum(xs * xs) / F32(32))
    L, scales, mins = _make_qkx2_quants(xs, av_x + np.abs(xs), nmax, rmin, 0.1, nstep, False)
    scales, mins = scales.reshape(nb, 8), mins.reshape(nb, 8)
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    max_min = np.maximum(mins.max(axis=1), F32(0))
    inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0))
    inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0))
    ls = np.minimum(63, _nearest_int(inv_scale[:, None] * scales) & 0xFF)
    lm = np.minimum(63, _nearest_int(inv_min[:, None] * mins) & 0xFF)
    d16, dmin16 = _fp16(max_scale / F32(63)), _fp16(max_min / F32(63))
    d = (d16.astype(F32)[:, None] * ls.astype(F32)).reshape(-1)
    dm = (dmin16.astype(F32)[:, None] * lm.astype(F32)).reshape(-1)
    L = _requant(xs, d, dm, L, 0, nmax)
    return L.T.reshape(nb, 256), _pack_scales_k4(ls, lm), d16, dmin16


def _q4_k(x: np.ndarray) -> np.ndarray:
    L, scales, d16, dmin16 = _qkx_block(x, 15, -1.0, 20)
    q = L.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | q[:, :, 1] << 4).reshape(-1, 128)
    return _u8(_f16_bytes(d16), _f16_bytes(dmin16), scales, qs)


def _q5_k(x: np.ndarray) -> np.ndarray:
    L, scales, d16, dmin16 = _qkx_block(x, 31, -0.5, 15)
    q = L.reshape(-1, 4, 2, 32)  # [block, pair p, half, j]: L[64p + 32 half + j]
    qs = ((q[:, :, 0] & 0xF) | (q[:, :, 1] & 0xF) << 4).reshape(-1, 128)
    hi = q >> 4  # bit 2p + half of qh[j]
    shifts = (2 * np.arange(4)[:, None] + np.arange(2)[None, :])[None, :, :, None]
    qh = (hi << shifts).sum(axis=(1, 2))
    return _u8(_f16_bytes(d16), _f16_bytes(dmin16), scales, qh, qs)


def _q3_k(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    xs = _subblocks(x, 16)
    L, scales = _make_q3_quants(xs, 4)
    scales = scales.reshape(nb, 16)
    max_scale = _abs_argmax(scales.T)
    live = max_scale != 0
    iscale = np.where(live, F32(-32) / np.where(live, max_scale, F32(1)), F32(0))
    l = ((_nearest_int(iscale[:, None] * scales) + 128) & 0xFF) - 128  # int8_t
    l = np.where(live[:, None], np.clip(l, -32, 31) + 32, 0)
    packed = np.zeros((nb, 12), np.int32)
    packed[:, :8] = (l[:, :8] & 0xF) | (l[:, 8:] & 0xF) << 4
    packed[:, 8:] = ((l >> 4).reshape(nb, 4, 4) << (2 * np.arange(4))[None, :, None]).sum(axis=1)
    d16 = _fp16(np.where(live, F32(1) / np.where(live, iscale, F32(1)), F32(0)))
    d = (d16.astype(F32)[:, None] * (l - 32).astype(F32)).reshape(-1)
    L = _requant(xs, d, F32(0), L - F32(4), -4, 3) + 4
    L = L.T.reshape(nb, 256)
    hmask = ((L > 3).reshape(nb, 8, 32) << np.arange(8)[None, :, None]).sum(axis=1)
    return _u8(hmask, _pack2(L & 3), packed, _f16_bytes(d16))


def _q2_k(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    xs = _subblocks(x, 16)
    L, scales, mins = _make_qkx2_quants(xs, np.abs(xs), 3, -0.5, 0.1, 15, True)
    scales, mins = scales.reshape(nb, 16), mins.reshape(nb, 16)
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    max_min = np.maximum(mins.max(axis=1), F32(0))
    inv_scale, inv_min = F32(15) / max_scale, F32(15) / max_min
    sc = np.where((max_scale > 0)[:, None], _nearest_int(inv_scale[:, None] * scales) & 0xFF, 0)
    lm = np.where((max_min > 0)[:, None], _nearest_int(inv_min[:, None] * mins), 0)
    sc = (sc | lm << 4) & 0xFF
    d16 = _fp16(np.where(max_scale > 0, max_scale / F32(15), F32(0)))
    dmin16 = _fp16(np.where(max_min > 0, max_min / F32(15), F32(0)))
    d = (d16.astype(F32)[:, None] * (sc & 0xF).astype(F32)).reshape(-1)
    dm = (dmin16.astype(F32)[:, None] * (sc >> 4).astype(F32)).reshape(-1)
    L = _requant(xs, d, dm, L, 0, 3).T.reshape(nb, 256)
    return _u8(sc, _pack2(L), _f16_bytes(d16), _f16_bytes(dmin16))


_OURS: dict[gguf.GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    _Q.Q8_0: _q8_0, _Q.Q6_K: _q6_k, _Q.Q5_K: _q5_k, _Q.Q4_K: _q4_k, _Q.Q3_K: _q3_k, _Q.Q2_K: _q2_k,
}
_GGUFS = frozenset({_Q.F32, _Q.F16, _Q.BF16, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1})
SUPPORTED = frozenset(_OURS) | _GGUFS


def quantize_blocks(w: np.ndarray,  # f32[rows, n_per_row]
                    qtype: str | gguf.GGMLQuantizationType) -> np.ndarray:  # u8[rows, bytes_per_row]
    """Quantise rows to GGUF blocks, byte-identical to llama.cpp's reference quantiser
    (F32/F16/BF16 rows come back as their raw bytes). A one-line JaxdecError for a type this
    module cannot write, a row length that is not a multiple of the type's block, or a
    non-finite value."""
    q = qtype_of(qtype)
    if q not in SUPPORTED:
        names = ", ".join(sorted(t.name for t in SUPPORTED))
        raise JaxdecError(f"cannot quantise to {q.name} (supported: {names})")
    w = np.asarray(w, F32)
    if w.ndim != 2:
        raise JaxdecError(f"quantize_blocks takes [rows, n_per_row] rows, got shape {w.shape}")
    block, size = gguf.GGML_QUANT_SIZES[q]
    rows, n = w.shape
    if n % block:
        raise JaxdecError(f"cannot quantise rows of {n} values to {q.name}: "
                          f"the row length must be a multiple of {block}")
    if not np.isfinite(w).all():
        raise JaxdecError(f"cannot quantise to {q.name}: the rows hold NaN or infinite values")
    if q in _GGUFS:
        with np.errstate(over="ignore"):  # float16 overflows to inf, as in ggml
            return np.ascontiguousarray(gguf.quants.quantize(w, q)).view(np.uint8).reshape(rows, -1)
    out = np.empty((rows, n // block * size), np.uint8)
    step = max(1, _ROWS_PER_CHUNK_ELEMS // max(n, 1))

    def run(r: int) -> None:  # rows r..r+step; numpy releases the GIL inside each op
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            out[r:r + step] = _OURS[q](w[r:r + step].reshape(-1, block)).reshape(len(w[r:r + step]), -1)

    starts = range(0, rows, step)
    if len(starts) == 1 or _THREADS == 1:
        for r in starts:
            run(r)
    else:
        with concurrent.futures.ThreadPoolExecutor(_THREADS) as pool:
            list(pool.map(run, starts))
    return out


def dequantize_blocks(blocks: np.ndarray, qtype) -> np.ndarray:
    """u8[rows, bytes_per_row] -> f32[rows, n_per_row], through `gguf.quants.dequantize`."""
    return np.asarray(gguf.quants.dequantize(blocks, qtype_of(qtype)), F32)


# --------------------------------------------------------------------------------------------
# Recipes: the type of every tensor, as llama.cpp's llama_tensor_get_type chooses it
# --------------------------------------------------------------------------------------------
# A plain name is uniform: every quantisable weight gets that type, except llama.cpp's rule
# for all k-quant and Q8_0 file types: output.weight (token_embd.weight too when the two are
# tied, i.e. output.weight is absent) gets Q6_K (Q8_0 in Q8_0 files, and in any file whose
# rows are not a multiple of the type's block). "Q8_0", "Q6_K", "Q5_K" and "Q3_K" are then
# exactly llama.cpp's Q8_0, Q6_K, Q5_K_S and Q3_K_S; "Q4_K" and "Q2_K" are llama.cpp's
# Q4_K_S and Q2_K without their attn_v / ffn_down / attn_output upgrades.
# Tensors llama.cpp never quantises (1-D, norms, non-"weight") keep their source type.
UNIFORM = ("Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K")
RECIPES = (*UNIFORM, "Q4_K_M", "Q3_K_M", "DQ3_K_M")
# general.file_type (llama_ftype) of a file written with each recipe; DQ3_K_M is labelled Q3_K_M
FILE_TYPES = {"Q8_0": 7, "Q6_K": 18, "Q5_K": 16, "Q4_K": 14, "Q3_K": 11, "Q2_K": 10,
              "Q4_K_M": 15, "Q3_K_M": 12, "DQ3_K_M": 12}
DQ3_CANDIDATES = ("Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0")
# a row length that does not fit a 256-block type falls back to a 32-block type (llama.cpp)
KL_WINDOWS = 4  # calibration windows on which `kl_sensitivity` measures each tensor
_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_NEVER = ("_norm.weight", "ffn_gate_inp.weight", "position_embd.weight", "token_types.weight",
          "ssm_conv1d", "altup", "laurel", "per_layer_model_proj", "attn_rel_b.weight")
_ATTN_V = ("attn_qkv.weight", "attn_kv_b.weight", "attn_v.weight")
_LAYER = re.compile(r"^blk\.(\d+)\.")


def is_quantisable(name: str, shape: Sequence[int]) -> bool:
    """tensor_allows_quantization, for the tensors of dense decoder models."""
    return len(shape) >= 2 and name.endswith("weight") and not any(s in name for s in _NEVER)


def _category(name: str) -> str:
    if name in ("output.weight", "token_embd.weight", "per_layer_token_embd.weight"):
        return "output" if name == "output.weight" else "token_embd"
    for key in (*_ATTN_V, "attn_k.weight", "attn_q.weight", "attn_output.weight"):
        if key in name:
            return "attn_v" if key in _ATTN_V else key[:-len(".weight")]
    return next((key for key in ("ffn_up", "ffn_gate", "ffn_down") if key in name), "other")


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _layer_order(name: str) -> tuple[int, str]:
    """llama.cpp's weight order: by layer (non-layer tensors first), then by name."""
    m = _LAYER.match(name)
    return (int(m.group(1)) if m else -1, name)


def fallback_type(qtype: str, n_per_row: int) -> str:
    """tensor_type_fallback: the type a row of n_per_row values gets instead of qtype."""
    if n_per_row % block_size(qtype) == 0:
        return qtype
    q = _FALLBACK.get(qtype, qtype)
    return q if n_per_row % block_size(q) == 0 else "F16"


def _chosen(recipe: str, cat: str, n_per_row: int, tied: bool, i_v: int, n_v: int,
            i_down: int, n_layer: int) -> str:
    """llama_tensor_get_type_impl for one quantisable tensor of a dense, non-Falcon model."""
    default = recipe.removesuffix("_M")
    if cat == "output" or (tied and cat == "token_embd"):
        if n_per_row % block_size(default):
            return "Q8_0"
        return default if default == "Q8_0" else "Q6_K"
    if recipe == "Q4_K_M" and cat in ("attn_v", "ffn_down"):
        i, n = (i_v, n_v) if cat == "attn_v" else (i_down, n_layer)
        return "Q6_K" if _use_more_bits(i, n) else default
    if recipe == "Q3_K_M":
        if cat == "attn_v":
            return "Q5_K" if i_v < 2 else "Q4_K"
        if cat == "ffn_down":
            return "Q5_K" if i_down < n_layer // 16 else "Q4_K"
        if cat == "attn_output":
            return "Q4_K"
    return default


def llama_types(tensors: Sequence, recipe: str, *, n_layer: int, is_70b: bool = False) -> dict[str, str]:
    """{name: type} for `tensors` (objects with .name, .shape in numpy order and .qtype, such
    as `read_gguf_header(path).tensors.values()`) under a uniform recipe, Q4_K_M or Q3_K_M.
    Per-layer rules count attn_v / ffn_down tensors in llama.cpp's (layer, name) order."""
    if recipe not in RECIPES or recipe == "DQ3_K_M":
        raise JaxdecError(f"unknown recipe {recipe!r} (llama.cpp's: {', '.join(RECIPES[:-1])})")
    names = {t.name for t in tensors}
    tied = "output.weight" not in names
    n_v = sum(_category(t.name) == "attn_v" for t in tensors)
    i_v = i_down = 0
    types = {}
    for t in sorted(tensors, key=lambda t: _layer_order(t.name)):
        if not is_quantisable(t.name, t.shape):
            types[t.name] = qtype_of(t.qtype).name
            continue
        cat = _category(t.name)
        q = _chosen(recipe, cat, t.shape[-1], tied, i_v, n_v, i_down, n_layer)
        if is_70b and cat == "attn_v" and q in ("Q3_K", "Q4_K"):
            q = "Q5_K"  # llama.cpp: a 70B model's attn_v is 8x smaller than attn_q
        types[t.name] = fallback_type(q, t.shape[-1])
        i_v += cat == "attn_v"
        i_down += cat == "ffn_down"
    return {t.name: types[t.name] for t in tensors}


def bits_per_weight_of(types: Mapping[str, str], sizes: Mapping[str, int]) -> float:
    """The mean storage bits per value of the tensors in `types` (sizes: values per tensor)."""
    total = sum(sizes[n] for n in types)
    return sum(sizes[n] * bits_per_weight(q) for n, q in types.items()) / total


# --------------------------------------------------------------------------------------------
# DQ3_K_M: bits allocated by measured sensitivity, within Q3_K_M's budget
# --------------------------------------------------------------------------------------------

def dq3_recipe(sizes: Mapping[str, int], sensitivity: Mapping[str, Mapping[str, float]],
               budget_bpw: float) -> dict[str, str]:
    """Greedy knapsack: every tensor starts at its cheapest candidate type (Q3_K, or the
    fallback of Q3_K for its row length); then, while the budget allows, the move (one
    tensor to one dearer candidate) with the largest sensitivity reduction per extra bit is
    taken. sizes: {name: values}; sensitivity: {name: {type: error}}; budget_bpw: the mean
    bits per value the result may reach. Ties go to the first name in sorted order."""
    names = sorted(sizes)
    bits = {q: bits_per_weight(q) for n in names for q in sensitivity[n]}
    current = {n: min(sensitivity[n], key=lambda q: (bits[q], sensitivity[n][q])) for n in names}
    budget = budget_bpw * sum(sizes.values()) * (1 + 1e-12)
    used = sum(sizes[n] * bits[current[n]] for n in names)
    if used > budget:
        raise JaxdecError(f"a budget of {budget_bpw:.4f} bits per weight is below the cheapest "
                          f"candidates' {used / sum(sizes.values()):.4f}")
    while True:
        best = None
        for n in names:
            s0, b0 = sensitivity[n][current[n]], bits[current[n]]
            for q, s in sensitivity[n].items():
                extra = sizes[n] * (bits[q] - b0)
                if extra <= 0 or s >= s0 or used + extra > budget:
                    continue
                if best is None or (s0 - s) / extra > best[0]:
                    best = ((s0 - s) / extra, n, q, extra)
        if best is None:
            return {n: current[n] for n in sizes}
        _, n, q, extra = best
        current[n], used = q, used + extra


def tensor_sensitivity(w: np.ndarray, qtypes: Sequence[str], importance: np.ndarray | None = None,
                       *, max_values: int = 1 << 16, scale: float | None = None) -> dict[str, float]:
    """{type: ||dequant(quant(W)) - W||^2 / ||W||^2} for f32[rows, n] W, each column's squared
    error weighted by importance f32[n] when given (e.g. the diagonal of X^T X over
    calibration inputs). Measured on evenly spaced rows, at most max_values values. With
    `scale`, the weighted error itself times scale instead (absolute: with scale = all rows /
    rows measured, an estimate over the whole tensor that compares across tensors)."""
    sample = np.asarray(w[_sample_rows(w.shape[0], w.shape[1], max_values)], F32)
    col = np.ones(w.shape[1], np.float64) if importance is None else np.asarray(importance, np.float64)
    if col.shape != (w.shape[1],):
        raise JaxdecError(f"importance has shape {col.shape}, expected ({w.shape[1]},)")
    norm = float(np.square(sample, dtype=np.float64).sum(axis=0) @ col)
    out = {}
    for q in qtypes:
        back = round_trip(sample, q)
        err = float(np.square(back - sample, dtype=np.float64).sum(axis=0) @ col)
        out[q] = err * scale if scale is not None else (err / norm if norm > 0 else 0.0)
    return out


def round_trip(rows: np.ndarray, qtype) -> np.ndarray:
    """f32[rows, n_per_row] quantised to qtype and dequantised (what a GGUF reader sees)."""
    rows = np.asarray(rows, F32)
    return dequantize_blocks(quantize_blocks(rows, qtype), qtype).reshape(rows.shape)


def _sample_rows(n_rows: int, n_per_row: int, max_values: int) -> np.ndarray:
    """Evenly spaced row indices, at most max_values values (at least one row)."""
    rows = max(1, min(n_rows, max_values // n_per_row))
    return np.linspace(0, n_rows - 1, rows).round().astype(np.int64)


# --------------------------------------------------------------------------------------------
# Recipes of a GGUF file
# --------------------------------------------------------------------------------------------

def recipe_types(src: str | pathlib.Path, recipe: str, *,
                 importance: Mapping[str, np.ndarray] | None = None,
                 measured: Mapping[str, float] | None = None, max_values: int = 1 << 16,
                 progress: Callable[[int, int], None] | None = None) -> dict[str, str]:
    """{tensor name: type} for every tensor of the GGUF file `src` under `recipe` (one of
    RECIPES). DQ3_K_M keeps Q3_K_M's output / tied-embedding type and measures, for every
    other quantisable tensor, `tensor_sensitivity` (on at most max_values of its values) over
    DQ3_CANDIDATES, then runs `dq3_recipe` with Q3_K_M's bits per weight over those tensors
    as the budget. Without `importance` the sensitivity is each tensor's relative error
    (data-free); with it (f32[n_per_row] for every such tensor, e.g. `fisher_importance`),
    the importance-weighted squared error of the whole tensor, which compares tensors by
    their effect on the loss. With `measured` ({name: the output KL with that tensor alone at
    its cheapest candidate}, `kl_sensitivity`), a tensor's sensitivity at type q is that
    measured KL scaled by its relative error at q over its relative error at the cheapest
    (the KL of small independent perturbations grows with their energy).
    progress(done, total) follows the measured tensors."""
    from jaxdec.checkpoint.gguf_reader import read_gguf_header

    header = read_gguf_header(src)
    meta, tensors = header.metadata, list(header.tensors.values())
    arch = str(meta.get("general.architecture", ""))
    if arch == "falcon" or int(meta.get(f"{arch}.expert_count", 0) or 0) > 1:
        raise JaxdecError(f"{src}: recipes follow llama.cpp's rules for dense non-Falcon "
                          f"models; {arch!r} with experts or Falcon is not supported")
    n_layer = int(meta.get(f"{arch}.block_count", 0))
    n_head, n_kv = meta.get(f"{arch}.attention.head_count"), meta.get(f"{arch}.attention.head_count_kv")
    is_70b = n_layer == 80 and (arch != "llama" or n_head != n_kv)
    if recipe != "DQ3_K_M":
        return llama_types(tensors, recipe, n_layer=n_layer, is_70b=is_70b)
    base = llama_types(tensors, "Q3_K_M", n_layer=n_layer, is_70b=is_70b)
    free = dq3_tensors(src)
    sizes = {t.name: int(np.prod(t.shape)) for t in free}
    if importance is not None and measured is not None:
        raise JaxdecError("DQ3_K_M takes column importance or measured KL, not both")
    given = importance if importance is not None else measured
    missing = [t.name for t in free if given is not None and t.name not in given]
    if missing:
        raise JaxdecError(f"{'importance' if importance is not None else 'measured KL'} covers "
                          f"{len(free) - len(missing)} of the {len(free)} "
                          f"tensors DQ3_K_M allocates (missing {missing[0]}, ...)")
    sens = {}
    for done, t in enumerate(free):
        qtypes = dq3_candidates(t.shape[-1])
        n_rows = int(np.prod(t.shape[:-1]))
        w = read_tensor_f32(header.path, t, _sample_rows(n_rows, t.shape[-1], max_values))
        if importance is None:  # data-free: relative error
            sens[t.name] = tensor_sensitivity(w, qtypes, max_values=max_values)
            if measured is not None:  # the measured KL at the cheapest, scaled by error
                rel = sens[t.name]
                sens[t.name] = {q: measured[t.name] * (rel[q] / rel[qtypes[0]] if rel[qtypes[0]] > 0 else 0.0)
                                for q in qtypes}
        else:  # the importance-weighted error of the whole tensor
            sens[t.name] = tensor_sensitivity(w, qtypes, importance[t.name], max_values=max_values,
                                              scale=n_rows / len(w))
        if progress is not None:
            progress(done + 1, len(free))
    budget = bits_per_weight_of({n: base[n] for n in sizes}, sizes)
    return {**base, **dq3_recipe(sizes, sens, budget)}


def dq3_candidates(n_per_row: int) -> list[str]:
    """DQ3_K_M's candidate types for rows of n_per_row values (fallbacks applied), by bits."""
    return sorted({fallback_type(q, n_per_row) for q in DQ3_CANDIDATES}, key=bits_per_weight)


def dq3_tensors(src: str | pathlib.Path) -> list:
    """The tensors of the GGUF file `src` whose types DQ3_K_M chooses (header infos)."""
    from jaxdec.checkpoint.gguf_reader import read_gguf_header

    header = read_gguf_header(src)
    tied = "output.weight" not in header.tensors
    return [t for t in header.tensors.values() if is_quantisable(t.name, t.shape)
            and not (_category(t.name) == "output" or (tied and _category(t.name) == "token_embd"))]


def read_tensor_f32(path: pathlib.Path, info, rows: np.ndarray | None = None) -> np.ndarray:
    """f32[rows, n_per_row] of one tensor of a GGUF file (`read_gguf_header`'s info), all its
    rows or the given ones, dequantised by gguf."""
    n_rows = int(np.prod(info.shape[:-1]))
    raw = np.memmap(path, np.uint8, mode="r", offset=info.start, shape=(n_rows, info.nbytes // n_rows))
    raw = np.array(raw if rows is None else raw[rows])
    return dequantize_blocks(raw, info.qtype).reshape(len(raw), info.shape[-1])


# key paths of a jaxdec layer's matmuls -> the GGUF tensor names (inputs are GGUF's columns)
_GGUF_NAMES = {".mixer.wq": "attn_q", ".mixer.wk": "attn_k", ".mixer.wv": "attn_v",
               ".mixer.wo": "attn_output", ".ffn.w_gate": "ffn_gate", ".ffn.w_up": "ffn_up",
               ".ffn.w_down": "ffn_down"}


def fisher_importance(params, cfg, tokens: np.ndarray, *, progress=None) -> dict[str, np.ndarray]:
    """{GGUF tensor name: f32[n_per_row]} for `recipe_types(importance=...)`: the empirical
    Fisher information of the model's loss on calibration `tokens` per input column
    (`calibrate.fisher_columns`), so that DQ3_K_M spends its bits where they lower the
    loss most. A weight's columns are its inputs, which llama.cpp never permutes; an untied
    embedding's columns are its D features."""
    from jaxdec.quant import calibrate

    fisher = calibrate.fisher_columns(params, cfg, tokens, progress=progress)
    out = {f"blk.{i}.{_GGUF_NAMES[path]}.weight": f.astype(np.float32)
           for i, layer in enumerate(fisher.layers) for path, f in layer.items() if path in _GGUF_NAMES}
    if fisher.embed is not None:  # an untied token_embd [vocab, D]: its rows' inputs are D
        out["token_embd.weight"] = fisher.embed.astype(np.float32)
    return out


def kl_sensitivity(params, cfg, tokens: np.ndarray, *, windows: int | None = KL_WINDOWS,
                   only: Sequence[str] | None = None, progress=None) -> dict[str, float]:
    """{GGUF tensor name: the mean KL divergence per token (nats) of the model's next-token
    distribution on `windows` evenly spaced rows of calibration `tokens` [R, T] (all rows
    when None; one forward pass over them per tensor) when that tensor alone is quantised to its
    cheapest DQ3_K_M candidate} for every tensor DQ3_K_M allocates: each tensor's measured
    effect on the model's output, for `recipe_types(measured=...)`. A weight's GGUF rows are
    its output features, each a row of its inputs (row order, which llama.cpp permutes for
    attn_q/attn_k, does not change a row's blocks). `only`: just these GGUF names.
    progress(done, total) follows the tensors."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from jaxdec.models import transformer
    from jaxdec.pytree import is_spec
    from jaxdec.quant import calibrate

    if any(not isinstance(w, (np.ndarray, jax.Array)) for w in jax.tree.leaves(params)):
        raise JaxdecError("kl_sensitivity measures a float model (load it without quantisation)")
    tokens = np.asarray(tokens)
    if windows is not None and windows < len(tokens):
        tokens = tokens[np.linspace(0, len(tokens) - 1, windows).round().astype(np.int64)]
    kl = calibrate.output_kl(params, cfg, tokens)
    decl = transformer.declare(cfg)

    def cheapest(w, n_in: int):
        k = int(np.prod(w.shape[:n_in]))
        rows = np.asarray(w, F32).reshape(k, -1).T
        back = round_trip(rows, dq3_candidates(k)[0]).T.reshape(w.shape)
        return jnp.asarray(back, w.dtype)

    keep = lambda name: only is None or name in only
    jobs = [(i, path) for i, d in enumerate(decl.layers)
            for path in calibrate.matmul_names(d)
            if path in _GGUF_NAMES and keep(f"blk.{i}.{_GGUF_NAMES[path]}.weight")]
    tied = params.embed is None or not keep("token_embd.weight")
    total = len(jobs) + (not tied)
    out = {}
    for done, (i, path) in enumerate(jobs):
        def swap(kp, spec, w):
            if jax.tree_util.keystr(kp) == path:
                return cheapest(w, spec.n_in)
            return w
        layer = jax.tree_util.tree_map_with_path(swap, decl.layers[i], params.layers[i],
                                                 is_leaf=lambda x: x is None or is_spec(x))
        layers = tuple(params.layers)
        changed = dataclasses.replace(params, layers=layers[:i] + (layer,) + layers[i + 1:])
        out[f"blk.{i}.{_GGUF_NAMES[path]}.weight"] = kl(changed)
        if progress is not None:
            progress(done + 1, total)
    if not tied:  # an untied token_embd [vocab, D]: GGUF rows are its vocabulary entries
        e = params.embed
        back = round_trip(np.asarray(e, F32), dq3_candidates(e.shape[-1])[0])
        out["token_embd.weight"] = kl(dataclasses.replace(params, embed=jnp.asarray(back, e.dtype)))
        if progress is not None:
            progress(total, total)
    return out
