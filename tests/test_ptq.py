"""Per-matrix PTQ quantisers (`jaxdec.quant.ptq`) against float64 references written from
the papers' definitions, and their error ordering on real SmolLM2 weights: GPTQ below RTN
in output error, AWQ never above RTN, HQQ's l_p error below RTN's."""

from __future__ import annotations

import functools

import gguf
import numpy as np
import pytest

from conftest import assert_one_line_error
from jaxdec.quant import ptq
from jaxdec.quant.ptq import Grid, awq, dequantize_grid, gptq, hqq, output_error, rtn

F16_MAX = 65504.0
MODES = [(2, False), (3, False), (4, False), (8, False), (2, True), (3, True), (4, True), (8, True)]


# ---- float64 references, written from the definitions ---------------------------------------
def f16(x, mode):
    """float64 -> nearest float16 value ("nearest"), or nearest >= x ("up") / <= x ("down")."""
    x = np.asarray(x, np.float64)
    h = x.astype(np.float16)
    if mode == "up":
        h = np.where(h.astype(np.float64) < x, np.nextafter(h, np.float16(np.inf)), h)
    elif mode == "down":
        h = np.where(h.astype(np.float64) > x, np.nextafter(h, np.float16(-np.inf)), h)
    return np.clip(h.astype(np.float64), -F16_MAX, F16_MAX)


def ref_params(lo, hi, bits, symmetric):
    """Min-max (scale, offset) that cover [lo, hi], both float16 values."""
    maxq, c = 2 ** bits - 1, 2 ** (bits - 1)
    if symmetric:
        scale = f16(np.maximum(np.maximum(hi / (c - 1), lo / -c), 0), "up")
        return scale, -c * scale
    offset = f16(lo, "down")
    return f16(np.maximum(hi - offset, 0) / maxq, "up"), offset


def ref_round(w, scale, offset, bits):
    codes = np.clip(np.rint((w - offset) / np.where(scale == 0, 1, scale)), 0, 2 ** bits - 1)
    return codes, codes * scale + offset


def ref_rtn(w, bits, g, symmetric):
    """(codes, scale, offset, W_hat) in float64."""
    k, n = w.shape
    wg = w.astype(np.float64).reshape(k // g, g, n)
    scale, offset = ref_params(wg.min(1), wg.max(1), bits, symmetric)
    codes, w_hat = ref_round(wg, scale[:, None], offset[:, None], bits)
    return codes.reshape(k, n), scale, offset, w_hat.reshape(k, n)


def ref_gptq(w, h, bits, g, act_order=False, symmetric=False, damp=0.01):
    """GPTQ one input at a time (no lazy batches), float64: the OBS update
    w_rest -= (w_j - q_j) H^-1[rest, j] / H^-1[j, j], then H^-1 of the remaining inputs by
    the Schur complement. Group parameters: from the current weights when a group's first
    input is reached; with act_order, from the original W up front (static groups)."""
    w, h = np.array(w, np.float64), np.array(h, np.float64)
    k = len(h)
    dead = np.diag(h) == 0
    h[dead, dead] = 1
    w[dead] = 0
    h += damp * np.mean(np.diag(h)) * np.eye(k)
    order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(k)
    params = {}
    for j in range(k // g) if act_order else ():
        params[j] = ref_params(w[j * g:(j + 1) * g].min(0), w[j * g:(j + 1) * g].max(0), bits, symmetric)
    hinv, codes = np.linalg.inv(h), np.zeros(w.shape, np.int64)
    for step, j in enumerate(order):
        grp = j // g
        if grp not in params:
            rows = w[grp * g:(grp + 1) * g]
            params[grp] = ref_params(rows.min(0), rows.max(0), bits, symmetric)
        codes[j], q = ref_round(w[j], *params[grp], bits)
        rest = order[step + 1:]
        w[rest] -= np.outer(hinv[rest, j] / hinv[j, j], w[j] - q)
        hinv[np.ix_(rest, rest)] -= np.outer(hinv[rest, j], hinv[j, rest]) / hinv[j, j]
    return codes


def ref_hqq(w, bits, g, iters=20, p=0.7, beta=10.0, kappa=1.01):
    """Asymmetric HQQ in float64: min-max scale kept, zero point z (code units) by
    alternating the l_p shrinkage of W - W_hat and z = mean(q - (W - W_e) / s); each group
    keeps the z of its lowest mean |W - W_hat|^p and stops when that stops decreasing."""
    k, n = w.shape
    wg = w.astype(np.float64).reshape(k // g, g, n)
    scale, offset = ref_params(wg.min(1), wg.max(1), bits, False)
    s = scale[:, None]
    z = -offset / scale
    best_z, best, active = z.copy(), np.full(z.shape, np.inf), np.ones(z.shape, bool)
    for _ in range(iters):
        q = np.clip(np.rint(wg / s + z[:, None]), 0, 2 ** bits - 1)
        e = wg - (q - z[:, None]) * s
        err = np.mean(np.abs(e) ** p, 1)
        active &= err < best
        best_z, best = np.where(active, z, best_z), np.where(active, err, best)
        with np.errstate(divide="ignore"):
            w_e = np.sign(e) * np.maximum(np.abs(e) - np.abs(e) ** (p - 1) / beta, 0)
        z = np.where(active, np.mean(q - (wg - w_e) / s, 1), z)
        beta *= kappa
    return f16(-best_z * scale, "nearest")


# ---- data ------------------------------------------------------------------------------------
def calib_inputs(k: int, n_tokens: int, seed: int, *, outliers: int = 4, outlier_scale: float = 20.0):
    """f64[n_tokens, k] shaped like LLM activations: correlated channels (neighbours mixed,
    and 8 shared directions), channel scales spread over a decade, and `outliers`
    channels `outlier_scale` times larger than the rest."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_tokens, k))
    x += 0.5 * np.roll(x, 1, axis=1) + rng.standard_normal((n_tokens, 8)) @ rng.standard_normal((8, k))
    x *= np.exp(0.6 * rng.standard_normal(k))
    x[:, rng.choice(k, outliers, replace=False)] *= outlier_scale
    return x


def gram(x):
    return x.T @ x


@functools.lru_cache(maxsize=None)
def calib_stats(k: int, seed: int, outliers: int = 4, outlier_scale: float = 20.0):
    """(H = X^T X, mean |x| per channel) of `calib_inputs(k, 2048, seed, ...)`."""
    x = calib_inputs(k, 2048, seed, outliers=outliers, outlier_scale=outlier_scale)
    return gram(x), np.abs(x).mean(0)


def random_weight(k: int, n: int, seed: int) -> np.ndarray:
    return (0.05 * np.random.default_rng(seed).standard_normal((k, n))).astype(np.float32)


@functools.lru_cache(maxsize=None)
def smollm2_header():
    from jaxdec.checkpoint import registry
    from jaxdec.checkpoint.gguf_reader import read_gguf_header

    return read_gguf_header(registry.resolve("smollm2"))


@functools.lru_cache(maxsize=None)
def smollm2_weight(name: str) -> np.ndarray:
    """A SmolLM2 weight as our f32[in, out] (GGUF stores linear weights as [out, in]; the
    header is parsed by jaxdec's reader, which `gguf.GGUFReader` is seconds slower than).
    llama.cpp's permutation of attn_q's output rows is left in: outputs are independent."""
    header = smollm2_header()
    info = header.tensors[name]
    with open(header.path, "rb") as f:
        raw = np.fromfile(f, np.uint8, count=info.nbytes, offset=info.start)
    w = gguf.quants.dequantize(raw.reshape(info.shape[0], -1), info.qtype)
    return np.ascontiguousarray(np.asarray(w, np.float32).reshape(info.shape).T)


REAL = ["blk.10.attn_q.weight", "blk.10.ffn_down.weight"]


def relative_error(w, w_hat, h) -> float:
    return output_error(w, w_hat, h) / output_error(w, np.zeros_like(w), h)


# ---- grids: format invariants ----------------------------------------------------------------
@pytest.mark.parametrize("bits,symmetric", MODES)
def test_rtn_matches_reference(bits, symmetric):
    w = random_weight(128, 24, seed=bits) + np.float32(0.02 * symmetric)
    grid = rtn(w, bits=bits, group_size=32, symmetric=symmetric)
    codes, scale, offset, w_hat = ref_rtn(w, bits, 32, symmetric)
    np.testing.assert_array_equal(grid.scale, scale)
    np.testing.assert_array_equal(grid.offset, offset)
    np.testing.assert_array_equal(grid.codes, codes)
    np.testing.assert_array_equal(dequantize_grid(grid), w_hat.astype(np.float32))
    step = np.repeat(scale, 32, axis=0)  # every weight within half a step (range covered)
    assert np.all(np.abs(w_hat - w) <= step / 2 * (1 + 1e-6))


def _methods(w, h, xm):
    return {"rtn": lambda **kw: rtn(w, **kw), "gptq": lambda **kw: gptq(w, h, **kw),
            "gptq-act-order": lambda **kw: gptq(w, h, act_order=True, **kw),
            "awq": lambda **kw: awq(w, h, xm, **kw)[1], "hqq": lambda **kw: hqq(w, **kw)}


@pytest.mark.parametrize("symmetric", [False, True])
def test_every_method_returns_a_valid_grid(symmetric):
    x = calib_inputs(96, 512, seed=1)
    w = random_weight(96, 40, seed=2)
    for name, method in _methods(w, gram(x), np.abs(x).mean(0)).items():
        grid = method(bits=3, group_size=32, symmetric=symmetric)
        assert isinstance(grid, Grid) and ptq.validate_grid(grid) is grid, name
        assert grid.codes.shape == (96, 40) and grid.codes.dtype == np.uint8 and grid.codes.max() <= 7
        for a in (grid.scale, grid.offset):  # float16-representable
            assert a.shape == (3, 40) and a.dtype == np.float32
            np.testing.assert_array_equal(a.astype(np.float16).astype(np.float32), a)
        if symmetric:
            np.testing.assert_array_equal(grid.offset, -4 * grid.scale)
        want = (grid.codes.astype(np.float64).reshape(3, 32, 40) * grid.scale[:, None].astype(np.float64)
                + grid.offset[:, None]).reshape(96, 40)
        np.testing.assert_array_equal(dequantize_grid(grid), want.astype(np.float32))


# ---- GPTQ ------------------------------------------------------------------------------------
GPTQ_CASES = [  # (K, group, bits, act_order, symmetric, block, dead inputs)
    (64, 16, 4, False, False, 128, 0),
    (128, 32, 3, True, False, 128, 2),
    (256, 64, 4, False, False, 32, 0),    # a group spans two blocks
    (256, 256, 3, False, False, 64, 0),   # one group per column
    (128, 128, 4, True, True, 128, 0),
    (192, 64, 2, False, True, 48, 3),
    (256, 32, 8, True, False, 128, 0),
]


@pytest.mark.parametrize("k,g,bits,act_order,symmetric,block,dead", GPTQ_CASES)
def test_gptq_matches_one_input_at_a_time_reference(k, g, bits, act_order, symmetric, block, dead):
    """Same codes as the float64 OBS reference, except where float32 rounding lands on the
    other side of an exact rounding tie; one such flip feeds a different error to the inputs
    after it, so up to 1% of the codes may differ (seen: 0 in almost every case, 5/8192 in
    one 8-bit case)."""
    for seed in range(2):
        x = calib_inputs(k, 4 * k, seed=seed)
        x[:, np.random.default_rng(seed).choice(k, dead, replace=False)] = 0
        w, h = random_weight(k, 32, seed=seed + 10), gram(x)
        grid = gptq(w, h, bits=bits, group_size=g, act_order=act_order, symmetric=symmetric, block=block)
        assert np.mean(grid.codes != ref_gptq(w, h, bits, g, act_order, symmetric)) <= 0.01


@pytest.mark.parametrize("name", REAL)
@pytest.mark.parametrize("bits", [3, 4])
def test_gptq_output_error_below_rtn_on_real_weights(name, bits):
    w = smollm2_weight(name)
    h = calib_stats(w.shape[0], seed=3)[0]
    e_rtn = relative_error(w, dequantize_grid(rtn(w, bits=bits, group_size=64)), h)
    for act_order in (False, True):
        grid = gptq(w, h, bits=bits, group_size=64, act_order=act_order)
        e_gptq = relative_error(w, dequantize_grid(grid), h)
        assert e_gptq < 0.8 * e_rtn, (act_order, e_gptq, e_rtn)


# ---- AWQ -------------------------------------------------------------------------------------
def ref_awq_alpha(w, h, xm, bits, g, n_grid=20):
    """The exact grid search (no clipping): the alpha whose RTN of diag(s) W has the
    lowest float64 output error."""
    errors = []
    for alpha in np.arange(n_grid) / n_grid:
        s = np.maximum(xm ** alpha, 1e-4)
        s = s / np.sqrt(s.max() * s.min())
        w_hat = ref_rtn((s[:, None] * w).astype(np.float32), bits, g, False)[3] / s[:, None]
        errors.append(output_error(w, w_hat, h))
    return int(np.argmin(errors)), min(errors)


def test_awq_search_equals_the_exact_grid_search_when_h_is_small():
    """K <= AWQ_RANK: the search's model of H is exact, so it picks the reference's alpha."""
    k = min(64, ptq.AWQ_RANK)
    x = calib_inputs(k, 1024, seed=4)
    w, h, xm = random_weight(k, 48, seed=5), gram(x), np.abs(x).mean(0)
    s, grid = awq(w, h, xm, bits=3, group_size=32, clip_search=False)
    best, err = ref_awq_alpha(w, h, xm, 3, 32)
    want = np.maximum(xm ** (best / 20), 1e-4)
    np.testing.assert_allclose(s, want / np.sqrt(want.max() * want.min()), rtol=1e-5)
    np.testing.assert_allclose(output_error(w, dequantize_grid(grid) / s[:, None], h), err, rtol=1e-4)


def test_awq_never_above_rtn():
    """No salient channels (i.i.d. inputs; K beyond AWQ_RANK): AWQ may gain nothing, but
    never loses (1e-5: the float32 comparison of exact errors)."""
    bits = 3
    for seed in range(4):
        x = np.random.default_rng(seed).standard_normal((1024, 192))
        w, h = random_weight(192, 48, seed=seed), gram(x)
        s, grid = awq(w, h, np.abs(x).mean(0), bits=bits, group_size=32)
        e_awq = output_error(w, dequantize_grid(grid) / s[:, None], h)
        e_rtn = output_error(w, dequantize_grid(rtn(w, bits=bits, group_size=32)), h)
        assert e_awq <= e_rtn * (1 + 1e-5)


@pytest.mark.parametrize("name,bits", [(REAL[0], 3), (REAL[1], 4)])
def test_awq_below_rtn_with_salient_channels(name, bits):
    w = smollm2_weight(name)
    h, xm = calib_stats(w.shape[0], seed=6, outliers=8, outlier_scale=30.0)
    s, grid = awq(w, h, xm, bits=bits, group_size=64)
    e_awq = relative_error(w, dequantize_grid(grid) / s[:, None], h)
    e_rtn = relative_error(w, dequantize_grid(rtn(w, bits=bits, group_size=64)), h)
    assert e_awq < 0.9 * e_rtn, (e_awq, e_rtn)


def test_awq_model_of_h_tracks_the_exact_error():
    """K > AWQ_RANK: the rank-plus-diagonal model of H (what the search ranks with) is
    within 2% of the exact output error of a quantisation error (seen: 0.3%)."""
    w = smollm2_weight("blk.10.ffn_down.weight")
    h = calib_stats(w.shape[0], seed=3)[0]
    f, rdiag = ptq._h_model(h, ptq.AWQ_RANK)
    d = dequantize_grid(rtn(w, bits=3, group_size=64)) - w
    np.testing.assert_allclose(float(ptq._estimate(d, f, rdiag)), output_error(w, w + d, h), rtol=0.02)


# ---- HQQ -------------------------------------------------------------------------------------
HQQ_CASES = [(REAL[0], 3), (REAL[1], 4)]


def test_hqq_matches_float64_reference():
    """Float32 vs float64 iterations: the offsets agree to a small fraction of a step (a
    group whose early stop flips on a near-equal error keeps a neighbouring iterate)."""
    name, bits = HQQ_CASES[0]
    w = smollm2_weight(name)
    grid = hqq(w, bits=bits, group_size=64)
    np.testing.assert_array_equal(grid.scale, ref_rtn(w, bits, 64, False)[1])
    assert np.max(np.abs(grid.offset - ref_hqq(w, bits, 64)) / grid.scale) < 0.05


@pytest.mark.parametrize("name,bits", HQQ_CASES)
def test_hqq_lp_error_below_rtn_on_real_weights(name, bits):
    """No data: HQQ's l_p error (p = 0.7) and its l2 error are below RTN's (seen on these
    matrices: l_p 1.8% / 7.4% and l2 3.8% / 12% lower at 3 / 4 bits)."""
    w = smollm2_weight(name)
    d_hqq = dequantize_grid(hqq(w, bits=bits, group_size=64)) - w
    d_rtn = dequantize_grid(rtn(w, bits=bits, group_size=64)) - w
    assert np.mean(np.abs(d_hqq) ** 0.7) < (0.99 if bits == 3 else 0.95) * np.mean(np.abs(d_rtn) ** 0.7)
    assert np.mean(d_hqq ** 2) < np.mean(d_rtn ** 2)


# ---- bad arguments ---------------------------------------------------------------------------
W64 = random_weight(64, 8, seed=0)
H64 = np.eye(64)
BAD = [
    (rtn, (W64,), dict(bits=5, group_size=32), "rtn: bits=5"),
    (rtn, (W64,), dict(bits=4, group_size=24), "group_size=24 must be a positive divisor of K=64"),
    (rtn, (W64,), dict(bits=4, group_size=64.0), "group_size=64.0"),
    (rtn, (W64,), dict(bits=4, group_size=0), "group_size=0"),
    (rtn, (W64[0],), dict(bits=4, group_size=32), "w must be a non-empty float"),
    (hqq, (np.where(W64 > 0, np.nan, W64),), dict(bits=4, group_size=32), "non-finite"),
    (gptq, (W64, np.eye(63)), dict(bits=4, group_size=32), "h has shape"),
    (gptq, (W64, np.where(H64 > 0, np.inf, H64)), dict(bits=4, group_size=32), "h has non-finite"),
    (gptq, (W64, -H64), dict(bits=4, group_size=32), "not positive definite"),
    (gptq, (W64, H64), dict(bits=4, group_size=32, act_order=True, static_groups=False),
     "static_groups"),
    (gptq, (W64, H64), dict(bits=4, group_size=32, damp=-1.0), "damp=-1.0"),
    (gptq, (W64, H64), dict(bits=4, group_size=32, block=0), "block=0"),
    (awq, (W64, H64, np.ones(32)), dict(bits=4, group_size=32), "x_absmean has shape"),
    (awq, (W64, H64, -np.ones(64)), dict(bits=4, group_size=32), "x_absmean has negative"),
    (awq, (W64, H64, np.ones(64)), dict(bits=4, group_size=32, n_grid=0), "n_grid=0"),
    (hqq, (W64,), dict(bits=4, group_size=32, p=0.0), "p=0.0"),
    (hqq, (W64,), dict(bits=4, group_size=32, iters=0), "iters=0"),
    (ptq.validate_grid, (Grid(np.zeros((64, 8), np.uint8), np.full((2, 8), 0.1, np.float32),
                              np.zeros((2, 8), np.float32), 4, 32),), {}, "scale is not float16"),
]


@pytest.mark.parametrize("fn,args,kwargs,match", BAD, ids=[b[3] for b in BAD])
def test_bad_arguments_raise_one_line_errors(fn, args, kwargs, match):
    assert_one_line_error(fn, *args, match=match, **kwargs)
