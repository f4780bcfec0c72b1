"""pallas_kernels/quantized_kv_attention against its float32 reference (highest precision).

`QuantizedKVAttentionCases` holds the cases; the interpret-mode subclasses run them on any
backend (CI, on the CPU) through both bodies, the GPU (Triton) one and the TPU (Mosaic)
one; `TestOnDevice` runs them compiled where a GPU or TPU backend is present. Kernel and
reference see the same quantised K and V, so they differ only by float32 summation order
(float32 queries) or by the bf16 rounding of the dequantised blocks (bf16 queries: the
kernels' dots run in the query's dtype).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdec.formats.kvquant import empty_kv, quantize_kv
from pallas_kernels import decode_attention
from pallas_kernels.quantized_kv_attention import bytes_moved, quantized_kv_attention
from pallas_kernels.quantized_kv_attention import reference
from pallas_kernels.lowering import lower

TOL = {jnp.float32: (2e-5, 2e-5), jnp.bfloat16: (1e-2, 1e-2)}  # bf16: the output's own rounding
# format names: i8 (symmetric int8), i8a (asymmetric int8), i4 (asymmetric int4), i4s
# (symmetric int4), then the granularity
FORMATS = {"i8": dict(bits=8), "i8a": dict(bits=8, symmetric=False), "i4": dict(bits=4),
           "i4s": dict(bits=4, symmetric=True)}
# (G, H, q dtype, K format, V format): every G with every H, every bits x granularity for
# K and for V, dtypes (of q and of the scales) mixed
CASES = [(1, 64, jnp.float32, "i8-token", "i4s-group"), (3, 64, jnp.bfloat16, "i4-channel", "i8-channel"),
         (7, 64, jnp.bfloat16, "i8-group", "i4-token"), (1, 128, jnp.float32, "i4-group", "i8a-token"),
         (3, 128, jnp.float32, "i8a-channel", "i4-channel"), (7, 128, jnp.bfloat16, "i4-token", "i8-group")]


@functools.partial(jax.jit, static_argnames=("fmt", "scale_dtype"))
def quantized(x, fmt: str, scale_dtype):
    name, granularity = fmt.split("-")
    return quantize_kv(x, granularity=granularity, group_size=32, scale_dtype=scale_dtype,
                       **FORMATS[name])


def random_inputs(seed: int, b: int, g: int, kh: int, s: int, h: int, dtype, k_fmt="i8-group",
                  v_fmt="i8-group"):
    """Fresh normal q and K/V (keys with outlier channels) quantised as k_fmt / v_fmt with
    `dtype` scales, the float K and V, and ragged lengths that include 0 and S."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, kh * g, h)), dtype)
    k = jnp.asarray(rng.standard_normal((b, kh, s, h)) + 2 * rng.standard_normal(h), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, kh, s, h)), jnp.float32)
    lengths = np.concatenate([[0, s], rng.integers(1, s, b - 2)]).astype(np.int32)
    rng.shuffle(lengths)
    return q, quantized(k, k_fmt, dtype), quantized(v, v_fmt, dtype), jnp.asarray(lengths), (k, v)


class QuantizedKVAttentionCases:
    interpret = False
    platform: str | None = None

    def run(self, *args, **kwargs):
        return quantized_kv_attention(*args, implementation="pallas", interpret=self.interpret,
                                      platform=self.platform, **kwargs)

    @pytest.mark.parametrize("g,h,dtype,k_fmt,v_fmt", CASES)
    def test_matches_reference(self, g, h, dtype, k_fmt, v_fmt):
        s = 300  # two full key blocks and a partial one
        q, k, v, lengths, _ = random_inputs(g * h, 4, g, 2, s, h, dtype, k_fmt, v_fmt)
        out, lse = self.run(q, k, v, lengths, return_lse=True)
        want, want_lse = reference.quantized_kv_attention(q, k, v, lengths, scale=h ** -0.5)
        atol, rtol = TOL[dtype]
        assert out.dtype == q.dtype and out.shape == q.shape
        np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=atol, rtol=rtol)
        # -inf where empty; bf16 queries score dequantised keys rounded to bf16
        np.testing.assert_allclose(lse, want_lse, atol=1e-4 if dtype == jnp.float32 else 2e-2, rtol=1e-5)
        assert np.all(np.asarray(out)[np.asarray(lengths) == 0] == 0)

    def test_short_cache_and_splits(self):
        """A cache shorter than one block (padded), and blocks shared between GPU splits."""
        q, k, v, lengths, _ = random_inputs(1, 3, 2, 2, 40, 64, jnp.float32, "i4-group", "i8-channel")
        want, _ = reference.quantized_kv_attention(q, k, v, lengths, scale=0.125)
        np.testing.assert_allclose(self.run(q, k, v, lengths), want, atol=2e-5, rtol=2e-5)
        q, k, v, lengths, _ = random_inputs(2, 3, 2, 1, 520, 64, jnp.float32, "i4-channel", "i4-token")
        want, _ = reference.quantized_kv_attention(q, k, v, lengths, scale=0.125)
        np.testing.assert_allclose(self.run(q, k, v, lengths, n_splits=3), want, atol=2e-5, rtol=2e-5)


class TestInterpretGPU(QuantizedKVAttentionCases):
    interpret, platform = True, "gpu"


class TestInterpretTPU(QuantizedKVAttentionCases):
    interpret, platform = True, "tpu"


@pytest.mark.skipif(jax.default_backend() not in ("gpu", "tpu"), reason="needs a GPU or TPU")
class TestOnDevice(QuantizedKVAttentionCases):
    pass


def test_close_to_unquantised_attention():
    """Against attention over the float K and V: int8 within 0.02, int4 within 0.2, and
    int8 several times closer (keys per channel, values per group)."""
    errors = {}
    for bits in (8, 4):
        q, k, v, lengths, (kf, vf) = random_inputs(11, 4, 3, 2, 300, 128, jnp.float32,
                                                   f"i{bits}-channel", f"i{bits}-group")
        want, _ = decode_attention.reference.decode_attention(q, kf, vf, lengths, scale=128 ** -0.5)
        got = quantized_kv_attention(q, k, v, lengths, interpret=True, platform="tpu")
        errors[bits] = float(np.abs(np.asarray(got) - np.asarray(want)).max())
    assert errors[8] < 0.02 and errors[4] < 0.2 and errors[8] < errors[4] / 5, errors


def test_xla_path_is_the_reference():
    """The XLA path (the kernels' reference) against an independent float64 definition on
    the dequantised K and V."""
    from numpy_attention import attention_f64, prefix_visible

    from jaxdec.formats.kvquant import dequantize_kv

    q, k, v, lengths, _ = random_inputs(3, 4, 3, 2, 50, 64, jnp.float32, "i4-token", "i8a-group")
    want = attention_f64(q, dequantize_kv(k), dequantize_kv(v), prefix_visible(lengths, 2, 50), 0.125)
    got = quantized_kv_attention(q, k, v, lengths, implementation="xla")
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


def test_lengths_outside_the_cache_are_clamped():
    q, k, v, _, _ = random_inputs(4, 2, 1, 1, 130, 64, jnp.float32)
    got = quantized_kv_attention(q, k, v, jnp.array([-5, 999], jnp.int32), implementation="xla")
    want, _ = reference.quantized_kv_attention(q, k, v, jnp.array([0, 130]), scale=0.125)
    np.testing.assert_allclose(got, want, atol=1e-6)


def cache_spec(b, kh, s, h, fmt: str, dtype=jnp.bfloat16):
    """A `QuantKV` of ShapeDtypeStructs in format `fmt` (group 32, `dtype` scales)."""
    name, granularity = fmt.split("-")
    return jax.eval_shape(lambda: empty_kv(b, kh, s, h, granularity=granularity, group_size=32,
                                           scale_dtype=dtype, **FORMATS[name]))


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
@pytest.mark.parametrize("k_fmt,v_fmt", [("i8-group", "i8-group"), ("i4-group", "i4-group"),
                                         ("i4-channel", "i8-token")])
def test_lowers_for_the_device(platform, k_fmt, v_fmt):
    """The kernel lowers for cuda (Triton) and tpu (Mosaic) from this CPU machine: a 32k
    cache with GQA 28/4, head dim 128, bf16 queries and scales."""
    sd = jax.ShapeDtypeStruct
    b, kh, s, h = 2, 4, 32768, 128
    args = (sd((b, 7 * kh, h), jnp.bfloat16), cache_spec(b, kh, s, h, k_fmt),
            cache_spec(b, kh, s, h, v_fmt), sd((b,), jnp.int32))
    lower(functools.partial(quantized_kv_attention, platform=platform), args, platform)


@pytest.mark.parametrize("change,match", [
    (dict(q_dtype=jnp.int8), "q has dtype int8"),
    (dict(codes_dtype=jnp.int8), "k: invalid QuantKV: codes has dtype int8, expected uint8"),
    (dict(plain_v=True), r"v must be a QuantKV, got an array of shape \(2, 2, 256, 64\)"),
    (dict(lengths_dtype=jnp.float32), "lengths has dtype float32"),
    (dict(h=72), "head_dim=72 must be"),
    (dict(h=16, platform="gpu"), "head_dim=16 with 4-bit k: each half must be >= 16"),
    (dict(block_k=96), "block_k=96 must be"),
    (dict(block_k=64, platform="tpu"), "block_k=64 must be a multiple of 128 on the TPU"),
    (dict(heads=5), "5 query heads do not share 2 kv heads"),
    (dict(implementation="triton"), "implementation='triton'"),
])
def test_bad_input_is_a_one_line_error(change, match):
    from conftest import assert_one_line_error

    h = change.get("h", 64)
    q = jnp.ones((2, change.get("heads", 4), h), change.get("q_dtype", jnp.float32))
    k = empty_kv(2, 2, 256, h, bits=4, group_size=4)
    k = dataclasses.replace(k, codes=k.codes.astype(change.get("codes_dtype", jnp.uint8)))
    v = jnp.ones((2, 2, 256, h)) if change.get("plain_v") else empty_kv(2, 2, 256, h, bits=8, group_size=8)
    lengths = jnp.ones((2,), change.get("lengths_dtype", jnp.int32))
    assert_one_line_error(quantized_kv_attention, q, k, v, lengths, match=match, interpret=True,
                          platform=change.get("platform", "gpu"), block_k=change.get("block_k", 128),
                          implementation=change.get("implementation", "pallas"))


def test_on_cpu_without_interpret_is_refused():
    from conftest import assert_one_line_error

    q, k, v, lengths, _ = random_inputs(0, 2, 1, 1, 64, 64, jnp.float32)
    assert_one_line_error(quantized_kv_attention, q, k, v, lengths, match="interpret=True")


def test_bytes_moved_counts_compressed_visible_blocks():
    """Rows of length 0 and 129 read 0 and 2 blocks of 128 slots, per kv head (4)."""
    q = jax.ShapeDtypeStruct((2, 28, 128), jnp.bfloat16)
    k = cache_spec(2, 4, 1024, 128, "i4-channel")  # codes 64 B/slot; scale+offset 2 x 128 x 2 B per row
    v = cache_spec(2, 4, 1024, 128, "i8-group")  # codes 128 B/slot + 4 bf16 scales, no offset
    moved = bytes_moved(q, k, v, np.array([0, 129]), block_k=128)
    q_bytes = 2 * 28 * 128 * 2
    k_bytes = 4 * (256 * 64 + 1 * 2 * 128 * 2)
    v_bytes = 4 * 256 * (128 + 4 * 2)
    assert moved.read == q_bytes + k_bytes + v_bytes + 8 and moved.written == q_bytes


def test_bytes_moved_against_bf16_decode_attention():
    """At 4k tokens, group 32 with bf16 scales: int8 (symmetric: 136 B per token and head
    against 256) < 0.55x of a bf16 cache; int4 (codes 64 B + scale and offset 16 B: 80 B)
    is 0.3125x, under 0.32x."""
    q = jax.ShapeDtypeStruct((2, 28, 128), jnp.bfloat16)
    lengths = np.array([4096, 4096])
    dense = decode_attention.bytes_moved(q, jax.ShapeDtypeStruct((2, 4, 4096, 128), jnp.bfloat16),
                                         lengths).total
    ratio = {name: bytes_moved(q, cache_spec(2, 4, 4096, 128, f"{name}-group"),
                               cache_spec(2, 4, 4096, 128, f"{name}-group"), lengths).total / dense
             for name in ("i8", "i4")}
    assert ratio["i8"] < 0.55 and ratio["i4"] < 0.32, ratio
    assert ratio["i4"] > 80 / 256  # the scales and offsets are counted
