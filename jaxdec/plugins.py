"""One registry type for every plug-in point that is chosen by name (weight transforms,
cache kinds): entries registered by the modules that define them, which the registry
imports by name on its first lookup (so a registry module imports nothing heavy, and the
providers import it, not the reverse)."""

from __future__ import annotations

import importlib
from typing import Generic, TypeVar

from jaxdec.errors import JaxdecError

T = TypeVar("T")


class Registry(Generic[T]):
    """Named entries of one kind: `what` names the kind in errors ("weight transform");
    `providers` are the modules whose import registers the built-in entries."""

    def __init__(self, what: str, providers: tuple[str, ...]):
        self.what, self.providers = what, providers
        self.entries: dict[str, T] = {}
        self._loaded = False

    def add(self, name: str, entry: T) -> None:
        if name in self.entries:
            raise ValueError(f"{self.what} {name!r} is registered twice")
        self.entries[name] = entry

    def remove(self, name: str) -> None:
        del self.entries[name]

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True
            for module in self.providers:
                importlib.import_module(module)

    def names(self) -> tuple[str, ...]:
        """Every registered name, in registration order."""
        self._load()
        return tuple(self.entries)

    def get(self, name: str) -> T:
        """The entry `name`; an unknown name raises a one-line JaxdecError."""
        self._load()
        if name not in self.entries:
            raise JaxdecError(f"unknown {self.what} {name!r} (one of {', '.join(self.entries)})")
        return self.entries[name]
