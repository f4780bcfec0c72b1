"""The quantised-matmul CPU kernel (jaxdec.ops.cpu_kernel) against a float64 NumPy reference."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxdec.ops import cpu_kernel as ck

pytestmark = pytest.mark.skipif(not ck.available(), reason=f"CPU kernel unavailable: {ck.reason()}")


def make(M, K, N, bits, g=32, offset=True, seed=0):
    """Random inputs, none of them zero-filled."""
    rng = np.random.default_rng(seed + 1000 * M + 7 * K + N + bits)
    x = rng.standard_normal((M, K)).astype(np.float32)
    if bits == 8:
        q = rng.integers(-128, 128, (K, N), dtype=np.int8)
    else:
        q = rng.integers(0, 256, (K // 2, N), dtype=np.uint8)
    s = (rng.random((K // g, N)) * 0.02 + 1e-3).astype(np.float16)
    o = (rng.standard_normal((K // g, N)) * 0.1).astype(np.float16) if offset else None
    return x, q, s, o


def ref_weights(q, s, o, bits, g):
    """W float64[K, N] from the definition."""
    if bits == 8:
        codes = q.astype(np.float64)
    else:
        codes = np.empty((2 * q.shape[0], q.shape[1]))
        codes[0::2] = q & 0xF
        codes[1::2] = q >> 4
    w = codes * np.repeat(s.astype(np.float64), g, axis=0)
    if o is not None:
        w += np.repeat(o.astype(np.float64), g, axis=0)
    return w


def amx_rows(M: int, impl: str = "auto", g: int = 32) -> bool:
    """Whether the kernel computes these rows in AMX tiles (bf16 inputs, f32 sums)."""
    return ck.has_amx() and impl in ("auto", "simd") and M >= 16 and g % 2 == 0


def bf16_round(a) -> np.ndarray:
    """float64 -> float32 (one rounding, as the kernel's fused multiply-add of code, scale and
    offset) -> bfloat16 (to nearest even, as the AMX path's conversions) -> float64."""
    return np.asarray(np.asarray(a, np.float32).astype(ml_dtypes.bfloat16), np.float64)


def check_against(y, x, w, *, amx: bool = False):
    """y vs x @ w in float64 (w float64[K, N]), within f32 rounding of sums of K products:
    bounded relative to sum |x| |W|. With `amx`, x and W are first rounded to bfloat16 as the
    AMX path does, so its result is held to the same f32 bound."""
    if amx:
        x, w = bf16_round(x), bf16_round(w)
    x64 = np.asarray(x, np.float64)
    ref = x64 @ w
    bound = np.abs(x64) @ np.abs(w)
    y = np.asarray(y, np.float64)
    assert y.shape == ref.shape
    err = np.abs(y - ref)
    tol = 2e-6 * bound + 1e-6
    assert np.all(err <= tol), f"max err {err.max():.3g}, worst ratio {(err / tol).max():.3g}"


def check(y, x, q, s, o, bits, g, impl="auto"):
    M = int(np.prod(np.shape(x)[:-1]))
    check_against(y, x, ref_weights(q, s, o, bits, g), amx=amx_rows(M, impl, g))


SHAPES = [(96, 100), (576, 77), (896, 130), (64, 16), (32, 1)]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("M", [1, 3, 5, 7, 8, 64])
@pytest.mark.parametrize("K,N", SHAPES)
def test_matches_reference(K, N, M, offset, bits):
    x, q, s, o = make(M, K, N, bits, offset=offset)
    f = jax.jit(lambda x, q, s, o: ck.qmatmul(x, q, s, o, bits=bits))
    check(f(x, q, s, o), x, q, s, o, bits, 32)


@pytest.mark.parametrize("impl", ["auto", "avx2"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("offset", [False, True])
def test_rows_do_not_depend_on_the_blocking(bits, offset, impl):
    """Up to 8 rows share register blocks of up to 6 (int4: 4) rows, split into balanced
    blocks (7 rows: 4 + 3). A row's sums must not depend on which block it lands in: the
    first m rows of an 8-row product are bit for bit the m-row product, for every m. (A
    speculative verification computes the draft's rows together; plain decoding, one.)"""
    x, q, s, o = make(8, 576, 700, bits, offset=offset, seed=5)
    f = jax.jit(lambda x, q, s, o: ck.qmatmul(x, q, s, o, bits=bits, impl=impl))
    full = np.asarray(f(x, q, s, o))
    check(full, x, q, s, o, bits, 32)
    for m in range(1, 8):
        np.testing.assert_array_equal(np.asarray(f(x[:m], q, s, o)), full[:m], err_msg=f"{m} rows")


@pytest.mark.parametrize("impl", ["auto", "avx2"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("offset", [False, True])
def test_rows_do_not_depend_on_the_path(bits, offset, impl):
    """Past `JAXDEC_CPU_PANEL_MIN_M` rows (8) the kernel widens each group's codes once into a
    panel and runs every row block from it; up to 8 rows, it widens them for every block. The
    two paths sum in the same order: a prompt chunk's rows are bit for bit the rows of a
    decode step or a short verification chunk."""
    x, q, s, o = make(40, 576, 700, bits, offset=offset, seed=6)
    f = jax.jit(lambda x, q, s, o: ck.qmatmul(x, q, s, o, bits=bits, impl=impl))
    full = np.asarray(f(x, q, s, o))
    check(full, x, q, s, o, bits, 32)
    for m in (1, 5, 8, 9, 13, 25):
        np.testing.assert_array_equal(np.asarray(f(x[:m], q, s, o)), full[:m], err_msg=f"{m} rows")


@pytest.mark.parametrize("impl", ["scalar", "avx2"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("M", [1, 5, 12, 40])
@pytest.mark.parametrize("K,N", [(96, 100), (576, 77), (64, 48)])
def test_portable_and_avx2_paths(K, N, M, offset, bits, impl):
    """The scalar loops (any CPU), and the AVX2 code (x86 without AVX-512; the scalar loops on
    a CPU without AVX2) that AVX-512 machines never take by themselves."""
    x, q, s, o = make(M, K, N, bits, offset=offset, seed=1)
    f = jax.jit(lambda x, q, s, o: ck.qmatmul(x, q, s, o, bits=bits, impl=impl))
    check(f(x, q, s, o), x, q, s, o, bits, 32, impl=impl)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("g,K,M", [(16, 96, 3), (64, 576, 9), (2, 8, 2), (6, 36, 1), (512, 1024, 16),
                                   (512, 1024, 2)])
def test_group_sizes(g, K, M, bits):
    """Group sizes other than 32, incl. ones that are not a multiple of 4 rows and ones longer
    than the kernel's panel (split accumulation)."""
    x, q, s, o = make(M, K, 70, bits, g=g, offset=True, seed=2)
    for impl in ("auto", "scalar", "avx2"):
        f = jax.jit(lambda x, q, s, o: ck.qmatmul(x, q, s, o, bits=bits, group_size=g, impl=impl))
        check(f(x, q, s, o), x, q, s, o, bits, g, impl=impl)


@pytest.mark.parametrize("impl", ["auto", "avx2"])
def test_wide_parallel_and_thread_independence(impl):
    """A matrix big enough to be split across threads; per-column arithmetic does not depend on
    the split, so one thread and all threads agree bit for bit."""
    x, q, s, o = make(2, 576, 4100, 8, offset=True, seed=3)
    f = jax.jit(lambda x, q, s, o: ck.qmatmul(x, q, s, o, bits=8, impl=impl))
    y_all = np.asarray(f(x, q, s, o))
    check(y_all, x, q, s, o, 8, 32)
    try:
        ck.set_threads(1)
        y_one = np.asarray(jax.jit(lambda x, q, s, o: ck.qmatmul(x, q, s, o, bits=8, impl=impl) + 0.0)(x, q, s, o))
    finally:
        ck.set_threads(0)
    np.testing.assert_array_equal(y_all, y_one)


def test_matches_xla_path():
    x, q, s, o = make(4, 576, 200, 4, offset=True, seed=4)
    y = jax.jit(lambda *a: ck.qmatmul(*a, bits=4))(x, q, s, o)
    y_xla = jax.jit(lambda *a: ck.qmatmul_xla(*a, bits=4, precision=jax.lax.Precision.HIGHEST))(x, q, s, o)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_xla), rtol=1e-4, atol=1e-3)


def test_inside_while_loop():
    """Repeated calls in a lax.while_loop body, the input changing each iteration."""
    K, N = 192, 192
    x, q, s, o = make(1, K, N, 8, offset=False, seed=5)
    s = (s.astype(np.float32) * 0.05).astype(np.float16)  # keep the iteration contractive

    def step(carry):
        i, h = carry
        y = ck.qmatmul(h, q, s, None, bits=8)
        return i + 1, jnp.tanh(y)

    out = jax.jit(lambda h: jax.lax.while_loop(lambda c: c[0] < 5, step, (0, h))[1])(x)
    h = x.astype(np.float64)
    w = ref_weights(q, s, None, 8, 32)
    for _ in range(5):
        h = np.tanh(h @ w)
    np.testing.assert_allclose(np.asarray(out), h, rtol=1e-4, atol=1e-5)


def test_leading_dims_and_vmap():
    K, N = 96, 50
    x, q, s, o = make(6, K, N, 4, offset=True, seed=6)
    x3 = x.reshape(2, 3, K)
    y = ck.qmatmul(x3, q, s, o, bits=4)
    assert y.shape == (2, 3, N)
    check(np.asarray(y).reshape(6, N), x, q, s, o, 4, 32)
    # vmap over x, weights shared (rows folded into M)
    yv = jax.jit(jax.vmap(lambda xi: ck.qmatmul(xi, q, s, o, bits=4)))(x3)
    check(np.asarray(yv).reshape(6, N), x, q, s, o, 4, 32)
    # vmap over the weights too (per-batch matrices), and over weights only
    xs, qs, ss, os_ = zip(*[make(3, K, N, 4, offset=True, seed=10 + i) for i in range(2)])
    xs, qs, ss, os_ = map(np.stack, (xs, qs, ss, os_))
    yb = jax.jit(jax.vmap(lambda xi, qi, si, oi: ck.qmatmul(xi, qi, si, oi, bits=4)))(xs, qs, ss, os_)
    for i in range(2):
        check(np.asarray(yb[i]), xs[i], qs[i], ss[i], os_[i], 4, 32)
    yw = jax.vmap(lambda qi, si, oi: ck.qmatmul(xs[0], qi, si, oi, bits=4))(qs, ss, os_)
    for i in range(2):
        check(np.asarray(yw[i]), xs[0], qs[i], ss[i], os_[i], 4, 32)


def _custom_calls(hlo_text):
    return [line for line in hlo_text.splitlines() if "jaxdec_qmatmul" in line]


def test_lowering_cpu_and_cuda(monkeypatch):
    monkeypatch.setattr(ck, "PORTABLE", True)
    K, N = 96, 40
    args = (jax.ShapeDtypeStruct((2, K), jnp.float32), jax.ShapeDtypeStruct((K // 2, N), jnp.uint8),
            jax.ShapeDtypeStruct((K // 32, N), jnp.float16))
    f = jax.jit(lambda x, q, s: ck.qmatmul(x, q, s, None, bits=4))
    compiled = f.lower(*args).compile().as_text()
    assert _custom_calls(compiled), "CPU program should call the kernel"
    assert "conditional" not in compiled
    exported = jax.export.export(f, platforms=["cuda"])(*args)
    text = exported.mlir_module()
    assert "custom_call" not in text and "dot_general" in text


def test_large_m_dispatch():
    """Without AMX, M >= MAX_KERNEL_M goes to XLA (M >= MAX_AVX2_KERNEL_M or
    MAX_SCALAR_KERNEL_M where the kernel runs AVX2 or scalar code on this CPU); with AMX the
    kernel keeps every M."""
    limit = {"avx512": ck.MAX_KERNEL_M, "avx2": ck.MAX_AVX2_KERNEL_M}.get(ck.isa(), ck.MAX_SCALAR_KERNEL_M)
    K, N = 64, 32
    f = jax.jit(lambda x, q, s: ck.qmatmul(x, q, s, None, bits=8))
    for M in (limit - 1, limit):
        args = (jax.ShapeDtypeStruct((M, K), jnp.float32), jax.ShapeDtypeStruct((K, N), jnp.int8),
                jax.ShapeDtypeStruct((K // 32, N), jnp.float16))
        assert bool(_custom_calls(f.lower(*args).as_text())) == (M < limit or ck.has_amx())


@pytest.mark.skipif(not ck.has_amx(), reason="this CPU has no AMX (or the OS did not grant it)")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("M,K,N", [(16, 64, 32), (32, 576, 1536), (33, 96, 70), (100, 1536, 300),
                                   (17, 1000, 257)])
def test_amx_rows_match_bf16_reference(M, K, N, bits):
    """Batched rows (AMX path): equal to the float64 product of the bf16-rounded operands
    within f32 rounding, and within bf16 rounding of the exact product; several slabs, tails
    of every kind (rows past 32, columns past the slab, K not a multiple of 32)."""
    g = 40 if K == 1000 else 32
    x, q, s, o = make(M, K, N, bits, g=g, offset=True, seed=5)
    y = np.asarray(jax.jit(lambda *a: ck.qmatmul(*a, bits=bits, group_size=g))(x, q, s, o))
    check(y, x, q, s, o, bits, g)
    w = ref_weights(q, s, o, bits, g)
    exact = x.astype(np.float64) @ w
    assert np.abs(y - exact).max() <= 2 ** -7 * (np.abs(x) @ np.abs(w)).max()


def test_bad_arguments():
    x, q, s, o = make(1, 64, 16, 8)
    with pytest.raises(TypeError):
        ck.qmatmul(x, q.view(np.uint8), s, o, bits=8)
    with pytest.raises(ValueError):
        ck.qmatmul(x, q, s, o, bits=8, group_size=48)
    with pytest.raises(ValueError):
        ck.qmatmul(x[:, :32], q, s, o, bits=8)
    with pytest.raises(ValueError):
        ck.qmatmul(x, q, s, o, bits=3)
    with pytest.raises(TypeError):
        ck.qmatmul(x, q, s.astype(np.float32), o, bits=8)


def test_unavailable_falls_back(tmp_path):
    """No usable compiler: available() is False with a reason, qmatmul and dense_matmul still
    work (XLA)."""
    code = (
        "import numpy as np\n"
        "from jaxdec.ops import cpu_kernel as ck\n"
        "assert not ck.available(), ck.info()\n"
        "assert ck.reason(), 'no reason'\n"
        "x = np.ones((1, 64), np.float32); q = np.ones((64, 8), np.int8)\n"
        "s = np.full((2, 8), 0.5, np.float16)\n"
        "y = np.asarray(ck.qmatmul(x, q, s, None, bits=8))\n"
        "assert np.allclose(y, 32.0), y\n"
        "w = np.full((64, 8), 0.5, np.float32)\n"
        "assert np.allclose(np.asarray(ck.dense_matmul(x, w)), 32.0)\n"
        "print('REASON:', ck.reason().splitlines()[0])\n"
    )
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), JAXDEC_KERNEL_CACHE=str(tmp_path),
               JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "REASON: no C++ compiler" in res.stdout


def test_independent_calls_in_one_program():
    """Several independent kernel calls in one jitted program (XLA may run them concurrently;
    a caller that finds the thread pool busy computes on its own thread)."""
    mats = [make(2, 576, 1000 + 17 * i, 8 if i % 2 else 4, offset=bool(i % 3), seed=20 + i) for i in range(4)]
    x = mats[0][0]

    def f(x, ws):
        return [ck.qmatmul(x, q, s, o, bits=8 if i % 2 else 4) for i, (q, s, o) in enumerate(ws)]

    outs = jax.jit(f)(x, [(q, s, o) for _, q, s, o in mats])
    for i, (y, (_, q, s, o)) in enumerate(zip(outs, mats)):
        check(y, x, q, s, o, 8 if i % 2 else 4, 32)


# ---------------------------------------------------------------------------------------------
# Dense weights (float32 / bfloat16): dense_matmul
# ---------------------------------------------------------------------------------------------

DENSE_DTYPES = [jnp.float32, jnp.bfloat16]
# Odd N, K not a multiple of 16, K longer than one panel block (256 rows) and not a multiple of
# the kernel's row blocks, N with a masked tail, a single column, a single row.
DENSE_SHAPES = [(96, 100), (100, 77), (577, 130), (64, 16), (33, 1), (1000, 257), (1, 40)]


def make_dense(M, K, N, dtype, seed=0):
    """Random x f32[M, K] and w [K, N] of `dtype` (none of them zero-filled)."""
    rng = np.random.default_rng(seed + 1000 * M + 7 * K + N)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = np.asarray(jnp.asarray(rng.standard_normal((K, N)).astype(np.float32) * 0.1, dtype))
    return x, w


def check_dense(y, x, w, impl="auto"):
    amx = jnp.dtype(w.dtype) == jnp.bfloat16 and amx_rows(int(np.prod(np.shape(x)[:-1])), impl)
    check_against(y, x, np.asarray(np.asarray(w, np.float32), np.float64), amx=amx)  # bf16 -> f32: exact


def _dense_calls(hlo_text):
    return [line for line in hlo_text.splitlines() if "jaxdec_dense_matmul" in line]


@pytest.fixture
def dense_kernel_any_m(monkeypatch):
    """Route every M to the kernel (M >= MAX_DENSE_KERNEL_M would otherwise go to XLA)."""
    monkeypatch.setattr(ck, "MAX_DENSE_KERNEL_M", dict.fromkeys(ck.MAX_DENSE_KERNEL_M, 1 << 30))


@pytest.mark.parametrize("dtype", DENSE_DTYPES)
@pytest.mark.parametrize("M", [1, 3, 5, 6, 7, 8, 64])
@pytest.mark.parametrize("K,N", DENSE_SHAPES)
def test_dense_matches_reference(K, N, M, dtype, dense_kernel_any_m):
    x, w = make_dense(M, K, N, dtype)
    f = jax.jit(ck.dense_matmul)
    assert _dense_calls(f.lower(x, w).as_text()), "should run the kernel"
    y = f(x, w)
    assert y.dtype == jnp.float32
    check_dense(y, x, w)


@pytest.mark.parametrize("impl", ["scalar", "avx2"])
@pytest.mark.parametrize("dtype", DENSE_DTYPES)
@pytest.mark.parametrize("M", [1, 5, 12])
@pytest.mark.parametrize("K,N", [(96, 100), (577, 77), (33, 1), (64, 48)])
def test_dense_portable_and_avx2_paths(K, N, M, dtype, impl):
    x, w = make_dense(M, K, N, dtype, seed=1)
    check_dense(jax.jit(lambda x, w: ck.dense_matmul(x, w, impl=impl))(x, w), x, w, impl=impl)


@pytest.mark.parametrize("impl", ["auto", "avx2"])
@pytest.mark.parametrize("dtype", DENSE_DTYPES)
def test_dense_rows_do_not_depend_on_the_row_count(dtype, impl):
    """Up to 8 rows, a row's sums are the same bit for bit whatever the other rows: the
    decode step's logits equal a speculative verification chunk's."""
    x, w = make_dense(8, 576, 1536, dtype, seed=6)
    f = jax.jit(lambda x, w: ck.dense_matmul(x, w, impl=impl))
    full = np.asarray(f(x, w))
    check_dense(full, x, w, impl=impl)
    for m in range(1, 8):
        np.testing.assert_array_equal(np.asarray(f(x[:m], w)), full[:m], err_msg=f"{m} rows")


@pytest.mark.parametrize("dtype", DENSE_DTYPES)
@pytest.mark.parametrize("M,K,N", [(2, 576, 4100), (1, 1536, 576), (3, 577, 1536), (6, 576, 700)])
def test_dense_wide_parallel_and_thread_independence(M, K, N, dtype):
    """Matrices big enough to be split across threads, over N (wide rows, or M > 4) or over K
    (slabs of rows summed in a fixed order): one thread and all threads agree bit for bit."""
    x, w = make_dense(M, K, N, dtype, seed=3)
    f = jax.jit(ck.dense_matmul)
    y_all = np.asarray(f(x, w))
    check_dense(y_all, x, w)
    try:
        ck.set_threads(1)
        y_one = np.asarray(jax.jit(lambda x, w: ck.dense_matmul(x, w) + 0.0)(x, w))
    finally:
        ck.set_threads(0)
    np.testing.assert_array_equal(y_all, y_one)


@pytest.mark.parametrize("dtype", DENSE_DTYPES)
def test_dense_inside_while_loop(dtype):
    """Repeated calls in a lax.while_loop body (distinct weights per layer, the input changing
    every iteration), against the float64 recurrence."""
    K = 200
    x, w1 = make_dense(1, K, K, dtype, seed=5)
    _, w2 = make_dense(1, K, K, dtype, seed=6)

    def step(carry):
        i, h = carry
        h = jnp.tanh(ck.dense_matmul(h, w1))
        return i + 1, jnp.tanh(ck.dense_matmul(h, w2))

    f = jax.jit(lambda h: jax.lax.while_loop(lambda c: c[0] < 4, step, (0, h))[1])
    assert _dense_calls(f.lower(x).compile().as_text())
    out = f(x)
    h = x.astype(np.float64)
    w1_64, w2_64 = (np.asarray(np.asarray(w, np.float32), np.float64) for w in (w1, w2))
    for _ in range(4):
        h = np.tanh(np.tanh(h @ w1_64) @ w2_64)
    np.testing.assert_allclose(np.asarray(out), h, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", DENSE_DTYPES)
def test_dense_leading_dims_and_vmap(dtype):
    K, N = 96, 50
    x, w = make_dense(6, K, N, dtype, seed=7)
    x3 = x.reshape(2, 3, K)
    y = ck.dense_matmul(x3, w)
    assert y.shape == (2, 3, N)
    check_dense(np.asarray(y).reshape(6, N), x, w)
    yv = jax.jit(jax.vmap(lambda xi: ck.dense_matmul(xi, w)))(x3)
    check_dense(np.asarray(yv).reshape(6, N), x, w)
    # batched weights, with and without batched x
    xs, ws = zip(*[make_dense(3, K, N, dtype, seed=10 + i) for i in range(2)])
    xs, ws = np.stack(xs), np.stack(ws)
    yb = jax.jit(jax.vmap(ck.dense_matmul))(xs, ws)
    yw = jax.vmap(lambda wi: ck.dense_matmul(xs[0], wi))(ws)
    for i in range(2):
        check_dense(yb[i], xs[i], ws[i])
        check_dense(yw[i], xs[0], ws[i])


@pytest.mark.parametrize("dtype", DENSE_DTYPES)
def test_dense_lowering_cpu_and_cuda(dtype, monkeypatch):
    monkeypatch.setattr(ck, "PORTABLE", True)
    args = (jax.ShapeDtypeStruct((2, 96), jnp.float32), jax.ShapeDtypeStruct((96, 40), dtype))
    f = jax.jit(ck.dense_matmul)
    compiled = f.lower(*args).compile().as_text()
    assert _dense_calls(compiled), "CPU program should call the kernel"
    assert "conditional" not in compiled
    text = jax.export.export(f, platforms=["cuda"])(*args).mlir_module()
    assert "custom_call" not in text and "dot_general" in text


@pytest.mark.parametrize("dtype", DENSE_DTYPES)
def test_dense_large_m_uses_xla(dtype):
    """Activations of the weights' dtype go to XLA's dot from MAX_DENSE_KERNEL_M rows (bf16:
    its own limit where XLA's dot runs on AMX, float32's elsewhere)."""
    name = jnp.dtype(dtype).name
    M = ck.MAX_DENSE_KERNEL_M[name if name == "float32" or ck.has_amx() else "float32"]
    assert ck._dense_limit(dtype, dtype) == M
    f = jax.jit(ck.dense_matmul)
    w = jax.ShapeDtypeStruct((64, 32), dtype)
    assert not _dense_calls(f.lower(jax.ShapeDtypeStruct((M, 64), dtype), w).as_text())
    assert _dense_calls(f.lower(jax.ShapeDtypeStruct((M - 1, 64), dtype), w).as_text())


def test_dense_bf16_weights_f32_rows():
    """bfloat16 weights against float32 activations: XLA would widen the matrix on every call,
    so the kernel keeps them (every M with AMX, up to 128 rows without)."""
    f = jax.jit(ck.dense_matmul)
    w = jax.ShapeDtypeStruct((64, 32), jnp.bfloat16)
    big = f.lower(jax.ShapeDtypeStruct((512, 64), jnp.float32), w).as_text()
    assert bool(_dense_calls(big)) == ck.has_amx()
    assert _dense_calls(f.lower(jax.ShapeDtypeStruct((127, 64), jnp.float32), w).as_text())


def test_dense_other_dtypes_use_xla():
    f = jax.jit(ck.dense_matmul)
    # float16 weights: XLA, same contract
    x, w = make_dense(3, 64, 24, jnp.float16, seed=8)
    assert not _dense_calls(f.lower(x, w).as_text())
    y = f(x, w)
    assert y.dtype == jnp.float32
    ref = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=1e-4)


def test_dense_matches_xla_path():
    x, w = make_dense(4, 576, 200, jnp.bfloat16, seed=9)
    y = jax.jit(ck.dense_matmul)(x, w)
    y_xla = jax.jit(lambda x, w: ck.dense_matmul_xla(x, w, precision=jax.lax.Precision.HIGHEST))(x, w)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_xla), rtol=1e-4, atol=1e-4)


def test_dense_bad_arguments():
    x, w = make_dense(1, 64, 16, jnp.float32)
    with pytest.raises(ValueError):
        ck.dense_matmul(x[:, :32], w)
    with pytest.raises(ValueError):
        ck.dense_matmul(x, w[None])
    with pytest.raises(ValueError):
        ck.dense_matmul(x, w, impl="fast")


def test_dense_independent_calls_in_one_program():
    mats = [make_dense(2, 576, 1000 + 17 * i, DENSE_DTYPES[i % 2], seed=20 + i)[1] for i in range(4)]
    x = make_dense(2, 576, 1, jnp.float32, seed=30)[0]
    outs = jax.jit(lambda x, ws: [ck.dense_matmul(x, w) for w in ws])(x, mats)
    for y, w in zip(outs, mats):
        check_dense(y, x, w)


def test_dense_gradients_are_the_products():
    """The kernel path is differentiable: d(sum(c * x @ w)) by reverse and forward mode equals
    the float64 product rule (c @ w^T for x, x^T @ c for w)."""
    rng = np.random.default_rng()
    x = rng.standard_normal((3, 64)).astype(np.float32)
    w = rng.standard_normal((64, 96)).astype(np.float32)
    c = rng.standard_normal((3, 96)).astype(np.float32)
    f = lambda x, w: jnp.sum(jnp.asarray(c) * ck.dense_matmul(x, w))
    gx, gw = jax.jit(jax.grad(f, argnums=(0, 1)))(x, w)
    x64, w64, c64 = (a.astype(np.float64) for a in (x, w, c))
    np.testing.assert_allclose(gx, c64 @ w64.T, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gw, x64.T @ c64, rtol=1e-4, atol=1e-4)
    dx = rng.standard_normal(x.shape).astype(np.float32)
    dw = rng.standard_normal(w.shape).astype(np.float32)
    _, tangent = jax.jvp(f, (x, w), (dx, dw))
    want = np.sum(c64 * (dx.astype(np.float64) @ w64 + x64 @ dw.astype(np.float64)))
    np.testing.assert_allclose(tangent, want, rtol=1e-4)
