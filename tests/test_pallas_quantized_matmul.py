"""pallas_kernels/quantized_matmul against its float32 reference (highest precision).

`QuantizedMatmulCases` holds the cases; the interpret-mode subclasses run them on any
backend (CI, on the CPU) through both bodies, the GPU (Triton) one and the TPU (Mosaic)
one; `TestOnDevice` runs them compiled where a GPU or TPU backend is present.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdec.formats import qarray
from pallas_kernels.quantized_matmul import bytes_moved, quantized_matmul
from pallas_kernels.quantized_matmul import reference
from pallas_kernels.lowering import lower

# f32: the GPU scales after an exact dot, the TPU dots the float32 dequantised tile;
# bf16: the TPU rounds the dequantised tile to bf16 for the MXU (outputs are ~N(0, 1)).
TOL = {jnp.float32: (2e-5, 2e-5), jnp.bfloat16: (2e-2, 2e-2)}
# (bits, symmetric, group size g, rows M, x dtype): 8-bit symmetric has no offset, the
# others have one; every bits with every g and both symmetries, M and dtypes mixed.
CASES = [(8, True, 32, 1, jnp.float32), (8, False, 128, 5, jnp.bfloat16),
         (8, True, 128, 64, jnp.bfloat16), (8, False, 32, 64, jnp.float32),
         (4, False, 32, 64, jnp.float32), (4, True, 128, 1, jnp.bfloat16),
         (4, True, 32, 5, jnp.float32), (4, False, 128, 5, jnp.bfloat16)]


def random_inputs(seed: int, m: int, k: int, n: int, bits: int, symmetric: bool, g: int, dtype):
    """Fresh normal x [M, K] and a quantised W [K, N] ~ N(0, 1/K) with column means (so
    offsets matter): outputs are O(1)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = rng.standard_normal((k, n)) / np.sqrt(k) + rng.uniform(-0.05, 0.05, n)
    return x, qarray.quantize(jnp.asarray(w, jnp.float32), bits=bits, group_size=g, symmetric=symmetric)


class QuantizedMatmulCases:
    interpret = False
    platform: str | None = None

    def run(self, *args, **kwargs):
        return quantized_matmul(*args, implementation="pallas", interpret=self.interpret,
                                platform=self.platform, **kwargs)

    @pytest.mark.parametrize("bits,symmetric,g,m,dtype", CASES)
    def test_matches_reference(self, bits, symmetric, g, m, dtype):
        x, w = random_inputs(bits * g + m, m, 384, 384, bits, symmetric, g, dtype)
        assert w.has_offset == (bits == 4 or not symmetric)
        got = self.run(x, w)
        want = reference.quantized_matmul(x, w)
        atol, rtol = TOL[dtype]
        assert got.dtype == jnp.float32 and got.shape == (m, 384)
        np.testing.assert_allclose(got, want, atol=atol, rtol=rtol)

    @pytest.mark.parametrize("bits,g,blocks", [
        (8, 256, dict(block_m=16, block_k=128)),  # several K blocks share a group's scales
        (8, 32, dict(block_m=16, block_k=256)),  # a K block of several groups
        (4, 64, dict(block_m=16, block_k=256)),  # int4 over several K blocks
    ])
    def test_explicit_blocks(self, bits, g, blocks):
        """Row padding over several row blocks, K blocks inside or across groups, bf16 out."""
        x, w = random_inputs(7, 40, 512, 256, bits, False, g, jnp.float32)
        if self.platform == "gpu":  # Triton: K steps inside one group, power-of-two blocks
            blocks = dict(blocks, block_k=min(blocks["block_k"], g), block_n=64)
        got = self.run(x, w, out_dtype=jnp.bfloat16, **blocks)
        assert got.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(got, np.float32), reference.quantized_matmul(x, w),
                                   atol=2e-2, rtol=1e-2)


class TestInterpretGPU(QuantizedMatmulCases):
    interpret, platform = True, "gpu"


class TestInterpretTPU(QuantizedMatmulCases):
    interpret, platform = True, "tpu"


@pytest.mark.skipif(jax.default_backend() not in ("gpu", "tpu"), reason="needs a GPU or TPU")
class TestOnDevice(QuantizedMatmulCases):
    pass


def test_xla_path_is_the_reference():
    x, w = random_inputs(3, 5, 256, 128, 4, False, 32, jnp.bfloat16)
    got = quantized_matmul(x, w, implementation="xla")
    want = np.asarray(x, np.float64) @ np.asarray(qarray.dequantize(w), np.float64)  # float64 dot
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)


def test_kernel_reads_codes_not_a_dequantised_weight():
    """The pallas_call's operands are x, the uint8 codes and the group-wise scales:
    nothing of W's [K, N] size in floating point."""
    x, w = random_inputs(4, 8, 256, 256, 4, False, 32, jnp.bfloat16)
    jaxpr = jax.make_jaxpr(functools.partial(quantized_matmul, interpret=True, platform="tpu"))(x, w)
    [call] = [e for e in jaxpr.jaxpr.eqns[0].params["jaxpr"].eqns if e.primitive.name == "pallas_call"]
    avals = [v.aval for v in call.invars]
    assert any(a.dtype == jnp.uint8 and a.shape == (128, 256) for a in avals)
    assert all(a.size < 256 * 256 // 8 for a in avals if jnp.issubdtype(a.dtype, jnp.floating))


def quantized_shapes(bits: int, k: int, n: int, g: int, offset: bool) -> qarray.QArray:
    sd = jax.ShapeDtypeStruct
    q = sd((k, n), jnp.int8) if bits == 8 else sd((k // 2, n), jnp.uint8)
    scale = sd((k // g, n), jnp.float16)
    return qarray.QArray(q=q, scale=scale, offset=scale if offset else None, bits=bits,
                         group_size=g, shape=(k, n))


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
@pytest.mark.parametrize("bits", [4, 8])
def test_lowers_for_the_device(platform, bits):
    """The kernel lowers for cuda (Triton) and tpu (Mosaic) from this CPU machine: a
    decode step (M=8, bf16) against a 4096 x 4096 weight in groups of 128."""
    x = jax.ShapeDtypeStruct((8, 4096), jnp.bfloat16)
    w = quantized_shapes(bits, 4096, 4096, 128, offset=bits == 4)
    lower(functools.partial(quantized_matmul, platform=platform), (x, w), platform)


@pytest.mark.parametrize("change,match", [
    (dict(x_dtype=jnp.float16), "x has dtype float16"),
    (dict(not_a_qarray=True), "w is a .*, expected a QArray"),
    (dict(k=256), "x has K=256 but the QArray has K=384"),
    (dict(scale_dtype=jnp.float32), "invalid QArray: scale has dtype float32"),
    (dict(platform="gpu", block_k=48), "block_k=48 must be a power of two >= 16 dividing group_size=128"),
    (dict(platform="gpu", block_k=256), "block_k=256 must be a power of two >= 16 dividing"),
    (dict(platform="gpu", bits=4, block_k=16), "block_k=16 must be a power of two >= 32"),
    (dict(platform="gpu", block_m=24), "block_m=24 must be a power of two"),
    (dict(platform="gpu", block_n=48), "block_n=48 must be a power of two"),
    (dict(platform="tpu", block_k=64), "block_k=64 must be K=384 or a multiple of 128"),
    (dict(platform="tpu", bits=4, block_k=128), "block_k=128 must be K=384 or a multiple of 256"),
    (dict(platform="tpu", block_n=192), "block_n=192 must be N=384 or a multiple of 128"),
    (dict(platform="tpu", block_m=12), "block_m=12 must be a multiple of 8"),
    (dict(implementation="triton"), "implementation='triton'"),
])
def test_bad_input_is_a_one_line_error(change, match):
    from conftest import assert_one_line_error

    bits = change.get("bits", 8)
    x = jnp.ones((4, change.get("k", 384)), change.get("x_dtype", jnp.float32))
    _, w = random_inputs(0, 1, 384, 384, bits, False, 128, jnp.float32)
    if "scale_dtype" in change:
        w = qarray.QArray(w.q, w.scale.astype(change["scale_dtype"]), w.offset, bits, 128, w.shape)
    w = w.q if change.get("not_a_qarray") else w
    blocks = {b: change[b] for b in ("block_m", "block_n", "block_k") if b in change}
    assert_one_line_error(quantized_matmul, x, w, match=match, interpret=True,
                          platform=change.get("platform", "tpu"),
                          implementation=change.get("implementation", "pallas"), **blocks)


def test_on_cpu_without_interpret_is_refused():
    from conftest import assert_one_line_error

    if jax.default_backend() in ("gpu", "tpu"):
        pytest.skip("a device backend has a kernel")
    x, w = random_inputs(0, 2, 256, 128, 8, True, 32, jnp.float32)
    assert_one_line_error(quantized_matmul, x, w, match="interpret=True")


def test_bytes_moved_counts_codes_scales_x_and_out():
    x = jax.ShapeDtypeStruct((8, 4096), jnp.bfloat16)
    int4 = quantized_shapes(4, 4096, 4096, 128, offset=True)
    moved = bytes_moved(x, int4, platform="gpu")
    # x bf16 + codes (two per byte) + f16 scales and offsets (32 groups); f32 out
    assert moved.read == 8 * 4096 * 2 + 2048 * 4096 + 2 * 32 * 4096 * 2
    assert moved.written == 8 * 4096 * 4
    # the TPU also converts scales and offsets to f32 (written, then read by the kernel)
    moved = bytes_moved(x, int4, platform="tpu")
    assert moved.read == 8 * 4096 * 2 + 2048 * 4096 + 2 * 32 * 4096 * (2 + 4)
    assert moved.written == 8 * 4096 * 4 + 2 * 32 * 4096 * 4
    int8 = quantized_shapes(8, 4096, 1024, 32, offset=False)
    moved = bytes_moved(x, int8, platform="gpu", out_dtype=jnp.bfloat16)
    assert (moved.read, moved.written) == (8 * 4096 * 2 + 4096 * 1024 + 128 * 1024 * 2, 8 * 1024 * 2)
