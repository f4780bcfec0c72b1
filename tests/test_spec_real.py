"""Speculative decoding on the real models: greedy tokens identical to plain decoding on 20
prompts per model (one ragged batch): the drafters that need no training, and EAGLE-3 and
PARD drafters at their untrained start (lossless does not depend on a drafter's quality;
`scripts/bench_spec.py` measures trained ones)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxdec
from conftest import assert_one_line_error, jax_model
from jaxdec.prompts import CODE_TASKS, PROMPTS
from jaxdec.speculative import drafters, eagle3, pard
from jaxdec.speculative.tree import TreeSpec

PROMPTS_20 = list(PROMPTS) + list(CODE_TASKS[:10])


@pytest.mark.parametrize("name, draft, k, new", [("smollm2", "layers:12", 4, 24),
                                                 ("qwen2.5-coder-0.5b", "layers:8", 3, 16)])
def test_greedy_identical_on_20_prompts(name, draft, k, new):
    model = jax_model(name)
    want = jaxdec.generate(model, PROMPTS_20, max_new_tokens=new)
    got = jaxdec.generate(model, PROMPTS_20, max_new_tokens=new,
                          drafter=drafters.load(draft, model, k=k))
    assert got.token_ids == want.token_ids
    assert got.spec["mean_accepted"] > 1.0  # some drafts were kept (the check has teeth)


def _eagle3(model, tree):
    prompts = jaxdec.api.encode_prompts(model, PROMPTS_20, chat=False)
    counts = np.concatenate([np.asarray(r) for r in prompts])
    task = eagle3.Eagle3Task.for_target(model, counts, draft_vocab=4096, tree=tree,
                                        k=None if tree else 4)
    return task.drafter(task.init(jax.random.key(7)))


def _pard(model):
    task = pard.PardTask.for_target(model, None, n_layers=6, k=4)
    return task.drafter(task.init(None))


@pytest.mark.parametrize("kind", ["eagle3-chain", "eagle3-tree", "pard"])
def test_trainable_drafters_greedy_identical_on_20_prompts(kind):
    model = jax_model("smollm2")
    drafter = {"eagle3-chain": lambda: _eagle3(model, None),
               "eagle3-tree": lambda: _eagle3(model, TreeSpec(depth=3, top_k=2, budget=6)),
               "pard": lambda: _pard(model)}[kind]()
    want = jaxdec.generate(model, PROMPTS_20, max_new_tokens=20)
    got = jaxdec.generate(model, PROMPTS_20, max_new_tokens=20, drafter=drafter)
    assert got.token_ids == want.token_ids
    assert got.spec["rounds"] > 0


def test_cli_draft_errors():
    model = jax_model("smollm2")
    assert_one_line_error(drafters.load, "layers:x", model, match="not an integer")
    assert_one_line_error(drafters.load, "layers:31", model, match="1..30 layers")
    assert_one_line_error(jaxdec.generate, model, "hi", max_new_tokens=model.cfg.max_position,
                          drafter=drafters.load("layers:2", model), match="exceeds the model's context")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verification_rows_equal_decode_steps_bit_for_bit(dtype):
    """A chunk of 7 tokens (a draft of 6 and the last token) through the target gives, row
    by row, exactly the logits of 7 decode steps over the same tokens: the matmul kernel's
    sums do not depend on the row count, and the chunk is written before it is attended,
    so each query's softmax and value sums run over its keys in slot order. In bf16 a
    rounding difference anywhere would change some logits (it flipped greedy tokens
    before), so this is what makes greedy speculation token-identical there too."""
    from jaxdec import decode
    from jaxdec.models import transformer

    model = jax_model("smollm2", dtype)
    cfg, params = model.cfg, model.params
    rng = np.random.default_rng(int.from_bytes(dtype.encode(), "little") % 2**32)
    prompt = jax.numpy.asarray(rng.integers(100, cfg.vocab_size, (1, 37)), "int32")
    chunk = jax.numpy.asarray(rng.integers(100, cfg.vocab_size, (1, 7)), "int32")
    # params an argument, not a closure: 135M constants in the program cost minutes of XLA
    # constant folding (262 s of a CI run on a 2-core AMD host)
    step = jax.jit(lambda p, c, t, pos: transformer.forward(p, t, pos, c, cfg),
                   compiler_options=decode.COMPILER_OPTIONS)
    forward = lambda c, t, pos: step(params, c, t, pos)

    def prefilled():
        cache = jaxdec.api.init_cache(model, 1, 64)
        return decode.prefill(params, cache, prompt, jax.numpy.asarray([37]), cfg)[1]

    cache = prefilled()
    together, _ = forward(cache, chunk, cache.lengths[:, None] + jax.numpy.arange(7))
    cache, steps = prefilled(), []
    for i in range(7):
        logits, cache = forward(cache, chunk[:, i:i + 1], cache.lengths[:, None])
        steps.append(np.asarray(logits[0, 0]))
    np.testing.assert_array_equal(np.asarray(together[0]), np.stack(steps))


def test_bf16_greedy_speculation_identical_one_prompt_at_a_time():
    """In bf16, where rounding differences between the verification and the decode steps
    flipped tokens, speculative greedy decoding of single prompts gives plain decoding's
    tokens (chains of up to 6 drafts: verification chunks of up to 7 rows)."""
    model = jax_model("smollm2", "bfloat16")
    drafter = drafters.load("layers:12", model, k=4)
    accepted = []
    for prompt in PROMPTS_20[::4]:
        want = jaxdec.generate(model, prompt, max_new_tokens=48)
        got = jaxdec.generate(model, prompt, max_new_tokens=48, drafter=drafter)
        assert got.token_ids == want.token_ids, prompt
        accepted.append(got.spec["mean_accepted"])
    assert max(accepted) > 1.0
