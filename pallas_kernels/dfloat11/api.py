"""`decompress`: the bfloat16 weight of a `DF11Array`, bit for bit.

    w = decompress(a, implementation="pallas", interpret=True)

a: a `jaxdec.formats.dfloat11.DF11Array` (Huffman-coded exponents, raw sign and mantissa;
its docstring has the layout). implementation="xla" is the library's jnp decoder
(`reference.py`); "pallas" runs the two-phase block kernel (`kernel.py`: count, scan,
decode and write, one program per block of 512 threads), then lays the blocks' rows at
their stored output positions. The kernel is checked in Pallas interpret mode; without
`interpret=True` the call raises a one-line `KernelError` (its gathers do not lower on
Mosaic, and its Triton lowering is not verified).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxdec.errors import JaxdecError
from jaxdec.formats import dfloat11
from pallas_kernels import common
from pallas_kernels.dfloat11 import kernel, reference

OP = "dfloat11_decompress"


def check_inputs(a) -> dfloat11.DF11Array:
    common.check(isinstance(a, dfloat11.DF11Array), OP, f"a is a {type(a).__name__}, expected a DF11Array")
    try:
        return dfloat11.validate(a)
    except JaxdecError as e:
        raise common.KernelError(f"{OP}: {e}") from None


def blocked_inputs(a: dfloat11.DF11Array):
    """(u32[NB, 1025] each block's stream words with one word of look-ahead, u8[NB, 321]
    each block's packed gaps with one byte more, i32[L * 256] the tables)."""
    nb, per = a.n_blocks, 2 * dfloat11.THREADS_PER_BLOCK
    words = dfloat11.stream_words(a.stream)
    words = jnp.pad(words, (0, nb * per + 1 - words.shape[0]))
    rows = jnp.arange(nb)[:, None] * per + jnp.arange(per + 1)
    gaps = jnp.asarray(a.gaps)
    gaps = jnp.pad(gaps, (0, nb * kernel.GAP_BYTES + 1 - gaps.shape[0]))
    gap_rows = jnp.arange(nb)[:, None] * kernel.GAP_BYTES + jnp.arange(kernel.GAP_BYTES + 1)
    return words[rows], gaps[gap_rows], jnp.asarray(a.luts).reshape(-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("implementation", "interpret", "platform"))
def decompress(a: dfloat11.DF11Array, *, implementation: str = "pallas", interpret: bool = False,
               platform: str | None = None) -> jax.Array:
    """See the module docstring."""
    a = check_inputs(a)
    if common.resolve(OP, implementation, interpret, platform) is None:
        return reference.decompress(a)
    common.check(interpret, OP, "the DFloat11 kernel runs in Pallas interpret mode only "
                 "(pass interpret=True, or implementation='xla')")
    words, gaps, lut = blocked_inputs(a)
    rows = kernel.block_exponents(words, gaps, lut, n_bits=a.n_bits, steps=a.max_count,
                                  levels=-(-a.max_len // 8), interpret=interpret)
    exponent = dfloat11.place_exponents(rows.T, jnp.asarray(a.block_pos).astype(jnp.int32), a.size)
    return dfloat11.assemble_bf16(exponent, a.sign_mantissa).reshape(a.shape)
