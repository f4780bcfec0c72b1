"""jaxdec: a JAX/XLA decoding stack for large language models, written as pure functions."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# The public names, imported on first use: `python -m jaxdec` parses its arguments (and
# answers --help or a usage error) before it pays for importing jax.
_EXPORTS = {
    "GenerateResult": "jaxdec.api", "Model": "jaxdec.api", "generate": "jaxdec.api",
    "load": "jaxdec.api", "save": "jaxdec.api", "score": "jaxdec.api",
    "init_cache": "jaxdec.api", "shard": "jaxdec.api", "mesh_decode_step": "jaxdec.api",
    "ModelConfig": "jaxdec.config", "RopeScaling": "jaxdec.config",
    "JaxdecError": "jaxdec.errors",
    "Engine": "jaxdec.engine.engine", "SamplingParams": "jaxdec.engine.request",
    "Greedy": "jaxdec.sampling", "MinP": "jaxdec.sampling", "Sample": "jaxdec.sampling",
    "Temperature": "jaxdec.sampling", "TopK": "jaxdec.sampling", "TopP": "jaxdec.sampling",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from jaxdec.api import (GenerateResult, Model, generate, init_cache, load, mesh_decode_step,
                            save, score, shard)
    from jaxdec.config import ModelConfig, RopeScaling
    from jaxdec.engine.engine import Engine
    from jaxdec.engine.request import SamplingParams
    from jaxdec.errors import JaxdecError
    from jaxdec.sampling import Greedy, MinP, Sample, Temperature, TopK, TopP


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    try:  # `import jaxdec` used to import the submodules too (jaxdec.api, jaxdec.decode, ...)
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
