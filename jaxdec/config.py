"""Frozen model configs.

A config is keyword-only, frozen and hashable, so it is passed to `jax.jit` as a static
argument; variants come from `dataclasses.replace`. Checkpoint formats (GGUF keys, HF
config.json names) are mapped onto these fields in `jaxdec.checkpoint`, never in the model.

One `ModelConfig` describes every family: a stack of layers, each a pre-norm residual
mixer (attention, latent attention or Mamba2) and/or a pre-norm residual feed-forward
(dense MLP or MoE), as `layer_types` spells it. The Llama family is the default, every layer
"attention+mlp"; Nemotron-H writes single-sublayer layers ("mamba", "attention", "mlp",
"moe"); DeepSeek-V3 is "mla+mlp" for its first layers then "mla+moe".
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

MIXERS = ("attention", "mla", "mamba")
FFNS = ("mlp", "moe")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling (HF `rope_type`).

    - "llama3": wavelengths longer than `original_max_position / low_freq_factor` are divided
      by `factor`; shorter than `original_max_position / high_freq_factor` are kept; the band
      between is interpolated smoothly.
    - "linear": every frequency divided by `factor`.
    - "yarn" (DeepSeek): dimensions that turn more than `beta_fast` times over the original
      context keep their frequency, those under `beta_slow` are divided by `factor`, a linear
      ramp between; cos and sin are scaled by `attention_factor`.
    """

    kind: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True

    def __post_init__(self):
        if self.kind not in ("llama3", "linear", "yarn"):
            raise ValueError(f"unsupported RoPE scaling {self.kind!r} (llama3, linear or yarn)")

    @property
    def attention_factor(self) -> float:
        """YaRN's factor on cos/sin (1 for the other kinds)."""
        if self.kind != "yarn":
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): per token the cache holds a latent of
    `kv_lora_rank` values and one RoPE key of `qk_rope_head_dim` values shared by all heads."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: a full-rank query projection
    rope_interleave: bool = True  # DeepSeek's checkpoints rotate interleaved pairs

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """A routed mixture of experts, optionally with always-on shared experts.

    router:
      - "softmax": softmax over all experts, top-k (Qwen-MoE, Mixtral; `normalize` rescales
        the k weights to sum to 1).
      - "sigmoid": DeepSeek-V3: sigmoid scores, top-k on scores + a bias within the best
        `topk_group` of `n_group` groups, weights normalised (`normalize`) and times `scale`.
      - "select": top-k by the router's logits (plus its bias, when `router_bias`), every
        chosen expert weighted 1 (a MoEfied dense MLP: with all experts active it is the
        dense MLP).
    `top_k` is also the inference-time knob: `dataclasses.replace(cfg.moe, top_k=...)` runs
    the same weights with fewer (or more) experts per token.
    """

    n_experts: int  # E
    top_k: int
    d_expert: int  # the hidden size of one expert
    router: str = "softmax"
    normalize: bool = False
    scale: float = 1.0  # routed_scaling_factor
    n_group: int = 1
    topk_group: int = 1
    router_bias: bool = False  # DeepSeek-V3's e_score_correction_bias (also "select"'s bias)
    d_shared: int = 0  # hidden size of the shared expert(s) together; 0: none
    shared_gate: bool = False  # Qwen-MoE scales the shared expert by sigmoid(x @ gate)

    def __post_init__(self):
        if self.router not in ("softmax", "sigmoid", "select"):
            raise ValueError(f"unknown MoE router {self.router!r} (softmax, sigmoid or select)")
        if not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} experts per token is not in 1..{self.n_experts}")
        if self.n_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"{self.n_experts} experts do not split into {self.n_group} groups "
                             f"of which {self.topk_group} are kept")
        if self.d_expert <= 0 or self.d_shared < 0:
            raise ValueError(f"expert sizes must be positive (d_expert={self.d_expert}, "
                             f"d_shared={self.d_shared})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MambaConfig:
    """A Mamba2 (SSD) mixer's shapes (HF Mamba2Config / NemotronH names in comments)."""

    n_heads: int  # num_heads (mamba_num_heads)
    head_dim: int  # head_dim (mamba_head_dim)
    n_groups: int  # n_groups: heads share B and C within a group
    d_state: int  # state_size (ssm_state_size)
    d_conv: int = 4  # conv_kernel
    chunk: int = 256  # chunk_size of the prefill scan
    dt_min: float = 0.0  # time_step_limit
    dt_max: float = math.inf

    def __post_init__(self):
        if self.n_groups <= 0 or self.n_heads % self.n_groups:
            raise ValueError(f"{self.n_heads} Mamba heads do not split into {self.n_groups} groups")
        if self.d_conv < 1 or self.chunk < 1:
            raise ValueError(f"conv kernel {self.d_conv} and chunk {self.chunk} must be positive")

    @property
    def d_inner(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.d_state

    def state_shapes(self, batch: int) -> dict[str, tuple[int, ...]]:
        """One layer's decode state per row, the same at any length: the conv windows (in the
        activation dtype) of the x channels (by head) and of the B, C channels (by group),
        and the SSM state (float32)."""
        return {"conv_x": (batch, self.d_conv - 1, self.n_heads, self.head_dim),
                "conv_bc": (batch, self.d_conv - 1, 2, self.n_groups, self.d_state),
                "ssm": (batch, self.n_heads, self.head_dim, self.d_state)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Any of jaxdec's families. Shapes use the project's letters: D model dim, N query
    heads, K kv heads, H head dim, F ffn dim, V vocab.

    `layer_types` gives each layer's sublayers, joined by "+": a mixer ("attention", "mla",
    "mamba") and/or a feed-forward ("mlp", "moe"). Empty means "attention+mlp" everywhere.
    """

    arch: str = "llama"  # the family, informational: behaviour comes from the fields
    vocab_size: int  # V
    d_model: int  # D
    n_layers: int
    n_heads: int  # N
    n_kv_heads: int  # K
    head_dim: int  # H
    d_ff: int  # F (the dense MLPs)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    attention_rope: bool = True  # False: attention layers without positions (Nemotron-H)
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of queries and keys before RoPE (Qwen3)
    mlp_act: str = "silu"  # "silu": SwiGLU (gate, up, down); "relu2": down(relu(up x)^2)
    layer_types: tuple[str, ...] = ()
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    mamba: MambaConfig | None = None
    max_position: int = 4096
    # How decode steps attend ("xla" | "pallas": `jaxdec.cache.kinds`); a run-time choice,
    # static under jit like the rest of the config.
    attention_impl: str = "xla"
    # Tokens that end a row's generation (EOS and the chat turn terminator).
    eos_ids: tuple[int, ...] = ()
    bos_id: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "head_dim", "d_ff"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.attention_impl not in ("xla", "pallas"):
            raise ValueError(f"unknown attention implementation {self.attention_impl!r} (xla or pallas)")
        if self.mlp_act not in ("silu", "relu2"):
            raise ValueError(f"unsupported MLP activation {self.mlp_act!r} (silu or relu2)")
        if self.layer_types and len(self.layer_types) != self.n_layers:
            raise ValueError(f"layer_types names {len(self.layer_types)} layers, "
                             f"n_layers is {self.n_layers}")
        for i, kind in enumerate(self.layer_types):
            mixer, ffn = split_layer_type(kind)
            for part, needs in ((mixer, "mla"), (mixer, "mamba"), (ffn, "moe")):
                if part == needs and getattr(self, needs) is None:
                    raise ValueError(f"layer {i} is {kind!r} but the config has no {needs} settings")

    @property
    def group(self) -> int:
        """G: query heads per kv head."""
        return self.n_heads // self.n_kv_heads

    @property
    def kinds(self) -> tuple[tuple[str | None, str | None], ...]:
        """(mixer, feed-forward) of every layer; None where a layer has no such sublayer."""
        types = self.layer_types or ("attention+mlp",) * self.n_layers
        return tuple(split_layer_type(t) for t in types)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        for name, sub in (("rope_scaling", RopeScaling), ("mla", MLAConfig), ("moe", MoEConfig),
                          ("mamba", MambaConfig)):
            if d.get(name) is not None:
                d[name] = sub(**d[name])
        d["eos_ids"] = tuple(d.get("eos_ids", ()))
        d["layer_types"] = tuple(d.get("layer_types", ()))
        return cls(**d)


def split_layer_type(kind: str) -> tuple[str | None, str | None]:
    """"mla+moe" -> ("mla", "moe"); "mamba" -> ("mamba", None); "mlp" -> (None, "mlp")."""
    parts = kind.split("+")
    mixer = parts[0] if parts[0] in MIXERS else None
    ffn = parts[-1] if parts[-1] in FFNS else None
    if len(parts) > 2 or [p for p in (mixer, ffn) if p] != parts:
        raise ValueError(f"unknown layer type {kind!r}: a mixer ({', '.join(MIXERS)}) and/or "
                         f"a feed-forward ({', '.join(FFNS)}), joined by '+'")
    return mixer, ffn
