"""Per-row sampling settings as data (the engine's sampler) against `Sample` on each row
alone, which is itself checked against HF's logits warpers (tests/test_sampling.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from jaxdec.sampling import Greedy, RowParams, Sample, draw, filter_rows, sample_rows

ROW = st.one_of(
    st.just(Greedy()),
    st.builds(Sample, temperature=st.floats(0.2, 2.0), top_k=st.sampled_from([0, 1, 3, 17, 64]),
              top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1]), min_p=st.sampled_from([0.0, 0.05, 0.3])))

filter_jit = jax.jit(filter_rows)
sample_jit = jax.jit(sample_rows)


def inverse_cdf(x: np.ndarray, u: float) -> int:
    """float64: the first token whose cumulative softmax mass exceeds u."""
    w = np.exp(np.asarray(x, np.float64) - np.max(x))
    return int(np.searchsorted(np.cumsum(w), u * w.sum(), side="right"))


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(ROW, min_size=1, max_size=6), seed=st.integers(0, 2**31 - 1),
       ties=st.booleans())
def test_each_row_filters_and_draws_as_its_sampler_alone(rows, seed, ties):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3, (len(rows), 64)).astype(np.float32)
    if ties:  # repeated values, where top-k and top-p must break ties as `Sample` does
        logits = np.round(logits)
    p = RowParams.of(rows)
    got = np.asarray(filter_jit(jnp.asarray(logits), p))
    keys = jax.random.split(jax.random.key(seed), len(rows))
    drawn = np.asarray(sample_jit(jnp.asarray(logits), p, keys))
    for r, s in enumerate(rows):
        if isinstance(s, Greedy):
            assert drawn[r] == np.argmax(logits[r])
            continue
        want = np.asarray(s.filter(jnp.asarray(logits[r:r + 1])))[0]
        np.testing.assert_array_equal(np.isinf(got[r]), np.isinf(want))
        np.testing.assert_allclose(got[r][~np.isinf(got[r])], want[~np.isinf(want)], rtol=1e-6)
        assert drawn[r] == inverse_cdf(want, float(jax.random.uniform(keys[r])))
        assert not np.isinf(want[drawn[r]])


def test_a_rows_draw_does_not_depend_on_the_other_rows():
    rng = np.random.default_rng()
    logits = jnp.asarray(rng.normal(0, 2, (4, 100)), jnp.float32)
    rows = [Sample(temperature=1.0, top_p=0.9), Greedy(), Sample(temperature=0.7), Sample(top_k=5)]
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 4)
    full = np.asarray(sample_jit(logits, RowParams.of(rows), keys))
    for r in range(4):
        alone = np.asarray(sample_jit(logits[r:r + 1], RowParams.of(rows[r:r + 1]), keys[r:r + 1]))
        assert alone[0] == full[r]


def test_rows_past_the_candidates_match_hf_and_do_not_depend_on_the_batch():
    """A vocabulary larger than `sampling.CANDIDATES`: rows whose cuts fall among the 256
    most likely tokens, among the 4096 most likely, and rows that need all of them sorted
    (top_k above 4096, top_p not reached within them), each as HF's warpers filter it, and the
    same bits alone as beside rows of the other kinds."""
    from test_sampling import hf_filter

    rng = np.random.default_rng()
    v = 6000
    peaked, flat = rng.normal(0, 4, v), rng.normal(0, 0.3, v)
    rows = [(Sample(temperature=0.9, top_k=40), peaked), (Sample(top_p=0.9), peaked),
            (Sample(top_p=0.999), flat), (Sample(top_k=300), flat), (Sample(top_p=0.5), flat),
            (Sample(top_k=5000), flat),
            (Sample(top_k=300, top_p=0.5, min_p=0.1), peaked), (Sample(min_p=0.05), flat),
            (Sample(temperature=1.3, top_p=0.95, min_p=0.02), peaked)]
    logits = np.stack([x for _, x in rows]).astype(np.float32)
    # every kind is here: the top 256 of `peaked` hold 0.9 of its mass; of `flat`, the top 256
    # do not hold 0.5, the top 4096 do, and not 0.999
    mass = lambda x, n: (lambda e: e[:n].sum() / e.sum())(np.sort(np.exp(x - x.max()))[::-1])
    assert mass(peaked, 256) > 0.95 and mass(flat, 256) < 0.5 < mass(flat, 4096) < 0.99
    samplers = [s for s, _ in rows]
    got = np.asarray(filter_jit(jnp.asarray(logits), RowParams.of(samplers)))
    for r, s in enumerate(samplers):
        want = hf_filter(s, logits[r:r + 1])[0]
        np.testing.assert_array_equal(np.isneginf(got[r]), np.isneginf(want), err_msg=str(s))
        np.testing.assert_allclose(got[r][~np.isneginf(want)], want[~np.isneginf(want)], rtol=1e-6)
        alone = np.asarray(filter_jit(jnp.asarray(logits[r:r + 1]), RowParams.of([s])))[0]
        np.testing.assert_array_equal(alone, got[r], err_msg=str(s))
        np.testing.assert_array_equal(np.asarray(s.filter(jnp.asarray(logits[r:r + 1])))[0], got[r])


def test_draw_maps_uniforms_onto_the_distribution():
    """`draw` is a function of one uniform a row: over a fine grid of uniforms, each token's
    share is its softmax probability to within the grid's step (blocks of 256 tokens, some
    tokens and a whole block removed, a short last block), and a removed token never comes."""
    rng = np.random.default_rng()
    v, n = 700, 50_000
    x = rng.normal(0, 1.5, v)
    x[rng.random(v) < 0.3] = -np.inf
    x[256:512] = -np.inf
    p = np.exp(x - x.max())
    p /= p.sum()
    u = (np.arange(n) + 0.5) / n
    tokens = np.asarray(jax.jit(draw)(jnp.broadcast_to(jnp.asarray(x, jnp.float32), (n, v)),
                                      jnp.asarray(u, jnp.float32)))
    assert np.all(np.isfinite(x[tokens]))
    share = np.bincount(tokens, minlength=v) / n
    np.testing.assert_allclose(share, p, atol=3 / n)
