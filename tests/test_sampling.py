"""Samplers against HF transformers' logits warpers, and the sampled distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy import stats
from transformers.generation import logits_process as lp

from conftest import assert_fits
from jaxdec.errors import JaxdecError
from jaxdec.sampling import Greedy, MinP, Sample, TopK, TopP, make_sampler

CASES = [
    Sample(temperature=0.7),
    TopK(17, temperature=1.3),
    TopP(0.8),
    MinP(0.05, temperature=0.9),
    Sample(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02),
]


def hf_filter(s: Sample, logits: np.ndarray) -> np.ndarray:
    """HF's warpers in HF's order: temperature, top-k, top-p, min-p."""
    procs = [lp.TemperatureLogitsWarper(s.temperature)]
    if s.top_k:
        procs.append(lp.TopKLogitsWarper(s.top_k))
    if s.top_p < 1:
        procs.append(lp.TopPLogitsWarper(s.top_p))
    if s.min_p > 0:
        procs.append(lp.MinPLogitsWarper(s.min_p))
    x = torch.as_tensor(logits)
    for p in procs:
        x = p(None, x)
    return x.numpy()


@pytest.mark.parametrize("sampler", CASES, ids=str)
def test_filter_matches_hf_warpers(sampler):
    logits = np.random.default_rng().normal(0, 3, (4, 1000)).astype(np.float32)
    ours = np.asarray(sampler.filter(jnp.asarray(logits)))
    ref = hf_filter(sampler, logits)
    np.testing.assert_array_equal(np.isneginf(ours), np.isneginf(ref))
    kept = ~np.isneginf(ref)
    np.testing.assert_allclose(ours[kept], ref[kept], rtol=1e-6)


def test_samples_follow_filtered_distribution():
    """Chi-squared goodness of fit of 20k draws against softmax(filtered logits)."""
    sampler = Sample(temperature=0.9, top_k=12, top_p=0.95)
    logits = jnp.asarray(np.random.default_rng().normal(0, 1.5, (1, 40)), jnp.float32)
    probs = np.asarray(jax.nn.softmax(sampler.filter(logits)[0]), np.float64)
    probs /= probs.sum()
    kept = probs > 0

    def pvalue(seed):
        keys = jax.random.split(jax.random.key(seed), 20000)
        draws = np.asarray(jax.vmap(lambda k: sampler(logits, k)[0])(keys))
        assert probs[draws].min() > 0  # never a filtered-out token
        counts = np.bincount(draws, minlength=40)[kept]
        return stats.chisquare(counts, probs[kept] * len(draws)).pvalue

    assert_fits(pvalue)


def test_seeded_and_reproducible():
    logits = jnp.asarray(np.random.default_rng().normal(0, 1, (8, 500)), jnp.float32)
    s = Sample(temperature=1.0, top_p=0.9)
    a, b = s(logits, jax.random.key(3)), s(logits, jax.random.key(3))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, s(logits, jax.random.key(4)))
    np.testing.assert_array_equal(Greedy()(logits, None), np.argmax(logits, -1))


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5),
                                    dict(top_k=-1), dict(min_p=1.2)])
def test_bad_knobs_are_one_line_errors(kwargs):
    with pytest.raises(JaxdecError) as e:
        make_sampler(**kwargs)
    assert "\n" not in str(e.value)


def test_temperature_zero_is_greedy():
    assert make_sampler(temperature=0.0) == Greedy()
