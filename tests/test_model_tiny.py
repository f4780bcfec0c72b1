"""The model, cache and decode loop against HF transformers on tiny random checkpoints."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxdec import decode
from jaxdec.cache import dense
from jaxdec.models import transformer
from jaxdec.sampling import Greedy, Sample
from tiny_hf import VOCAB, build, hf_logits, rel_err

ARCHS = ["llama", "qwen2"]


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request):
    return build(request.param, seed=ARCHS.index(request.param))


def test_logits_match_hf(tiny):
    model, cfg, params = tiny
    tokens = np.random.default_rng().integers(0, VOCAB, (3, 37))
    positions = jnp.broadcast_to(jnp.arange(37), (3, 37))
    ours, _ = transformer.forward(params, jnp.asarray(tokens), positions, None, cfg)
    assert rel_err(ours, hf_logits(model, tokens)) < 1e-5


def test_prefill_then_decode_equals_full_forward(tiny):
    model, cfg, params = tiny
    tokens = np.random.default_rng().integers(0, VOCAB, (2, 30))
    full = hf_logits(model, tokens)
    cache = dense.init_cache(cfg, 2, 64)
    pos = np.broadcast_to(np.arange(30), (2, 30))
    logits, cache = transformer.forward(params, jnp.asarray(tokens[:, :21]), pos[:, :21], cache, cfg)
    steps = [np.asarray(logits)]
    for t in range(21, 30):
        logits, cache = transformer.forward(params, jnp.asarray(tokens[:, t:t + 1]),
                                            pos[:, t:t + 1], cache, cfg)
        steps.append(np.asarray(logits))
    assert rel_err(np.concatenate(steps, axis=1), full) < 1e-5
    np.testing.assert_array_equal(cache.lengths, [30, 30])


def test_ragged_batch_equals_rows_alone(tiny):
    """Right-padded rows of different lengths give each row's own logits and tokens."""
    model, cfg, params = tiny
    rng = np.random.default_rng()
    lens = [5, 17, 11]
    rows = [rng.integers(0, VOCAB - 1, n) for n in lens]
    prompts = np.zeros((3, 32), np.int32)
    for i, r in enumerate(rows):
        prompts[i, : len(r)] = r
    run = lambda p, n, b: decode.generate_tokens(
        params, dense.init_cache(cfg, b, 64), jnp.asarray(p), jnp.asarray(n),
        jax.random.key(0), jnp.full((b,), 20, jnp.int32), sampler=Greedy(), cfg=cfg,
        max_new_tokens=20, stop_ids=())[0]
    batched = run(prompts, np.array(lens, np.int32), 3)
    for i, r in enumerate(rows):
        alone = run(r[None], np.array([len(r)], np.int32), 1)
        np.testing.assert_array_equal(batched.tokens[i], alone.tokens[0])
        with torch.no_grad():
            hf = model.generate(torch.as_tensor(r[None]), max_new_tokens=20, do_sample=False,
                                attention_mask=torch.ones(1, len(r), dtype=torch.long),
                                eos_token_id=None, pad_token_id=0)
        np.testing.assert_array_equal(np.asarray(batched.tokens[i]), hf[0, len(r):].numpy())


def test_generation_stops_per_row(tiny):
    """A row stops on its stop token; the other rows go on to the limit."""
    model, cfg, params = tiny
    prompt = np.random.default_rng().integers(0, VOCAB, (2, 8)).astype(np.int32)
    run = lambda stops, limits: decode.generate_tokens(
        params, dense.init_cache(cfg, 2, 64), jnp.asarray(prompt), jnp.array([8, 8]),
        jax.random.key(0), jnp.asarray(limits, jnp.int32), sampler=Greedy(), cfg=cfg,
        max_new_tokens=16, stop_ids=stops)
    free, _ = run((), [16, 16])
    stop_tok = int(free.tokens[0, 4])
    first = int(np.argmax(np.asarray(free.tokens[0]) == stop_tok))
    stopped, cache = run((stop_tok,), [16, 10])
    assert int(stopped.n_generated[0]) == first + 1 and bool(stopped.stopped[0])
    np.testing.assert_array_equal(stopped.tokens[0, : first + 1], free.tokens[0, : first + 1])
    assert (np.asarray(stopped.tokens[0, first + 1:]) == -1).all()
    other = np.asarray(free.tokens[1])
    expect_n = min(10, int(np.argmax(other == stop_tok)) + 1 if (other == stop_tok).any() else 10)
    assert int(stopped.n_generated[1]) == expect_n
    assert int(cache.lengths[0]) == 8 + first  # the stop token is never written


def test_decode_step_donates_cache(tiny):
    _, cfg, params = tiny
    cache = dense.init_cache(cfg, 2, 32)
    cache = dataclasses.replace(cache, lengths=jnp.full_like(cache.lengths, 3))
    k_before = cache.layers[0].k
    toks, new = decode.decode_step(params, cache, jnp.array([1, 2]), jax.random.key(0),
                                   Greedy(), cfg)
    assert k_before.is_deleted()  # donated: XLA reused the buffer in place
    np.testing.assert_array_equal(new.lengths, [4, 4])
    assert toks.shape == (2,) and toks.dtype == jnp.int32


@pytest.mark.parametrize("sampler", [Greedy(), Sample(temperature=0.9, top_p=0.95)], ids=str)
def test_chunked_streaming_equals_one_jit(tiny, sampler):
    """start + advance chunk by chunk (the streaming path) reproduces the one-jit loop,
    sampling included (keys are folded per step, not per call)."""
    _, cfg, params = tiny
    prompt = jnp.asarray(np.random.default_rng().integers(0, VOCAB, (2, 9)), jnp.int32)
    args = lambda: (params, dense.init_cache(cfg, 2, 64), prompt, jnp.array([9, 6]),
                    jax.random.key(7), jnp.array([30, 23]))
    static = dict(sampler=sampler, cfg=cfg, stop_ids=(5,))
    whole, _ = decode.generate_tokens(*args(), max_new_tokens=30, **static)
    p, cache = decode.start(*args(), max_new_tokens=30, **static)
    for end in range(4, 40, 3):
        p, cache = decode.advance(params, cache, p, jax.random.key(7), jnp.array([30, 23]),
                                  end, **static)
    np.testing.assert_array_equal(p.tokens, whole.tokens)
    np.testing.assert_array_equal(p.n_generated, whole.n_generated)
