"""Cache kinds by name: what `--kv-cache` and `jaxdec.load(kv_cache=...)` choose from.

A kind is one file under `jaxdec/cache/` that defines its entry class (the interface of
`jaxdec.cache.entry`) and registers how to make one for an attention layer:

    @registry.register("paged", summary="...", options=("page_size", ...))
    def make(cfg, layer, batch, max_len, dtype, **options) -> entry | None

`make` returns the layer's entry, or None where the kind keeps the dense entry (a window
ring on a global layer). `fits(cfg)`, if given, raises a one-line `JaxdecError` when the
model cannot take the kind. Layers without attention (MLA latents, Mamba states) keep
their own entries whatever the kind. The modules named in `_PROVIDERS` are imported on
the first lookup (`jaxdec.plugins.Registry`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxdec.errors import JaxdecError
from jaxdec.plugins import Registry

_PROVIDERS = ("jaxdec.cache.entry", "jaxdec.cache.paged", "jaxdec.cache.quantized",
              "jaxdec.cache.window")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Kind:
    """One registered cache kind."""

    name: str
    make: Callable[..., Any]  # (cfg, layer, batch, max_len, dtype, **options) -> entry | None
    summary: str
    options: tuple[str, ...] = ()  # the keyword options `make` takes
    fits: Callable[[Any], None] | None = None  # (cfg) -> None, or a one-line JaxdecError


_KINDS: Registry[Kind] = Registry("KV cache kind", _PROVIDERS)


def register(name: str, *, summary: str, options: tuple[str, ...] = (), fits=None):
    """Decorator: register `make` as the kind `name` (returned unchanged)."""
    def add(make):
        _KINDS.add(name, Kind(name=name, make=make, summary=summary, options=options, fits=fits))
        return make
    return add


def unregister(name: str) -> None:
    _KINDS.remove(name)


def names() -> tuple[str, ...]:
    """Every registered kind's name, in registration order."""
    return _KINDS.names()


def get(name: str) -> Kind:
    """The kind `name`; an unknown name raises a one-line JaxdecError."""
    return _KINDS.get(name)


def make(name: str, cfg, layer: int, batch: int, max_len: int, dtype, **options):
    """Layer `layer`'s entry of kind `name` (None: the dense entry); options the kind does
    not take are a one-line error."""
    kind = get(name)
    unknown = sorted(set(options) - set(kind.options))
    if unknown:
        takes = ", ".join(kind.options) or "no options"
        raise JaxdecError(f"the {name} KV cache takes {takes}, not {', '.join(unknown)}")
    return kind.make(cfg, layer, batch, max_len, dtype, **options)
