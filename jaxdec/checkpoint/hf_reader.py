"""Read a Hugging Face model directory (config.json + safetensors + tokenizer) into a `Checkpoint`.

Supported (`SUPPORTED`): the Llama family (Llama, Qwen2, Qwen3), MoE (Mixtral, Qwen2-MoE,
Qwen3-MoE), MLA + MoE (DeepSeek-V3), Mamba2 and the Nemotron-H hybrids, single-file or sharded
(`model.safetensors.index.json`) safetensors in float32, float16 or bfloat16. Tensors are
read with safetensors' numpy API (bfloat16 through `ml_dtypes`) and widened to float32,
which is exact for all three. Both transformers v4 (`rope_theta` + `rope_scaling`) and v5
(`rope_parameters`) config layouts are understood.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
from typing import Any

import ml_dtypes  # noqa: F401  (registers numpy's 'bfloat16' dtype, which safetensors asks for)
import numpy as np
import safetensors

from jaxdec.checkpoint.common import Checkpoint, LazyTensors, missing_tensors_error, validate
from jaxdec.checkpoint.hf_layout import hf_tensor_shapes
from jaxdec.checkpoint.tokenizer import Tokenizer
from jaxdec.config import MambaConfig, MLAConfig, ModelConfig, MoEConfig, RopeScaling
from jaxdec.errors import JaxdecError

SUPPORTED = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
             "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
             "Qwen3MoeForCausalLM": "qwen3_moe", "DeepseekV3ForCausalLM": "deepseek_v3",
             "Mamba2ForCausalLM": "mamba2", "NemotronHForCausalLM": "nemotron_h"}
# Buffers some checkpoints carry that are recomputed, never loaded.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# Nemotron-H's hybrid_override_pattern letters, and its v5 layers_block_type names.
# The field that counts a family's routed experts (transformers v5 also accepts the others).
_EXPERT_COUNT = {"mixtral": "num_local_experts", "qwen2_moe": "num_experts",
                 "qwen3_moe": "num_experts", "deepseek_v3": "n_routed_experts"}
_NEMOTRON_LETTERS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_NEMOTRON_TYPES = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention",
                   "attention": "attention", "mlp": "mlp", "moe": "moe"}


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
    if kind == "yarn":
        if params.get("attention_factor") is not None:
            raise JaxdecError(f"{path}: YaRN with an explicit attention_factor is unsupported")
        return theta, RopeScaling(kind="yarn", factor=float(params["factor"]),
                                  original_max_position=original,
                                  beta_fast=float(params.get("beta_fast") or 32.0),
                                  beta_slow=float(params.get("beta_slow") or 1.0),
                                  mscale=float(params.get("mscale") or 0.0),
                                  mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
                                  truncate=bool(params.get("truncate", True)))
    raise JaxdecError(f"{path}: unsupported RoPE scaling type {kind!r} (supported: llama3, linear, yarn)")


def _refuse(path: pathlib.Path, config: dict[str, Any], checks: dict[str, Any]) -> None:
    """One-line error for the first config field that asks for something jaxdec lacks:
    checks maps field -> the one value (or tuple of values) jaxdec supports."""
    for field, ok in checks.items():
        value = config.get(field)
        if value is None:
            continue
        if value not in (ok if isinstance(ok, tuple) else (ok,)):
            raise JaxdecError(f"{path}: unsupported {field}={value!r} (supported: {ok!r})")


def _check_supported(config: dict[str, Any], arch: str, path: pathlib.Path) -> None:
    checks = {"hidden_act": "silu", "mlp_bias": (False,), "use_sliding_window": (False,),
              "mamba_hidden_act": "silu", "mlp_hidden_act": "relu2", "use_bias": (False,),
              "mamba_proj_bias": (False,), "use_conv_bias": (True,), "moe_latent_size": (None,)}
    if arch in ("mixtral", "nemotron_h"):  # these apply a sliding window whenever it is set
        checks["sliding_window"] = (None,)
    _refuse(path, config, checks)
    if arch == "qwen2":  # Qwen2 always biases q, k and v
        return
    if config.get("attention_bias") and arch != "qwen2_moe":
        # HF's attention_bias also biases o_proj, which ModelConfig cannot express
        raise JaxdecError(f"{path}: attention_bias (q/k/v/o biases) is unsupported")


def _float(value) -> float:
    """A float from config.json, including transformers' {"__float__": "Infinity"}."""
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    return float(value)


def _moe_layers(config: dict[str, Any], n_layers: int, mixer: str) -> tuple[str, ...]:
    """Qwen-MoE: layer i is MoE unless listed in mlp_only_layers or off decoder_sparse_step."""
    step = int(config.get("decoder_sparse_step") or 1)
    dense = set(config.get("mlp_only_layers") or ())
    return tuple(f"{mixer}+mlp" if i in dense or (i + 1) % step else f"{mixer}+moe"
                 for i in range(n_layers))


def _family_fields(config: dict[str, Any], arch: str, d: int, n_layers: int,
                   path: pathlib.Path) -> dict[str, Any]:
    """The ModelConfig fields that set the family apart from a plain Llama."""
    g = config.get

    def need(name: str):
        """A field the family cannot do without (a missing or null one names itself)."""
        if config.get(name) is None:
            raise KeyError(name)
        return config[name]

    n_experts = g("num_experts") or g("num_local_experts") or g("n_routed_experts")
    if n_experts is None and arch in _EXPERT_COUNT:
        raise KeyError(_EXPERT_COUNT[arch])
    if arch == "llama":
        return {}
    if arch == "qwen2":
        return dict(qkv_bias=True)
    if arch == "qwen3":
        return dict(qk_norm=True)
    if arch == "mixtral":
        moe = MoEConfig(n_experts=int(n_experts), top_k=int(need("num_experts_per_tok")),
                        d_expert=int(need("intermediate_size")), router="softmax", normalize=True)
        return dict(moe=moe, layer_types=("attention+moe",) * n_layers)
    if arch in ("qwen2_moe", "qwen3_moe"):
        shared = int(g("shared_expert_intermediate_size") or 0) if arch == "qwen2_moe" else 0
        moe = MoEConfig(n_experts=int(n_experts), top_k=int(need("num_experts_per_tok")),
                        d_expert=int(need("moe_intermediate_size")), router="softmax",
                        normalize=bool(g("norm_topk_prob", False)), d_shared=shared,
                        shared_gate=shared > 0)
        return dict(moe=moe, layer_types=_moe_layers(config, n_layers, "attention"),
                    qkv_bias=arch == "qwen2_moe", qk_norm=arch == "qwen3_moe")
    if arch == "deepseek_v3":
        q_lora = g("q_lora_rank")
        mla = MLAConfig(kv_lora_rank=int(need("kv_lora_rank")), qk_nope_head_dim=int(need("qk_nope_head_dim")),
                        qk_rope_head_dim=int(need("qk_rope_head_dim")), v_head_dim=int(need("v_head_dim")),
                        q_lora_rank=int(q_lora) if q_lora else None,
                        rope_interleave=bool(g("rope_interleave", True)))
        moe = MoEConfig(n_experts=int(n_experts), top_k=int(need("num_experts_per_tok")),
                        d_expert=int(need("moe_intermediate_size")), router="sigmoid",
                        normalize=bool(g("norm_topk_prob", True)),
                        scale=float(g("routed_scaling_factor", 1.0)), n_group=int(g("n_group") or 1),
                        topk_group=int(g("topk_group") or 1), router_bias=True,
                        d_shared=int(need("moe_intermediate_size")) * int(g("n_shared_experts") or 0))
        first_dense = int(g("first_k_dense_replace") or 0)
        types = tuple("mla+mlp" if i < first_dense else "mla+moe" for i in range(n_layers))
        return dict(mla=mla, moe=moe, layer_types=types, head_dim=mla.qk_head_dim,
                    n_kv_heads=int(need("num_attention_heads")))
    # Mamba2 and Nemotron-H
    prefix = "mamba_" if arch == "nemotron_h" else ""
    limit = g("time_step_limit") or (0.0, math.inf)
    mamba = MambaConfig(n_heads=int(need(prefix + "num_heads")), head_dim=int(need(prefix + "head_dim")),
                        n_groups=int(g("n_groups") or 1),
                        d_state=int(need("ssm_state_size" if arch == "nemotron_h" else "state_size")),
                        d_conv=int(g("conv_kernel") or 4), chunk=int(g("chunk_size") or 256),
                        dt_min=_float(limit[0]), dt_max=_float(limit[1]))
    inner = int(g("expand") or 2) * d
    if arch == "mamba2":
        if mamba.d_inner != inner:
            raise JaxdecError(f"{path}: num_heads * head_dim = {mamba.d_inner} differs from "
                              f"expand * hidden_size = {inner}")
        # no attention or MLP layers: the head and ffn fields are unused placeholders
        return dict(mamba=mamba, layer_types=("mamba",) * n_layers, n_heads=1, n_kv_heads=1,
                    head_dim=1, d_ff=1, norm_eps=_float(g("layer_norm_epsilon", 1e-5)))
    pattern = g("hybrid_override_pattern")
    if pattern:
        unknown = set(pattern) - set(_NEMOTRON_LETTERS)
        if unknown:
            raise JaxdecError(f"{path}: hybrid_override_pattern has unknown layer letters {sorted(unknown)}")
        types = tuple(_NEMOTRON_LETTERS[c] for c in pattern)
    else:
        names = g("layers_block_type") or []
        unknown = [t for t in names if t not in _NEMOTRON_TYPES]
        if unknown:
            raise JaxdecError(f"{path}: unknown layers_block_type {unknown[0]!r}")
        types = tuple(_NEMOTRON_TYPES[t] for t in names)
    fields = dict(mamba=mamba, layer_types=types, attention_rope=False, mlp_act="relu2",
                  norm_eps=_float(g("layer_norm_epsilon", 1e-5)))
    if "moe" in types:
        fields["moe"] = MoEConfig(
            n_experts=int(need("n_routed_experts")), top_k=int(need("num_experts_per_tok")),
            d_expert=int(need("moe_intermediate_size")), router="sigmoid",
            normalize=bool(g("norm_topk_prob", True)), scale=float(g("routed_scaling_factor", 1.0)),
            n_group=int(g("n_group") or 1), topk_group=int(g("topk_group") or 1), router_bias=True,
            d_shared=int(g("moe_shared_expert_intermediate_size") or 0))
    return fields


def _eos_ids(config: dict[str, Any], tok: Tokenizer) -> tuple[int, ...]:
    eos = config.get("eos_token_id")
    extra = eos if isinstance(eos, list) else [eos]
    return tuple(dict.fromkeys([*tok.stop_ids, *(int(i) for i in extra if i is not None)]))


def config_from_hf(config: dict[str, Any], tok: Tokenizer, path: pathlib.Path) -> ModelConfig:
    """ModelConfig from a parsed config.json (any of `SUPPORTED`)."""
    arch = _arch(config, path)
    _check_supported(config, arch, path)
    try:
        theta, scaling = _rope(config, path)
        d = int(config["hidden_size"])
        # Nemotron-H's saved config counts its layers only in the layer pattern
        pattern = config.get("hybrid_override_pattern") or config.get("layers_block_type")
        n_layers = int(config["num_hidden_layers"] if pattern is None else len(pattern))
        if config.get("num_hidden_layers") not in (None, n_layers):
            raise JaxdecError(f"{path / 'config.json'}: num_hidden_layers="
                              f"{config['num_hidden_layers']} but the layer pattern has {n_layers} layers")
        n = int(config.get("num_attention_heads") or 1)
        bos = config.get("bos_token_id")
        fields = dict(
            arch=arch, vocab_size=int(config["vocab_size"]), d_model=d, n_layers=n_layers, n_heads=n,
            n_kv_heads=int(config.get("num_key_value_heads") or n),
            head_dim=int(config.get("head_dim") or d // n),
            d_ff=int(config.get("intermediate_size") or 1),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=theta,
            rope_scaling=scaling, tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position=int(config.get("max_position_embeddings") or 1 << 20),
            eos_ids=_eos_ids(config, tok), bos_id=int(bos) if bos is not None else tok.bos_id)
        fields |= _family_fields(config, arch, d, n_layers, path)
        return ModelConfig(**fields)
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


def _skipped(name: str, wanted: dict[str, tuple[int, ...]], cfg: ModelConfig) -> bool:
    """Stored tensors that are never loaded: recomputed buffers, a tied model's copy of the
    head, and DeepSeek-V3's multi-token-prediction layers (numbered past the last layer)."""
    if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and name not in wanted):
        return True
    extra = re.match(r"model\.layers\.(\d+)\.", name)
    return cfg.arch == "deepseek_v3" and extra is not None and int(extra.group(1)) >= cfg.n_layers


def _read_shard(file: pathlib.Path, wanted: dict[str, tuple[int, ...]], cfg: ModelConfig
                ) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """The shapes of `file`'s tensors that are in `wanted` and their stored dtypes (read
    from the header: no tensor data is read)."""
    shapes, types = {}, {}
    try:
        with safetensors.safe_open(str(file), framework="numpy") as f:
            for name in f.keys():
                if _skipped(name, wanted, cfg):
                    continue
                if name not in wanted:
                    raise JaxdecError(f"{file}: unexpected tensor {name!r}")
                sl = f.get_slice(name)
                types[name], shapes[name] = sl.get_dtype(), tuple(sl.get_shape())
    except JaxdecError:
        raise
    except Exception as e:  # safetensors raises SafetensorError / OSError / TypeError
        raise _unreadable(file, e) from None
    return shapes, types


def _unreadable(file: pathlib.Path, e: Exception) -> JaxdecError:
    first = (str(e).splitlines() or [type(e).__name__])[0]
    return JaxdecError(f"{file}: cannot read safetensors ({first})")


def _reader(where: dict[str, pathlib.Path]):
    """name -> the tensor as float32, read from its file when called."""

    def read(name: str) -> np.ndarray:
        try:
            with safetensors.safe_open(str(where[name]), framework="numpy") as f:
                return np.asarray(f.get_tensor(name), dtype=np.float32)
        except Exception as e:
            raise _unreadable(where[name], e) from None

    return read


def read_hf_dir(path: str | pathlib.Path) -> Checkpoint:
    """A Hugging Face model directory as a `Checkpoint` of float32 tensors (read from
    their files as they are looked up: `common.LazyTensors`).

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
    shapes, types, where = {}, {}, {}
    for file in _safetensors_files(path):
        file_shapes, file_types = _read_shard(file, wanted, cfg)
        shapes |= file_shapes
        types |= file_types
        where |= dict.fromkeys(file_shapes, file)
    missing = [n for n in wanted if n not in shapes]
    if missing:
        raise missing_tensors_error(str(path), missing)
    tensors = LazyTensors(shapes, _reader(where))
    return validate(Checkpoint(config=cfg, tensors=tensors, tokenizer=tok, tensor_types=types),
                    str(path))
