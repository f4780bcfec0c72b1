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
        if not (self.top_k or self.top_p < 1.0 or self.min_p > 0.0):
            return x
        rows = lambda v, dtype: jnp.full(x.shape[:1], v, dtype)
        return _filter(x, rows(self.top_k, jnp.int32), rows(self.top_p, jnp.float32),
                       rows(self.min_p, jnp.float32))

    def __call__(self, logits: jax.Array, key: jax.Array) -> jax.Array:
        x = self.filter(logits)
        return draw(x, jax.random.uniform(key, x.shape[:1]))


# Tokens per block of `draw`'s two-level search.
_BLOCK = 256


def draw(x: jax.Array, u: jax.Array) -> jax.Array:
    """f32[R, V] logits (removed tokens -inf), u f32[R] uniform in [0, 1) -> i32[R]: the first
    token whose cumulative weight exp(x - max) exceeds u times the row's total, by blocks of
    256 (their sums, then the chosen block's tokens), never a removed token. One uniform a
    row instead of a Gumbel draw per token (`jax.random.categorical`: ~2 ms a row of 49152 on
    the CPU, most of it making random bits)."""
    r, v = x.shape
    nb = -(-v // _BLOCK)
    w = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    w = jnp.pad(w, ((0, 0), (0, nb * _BLOCK - v))).reshape(r, nb, _BLOCK)
    sums = jnp.sum(w, axis=-1)
    ends = jnp.cumsum(sums, axis=-1)
    target = (u * ends[:, -1])[:, None]
    last = lambda m: m.shape[-1] - 1 - jnp.argmax(m[..., ::-1], axis=-1)  # the last True
    block = jnp.minimum(jnp.sum(ends <= target, axis=-1), last(sums > 0))
    rows = jnp.arange(r)
    inside = w[rows, block]
    start = jnp.where(block > 0, ends[rows, jnp.maximum(block - 1, 0)], 0.0)
    within = jnp.minimum(jnp.sum(start[:, None] + jnp.cumsum(inside, axis=-1) <= target, axis=-1),
                         last(inside > 0))
    return (block * _BLOCK + within).astype(jnp.int32)


# How many of the most likely tokens top-k and top-p look at, in turn: a row whose cuts fall
# among the first 256 (top_k <= 256, and they hold top_p of the mass) is filtered from them,
# else from the first 4096, else from its whole sorted vocabulary. Sorting a row of 49152
# costs XLA on the CPU ~30 ms; its top 256, about 1.
CANDIDATES = (256, 4096)


def _filter(x: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """x f32[R, V] (temperature applied), per-row knobs [R] -> x with removed tokens -inf:
    top-k (ties with the k-th kept), top-p over the most likely tokens in stable order (the
    first kept), then min-p, as HF's warpers. Each row is computed from its `CANDIDATES`
    most likely tokens where its cuts fall among them, else from its whole sorted vocabulary:
    which one depends on the row alone, never on the other rows."""
    v = x.shape[-1]
    k = jnp.where((top_k > 0) & (top_k < v), top_k, v)

    def cut(c: int) -> tuple[jax.Array, jax.Array]:
        """(x after top-k and top-p from the c most likely tokens, whether that was exact)."""
        vals, idx = jax.lax.top_k(x, c)  # descending; ties: the lower index first
        # vals is read by reductions and elementwise ops only: a slice or a gather of it
        # makes XLA's CPU compiler sort the whole row instead of a top-k call
        kth = jnp.min(jnp.where(jnp.arange(c) < k[:, None], vals, jnp.inf), axis=-1)
        kth = jnp.where(k <= c, kth, -jnp.inf)
        top = jnp.max(vals, axis=-1, keepdims=True)
        xk = jnp.where(x < kth[:, None], _REMOVED, x)
        vk = jnp.where(vals < kth[:, None], _REMOVED, vals)
        z = jnp.sum(jnp.exp(xk - top), axis=-1, keepdims=True)
        probs = jnp.exp(vk - top) / z
        mass = jnp.cumsum(probs, axis=-1)
        keep = (mass - probs < top_p[:, None]).at[:, 0].set(True)
        rows = jnp.arange(x.shape[0])[:, None]
        kept = jnp.zeros(x.shape, bool).at[rows, idx].set(keep)
        out = jnp.where((top_p[:, None] >= 1.0) | kept, xk, _REMOVED)
        exact = (c == v) | (((k <= c) | (k == v)) & ((top_p >= 1.0) | (mass[:, -1] >= top_p)))
        return out, exact

    def widen(levels, out, exact):
        """Rows not yet exact from the next level's candidates (the last: all of them)."""
        if not levels:
            return out

        def more():
            wide, ok = cut(levels[0])
            return widen(levels[1:], jnp.where(exact[:, None], out, wide), exact | ok)

        return jax.lax.cond(jnp.all(exact), lambda: out, more)

    levels = [c for c in CANDIDATES if c < v] + [v]
    out = widen(levels[1:], *cut(levels[0]))
    probs = jax.nn.softmax(out, axis=-1)
    low = (probs < min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)) & (min_p[:, None] > 0)
    return jnp.where(low, _REMOVED, out)


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
    top-k, top-p, min-p in that order; removed tokens -inf)."""
    x = logits.astype(jnp.float32) / jnp.where(p.temperature > 0, p.temperature, 1.0)[:, None]
    filters = jnp.any((p.temperature > 0) & ((p.top_k > 0) | (p.top_p < 1.0) | (p.min_p > 0)))
    return jax.lax.cond(filters, lambda: _filter(x, p.top_k, p.top_p, p.min_p), lambda: x)


def sample_rows(logits: jax.Array, p: RowParams, keys: jax.Array) -> jax.Array:
    """f32[R, V], per-row settings and keys ([R] typed keys) -> i32[R]: argmax where the
    temperature is 0, else a draw from the row's filtered distribution with its own key
    (so a row's draw does not depend on the other rows)."""
    drawn = draw(filter_rows(logits, p), jax.vmap(jax.random.uniform)(keys))
    greedy = jnp.argmax(logits, axis=-1)
    return jnp.where(p.temperature > 0, drawn, greedy).astype(jnp.int32)
