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

from jaxdec.errors import JaxdecError

MIXERS = ("attention", "mla", "mamba")
FFNS = ("mlp", "moe")


class ConfigError(JaxdecError, ValueError):
    """A config whose fields contradict each other (one line; a `ValueError` too, as config
    errors always were)."""


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
            raise ConfigError(f"unsupported RoPE scaling {self.kind!r} (llama3, linear or yarn)")

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
            raise ConfigError(f"unknown MoE router {self.router!r} (softmax, sigmoid or select)")
        if not 0 < self.top_k <= self.n_experts:
            raise ConfigError(f"top_k={self.top_k} experts per token is not in 1..{self.n_experts}")
        if self.n_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ConfigError(f"{self.n_experts} experts do not split into {self.n_group} groups "
                              f"of which {self.topk_group} are kept")
        if self.d_expert <= 0 or self.d_shared < 0:
            raise ConfigError(f"expert sizes must be positive (d_expert={self.d_expert}, "
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
            raise ConfigError(f"{self.n_heads} Mamba heads do not split into {self.n_groups} groups")
        if self.d_conv < 1 or self.chunk < 1:
            raise ConfigError(f"conv kernel {self.d_conv} and chunk {self.chunk} must be positive")

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
    mlp_act: str = "silu"  # "silu": SwiGLU (gate, up, down); "relu2": down(relu(up x)^2);
    # "gelu_tanh": GeGLU with the tanh approximation (Gemma)
    layer_types: tuple[str, ...] = ()
    # Each attention layer's sliding window (keys at most window - 1 positions back), None
    # for a global layer; empty: every layer global. See `window`.
    layer_windows: tuple[int | None, ...] = ()
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
    # Gemma 3, all off by default: embeddings times `embed_scale` (sqrt(D)); an RMSNorm on each
    # sublayer's output before the residual add (`post_norms`); attention scores times
    # `query_scale` (None: H ** -0.5); windowed layers rotated with base `rope_local_theta` and
    # no scaling (None: as the global layers).
    embed_scale: float | None = None
    post_norms: bool = False
    query_scale: float | None = None
    rope_local_theta: float | None = None
    # Per-layer widths (a pruned model): each layer's query heads, kv heads and dense-MLP
    # width; empty: n_heads, n_kv_heads, d_ff in every layer. See `heads`, `kv_heads`,
    # `ffn_width`. head_dim stays the same in every layer.
    layer_heads: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    layer_ffn: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "head_dim", "d_ff"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.attention_impl not in ("xla", "pallas"):
            raise ConfigError(f"unknown attention implementation {self.attention_impl!r} (xla or pallas)")
        if self.mlp_act not in ("silu", "relu2", "gelu_tanh"):
            raise ConfigError(f"unsupported MLP activation {self.mlp_act!r} (silu, relu2 or gelu_tanh)")
        for name in ("embed_scale", "query_scale", "rope_local_theta"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.layer_types and len(self.layer_types) != self.n_layers:
            raise ConfigError(f"layer_types names {len(self.layer_types)} layers, "
                              f"n_layers is {self.n_layers}")
        if self.layer_windows and len(self.layer_windows) != self.n_layers:
            raise ConfigError(f"layer_windows names {len(self.layer_windows)} layers, "
                              f"n_layers is {self.n_layers}")
        if any(w is not None and w <= 0 for w in self.layer_windows):
            raise ConfigError(f"sliding windows must be positive, got {self.layer_windows}")
        for i, kind in enumerate(self.layer_types):
            mixer, ffn = split_layer_type(kind)
            for part, needs in ((mixer, "mla"), (mixer, "mamba"), (ffn, "moe")):
                if part == needs and getattr(self, needs) is None:
                    raise ConfigError(f"layer {i} is {kind!r} but the config has no {needs} settings")
        self._check_widths()

    def _check_widths(self) -> None:
        for name in ("layer_heads", "layer_kv_heads", "layer_ffn"):
            widths = getattr(self, name)
            if widths and len(widths) != self.n_layers:
                raise ConfigError(f"{name} names {len(widths)} layers, n_layers is {self.n_layers}")
            if any(not isinstance(w, int) or w <= 0 for w in widths):
                raise ConfigError(f"{name} must be positive ints, got {widths}")
        for i in range(self.n_layers if self.layer_heads or self.layer_kv_heads else 0):
            if self.heads(i) % self.kv_heads(i):
                raise ConfigError(f"layer {i}: {self.heads(i)} query heads are not a multiple of "
                                  f"its {self.kv_heads(i)} kv heads")
        for i, (mixer, ffn) in enumerate(self.kinds if not self.uniform_widths else ()):
            # only attention and dense-MLP sublayers are declared with per-layer widths
            attn = (self.heads(i), self.kv_heads(i)) != (self.n_heads, self.n_kv_heads)
            if (attn and mixer != "attention") or (self.ffn_width(i) != self.d_ff and ffn != "mlp"):
                raise ConfigError(f"layer {i} is {'+'.join(filter(None, (mixer, ffn)))!r}: per-layer "
                                  "widths apply to attention heads and dense MLPs only")

    def heads(self, i: int) -> int:
        """N of layer i (query heads of its attention or MLA mixer)."""
        return self.layer_heads[i] if self.layer_heads else self.n_heads

    def kv_heads(self, i: int) -> int:
        """K of layer i (the kv heads its cache entry holds)."""
        return self.layer_kv_heads[i] if self.layer_kv_heads else self.n_kv_heads

    def ffn_width(self, i: int) -> int:
        """F of layer i's dense MLP."""
        return self.layer_ffn[i] if self.layer_ffn else self.d_ff

    @property
    def uniform_widths(self) -> bool:
        """Every layer has n_heads, n_kv_heads and d_ff (no per-layer widths)."""
        return not (self.layer_heads or self.layer_kv_heads or self.layer_ffn)

    def window(self, i: int) -> int | None:
        """Layer i's sliding window (a query at position p sees keys at p - window + 1 .. p),
        or None when it attends to its whole past."""
        return self.layer_windows[i] if self.layer_windows else None

    @property
    def group(self) -> int:
        """G: query heads per kv head."""
        return self.n_heads // self.n_kv_heads

    @property
    def kinds(self) -> tuple[tuple[str | None, str | None], ...]:
        """(mixer, feed-forward) of every layer; None where a layer has no such sublayer."""
        types = self.layer_types or ("attention+mlp",) * self.n_layers
        return tuple(split_layer_type(t) for t in types)

    def rope_of(self, window: int | None) -> tuple[float, RopeScaling | None]:
        """The RoPE base and scaling of a layer with sliding window `window` (`window(i)`):
        `rope_local_theta`, unscaled, on a windowed layer when that is set (Gemma 3's local
        layers), else `rope_theta` and `rope_scaling`."""
        if window is not None and self.rope_local_theta is not None:
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

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
        d["layer_windows"] = tuple(d.get("layer_windows", ()))
        for name in ("layer_heads", "layer_kv_heads", "layer_ffn"):
            d[name] = tuple(d.get(name, ()))
        return cls(**d)


def split_layer_type(kind: str) -> tuple[str | None, str | None]:
    """"mla+moe" -> ("mla", "moe"); "mamba" -> ("mamba", None); "mlp" -> (None, "mlp")."""
    parts = kind.split("+")
    mixer = parts[0] if parts[0] in MIXERS else None
    ffn = parts[-1] if parts[-1] in FFNS else None
    if len(parts) > 2 or [p for p in (mixer, ffn) if p] != parts:
        raise ConfigError(f"unknown layer type {kind!r}: a mixer ({', '.join(MIXERS)}) and/or "
                          f"a feed-forward ({', '.join(FFNS)}), joined by '+'")
    return mixer, ffn
