"""Frozen model configs.

A config is keyword-only, frozen and hashable, so it is passed to `jax.jit` as a static
argument; variants come from `dataclasses.replace`. Checkpoint formats (GGUF keys, HF
config.json names) are mapped onto these fields in `jaxdec.checkpoint`, never in the model.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling (HF `rope_type="llama3"`).

    Wavelengths longer than `original_max_position / low_freq_factor` are divided by
    `factor`; shorter than `original_max_position / high_freq_factor` are kept; the band
    between is interpolated smoothly. `kind="linear"` divides every frequency by `factor`.
    """

    kind: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self):
        if self.kind not in ("llama3", "linear"):
            raise ValueError(f"unsupported RoPE scaling {self.kind!r} (llama3 or linear)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The Llama family: Llama 2/3, SmolLM2, Qwen2 (QKV bias), tied or untied embeddings.

    Shapes use the project's letters: D model dim, N query heads, K kv heads, H head dim,
    F ffn dim, V vocab.
    """

    arch: str = "llama"  # "llama" | "qwen2": informational; behaviour comes from the fields
    vocab_size: int  # V
    d_model: int  # D
    n_layers: int
    n_heads: int  # N
    n_kv_heads: int  # K
    head_dim: int  # H
    d_ff: int  # F
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = False
    qkv_bias: bool = False
    max_position: int = 4096
    # Tokens that end a row's generation (EOS and the chat turn terminator).
    eos_ids: tuple[int, ...] = ()
    bos_id: int | None = None

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "head_dim", "d_ff"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def group(self) -> int:
        """G: query heads per kv head."""
        return self.n_heads // self.n_kv_heads

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_ids"] = tuple(d.get("eos_ids", ()))
        return cls(**d)
