"""Read a Hugging Face model directory (config.json + safetensors + tokenizer) into a `Checkpoint`.

Supported: `LlamaForCausalLM` and `Qwen2ForCausalLM`, single-file or sharded
(`model.safetensors.index.json`) safetensors in float32, float16 or bfloat16. Tensors are
read with safetensors' numpy API (bfloat16 through `ml_dtypes`) and widened to float32,
which is exact for all three. Both transformers v4 (`rope_theta` + `rope_scaling`) and v5
(`rope_parameters`) config layouts are understood.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import ml_dtypes  # noqa: F401  (registers numpy's 'bfloat16' dtype, which safetensors asks for)
import numpy as np
import safetensors

from jaxdec.checkpoint.common import Checkpoint, hf_tensor_shapes, missing_tensors_error, validate
from jaxdec.checkpoint.tokenizer import Tokenizer
from jaxdec.config import ModelConfig, RopeScaling
from jaxdec.errors import JaxdecError

SUPPORTED = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
# Buffers some checkpoints carry that are recomputed, never loaded.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise JaxdecError(f"{path}: cannot read JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise JaxdecError(f"{path}: expected a JSON object")
    return data


def _arch(config: dict[str, Any], path: pathlib.Path) -> str:
    names = config.get("architectures") or []
    for name in names:
        if name in SUPPORTED:
            return SUPPORTED[name]
    if not names and config.get("model_type") in SUPPORTED.values():
        return config["model_type"]
    shown = names[0] if names else config.get("model_type")
    raise JaxdecError(f"{path}: unsupported architecture {shown!r} "
                      f"(supported: {', '.join(SUPPORTED)})")


def _rope(config: dict[str, Any], path: pathlib.Path) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from v5 `rope_parameters` or v4 `rope_theta` + `rope_scaling`."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    original = int(params.get("original_max_position_embeddings",
                              config.get("max_position_embeddings", 8192)))
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=float(params["factor"]),
                                  original_max_position=original)
    if kind == "llama3":
        return theta, RopeScaling(kind="llama3", factor=float(params["factor"]),
                                  low_freq_factor=float(params["low_freq_factor"]),
                                  high_freq_factor=float(params["high_freq_factor"]),
                                  original_max_position=original)
    raise JaxdecError(f"{path}: unsupported RoPE scaling type {kind!r} (supported: llama3, linear)")


def _check_supported(config: dict[str, Any], arch: str, path: pathlib.Path) -> None:
    if config.get("hidden_act", "silu") != "silu":
        raise JaxdecError(f"{path}: unsupported activation {config['hidden_act']!r} (silu only)")
    if config.get("mlp_bias"):
        raise JaxdecError(f"{path}: MLP biases are unsupported")
    if arch == "llama" and config.get("attention_bias"):
        # HF Llama's attention_bias also biases o_proj, which ModelConfig cannot express
        raise JaxdecError(f"{path}: Llama attention_bias (q/k/v/o biases) is unsupported")
    if arch == "qwen2" and config.get("use_sliding_window"):
        raise JaxdecError(f"{path}: sliding-window attention is unsupported")


def _eos_ids(config: dict[str, Any], tok: Tokenizer) -> tuple[int, ...]:
    eos = config.get("eos_token_id")
    extra = eos if isinstance(eos, list) else [eos]
    return tuple(dict.fromkeys([*tok.stop_ids, *(int(i) for i in extra if i is not None)]))


def config_from_hf(config: dict[str, Any], tok: Tokenizer, path: pathlib.Path) -> ModelConfig:
    """ModelConfig from a parsed config.json (Llama or Qwen2)."""
    arch = _arch(config, path)
    _check_supported(config, arch, path)
    theta, scaling = _rope(config, path)
    try:
        d, n = int(config["hidden_size"]), int(config["num_attention_heads"])
        bos = config.get("bos_token_id")
        return ModelConfig(
            arch=arch, vocab_size=int(config["vocab_size"]), d_model=d,
            n_layers=int(config["num_hidden_layers"]), n_heads=n,
            n_kv_heads=int(config.get("num_key_value_heads") or n),
            head_dim=int(config.get("head_dim") or d // n),
            d_ff=int(config["intermediate_size"]),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=theta,
            rope_scaling=scaling, tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2",
            max_position=int(config.get("max_position_embeddings", 4096)),
            eos_ids=_eos_ids(config, tok), bos_id=int(bos) if bos is not None else tok.bos_id)
    except KeyError as e:
        raise JaxdecError(f"{path / 'config.json'}: missing field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise JaxdecError(f"{path / 'config.json'}: invalid value ({e})") from None


def _safetensors_files(path: pathlib.Path) -> list[pathlib.Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map") or {}
        files = [path / f for f in dict.fromkeys(weight_map.values())]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise JaxdecError(f"{path}: shard {absent[0]!r} named in the index is missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise JaxdecError(f"{path}: no *.safetensors files")
    return files


def _read_shard(file: pathlib.Path, wanted: dict[str, tuple[int, ...]]
                ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """`file`'s tensors that are in `wanted`, as float32, and their stored dtypes."""
    tensors, types = {}, {}
    try:
        with safetensors.safe_open(str(file), framework="numpy") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and name not in wanted):
                    continue
                if name not in wanted:
                    raise JaxdecError(f"{file}: unexpected tensor {name!r}")
                types[name] = f.get_slice(name).get_dtype()
                tensors[name] = np.asarray(f.get_tensor(name), dtype=np.float32)
    except JaxdecError:
        raise
    except Exception as e:  # safetensors raises SafetensorError / OSError / TypeError
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise JaxdecError(f"{file}: cannot read safetensors ({first})") from None
    return tensors, types


def read_hf_dir(path: str | pathlib.Path) -> Checkpoint:
    """A Hugging Face Llama/Qwen2 directory as a `Checkpoint` of float32 tensors.

    A tied model's `lm_head.weight`, if stored, is dropped (the embedding is the head).
    Every user-facing problem is a one-line JaxdecError.
    """
    path = pathlib.Path(path)
    if not path.is_dir():
        raise JaxdecError(f"{path}: no such directory")
    if not (path / "config.json").is_file():
        raise JaxdecError(f"{path}: no config.json")
    config = _read_json(path / "config.json")
    _arch(config, path)  # fail on the architecture before reading a tokenizer
    tok = Tokenizer.from_hf_dir(path)
    cfg = config_from_hf(config, tok, path)
    wanted = hf_tensor_shapes(cfg)
    shards = [_read_shard(file, wanted) for file in _safetensors_files(path)]
    tensors = {k: v for shard, _ in shards for k, v in shard.items()}
    types = {k: v for _, shard_types in shards for k, v in shard_types.items()}
    missing = [n for n in wanted if n not in tensors]
    if missing:
        raise missing_tensors_error(str(path), missing)
    return validate(Checkpoint(config=cfg, tensors=tensors, tokenizer=tok, tensor_types=types),
                    str(path))
