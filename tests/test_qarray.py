"""QArray: quantisers against a float64 reference, the pytree contract, validate, and the
GGUF block mapping (bit-exact against gguf's own dequantisation)."""

from __future__ import annotations

import dataclasses
from functools import partial

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from jaxdec.errors import JaxdecError
from jaxdec.formats import *  # noqa: F403 (the package's public API, `__all__`)
from jaxdec.formats import QArray, dequantize, quantize, validate
from jaxdec.formats.gguf_blocks import gguf_block_bits, qarray_from_gguf

GQ = gguf.GGMLQuantizationType
MODES = [(8, True), (8, False), (4, False), (4, True)]  # (bits, symmetric)
CODE_RANGE = {(8, True): (-127, 127), (8, False): (-128, 127), (4, True): (-8, 7), (4, False): (0, 15)}
F16_MAX = 65504.0
EPS32 = np.finfo(np.float32).eps


@partial(jax.jit, static_argnames=("bits", "group_size", "symmetric", "n_in"))
def quantize_jit(w, *, bits, group_size=32, symmetric=None, n_in=1):
    return quantize(w, bits=bits, group_size=group_size, symmetric=symmetric, n_in=n_in)


dequantize_jit = jax.jit(dequantize)


def weights(shape, seed, *, scale=1.0, shift=0.0):
    rng = np.random.default_rng(seed)
    return (shift + scale * rng.standard_normal(shape)).astype(np.float32)


# ---- float64 reference quantiser, written from the definition -------------------------------
def f16_toward(x, up):
    h = np.asarray(x, np.float64).astype(np.float16)
    wrong = h.astype(np.float64) < x if up else h.astype(np.float64) > x
    h = np.where(wrong, np.nextafter(h, np.float16(np.inf if up else -np.inf)), h)
    return np.clip(h, -F16_MAX, F16_MAX).astype(np.float16)


def ref_quantize(w, bits, symmetric, g):
    """float64: (scale f16[G, N], stored codes [K, N], dequantised f64[K, N])."""
    lo, hi = CODE_RANGE[(bits, symmetric)]
    k, n = w.shape
    groups = w.astype(np.float64).reshape(k // g, g, n)
    gmin, gmax = groups.min(1), groups.max(1)
    if symmetric:  # every w / scale in [lo, hi]; offset is 0 (int8) or -8 * scale (int4)
        top = np.maximum(np.maximum(gmax / hi, gmin / lo), 0.0)
        scale, off = f16_toward(np.minimum(top, F16_MAX / 8) if bits == 4 else top, True), 0.0
    else:  # offset rounded down first, then the scale covering [min, max] from it
        off = f16_toward(gmin - lo * (gmax - gmin) / (hi - lo), False).astype(np.float64)
        span = (gmax - off) / hi
        span = np.maximum(span, (gmin - off) / lo) if lo < 0 else span
        scale = f16_toward(span, True)
        off = off[:, None]
    s = scale.astype(np.float64)[:, None]
    codes = np.clip(np.round((groups - off) / np.where(s == 0, 1.0, s)), lo, hi)
    deq = (codes * s + off).reshape(k, n)
    stored = codes - lo if bits == 4 else codes
    return scale, stored.reshape(k, n), deq


def stored_codes(qa):
    q = np.asarray(qa.q)
    return (unpack_int4(q) if qa.bits == 4 else q).astype(np.int64)


def numpy_dequant(qa):
    """float64 W[K, N] from the fields, by the docstring formula."""
    g = qa.group_size
    w = stored_codes(qa) * np.repeat(np.asarray(qa.scale, np.float64), g, axis=0)
    if qa.offset is not None:
        w = w + np.repeat(np.asarray(qa.offset, np.float64), g, axis=0)
    return w


def assert_error_bound(qa, w):
    """|dequantize(qa) - w| <= stored scale / 2, up to float32 rounding."""
    k, n = qa.k, qa.n
    err = np.abs(np.asarray(dequantize_jit(qa), np.float64).reshape(k, n) - w.reshape(k, n))
    half = np.repeat(np.abs(np.asarray(qa.scale, np.float64)), qa.group_size, axis=0)[:k] / 2
    slack = 4 * EPS32 * (np.abs(w.reshape(k, n)) + half)
    assert np.all(err <= half + slack), float(np.max(err - half - slack))


# ---- quantisers ----------------------------------------------------------------------------
@pytest.mark.parametrize("bits,symmetric", MODES)
def test_quantize_matches_float64_reference(bits, symmetric):
    w = weights((256, 96), seed=bits + 2 * symmetric, shift=0.3)
    qa = quantize_jit(w, bits=bits, symmetric=symmetric)
    validate(qa)
    assert (qa.offset is None) == (bits == 8 and symmetric)
    scale, codes, _ = ref_quantize(w, bits, symmetric, 32)
    ours = np.asarray(qa.scale)
    same_scale = ours == scale
    assert same_scale.mean() > 0.99  # f32 vs f64 division can land across an f16 step
    assert np.all(np.abs(ours.astype(np.float64) - scale) <= np.spacing(np.abs(scale)))
    mask = np.repeat(same_scale, 32, axis=0)
    diff = np.abs(stored_codes(qa) - codes)[mask]
    assert diff.max() <= 1 and (diff == 0).mean() > 0.999
    lo, hi = CODE_RANGE[(bits, symmetric)]
    assert stored_codes(qa).min() >= (0 if bits == 4 else lo)
    assert stored_codes(qa).max() <= (15 if bits == 4 else hi)
    assert_error_bound(qa, w)


@settings(max_examples=20, deadline=None)
@given(mode=st.sampled_from(MODES), group_size=st.sampled_from([2, 8, 32]),
       log_scale=st.integers(-20, 12), shift=st.sampled_from([0.0, 1.0, -30.0]),
       constant_group=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_round_trip_error_bound(mode, group_size, log_scale, shift, constant_group, seed):
    bits, symmetric = mode
    w = weights((64, 6), seed, scale=2.0 ** log_scale, shift=shift * 2.0 ** log_scale)
    # The format's domain: scales and offsets are float16, so weights must stay inside its
    # finite range (hypothesis found shift=-30 at scale 2^11 reaching -67,000).
    assume(np.abs(w).max() < F16_MAX)
    if constant_group:
        w[:group_size, seed % 6] = w[0, 0]
    qa = quantize_jit(w, bits=bits, group_size=group_size, symmetric=symmetric)
    assert_error_bound(qa, w)


@pytest.mark.parametrize("bits,symmetric", MODES)
def test_constant_and_zero_groups_give_no_nan(bits, symmetric):
    w = weights((128, 8), seed=7)
    w[:32, 0] = 0.0           # all-zero group
    w[32:64, 1] = 0.3         # constant group (not representable in f16)
    w[64:96, 2] = -2.0        # constant group (representable)
    qa = quantize_jit(w, bits=bits, symmetric=symmetric)
    deq = np.asarray(dequantize(qa))
    assert np.all(np.isfinite(deq))
    assert np.all(deq[:32, 0] == 0.0)
    if not symmetric:  # a constant group is exact when its value is a float16
        assert np.all(deq[64:96, 2] == -2.0) and np.all(np.asarray(qa.scale)[2, 2] == 0)
    assert_error_bound(qa, w)


@pytest.mark.parametrize("bits,symmetric", MODES)
def test_huge_values_do_not_overflow_float16(bits, symmetric):
    w = weights((64, 4), seed=3, scale=1e8)
    qa = quantize_jit(w, bits=bits, symmetric=symmetric)
    leaves = [qa.scale] + ([] if qa.offset is None else [qa.offset])
    assert all(np.all(np.isfinite(np.asarray(x))) for x in leaves)
    assert np.all(np.isfinite(np.asarray(dequantize(qa))))


def test_quantize_rejects_bad_arguments():
    w = weights((64, 8), seed=0)
    for kwargs in (dict(bits=5), dict(bits=8, group_size=0), dict(bits=4, group_size=1),
                   dict(bits=8, n_in=2), dict(bits=8, n_in=0), dict(bits=8, n_batch=1, n_in=1)):
        with pytest.raises(JaxdecError):
            quantize(w, **kwargs)


# ---- a last group of fewer rows, stacks of matrices ------------------------------------------
def ref_quantize_short(w, bits, symmetric, g):
    """float64 dequantised W[K, N] when g does not divide K: groups of g rows, the last of
    K % g rows, each quantised on its own range by `ref_quantize`."""
    parts = [w[i:i + g] for i in range(0, len(w), g)]
    return np.concatenate([ref_quantize(p, bits, symmetric, len(p))[2] for p in parts])


@pytest.mark.parametrize("bits,symmetric", MODES)
@pytest.mark.parametrize("k,g", [(40, 16), (576, 128), (24, 32)])
def test_short_last_group_against_float64(bits, symmetric, k, g):
    """K = 40 in groups of 16: two full groups and one of 8 rows; its error bound is its
    own scale / 2; the matmul (CPU kernel and reference) ignores the padding rows."""
    from jaxdec import layers

    rng = np.random.default_rng()
    w = (rng.standard_normal((k, 12)) * rng.uniform(0.1, 2, (k, 1))).astype(np.float32)
    qa = quantize_jit(w, bits=bits, group_size=g, symmetric=symmetric)
    assert qa.n_groups == -(-k // g) and qa.k == k and qa.k_padded == qa.n_groups * g
    deq = np.asarray(dequantize_jit(qa), np.float64)
    assert deq.shape == (k, 12)
    ref = ref_quantize_short(w, bits, symmetric, g)
    err = np.abs(deq - ref)
    # f32 vs f64 arithmetic can land a code across a rounding boundary (one step, rarely:
    # 0.1% of codes at most in 30 draws), and at 8 bits asymmetric the f32 offset moves a
    # whole group by up to 1% of a step (so a relative 1e-6 bound fails for whole groups)
    step = np.repeat(np.abs(np.asarray(qa.scale, np.float64)), g, axis=0)[:k]
    assert np.all(err <= step * (1 + 1e-6)) and (err <= 0.05 * step).mean() > 0.99
    assert_error_bound(qa, w)
    x = rng.standard_normal((3, k)).astype(np.float32)
    want = x.astype(np.float64) @ deq
    bound = 2 * k * EPS32 * (np.abs(x) @ np.abs(deq)) + 1e-30
    for got in (matmul_reference(jnp.asarray(x), qa), layers.linear(jnp.asarray(x), qa)):
        assert np.all(np.abs(np.asarray(got, np.float64) - want) <= bound)


@pytest.mark.parametrize("bits", [8, 4])
def test_stack_of_matrices_is_each_matrix_quantised(bits):
    """A stack [E, K, N] (MoE experts, n_batch=1) holds each matrix's own quantisation;
    `select` gathers matrices, and the expert matmuls give float64's x @ W[e]."""
    from jaxdec.ops import qmatmul

    rng = np.random.default_rng()
    w = rng.standard_normal((5, 40, 6)).astype(np.float32)
    qa = quantize(jnp.asarray(w), bits=bits, group_size=16, n_batch=1)
    assert qa.shape == (5, 40, 6) and qa.batch_shape == (5,) and (qa.k, qa.n) == (40, 6)
    for e in range(5):
        one = quantize(jnp.asarray(w[e]), bits=bits, group_size=16)
        np.testing.assert_array_equal(np.asarray(dequantize(qa))[e], np.asarray(dequantize(one)))
    idx = jnp.asarray([3, 0, 3])
    np.testing.assert_array_equal(np.asarray(dequantize(select(qa, idx))),
                                  np.asarray(dequantize(qa))[np.asarray(idx)])
    deq = np.asarray(dequantize(qa), np.float64)
    x = rng.standard_normal((3, 2, 40)).astype(np.float32)
    got = np.asarray(qmatmul.expert_matmul(jnp.asarray(x), qa, idx), np.float64)
    want = np.einsum("smk,skn->smn", x.astype(np.float64), deq[np.asarray(idx)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    rows, sizes = rng.standard_normal((7, 40)).astype(np.float32), np.array([2, 0, 4, 0, 1], np.int32)
    got = np.asarray(qmatmul.ragged_matmul(jnp.asarray(rows), qa, jnp.asarray(sizes)), np.float64)
    owner = np.repeat(np.arange(5), sizes)
    want = np.einsum("rk,rkn->rn", rows.astype(np.float64), deq[owner])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    with pytest.raises(JaxdecError, match="stack"):
        matmul_reference(jnp.ones((1, 40)), qa)


# ---- dequantize, matmul_reference, take_columns ----------------------------------------------
@pytest.mark.parametrize("bits,symmetric", MODES)
def test_dequantize_and_matmul_against_float64(bits, symmetric):
    w = weights((8, 4, 6), seed=11, shift=-0.2)  # logical [D, N, H]-like, contracted over 2 dims
    qa = quantize_jit(w, bits=bits, group_size=8, symmetric=symmetric, n_in=2)
    assert (qa.k, qa.n, qa.shape, qa.in_shape, qa.out_shape) == (32, 6, (8, 4, 6), (8, 4), (6,))
    w64 = numpy_dequant(qa)
    deq = np.asarray(dequantize(qa))
    assert deq.shape == (8, 4, 6) and deq.dtype == np.float32
    np.testing.assert_allclose(deq.reshape(32, 6), w64, rtol=EPS32, atol=0)
    x = weights((3, 5, 32), seed=12)
    out = np.asarray(matmul_reference(jnp.asarray(x), qa))
    ref = x.astype(np.float64) @ w64
    bound = 2 * 32 * EPS32 * (np.abs(x) @ np.abs(w64))
    assert out.shape == (3, 5, 6) and out.dtype == np.float32
    assert np.all(np.abs(out - ref) <= bound)
    with pytest.raises(JaxdecError):
        matmul_reference(jnp.ones((2, 31)), qa)


@pytest.mark.parametrize("bits,symmetric", MODES)
def test_take_columns(bits, symmetric):
    w = weights((64, 40), seed=21)
    qa = quantize_jit(w, bits=bits, symmetric=symmetric)
    idx = np.random.default_rng(22).integers(0, 40, size=(3, 4))
    idx[0, 0] = idx[2, 3] = 39
    cols = jax.jit(take_columns)(qa, jnp.asarray(idx))
    assert cols.shape == (64, 3, 4) and cols.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(cols), np.asarray(dequantize(qa))[:, idx])


def test_pack_unpack_int4():
    assert pack_int4(np.array([[1], [2]], np.uint8)).tolist() == [[0x21]]
    codes = np.random.default_rng(5).integers(0, 16, size=(10, 3, 2)).astype(np.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (5, 3, 2) and isinstance(packed, np.ndarray)
    np.testing.assert_array_equal(unpack_int4(packed), codes)
    np.testing.assert_array_equal(np.asarray(unpack_int4(pack_int4(jnp.asarray(codes)))), codes)
    with pytest.raises(JaxdecError):
        pack_int4(codes[:3])


# ---- validate --------------------------------------------------------------------------------
def _valid(bits, offset=True):
    rng = np.random.default_rng(9)
    q = (rng.integers(-127, 128, (64, 6)).astype(np.int8) if bits == 8
         else rng.integers(0, 256, (32, 6)).astype(np.uint8))
    scale = rng.uniform(0.01, 0.1, (2, 6)).astype(np.float16)
    return QArray(q=q, scale=scale, offset=scale * np.float16(-3) if offset else None, bits=bits,
                  group_size=32, shape=(64, 6), n_in=1)


BROKEN = {
    "bits": lambda qa: dataclasses.replace(qa, bits=2),
    "group_not_dividing": lambda qa: dataclasses.replace(qa, group_size=24),
    "group_zero": lambda qa: dataclasses.replace(qa, group_size=0),
    "shape_zero": lambda qa: dataclasses.replace(qa, shape=(64, 0)),
    "shape_list": lambda qa: dataclasses.replace(qa, shape=[64, 6]),
    "n_in_zero": lambda qa: dataclasses.replace(qa, n_in=0),
    "n_in_all": lambda qa: dataclasses.replace(qa, n_in=2),
    "n_in_vs_shape": lambda qa: dataclasses.replace(qa, shape=(8, 8, 6), n_in=1),
    "q_dtype": lambda qa: dataclasses.replace(qa, q=qa.q.astype(np.int32)),
    "q_shape": lambda qa: dataclasses.replace(qa, q=qa.q[:-2]),
    "q_not_array": lambda qa: dataclasses.replace(qa, q=qa.q.tolist()),
    "scale_dtype": lambda qa: dataclasses.replace(qa, scale=qa.scale.astype(np.float32)),
    "scale_shape": lambda qa: dataclasses.replace(qa, scale=qa.scale[:1]),
    "offset_dtype": lambda qa: dataclasses.replace(qa, offset=qa.offset.astype(np.float32)),
    "offset_shape": lambda qa: dataclasses.replace(qa, offset=qa.offset.T),
}


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_validate_rejects(bits, broken):
    qa = validate(_valid(bits))
    with pytest.raises(JaxdecError, match="invalid QArray"):
        validate(BROKEN[broken](qa))


def test_validate_rejects_int4_layout():
    qa = _valid(4)
    with pytest.raises(JaxdecError, match="shape"):  # unpacked codes
        validate(dataclasses.replace(qa, q=unpack_int4(qa.q)))
    with pytest.raises(JaxdecError, match="even"):  # K = 6 in groups of 3
        validate(dataclasses.replace(qa, q=qa.q[:3], scale=qa.scale, offset=qa.offset,
                                     group_size=3, shape=(6, 6)))
    with pytest.raises(JaxdecError, match="dtype"):
        validate(dataclasses.replace(_valid(8), q=_valid(8).q.view(np.uint8)))
    with pytest.raises(JaxdecError, match="dtype"):
        validate(dataclasses.replace(qa, q=qa.q.view(np.int8)))
    with pytest.raises(JaxdecError):
        validate("not a QArray")


# ---- the pytree contract ---------------------------------------------------------------------
@pytest.mark.parametrize("bits,symmetric", [(8, True), (4, False)])
def test_pytree_under_jit_vmap_eval_shape(bits, symmetric):
    w = weights((64, 8), seed=31)
    qa = quantize_jit(w, bits=bits, symmetric=symmetric)
    assert isinstance(qa, QArray) and len(jax.tree.leaves(qa)) == (2 if symmetric else 3)

    double = jax.jit(lambda a: dataclasses.replace(a, scale=a.scale * 2))(qa)
    assert isinstance(double, QArray) and (double.offset is None) == symmetric
    assert (double.bits, double.group_size, double.shape, double.n_in) == (bits, 32, (64, 8), 1)
    np.testing.assert_array_equal(np.asarray(double.q), np.asarray(qa.q))
    np.testing.assert_array_equal(np.asarray(double.scale), 2 * np.asarray(qa.scale))

    same = jax.tree.map(lambda x: x, qa)
    assert jax.tree.structure(same) == jax.tree.structure(qa)

    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), qa, double)
    both = jax.jit(jax.vmap(dequantize))(stacked)
    np.testing.assert_array_equal(np.asarray(both[1]), np.asarray(dequantize(double)))

    abstract = jax.eval_shape(partial(quantize, bits=bits, symmetric=symmetric), w)
    assert isinstance(abstract.q, jax.ShapeDtypeStruct)
    assert validate(abstract).nbytes == qa.nbytes
    assert qa.nbytes == (64 * 8 * bits // 8) + 2 * 2 * 8 * (1 if symmetric else 2)


# ---- GGUF blocks -----------------------------------------------------------------------------
def gguf_weights(out_dim, in_dim, seed):
    """HF-orientation [out, in] rows with row magnitudes from 1e-6 (subnormal f16 d) to 1e3."""
    w = weights((out_dim, in_dim), seed, shift=0.1)
    return w * np.logspace(-6, 3, out_dim, dtype=np.float32)[:, None]


def assert_gguf_exact(raw, qtype, out_dim, in_dim):
    qa = qarray_from_gguf(raw, qtype, out_dim, in_dim)
    assert qa is not None and qa.shape == (in_dim, out_dim) and qa.group_size == 32
    ours = np.asarray(dequantize_jit(qa)).T
    theirs = gguf.quants.dequantize(raw.reshape(out_dim, -1), qtype)
    assert np.array_equal(ours, theirs)
    # bit for bit, but for the sign of zero: Q4_0's d * (q - 8) is -0.0 when d < 0
    assert np.array_equal((ours + 0.0).view(np.uint32), (theirs + 0.0).view(np.uint32))
    return qa


@pytest.mark.parametrize("qtype,bits", [(GQ.Q8_0, 8), (GQ.Q4_0, 4), (GQ.Q4_1, 4)])
def test_gguf_blocks_bit_exact(qtype, bits):
    out_dim, in_dim = 40, 256
    raw = gguf.quants.quantize(gguf_weights(out_dim, in_dim, seed=int(qtype)), qtype)
    assert gguf_block_bits(qtype) == bits == gguf_block_bits(int(qtype))
    qa = assert_gguf_exact(raw, qtype, out_dim, in_dim)
    assert qa.bits == bits and (qa.offset is None) == (qtype == GQ.Q8_0)
    assert_gguf_exact(raw.reshape(-1), qtype, out_dim, in_dim)  # any raw shape
    x = weights((2, in_dim), seed=1)
    np.testing.assert_allclose(np.asarray(matmul_reference(x, qa)),
                               x @ gguf.quants.dequantize(raw, qtype).T, rtol=1e-5, atol=1e-3)


def test_gguf_other_types_and_bad_sizes():
    raw = gguf.quants.quantize(gguf_weights(4, 64, seed=2), GQ.Q4_1)
    assert qarray_from_gguf(raw, GQ.F16, 4, 64) is None
    assert qarray_from_gguf(raw, GQ.Q4_K, 4, 64) is None
    assert gguf_block_bits(GQ.Q6_K) is None and gguf_block_bits(12345) is None
    with pytest.raises(JaxdecError):
        qarray_from_gguf(raw, GQ.Q4_1, 4, 96)
    with pytest.raises(JaxdecError):
        qarray_from_gguf(raw[:, :-1], GQ.Q4_1, 4, 64)


def test_gguf_q4_0_scale_overflow_is_refused():
    raw = gguf.quants.quantize(gguf_weights(2, 32, seed=3), GQ.Q4_0).copy()
    raw[0, :2] = np.array([9000.0], np.float16).view(np.uint8)  # -8d overflows float16
    assert qarray_from_gguf(raw, GQ.Q4_0, 2, 32) is None


def to_gguf_bytes(qa: QArray) -> np.ndarray:
    """The inverse mapping, for the test: QArray [in, out] -> GGUF rows of blocks u8[out, -]."""
    in_dim, out_dim = qa.shape
    fields = [np.asarray(qa.scale).T[..., None].view(np.uint8)]  # u8[out, nb, 2]
    if qa.bits == 8:
        fields.append(np.asarray(qa.q).T.reshape(out_dim, -1, 32).view(np.uint8))
    else:
        if qa.offset is not None and not np.array_equal(qa.offset, qa.scale * np.float16(-8)):
            fields.append(np.asarray(qa.offset).T[..., None].view(np.uint8))
        codes = unpack_int4(np.asarray(qa.q)).T.reshape(out_dim, -1, 2, 16)
        fields.append(codes[:, :, 0] | (codes[:, :, 1] << 4))  # element j low, j + 16 high
    return np.concatenate(fields, axis=-1).reshape(out_dim, -1)


def test_real_model_blocks_bit_exact():
    """Every Q4_0/Q4_1/Q8_0 tensor of SmolLM2 maps back to its own bytes; (up to) 1024 rows
    of one tensor per (type, shape) also dequantise bit-exactly. The header is read with
    jaxdec's parser: gguf.GGUFReader spends seconds on the vocabulary."""
    from jaxdec.checkpoint import registry
    from jaxdec.checkpoint.gguf_reader import read_gguf_header

    path = registry.resolve("smollm2")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    infos = [t for t in read_gguf_header(path).tensors.values() if gguf_block_bits(t.qtype)]
    assert infos
    seen = set()
    for t in infos:
        (out_dim, in_dim), raw = t.shape, data[t.start:t.start + t.nbytes].reshape(t.shape[0], -1)
        qa = qarray_from_gguf(raw, t.qtype, out_dim, in_dim)
        assert np.array_equal(to_gguf_bytes(qa), raw), t.name
        if (t.qtype, t.shape) not in seen:
            seen.add((t.qtype, t.shape))
            rows = min(out_dim, 1024)
            assert_gguf_exact(np.ascontiguousarray(raw[:rows]), t.qtype, rows, in_dim)
