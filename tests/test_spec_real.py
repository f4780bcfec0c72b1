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
from jaxdec.spec import drafters, eagle3, pard
from jaxdec.spec.tree import TreeSpec

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
