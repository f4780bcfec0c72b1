"""Tokenizers rebuilt from GGUF metadata against Hugging Face's tokenizer for the same file.

The reference is `AutoTokenizer.from_pretrained(dir, gguf_file=...)`. Building it takes ~8 s
(SmolLM2) and ~30 s (Qwen2.5) of CPU, so each is built once in a subprocess started when
this module is imported; the subprocess writes HF's ids, decodes and chat renderings for the
fixed hard strings, plus HF's backend `tokenizer.json` for the randomized test.

One documented divergence: for `pre='smollm'`, llama.cpp (and SmolLM2's own tokenizer.json:
`Digits(individual_digits=True)` then the GPT-2 byte-level regex) isolate digits *before*
the GPT-2 split, so "\\n 5" becomes ["\\n ", "5"]; HF's GGUF converter has no `smollm`
entry and uses the GPT-2 regex alone (["\\n", " 5"]). We follow llama.cpp. The hard strings
avoid whitespace directly before a digit, and the randomized test compares SmolLM2 against
HF's backend with SmolLM2's original pre-tokenizer restored.
"""

from __future__ import annotations

import json
import pathlib
import tempfile

import gguf
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers

from jaxdec.checkpoint import registry
from jaxdec.checkpoint.gguf_reader import read_gguf_header
from jaxdec.checkpoint.tokenizer import Tokenizer
from jaxdec.errors import JaxdecError
from hf_jobs import HfJob

MODELS = ("smollm2", "qwen2.5-coder-0.5b")

HARD = [
    "", "Hello world", "👍", "👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👍🏽 tone", "🇯🇵🇺🇸🇩🇪 flags", "🤖🧠💡🚀",
    "日本語のテキストです。", "中文字符，标点！", "한국어 텍스트", "مرحبا بالعالم، كيف حالك؟",
    "def f(x):\n\treturn x\t# tab\n", "\tindented\n\t\tdouble", "\n\n\n", " \n \n", "\r\n\r\n",
    "don't", "I'LL", "we've they'd it's", "She said 'hi'",
    "12345678901234567890", "x=3.14159265358979", "year2024", "1,000,000", "٣٤٥+١٢",
    "<|im_start|>user\nhi<|im_end|>", "<|im_start|>assistant\n<|endoftext|>",
    "a<|im_end|>b<|im_start|>", "unicode Ωμέγα café naïve ﬁ", "ſ's 'ſ",
    "   leading spaces", "trailing spaces   ", "mixed \t \n whitespace",
]
HARD += [" " * n for n in range(1, 13)] + ["x" + " " * n + "y" for n in range(1, 13)]

CHATS = {
    "multi": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3? Answer with émojis 🎉"},
    ],
    "single": [{"role": "user", "content": "Write hello world in C."}],
}

# Runs in a subprocess: argv = gguf path, input JSON, output JSON.
_HF_JOB = r"""
import json, pathlib, sys
from transformers import AutoTokenizer
path, out, inp = pathlib.Path(sys.argv[1]), sys.argv[2], json.load(open(sys.argv[3]))
tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
ids = [tok(s)["input_ids"] for s in inp["texts"]]
json.dump({
    "ids": ids,
    "decoded": [tok.decode(i, skip_special_tokens=True) for i in ids],
    "decoded_keep": [tok.decode(i, skip_special_tokens=False) for i in ids],
    "chat": {k: tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
             for k, m in inp["chats"].items()},
    "bos": tok.bos_token_id, "eos": tok.eos_token_id, "pad": tok.pad_token_id, "size": len(tok),
    "im_end": tok.convert_tokens_to_ids("<|im_end|>"),
    "endoftext": tok.convert_tokens_to_ids("<|endoftext|>"),
    "backend": tok.backend_tokenizer.to_str(),
}, open(out, "w"))
"""


def _start(name: str) -> HfJob:
    root = tempfile.mkdtemp(prefix="jaxdec_tok_in_")
    inp = pathlib.Path(root) / "input.json"
    inp.write_text(json.dumps({"texts": HARD, "chats": CHATS}))
    return HfJob(name, _HF_JOB, f"tok-{name}.json", str(inp))


_JOBS = {name: _start(name) for name in MODELS}
_RESULTS: dict[str, dict] = {}


def _hf_result(name: str) -> dict:
    if name not in _RESULTS:
        _RESULTS[name] = json.loads(_JOBS[name].wait().read_text())
    return _RESULTS[name]


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    """(name, our Tokenizer, HF reference results) for one real model."""
    ref = _hf_result(request.param)
    path = registry.resolve(request.param)
    if request.param == "smollm2":  # also exercise the gguf.GGUFReader entry point
        ours = Tokenizer.from_gguf(gguf.GGUFReader(path))
    else:
        ours = Tokenizer.from_gguf(read_gguf_header(path).metadata)
    return request.param, ours, ref


def _reference_backend(name: str, ref: dict) -> tokenizers.Tokenizer:
    """HF's backend tokenizer for the file; for SmolLM2 with its original pre-tokenizer."""
    backend = tokenizers.Tokenizer.from_str(ref["backend"])
    if name == "smollm2":
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return backend


# ---- fixed hard strings ---------------------------------------------------------------------------
def test_hard_strings_ids_equal_hf(model):
    _, ours, ref = model
    for text, expected in zip(HARD, ref["ids"]):
        assert ours.encode(text) == expected, repr(text)
    assert ours.encode_batch(HARD) == ref["ids"]


def test_decode_equals_hf(model):
    _, ours, ref = model
    for ids, text, keep in zip(ref["ids"], ref["decoded"], ref["decoded_keep"]):
        assert ours.decode(ids) == text
        assert ours.decode(ids, skip_special_tokens=False) == keep


def test_special_ids_equal_hf(model):
    _, ours, ref = model
    assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.vocab_size) == (
        ref["bos"], ref["eos"], ref["pad"], ref["size"])
    assert ours.stop_ids == tuple(dict.fromkeys([ref["eos"], ref["im_end"], ref["endoftext"]]))
    assert not ours.add_bos and ours.encode("hi")[:1] != [ours.bos_id]


@pytest.mark.parametrize("chat", sorted(CHATS))
def test_chat_template_equals_hf(model, chat):
    _, ours, ref = model
    assert ours.apply_chat_template(CHATS[chat], add_generation_prompt=True) == ref["chat"][chat]


def test_smollm_digit_split_follows_llama_cpp(model):
    """The documented divergence from HF's GGUF converter (module docstring)."""
    name, ours, ref = model
    text = "x\n 5 and \t42"
    assert ours.encode(text) == _reference_backend(name, ref).encode(text).ids


# ---- randomized -----------------------------------------------------------------------------------
_PIECES = st.sampled_from([" ", "  ", "\n", "\n\n", "\t", " \n", "\r\n", "7", "42", "'s", "'LL",
                           "<|im_end|>", "<|im_start|>", "<|endoftext|>", "👍🏽", "🇫🇷", "中文",
                           "é", "e\u0301", "ſ", "Hello", " world"])
_TEXT = st.lists(st.one_of(st.text(st.characters(codec="utf-8"), max_size=10), _PIECES),
                 max_size=12).map("".join)


@pytest.fixture(scope="module")
def reference(model) -> tokenizers.Tokenizer:
    name, _, ref = model
    return _reference_backend(name, ref)


@settings(max_examples=150, deadline=None)
@given(text=_TEXT)
def test_random_text_equals_hf(model, reference, text):
    _, ours, _ = model
    ids = ours.encode(text)
    assert ids == reference.encode(text).ids
    decoded = reference.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids) == decoded
    stream = ours.stream()
    assert "".join(stream.put(i) for i in ids) + stream.flush() == decoded


# ---- streaming ------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", [
    "Emoji 👨‍👩‍👧‍👦🇯🇵 and CJK 日本語の文章 mixed with ASCII, then 🤖!",
    "<|im_start|>assistant\n你好，世界 🌏<|im_end|>", "é\u0301 ﬁ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"])
def test_stream_decoder_concatenation_equals_decode(model, text):
    _, ours, ref = model
    ids = ours.encode(text)
    backend = tokenizers.Tokenizer.from_str(ref["backend"])
    for skip in (True, False):
        stream = ours.stream(skip_special_tokens=skip)
        pieces = [stream.put(i) for i in ids]
        assert not any("\ufffd" in p for p in pieces)
        assert "".join(pieces) + stream.flush() == backend.decode(ids, skip_special_tokens=skip)
    assert sum(1 for p in pieces if p) > 3  # it actually streams


def test_stream_decoder_holds_partial_utf8(model):
    _, ours, _ = model
    ids = ours.encode("𠀀")  # a CJK extension-B character: split across tokens in both vocabs
    assert len(ids) > 1
    stream = ours.stream()
    assert [stream.put(i) for i in ids] == [""] * (len(ids) - 1) + ["𠀀"]
    assert stream.flush() == ""


# ---- save / load, errors ------------------------------------------------------------------------
def test_save_load_round_trip(model, tmp_path):
    _, ours, ref = model
    ours.save(tmp_path)
    loaded = Tokenizer.load(tmp_path)
    assert loaded.encode_batch(HARD) == ref["ids"]
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id, loaded.stop_ids, loaded.add_bos) == (
        ours.bos_id, ours.eos_id, ours.pad_id, ours.stop_ids, ours.add_bos)
    for chat in CHATS:
        assert loaded.apply_chat_template(CHATS[chat]) == ref["chat"][chat]


def test_chat_template_error_is_one_line():
    tok = Tokenizer(backend=tokenizers.Tokenizer(tokenizers.models.BPE()),
                    chat_template="{{ raise_exception('roles must alternate\\nreally') }}")
    with pytest.raises(JaxdecError, match="chat template failed: roles must alternate") as info:
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    assert "\n" not in str(info.value)
    with pytest.raises(JaxdecError, match="chat template failed"):
        Tokenizer(backend=tok.backend, chat_template="{% for %}").apply_chat_template([])


def test_unsupported_gguf_tokenizers():
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(JaxdecError, match="unsupported GGUF tokenizer model 'llama'"):
        Tokenizer.from_gguf(meta)
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "chameleon",
            "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(JaxdecError, match="unsupported GGUF pre-tokenizer 'chameleon'"):
        Tokenizer.from_gguf(meta)
