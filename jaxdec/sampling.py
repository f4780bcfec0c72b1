"""Samplers: frozen dataclasses, static under jit, seeded by an explicit key.

`Greedy()` takes the argmax. `Sample(temperature, top_k, top_p, min_p)` filters the logits
in HF transformers' order (temperature, then top-k, then top-p, then min-p) and draws
from what is left. `Temperature`, `TopK`, `TopP` and `MinP` are the single-knob forms.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxdec.errors import JaxdecError

_REMOVED = -jnp.inf


@dataclasses.dataclass(frozen=True, kw_only=True)
class Greedy:
    def __call__(self, logits: jax.Array, key: jax.Array) -> jax.Array:
        """f32[B, V] -> i32[B]."""
        del key
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sample:
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off

    def __post_init__(self):
        if not self.temperature > 0:
            raise JaxdecError(f"temperature must be > 0 to sample (got {self.temperature}); "
                              "use Greedy() or --temperature 0 for greedy decoding")
        if self.top_k < 0:
            raise JaxdecError(f"top_k must be >= 0 (got {self.top_k})")
        if not 0 < self.top_p <= 1:
            raise JaxdecError(f"top_p must be in (0, 1] (got {self.top_p})")
        if not 0 <= self.min_p <= 1:
            raise JaxdecError(f"min_p must be in [0, 1] (got {self.min_p})")

    def filter(self, logits: jax.Array) -> jax.Array:
        """f32[B, V] logits with removed tokens set to -inf (temperature applied)."""
        x = logits.astype(jnp.float32) / self.temperature
        if self.top_k and self.top_k < x.shape[-1]:
            kth = jax.lax.top_k(x, self.top_k)[0][:, -1:]
            x = jnp.where(x < kth, _REMOVED, x)
        if self.top_p < 1.0:
            x = _top_p(x, self.top_p)
        if self.min_p > 0.0:
            probs = jax.nn.softmax(x, axis=-1)
            threshold = self.min_p * jnp.max(probs, axis=-1, keepdims=True)
            x = jnp.where(probs < threshold, _REMOVED, x)
        return x

    def __call__(self, logits: jax.Array, key: jax.Array) -> jax.Array:
        return jax.random.categorical(key, self.filter(logits), axis=-1).astype(jnp.int32)


def _top_p(x: jax.Array, p: float) -> jax.Array:
    """Keep the smallest set of most likely tokens whose mass reaches p (at least one)."""
    order = jnp.argsort(-x, axis=-1)
    sorted_x = jnp.take_along_axis(x, order, axis=-1)
    probs = jax.nn.softmax(sorted_x, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = mass_before < p
    keep_sorted = keep_sorted.at[:, 0].set(True)
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(x.shape[0])[:, None], order].set(keep_sorted)
    return jnp.where(keep, x, _REMOVED)


def Temperature(temperature: float) -> Sample:  # noqa: N802 (a sampler constructor)
    return Sample(temperature=temperature)


def TopK(k: int, temperature: float = 1.0) -> Sample:  # noqa: N802
    return Sample(top_k=k, temperature=temperature)


def TopP(p: float, temperature: float = 1.0) -> Sample:  # noqa: N802
    return Sample(top_p=p, temperature=temperature)


def MinP(p: float, temperature: float = 1.0) -> Sample:  # noqa: N802
    return Sample(min_p=p, temperature=temperature)


Sampler = Greedy | Sample


def make_sampler(*, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 min_p: float = 0.0) -> Sampler:
    """From CLI-style knobs: temperature 0 means greedy (the other knobs are still checked)."""
    if temperature < 0:
        raise JaxdecError(f"temperature must be >= 0 (got {temperature})")
    sampler = Sample(temperature=temperature or 1.0, top_k=top_k, top_p=top_p, min_p=min_p)
    return Greedy() if temperature == 0 else sampler
