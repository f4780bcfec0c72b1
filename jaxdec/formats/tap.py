"""`Tap`: a marked matmul weight whose input activations a calibration pass records.

A calibration pass wraps the weights it wants to see in `Tap(w, name)` and traces the model
inside `recording()`; `layers.linear` hands each tapped input to `record`, which appends the
traced array to the innermost recording. The recorded values are tracers of the same trace
that produced them, so the jitted calibration function turns them into statistics and
returns those: nothing escapes the trace and the model code stays pure (one `isinstance`
check in `layers.linear`, like `QArray`'s).
"""

from __future__ import annotations

import contextlib
import dataclasses
from functools import partial
from typing import Any

import jax

_RECORDINGS: list[list[tuple[str, jax.Array]]] = []  # trace-time stack, innermost last


@partial(jax.tree_util.register_dataclass, data_fields=["w"], meta_fields=["name"])
@dataclasses.dataclass(frozen=True)
class Tap:
    """Weight `w` (an array or a `QArray`), recorded under `name` (a parameter path)."""

    w: Any
    name: str

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.w.shape)


@contextlib.contextmanager
def recording():
    """Collect `(name, x)` for every tapped matmul traced inside the block: x is the
    input flattened to [M, K] (M tokens, K contracted features)."""
    found: list[tuple[str, jax.Array]] = []
    _RECORDINGS.append(found)
    try:
        yield found
    finally:
        _RECORDINGS.pop()


def record(name: str, x2d: jax.Array) -> None:
    """Called by `layers.linear` with a tapped weight's flattened input."""
    if _RECORDINGS:
        _RECORDINGS[-1].append((name, x2d))
