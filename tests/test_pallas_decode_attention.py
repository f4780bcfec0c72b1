"""pallas_kernels/decode_attention against its float32 reference (highest precision).

`DecodeAttentionCases` holds the cases; the interpret-mode subclasses run them on any
backend (CI, on the CPU) through both bodies, the GPU (Triton) one and the TPU (Mosaic)
one; `TestOnDevice` runs them compiled where a GPU or TPU backend is present.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import KernelError
from pallas_kernels.decode_attention import bytes_moved, decode_attention
from pallas_kernels.decode_attention import reference
from pallas_kernels.lowering import lower

TOL = {jnp.float32: (2e-5, 2e-5), jnp.bfloat16: (2e-2, 2e-2)}
# (group size G, head dim H, V layout, dtype): every G with every H, layouts and dtypes mixed
CASES = [(1, 64, "sh", jnp.float32), (3, 64, "hs", jnp.bfloat16), (7, 64, "sh", jnp.bfloat16),
         (1, 128, "hs", jnp.float32), (3, 128, "sh", jnp.float32), (7, 128, "hs", jnp.float32)]


def random_inputs(seed: int, b: int, g: int, kh: int, s: int, h: int, v_layout: str, dtype):
    """Fresh normal q, k, v and ragged lengths that include 0 and the capacity S."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, kh * g, h))
    k = rng.standard_normal((b, kh, s, h))
    v = rng.standard_normal((b, kh, s, h) if v_layout == "sh" else (b, kh, h, s))
    lengths = np.concatenate([[0, s], rng.integers(1, s, b - 2)]).astype(np.int32)
    rng.shuffle(lengths)
    cast = lambda x: jnp.asarray(x, dtype)
    return cast(q), cast(k), cast(v), jnp.asarray(lengths)


class DecodeAttentionCases:
    interpret = False
    platform: str | None = None

    def run(self, *args, **kwargs):
        return decode_attention(*args, implementation="pallas", interpret=self.interpret,
                                platform=self.platform, **kwargs)

    @pytest.mark.parametrize("g,h,v_layout,dtype", CASES)
    def test_matches_reference(self, g, h, v_layout, dtype):
        s = 300  # two full key blocks and a partial one
        q, k, v, lengths = random_inputs(g * h, 4, g, 2, s, h, v_layout, dtype)
        out, lse = self.run(q, k, v, lengths, v_layout=v_layout, return_lse=True)
        want, want_lse = reference.decode_attention(q, k, v, lengths, scale=h ** -0.5, v_layout=v_layout)
        atol, rtol = TOL[dtype]
        assert out.dtype == q.dtype and out.shape == q.shape
        np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=atol, rtol=rtol)
        np.testing.assert_allclose(lse, want_lse, atol=1e-4, rtol=1e-5)  # -inf where empty
        assert np.all(np.asarray(out)[np.asarray(lengths) == 0] == 0)

    def test_short_cache_and_splits(self):
        """A cache shorter than one block (padded), and blocks shared between GPU splits."""
        q, k, v, lengths = random_inputs(1, 3, 2, 2, 40, 64, "sh", jnp.float32)
        want, _ = reference.decode_attention(q, k, v, lengths, scale=0.125)
        np.testing.assert_allclose(self.run(q, k, v, lengths), want, atol=2e-5, rtol=2e-5)
        q, k, v, lengths = random_inputs(2, 3, 2, 1, 1000, 64, "sh", jnp.float32)
        want, _ = reference.decode_attention(q, k, v, lengths, scale=0.125)
        np.testing.assert_allclose(self.run(q, k, v, lengths, n_splits=3), want, atol=2e-5, rtol=2e-5)


class TestInterpretGPU(DecodeAttentionCases):
    interpret, platform = True, "gpu"


class TestInterpretTPU(DecodeAttentionCases):
    interpret, platform = True, "tpu"


@pytest.mark.skipif(jax.default_backend() not in ("gpu", "tpu"), reason="needs a GPU or TPU")
class TestOnDevice(DecodeAttentionCases):
    pass


def test_xla_path_matches_float64_numpy():
    """The XLA path (the kernels' reference) against an independent float64 definition."""
    from numpy_attention import attention_f64, prefix_visible

    q, k, v, lengths = random_inputs(3, 4, 3, 2, 50, 64, "hs", jnp.float32)
    want = attention_f64(q, k, v, prefix_visible(lengths, 2, 50), 0.125, "hs")
    got = decode_attention(q, k, v, lengths, implementation="xla", v_layout="hs")
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
@pytest.mark.parametrize("v_layout", ["sh", "hs"])
def test_lowers_for_the_device(platform, v_layout):
    """The kernel lowers for cuda (Triton) and tpu (Mosaic) from this CPU machine: a 32k
    cache of bf16 with GQA 28/4 and head dim 128."""
    sd = jax.ShapeDtypeStruct
    b, kh, s, h = 2, 4, 32768, 128
    args = (sd((b, 7 * kh, h), jnp.bfloat16), sd((b, kh, s, h), jnp.bfloat16),
            sd((b, kh, s, h) if v_layout == "sh" else (b, kh, h, s), jnp.bfloat16), sd((b,), jnp.int32))
    lower(functools.partial(decode_attention, platform=platform, v_layout=v_layout), args, platform)


@pytest.mark.parametrize("change,match", [
    (dict(k_dtype=jnp.int8), "k has dtype int8"),
    (dict(lengths_dtype=jnp.float32), "lengths has dtype float32"),
    (dict(h=72), "head_dim=72 must be"),
    (dict(block_k=96), "block_k=96 must be"),
    (dict(heads=5), "5 query heads do not share 2 kv heads"),
    (dict(implementation="triton"), "implementation='triton'"),
])
def test_bad_input_is_a_one_line_error(change, match):
    from conftest import assert_one_line_error

    h = change.get("h", 64)
    q = jnp.ones((2, change.get("heads", 4), h), jnp.float32)
    k = jnp.ones((2, 2, 256, h), change.get("k_dtype", jnp.float32))
    lengths = jnp.ones((2,), change.get("lengths_dtype", jnp.int32))
    assert_one_line_error(decode_attention, q, k, k, lengths, match=match, interpret=True,
                          platform="gpu", block_k=change.get("block_k", 128),
                          implementation=change.get("implementation", "pallas"))


def test_on_cpu_without_interpret_is_refused():
    from conftest import assert_one_line_error

    q, k, v, lengths = random_inputs(0, 2, 1, 1, 64, 64, "sh", jnp.float32)
    assert_one_line_error(decode_attention, q, k, v, lengths, match="interpret=True")


def test_bytes_moved_counts_visible_blocks():
    k = jax.ShapeDtypeStruct((2, 4, 1024, 128), jnp.bfloat16)
    q = jax.ShapeDtypeStruct((2, 28, 128), jnp.bfloat16)
    moved = bytes_moved(q, k, np.array([0, 129]), block_k=128)
    assert moved.read == 2 * 28 * 128 * 2 + 2 * 256 * 4 * 128 * 2 + 8
    assert moved.written == 2 * 28 * 128 * 2
