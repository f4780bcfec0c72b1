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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowParams:
    """Sampling settings as data, one per row, so one compiled step serves any mix of
    requests (the engine's). temperature 0 means greedy for that row; top_k 0, top_p 1
    and min_p 0 are off, as in `Sample`."""

    temperature: jax.Array  # f32[R]
    top_k: jax.Array        # i32[R]
    top_p: jax.Array        # f32[R]
    min_p: jax.Array        # f32[R]

    @classmethod
    def of(cls, samplers) -> "RowParams":
        """From one `Greedy` or `Sample` per row."""
        get = lambda name, off: [getattr(s, name, off) for s in samplers]
        temps = [s.temperature if isinstance(s, Sample) else 0.0 for s in samplers]
        return cls(temperature=jnp.asarray(temps, jnp.float32),
                   top_k=jnp.asarray(get("top_k", 0), jnp.int32),
                   top_p=jnp.asarray(get("top_p", 1.0), jnp.float32),
                   min_p=jnp.asarray(get("min_p", 0.0), jnp.float32))


def filter_rows(logits: jax.Array, p: RowParams) -> jax.Array:
    """f32[R, V] -> what `Sample(...).filter` gives each sampled row alone (temperature,
    top-k, top-p, min-p in that order; removed tokens -inf), from one sort of the batch."""
    x = logits.astype(jnp.float32) / jnp.where(p.temperature > 0, p.temperature, 1.0)[:, None]
    v = x.shape[-1]
    order = jnp.argsort(-x, axis=-1)  # stable, as `_top_p`'s
    sx = jnp.take_along_axis(x, order, axis=-1)
    k = jnp.where((p.top_k > 0) & (p.top_k < v), p.top_k, v)
    kth = jnp.take_along_axis(sx, (k - 1)[:, None], axis=-1)
    sx = jnp.where(sx < kth, _REMOVED, sx)
    probs = jax.nn.softmax(sx, axis=-1)
    keep = (jnp.cumsum(probs, axis=-1) - probs < p.top_p[:, None]) | (p.top_p[:, None] >= 1.0)
    sx = jnp.where(keep.at[:, 0].set(True), sx, _REMOVED)
    probs = jax.nn.softmax(sx, axis=-1)
    low = (probs < p.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)) & (p.min_p[:, None] > 0)
    sx = jnp.where(low, _REMOVED, sx)
    rows = jnp.arange(x.shape[0])[:, None]
    return jnp.zeros_like(x).at[rows, order].set(sx)


def sample_rows(logits: jax.Array, p: RowParams, keys: jax.Array) -> jax.Array:
    """f32[R, V], per-row settings and keys ([R] typed keys) -> i32[R]: argmax where the
    temperature is 0, else a draw from the row's filtered distribution with its own key
    (so a row's draw does not depend on the other rows)."""
    drawn = jax.vmap(lambda k, x: jax.random.categorical(k, x))(keys, filter_rows(logits, p))
    greedy = jnp.argmax(logits, axis=-1)
    return jnp.where(p.temperature > 0, drawn, greedy).astype(jnp.int32)
