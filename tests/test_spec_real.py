"""Speculative decoding on the real models: greedy tokens identical to plain decoding on 20
prompts per model (one ragged batch), for the drafters that need no training here."""

from __future__ import annotations

import pytest

import jaxdec
from conftest import assert_one_line_error, jax_model
from jaxdec.prompts import CODE_TASKS, PROMPTS
from jaxdec.spec import drafters

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


def test_cli_draft_errors():
    model = jax_model("smollm2")
    assert_one_line_error(drafters.load, "layers:x", model, match="not an integer")
    assert_one_line_error(drafters.load, "layers:31", model, match="1..30 layers")
    assert_one_line_error(jaxdec.generate, model, "hi", max_new_tokens=model.cfg.max_position,
                          drafter=drafters.load("layers:2", model), match="exceeds the model's context")
