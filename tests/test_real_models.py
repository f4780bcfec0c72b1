"""Both real models against HF transformers (PyTorch, CPU) loading the same GGUF file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import jaxdec
from jaxdec import prompts
from conftest import hf_model, hf_tokenizer, jax_model
from tiny_hf import rel_err

PROMPTS = list(prompts.PROMPTS)
CHAT = list(prompts.CHAT)


def prompt_rows(name: str) -> list[list[int]]:
    """Prose, code, CJK, French, German, emoji, and a chat-templated conversation."""
    model = jax_model(name)
    rows = [model.tokenizer.encode(p) for p in PROMPTS[:6]]
    chat = model.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    rows.append(model.tokenizer.encode(chat, add_special_tokens=False))
    return rows


def hf_row_logits(name: str, row: list[int], dtype: str = "float32") -> np.ndarray:
    with torch.no_grad():
        out = hf_model(name, dtype)(torch.tensor([row])).logits
    return out[0].float().numpy()


def test_f32_logits_match_hf(real_model_name):
    """float32: relative Frobenius error over each row's [T, V] logits <= 1e-4."""
    rows = prompt_rows(real_model_name)
    ours = jaxdec.score(jax_model(real_model_name), rows)  # one ragged batch
    for i, row in enumerate(rows):
        err = rel_err(ours[i, : len(row)], hf_row_logits(real_model_name, row))
        assert err <= 1e-4, f"row {i}: relative error {err:.2e}"


def test_bf16_logits_within_hf_own_bf16_error(real_model_name):
    """bf16: our error against HF f32 is at most 1.5x HF's own bf16 error against HF f32
    (bf16 has an 8-bit mantissa, so its rounding, not the implementation, sets the error)."""
    rows = prompt_rows(real_model_name)[:4]
    ours = jaxdec.score(jax_model(real_model_name, "bfloat16"), rows)
    for i, row in enumerate(rows):
        ref = hf_row_logits(real_model_name, row)
        ours_err = rel_err(ours[i, : len(row)], ref)
        hf_err = rel_err(hf_row_logits(real_model_name, row, "bfloat16"), ref)
        assert ours_err <= 1.5 * hf_err, f"row {i}: ours {ours_err:.3e} vs HF bf16 {hf_err:.3e}"


def test_greedy_64_tokens_match_hf_generate(real_model_name):
    """10 prompts, one ragged batch in jaxdec, each row alone in HF: identical tokens."""
    model = jax_model(real_model_name)
    stops = list(model.cfg.eos_ids)
    res = jaxdec.generate(model, PROMPTS, max_new_tokens=64)
    hf = hf_model(real_model_name)
    for i, row in enumerate(res.prompt_ids):
        with torch.no_grad():
            out = hf.generate(torch.tensor([row]), attention_mask=torch.ones(1, len(row), dtype=torch.long),
                              max_new_tokens=64, do_sample=False, eos_token_id=stops,
                              pad_token_id=stops[0])
        hf_ids = out[0, len(row):].tolist()
        while len(hf_ids) > len(res.token_ids[i]) and hf_ids[-1] == stops[0]:
            hf_ids.pop()  # HF pads finished rows
        assert res.token_ids[i] == hf_ids, f"prompt {i} {PROMPTS[i][:30]!r}"


def test_chat_generation_is_sensible():
    model = jax_model("smollm2")
    res = jaxdec.generate(model, "What is the capital of France?", max_new_tokens=40, chat=True)
    assert "Paris" in res.texts[0]
    assert res.stopped[0] or len(res.token_ids[0]) == 40


def test_tokens_match_hf_tokenizer_on_prompts(real_model_name):
    model, tok = jax_model(real_model_name), hf_tokenizer(real_model_name)
    for p in PROMPTS:
        assert model.tokenizer.encode(p) == tok.encode(p)
