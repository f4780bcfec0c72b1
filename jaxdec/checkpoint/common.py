"""What every checkpoint reader returns, and the Hugging Face tensor layout it promises.

A reader (GGUF, HF safetensors, orbax) maps its format onto one `Checkpoint`: a
`ModelConfig`, float32 tensors under Hugging Face names in Hugging Face shapes, the
tokenizer, and the type each tensor was stored as. Everything downstream (the param
builder, `jaxdec info`, `jaxdec convert`) reads only this.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable

import numpy as np

from jaxdec.checkpoint.hf_layout import hf_tensor_shapes
from jaxdec.checkpoint.tokenizer import Tokenizer
from jaxdec.config import ModelConfig
from jaxdec.errors import JaxdecError


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A model's config, weights and tokenizer, format-independent.

    Invariants (checked by `validate`):
      - `set(tensors) == set(hf_tensor_shapes(config))`: every expected tensor is present,
        nothing else is; `lm_head.weight` is present iff `not config.tie_embeddings`.
      - each tensor is a float32 `np.ndarray` with the shape `hf_tensor_shapes` gives
        (`[out, in]` for linear weights, `[V, D]` for the embedding).
      - `tensor_types` has the same keys; values name the stored type ('Q4_1', 'BF16', ...).
      - `blocks` (optional) maps some linear weights' names to a `QArray` of the [in, out]
        matrix holding exactly the same values: a GGUF file's own Q4/Q8 blocks, kept so
        a quantised load can use them instead of requantising.
    """

    config: ModelConfig
    tensors: dict[str, np.ndarray]
    tokenizer: Tokenizer
    tensor_types: dict[str, str]
    blocks: dict[str, Any] = dataclasses.field(default_factory=dict)


class LazyTensors(Mapping):
    """HF-named float32 tensors, each read from its file when it is looked up and not kept:
    building parameters from it holds one tensor at a time on the host (a sharded load
    places each one's slices, then drops it). `shapes` are known without reading."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], read: Callable[[str], np.ndarray]):
        self.shapes, self._read = dict(shapes), read

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.shapes:
            raise KeyError(name)
        return self._read(name)

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def missing_tensors_error(source: str, missing: list[str]) -> JaxdecError:
    """One line naming the first few missing tensors and how many there are."""
    shown = ", ".join(repr(m) for m in sorted(missing)[:3])
    more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
    return JaxdecError(f"{source}: missing {len(missing)} tensor(s): {shown}{more}")


def validate(ckpt: Checkpoint, source: str) -> Checkpoint:
    """Check the `Checkpoint` invariants; raise a one-line JaxdecError naming the first breach."""
    expected = hf_tensor_shapes(ckpt.config)
    missing = [n for n in expected if n not in ckpt.tensors]
    if missing:
        raise missing_tensors_error(source, missing)
    lazy = isinstance(ckpt.tensors, LazyTensors)
    for name in ckpt.tensors:
        if name not in expected:
            raise JaxdecError(f"{source}: unexpected tensor {name!r}")
        arr = None if lazy else ckpt.tensors[name]
        shape = tuple(ckpt.tensors.shapes[name] if lazy else arr.shape)
        if shape != expected[name]:
            raise JaxdecError(f"{source}: tensor {name!r} has shape {shape}, "
                              f"expected {expected[name]} from the config")
        if arr is not None and arr.dtype != np.float32:  # a lazy read converts to float32
            raise JaxdecError(f"{source}: tensor {name!r} is {arr.dtype}, expected float32")
    return ckpt
