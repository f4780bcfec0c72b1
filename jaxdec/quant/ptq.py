"""Per-matrix post-training weight quantisers: RTN, GPTQ, AWQ and HQQ.

Convention: a weight W is f32[K, N], used as y = x @ W (K inputs contracted, N outputs).
A group is `group_size` = g consecutive rows k of one column n, G = K // g. Every method
returns a `Grid`: integer codes u8[K, N] in 0..2^bits-1 and per-group scale/offset
f32[G, N] with

    W_hat[k, n] = codes[k, n] * scale[k // g, n] + offset[k // g, n]        (float32)

Scales and offsets are stored as float16 downstream, so every method rounds them to
float16-representable values *before* it computes codes, and before it uses W_hat for
anything (GPTQ's error feedback, AWQ's loss): what is optimised is what is stored.
Min-max parameters (RTN, GPTQ, AWQ): asymmetric (default), offset = the group's minimum
rounded down to float16 and scale = the smallest float16 that keeps [min, max] covered;
symmetric, codes centred at c = 2^(bits-1), offset = -c * scale. AWQ's clipping and HQQ
then move them (`awq`, `hqq`).

Calibration statistics (for GPTQ and AWQ): `h` = sum over calibration tokens of x^T x,
f[K, K] (any positive multiple of it gives the same result: GPTQ damps relative to its mean
diagonal, AWQ only compares errors), `x_absmean` = mean |x| per input channel, f[K].
The output error of a quantised W_hat over those tokens is trace(D^T H D), D = W_hat - W
(`output_error`). GPTQ is a numpy sweep (float32, float64 factorisation); the element-wise
searches (AWQ's grid, HQQ's iterations) are jitted jnp so that XLA fuses them.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg

from jaxdec.errors import JaxdecError

BITS = (2, 3, 4, 8)
F16_MAX = 65504.0
AWQ_RANK = 64             # rank of the low-rank-plus-diagonal H model AWQ searches with
AWQ_CLIP_RATIOS = tuple(1.0 - i / 20 for i in range(10))  # AutoAWQ: max_shrink 0.5, grid 20


@dataclasses.dataclass(frozen=True)
class Grid:
    """A group-wise quantised W f32[K, N] (see the module docstring for the formula).

    Invariants (checked by `validate_grid`): bits in BITS; g = group_size divides K;
    codes is u8[K, N] with values <= 2^bits - 1; scale and offset are f32[G, N], finite and
    float16-representable; symmetric grids have offset == -2^(bits-1) * scale.
    """

    codes: np.ndarray    # u8[K, N]
    scale: np.ndarray    # f32[G, N]
    offset: np.ndarray   # f32[G, N]
    bits: int
    group_size: int
    symmetric: bool = False


def validate_grid(grid: Grid) -> Grid:
    """Raise a one-line JaxdecError naming the first broken invariant of `Grid`; return it."""
    shape, g = np.shape(grid.codes), grid.group_size
    if len(shape) != 2 or grid.bits not in BITS or not isinstance(g, int) or g <= 0 or shape[0] % g:
        raise JaxdecError(f"invalid Grid: codes {list(shape)}, bits={grid.bits}, group_size={g}")
    want = (shape[0] // g, shape[1])
    for name in ("scale", "offset"):
        x = getattr(grid, name)
        if x.dtype != np.float32 or x.shape != want or not np.all(_f16_exact(x)):
            raise JaxdecError(f"invalid Grid: {name} is not float16-representable f32{list(want)}")
    if grid.codes.dtype != np.uint8 or grid.codes.max(initial=0) >= 2 ** grid.bits:
        raise JaxdecError(f"invalid Grid: codes are not u8 in 0..{2 ** grid.bits - 1}")
    if grid.symmetric and np.any(grid.offset != -(2.0 ** (grid.bits - 1)) * grid.scale):
        raise JaxdecError("invalid Grid: symmetric offset is not -2^(bits-1) * scale")
    return grid


def dequantize_grid(grid: Grid) -> np.ndarray:
    """codes * scale + offset per group -> f32[K, N] (float32 arithmetic, exact in practice:
    code * scale has at most 19 significant bits)."""
    k, n = grid.codes.shape
    g = grid.group_size
    codes = grid.codes.astype(np.float32).reshape(k // g, g, n)
    return (codes * grid.scale[:, None] + grid.offset[:, None]).reshape(k, n)


def output_error(w, w_hat, h) -> float:
    """trace(D^T H D) for D = w_hat - w, in float64: the summed squared output error over
    the calibration tokens that produced H = sum x^T x."""
    d = np.asarray(w_hat, np.float64) - np.asarray(w, np.float64)
    return float(np.sum(d * (np.asarray(h, np.float64) @ d)))


# ---- argument checks ------------------------------------------------------------------------
def _check_w(method: str, w, bits: int, group_size: int) -> np.ndarray:
    """w as f32[K, N], or a one-line JaxdecError naming the bad argument."""
    w = np.asarray(w)
    if w.ndim != 2 or w.size == 0 or not np.issubdtype(w.dtype, np.floating):
        raise JaxdecError(f"{method}: w must be a non-empty float [K, N] matrix, "
                          f"got {w.dtype}{list(w.shape)}")
    if not np.all(np.abs(w) < F16_MAX):
        raise JaxdecError(f"{method}: w has non-finite values or values beyond float16's range")
    if bits not in BITS:
        raise JaxdecError(f"{method}: bits={bits!r}, expected one of {BITS}")
    if not isinstance(group_size, (int, np.integer)) or group_size <= 0 or w.shape[0] % group_size:
        raise JaxdecError(f"{method}: group_size={group_size!r} must be a positive divisor "
                          f"of K={w.shape[0]}")
    return w.astype(np.float32)


def _check_stat(method: str, name: str, x, shape: tuple[int, ...]) -> np.ndarray:
    """A finite float64 calibration statistic of `shape`, or a one-line JaxdecError."""
    x = np.asarray(x)
    if x.shape != shape or not np.issubdtype(x.dtype, np.number):
        raise JaxdecError(f"{method}: {name} has shape {list(x.shape)}, expected {list(shape)}")
    x = np.asarray(x, np.float64)
    if not np.isfinite(x.sum()) and not np.all(np.isfinite(x)):
        raise JaxdecError(f"{method}: {name} has non-finite values")
    return x


def _check_positive(method: str, **values) -> None:
    for name, v in values.items():
        if not v > 0 or not np.isfinite(v):
            raise JaxdecError(f"{method}: {name}={v!r} must be positive")


# ---- float16-representable min-max parameters, RTN (numpy, or jnp under jit) -----------------
def _f16_exact(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32) == x


def _f16(x, mode: str, xp=jnp):
    """float32 -> the float16 value nearest x ("nearest"), or nearest on one side ("up": >= x,
    "down": <= x), clamped to the finite float16 range; returned as float32. `xp`: jnp or np
    (the same IEEE operations, so the same values)."""
    x = xp.asarray(x, xp.float32)
    x16 = x.astype(xp.float16)
    if mode != "nearest":
        back = x16.astype(xp.float32)
        wrong = back < x if mode == "up" else back > x
        toward = xp.float16(np.inf if mode == "up" else -np.inf)
        x16 = xp.where(wrong, xp.nextafter(x16, toward), x16)
    return xp.clip(x16.astype(xp.float32), -F16_MAX, F16_MAX)


def _minmax_params(lo, hi, *, bits: int, symmetric: bool, xp=jnp):
    """Group ranges [lo, hi] (f32[...]) -> (scale, offset) float16-representable f32[...]:
    asymmetric, offset = lo rounded down and scale the smallest float16 with
    offset + (2^bits - 1) scale >= hi; symmetric, the smallest float16 scale with
    (c - 1) scale >= hi and -c scale <= lo (c = 2^(bits-1)), offset = -c scale. `xp`: jnp
    or np (XLA's float32 division is not correctly rounded, so the division only gives a
    first guess, settled by the exact coverage test)."""
    maxq, c = 2 ** bits - 1, 2 ** (bits - 1)
    if symmetric:
        top = xp.maximum(xp.maximum(hi / xp.float32(c - 1), lo / xp.float32(-c)), xp.float32(0))
        covers = lambda s: (xp.float32(c - 1) * s >= hi) & (xp.float32(-c) * s <= lo)
        scale = _smallest_covering(xp.minimum(top, xp.float32(F16_MAX / c)), covers, xp)
        return scale, xp.float32(-c) * scale
    offset = _f16(lo, "down", xp)
    covers = lambda s: offset + xp.float32(maxq) * s >= hi
    guess = xp.maximum(hi - offset, xp.float32(0)) / xp.float32(maxq)
    return _smallest_covering(guess, covers, xp), offset


def _smallest_covering(guess, covers, xp):
    """The smallest of the float16 values around `guess` (f32[...] >= 0, within a few
    float32 ulps of the ideal) that `covers`; the largest of them where none does."""
    up = _f16(guess, "up", xp).astype(xp.float16)
    below = xp.maximum(xp.nextafter(up, xp.float16(-np.inf)), xp.float16(0)).astype(xp.float32)
    above = xp.minimum(xp.nextafter(up, xp.float16(np.inf)), xp.float16(F16_MAX)).astype(xp.float32)
    up = up.astype(xp.float32)
    return xp.where(covers(below), below, xp.where(covers(up), up, above))


def _round(wg, scale, offset, bits: int, xp=jnp):
    """wg f32[G, g, N], scale/offset f32[G, N] -> (codes f32[G, g, N], W_hat f32[G, g, N]):
    codes = clip(rint((w - offset) / scale)) (a zero scale divides by 1). `xp`: jnp or np."""
    s, o = scale[:, None], offset[:, None]
    codes = xp.clip(xp.round((wg - o) / xp.where(s == 0, xp.float32(1), s)), 0, 2 ** bits - 1)
    return codes, codes * s + o


def _groups(w, g: int):
    k, n = w.shape
    return w.reshape(k // g, g, n)


def _rtn(w, *, bits, group_size, symmetric, xp=jnp):
    """(codes f32[K, N], scale f32[G, N], offset f32[G, N]) of min-max RTN; `xp`: jnp or np."""
    wg = _groups(w, group_size)
    scale, offset = _minmax_params(wg.min(1), wg.max(1), bits=bits, symmetric=symmetric, xp=xp)
    return _round(wg, scale, offset, bits, xp)[0].reshape(w.shape), scale, offset


def _grid(codes, scale, offset, bits: int, group_size: int, symmetric: bool) -> Grid:
    return Grid(codes=np.asarray(codes, np.uint8), scale=np.asarray(scale, np.float32),
                offset=np.asarray(offset, np.float32), bits=bits, group_size=int(group_size),
                symmetric=symmetric)


def rtn(w, *, bits: int, group_size: int, symmetric: bool = False) -> Grid:
    """Round-to-nearest min-max quantisation of w f32[K, N] (float16-exact scale/offset)."""
    w = _check_w("rtn", w, bits, group_size)
    codes, scale, offset = _rtn(w, bits=bits, group_size=int(group_size), symmetric=symmetric, xp=np)
    return _grid(codes, scale, offset, bits, group_size, symmetric)


# ---- GPTQ -----------------------------------------------------------------------------------
def gptq(w, h, *, bits: int, group_size: int, act_order: bool = False, damp: float = 0.01,
         block: int = 128, symmetric: bool = False, static_groups: bool = True) -> Grid:
    """GPTQ (Frantar et al. 2022) of w f32[K, N] with H = sum x^T x f[K, K].

    Inputs k (GPTQ's "columns") are quantised one at a time and the rounding error of each
    is spread over the inputs not yet quantised (the OBS update), with lazy batch updates
    over blocks of `block` inputs; each output n is independent. H is damped by
    damp * mean(diag H); dead inputs (diag H == 0) get diag 1 and a zero weight row.

    Groups are always the consecutive input ranges [j*g, (j+1)*g). Without act_order a
    group's min-max parameters are computed when its first input is reached, from the
    current (error-updated) weights of its g inputs, as in the paper. With act_order
    (inputs processed in order of decreasing diag H) the parameters of every group are
    computed up front from the original W ("static groups": the groups stay consecutive,
    hence storable in a Grid); static_groups=False is refused with act_order, since the
    paper's groups are then consecutive in processing order, which a Grid cannot store.

    The paper writes the update with U, the upper Cholesky factor of H^-1: after input k,
    w_j -= U_kj (w_k - q_k) / U_kk for j > k. With H = R R^T (R upper, R = U^-1) and
    F = R / diag(R) (column k divided by R_kk, unit upper triangular), the same sweep is
        w~_k = w_k + sum_{j<k} F_jk (w_j - q_j)
    (w~_k: the value input k has when it is rounded; w_j: the original weights), so H is
    factored once (float64) and never inverted. Part way, after the inputs before i, the
    paper's weights of a group G starting at i are w_G + F_GG^-T sum_{j<i} F_jG (w_j - q_j)
    (one g x g triangular solve per group). The sweep itself runs in float32.
    """
    w = _check_w("gptq", w, bits, group_size)
    k, n = w.shape
    h = _check_stat("gptq", "h", h, (k, k))
    _check_positive("gptq", block=block)
    if not damp >= 0:
        raise JaxdecError(f"gptq: damp={damp!r} must be >= 0")
    if act_order and not static_groups:
        raise JaxdecError("gptq: act_order needs static_groups (groups must stay consecutive inputs)")
    dead = np.diag(h) == 0
    w = np.where(dead[:, None], np.float32(0), w)
    diag = np.where(dead, 1.0, np.diag(h))
    diag = diag + damp * np.mean(diag)
    order = np.argsort(-diag, kind="stable") if act_order else np.arange(k)
    feedback = _feedback_matrix(h, diag, order)
    params = _group_params(w, bits, group_size, symmetric) if act_order else None
    codes, scale, offset = _gptq_sweep(w[order], feedback, order, params, bits=bits,
                                       group_size=group_size, symmetric=symmetric, block=int(block))
    out = np.empty_like(codes)
    out[order] = codes
    return _grid(out, scale, offset, bits, group_size, symmetric)


def _feedback_matrix(h: np.ndarray, diag: np.ndarray, order: np.ndarray) -> np.ndarray:
    """F f32[K, K] = R / diag(R) (column k divided by R_kk) for H' = R R^T, R upper
    triangular, where H' is H in processing `order` with its diagonal replaced by `diag`
    (dead inputs 1, damped). With J the reversal and J H' J = L L^T (LAPACK's Cholesky,
    float64), R = J L J. One copy of H is made."""
    rev = order[::-1]
    a = h[np.ix_(rev, rev)] if np.any(order[1:] < order[:-1]) else np.ascontiguousarray(h[::-1, ::-1])
    a[np.diag_indices_from(a)] = diag[rev]
    # a.T is a in Fortran order (a is symmetric), so LAPACK factors it in place
    low, info = scipy.linalg.lapack.dpotrf(a.T, lower=1, clean=1, overwrite_a=1)
    if info != 0:
        raise JaxdecError("gptq: H is not positive definite after damping (raise damp)")
    low /= np.diag(low)[None, :]
    return np.ascontiguousarray(low[::-1, ::-1], dtype=np.float32)


def _group_params(w, bits: int, g: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
    """Min-max (scale, offset) f32[G, N] of every group of w f32[K, N] (numpy)."""
    wg = _groups(w, g)
    return _minmax_params(wg.min(1), wg.max(1), bits=bits, symmetric=symmetric, xp=np)


def _gptq_sweep(w, feedback, order, params, *, bits, group_size, symmetric, block):
    """The GPTQ loop over the original weights w f32[K, N] in processing order (input
    order[i] at position i). params: (scale, offset) f32[G, N] fixed up front, or None
    (only with order = identity) to compute each group's when its first input is reached.
    Returns codes u8[K, N] (in processing order), scale, offset."""
    k, n = w.shape
    gid = order // group_size
    todo = np.full(k // group_size, params is None)
    if params is None:
        params = (np.zeros((k // group_size, n), np.float32),) * 2
    scale, offset = (p.copy() for p in params)
    codes, cur = np.empty((k, n), np.uint8), w.copy()  # cur: w + feedback of earlier blocks
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, delta = cur[i1:i2].copy(), np.zeros((i2 - i1, n), np.float32)
        for i in range(i2 - i1):
            j = gid[i1 + i]
            if todo[j]:
                rows = _paper_rows(w, cur, w1, delta, feedback, i1, i, group_size)
                scale[j], offset[j] = _group_params(rows, bits, group_size, symmetric)
                todo[j] = False
            c, w_hat = _round(w1[None, i:i + 1], scale[j][None], offset[j][None], bits, np)
            codes[i1 + i] = c[0, 0]
            delta[i] = w[i1 + i] - w_hat[0, 0]
            w1[i + 1:] += np.outer(feedback[i1 + i, i1 + i + 1:i2], delta[i])
        cur[i2:] += feedback[i1:i2, i2:].T @ delta
    return codes, scale, offset


def _paper_rows(w, cur, w1, delta, feedback, i1: int, i: int, g: int) -> np.ndarray:
    """The paper's current weights f32[g, N] of the group starting at input i1 + i, after
    the inputs before it: w_G + F_GG^-T c_G, with c_G the feedback those inputs sent to G
    (held in w1 inside the block; past it the block's pending lazy update is added)."""
    rows = np.arange(i1 + i, i1 + i + g)
    inside = rows < i1 + len(w1)
    state = np.empty((g, w.shape[1]), np.float32)
    state[inside] = w1[rows[inside] - i1]
    out = rows[~inside]
    state[~inside] = cur[out] + feedback[i1:i1 + i, out].T @ delta[:i]
    f_gg = feedback[rows[0]:rows[-1] + 1, rows[0]:rows[-1] + 1]
    fix = scipy.linalg.solve_triangular(f_gg, state - w[rows], trans="T", unit_diagonal=True,
                                        check_finite=False)
    return w[rows] + fix.astype(np.float32)


# ---- AWQ ------------------------------------------------------------------------------------
def awq(w, h, x_absmean, *, bits: int, group_size: int, n_grid: int = 20, symmetric: bool = False,
        clip_search: bool = True) -> tuple[np.ndarray, Grid]:
    """AWQ (Lin et al. 2023) of w f32[K, N] -> (s f32[K], grid of diag(s) W).

    At run time x is divided by s (folded into the previous op), so the layer computes
    (x / s) @ Q(diag(s) W). s = x_absmean^alpha clamped to >= 1e-4 and divided by
    sqrt(max(s) * min(s)) (AutoAWQ's normalisation), for alpha in {0, 1/n_grid, ...,
    (n_grid-1)/n_grid}; the alpha with the lowest output error trace(D^T H D),
    D = diag(1/s) Q(diag(s) W) - W, wins. With clip_search, each group's range [min, max]
    of diag(s) W is then shrunk towards 0 by the ratio in AWQ_CLIP_RATIOS that minimises
    that group's own output error (AutoAWQ's auto_clip: cross-group terms ignored), and
    the clipped grid is kept if it lowers the whole output error. Matrices sharing an
    input (q/k/v, gate/up) must share s: pass them concatenated along N.

    The search ranks candidates with H modelled as rank-AWQ_RANK + diagonal (`_h_model`: a
    Nystrom approximation, exact when K <= AWQ_RANK; within 0.3% of the exact error of
    quantisation errors on SmolLM2's activations), since the exact trace costs 2 K^2 N
    flops per candidate and the model 2 AWQ_RANK K N. The
    exact output errors of the winner and of plain RTN then decide, so AWQ's exact error
    never exceeds RTN's (up to the float32 rounding of that comparison): when RTN wins,
    (ones, RTN's grid) is returned.
    """
    w = _check_w("awq", w, bits, group_size)
    k, n = w.shape
    h = _check_stat("awq", "h", h, (k, k))
    x_absmean = _check_stat("awq", "x_absmean", x_absmean, (k,)).astype(np.float32)
    if np.any(x_absmean < 0):
        raise JaxdecError("awq: x_absmean has negative values")
    _check_positive("awq", n_grid=n_grid)
    f, rdiag = _h_model(h, AWQ_RANK)
    static = dict(bits=bits, group_size=int(group_size), symmetric=symmetric)
    alphas = np.arange(int(n_grid), dtype=np.float32) / n_grid
    s, est, clipped, est_clipped = jax.device_get(_awq_search(
        w, x_absmean, alphas, f, rdiag, np.float32(AWQ_CLIP_RATIOS), clip_search=clip_search, **static))
    if clip_search and est_clipped < est:
        chosen = _grid(*clipped, bits, group_size, symmetric)
    else:
        chosen = rtn(s[:, None] * w, **static)
    plain, h32 = rtn(w, **static), h.astype(np.float32)
    e_chosen = _exact_error(dequantize_grid(chosen) / s[:, None] - w, h32)
    if e_chosen < _exact_error(dequantize_grid(plain) - w, h32):
        return s, chosen
    return np.ones(k, np.float32), plain


def _h_model(h: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """H f64[K, K] ~ F F^T + diag(r): (F f32[K, rank'], r f32[K] >= 0). Exact (eigen
    factor, r = 0) when K <= rank. Otherwise a Nystrom approximation on the range of
    H Omega (Omega a fixed Gaussian f64[K, rank]), F = H Q (Q^T H Q)^-1/2, whose residual
    H - F F^T is PSD; r is that residual's diagonal."""
    k = len(h)
    if k <= rank:
        lam, v = np.linalg.eigh(h)
        return (v * np.sqrt(np.maximum(lam, 0))).astype(np.float32), np.zeros(k, np.float32)
    q = _orthonormal(h @ np.random.default_rng(0).standard_normal((k, rank)))
    y = h @ q
    f = _orthonormal(y, metric=q.T @ y)
    return f.astype(np.float32), np.maximum(np.diag(h) - np.sum(f * f, 1), 0).astype(np.float32)


def _orthonormal(y: np.ndarray, metric: np.ndarray | None = None) -> np.ndarray:
    """y f64[K, r] times M^-1/2 for M = metric (default y^T y, so the result has
    orthonormal columns), through the eigendecomposition of the small M; directions with
    eigenvalues below 1e-12 of the largest are dropped."""
    lam, v = np.linalg.eigh(y.T @ y if metric is None else metric)
    keep = lam > lam.max() * 1e-12
    return (y @ v[:, keep]) / np.sqrt(lam[keep])


def _estimate(d, f, rdiag):
    """Modelled trace(D^T H D) for D f32[K, N] (see `_h_model`)."""
    return jnp.sum(jnp.square(f.T @ d)) + jnp.sum(rdiag @ jnp.square(d))


def _exact_error(d: np.ndarray, h32: np.ndarray) -> float:
    return float(np.sum(d * (h32 @ d), dtype=np.float64))


def _awq_scales(x_absmean, alpha):
    s = jnp.maximum(x_absmean ** alpha, 1e-4)
    return s / jnp.sqrt(s.max() * s.min())


@partial(jax.jit, static_argnames=("bits", "group_size", "symmetric", "clip_search"))
def _awq_search(w, x_absmean, alphas, f, rdiag, ratios, *, bits, group_size, symmetric, clip_search):
    """The modelled search: (s f32[K] of the best alpha, its error, the clipped grid of
    diag(s) W (codes, scale, offset), that grid's error); the last two are placeholders
    without clip_search."""
    def error(alpha):
        s = _awq_scales(x_absmean, alpha)[:, None]
        codes, scale, offset = _rtn(s * w, bits=bits, group_size=group_size, symmetric=symmetric)
        return _estimate(_dequantize(codes, scale, offset) / s - w, f, rdiag)

    errors = jax.lax.map(error, alphas)
    s = _awq_scales(x_absmean, alphas[jnp.argmin(errors)])
    if not clip_search:
        return s, errors.min(), (jnp.zeros(w.shape, jnp.uint8),) * 3, jnp.inf
    codes, scale, offset = _awq_clip(s[:, None] * w, s, f, rdiag, ratios, bits=bits,
                                     group_size=group_size, symmetric=symmetric)
    clipped_error = _estimate(_dequantize(codes, scale, offset) / s[:, None] - w, f, rdiag)
    return s, errors.min(), (codes.astype(jnp.uint8), scale, offset), clipped_error


def _dequantize(codes, scale, offset):
    """codes f32[K, N] with scale/offset f32[G, N] -> f32[K, N] (jnp)."""
    g = codes.shape[0] // scale.shape[0]
    return (_groups(codes, g) * scale[:, None] + offset[:, None]).reshape(codes.shape)


def _shrink(lo, hi, ratio):
    return jnp.where(lo < 0, lo * ratio, lo), jnp.where(hi > 0, hi * ratio, hi)


def _awq_clip(ws, s, f, rdiag, ratios, *, bits, group_size, symmetric):
    """AWQ's clip search on ws = diag(s) W f32[K, N]: per group and column, the ratio
    (of `ratios`) whose shrunk min-max range gives the lowest modelled output error of
    that group alone. Returns (codes f32[K, N], scale f32[G, N], offset f32[G, N])."""
    wg = _groups(ws, group_size)
    lo, hi = wg.min(1), wg.max(1)
    fg, rg = _groups(f, group_size), _groups(rdiag[:, None], group_size)  # [G, g, r], [G, g, 1]
    sg = _groups(s[:, None], group_size)

    def errors(ratio):  # f32[G, N]
        scale, offset = _minmax_params(*_shrink(lo, hi, ratio), bits=bits, symmetric=symmetric)
        d = (_round(wg, scale, offset, bits)[1] - wg) / sg
        proj = jnp.einsum("gkr,gkn->grn", fg, d)
        return jnp.sum(jnp.square(proj), 1) + jnp.sum(rg * jnp.square(d), 1)

    best = ratios[jnp.argmin(jax.lax.map(errors, ratios), axis=0)]
    scale, offset = _minmax_params(*_shrink(lo, hi, best), bits=bits, symmetric=symmetric)
    return _round(wg, scale, offset, bits)[0].reshape(ws.shape), scale, offset


# ---- HQQ ------------------------------------------------------------------------------------
def hqq(w, *, bits: int, group_size: int, iters: int = 20, p: float = 0.7, beta: float = 1e1,
        kappa: float = 1.01, symmetric: bool = False) -> Grid:
    """Half-quadratic quantisation (Badri & Shaji 2023) of w f32[K, N], no calibration data.

    The min-max scale s (float16, as RTN's) is kept and the zero point z (in code units,
    W_hat = (q - z) s, q = clip(rint(W / s + z))) is optimised for the l_p error (p < 1) by
    alternating W_e = shrink_p(W - W_hat) (the generalised soft threshold
    sign(e) max(|e| - |e|^(p-1) / beta, 0)) and the closed-form z = mean(q - (W - W_e) / s)
    over the group, beta *= kappa per iteration. Early stop per group: a group keeps the z
    of its lowest mean |W - W_hat|^p and stops at the first iteration that does not lower
    it (HQQ stops the whole tensor at once). symmetric: z is fixed at 2^(bits-1) and the
    scale is updated instead (least squares of (q - z) s against W - W_e). The offset
    -z * s (or the scale) is then rounded to float16 and the codes recomputed against it.
    """
    w = _check_w("hqq", w, bits, group_size)
    _check_positive("hqq", iters=iters, p=p, beta=beta, kappa=kappa)
    codes, scale, offset = _hqq_jit(w, bits=bits, group_size=int(group_size), iters=int(iters),
                                    p=float(p), beta=float(beta), kappa=float(kappa),
                                    symmetric=symmetric)
    return _grid(codes, scale, offset, bits, group_size, symmetric)


@partial(jax.jit, static_argnames=("bits", "group_size", "iters", "p", "beta", "kappa", "symmetric"))
def _hqq_jit(w, *, bits, group_size, iters, p, beta, kappa, symmetric):
    wg = _groups(w, group_size)
    scale0, offset0 = _minmax_params(wg.min(1), wg.max(1), bits=bits, symmetric=symmetric)
    s0 = jnp.where(scale0 == 0, 1.0, scale0)
    z0 = jnp.full_like(s0, 2 ** (bits - 1)) if symmetric else -offset0 / s0
    best_s, best_z = _hqq_loop(wg.transpose(0, 2, 1), s0, z0, bits=bits, iters=iters, p=p,
                               beta=beta, kappa=kappa, symmetric=symmetric)
    if symmetric:
        c = 2 ** (bits - 1)
        scale = jnp.where(scale0 == 0, 0.0, _f16(jnp.minimum(best_s, F16_MAX / c), "nearest"))
        offset = -c * scale
    else:
        scale, offset = scale0, jnp.where(scale0 == 0, offset0, _f16(-best_z * s0, "nearest"))
    codes = _round(wg, scale, offset, bits)[0]
    return codes.reshape(w.shape).astype(jnp.uint8), scale, offset


def _hqq_loop(wt, s, z, *, bits, iters, p, beta, kappa, symmetric):
    """The half-quadratic iterations on wt f32[G, N, g] (groups along the minor axis, so
    the per-group sums are contiguous) from scale s and zero z f32[G, N]; returns the
    (s, z) of each group's lowest l_p error."""
    def body(state):
        i, s, z, best_s, best_z, best_err, active, beta = state
        q = jnp.clip(jnp.round(wt / s[..., None] + z[..., None]), 0, 2 ** bits - 1)
        e = wt - (q - z[..., None]) * s[..., None]
        e_abs = jnp.abs(e)
        e_pow = jnp.exp((p - 1) * jnp.log(e_abs))  # |e|^(p-1) (inf at 0), 2x faster than **
        err = jnp.mean(jnp.where(e_abs > 0, e_abs * e_pow, 0.0), axis=-1)
        better = active & (err < best_err)
        best_s, best_z = jnp.where(better, s, best_s), jnp.where(better, z, best_z)
        target = wt - jnp.sign(e) * jnp.maximum(e_abs - e_pow / beta, 0.0)  # W - shrink_p(e)
        if symmetric:
            qc = q - z[..., None]
            den = jnp.sum(qc * qc, -1)
            fit = jnp.sum(qc * target, -1) / jnp.where(den > 0, den, 1.0)
            s = jnp.where(better & (fit > 0), fit, s)
        else:
            z = jnp.where(better, jnp.mean(q - target / s[..., None], -1), z)
        return i + 1, s, z, best_s, best_z, jnp.where(better, err, best_err), better, beta * kappa

    inf = jnp.full(s.shape, jnp.inf, jnp.float32)
    state = (0, s, z, s, z, inf, jnp.ones(s.shape, bool), jnp.float32(beta))
    state = jax.lax.while_loop(lambda st: (st[0] < iters) & jnp.any(st[6]), body, state)
    return state[3], state[4]
