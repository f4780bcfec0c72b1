"""pallas_kernels/dfloat11 against its reference, the library's jnp decoder: bit for bit.

`DFloat11Cases` holds the cases; `TestInterpret` runs them in Pallas interpret mode on any
backend (CI, on the CPU). The kernel is not compiled for a device yet (see its api).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxdec.formats import dfloat11 as df
from pallas_kernels import common
from pallas_kernels.dfloat11 import decompress, reference


def sample(kind: str, shape, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if kind == "all_bits":  # every bit pattern, all 256 exponents
        return rng.integers(0, 1 << 16, n).astype(np.uint16).view(jnp.bfloat16).reshape(shape)
    if kind == "constant":
        return np.full(shape, rng.standard_normal(), np.float32).astype(jnp.bfloat16)
    return (rng.standard_normal(shape) * 0.02).astype(np.float32).astype(jnp.bfloat16)


# (distribution, shape): one thread, one block, several blocks, sizes off the block grid
CASES = [("gaussian", (7,)), ("gaussian", (333, 77)), ("gaussian", (700, 300)),
         ("all_bits", (12_289,)), ("constant", (4096, 9)), ("gaussian", (64, 3, 65))]


class DFloat11Cases:
    interpret = False

    @pytest.mark.parametrize("kind,shape", CASES, ids=str)
    def test_matches_reference(self, kind, shape):
        w = sample(kind, shape, seed=int(np.prod(shape)) + len(kind))
        a = df.compress(w)
        got = decompress(a, implementation="pallas", interpret=self.interpret)
        want = reference.decompress(a)
        assert got.dtype == jnp.bfloat16 and got.shape == shape
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16), w.view(np.uint16))


class TestInterpret(DFloat11Cases):
    interpret = True


def test_xla_path_is_the_reference():
    w = sample("gaussian", (300, 40), 1)
    a = df.compress(w)
    np.testing.assert_array_equal(np.asarray(decompress(a, implementation="xla")).view(np.uint16),
                                  w.view(np.uint16))


def test_without_interpret_is_refused():
    a = df.compress(sample("gaussian", (30, 4), 2))
    with pytest.raises(common.KernelError, match="interpret mode only"):
        decompress(a, platform="gpu")


def test_bad_input_is_a_one_line_error():
    a = df.compress(sample("gaussian", (30, 4), 3))
    for bad, match in [(dataclasses.replace(a, max_len=40), "max_len"),
                       (np.zeros((3, 3)), "expected a DF11Array")]:
        with pytest.raises(common.KernelError, match=match) as info:
            decompress(bad, interpret=True)
        assert "\n" not in str(info.value)
