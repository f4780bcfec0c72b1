"""jaxdec.formats.kvquant: the quantised KV tensor, its quantiser, writer and invariants."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdec.formats import kvquant as Q

FORMATS = list(itertools.product((8, 4), Q.GRANULARITIES, (True, False), (jnp.float32, jnp.bfloat16)))


def random_kv(seed: int, shape=(2, 3, 24, 64)):
    """Normal values with a per-channel shift (the outlier channels of real keys)."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal(shape) * 2 + rng.standard_normal(shape[-1]) * 3, jnp.float32)


def expanded(qkv: Q.QuantKV, p):
    """A scale/offset broadcast to the logical [B, K, S, H]."""
    p = np.asarray(jnp.asarray(p, jnp.float32))
    return np.repeat(p, qkv.group_size, axis=-1) if qkv.granularity == "group" else p


@pytest.mark.parametrize("bits,granularity,symmetric,scale_dtype", FORMATS)
def test_error_is_at_most_half_a_step(bits, granularity, symmetric, scale_dtype):
    x = random_kv(bits + len(granularity))
    qkv = Q.quantize_kv(x, bits=bits, granularity=granularity, group_size=16, symmetric=symmetric,
                        scale_dtype=scale_dtype)
    b, kh, s, h = x.shape
    assert qkv.shape == x.shape and qkv.codes.shape == (b, kh, s, h * bits // 8)
    want = {"token": (b, kh, s, 1), "group": (b, kh, s, 4), "channel": (b, kh, 1, h)}[granularity]
    assert qkv.scale.shape == want
    assert (qkv.offset is None) == (bits == 8 and symmetric)
    err = np.abs(np.asarray(Q.dequantize_kv(qkv)) - np.asarray(x))
    step = expanded(qkv, qkv.scale)
    assert np.all(err <= step / 2 + 1e-6 * (1 + np.abs(np.asarray(x))))
    assert np.all(step > 0)


def test_half_split_packing():
    """Byte j of a 4-bit slot holds channel j (low nibble) and channel j + H/2 (high)."""
    codes = jnp.asarray(np.random.default_rng(0).integers(0, 16, (1, 1, 3, 8)), jnp.uint8)
    packed = Q.pack_halves(codes)
    np.testing.assert_array_equal(packed & 15, codes[..., :4])
    np.testing.assert_array_equal(packed >> 4, codes[..., 4:])
    np.testing.assert_array_equal(Q.unpack_halves(packed), codes)


@pytest.mark.parametrize("symmetric", [True, False])
def test_constant_groups_never_nan(symmetric):
    """A constant group: zeros (and asymmetric formats, for a value the scale dtype holds)
    exact, symmetric ones within half a step."""
    for bits, value, granularity in itertools.product((8, 4), (0.0, -2.5, 3072.0), Q.GRANULARITIES):
        x = jnp.full((1, 1, 3, 32), value)
        qkv = Q.quantize_kv(x, bits=bits, granularity=granularity, group_size=16,
                            symmetric=symmetric, scale_dtype=jnp.bfloat16)
        err = np.abs(np.asarray(Q.dequantize_kv(qkv)) - value)
        assert np.all(err <= (0 if value == 0 or not symmetric else expanded(qkv, qkv.scale) / 2))


@pytest.mark.parametrize("bits,granularity,symmetric", [
    (8, "token", True), (8, "group", False), (4, "group", False), (4, "token", False)])
def test_write_equals_quantising_the_whole_tensor(bits, granularity, symmetric):
    """Tokens written in two chunks, out of order, give the whole tensor's quantisation."""
    x = random_kv(5, (2, 3, 10, 64))
    want = Q.quantize_kv(x, bits=bits, granularity=granularity, symmetric=symmetric,
                         scale_dtype=jnp.bfloat16)
    got = Q.empty_kv(2, 3, 10, 64, bits=bits, granularity=granularity, symmetric=symmetric,
                     scale_dtype=jnp.bfloat16)
    order = np.stack([np.random.default_rng(r).permutation(10) for r in range(2)]).astype(np.int32)
    new = jnp.swapaxes(x, 1, 2)  # [B, S, K, H]
    for chunk in (order[:, :4], order[:, 4:]):
        got = jax.jit(Q.write_kv)(got, jnp.take_along_axis(new, chunk[:, :, None, None], axis=1), chunk)
    for field in ("codes", "scale", "offset"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field))


@pytest.mark.parametrize("bits,symmetric", [(8, True), (8, False), (4, False)])
def test_channel_write_uses_the_stored_scales_and_clips(bits, symmetric):
    x = random_kv(6, (1, 2, 12, 32))
    whole = Q.quantize_kv(x, bits=bits, granularity="channel", symmetric=symmetric)
    blank = dataclasses.replace(whole, codes=jnp.zeros_like(whole.codes))
    slots = jnp.arange(12, dtype=jnp.int32)[None]
    np.testing.assert_array_equal(Q.write_kv(blank, jnp.swapaxes(x, 1, 2), slots).codes, whole.codes)
    huge = Q.write_kv(blank, jnp.full((1, 1, 2, 32), 1e6), slots[:, :1])
    top = {(8, True): 127, (8, False): 127, (4, False): 15}[(bits, symmetric)]
    codes = np.asarray(Q.unpack_halves(huge.codes) if bits == 4 else huge.codes)
    assert np.all(codes[:, :, 0] == top) and huge.scale is blank.scale


def test_empty_is_all_zero():
    for bits, granularity in itertools.product((8, 4), Q.GRANULARITIES):
        qkv = Q.empty_kv(2, 2, 5, 64, bits=bits, granularity=granularity, scale_dtype=jnp.bfloat16)
        assert np.all(Q.dequantize_kv(qkv) == 0) and qkv.scale.dtype == jnp.bfloat16
        assert np.all(qkv.scale == (1 if granularity == "channel" else 0))


def test_pytree_and_bytes_per_token():
    qkv = Q.quantize_kv(random_kv(7), bits=4, group_size=32, scale_dtype=jnp.bfloat16)
    leaves, tree = jax.tree.flatten(qkv)
    assert len(leaves) == 3 and jax.tree.unflatten(tree, leaves) == qkv
    assert jax.jit(lambda a: a)(qkv).granularity == "group"
    per_token = Q.kv_bytes_per_token(64, bits=4, group_size=32, scale_dtype=jnp.bfloat16)
    assert per_token == 32 + 2 * 2 * 2 == qkv.nbytes // (2 * 3 * 24)
    assert Q.kv_bytes_per_token(128, bits=8, scale_dtype=jnp.bfloat16) == 128 + 4 * 2
    assert Q.kv_bytes_per_token(128, bits=8, granularity="token", symmetric=False) == 128 + 2 * 4
    assert Q.kv_bytes_per_token(128, bits=4, granularity="channel") == 64


def _good():
    return Q.quantize_kv(random_kv(8, (1, 2, 4, 64)), bits=4, group_size=16)


@pytest.mark.parametrize("change,match", [
    (dict(bits=3), "bits=3, expected 4 or 8"),
    (dict(granularity="row"), "granularity='row'"),
    (dict(group_size=24), "group_size=24 must divide 32"),
    (dict(codes=jnp.zeros((1, 2, 4, 32), jnp.int8)), "codes has dtype int8, expected uint8"),
    (dict(scale=jnp.zeros((1, 2, 4, 2))), r"scale has shape \(1, 2, 4, 2\), expected \(1, 2, 4, 4\)"),
    (dict(scale=jnp.zeros((1, 2, 4, 4), jnp.float16)), "scale has dtype float16"),
    (dict(offset=None), "offset is None, but 4-bit"),
    (dict(offset=jnp.zeros((1, 2, 4, 4), jnp.bfloat16)), "offset has dtype bfloat16, expected float32"),
    (dict(granularity="token"), "group_size=16 for granularity 'token', expected 64"),
])
def test_validate_is_a_one_line_error(change, match):
    from conftest import assert_one_line_error

    assert_one_line_error(Q.validate_kv, dataclasses.replace(_good(), **change), match=match)


def test_bad_arguments_are_one_line_errors():
    from conftest import assert_one_line_error

    x = random_kv(9, (1, 2, 4, 64))
    assert_one_line_error(Q.quantize_kv, x[0], bits=8, match="expected \\[B, K, S, H\\]")
    assert_one_line_error(Q.quantize_kv, x, bits=8, scale_dtype=jnp.float16, match="scale_dtype float16")
    qkv = Q.empty_kv(1, 2, 4, 64, bits=8)
    new = jnp.ones((1, 1, 2, 64))
    assert_one_line_error(Q.write_kv, qkv, new, jnp.array([[4]], jnp.int32),
                          match=r"slots 4\.\.4 outside \[0, 4\)")
    assert_one_line_error(Q.write_kv, qkv, new, jnp.array([[-1]], jnp.int32), match="outside")
    assert_one_line_error(Q.write_kv, qkv, new[:, :, :1], jnp.array([[0]], jnp.int32), match="do not fit")
