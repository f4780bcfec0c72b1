"""Gemma 3 270M (`gemma3-270m`) against HF transformers (PyTorch, CPU) loading the same GGUF file:
float32 logits past the 512-token sliding window, without a cache and through the dense cache
(two prefill chunks, then decode steps); greedy tokens; the tokenizer; the chat template.

HF's GGUF loading parses the file's 262k-token vocabulary once per tokenizer, config and
weights (~70 s of CPU), so the references are computed once, in a subprocess started when
this module is imported (`hf_jobs`); the 10-prompt greedy check starts its own.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdec
from jaxdec import api, prompts
from jaxdec.checkpoint import chat_template
from jaxdec.config import ModelConfig
from jaxdec.models import transformer
from jaxdec.pytree import init_params
from conftest import assert_one_line_error, jax_model
from hf_jobs import HfJob

NAME = "gemma3-270m"
WINDOW = 512
LENGTH = 700  # the long prompt: well past the window
CHUNKS = ((0, 400), (400, 640))  # prefilled through the cache, then decoded one by one to LENGTH
_RNG = np.random.default_rng(20261204)


def _long_text(rng: np.random.Generator) -> str:
    """Prose, code, CJK, French, German, emoji: every fixed prompt and code task, shuffled."""
    return "\n\n".join(rng.permutation(list(prompts.PROMPTS) + list(prompts.CODE_TASKS)))


def _random_texts(rng: np.random.Generator, n: int) -> list[str]:
    pieces = [" ", "  ", "   ", "\n", "\n\n", "\t", " \n", "\r\n", "7", "42", "3.14", "é", "e\u0301",
              "中文", "👍🏽", "🇫🇷", "<start_of_turn>", "<end_of_turn>", "<bos>", "▁", "<0x41>",
              "Hello", " world", "def", "(x):", "ſ"]
    chars = np.arange(1, 0x2FFFF)
    chars = chars[(chars < 0xD800) | (chars >= 0xE000)]  # (an array: rng.choice copies a list each call)

    def piece():
        return str(rng.choice(pieces)) if rng.random() < 0.6 else chr(int(rng.choice(chars)))
    return ["".join(piece() for _ in range(rng.integers(1, 16))) for _ in range(n)]


TEXTS = [
    "", "Hello world", "Hello  world", "   leading spaces", "trailing spaces   ", "x" + " " * 20 + "y",
    "\n\n\n", " \n \n", "\r\n\r\n", "\tindented\n\t\tdouble", "mixed \t \n whitespace",
    "def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < n; ++i) { a[i] = i; }",
    "12345678901234567890", "x=3.14159265358979", "1,000,000", "year2024", "٣٤٥+١٢",
    "日本語のテキストです。", "中文字符，标点！", "한국어 텍스트", "مرحبا بالعالم", "Ωμέγα café naïve ﬁ",
    "👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👍🏽 tone", "𠀀𠀁", "\x00\x01 \x7f",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", "<bos><eos><pad><unk><mask>",
    "[multimodal] <start_of_image> <unused17>", "don't I'LL we've",
] + _random_texts(_RNG, 300)

CHATS = {
    "single": [{"role": "user", "content": "Write hello world in C."}],
    "system": [{"role": "system", "content": "You are terse."},
               {"role": "user", "content": "  What is 2+2?  "},
               {"role": "assistant", "content": "4."},
               {"role": "user", "content": "And 3+3? Answer with émojis 🎉"}],
    "parts": [{"role": "system", "content": [{"type": "text", "text": "Be kind."}]},
              {"role": "user", "content": [{"type": "text", "text": " Hi "}]}],
}

# The long prompt: text, then random ids up to LENGTH; the kept logit rows: some before the
# cache's decode steps, every one of them.
INPUT = {
    "text": _long_text(_RNG), "tail": _RNG.integers(300, 200_000, LENGTH).tolist(),
    "rows": sorted(_RNG.choice(CHUNKS[-1][1], 24, replace=False).tolist()) + list(
        range(CHUNKS[-1][1], LENGTH)),
    "texts": TEXTS, "chats": CHATS, "template": chat_template.GEMMA3,
    "greedy": [prompts.PROMPTS[1], CHATS["single"]],
}

# Runs in a subprocess: argv = gguf path, output folder, input JSON.
_HF_JOB = r"""
import json, pathlib, sys
import numpy as np, torch, transformers
path, out, inp = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), json.load(open(sys.argv[3]))
out.mkdir(exist_ok=True)
tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
res = {"greedy": []}
if "texts" in inp:
    ids = [tok(s)["input_ids"] for s in inp["texts"]]
    res |= {"ids": ids, "size": len(tok), "bos": tok.bos_token_id, "eos": tok.eos_token_id,
            "pad": tok.pad_token_id, "end_of_turn": tok.convert_tokens_to_ids("<end_of_turn>"),
            "decoded": [tok.decode(i, skip_special_tokens=True) for i in ids],
            "decoded_keep": [tok.decode(i, skip_special_tokens=False) for i in ids],
            "chat": {k: tok.apply_chat_template(m, chat_template=inp["template"], tokenize=False,
                                                add_generation_prompt=True)
                     for k, m in inp["chats"].items()}}
model = transformers.AutoModelForCausalLM.from_pretrained(
    str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
with torch.no_grad():
    if "text" in inp:
        long = (tok(inp["text"])["input_ids"] + inp["tail"])[:len(inp["tail"])]
        logits = model(torch.tensor([long])).logits[0]
        np.save(out / "logits.npy", logits[inp["rows"]].numpy())
        res["long"] = long
    for prompt in inp["greedy"]:  # a text, or messages for the chat template
        row = tok(prompt)["input_ids"] if isinstance(prompt, str) else tok(
            tok.apply_chat_template(prompt, chat_template=inp["template"], tokenize=False,
                                    add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        gen = model.generate(torch.tensor([row]), attention_mask=torch.ones(1, len(row), dtype=torch.long),
                             max_new_tokens=64, do_sample=False, eos_token_id=[1, 106], pad_token_id=1)
        res["greedy"].append({"prompt": row, "tokens": gen[0, len(row):].tolist()})
(out / "result.json").write_text(json.dumps(res))
"""


def _job(inp: dict, out: str) -> HfJob:
    spec = pathlib.Path(tempfile.mkdtemp(prefix="jaxdec_gemma3_in_")) / "input.json"
    spec.write_text(json.dumps(inp))
    return HfJob(NAME, _HF_JOB, out, str(spec))


_JOB = _job(INPUT, "gemma3")
_RESULT: dict = {}


def hf() -> dict:
    """HF's results for INPUT (its logit rows under "logits")."""
    if not _RESULT:
        out = _JOB.wait()
        _RESULT.update(json.loads((out / "result.json").read_text()), logits=np.load(out / "logits.npy"))
    return _RESULT


def rel_max(ours, ref) -> float:
    """max |ours - ref| / max |ref|."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def hf_tokens(gen: dict) -> list[int]:
    """HF's generated ids up to its first stop token (then padding)."""
    ids = gen["tokens"]
    return ids[:next((i + 1 for i, t in enumerate(ids) if t in (1, 106)), len(ids))]


# ---- logits ---------------------------------------------------------------------------------------
def test_config_is_gemma3_270m():
    cfg = jax_model(NAME).cfg
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff,
            cfg.vocab_size) == (18, 640, 4, 1, 256, 2048, 262144)
    assert [cfg.window(i) for i in range(18)] == [None if i % 6 == 5 else WINDOW for i in range(18)]
    assert [cfg.rope_of(cfg.window(i)) for i in (0, 5)] == [(10_000.0, None), (1_000_000.0, None)]
    assert cfg.tie_embeddings and cfg.qk_norm and cfg.post_norms and cfg.eos_ids == (1, 106)


def test_f32_logits_past_the_window_match_hf():
    """cache=None, one forward over all LENGTH tokens: max error / max |logit| <= 1e-4."""
    ref = hf()
    ours = jaxdec.score(jax_model(NAME), [ref["long"]])[0, INPUT["rows"]]
    past = np.asarray(INPUT["rows"]) >= WINDOW
    assert past.sum() > 50
    assert rel_max(ours[~past], ref["logits"][~past]) <= 1e-4
    assert rel_max(ours[past], ref["logits"][past]) <= 1e-4


def test_f32_prefill_and_decode_through_the_cache_match_hf():
    """Two prefill chunks (the second sees the first through the cache, past the window),
    then one decode step per token to LENGTH: every kept row within 1e-4 of HF's."""
    model, ref = jax_model(NAME), hf()
    ids, rows = np.asarray(ref["long"], np.int32), INPUT["rows"]
    step = jax.jit(transformer.forward, static_argnames="cfg")
    cache = jaxdec.init_cache(model, 1, LENGTH + 20)
    spans = list(CHUNKS) + [(p, p + 1) for p in range(CHUNKS[-1][1], LENGTH)]
    for lo, hi in spans:
        logits, cache = step(model.params, jnp.asarray(ids[None, lo:hi]), jnp.arange(lo, hi)[None],
                             cache, cfg=model.cfg)
        for i, r in enumerate(rows):
            if lo <= r < hi:
                err = rel_max(np.asarray(logits[0, r - lo]), ref["logits"][i])
                assert err <= 1e-4, f"position {r}: error {err:.2e}"


# ---- greedy ---------------------------------------------------------------------------------------
def _assert_greedy_equal(model, generated: list[dict]):
    res = api.generate_ids(model, [g["prompt"] for g in generated], max_new_tokens=64)
    for i, g in enumerate(generated):
        assert res.token_ids[i] == hf_tokens(g), f"prompt {i} ({len(g['prompt'])} tokens)"


def test_greedy_64_tokens_match_hf_generate():
    """A prompt and a chat-templated one (encoded as HF encodes it), in one ragged batch."""
    model, generated = jax_model(NAME), hf()["greedy"]
    assert api.encode_prompts(model, [CHATS["single"]], chat=True) == [generated[1]["prompt"]]
    _assert_greedy_equal(model, generated)


def test_greedy_64_tokens_match_hf_on_10_prompts():
    """Nine prompts and one of 560 tokens, whose 64 new tokens all attend past the window."""
    long = jax_model(NAME).tokenizer.decode(hf()["long"][:560])
    job = _job({"greedy": list(prompts.PROMPTS[:9]) + [long], "template": chat_template.GEMMA3},
               "gemma3-greedy")
    generated = json.loads((job.wait() / "result.json").read_text())["greedy"]
    assert len(generated[-1]["prompt"]) > WINDOW
    _assert_greedy_equal(jax_model(NAME), generated)


def test_generation_is_sensible():
    """The file is the pretrained (not instruction-tuned) 270M: it completes text."""
    res = jaxdec.generate(jax_model(NAME), "The Eiffel Tower is located in the city of",
                          max_new_tokens=8)
    assert "Paris" in res.texts[0]


# ---- tokenizer and chat template ---------------------------------------------------------------------
def test_tokenizer_equals_hf():
    tok, ref = jax_model(NAME).tokenizer, hf()
    assert tok.encode_batch(TEXTS) == ref["ids"]
    assert [tok.decode(i) for i in ref["ids"]] == ref["decoded"]
    assert [tok.decode(i, skip_special_tokens=False) for i in ref["ids"]] == ref["decoded_keep"]
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id, tok.add_bos) == (
        ref["size"], ref["bos"], ref["eos"], ref["pad"], True)
    assert tok.stop_ids == (ref["eos"], ref["end_of_turn"])


@pytest.mark.parametrize("chat", sorted(CHATS))
def test_chat_template_renders_as_hf(chat):
    tok = jax_model(NAME).tokenizer
    assert tok.chat_template == chat_template.GEMMA3
    assert tok.apply_chat_template(CHATS[chat], add_generation_prompt=True) == hf()["chat"][chat]


def test_chat_template_is_gemmas_format():
    """The system prompt opens the first user turn; the assistant is "model"; text is trimmed."""
    tok = jax_model(NAME).tokenizer
    assert tok.apply_chat_template(CHATS["system"], add_generation_prompt=True) == (
        "<bos><start_of_turn>user\nYou are terse.\n\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n4.<end_of_turn>\n"
        "<start_of_turn>user\nAnd 3+3? Answer with émojis 🎉<end_of_turn>\n<start_of_turn>model\n")
    assert_one_line_error(tok.apply_chat_template, [{"role": "user", "content": "a"}] * 2,
                          match="roles must alternate")


# ---- a config field the 270M leaves at its default ---------------------------------------------------
def test_query_scale_scales_the_scores():
    """Scores times `query_scale` (Gemma 3 27B's (D/N)^-1/2) are the default H^-1/2 scores of
    queries times query_scale * H^1/2: here, of wq times 3."""
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                      d_ff=48)
    params = init_params(transformer.declare(cfg), jax.random.key(0))
    wider = dataclasses.replace(params, layers=tuple(
        dataclasses.replace(l, mixer=dataclasses.replace(l.mixer, wq=3 * l.mixer.wq))
        for l in params.layers))
    tokens = jnp.asarray(_RNG.integers(0, 64, (2, 9)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(9), (2, 9))
    forward = jax.jit(transformer.forward, static_argnames="cfg")
    scaled = dataclasses.replace(cfg, query_scale=3 * 8 ** -0.5)
    np.testing.assert_allclose(forward(params, tokens, positions, None, cfg=scaled)[0],
                               forward(wider, tokens, positions, None, cfg=cfg)[0],
                               rtol=1e-5, atol=1e-5)
