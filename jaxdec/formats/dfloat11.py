"""DFloat11 (arXiv 2504.11651): lossless compression of bfloat16 weights.

A bf16 number is sign (1 bit), exponent (8) and mantissa (7). In trained weights the
exponent carries ~2.6 bits of information and the rest next to none, so DFloat11 Huffman-
codes the exponents and keeps sign and mantissa raw: ~11 bits a weight instead of 16, and
`decompress` gives back the very same bits.

Layout (the paper's, `DF11Array`): the exponent codes are concatenated MSB-first into one
byte stream, cut into *threads* of `BYTES_PER_THREAD` = 8 bytes, grouped `THREADS_PER_BLOCK`
= 512 to a block. A thread decodes the codes that *start* in its 64 bits (the last one may
run into the next 4 look-ahead bytes); its 5-bit gap is the offset of its first code start.
Each block stores the index of the first element it decodes (its output position), so the
output position of a thread is its block's plus the codes of the threads before it in the
block: an exclusive scan of per-thread counts.

Decoding a code: the 32-bit window at the code start indexes a hierarchy of 256-entry
look-up tables one byte at a time (`build_luts`): an entry is a leaf `length << 8 | symbol`
or a pointer `0x8000 | table`. Codes are canonical Huffman codes of at most `MAX_CODE_LEN`
= 32 bits (`code_lengths`: when a Huffman tree is deeper, the k rarest frequencies are set
to 1, k = 2, 3, ... until it fits).

`compress` (numpy, offline) builds the stream. `decompress` (pure jnp, jittable) decodes
every thread at once: a fixed-trip loop of `max_count` steps over all threads (the lanes)
keeps each step's exponent; a scan of the counts within each block plus the block's stored
position places each lane's run (one windowed scatter-add). The GPU kernel's two phases
(count, then decode again and write) become one here, the steps being kept instead of
decoded twice; `pallas_kernels/dfloat11` has the two-phase kernel. `decompress_many`
decodes several arrays in one loop (a transformer block's, as the paper launches one
kernel per block); `take_rows` decodes only the blocks holding some rows (an embedding
lookup). In a model, `transformer.decoder_layer` decodes each layer's weights just before
the layer (`decompress_tree`, made to wait for the layer's input), `layers.linear` any
other weight before its matmul, and `transformer.embed` the embedding rows it reads; a
tensor larger than `SLICE_VALUES` (a tied LM head) is decoded a slice of rows at a time
(`matmul_sliced`, `take_columns`): at most about one layer is decompressed at a time. `compress_params` is the `params -> params`
transform; `layout`/`abstract` describe an array in a checkpoint (with a CRC-32).

Letters: n elements, T threads (= ceil(n_bits / 64)), NB blocks, S = `max_count`.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import zlib
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxdec.errors import JaxdecError

MAX_CODE_LEN = 32
BYTES_PER_THREAD = 8
THREAD_BITS = 8 * BYTES_PER_THREAD  # 64
THREADS_PER_BLOCK = 512
GAP_BITS = 5
LOOKAHEAD_BYTES = 4
PTR = 0x8000  # a look-up table entry >= PTR points to table (entry - PTR)
_ENCODE_CHUNK = 1 << 22  # elements encoded at a time (bounds the encoder's memory)


@partial(jax.tree_util.register_dataclass,
         data_fields=["stream", "sign_mantissa", "gaps", "block_pos", "luts"],
         meta_fields=["shape", "n_in", "n_bits", "max_len", "max_count", "min_block"])
@dataclasses.dataclass(frozen=True)
class DF11Array:
    """A bfloat16 weight of logical `shape`, its exponents Huffman-coded (DFloat11).

    Element i of the flattened weight has bits
        (sign_mantissa[i] & 0x80) << 8 | exponent[i] << 7 | (sign_mantissa[i] & 0x7F)
    where exponent[i] is the i-th code of `stream`.

    Invariants (checked by `validate`; `check_data` adds the ones that read the values):
    - `shape` is a tuple of positive ints, n = prod(shape) < 2**31; 1 <= n_in < len(shape)
      (the leading n_in axes are contracted when used as `x @ W`), or n_in = 1 if 1-D.
    - `n_bits` (total code bits) satisfies n <= n_bits <= n * max_len and n_bits < 2**31;
      1 <= `max_len` <= 32 is the longest code; T = ceil(n_bits / 64) threads.
    - `stream` is u8[8 T + 4]: the codes MSB-first from bit 0, zero bits after n_bits (4
      look-ahead bytes let the last thread read a whole 32-bit window).
    - `sign_mantissa` is u8[n]: sign << 7 | mantissa, raw.
    - `gaps` is u8[ceil(5 T / 8) + 1]: thread t's gap (0..31, the offset of the first code
      starting in its bits [64 t, 64 t + 64); n_bits - 64 t if none does) in bits
      [5 t, 5 t + 5) of the bytes read little-endian; the last byte is padding.
    - `block_pos` is u32[ceil(T / 512)]: index of the first code starting at or after bit
      64 * 512 * b; block_pos[0] = 0, nondecreasing, <= n.
    - `luts` is u16[L, 256], L >= 1: table 0 is indexed by a code's first byte; an entry
      is a leaf `length << 8 | exponent` (1 <= length <= max_len) or `0x8000 | table`
      (0 < table < L, indexed by the next byte). At most ceil(max_len / 8) levels.
    - `max_count` (S, 1..64) is the most codes starting in one thread.
    - `min_block` is 0 (unknown) or the fewest codes any block but the last holds (1..n;
      it bounds the blocks a run of elements touches: `_blocks_per_row`).
    Leaves may be numpy or jax arrays (or `jax.ShapeDtypeStruct`s under `eval_shape`).
    """

    stream: Any          # u8[8 T + 4]
    sign_mantissa: Any   # u8[n]
    gaps: Any            # u8[ceil(5 T / 8) + 1]
    block_pos: Any       # u32[NB]
    luts: Any            # u16[L, 256]
    shape: tuple[int, ...]
    n_in: int
    n_bits: int
    max_len: int
    max_count: int
    min_block: int = 0

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def n_threads(self) -> int:
        return -(-self.n_bits // THREAD_BITS)

    @property
    def n_blocks(self) -> int:
        return -(-self.n_threads // THREADS_PER_BLOCK)

    @property
    def nbytes(self) -> int:
        """Bytes stored: stream, sign+mantissa, gaps, block positions and tables."""
        leaves = (self.stream, self.sign_mantissa, self.gaps, self.block_pos, self.luts)
        return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves)


# ---- validation -------------------------------------------------------------------------
def _fail(msg: str):
    raise JaxdecError(f"invalid DF11Array: {msg}")


def _check_array(name: str, x: Any, dtype, shape: tuple[int, ...]) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        _fail(f"{name} is a {type(x).__name__}, not an array")
    if np.dtype(x.dtype) != np.dtype(dtype):
        _fail(f"{name} has dtype {np.dtype(x.dtype).name}, expected {np.dtype(dtype).name}")
    if tuple(x.shape) != shape:
        _fail(f"{name} has shape {tuple(x.shape)}, expected {shape}")


def _check_meta(a: DF11Array) -> None:
    shape = a.shape
    if not isinstance(shape, tuple) or not shape or not all(isinstance(d, int) and d > 0 for d in shape):
        _fail(f"shape {shape!r} is not a tuple of positive ints")
    if a.size >= 2**31:
        _fail(f"{a.size} elements; at most 2**31 - 1 in one DF11Array")
    if not isinstance(a.n_in, int) or not 1 <= a.n_in < max(2, len(shape)):
        _fail(f"n_in={a.n_in!r} must be in [1, {len(shape) - 1}] for shape {shape}")
    if not isinstance(a.max_len, int) or not 1 <= a.max_len <= MAX_CODE_LEN:
        _fail(f"max_len={a.max_len!r}, expected 1..{MAX_CODE_LEN}")
    if not isinstance(a.n_bits, int) or not a.size <= a.n_bits <= min(a.size * a.max_len, 2**31 - 1):
        _fail(f"n_bits={a.n_bits!r} is not in [{a.size}, {a.size * a.max_len}]")
    if not isinstance(a.max_count, int) or not 1 <= a.max_count <= THREAD_BITS:
        _fail(f"max_count={a.max_count!r}, expected 1..{THREAD_BITS}")
    if not isinstance(a.min_block, int) or not 0 <= a.min_block <= a.size:
        _fail(f"min_block={a.min_block!r}, expected 0..{a.size}")


def validate(a: DF11Array) -> DF11Array:
    """Check the invariants of the class docstring that shapes and metadata show; raise
    `JaxdecError` naming the first broken one. Works on concrete arrays, tracers and
    ShapeDtypeStructs. Returns `a`."""
    if not isinstance(a, DF11Array):
        _fail(f"expected a DF11Array, got {type(a).__name__}")
    _check_meta(a)
    t = a.n_threads
    _check_array("stream", a.stream, np.uint8, (BYTES_PER_THREAD * t + LOOKAHEAD_BYTES,))
    _check_array("sign_mantissa", a.sign_mantissa, np.uint8, (a.size,))
    _check_array("gaps", a.gaps, np.uint8, (-(-GAP_BITS * t // 8) + 1,))
    _check_array("block_pos", a.block_pos, np.uint32, (a.n_blocks,))
    if len(getattr(a.luts, "shape", ())) != 2 or a.luts.shape[0] < 1:
        _fail("luts must be a [L >= 1, 256] table")
    _check_array("luts", a.luts, np.uint16, (a.luts.shape[0], 256))
    return a


def check_data(a: DF11Array) -> DF11Array:
    """`validate`, then the invariants that read concrete values (block positions, gaps
    and look-up tables). A restored checkpoint is checked this way."""
    validate(a)
    pos = np.asarray(a.block_pos).astype(np.int64)
    if pos[0] != 0 or np.any(np.diff(pos) < 0) or pos[-1] > a.size:
        _fail("block positions are not a nondecreasing run from 0 to at most n")
    if a.min_block and len(pos) > 1 and np.diff(pos).min() < a.min_block:
        _fail(f"a block holds fewer than min_block={a.min_block} codes")
    gaps = _unpack_gaps_np(np.asarray(a.gaps), a.n_threads)
    if np.any(64 * np.arange(a.n_threads, dtype=np.int64) + gaps > a.n_bits):
        _fail("a thread's gap points past the end of the stream")
    luts = np.asarray(a.luts).astype(np.int64)
    ptr = luts >= PTR
    if np.any(ptr & ((luts - PTR < 1) | (luts - PTR >= luts.shape[0]))):
        _fail("a look-up table entry points to no table")
    length = luts >> 8
    if np.any(~ptr & (luts != 0) & ((length < 1) | (length > a.max_len))):
        _fail(f"a look-up table leaf has a code length outside 1..{a.max_len}")
    return a


# ---- the code (offline, numpy) ----------------------------------------------------------
def _huffman_lengths(freq: np.ndarray) -> np.ndarray:
    """i64[256] code lengths of a Huffman code for `freq` (0 for absent symbols; a lone
    symbol gets 1 bit). Ties are broken by symbol order, so the code is deterministic."""
    present = [int(s) for s in np.flatnonzero(freq)]
    lengths = np.zeros(256, np.int64)
    if len(present) == 1:
        lengths[present[0]] = 1
        return lengths
    heap = [(int(freq[s]), i, (s,)) for i, s in enumerate(present)]
    heapq.heapify(heap)
    order = len(heap)
    while len(heap) > 1:
        f1, _, a = heapq.heappop(heap)
        f2, _, b = heapq.heappop(heap)
        lengths[list(a + b)] += 1
        heapq.heappush(heap, (f1 + f2, order, a + b))
        order += 1
    return lengths


def code_lengths(freq, max_len: int = MAX_CODE_LEN) -> np.ndarray:
    """u8[256] Huffman code lengths for the symbol counts `freq`, none longer than
    `max_len`: while the tree is too deep, the k rarest present symbols count as 1, for
    k = 2, 3, ... (the paper's rule)."""
    freq = np.asarray(freq, np.int64)
    if freq.shape != (256,) or np.any(freq < 0) or not freq.any():
        raise JaxdecError("code_lengths: expected 256 nonnegative counts, not all zero")
    lengths = _huffman_lengths(freq)
    rarest = sorted(np.flatnonzero(freq), key=lambda s: (freq[s], s))
    k = 2
    while lengths.max() > max_len:
        if k > len(rarest):
            raise JaxdecError(f"code_lengths: no Huffman code of {len(rarest)} symbols fits "
                              f"in {max_len} bits")
        flat = freq.copy()
        flat[rarest[:k]] = 1
        lengths = _huffman_lengths(flat)
        k += 1
    return lengths.astype(np.uint8)


def canonical_codes(lengths) -> np.ndarray:
    """u32[256] canonical Huffman codes for `lengths` (shortest first, then by symbol)."""
    lengths = np.asarray(lengths, np.int64)
    codes = np.zeros(256, np.uint64)
    code, prev = 0, 0
    for s in sorted(np.flatnonzero(lengths), key=lambda s: (lengths[s], s)):
        code <<= int(lengths[s]) - prev
        codes[s], prev = code, int(lengths[s])
        code += 1
    return codes.astype(np.uint32)


def build_luts(lengths, codes) -> np.ndarray:
    """u16[L, 256] decoding tables of the code (see the module docstring): table 0 reads
    the first byte of a 32-bit window, a pointer entry sends the next byte to a subtable."""
    tables = [np.zeros(256, np.uint16)]
    for s in np.flatnonzero(lengths):
        n, code, t = int(lengths[s]), int(codes[s]), 0
        while n > 8:
            n -= 8
            prefix = code >> n
            if tables[t][prefix] < PTR:
                tables.append(np.zeros(256, np.uint16))
                tables[t][prefix] = PTR | (len(tables) - 1)
            t, code = int(tables[t][prefix]) - PTR, code & ((1 << n) - 1)
        lo = code << (8 - n)
        tables[t][lo: lo + (1 << (8 - n))] = (int(lengths[s]) << 8) | int(s)
    return np.stack(tables)


def entropy_bits(freq) -> float:
    """Shannon entropy (bits per symbol) of the counts `freq`."""
    p = np.asarray(freq, np.float64)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log2(p)).sum())


# ---- encoding ---------------------------------------------------------------------------
def _split_bits(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """u16 bf16 bits -> (exponent u8, sign << 7 | mantissa u8)."""
    exponent = ((bits >> 7) & 0xFF).astype(np.uint8)
    sign_mantissa = (((bits >> 8) & 0x80) | (bits & 0x7F)).astype(np.uint8)
    return exponent, sign_mantissa


class _Threads:
    """Per-thread bookkeeping filled chunk by chunk: the index of the first code starting
    at or after each thread's first bit, and that code's offset (the gap). Every thread
    but the last holds a code start (codes are at most 32 bits, threads 64)."""

    def __init__(self, n_threads: int):
        self.first = np.zeros(n_threads + 1, np.int64)
        self.gap = np.zeros(n_threads, np.int64)
        self.done = 0  # threads assigned so far

    def add(self, starts: np.ndarray, base: int) -> None:
        """`starts`: sorted start bits of codes base, base + 1, ..."""
        thread = starts >> 6
        new = np.flatnonzero(np.concatenate([[thread[0] >= self.done], thread[1:] != thread[:-1]]))
        t = thread[new]
        self.first[t] = base + new
        self.gap[t] = starts[new] - THREAD_BITS * t.astype(np.int64)
        self.done += t.size
        assert self.done == thread[-1] + 1, "a thread without a code start"


def _encode(exponent: np.ndarray, lengths: np.ndarray, codes: np.ndarray, n_bits: int):
    """-> (stream u8[8 T + 4], _Threads): the `n_bits` (< 2**31) code bits packed MSB-first."""
    lens = lengths.astype(np.uint8)
    codes = codes.astype(np.uint64)
    n_threads = -(-n_bits // THREAD_BITS)
    words = np.zeros(2 * n_threads + 2, np.uint32)
    threads = _Threads(n_threads)
    base_bit = 0
    for lo in range(0, exponent.size, _ENCODE_CHUNK):
        e = exponent[lo: lo + _ENCODE_CHUNK]
        ln = lens[e]
        starts = np.cumsum(ln, dtype=np.int32)
        starts -= ln
        starts += base_bit
        word = starts >> 5
        # each code left-aligned in the 64 bits of words `word` and `word + 1`; the codes
        # starting in one word have disjoint bits, so their sum is their OR
        shift = np.uint8(64) - (starts & 31).astype(np.uint8) - ln
        v = codes[e] << shift
        first = np.flatnonzero(np.concatenate([[True], word[1:] != word[:-1]]))
        run = np.add.reduceat(v, first)
        words[word[first]] |= (run >> np.uint64(32)).astype(np.uint32)
        words[word[first] + 1] |= run.astype(np.uint32)
        threads.add(starts, lo)
        base_bit = int(starts[-1]) + int(ln[-1])
    return words[: 2 * n_threads + 1].astype(">u4").view(np.uint8), threads


def _finish_threads(threads: _Threads, n: int, n_bits: int) -> None:
    """Threads in which no code starts (at most the last one): first = n, gap to the end."""
    t = np.arange(threads.done, threads.gap.size, dtype=np.int64)
    threads.first[t] = n
    threads.gap[t] = n_bits - THREAD_BITS * t
    threads.first[-1] = n


def _pack_gaps(gaps: np.ndarray) -> np.ndarray:
    """5-bit gaps -> u8[ceil(5 T / 8) + 1], gap t in bits [5 t, 5 t + 5), little-endian."""
    bits = (gaps[:, None] >> np.arange(GAP_BITS)) & 1
    packed = np.packbits(bits.astype(np.uint8).reshape(-1), bitorder="little")
    return np.concatenate([packed, np.zeros(1, np.uint8)])


def _unpack_gaps_np(packed: np.ndarray, n_threads: int) -> np.ndarray:
    bits = np.unpackbits(packed, bitorder="little")[: GAP_BITS * n_threads]
    return (bits.reshape(n_threads, GAP_BITS).astype(np.int64) << np.arange(GAP_BITS)).sum(1)


def compress(w, *, n_in: int = 1, max_len: int = MAX_CODE_LEN) -> DF11Array:
    """A bfloat16 array (numpy or jax; as a matmul weight, its leading `n_in` axes contracted)
    -> its `DF11Array`. Offline, in numpy; bit-exact: `decompress` gives back w's bits."""
    if np.dtype(getattr(w, "dtype", None)) != np.dtype(jnp.bfloat16):
        raise JaxdecError(f"DFloat11 compresses bfloat16 arrays, not {getattr(w, 'dtype', type(w).__name__)}")
    shape = tuple(int(d) for d in w.shape)
    bits = np.asarray(w).view(np.uint16).reshape(-1)
    if bits.size == 0:
        raise JaxdecError("DFloat11: cannot compress an empty array")
    exponent, sign_mantissa = _split_bits(bits)
    lengths = code_lengths(np.bincount(exponent, minlength=256), max_len)
    codes = canonical_codes(lengths)
    n_bits = int(np.bincount(exponent, minlength=256).astype(np.int64) @ lengths.astype(np.int64))
    if n_bits >= 2**31:
        raise JaxdecError(f"DFloat11: {shape} needs {n_bits} code bits, over 2**31; split it")
    stream, threads = _encode(exponent, lengths, codes, n_bits)
    _finish_threads(threads, bits.size, n_bits)
    counts = np.diff(threads.first)
    block_pos = threads.first[:-1:THREADS_PER_BLOCK]
    a = DF11Array(stream=stream, sign_mantissa=sign_mantissa, gaps=_pack_gaps(threads.gap),
                  block_pos=block_pos.astype(np.uint32), luts=build_luts(lengths, codes),
                  shape=shape, n_in=n_in, n_bits=n_bits, max_len=int(lengths.max()),
                  max_count=max(1, int(counts.max())),
                  min_block=int(np.diff(block_pos).min(initial=bits.size)))
    return validate(a)


# ---- decoding (pure jnp) ----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Lanes:
    """The decode loop's inputs, one lane per thread (M lanes, from one or many arrays)."""

    words: jax.Array     # u32[3, M] the thread's 96 stream bits (its 8 bytes, 4 more)
    gap: jax.Array       # i32[M] local bit of its first code
    end: jax.Array       # i32[M] local bit where its codes stop (0: an idle lane)
    lut_base: jax.Array  # i32[M] where its array's tables start in the flat table (entries)


def stream_words(stream) -> jax.Array:
    """u8[4 W] -> u32[W], big-endian."""
    b = jnp.asarray(stream).reshape(-1, 4).astype(jnp.uint32)
    return (b[:, 0] << 24) | (b[:, 1] << 16) | (b[:, 2] << 8) | b[:, 3]


def _lanes(words, gaps, t, *, n_bits, word0=0, gap0=0, lut0=0) -> _Lanes:
    """Lanes of threads `t` (i32[M]) of an array whose stream starts at word `word0` of
    `words` (u32), whose gaps start at bit `gap0` of `gaps` (u8), and whose tables start
    at table `lut0`; the offsets may be per-lane arrays. Threads past the stream idle."""
    at = jnp.clip(word0 + 2 * t + jnp.arange(3, dtype=jnp.int32)[:, None], 0, words.shape[0] - 1)
    g = jnp.asarray(gaps).astype(jnp.int32)
    bit = gap0 + GAP_BITS * t
    i = jnp.clip(bit >> 3, 0, g.shape[0] - 2)
    take = lambda x, j: x.at[j].get(mode="promise_in_bounds")  # (j is clipped above)
    gap = ((take(g, i) | (take(g, i + 1) << 8)) >> (bit & 7)) & 31
    end = jnp.clip(n_bits - THREAD_BITS * t, 0, THREAD_BITS)
    return _Lanes(words=take(words, at), gap=gap, end=end,
                  lut_base=jnp.broadcast_to(256 * lut0, t.shape).astype(jnp.int32))


def _all_lanes(arrays, zero=0) -> _Lanes:
    """Lanes of every thread of every array, block-padded (NB * 512 lanes an array), from
    their streams and gaps concatenated; which array a lane belongs to is static."""
    wait = lambda x: x + jnp.asarray(zero).astype(x.dtype)
    cat = lambda xs: wait(xs[0]) if len(xs) == 1 else jnp.concatenate([wait(x) for x in xs])
    words = stream_words(cat([jnp.asarray(a.stream) for a in arrays]))  # (waiting for `zero`)
    gaps = cat([jnp.asarray(a.gaps) for a in arrays])
    starts = lambda sizes: np.cumsum([0] + list(sizes))[:-1]
    lane0 = starts(a.n_blocks * THREADS_PER_BLOCK for a in arrays)
    tables = dict(word0=starts(a.stream.shape[0] // 4 for a in arrays),
                  gap0=8 * starts(a.gaps.shape[0] for a in arrays),
                  n_bits=np.array([a.n_bits for a in arrays]),
                  lut0=starts(a.luts.shape[0] for a in arrays))
    lane = jnp.arange(sum(a.n_blocks for a in arrays) * THREADS_PER_BLOCK, dtype=jnp.int32) + zero

    def pick(table):  # the lane's array's entry of a static table (elementwise: it fuses)
        out = jnp.int32(int(table[0]))
        for start, v in zip(lane0[1:], table[1:]):
            out = jnp.where(lane >= int(start), jnp.int32(int(v)), out)
        return out

    return _lanes(words, gaps, lane - pick(lane0), **{name: pick(v) for name, v in tables.items()})


def _zeros(shape, dtype, zero) -> jax.Array:
    """Zeros that wait for `zero` (see `_zero_after`) rather than being made up front."""
    return jnp.broadcast_to(jnp.asarray(zero).astype(dtype), shape)


def _decode(lanes: _Lanes, flat_luts, steps: int, levels: int, zero=0) -> tuple[jax.Array, jax.Array]:
    """Every lane decodes the codes starting in its 64 bits, `steps` times (a lane with
    fewer codes idles) -> (u8[S, M] the exponents step by step, 0 past a lane's codes;
    i32[M] the code counts)."""
    def lookup(window):  # u32 window -> i32 leaf entry, length << 8 | exponent
        entry = flat_luts.at[lanes.lut_base + (window >> 24).astype(jnp.int32)].get(mode="clip")
        for level in range(1, levels):
            ptr = entry >= PTR
            byte = ((window >> (24 - 8 * level)) & 0xFF).astype(jnp.int32)
            sub = lanes.lut_base + (entry - PTR) * 256 + byte
            entry = jnp.where(ptr, flat_luts.at[jnp.where(ptr, sub, 0)].get(mode="clip"), entry)
        return entry

    def step(i, carry):
        pos, count, syms = carry  # i32[M]: local bit of the next code, codes so far
        r = (pos & 31).astype(jnp.uint32)
        high = pos >= 32
        w = lanes.words  # (rows sliced inside the loop: the slices fuse)
        first, second = jnp.where(high, w[1], w[0]), jnp.where(high, w[2], w[1])
        window = (first << r) | jnp.where(r == 0, 0, second >> ((32 - r) & 31))
        entry = lookup(window)
        live = pos < lanes.end
        sym = jnp.where(live, entry & 0xFF, 0).astype(jnp.uint8)
        syms = jax.lax.dynamic_update_index_in_dim(syms, sym, i, 0)
        return pos + jnp.where(live, entry >> 8, 0), count + live, syms

    m = lanes.gap.shape[0]
    start = (lanes.gap, _zeros((m,), jnp.int32, zero), _zeros((steps, m), jnp.uint8, zero))
    _, count, syms = jax.lax.fori_loop(0, steps, step, start)
    return syms, count


def _offsets(count, block_base, zero=0) -> jax.Array:
    """i32[NB * 512] output position of every thread: its block's `block_base` (i32[NB])
    plus the counts of the block's threads before it (an exclusive scan, as a product with
    a strictly upper triangular matrix: f32 holds these small integers exactly)."""
    c = count.reshape(-1, THREADS_PER_BLOCK).astype(jnp.float32)
    k = jnp.arange(THREADS_PER_BLOCK)
    before = jnp.dot(c, (k[:, None] + zero < k[None, :]).astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    return (block_base[:, None] + before.astype(jnp.int32)).reshape(-1)


def place_exponents(syms, offsets, n: int, zero=0) -> jax.Array:
    """u8[n]: the steps of lane m (syms[:, m], zeros past its codes) go to offsets[m],
    offsets[m] + 1, ...: one windowed scatter-add into a buffer S longer than n. The
    lanes' runs of codes tile [0, n), so every position gets exactly one code."""
    s = syms.shape[0]
    dims = jax.lax.ScatterDimensionNumbers(update_window_dims=(0,), inserted_window_dims=(),
                                           scatter_dims_to_operand_dims=(0,))
    out = jax.lax.scatter_add(_zeros((n + s,), jnp.uint8, zero), jnp.clip(offsets, 0, n)[:, None],
                              syms, dims, indices_are_sorted=True,
                              mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)
    return out[:n]


def assemble_bf16(exponent, sign_mantissa, zero=0) -> jax.Array:
    """u8 exponents and sign+mantissa bytes -> bfloat16. (The bytes wait for `zero` too:
    otherwise XLA hoists their share of the work out of a decode loop and keeps it, two
    bytes a weight of the whole model, alive for the whole loop.)"""
    sm = (jnp.asarray(sign_mantissa) + jnp.asarray(zero).astype(jnp.uint8)).astype(jnp.uint16)
    bits = ((sm & 0x80) << 8) | (exponent.astype(jnp.uint16) << 7) | (sm & 0x7F)
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


def _zero_after(after) -> jax.Array | int:
    """An i32 zero computed from `after` (cos never exceeds 2, NaN included), which XLA
    cannot prove is zero. Added to the decoder's lane ids it makes the decoding wait for
    `after` (e.g. the activation a layer reads), so it is neither hoisted out of a loop
    nor scheduled early: each layer's weights are decoded just before their use. (An
    optimisation barrier does not do it: XLA:CPU drops barriers before scheduling.)"""
    if after is None or math.prod(jnp.shape(after)) == 0:
        return 0
    v = jnp.asarray(after).reshape(-1)[0].astype(jnp.float32)
    return (jnp.cos(v) > 2).astype(jnp.int32)


def _flat_luts(arrays) -> jax.Array:
    """i32: the arrays' tables stacked and flattened."""
    luts = [jnp.asarray(a.luts) for a in arrays]
    return (luts[0] if len(luts) == 1 else jnp.concatenate(luts)).reshape(-1).astype(jnp.int32)


def decompress_many(arrays, *, after=None) -> list[jax.Array]:
    """`decompress` of several arrays in one decode loop (one launch per transformer block,
    as in the paper): their threads are the lanes of one loop, then one scatter places
    every code. Returns the bfloat16 weights, in order. `after`: as for `decompress`."""
    arrays = [validate(a) for a in arrays]
    if not arrays:
        return []
    flat, zero = _flat_luts(arrays), _zero_after(after)
    syms, count = _decode(_all_lanes(arrays, zero), flat, max(a.max_count for a in arrays),
                          max(-(-a.max_len // 8) for a in arrays), zero)
    block_base, n_total = [], 0
    for a in arrays:
        block_base.append(jnp.asarray(a.block_pos).astype(jnp.int32) + n_total)
        n_total += a.size
    offsets = _offsets(count, jnp.concatenate(block_base) if len(arrays) > 1 else block_base[0], zero)
    exponent = place_exponents(syms, offsets, n_total, zero)
    out, lo = [], 0
    for a in arrays:
        out.append(assemble_bf16(exponent[lo: lo + a.size], a.sign_mantissa, zero).reshape(a.shape))
        lo += a.size
    return out


def decompress(a: DF11Array, *, after=None) -> jax.Array:
    """The bfloat16 weight of logical shape `a.shape`, bit for bit. Pure jnp (jit it).
    `after`: an array the decompression must wait for (see `_zero_after`): inside a
    model, the matmul's input, so each weight is decoded just before its use."""
    return decompress_many([a], after=after)[0]


def is_df11(x) -> bool:
    return isinstance(x, DF11Array)


def decompress_tree(tree, *, after=None):
    """`tree` with every `DF11Array` in it decompressed (all in one `decompress_many`);
    a tree without one comes back as it is."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_df11)
    where = [i for i, x in enumerate(leaves) if is_df11(x)]
    if not where:
        return tree
    for i, w in zip(where, decompress_many([leaves[i] for i in where], after=after)):
        leaves[i] = w
    return jax.tree.unflatten(treedef, leaves)


def _blocks_per_row(a: DF11Array, row: int) -> int:
    """Most blocks a run of `row` consecutive elements can touch: a block (but the last)
    holds at least `min_block` codes, or when that is unknown (bits per block - 32) /
    max_len."""
    least = a.min_block or (THREADS_PER_BLOCK * THREAD_BITS - 32) // a.max_len
    return min(a.n_blocks, 1 + -(-(row - 1) // least))


# ---- runs of rows: embedding lookups, and big tensors a slice at a time --------------------
# A tensor of more values than this is never decoded whole: its matmul and its column lookup
# go through it SLICE_VALUES (at most) at a time. A transformer block of the real models
# holds 3-15M weights; their tied LM heads 28M (SmolLM2) and 136M (Qwen2.5-0.5B), which
# decoded whole would be the largest thing a decode step holds.
SLICE_VALUES = 1 << 22


def slice_rows(a: DF11Array) -> int | None:
    """Rows per slice for a tensor decoded in slices (the largest divisor of its first axis
    whose rows hold at most SLICE_VALUES values; at least one row), None for one decoded
    whole (at most SLICE_VALUES values, or contracting more than one axis)."""
    rows, row = a.shape[0], math.prod(a.shape[1:])
    if a.size <= SLICE_VALUES or a.n_in != 1:
        return None
    return max([d for d in range(1, rows + 1) if rows % d == 0 and d * row <= SLICE_VALUES] or [1])


def take_slice(a: DF11Array, start, rows: int) -> jax.Array:
    """W[start:start + rows] -> bf16[rows, *shape[1:]] (`start` may be traced), decoding only
    the blocks that hold those elements, each once: their lanes decode as in `decompress`,
    and the runs are placed relative to the slice's first element, with a margin of one
    block's most codes for the runs that begin before it."""
    validate(a)
    row = math.prod(a.shape[1:])
    n = rows * row
    first = jnp.asarray(start, jnp.int32) * row
    pos = jnp.asarray(a.block_pos).astype(jnp.int32)
    nb = _blocks_per_row(a, n)
    blocks = jnp.searchsorted(pos, first, side="right").astype(jnp.int32) - 1 + jnp.arange(nb)
    t = (blocks[:, None] * THREADS_PER_BLOCK + jnp.arange(THREADS_PER_BLOCK, dtype=jnp.int32)).reshape(-1)
    syms, count = _decode(_lanes(stream_words(a.stream), a.gaps, t, n_bits=a.n_bits), _flat_luts([a]),
                          a.max_count, -(-a.max_len // 8))
    margin = THREADS_PER_BLOCK * THREAD_BITS  # a block holds at most this many codes
    # blocks past the last (idle lanes) start at n, after every real one: the offsets stay
    # sorted, as `_place`'s scatter is told they are
    base = jnp.where(blocks < a.n_blocks, pos[jnp.minimum(blocks, a.n_blocks - 1)], a.size)
    offsets = _offsets(count, base) - first + margin
    exponent = place_exponents(syms, offsets, margin + n)[margin:]
    sm = jax.lax.dynamic_slice_in_dim(jnp.asarray(a.sign_mantissa), first, n)
    return assemble_bf16(exponent, sm).reshape(rows, *a.shape[1:])


def take_rows(a: DF11Array, idx) -> jax.Array:
    """W[idx] along the first axis -> bf16[*idx.shape, *shape[1:]], decoding only the
    blocks that hold those rows (an embedding lookup): `take_slice` of one row, for each."""
    validate(a)
    idx = jnp.asarray(idx, jnp.int32)
    rows = jax.vmap(lambda r: take_slice(a, r, 1))(idx.reshape(-1))
    return rows.reshape(*idx.shape, *a.shape[1:])


def matmul_sliced(x, a: DF11Array, matmul) -> jax.Array:
    """x[..., K] @ W -> f32[..., *shape[1:]] for W = `a` [K, ...], decoding `slice_rows(a)`
    rows of W at a time: sum over slices of x[..., rows] @ W[rows] (`matmul(x2, w)` the
    float32-accumulating product). The sum runs over slices in order, so the result
    differs from one whole product by float32 rounding only."""
    rows = slice_rows(a) or a.shape[0]
    k, out = a.shape[0], a.shape[1:]
    x2 = x.reshape(-1, k)

    def one(c, acc):
        w = take_slice(a, c * rows, rows).reshape(rows, -1)
        xs = jax.lax.dynamic_slice_in_dim(x2, c * rows, rows, axis=1)
        return acc + matmul(xs, w).astype(jnp.float32)

    acc = jax.lax.fori_loop(0, k // rows, one, jnp.zeros((x2.shape[0], math.prod(out)), jnp.float32))
    return acc.reshape(*x.shape[:-1], *out)


def take_columns(a: DF11Array, idx) -> jax.Array:
    """W[:, idx] with the columns' axis last -> bf16[*idx.shape, K] for a sliced 2-D `a`
    [K, N] (a tied LM head read as the embedding), `slice_rows(a)` rows decoded at a time.
    The columns are gathered as uint16 bits (XLA:CPU would widen a bf16 slice to f32)."""
    validate(a)
    idx = jnp.asarray(idx, jnp.int32)
    rows, k, flat = slice_rows(a) or a.shape[0], a.shape[0], idx.reshape(-1)

    def one(c, out):
        w = take_slice(a, c * rows, rows)  # [rows, N]
        bits = jnp.take(jax.lax.bitcast_convert_type(w, jnp.uint16), flat, axis=1)
        return jax.lax.dynamic_update_slice_in_dim(out, bits, c * rows, axis=0)

    out = jax.lax.fori_loop(0, k // rows, one, jnp.zeros((k, flat.shape[0]), jnp.uint16))
    return jax.lax.bitcast_convert_type(out.T, jnp.bfloat16).reshape(*idx.shape, k)


# ---- whole models -----------------------------------------------------------------------
def compressible(spec) -> bool:
    """A declared parameter DFloat11 compresses: a matmul weight (declared with `n_in`) or
    an embedding table (first axis `vocab`)."""
    return spec is not None and (spec.n_in is not None or spec.axes[:1] == ("vocab",))


def compress_params(params, decl, *, progress: Callable[[int, int], None] | None = None):
    """`params -> params`: every matmul weight and embedding table (by the declaration
    `decl`) becomes a `DF11Array` (of jax arrays) of its bfloat16 value; norms and biases
    become bfloat16 arrays. `DF11Array` leaves are kept; quantised (`QArray`) weights are
    refused. `progress(done, total)` is called after each tensor."""
    from jaxdec.pytree import is_spec
    from jaxdec.formats.qarray import QArray

    is_leaf = lambda x: x is None or is_spec(x) or isinstance(x, (DF11Array, QArray))
    specs, treedef = jax.tree.flatten(decl, is_leaf=is_leaf)
    leaves = treedef.flatten_up_to(params)
    out = []
    for i, (spec, w) in enumerate(zip(specs, leaves)):
        if not (w is None or isinstance(w, DF11Array) or hasattr(w, "astype")):
            raise JaxdecError(f"DFloat11 compresses float weights, not {type(w).__name__} "
                              "(a quantised model cannot be compressed losslessly)")
        if w is None or isinstance(w, DF11Array):
            out.append(w)
        elif compressible(spec):
            a = compress(np.asarray(jnp.asarray(w, jnp.bfloat16)), n_in=spec.n_in or 1)
            out.append(jax.tree.map(jnp.asarray, a))
        else:
            out.append(jnp.asarray(w, jnp.bfloat16))
        if progress is not None:
            progress(i + 1, len(leaves))
    return jax.tree.unflatten(treedef, out)


def pairs(original, compressed) -> list[tuple[Any, DF11Array]]:
    """(bfloat16 weight, its DF11Array) for every DF11Array of `compressed`, the weights
    taken from `original` (the same tree, before `compress_params`)."""
    leaves, treedef = jax.tree.flatten(compressed, is_leaf=is_df11)
    return [(w, a) for w, a in zip(treedef.flatten_up_to(original), leaves) if is_df11(a)]


# ---- checkpoint layout ------------------------------------------------------------------
def layout(a: DF11Array) -> dict:
    """The static layout of `a` as JSON (what a restore needs to rebuild it), with a
    CRC-32 of its data so that a damaged file is refused."""
    return {"format": "dfloat11", "shape": list(a.shape), "n_in": a.n_in, "n_bits": a.n_bits,
            "max_len": a.max_len, "max_count": a.max_count, "min_block": a.min_block,
            "n_luts": int(a.luts.shape[0]),
            "crc32": checksum(a)}


def checksum(a: DF11Array) -> int:
    crc = 0
    for x in jax.tree.leaves(a):
        crc = zlib.crc32(np.ascontiguousarray(np.asarray(x)).view(np.uint8).reshape(-1), crc)
    return crc


def abstract(entry: dict, shape: tuple[int, ...] | None = None) -> DF11Array:
    """A `DF11Array` of ShapeDtypeStructs for a `layout` entry (orbax restore), checked
    against the declared `shape` when given."""
    try:
        logical, n_bits = tuple(int(d) for d in entry["shape"]), int(entry["n_bits"])
        t = -(-n_bits // THREAD_BITS)
        sds = jax.ShapeDtypeStruct
        a = DF11Array(stream=sds((BYTES_PER_THREAD * t + LOOKAHEAD_BYTES,), jnp.uint8),
                      sign_mantissa=sds((math.prod(logical),), jnp.uint8),
                      gaps=sds((-(-GAP_BITS * t // 8) + 1,), jnp.uint8),
                      block_pos=sds((-(-t // THREADS_PER_BLOCK),), jnp.uint32),
                      luts=sds((int(entry["n_luts"]), 256), jnp.uint16), shape=logical,
                      n_in=int(entry["n_in"]), n_bits=n_bits, max_len=int(entry["max_len"]),
                      max_count=int(entry["max_count"]), min_block=int(entry.get("min_block", 0)))
    except (KeyError, TypeError, ValueError) as e:
        raise JaxdecError(f"malformed DFloat11 layout entry ({e.__class__.__name__}: {e})") from None
    if shape is not None and logical != tuple(shape):
        raise JaxdecError(f"DFloat11 layout says shape {logical}, the model declares {tuple(shape)}")
    return validate(a)


def check_restored(a: DF11Array, entry: dict, where: str) -> DF11Array:
    """A restored `a` against its `layout` entry: the checksum, then `check_data`; a
    one-line `JaxdecError` naming `where` otherwise."""
    if checksum(a) != entry.get("crc32"):
        raise JaxdecError(f"{where}: DFloat11 data fails its checksum (damaged checkpoint)")
    try:
        return check_data(a)
    except JaxdecError as e:
        raise JaxdecError(f"{where}: {e}") from None


def check_restored_params(params, layout: dict[str, dict], where: str):
    """`check_restored` on every `DF11Array` of restored `params` (entries of `layout` by
    key path, as `jaxdec.formats.convert.describe` wrote them). Returns `params`."""
    found = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_df11)[0]
    for path, a in found:
        if is_df11(a):
            key = jax.tree_util.keystr(path)
            check_restored(a, layout.get(key, {}), f"{where}: {key}")
    return params


# ---- measuring --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Stats:
    """Sizes and exponent statistics of one or many compressed tensors."""

    n: int                 # weights
    bf16_bytes: int        # 2 n
    df11_bytes: int        # every stored byte (stream, sign+mantissa, gaps, positions, tables)
    code_bits: int         # Huffman code bits (the stream without padding)
    entropy_bits: float    # empirical Shannon entropy of the exponents, bits per weight

    @property
    def fraction(self) -> float:
        return self.df11_bytes / self.bf16_bytes

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.df11_bytes / self.n


def exponent_counts(w) -> np.ndarray:
    """i64[256] how often each exponent occurs in the bfloat16 array `w`."""
    bits = np.asarray(w).view(np.uint16).reshape(-1)
    return np.bincount((bits >> 7) & 0xFF, minlength=256).astype(np.int64)


def stats(pairs) -> Stats:
    """`Stats` over (bf16 array, its DF11Array) pairs; the entropy is of all their
    exponents together."""
    freq, n, nbytes, code_bits = np.zeros(256, np.int64), 0, 0, 0
    for w, a in pairs:
        freq += exponent_counts(w)
        n, nbytes, code_bits = n + a.size, nbytes + a.nbytes, code_bits + a.n_bits
    return Stats(n=n, bf16_bytes=2 * n, df11_bytes=nbytes, code_bits=code_bits,
                 entropy_bits=entropy_bits(freq))
