"""GGUF and HF-directory readers against Hugging Face transformers' own loading.

The reference numbers are HF's: `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...,
dtype=float32)` state dicts and configs for both real GGUF files, and in-memory
`LlamaForCausalLM`/`Qwen2ForCausalLM` models for the HF-directory reader. HF (with a float
dtype) dequantizes GGUF blocks with the same `gguf` package we use, so tensors must be
*exactly* equal; what this checks independently is the name mapping, shapes and the
llama q/k row un-permutation.

HF's GGUF loading is slow (~25 s of CPU for SmolLM2, ~70 s for Qwen2.5-0.5B: it parses the
metadata with `gguf.GGUFReader` twice), so each real model is loaded once, in a
subprocess started when this module is imported (overlapping the rest of the suite), with
the parse cached; the subprocess writes a sample of tensors as .npy files plus the
config, and the tests read those.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import gguf
import numpy as np
import pytest
import torch
from transformers import (AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

from jaxdec.checkpoint import registry
from jaxdec.checkpoint.gguf_reader import read_gguf
from jaxdec.checkpoint.hf_reader import read_hf_dir
from conftest import assert_one_line_error
from hf_jobs import HfJob

MODELS = ("smollm2", "qwen2.5-coder-0.5b")

# Runs in a subprocess: argv = gguf path, output dir, "save" (also save an HF dir + tokenizer).
_HF_JOB = r"""
import functools, json, pathlib, sys, time
import gguf, numpy as np, torch
# HF parses the same file with gguf.GGUFReader up to three times and rebuilds the same name
# map per module; caching both (read-only, pure) halves the job time and changes no value.
gguf.GGUFReader = functools.cache(gguf.GGUFReader)
gguf.get_tensor_name_map = functools.cache(gguf.get_tensor_name_map)
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
path, out, save = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3] == "save"
t0 = time.time()
model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
sd = model.state_dict()
n = model.config.num_hidden_layers
layers = {0, 1, 2, n // 2, n - 1}
(out / "tensors").mkdir(parents=True)
for name, t in sd.items():
    parts = name.split(".")
    if not (len(parts) > 2 and parts[1] == "layers") or int(parts[2]) in layers:
        np.save(out / "tensors" / f"{name}.npy", t.numpy())
json.dump({"config": model.config.to_dict(), "names": sorted(sd)}, open(out / "hf.json", "w"))
if save:
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.save_pretrained(out / "hf_tokenizer")
    # A GGUF-quantized HF model refuses save_pretrained: copy it into a plain one first.
    config = AutoConfig.for_model(**{k: v for k, v in model.config.to_dict().items()
                                     if k not in ("quantization_config", "model_type")},
                                  model_type=model.config.model_type)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(sd)
    plain.save_pretrained(out / "hf_model")
    tok.save_pretrained(out / "hf_model")
print(f"HF job {path.name}: {time.time() - t0:.1f} s", file=sys.stderr)
"""


_JOBS = {name: HfJob(name, _HF_JOB, f"ckpt-{name}", "save" if name == "smollm2" else "-")
         for name in MODELS}


@pytest.fixture(scope="module", params=MODELS)
def pair(request):
    """(our Checkpoint from the GGUF, HF reference dir) for one real model."""
    out = _JOBS[request.param].wait()
    return read_gguf(registry.resolve(request.param)), out


def _hf_tensor(out: pathlib.Path, name: str) -> np.ndarray:
    return np.load(out / "tensors" / f"{name}.npy")


def _hf_config(out: pathlib.Path) -> dict:
    return json.loads((out / "hf.json").read_text())


def _hf_names(out: pathlib.Path) -> set[str]:
    """HF's state-dict names, less the tied `lm_head.weight` alias (ours omits it)."""
    hf = _hf_config(out)
    return set(hf["names"]) - ({"lm_head.weight"} if hf["config"]["tie_word_embeddings"] else set())


def _assert_config_matches_hf(cfg, hf: dict):
    rope = hf.get("rope_parameters") or {}
    assert cfg.vocab_size == hf["vocab_size"]
    assert cfg.d_model == hf["hidden_size"]
    assert cfg.n_layers == hf["num_hidden_layers"]
    assert cfg.n_heads == hf["num_attention_heads"]
    assert cfg.n_kv_heads == hf["num_key_value_heads"]
    assert cfg.head_dim == (hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
    assert cfg.d_ff == hf["intermediate_size"]
    assert cfg.norm_eps == hf["rms_norm_eps"]
    assert cfg.rope_theta == rope["rope_theta"]
    assert cfg.tie_embeddings == hf["tie_word_embeddings"]
    assert cfg.max_position == hf["max_position_embeddings"]
    assert cfg.qkv_bias == (hf["model_type"] == "qwen2" or hf.get("attention_bias", False))
    if rope.get("rope_type", "default") == "default":
        assert cfg.rope_scaling is None
    else:
        s = cfg.rope_scaling
        assert (s.kind, s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position) == (
            rope["rope_type"], rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
            rope["original_max_position_embeddings"])


# ---- real GGUF files vs HF ----------------------------------------------------------------------
def test_gguf_tensors_equal_hf_state_dict(pair):
    ours, out = pair
    assert set(ours.tensors) == _hf_names(out)
    sampled = sorted(p.name[:-4] for p in (out / "tensors").iterdir() if p.name[:-4] in ours.tensors)
    # the sample covers q/k (permuted for llama), biases, embeddings, norms and every stored type
    assert set(ours.tensor_types[n] for n in sampled) == set(ours.tensor_types.values())
    assert any(".q_proj." in n for n in sampled) and any(".k_proj." in n for n in sampled)
    for name in sampled:
        ref = _hf_tensor(out, name)
        got = ours.tensors[name]
        assert got.dtype == np.float32 and got.shape == ref.shape, name
        # exact: HF dequantizes with the same gguf package, so any difference is a mapping bug
        assert np.array_equal(got, ref), (name, ours.tensor_types[name],
                                          float(np.max(np.abs(got - ref))))


def test_gguf_config_matches_hf(pair):
    ours, out = pair
    hf = _hf_config(out)["config"]
    _assert_config_matches_hf(ours.config, hf)
    assert ours.config.bos_id == hf["bos_token_id"]
    assert hf["eos_token_id"] in ours.config.eos_ids
    assert ("lm_head.weight" in ours.tensors) == (not hf["tie_word_embeddings"])


# ---- HF directories -------------------------------------------------------------------------------
def test_hf_dir_real_smollm2_saved_by_hf():
    out = _JOBS["smollm2"].wait()
    ckpt = read_hf_dir(out / "hf_model")
    _assert_config_matches_hf(ckpt.config, _hf_config(out)["config"])
    assert set(ckpt.tensors) == _hf_names(out)
    for npy in (out / "tensors").iterdir():
        if npy.name[:-4] not in ckpt.tensors:  # the tied lm_head alias
            continue
        assert np.array_equal(ckpt.tensors[npy.name[:-4]], np.load(npy)), npy.name
    hf_tok = AutoTokenizer.from_pretrained(out / "hf_model")
    text = "Hello 🌍, 12345 don't\n\n  <|im_start|>user"
    assert ckpt.tokenizer.encode(text) == hf_tok(text)["input_ids"]
    chat = [{"role": "user", "content": "hi"}]
    assert ckpt.tokenizer.apply_chat_template(chat) == hf_tok.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True)


def test_load_hf_dir_generates_like_the_gguf():
    """jaxdec.load(HF dir) -> the same logits and greedy tokens as jaxdec.load(GGUF)."""
    import jaxdec
    from conftest import jax_model

    from_dir = jaxdec.load(_JOBS["smollm2"].wait() / "hf_model")
    rows = [from_dir.tokenizer.encode("The quick brown fox"), [1, 2, 3, 4, 5, 6, 7]]
    np.testing.assert_array_equal(jaxdec.score(from_dir, rows), jaxdec.score(jax_model("smollm2"), rows))
    a = jaxdec.generate(from_dir, "Rivers flow to", max_new_tokens=8)
    assert a.token_ids == jaxdec.generate(jax_model("smollm2"), "Rivers flow to", max_new_tokens=8).token_ids


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 1024,
                "rope_theta": 500000.0}
_SMALL = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
_VARIANTS = {
    # name: (model class, config, dtype, save_pretrained kwargs)
    "llama-llama3-rope-sharded": (
        LlamaForCausalLM, LlamaConfig(**_SMALL, rope_parameters=_LLAMA3_ROPE),
        torch.float32, {"max_shard_size": "4MB"}),
    "llama-bf16-tied": (
        LlamaForCausalLM, LlamaConfig(**_SMALL, tie_word_embeddings=True), torch.bfloat16, {}),
    "qwen2-tied": (
        Qwen2ForCausalLM, Qwen2Config(**_SMALL, tie_word_embeddings=True), torch.float32, {}),
}


@pytest.mark.parametrize("variant", sorted(_VARIANTS))
def test_hf_dir_random_model(variant, tmp_path):
    cls, config, dtype, save_kwargs = _VARIANTS[variant]
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    model = cls(config).to(dtype)
    model.save_pretrained(tmp_path, **save_kwargs)
    tok_dir = _JOBS["smollm2"].wait() / "hf_tokenizer"
    for f in tok_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    if save_kwargs:
        assert (tmp_path / "model.safetensors.index.json").is_file()

    ckpt = read_hf_dir(tmp_path)
    _assert_config_matches_hf(ckpt.config, json.loads((tmp_path / "config.json").read_text()))
    ref = {k: v.float().numpy() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        ref.pop("lm_head.weight", None)
    assert set(ckpt.tensors) == set(ref)
    for name, value in ref.items():
        assert np.array_equal(ckpt.tensors[name], value), name
    stored = "BF16" if dtype == torch.bfloat16 else "F32"
    assert set(ckpt.tensor_types.values()) == {stored}


# ---- errors ---------------------------------------------------------------------------------------

_D, _F, _V, _N, _K = 256, 512, 300, 4, 2  # K-quants need rows of 256


_Q = gguf.GGMLQuantizationType
# Byte offsets of each block's float16 scale fields (d, dmin/m), as ggml lays blocks out.
_F16_FIELDS = {_Q.Q4_0: (0,), _Q.Q4_1: (0, 2), _Q.Q5_0: (0,), _Q.Q5_1: (0, 2), _Q.Q8_0: (0,),
               _Q.Q2_K: (80, 82), _Q.Q3_K: (108,), _Q.Q4_K: (0, 2), _Q.Q5_K: (0, 2), _Q.Q6_K: (208,),
               _Q.IQ4_NL: (0,)}


def _random_blocks(qtype, shape, rng) -> np.ndarray:
    """Random quantized rows [out, bytes]: random quants, small finite float16 scales."""
    if qtype == _Q.BF16:
        bits = rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8).reshape(shape[0], -1)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
    for at in _F16_FIELDS[qtype]:
        scale = (rng.uniform(-0.05, 0.05, raw.shape[:2])).astype(np.float16)
        raw[:, :, at:at + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(shape[0], -1)


def _tiny_gguf(path, *, arch="llama", tok_model="gpt2", drop=(), types=None, theta=10000.0,
               rope_freqs=None):
    """A small valid llama-shaped GGUF (random weights), optionally broken on purpose.

    `types` maps a GGUF tensor name to the ggml type to store it as (random blocks).
    """
    rng = np.random.default_rng()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2), w.add_context_length(256), w.add_embedding_length(_D)
    w.add_feed_forward_length(_F), w.add_head_count(_N), w.add_head_count_kv(_K)
    w.add_layer_norm_rms_eps(1e-5), w.add_rope_freq_base(theta), w.add_vocab_size(_V)
    if rope_freqs is not None:  # llama.cpp's baked Llama 3 RoPE divisors
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.add_tokenizer_model(tok_model), w.add_tokenizer_pre("default")
    tokens = [f"t{i}" for i in range(_V - 1)] + ["<|endoftext|>"]
    w.add_token_list(tokens), w.add_token_types([1] * (_V - 1) + [3])
    w.add_eos_token_id(_V - 1)
    shapes = {"token_embd.weight": (_V, _D), "output_norm.weight": (_D,), "output.weight": (_V, _D)}
    for i in range(2):
        shapes |= {f"blk.{i}.attn_norm.weight": (_D,), f"blk.{i}.ffn_norm.weight": (_D,),
                   f"blk.{i}.attn_q.weight": (_N * 64, _D), f"blk.{i}.attn_k.weight": (_K * 64, _D),
                   f"blk.{i}.attn_v.weight": (_K * 64, _D), f"blk.{i}.attn_output.weight": (_D, _N * 64),
                   f"blk.{i}.ffn_gate.weight": (_F, _D), f"blk.{i}.ffn_up.weight": (_F, _D),
                   f"blk.{i}.ffn_down.weight": (_D, _F)}
    for name, shape in shapes.items():
        if name in drop:
            continue
        qtype = (types or {}).get(name)
        if qtype is None:
            w.add_tensor(name, rng.standard_normal(shape, dtype=np.float32))
        elif qtype == _Q.F16:
            w.add_tensor(name, rng.standard_normal(shape, dtype=np.float32).astype(np.float16))
        else:
            w.add_tensor(name, _random_blocks(qtype, shape, rng), raw_dtype=qtype)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def test_error_missing_paths(tmp_path):
    assert_one_line_error(read_gguf, tmp_path / "nope.gguf", match="no such file")
    assert_one_line_error(read_hf_dir, tmp_path / "nope", match="no such directory")
    assert_one_line_error(read_hf_dir, tmp_path, match="no config.json")


def test_error_garbage_and_empty_files(tmp_path):
    (tmp_path / "empty.gguf").write_bytes(b"")
    assert_one_line_error(read_gguf, tmp_path / "empty.gguf", match="not a GGUF file")
    (tmp_path / "garbage.gguf").write_bytes(os.urandom(4096))
    assert_one_line_error(read_gguf, tmp_path / "garbage.gguf", match="not a GGUF file")
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + os.urandom(4096))
    assert_one_line_error(read_gguf, tmp_path / "bad.gguf", match="GGUF")


def test_error_truncated_real_gguf(tmp_path):
    src = registry.resolve("smollm2")
    data = src.read_bytes()
    cut = tmp_path / "cut.gguf"
    # inside the header, inside the vocabulary, inside the tensor data, one byte short
    for size in (20, 100_000, len(data) // 2, len(data) - 1):
        cut.write_bytes(data[:size])
        assert_one_line_error(read_gguf, cut, match="truncated")


def test_error_unsupported_architecture(tmp_path):
    assert_one_line_error(read_gguf, _tiny_gguf(tmp_path / "g.gguf", arch="gemma"),
                           match="unsupported architecture 'gemma'")


def test_error_unsupported_tokenizer_model(tmp_path):
    assert_one_line_error(read_gguf, _tiny_gguf(tmp_path / "t.gguf", tok_model="llama"),
                           match="tokenizer model 'llama'")


def test_error_unsupported_tensor_type(tmp_path):
    path = _tiny_gguf(tmp_path / "q.gguf",
                      types={"blk.1.ffn_up.weight": gguf.GGMLQuantizationType.IQ4_NL})
    assert_one_line_error(read_gguf, path, match="'blk.1.ffn_up.weight' has unsupported type IQ4_NL")


def test_error_missing_gguf_tensors(tmp_path):
    path = _tiny_gguf(tmp_path / "m.gguf", drop=("blk.1.ffn_up.weight", "output_norm.weight"))
    assert_one_line_error(read_gguf, path, match="missing 2 tensor")


# One tensor per supported stored type (q/k stay F32: their rows are permuted).
_TYPE_SLOTS = {
    "token_embd.weight": _Q.Q4_0, "output.weight": _Q.Q4_1, "blk.0.attn_v.weight": _Q.Q5_0,
    "blk.0.attn_output.weight": _Q.Q5_1, "blk.0.ffn_gate.weight": _Q.Q8_0,
    "blk.0.ffn_up.weight": _Q.Q2_K, "blk.0.ffn_down.weight": _Q.Q3_K,
    "blk.1.attn_v.weight": _Q.Q4_K, "blk.1.attn_output.weight": _Q.Q5_K,
    "blk.1.ffn_gate.weight": _Q.Q6_K, "blk.1.ffn_up.weight": _Q.F16, "blk.1.ffn_down.weight": _Q.BF16,
}


def test_every_supported_type_matches_hf_torch_dequant(tmp_path):
    """Each type against HF's torch dequantizer (independent of the gguf package), F16/BF16
    against torch's casts; Q5_0/Q5_1 (which HF's torch path lacks) only load finite."""
    from transformers.integrations.gguf.dequant import GGML_BLOCK
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    path = _tiny_gguf(tmp_path / "types.gguf", types=_TYPE_SLOTS)
    ckpt = read_gguf(path)
    reader = gguf.GGUFReader(path)
    hf_names = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}
    for t in reader.tensors:
        if t.name not in _TYPE_SLOTS:
            continue
        name = hf_names.get(t.name) or t.name.replace("blk.", "model.layers.").replace(
            "attn_v", "self_attn.v_proj").replace("attn_output", "self_attn.o_proj").replace(
            "ffn_gate", "mlp.gate_proj").replace("ffn_up", "mlp.up_proj").replace("ffn_down", "mlp.down_proj")
        got, shape = ckpt.tensors[name], tuple(reversed(t.shape.tolist()))
        assert ckpt.tensor_types[name] == t.tensor_type.name and got.shape == shape
        raw = torch.from_numpy(np.array(t.data)).reshape(-1)
        if t.tensor_type == _Q.F16:
            ref = raw.view(torch.float16).float()
        elif t.tensor_type == _Q.BF16:
            ref = raw.view(torch.bfloat16).float()
        elif int(t.tensor_type) in GGML_BLOCK:
            ref = hf_dequantize(raw, int(t.tensor_type))
        else:
            assert np.isfinite(got).all(), name
            continue
        # exact: both follow ggml's float32 arithmetic
        np.testing.assert_array_equal(got, ref.reshape(shape).numpy(), err_msg=f"{name} {t.tensor_type.name}")
    assert set(ckpt.tensor_types.values()) == {"F32"} | {q.name for q in _TYPE_SLOTS.values()}


@pytest.mark.parametrize("factor", [8.0, 32.0])  # Llama 3.1, Llama 3.2
def test_llama3_rope_scaling_from_rope_freqs(tmp_path, factor):
    """llama.cpp stores Llama 3 scaling as `rope_freqs` = default / scaled inverse frequencies;
    build them with HF's llama3 RoPE init and recover the parameters."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    rope = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    hf_cfg = LlamaConfig(hidden_size=_D, num_attention_heads=_N, rope_parameters=rope,
                         max_position_embeddings=131072)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg)
    head_dim = _D // _N
    default = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    freqs = (default / scaled.double()).numpy()
    ckpt = read_gguf(_tiny_gguf(tmp_path / "r.gguf", theta=500000.0, rope_freqs=freqs))
    s = ckpt.config.rope_scaling
    assert (s.kind, s.low_freq_factor, s.high_freq_factor, s.original_max_position) == (
        "llama3", 1.0, 4.0, 8192)
    assert s.factor == pytest.approx(factor, rel=1e-6)
    assert "rope_freqs.weight" not in ckpt.tensors


def _tiny_hf_dir(tmp_path):
    model = LlamaForCausalLM(LlamaConfig(**{**_SMALL, "vocab_size": 512}))
    model.save_pretrained(tmp_path)
    return tmp_path


def test_error_hf_dir(tmp_path):
    d = _tiny_hf_dir(tmp_path)
    assert_one_line_error(read_hf_dir, d, match="no tokenizer.json")
    (d / "tokenizer.json").write_text("{not json")
    assert_one_line_error(read_hf_dir, d, match="tokenizer.json: cannot parse")
    for f in (_JOBS["smollm2"].wait() / "hf_tokenizer").iterdir():
        shutil.copy(f, d / f.name)
    cfg = json.loads((d / "config.json").read_text())

    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    assert_one_line_error(read_hf_dir, d, match="unsupported architecture 'GPT2LMHeadModel'")
    (d / "config.json").write_text(json.dumps({**cfg, "attention_bias": True}))
    assert_one_line_error(read_hf_dir, d, match="attention_bias")
    (d / "config.json").write_text(json.dumps({**cfg, "rope_parameters": {"rope_type": "dynamic"}}))
    assert_one_line_error(read_hf_dir, d, match="unsupported RoPE scaling type 'dynamic'")
    (d / "config.json").write_text(json.dumps({**cfg, "rope_parameters": {"rope_type": "yarn"}}))
    assert_one_line_error(read_hf_dir, d, match="config.json: missing field 'factor'")
    (d / "config.json").write_text(json.dumps(cfg))

    from safetensors.numpy import load_file, save_file
    tensors = load_file(d / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "model.norm.weight"}, d / "model.safetensors")
    assert_one_line_error(read_hf_dir, d, match="missing 1 tensor.*model.norm.weight")
    (d / "model.safetensors").write_bytes(os.urandom(1000))
    assert_one_line_error(read_hf_dir, d, match="cannot read safetensors")
    (d / "model.safetensors").unlink()
    assert_one_line_error(read_hf_dir, d, match="no \\*.safetensors")


@pytest.mark.parametrize("name", ["smollm2", "qwen2.5-coder-0.5b"])
def test_header_parser_agrees_with_gguf_reader(name):
    """Our fast header parser (gguf.GGUFReader spends 5-15 s on these vocabularies) reads
    the same metadata and tensor table as the gguf package's own reader."""
    from jaxdec.checkpoint import registry
    from jaxdec.checkpoint.gguf_reader import read_gguf_header

    path = registry.resolve(name)
    ours = read_gguf_header(path)
    reader = gguf.GGUFReader(path)
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        want, got = field.contents(), ours.metadata[key]
        if isinstance(got, np.ndarray):
            got = got.tolist()
        assert got == want, key
    assert set(ours.metadata) == {k for k in reader.fields if not k.startswith("GGUF.")}
    assert list(ours.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(reversed(t.shape.tolist())) and info.qtype == t.tensor_type
        assert info.start == t.data_offset and info.nbytes == t.n_bytes
