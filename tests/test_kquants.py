"""llama.cpp block quantisation (jaxdec.quant.kquants), its recipes and the GGUF writer.

References: ggml's own reference quantisers (`ggml_quantize_chunk` without an importance
matrix, from the libggml-base that llama-cpp-python ships), compared byte for byte on
fresh random rows of several distributions and on real weight rows of both models; digests
of ggml's blocks for fixed inputs (so the equality is checked without llama.cpp too);
gguf's own Q8_0 quantiser; ggml's dequantisation (gguf's must equal it, so jaxdec runs the
weights llama.cpp runs); llama.cpp's `llama_model_quantize` for whole files (types, bytes,
metadata); the Qwen GGUF's own Q4_K_M types; and llama.cpp running the files we write,
greedy tokens against jaxdec's. llama.cpp runs in a child process: a native crash fails
one test with its signal instead of ending the run.
"""

from __future__ import annotations

import ctypes
import hashlib
import multiprocessing
import pathlib
import signal

import gguf
import numpy as np
import pytest

import jaxdec
from jaxdec.checkpoint import registry
from jaxdec.checkpoint.gguf_reader import read_gguf_header
from jaxdec.quant import gguf_writer, kquants

from conftest import assert_one_line_error

OURS = ["Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K"]
FALLBACKS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1"]
LLAMA_CPP_REASON = "llama-cpp-python (`make bench`) ships ggml's reference quantisers and llama.cpp"


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:
        pytest.fail(f"{LLAMA_CPP_REASON}: {e}")
    return llama_cpp


def _model_path(name: str) -> pathlib.Path:
    return registry.resolve(name)


@pytest.fixture(scope="module")
def ggml():
    """ggml_quantize_chunk(type, f32[rows, n]) -> u8[rows, bytes per row], ggml's reference."""
    lc = _llama_cpp()
    lib_dir = pathlib.Path(lc.__file__).parent / "lib"
    found = sorted(lib_dir.glob("libggml-base.*")) or pytest.fail(f"no libggml-base in {lib_dir}")
    lib = ctypes.CDLL(str(found[0]))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]

    def quantize(w: np.ndarray, qtype: str) -> np.ndarray:
        q = gguf.GGMLQuantizationType[qtype]
        w = np.ascontiguousarray(w, np.float32)
        block, size = gguf.GGML_QUANT_SIZES[q]
        out = np.zeros((w.shape[0], w.shape[1] // block * size), np.uint8)
        n = lib.ggml_quantize_chunk(int(q), w.ctypes.data, out.ctypes.data, 0, w.shape[0], w.shape[1], None)
        assert n == out.nbytes
        return out

    quantize.lib = lib
    return quantize


@pytest.fixture(scope="module")
def ggml_to_float(ggml):
    """(u8 blocks, type, shape) -> f32[shape]: ggml's dequantisation (type traits' to_float)."""
    to_float = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)

    class Traits(ctypes.Structure):  # struct ggml_type_traits
        _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                    ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                    ("is_quantized", ctypes.c_bool), ("to_float", to_float), ("from_float_ref", ctypes.c_void_p)]

    ggml.lib.ggml_get_type_traits.restype = ctypes.POINTER(Traits)

    def dequantize(blocks: np.ndarray, qtype: str, shape) -> np.ndarray:
        traits = ggml.lib.ggml_get_type_traits(int(gguf.GGMLQuantizationType[qtype])).contents
        blocks, out = np.ascontiguousarray(blocks), np.empty(shape, np.float32)
        traits.to_float(blocks.ctypes.data, out.ctypes.data, out.size)
        return out

    return dequantize


def _assert_blocks_equal(ours: np.ndarray, ref: np.ndarray, what: str) -> None:
    bad = np.flatnonzero((ours != ref).any(axis=1))
    assert not bad.size, f"{what}: {bad.size}/{len(ours)} rows differ from ggml, first row {bad[0]}"


# ---- inputs -------------------------------------------------------------------------------------

def _random_rows(rng: np.random.Generator, n: int = 512) -> dict[str, np.ndarray]:
    g = rng.standard_normal((24, n)).astype(np.float32)
    heavy = rng.standard_t(2, (24, n)).astype(np.float32) * np.float32(0.01)
    heavy[rng.random(heavy.shape) < 0.01] *= np.float32(60)  # outliers
    zeros = np.where(rng.random((16, n)) < 0.6, np.float32(0), g[:16])
    zeros[0] = 0
    return {"gaussian": g * np.float32(0.02), "student-t + outliers": heavy,
            "all equal": np.repeat(rng.standard_normal((8, 1)).astype(np.float32), n, axis=1),
            "zeros": zeros, "positive": np.abs(g[:8]), "integers": rng.integers(-4, 4, (8, n)).astype(np.float32),
            "tiny": g[:8] * np.float32(1e-33), "huge": g[:8] * np.float32(1e7)}


def _uniform(n: int, seed: int) -> np.ndarray:
    """f32[n] in [0, 1): splitmix64 of the index, its top 24 bits (integer ops only)."""
    z = np.arange(n, dtype=np.uint64) + np.uint64(seed * 0x9E3779B97F4A7C15 % 2**64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return (z >> np.uint64(40)).astype(np.float32) * np.float32(2.0 ** -24)


def _fixed_rows(rows: int = 8, n: int = 512) -> np.ndarray:
    """f32[48, 512] made with integer and float32 arithmetic only (the same bits on every
    machine and numpy): Gaussian-like, heavy-tailed with outliers, all equal, half zeros,
    tiny, huge (float16 scales overflow)."""
    k = rows * n
    g = sum(_uniform(k, s) for s in range(4)) - np.float32(2)  # Irwin-Hall(4), centred
    heavy = g / (_uniform(k, 9) + np.float32(0.02))
    heavy[::97] *= np.float32(40)
    zeros = np.where(_uniform(k, 11) < np.float32(0.5), np.float32(0), g)
    parts = [g * np.float32(0.02), heavy * np.float32(0.01), np.full(k, np.float32(-0.37)),
             zeros, g * np.float32(1e-30), g * np.float32(1e8)]
    return np.concatenate(parts).reshape(6 * rows, n)


# sha256 (first 16 hex digits) of ggml_quantize_chunk's blocks for _fixed_rows(), computed
# with llama-cpp-python 0.3.36's libggml-base (ggml 0.25.3)
GGML_DIGESTS = {"Q8_0": "3140f6614af880d2", "Q6_K": "152921052b38a621", "Q5_K": "2ed3b5e5ef928fd5",
                "Q4_K": "f7616499bf52615b", "Q3_K": "197170ad42a36e96", "Q2_K": "5ef133c73dba6959"}


# ---- block equality -----------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", OURS)
def test_blocks_match_recorded_ggml_digests(qtype):
    """Runs without llama.cpp: our blocks for fixed inputs hash to ggml's."""
    blocks = kquants.quantize_blocks(_fixed_rows(), qtype)
    assert hashlib.sha256(blocks.tobytes()).hexdigest()[:16] == GGML_DIGESTS[qtype]


def test_q8_0_equals_gguf_quantiser():
    rng = np.random.default_rng()
    for name, w in _random_rows(rng).items():
        with np.errstate(over="ignore"):  # float16 scales of the huge rows overflow, as in ggml
            want = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
        np.testing.assert_array_equal(kquants.quantize_blocks(w, "Q8_0"), want, err_msg=name)


@pytest.mark.parametrize("qtype", OURS + FALLBACKS)
def test_blocks_equal_ggml_on_random_rows(ggml, qtype):
    seed = np.random.SeedSequence().entropy
    for name, w in _random_rows(np.random.default_rng(seed)).items():
        _assert_blocks_equal(kquants.quantize_blocks(w, qtype), ggml(w, qtype),
                             f"{qtype}, {name} rows (seed {seed})")


@pytest.mark.parametrize("model", ["smollm2", "qwen2.5-coder-0.5b"])
def test_blocks_equal_ggml_on_real_weight_rows(ggml, model):
    """Rows of the model's own matrices (dequantised from its GGUF), every type whose block
    fits the row length (SmolLM2's 576 and Qwen's 896 fit only the 32-blocks)."""
    header = read_gguf_header(_model_path(model))
    n_layer = 1 + max(int(n.split(".")[1]) for n in header.tensors if n.startswith("blk."))
    wanted = ["token_embd.weight", "output.weight", "blk.0.attn_q.weight", "blk.0.attn_v.weight",
              f"blk.{n_layer // 2}.ffn_down.weight", f"blk.{n_layer - 1}.ffn_gate.weight",
              f"blk.{n_layer - 1}.attn_k.weight"]
    checked = 0
    for name in filter(header.tensors.__contains__, wanted):
        info = header.tensors[name]
        w = kquants.read_tensor_f32(header.path, info, np.linspace(0, info.shape[0] - 1, 48).astype(int))
        for qtype in OURS + FALLBACKS:
            if w.shape[1] % kquants.block_size(qtype) == 0:
                _assert_blocks_equal(kquants.quantize_blocks(w, qtype), ggml(w, qtype), f"{name} {qtype}")
                checked += 1
    assert checked >= 30


def test_gguf_dequantisation_is_ggml_s(ggml_to_float):
    """What jaxdec runs is what llama.cpp runs: gguf's dequantisation of our blocks equals
    ggml's own (its type traits' to_float) bit for bit, for every type we write."""
    w = (np.random.default_rng().standard_t(3, (32, 1024)) * 0.03).astype(np.float32)
    for qtype in OURS + FALLBACKS:
        blocks = kquants.quantize_blocks(w, qtype)
        np.testing.assert_array_equal(kquants.dequantize_blocks(blocks, qtype).view(np.int32),
                                      ggml_to_float(blocks, qtype, w.shape).view(np.int32), err_msg=qtype)


@pytest.mark.parametrize("qtype", OURS)
def test_round_trip_error_is_about_half_a_step(qtype):
    """Per sub-block, the largest error is about half the nominal step (range / levels) and the
    RMS error about step / sqrt(12); scale search and 6-bit sub-scales move both a little."""
    size, levels, affine = {"Q8_0": (32, 127, False), "Q6_K": (16, 32, False), "Q5_K": (32, 31, True),
                            "Q4_K": (32, 15, True), "Q3_K": (16, 4, False), "Q2_K": (16, 3, True)}[qtype]
    w = np.random.default_rng().standard_normal((64, 1024)).astype(np.float32)
    back = kquants.dequantize_blocks(kquants.quantize_blocks(w, qtype), qtype)
    x, err = w.reshape(-1, size), np.abs(back - w).reshape(-1, size)
    step = ((x.max(1) - np.minimum(x.min(1), 0)) if affine else np.abs(x).max(1)) / levels
    assert 0.35 < np.median(err.max(1) / step) < 0.55
    assert 0.75 < np.median(np.sqrt(np.mean(err ** 2, axis=1)) / (step / np.sqrt(12))) < 1.1


# ---- bad input ----------------------------------------------------------------------------------

def test_bad_input_is_a_one_line_error(tmp_path):
    w = np.ones((2, 512), np.float32)
    assert_one_line_error(kquants.quantize_blocks, w, "IQ2_XXS", match="cannot quantise to IQ2_XXS")
    assert_one_line_error(kquants.quantize_blocks, w, "Q9_X", match="unknown GGML type")
    assert_one_line_error(kquants.quantize_blocks, np.ones((2, 100), np.float32), "Q4_K",
                          match="multiple of 256")
    assert_one_line_error(kquants.quantize_blocks, np.full((1, 32), np.nan, np.float32), "Q8_0",
                          match="NaN or infinite")


def test_writer_refuses_before_writing_anything(tmp_path):
    src = _model_path("smollm2")
    out = tmp_path / "out.gguf"
    out.write_bytes(b"old")
    for types, match in [({"blk.0.attn_q.weight": "Q4_K"}, "do not fit Q4_K blocks of 256"),
                         ({"blk.0.attn_q.weight": "IQ1_S"}, "cannot quantise to IQ1_S"),
                         ({"no.such.weight": "Q8_0"}, "does not have")]:
        assert_one_line_error(gguf_writer.write_gguf, src, out, types, match=match)
    assert_one_line_error(gguf_writer.write_gguf, src, tmp_path / "no" / "x.gguf", {}, match="no such directory")
    assert out.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["out.gguf"]



def test_writer_requantises_named_tensors_and_copies_the_rest(tmp_path):
    """Named tensors hold quantize_blocks of the source's values, the others the source's
    own bytes; every metadata key/value is copied, general.file_type set."""
    src = _model_path("smollm2")
    types = {"blk.0.ffn_down.weight": "Q4_K", "blk.1.ffn_down.weight": "Q6_K", "blk.2.ffn_down.weight": "Q2_K",
             "blk.3.ffn_down.weight": "Q3_K", "blk.4.ffn_down.weight": "Q5_K", "blk.5.attn_q.weight": "Q8_0",
             "blk.6.attn_v.weight": "F16", "blk.7.attn_k.weight": "Q4_1"}
    out = gguf_writer.write_gguf(src, tmp_path / "mixed.gguf", types, file_type=7)
    a, b = read_gguf_header(src), read_gguf_header(out)
    assert list(b.tensors) == list(a.tensors)
    assert b.metadata.pop("general.file_type") == 7 and a.metadata.pop("general.file_type") == 3
    assert {k: _plain(v) for k, v in b.metadata.items()} == {k: _plain(v) for k, v in a.metadata.items()}
    for name, t in b.tensors.items():
        assert t.type_name == types.get(name, a.tensors[name].type_name)
        got = np.fromfile(out, np.uint8, count=t.nbytes, offset=t.start)
        if name in types:
            want = kquants.quantize_blocks(kquants.read_tensor_f32(src, a.tensors[name]), types[name])
        else:
            want = np.fromfile(src, np.uint8, count=a.tensors[name].nbytes, offset=a.tensors[name].start)
        np.testing.assert_array_equal(got, want.reshape(-1), err_msg=name)


def test_writer_leaves_nothing_when_a_tensor_fails(tmp_path, monkeypatch):
    """A failure half-way (here the third quantised tensor) removes the temporary file and
    leaves an existing destination as it was."""
    src = _model_path("smollm2")
    out = tmp_path / "out.gguf"
    out.write_bytes(b"old")
    calls = []

    def failing(w, qtype):
        calls.append(qtype)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(w, qtype)

    real = kquants.quantize_blocks
    monkeypatch.setattr(kquants, "quantize_blocks", failing)
    with pytest.raises(KeyboardInterrupt):
        gguf_writer.write_gguf(src, out, {"blk.0.attn_q.weight": "Q8_0", "blk.0.attn_k.weight": "Q5_0",
                                          "blk.1.attn_q.weight": "Q4_0"})
    assert out.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["out.gguf"]

# ---- recipes ------------------------------------------------------------------------------------

class _T:
    def __init__(self, name, shape, qtype="F32"):
        self.name, self.shape, self.qtype = name, shape, qtype


def _llama_tensors(n_layer: int, d: int = 4096, tied: bool = False) -> list[_T]:
    out = [_T("token_embd.weight", (32000, d)), _T("output_norm.weight", (d,))]
    out += [] if tied else [_T("output.weight", (32000, d))]
    for i in range(n_layer):
        out += [_T(f"blk.{i}.{n}.weight", s) for n, s in [
            ("attn_norm", (d,)), ("attn_q", (d, d)), ("attn_k", (1024, d)), ("attn_v", (1024, d)),
            ("attn_output", (d, d)), ("ffn_norm", (d,)), ("ffn_gate", (11008, d)),
            ("ffn_up", (11008, d)), ("ffn_down", (d, 11008))]]
    return out


def test_llama_rules_on_a_32_layer_model():
    """llama-quant.cpp for a dense 32-layer llama: use_more_bits(i, 32) picks layers 0-3,
    28-31 and 6, 9, ..., 27 for Q4_K_M's Q6_K attn_v / ffn_down; Q3_K_M upgrades attn_v of
    layers 0-1 to Q5_K and ffn_down of layers 0-1 (32 / 16) to Q5_K, the rest of both and
    attn_output to Q4_K; output gets Q6_K, an untied token_embd the base type."""
    tensors = _llama_tensors(32)
    more = {0, 1, 2, 3, 28, 29, 30, 31} | set(range(6, 28, 3))
    m = kquants.llama_types(tensors, "Q4_K_M", n_layer=32)
    assert {i for i in range(32) if m[f"blk.{i}.attn_v.weight"] == "Q6_K"} == more
    assert {i for i in range(32) if m[f"blk.{i}.ffn_down.weight"] == "Q6_K"} == more
    assert m["output.weight"] == "Q6_K" and m["token_embd.weight"] == "Q4_K"
    assert m["blk.5.attn_q.weight"] == "Q4_K" and m["blk.5.attn_norm.weight"] == "F32"
    s = kquants.llama_types(tensors, "Q3_K_M", n_layer=32)
    assert [s[f"blk.{i}.attn_v.weight"] for i in (0, 1, 2, 31)] == ["Q5_K", "Q5_K", "Q4_K", "Q4_K"]
    assert [s[f"blk.{i}.ffn_down.weight"] for i in (0, 1, 2, 31)] == ["Q5_K", "Q5_K", "Q4_K", "Q4_K"]
    assert s["blk.7.attn_output.weight"] == "Q4_K" and s["blk.7.ffn_up.weight"] == "Q3_K"
    tied = kquants.llama_types(_llama_tensors(2, tied=True), "Q4_K", n_layer=2)
    assert tied["token_embd.weight"] == "Q6_K"
    odd = kquants.llama_types(_llama_tensors(2, d=4000), "Q4_K_M", n_layer=2)  # 4000 % 256 != 0
    assert odd["output.weight"] == "Q8_0" and odd["blk.0.attn_q.weight"] == "Q5_0"
    assert odd["blk.1.attn_v.weight"] == "Q8_0"  # use_more_bits(1, 2): Q6_K -> Q8_0


def test_q4_k_m_rules_reproduce_qwen_file():
    """The Qwen GGUF was made by llama.cpp as Q4_K_M (with 896-wide rows falling back to
    Q5_0 / Q8_0). That llama.cpp counted layers in string order (0, 1, 10, 11, ..., 19, 2,
    20, ...); today's counts them numerically. Renumbered that way, our rules give exactly
    the file's type for every tensor."""
    header = read_gguf_header(_model_path("qwen2.5-coder-0.5b"))
    n_layer = header.metadata["qwen2.block_count"]
    rank = {int(s): i for i, s in enumerate(sorted(str(i) for i in range(n_layer)))}

    def renamed(name):
        parts = name.split(".")
        return ".".join([parts[0], str(rank[int(parts[1])]), *parts[2:]]) if name.startswith("blk.") else name

    tensors = [_T(renamed(t.name), t.shape, t.qtype) for t in header.tensors.values()]
    types = kquants.llama_types(tensors, "Q4_K_M", n_layer=n_layer)
    assert {n: types[renamed(n)] for n in header.tensors} == {n: t.qtype.name for n, t in header.tensors.items()}


def test_dq3_recipe_is_a_greedy_knapsack():
    sizes = {"a": 100, "b": 100, "c": 1000}
    sens = {"a": {"Q3_K": 0.04, "Q4_K": 0.01, "Q6_K": 0.001},
            "b": {"Q3_K": 0.04, "Q4_K": 0.03, "Q6_K": 0.029},
            "c": {"Q3_K": 0.04, "Q4_K": 0.01, "Q6_K": 0.001}}
    bits = lambda types: kquants.bits_per_weight_of(types, sizes)
    base = {"a": "Q3_K", "b": "Q3_K", "c": "Q3_K"}
    assert kquants.dq3_recipe(sizes, sens, bits(base)) == base
    # the best gain per bit first (a to Q4_K: 0.03 over 106 bits), then b's (0.01 over 106),
    # then a to Q6_K (0.009 over 206 more bits); c's upgrades are 10x dearer
    for upgraded in ({"a": "Q4_K"}, {"a": "Q4_K", "b": "Q4_K"}, {"a": "Q6_K", "b": "Q4_K"}):
        assert kquants.dq3_recipe(sizes, sens, bits({**base, **upgraded})) == {**base, **upgraded}
    for budget in (3.6, 4.0, 5.0, 9.0):
        got = kquants.dq3_recipe(sizes, sens, budget)
        assert bits(got) <= budget
    assert kquants.dq3_recipe(sizes, sens, 9.0) == {"a": "Q6_K", "b": "Q6_K", "c": "Q6_K"}
    assert_one_line_error(kquants.dq3_recipe, sizes, sens, 3.0, match="below the cheapest")


def test_sensitivity_is_relative_error_and_weighted():
    w = np.random.default_rng().standard_normal((32, 512)).astype(np.float32)
    s = kquants.tensor_sensitivity(w, ["Q3_K", "Q4_K", "Q8_0"])
    assert s["Q8_0"] < s["Q4_K"] < s["Q3_K"] < 0.1
    back = kquants.dequantize_blocks(kquants.quantize_blocks(w, "Q4_K"), "Q4_K")
    assert s["Q4_K"] == pytest.approx(np.sum((back - w) ** 2) / np.sum(w ** 2), rel=1e-6)
    imp = np.zeros(512)
    imp[:256] = 1.0  # only the first super-block of each row counts
    got = kquants.tensor_sensitivity(w, ["Q4_K"], imp)["Q4_K"]
    assert got == pytest.approx(np.sum((back - w)[:, :256] ** 2) / np.sum(w[:, :256] ** 2), rel=1e-6)
    imp = np.random.default_rng().uniform(0, 2, 512)  # absolute: the weighted error, scaled
    got = kquants.tensor_sensitivity(w, ["Q4_K"], imp, scale=3.0)["Q4_K"]
    assert got == pytest.approx(3.0 * np.sum((back - w) ** 2 @ imp), rel=1e-6)


def test_dq3_on_smollm2_spends_at_most_q3_k_m_bits():
    """DQ3_K_M reallocates Q3_K_M's bits: the same output / embedding type, at most the same
    bits per weight, a different choice per layer; an importance vector that zeroes a
    tensor's columns makes its error vanish, so it is never upgraded."""
    src = _model_path("smollm2")
    header = read_gguf_header(src)
    sizes = {n: int(np.prod(t.shape)) for n, t in header.tensors.items()}
    q3 = kquants.recipe_types(src, "Q3_K_M")
    dq3 = kquants.recipe_types(src, "DQ3_K_M", max_values=4096)
    assert kquants.bits_per_weight_of(dq3, sizes) <= kquants.bits_per_weight_of(q3, sizes)
    assert dq3["token_embd.weight"] == q3["token_embd.weight"] and dq3 != q3
    assert {n for n, q in dq3.items() if q == "F32"} == {n for n, q in q3.items() if q == "F32"}
    name = "blk.3.attn_v.weight"
    importance = {n: np.ones(t.shape[-1]) for n, t in header.tensors.items()}
    importance[name] = np.zeros(header.tensors[name].shape[-1])
    deaf = kquants.recipe_types(src, "DQ3_K_M", max_values=4096, importance=importance)
    assert deaf[name] == kquants.fallback_type("Q3_K", header.tensors[name].shape[-1])
    # measured KL: a tensor whose quantisation costs far more than any other's gets the
    # most bits, one that costs nothing stays at its cheapest
    free = [t.name for t in kquants.dq3_tensors(src)]
    rng = np.random.default_rng()
    measured = {n: float(rng.uniform(1e-4, 1e-3)) for n in free}
    loud, quiet = "blk.7.ffn_down.weight", "blk.20.ffn_down.weight"
    measured[loud], measured[quiet] = 10.0, 0.0
    kl = kquants.recipe_types(src, "DQ3_K_M", max_values=4096, measured=measured)
    assert kl[loud] == "Q8_0" and kl[quiet] == "Q3_K"
    assert kquants.bits_per_weight_of(kl, sizes) <= kquants.bits_per_weight_of(q3, sizes)
    assert_one_line_error(kquants.recipe_types, src, "DQ3_K_M", importance=importance,
                          measured=measured, match="not both")
    del measured[quiet]
    assert_one_line_error(kquants.recipe_types, src, "DQ3_K_M", measured=measured,
                          match="measured KL covers")

# ---- whole files: llama.cpp's quantiser, llama.cpp running ours ---------------------------------

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a"]
NEW_TOKENS = 24
E2E_RECIPES = {"Q4_K_M": 15, "Q3_K_M": 12}  # recipe: llama_ftype
# llama.cpp rounds activations to 8 bits (Q8_K / Q8_0 blocks) inside its quantised dot
# products; over SmolLM2 its logits differ from jaxdec's float32 ones by up to ~TIE
TIE = 0.5


@pytest.fixture(scope="module")
def smollm2_files(tmp_path_factory):
    """{recipe: (our file, llama.cpp's file)}: SmolLM2 requantised from its own GGUF by
    write_gguf and by llama_model_quantize (same ftype, no importance matrix)."""
    lc = _llama_cpp()
    src = _model_path("smollm2")
    root = tmp_path_factory.mktemp("kquants")
    files = {}
    for recipe, ftype in E2E_RECIPES.items():
        ours = gguf_writer.write_gguf(src, root / f"ours.{recipe}.gguf", kquants.recipe_types(src, recipe),
                                      file_type=recipe)
        theirs = root / f"llama.{recipe}.gguf"
        params = lc.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize, params.nthread = ftype, True, 2
        assert lc.llama_model_quantize(str(src).encode(), str(theirs).encode(), ctypes.byref(params)) == 0
        files[recipe] = (ours, theirs)
    return files


def _plain(value):
    return value.tolist() if isinstance(value, np.ndarray) else value


@pytest.mark.parametrize("recipe", E2E_RECIPES)
def test_written_file_equals_llama_cpp_quantize(smollm2_files, recipe):
    """Our file and llama.cpp's hold the same tensors (same types, same bytes) and the same
    metadata; only the tensor order differs (llama.cpp sorts by layer)."""
    ours, theirs = smollm2_files[recipe]
    a, b = read_gguf_header(ours), read_gguf_header(theirs)
    assert {n: t.type_name for n, t in a.tensors.items()} == {n: t.type_name for n, t in b.tensors.items()}
    for name, t in a.tensors.items():
        u = b.tensors[name]
        same = np.array_equal(np.fromfile(ours, np.uint8, count=t.nbytes, offset=t.start),
                              np.fromfile(theirs, np.uint8, count=u.nbytes, offset=u.start))
        assert same, f"{name} ({t.type_name}) differs from llama.cpp's"
    assert {k: _plain(v) for k, v in a.metadata.items()} == {k: _plain(v) for k, v in b.metadata.items()}


def _llama_cpp_greedy(path: str, rows: list[list[int]], lengths: list[int]):
    """llama.cpp's greedy continuation of each row of prompt ids (numpy argmax of its
    logits): [(ids, logits f32[n, V] that chose them)]."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_ctx=128, n_batch=128, n_threads=2, logits_all=True, verbose=False)
    out = []
    for prompt_ids, n in zip(rows, lengths):
        llm.reset()
        llm.eval(prompt_ids)
        ids, logits = [], []
        for _ in range(n):
            logits.append(np.array(llm.scores[llm.n_tokens - 1], np.float32))
            ids.append(int(np.argmax(logits[-1])))
            llm.eval(ids[-1:])
        out.append((ids, np.stack(logits)))
    return out


def _send(conn, fn, args) -> None:
    conn.send(fn(*args))


def _isolated(fn, *args, timeout: float = 600):
    """fn(*args) in a fresh process, so that a native crash fails this test, not the run."""
    ctx = multiprocessing.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_send, args=(send, fn, args))
    proc.start()
    send.close()
    try:
        result = recv.recv() if recv.poll(timeout) else None
    except EOFError:
        result = None
    proc.join(10)
    if proc.exitcode != 0:
        proc.kill()
        hint = (" (SIGILL: this llama.cpp build uses an instruction the CPU lacks, e.g. AVX-VNNI's "
                "VEX vpdpbusd; see the Makefile's LLAMA_CMAKE_ARGS)") if proc.exitcode == -signal.SIGILL else ""
        pytest.fail(f"llama.cpp's process ended with exit code {proc.exitcode}{hint}")
    return result


@pytest.mark.parametrize("recipe", [pytest.param("Q4_K_M"), pytest.param("Q3_K_M", marks=pytest.mark.slow)])
def test_llama_cpp_generates_jaxdec_tokens_from_our_file(smollm2_files, recipe):
    """llama.cpp loads the file we wrote and, from the same prompt ids, its greedy tokens are
    jaxdec's (which runs the same weights: see test_gguf_dequantisation_is_ggml_s) until
    they part, and they part only at a near tie: the two tokens' logits within TIE of each
    other in jaxdec's logits and in llama.cpp's."""
    path = smollm2_files[recipe][0]
    model = jaxdec.load(str(path))
    out = jaxdec.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS)
    llama = _isolated(_llama_cpp_greedy, str(path), out.prompt_ids, [len(t) for t in out.token_ids])
    agreed = 0
    for prompt_ids, ours, (theirs, their_logits) in zip(out.prompt_ids, out.token_ids, llama):
        k = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        agreed += len(ours) if k is None else k
        if k is not None:
            logits = jaxdec.score(model, [prompt_ids + ours[:k]])[0, -1]
            margins = (logits[ours[k]] - logits[theirs[k]], their_logits[k, theirs[k]] - their_logits[k, ours[k]])
            assert max(margins) < TIE, (f"step {k}: jaxdec {ours[k]}, llama.cpp {theirs[k]}, margins "
                                        f"{margins[0]:.3f} (jaxdec) and {margins[1]:.3f} (llama.cpp)")
    assert agreed >= NEW_TOKENS  # (a row of near ties at every step would say nothing)
