"""DFloat11 decompression as the paper's two-phase block kernel, in Pallas.

Grid: one program per block of `THREADS_PER_BLOCK` (512) threads, a thread being 8 bytes
of the code stream (see `jaxdec.formats.dfloat11` for the layout). Each program:

    phase 1: every thread decodes the codes starting in its 64 bits, only to count them;
             an exclusive scan of the counts gives each thread's first output slot
    phase 2: every thread decodes again and writes each exponent at its slot

into its block's row of the output, u8[NB, 512 * S] (S = the most codes in a thread),
zeros past the block's codes. The wrapper (`api.decompress`) lays each row at its block's
stored output position (one windowed scatter-add: rows overlap only in their zeros) and
joins sign and mantissa. The paper's CUDA kernel keeps the row in shared memory and stores
it coalesced; here it is the program's output block.

The table lookups and the phase-2 writes are gathers and a scatter over a program's
values, which Pallas interpret mode runs anywhere; Mosaic (TPU) does not lower them, and
the Triton lowering is not verified here, so `api` asks for interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxdec.formats.dfloat11 import GAP_BITS, PTR, THREAD_BITS, THREADS_PER_BLOCK

GAP_BYTES = GAP_BITS * THREADS_PER_BLOCK // 8  # 320 bytes of gaps a block


def _lookup(lut, window, levels: int):
    """u32 windows -> i32 leaf entries (length << 8 | exponent) through the tables."""
    entry = lut[(window >> 24).astype(jnp.int32)]
    for level in range(1, levels):
        ptr = entry >= PTR
        byte = ((window >> (24 - 8 * level)) & 0xFF).astype(jnp.int32)
        entry = jnp.where(ptr, lut[jnp.where(ptr, (entry - PTR) * 256 + byte, 0)], entry)
    return entry


def _kernel(
    # inputs
    words_ref,  # u32[1, 2 * 512 + 1]: the block's stream words, one word of look-ahead
    gaps_ref,  # u8[1, 320 + 1]: the block's packed 5-bit gaps, one byte more
    lut_ref,  # i32[L * 256]: the decoding tables, flat
    # outputs
    o_ref,  # u8[1, 512 * S]: the block's exponents in order, zeros past its codes
    *, n_bits: int, steps: int, levels: int,
):
    b = pl.program_id(0)
    t = jnp.arange(THREADS_PER_BLOCK, dtype=jnp.int32)
    words, lut = words_ref[0], lut_ref[...]
    w0, w1, w2 = words[0:-1:2], words[1::2], words[2::2]  # u32[512] each
    g = gaps_ref[0].astype(jnp.int32)
    bit = GAP_BITS * t
    gap = ((g[bit >> 3] | (g[(bit >> 3) + 1] << 8)) >> (bit & 7)) & 31
    end = jnp.clip(n_bits - THREAD_BITS * (b * THREADS_PER_BLOCK + t), 0, THREAD_BITS)

    def code_at(pos):  # -> (exponent, length, live) of the code at local bit pos
        r = (pos & 31).astype(jnp.uint32)
        high = pos >= 32
        first, second = jnp.where(high, w1, w0), jnp.where(high, w2, w1)
        window = (first << r) | jnp.where(r == 0, 0, second >> ((32 - r) & 31))
        entry = _lookup(lut, window, levels)
        return entry & 0xFF, entry >> 8, pos < end

    def count(_, carry):  # phase 1
        pos, n = carry
        _, length, live = code_at(pos)
        return pos + jnp.where(live, length, 0), n + live

    _, counts = jax.lax.fori_loop(0, steps, count, (gap, jnp.zeros_like(gap)))
    slot0 = jnp.cumsum(counts) - counts  # exclusive scan: each thread's first slot
    cap = o_ref.shape[1]

    def write(i, carry):  # phase 2
        pos, row = carry
        sym, length, live = code_at(pos)
        row = row.at[jnp.where(live, slot0 + i, cap)].set(sym.astype(jnp.uint8), mode="drop")
        return pos + jnp.where(live, length, 0), row

    _, row = jax.lax.fori_loop(0, steps, write, (gap, jnp.zeros((cap,), jnp.uint8)))
    o_ref[0] = row


@functools.partial(jax.jit, static_argnames=("n_bits", "steps", "levels", "interpret"))
def block_exponents(words, gaps, lut, *, n_bits: int, steps: int, levels: int,
                    interpret: bool):
    """words u32[NB, 1025], gaps u8[NB, 321], lut i32[L * 256] -> u8[NB, 512 * steps]."""
    nb = words.shape[0]
    cap = THREADS_PER_BLOCK * steps
    return pl.pallas_call(
        functools.partial(_kernel, n_bits=n_bits, steps=steps, levels=levels),
        grid=(nb,),
        in_specs=[pl.BlockSpec((1, words.shape[1]), lambda b: (b, 0)),
                  pl.BlockSpec((1, gaps.shape[1]), lambda b: (b, 0)),
                  pl.BlockSpec(lut.shape, lambda b: (0,))],
        out_specs=pl.BlockSpec((1, cap), lambda b: (b, 0)),
        out_shape=jax.ShapeDtypeStruct((nb, cap), jnp.uint8),
        interpret=interpret,
        name="dfloat11_decode",
    )(words, gaps, lut)
