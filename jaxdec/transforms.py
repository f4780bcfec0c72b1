"""Weight transforms: one signature, one registry.

    params, cfg = transforms.apply("gptq", params, cfg, calib, bits=4, group_size=128)

A transform is `fn(params, cfg, calib, **options) -> (params, cfg)`: a model's params and
config (and calibration tokens i32[n, T], `calibrate.calibration_tokens`, or None) in, the
transformed model's out. The config comes back too because some transforms change it
(MoEfication turns MLP layers into MoE layers; rotations untie the LM head). `jaxdec
quantize`, the quality table and the MoEfication script all go through `apply`.

A module defining transforms registers them with `@register(name, needs_calib=...,
summary=...)` and is named in `_PROVIDERS`, which the registry (`jaxdec.plugins.Registry`)
imports on its first lookup.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxdec.errors import JaxdecError
from jaxdec.plugins import Registry

# fn(params, cfg, calib, **options) -> (params, cfg)
Transform = Callable[..., tuple[Any, Any]]

# the modules whose import registers their transforms
_PROVIDERS = ("jaxdec.quant.methods", "jaxdec.quant.kurtail", "jaxdec.models.moefy")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Entry:
    """One registered transform."""

    name: str
    fn: Transform
    needs_calib: bool
    summary: str


_REGISTRY: Registry[Entry] = Registry("weight transform", _PROVIDERS)


def register(name: str, *, needs_calib: bool, summary: str):
    """Decorator: register `fn` under `name` (returned unchanged)."""
    def add(fn: Transform) -> Transform:
        _REGISTRY.add(name, Entry(name=name, fn=fn, needs_calib=needs_calib, summary=summary))
        return fn
    return add


def names() -> tuple[str, ...]:
    """Every registered transform's name, in registration order."""
    return _REGISTRY.names()


def get(name: str) -> Entry:
    """The transform `name`; an unknown name raises a one-line JaxdecError."""
    return _REGISTRY.get(name)


def apply(name: str, params, cfg, calib=None, **options):
    """(params, cfg) of transform `name` applied with `options`; one that needs
    calibration tokens and gets none raises a one-line JaxdecError before any work."""
    entry = get(name)
    if entry.needs_calib and calib is None:
        raise JaxdecError(f"{name} needs calibration tokens")
    return entry.fn(params, cfg, calib, **options)
