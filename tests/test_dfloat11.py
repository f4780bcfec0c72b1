"""DFloat11 (`jaxdec.formats.dfloat11`): bit-exact round trips, the stream layout against an
independent bit-string encoder, the code against entropy and Kraft, every tensor of both
real models, identical tokens, the checkpoint and CLI path, and damaged files."""

from __future__ import annotations

import dataclasses
import heapq
import os
import pathlib
import shutil
import subprocess
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdec
from conftest import REAL_MODELS, assert_one_line_error, jax_model
from jaxdec import api, decode
from jaxdec.errors import JaxdecError
from jaxdec.models import transformer
from jaxdec.pytree import init_params
from jaxdec.formats import dfloat11 as df
from jaxdec.sampling import Greedy

decompress = jax.jit(df.decompress)
decompress_many = jax.jit(df.decompress_many)
take_rows = jax.jit(df.take_rows)


def u16(x) -> np.ndarray:
    return np.asarray(x).view(np.uint16)


def from_bits(bits) -> np.ndarray:
    return np.asarray(bits, np.uint16).view(jnp.bfloat16)


def sample(kind: str, shape, seed: int) -> np.ndarray:
    """Fresh random bfloat16 weights of one of several distributions."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if kind == "gaussian":
        x = rng.standard_normal(n) * 0.02
    elif kind == "wide":  # exponents over most of the range, zeros and infinities included
        x = rng.choice([-1.0, 1.0], n) * np.exp(np.clip(rng.standard_normal(n) * 25, -200, 88))
    elif kind == "all_bits":  # every bit pattern: NaNs, infinities, subnormals
        return from_bits(rng.integers(0, 1 << 16, n)).reshape(shape)
    elif kind == "constant":
        x = np.full(n, rng.standard_normal())
    elif kind == "two_values":  # (two exponents)
        x = rng.choice([rng.uniform(1, 2), -rng.uniform(8, 16)], n)
    else:
        raise ValueError(kind)
    return x.astype(np.float32).astype(jnp.bfloat16).reshape(shape)


def assert_round_trip(w, a=None):
    a = df.check_data(a or df.compress(w))
    np.testing.assert_array_equal(u16(decompress(a)), u16(w))
    return a


KINDS = ["gaussian", "wide", "all_bits", "constant", "two_values"]
SHAPES = [(1,), (7,), (513,), (333, 77), (700, 300), (3, 4, 5)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_is_bit_exact(kind, shape):
    w = sample(kind, shape, seed=zlib.crc32(repr((kind, shape)).encode()))
    a = assert_round_trip(w)
    assert a.shape == shape and a.size == w.size
    if kind == "all_bits" and w.size > 100_000:
        assert np.all(df.exponent_counts(w) > 0), "all 256 exponents should be present"
    if kind == "constant":
        assert a.max_len == 1 and a.n_bits == w.size


def test_sizes_around_threads_and_blocks():
    """Element counts that end a thread or a block exactly, or one code past it."""
    rng = np.random.default_rng(1)
    ws = []
    for n in [8, 64, 4095, 4096, 4097, 12_000, 12_288, 32_768, 40_001]:
        ws.append(sample("gaussian", (n,), int(rng.integers(1 << 30))))
        ws.append(np.full(n, 1.5, np.float32).astype(jnp.bfloat16))  # 1 bit a code: n bits
    arrays = [df.check_data(df.compress(w)) for w in ws]
    for w, out in zip(ws, decompress_many(arrays)):
        np.testing.assert_array_equal(u16(out), u16(w))


def test_many_arrays_in_one_decode():
    ws = [sample(k, s, i) for i, (k, s) in enumerate(
        [("gaussian", (576, 192)), ("all_bits", (64, 3, 7)), ("constant", (5,)), ("wide", (900, 31))])]
    outs = decompress_many([df.compress(w) for w in ws])
    for w, out in zip(ws, outs):
        np.testing.assert_array_equal(u16(out), u16(w))


@pytest.mark.parametrize("kind", ["gaussian", "all_bits"])
def test_take_rows(kind):
    w = sample(kind, (3001, 40), seed=7)
    a = df.compress(w)
    idx = np.concatenate([[0, 3000, 1500], np.random.default_rng(8).integers(0, 3001, 29)]).reshape(4, 8)
    np.testing.assert_array_equal(u16(take_rows(a, idx)), u16(w[idx]))
    wide = sample(kind, (7, 20_000), seed=9)  # rows spanning several blocks
    np.testing.assert_array_equal(u16(take_rows(df.compress(wide), np.array([6, 0, 3]))),
                                  u16(wide[[6, 0, 3]]))


def test_big_tensors_are_used_a_slice_at_a_time(monkeypatch):
    """Over SLICE_VALUES a tensor is decoded a slice of rows at a time: its matmul equals the
    float64 product to float32 rounding, its column lookup (a tied head read as the
    embedding) is bit-exact, and a small tensor is not sliced."""
    from jaxdec import layers

    monkeypatch.setattr(df, "SLICE_VALUES", 1 << 16)
    rng = np.random.default_rng()
    w = sample("gaussian", (96, 5003), seed=int(rng.integers(1 << 30)))
    a = df.compress(w)
    assert df.slice_rows(a) == 12 and df.slice_rows(df.compress(w[:8, :4000])) is None
    x = rng.standard_normal((2, 3, 96)).astype(np.float32)
    y = jax.jit(lambda x, a: layers.linear(x, a, dtype=jnp.float32))(x, a)
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    idx = rng.integers(0, 5003, (2, 7))
    got = jax.jit(df.take_columns)(a, idx)
    np.testing.assert_array_equal(u16(got), u16(np.moveaxis(w[:, idx], 0, -1)))


# ---- the layout, against an independent bit-string encoder ------------------------------
def reference_layout(w, lengths, codes):
    """(stream bytes, gaps, block positions, n_bits) by the docstring, built from Python
    strings of '0'/'1' one code at a time."""
    e = (u16(w).reshape(-1) >> 7) & 0xFF
    bits = "".join(format(int(codes[s]), f"0{int(lengths[s])}b") for s in e)
    starts = np.cumsum([0] + [int(lengths[s]) for s in e])[:-1]
    n_bits, t = len(bits), -(-len(bits) // 64)
    stream = int(bits.ljust(64 * t + 32, "0"), 2).to_bytes(8 * t + 4, "big")
    first = np.searchsorted(starts, 64 * np.arange(t))
    gaps = np.where(first < len(starts), starts[np.minimum(first, len(starts) - 1)], n_bits) - 64 * np.arange(t)
    return np.frombuffer(stream, np.uint8), gaps, first[::512], n_bits


def unpack_gaps(packed, t):
    bits = [(int(packed[k // 8]) >> (k % 8)) & 1 for k in range(5 * t)]
    return np.array([sum(bits[5 * i + j] << j for j in range(5)) for i in range(t)])


@pytest.mark.parametrize("kind,n", [("gaussian", 3000), ("wide", 15_000), ("all_bits", 9000)])
def test_layout_matches_reference_encoder(kind, n):
    w = sample(kind, (n,), seed=n)
    a = df.compress(w)
    lengths = df.code_lengths(df.exponent_counts(w))
    stream, gaps, block_pos, n_bits = reference_layout(w, lengths, df.canonical_codes(lengths))
    assert a.n_bits == n_bits
    np.testing.assert_array_equal(np.asarray(a.stream), stream)
    np.testing.assert_array_equal(unpack_gaps(np.asarray(a.gaps), a.n_threads), gaps)
    np.testing.assert_array_equal(np.asarray(a.block_pos), block_pos)
    sm = u16(w) >> 8 & 0x80 | u16(w) & 0x7F
    np.testing.assert_array_equal(np.asarray(a.sign_mantissa), sm)
    assert 0 <= gaps.min() and gaps.max() < 32


# ---- the code ---------------------------------------------------------------------------
def huffman_cost(freq) -> int:
    """Sum of f * length of an optimal prefix code: the sum of all Huffman merges."""
    heap = [int(f) for f in freq if f > 0]
    heapq.heapify(heap)
    cost = 0
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        cost += a + b
        heapq.heappush(heap, a + b)
    return cost


def numpy_entropy(w) -> float:
    _, counts = np.unique((u16(w) >> 7) & 0xFF, return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum())


def check_code(freq, lengths, max_len=32):
    """Kraft, prefix-freeness of the canonical code, and the length limit."""
    present = freq > 0
    assert np.all((lengths > 0) == present) and lengths.max() <= max_len
    kraft = sum(2.0 ** -int(l) for l in lengths[present])
    assert kraft <= 1 + 1e-12 and (present.sum() < 2 or kraft == 1.0)
    codes = df.canonical_codes(lengths)
    words = sorted(format(int(codes[s]), f"0{int(lengths[s])}b") for s in np.flatnonzero(present))
    assert not any(b.startswith(a) for a, b in zip(words, words[1:])), "not prefix-free"


@pytest.mark.parametrize("kind", ["gaussian", "wide", "all_bits", "two_values"])
def test_code_is_optimal_and_near_entropy(kind):
    w = sample(kind, (50_000,), seed=3)
    freq = df.exponent_counts(w)
    lengths = df.code_lengths(freq)
    check_code(freq, lengths)
    assert int(freq @ lengths.astype(np.int64)) == huffman_cost(freq)
    h = numpy_entropy(w)
    assert df.entropy_bits(freq) == pytest.approx(h, abs=1e-12)
    mean = float(freq @ lengths) / freq.sum()
    assert h <= mean < h + 1


FIB = [1, 1]
while len(FIB) < 40:
    FIB.append(FIB[-1] + FIB[-2])


@pytest.mark.parametrize("n_symbols,max_len", [(40, 32), (20, 8), (12, 4)])
def test_length_limit(n_symbols, max_len):
    """Fibonacci counts make the Huffman tree as deep as there are symbols."""
    freq = np.zeros(256, np.int64)
    freq[100: 100 + n_symbols] = FIB[:n_symbols]
    assert df._huffman_lengths(freq).max() == n_symbols - 1 > max_len
    lengths = df.code_lengths(freq, max_len)
    check_code(freq, lengths, max_len)
    with pytest.raises(JaxdecError, match="no Huffman code"):
        df.code_lengths(freq, 3)


def test_length_limit_round_trip():
    """34 exponents with Fibonacci counts (14.9M weights): a 33-bit Huffman code, cut to 32."""
    counts = np.array(FIB[:34])
    rng = np.random.default_rng(4)
    e = rng.permutation(np.repeat(np.arange(60, 94), counts)).astype(np.uint16)
    sm = rng.integers(0, 256, e.size).astype(np.uint16)
    w = from_bits((sm & 0x80) << 8 | e << 7 | (sm & 0x7F))
    a = assert_round_trip(w)
    assert a.max_len == 32


def test_small_length_limit_round_trip():
    w = sample("wide", (20_000,), seed=5)
    a = df.compress(w, max_len=9)
    assert a.max_len <= 9
    assert_round_trip(w, a)


# ---- validation -------------------------------------------------------------------------
def test_validate_names_the_broken_invariant():
    a = df.compress(sample("gaussian", (100, 30), seed=6))
    for change, needle in [(dict(stream=np.asarray(a.stream)[:-1]), "stream has shape"),
                           (dict(sign_mantissa=np.asarray(a.sign_mantissa, np.int8)), "dtype int8"),
                           (dict(max_len=33), "max_len"), (dict(n_in=2), "n_in"),
                           (dict(n_bits=a.size - 1), "n_bits"), (dict(shape=(100, 0)), "shape")]:
        assert_one_line_error(df.validate, dataclasses.replace(a, **change), match=needle)
    bad = np.asarray(a.luts).copy()
    bad[0, 0] = df.PTR | 99
    assert_one_line_error(df.check_data, dataclasses.replace(a, luts=bad), match="points to no table")
    assert_one_line_error(df.compress, np.zeros((3, 3), np.float32), match="bfloat16")


# ---- models -----------------------------------------------------------------------------
def tiny(tied: bool, seed: int = 0):
    """A tiny random bf16 model (SmolLM2's tokenizer and vocabulary)."""
    base = jax_model("smollm2", "bfloat16")
    cfg = dataclasses.replace(base.cfg, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2,
                              head_dim=16, d_ff=128, tie_embeddings=tied, qkv_bias=not tied)
    params = init_params(transformer.declare(cfg), jax.random.key(seed), jnp.bfloat16)
    return dataclasses.replace(base, cfg=cfg, params=params, source="tiny")


def compressed(model):
    return dataclasses.replace(model, params=df.compress_params(
        model.params, transformer.declare(model.cfg)))


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_model_identical(tied):
    model = tiny(tied)
    small = compressed(model)
    assert small.weights == "dfloat11"
    assert isinstance(small.params.lm_head, df.DF11Array)
    assert isinstance(small.params.embed, type(None) if tied else df.DF11Array)
    assert not isinstance(small.params.layers[0].mixer_norm, df.DF11Array)
    rows = [[1, 504, 3458, 282, 4290, 314], [9707, 28, 1288]]
    np.testing.assert_array_equal(api.score(small, rows), api.score(model, rows))
    if tied:  # (the untied model generates through the CLI below)
        a = jaxdec.generate(model, ["Hello"], max_new_tokens=6)
        assert jaxdec.generate(small, ["Hello"], max_new_tokens=6).token_ids == a.token_ids


@pytest.mark.parametrize("vocab", [2048, 16384])
def test_generation_holds_one_layer(vocab, monkeypatch):
    """XLA neither hoists the decoding (or any share of it) out of the generation loop nor
    decodes layers ahead of their use: the temporaries of a whole generation (prefill and
    decode loop, one program) stay near one layer's, far below the decompressed model.
    With the larger vocabulary the tied head is ~4 layers and, over SLICE_VALUES, is read a
    slice at a time (as the real models' heads are)."""
    monkeypatch.setattr(df, "SLICE_VALUES", 1 << 19)
    model = tiny(True)
    cfg = dataclasses.replace(model.cfg, n_layers=8, d_model=256, n_heads=4, n_kv_heads=2,
                              head_dim=64, d_ff=1024, vocab_size=vocab)
    bf16 = init_params(transformer.declare(cfg), jax.random.key(1), jnp.bfloat16)
    params = df.compress_params(bf16, transformer.declare(cfg))
    decompressed = 2 * sum(a.size for a in jax.tree.leaves(params, is_leaf=df.is_df11) if df.is_df11(a))
    layer = 2 * sum(a.size for a in jax.tree.leaves(params.layers[0], is_leaf=df.is_df11) if df.is_df11(a))
    assert (df.slice_rows(params.lm_head) is not None) == (vocab > 2048)
    tokens, lens = api.pad_rows([[1, 2, 3, 4]], 32)

    def temp(p):  # the temporaries of one generation program
        small = dataclasses.replace(model, cfg=cfg, params=p)
        compiled = decode.generate_tokens.lower(
            p, api.init_cache(small, 1, 64), tokens, lens, jax.random.key(0),
            np.array([8], np.int32), sampler=Greedy(), cfg=cfg, max_new_tokens=8,
            stop_ids=(0,)).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    # over the bf16 model's own temporaries (logits, activations), at most ~1.5 layers
    got, base = temp(params), temp(bf16)
    assert got < base + 3 * layer < base + decompressed / 2, (got, base, layer, decompressed)


@pytest.fixture(scope="module")
def smollm2():
    model = jax_model("smollm2", "bfloat16")
    return model, compressed(model)


def histogram_entropy(ws) -> float:
    """Exponent entropy of bf16 arrays, by np.histogram (independent of the library)."""
    hist = sum(np.histogram((u16(w).reshape(-1) >> 7) & 0xFF, bins=256, range=(0, 256))[0] for w in ws)
    p = hist[hist > 0] / hist.sum()
    return float(-(p * np.log2(p)).sum())


def check_tensors(pairs, budget: int = 160 << 20):
    """Every DF11Array decodes to its weight bit for bit (decoded `budget` weights at a
    time); each tensor's code meets Kraft and is within a bit of its entropy."""
    group, size = [], 0
    for k, (w, a) in enumerate(pairs):
        group.append((w, a))
        size += a.size
        if size > budget or k == len(pairs) - 1:
            for (w, a), out in zip(group, decompress_many([a for _, a in group])):
                np.testing.assert_array_equal(u16(out), u16(w))
            group, size = [], 0
    for w, a in pairs:
        freq = df.exponent_counts(w)
        lengths = df.code_lengths(freq)
        check_code(freq, lengths)
        assert a.n_bits == int(freq @ lengths.astype(np.int64))
        h = df.entropy_bits(freq)
        assert h <= a.n_bits / a.size < h + 1


def test_smollm2_every_tensor_bit_exact(smollm2):
    model, small = smollm2
    pairs = df.pairs(model.params, small.params)
    decl = transformer.declare(model.cfg)
    assert len(pairs) == sum(map(df.compressible, jax.tree.leaves(decl))) == 30 * 7 + 1
    check_tensors(pairs)
    s = df.stats(pairs)
    assert s.n == sum(w.size for w, _ in pairs) and s.bf16_bytes == 2 * s.n
    assert s.entropy_bits == pytest.approx(histogram_entropy([w for w, _ in pairs]), abs=1e-9)
    assert 2.0 < s.entropy_bits < 3.5  # the paper: ~2.6 bits
    assert 0.6 < s.fraction < 0.75 and s.bits_per_weight == pytest.approx(16 * s.fraction)
    assert s.df11_bytes == sum(a.nbytes for _, a in pairs)


QWEN = "qwen2.5-coder-0.5b"


def qwen_pairs(every: bool):
    model = jax_model(QWEN, "bfloat16")
    decl = transformer.declare(model.cfg)
    if every:
        return df.pairs(model.params, df.compress_params(model.params, decl))
    picked = [model.params.lm_head, *jax.tree.leaves(model.params.layers[0]),
              *jax.tree.leaves(model.params.layers[-1])]
    specs = [decl.lm_head, *jax.tree.leaves(decl.layers[0]), *jax.tree.leaves(decl.layers[-1])]
    return [(w, df.compress(np.asarray(w), n_in=spec.n_in)) for w, spec in zip(picked, specs)
            if df.compressible(spec)]


def test_qwen_tensors_bit_exact():
    """The LM head (136M weights, the largest tensor) and the first and last layers; every
    tensor is checked by the slow test below."""
    pairs = qwen_pairs(every=False)
    assert len(pairs) == 15 and pairs[0][1].size == 896 * 151936
    check_tensors(pairs)
    s = df.stats(pairs)
    assert 0.6 < s.fraction < 0.75
    assert s.entropy_bits == pytest.approx(histogram_entropy([w for w, _ in pairs]), abs=1e-9)


@pytest.mark.slow
def test_qwen_every_tensor_bit_exact():
    pairs = qwen_pairs(every=True)
    assert len(pairs) == 24 * 7 + 2
    check_tensors(pairs, budget=256 << 20)
    s = df.stats(pairs)
    assert 0.6 < s.fraction < 0.75
    assert s.entropy_bits == pytest.approx(histogram_entropy([w for w, _ in pairs]), abs=1e-9)


def test_smollm2_identical_tokens(smollm2):
    """SmolLM2's tied head (28M weights, over SLICE_VALUES) is read a slice of rows at a time:
    every slice and, inside the model's program, the embedding rows it gives are bit-exact;
    the greedy continuations, teacher-forced, pick the bf16 model's tokens. (Logits are not
    bit-identical: the head sums its products slice by slice, and XLA:CPU keeps bf16
    intermediates in f32 or not depending on the program around them,
    `--xla_allow_excess_precision`, so the two programs round differently.)"""
    model, small = smollm2
    rows_per = df.slice_rows(small.params.lm_head)
    assert rows_per is not None
    head = np.asarray(model.params.lm_head)
    take = jax.jit(df.take_slice, static_argnums=2)
    for start in range(0, head.shape[0], rows_per):
        np.testing.assert_array_equal(u16(take(small.params.lm_head, start, rows_per)),
                                      u16(head[start:start + rows_per]))
    out = jaxdec.generate(model, ["The capital of France is", "def fib(n):"], max_new_tokens=8)
    rows = [p + t for p, t in zip(out.prompt_ids, out.token_ids)]
    tokens, _ = api.pad_rows(rows, 16)
    pos = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    both = jax.jit(lambda p: (transformer.embed(p, tokens), transformer.hidden(p, tokens, pos, None, model.cfg)[0]))
    np.testing.assert_array_equal(u16(both(small.params)[0]), u16(both(model.params)[0]))
    logits = api.score(small, rows)
    for row, p, t in zip(logits, out.prompt_ids, out.token_ids):
        assert list(row[len(p) - 1: len(p) - 1 + len(t)].argmax(-1)) == t


@pytest.mark.slow
@pytest.mark.parametrize("name", REAL_MODELS)
def test_real_model_identical_generation(name):
    """Generated tokens (prefill, then the decode loop) equal the bf16 model's."""
    model = jax_model(name, "bfloat16")
    prompts = ["The capital of France is", "def fib(n):", "Once upon a time"]
    a = jaxdec.generate(model, prompts, max_new_tokens=12)
    b = jaxdec.generate(compressed(model), prompts, max_new_tokens=12)
    assert a.token_ids == b.token_ids


# ---- checkpoint and CLI -----------------------------------------------------------------
def run(*args):
    env = dict(os.environ, JAXDEC_XLA_CACHE=os.environ.get("JAXDEC_XLA_CACHE", ""))
    return subprocess.run([sys.executable, "-m", "jaxdec", *args], capture_output=True,
                          text=True, timeout=600, env=env)


def assert_cli_error(r, *needles):
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxdec: error:"), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def largest_file(path: pathlib.Path) -> pathlib.Path:
    return max((p for p in path.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def test_cli_round_trip_and_damaged_files(tmp_path):
    model = tiny(False, seed=2)
    src = jaxdec.save(model, tmp_path / "tiny")
    out = tmp_path / "tiny-df11"
    r = run("compress-lossless", str(src), str(out))
    assert r.returncode == 0, r.stderr
    assert "bfloat16" in r.stdout and "%" in r.stdout
    restored = jaxdec.load(out, dtype="bfloat16")
    assert restored.weights == "dfloat11"
    for w, a in df.pairs(model.params, restored.params):
        np.testing.assert_array_equal(u16(decompress(a)), u16(w))
    args = ("generate", "--dtype", "bfloat16", "-p", "Hello there", "-n", "6", "--no-stream")
    plain, small = run(*args, "--model", str(src)), run(*args, "--model", str(out))
    assert plain.returncode == 0 == small.returncode, small.stderr
    assert plain.stdout == small.stdout
    info = run("info", str(out))
    assert info.returncode == 0 and "dfloat11 weights" in info.stdout, info.stderr
    bits = float(info.stdout.split(" bits a parameter")[0].split()[-1])
    assert 8 < bits < 16, info.stdout  # ~11 bits a weight, and the float norms

    for damage in ("flip", "truncate"):
        bad = tmp_path / f"bad-{damage}"
        shutil.copytree(out, bad)
        f = largest_file(bad / "params")
        data = bytearray(f.read_bytes())
        if damage == "flip":
            for i in range(len(data) // 3, len(data), max(1, len(data) // 5)):
                data[i] ^= 0xA5
        else:
            data = data[: len(data) // 2]
        f.write_bytes(bytes(data))
        assert_one_line_error(jaxdec.load, bad, match=str(bad))
    assert_cli_error(run(*args, "--model", str(tmp_path / "bad-flip")), "checksum")

    before = sorted(p.name for p in out.rglob("*"))
    assert_cli_error(run("compress-lossless", str(tmp_path / "missing"), str(out)), "missing")
    assert sorted(p.name for p in out.rglob("*")) == before
    assert [p.name for p in tmp_path.iterdir() if "partial" in p.name] == []
