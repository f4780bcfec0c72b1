"""Output text of a request, token by token, on the real models' tokenizers: the deltas
joined equal the whole decode cut before the first stop string, no delta holds half a
character (U+FFFD), and no stop string reaches the output, even one that spans tokens."""

from __future__ import annotations

import functools

import gguf
import pytest
from hypothesis import given, settings, strategies as st

from jaxdec.checkpoint import registry
from jaxdec.checkpoint.tokenizer import Tokenizer
from jaxdec.engine.detok import TextStream
from jaxdec.errors import JaxdecError

TEXTS = ("Emoji 👨‍👩‍👧‍👦🇯🇵 and CJK 日本語の文章 mixed with ASCII, then 🤖! 𠀀𠀁 ends.\n\n"
         "def f(x):\n    return x * 2  # done\nEND of the story. Ωμέγα café 한국어 텍스트 مرحبا")


@functools.cache
def tokenizer(name: str) -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(registry.resolve(name)))


@pytest.fixture(scope="module", params=["smollm2", "gemma3-270m"])
def tok(request):
    return tokenizer(request.param)


def expected(tok, ids, stops) -> tuple[str, bool]:
    """The definition, from whole decodes: the first prefix of `ids` whose text holds a stop
    string ends the output just before the stop that ends first there (of those, the one
    that starts first); without one, the output is the whole text."""
    for i in range(1, len(ids) + 1):
        text = tok.decode(list(ids[:i]))
        hits = sorted((text.index(s) + len(s), text.index(s)) for s in stops if s in text)
        if hits:
            return text[:hits[0][1]], True
    return tok.decode(list(ids)), False


def run(tok, ids, stops):
    stream = TextStream(tok, stops)
    deltas = []
    for i in ids:
        deltas.append(stream.put(i))
        if stream.stopped:
            break
    deltas.append(stream.finish())
    return deltas, stream


@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_deltas_equal_the_whole_decode_cut_at_the_first_stop(tok, data):
    a = data.draw(st.integers(0, len(TEXTS) - 1))
    b = data.draw(st.integers(a, len(TEXTS)))
    text = TEXTS[a:b]
    ids = tok.encode(text, add_special_tokens=False)
    whole = tok.decode(ids)
    # stops taken from the text itself, so they hit and often span tokens; and one that misses
    stops = []
    for _ in range(data.draw(st.integers(0, 3))):
        i = data.draw(st.integers(0, max(0, len(whole) - 1)))
        stops.append(whole[i:i + data.draw(st.integers(1, 6))] or "x")
    stops.append(data.draw(st.sampled_from(["<never>", "\u2603\u2603", "zzzq"])))
    deltas, stream = run(tok, ids, stops)
    out = "".join(deltas)
    want, hit = expected(tok, ids, stops)
    assert out == want == stream.text
    assert not any("\ufffd" in d for d in deltas), deltas
    assert not any(s in out for s in stops), (out, stops)
    assert stream.stopped == hit


def test_a_stop_string_spanning_tokens_never_shows(tok):
    ids = tok.encode("The answer is 42.\n\nNext question", add_special_tokens=False)
    # "is 42.\n" starts inside one token and ends in a later one
    deltas, stream = run(tok, ids, ["is 42.\n"])
    assert "".join(deltas) == "The answer " and stream.stopped
    assert sum(1 for d in deltas if d) >= 1 and all("is" not in d for d in deltas[1:])


def test_a_character_split_across_tokens_is_held_not_replaced(tok):
    ids = tok.encode("𠀀𠀁", add_special_tokens=False)
    assert len(ids) > 2  # split into bytes
    deltas, _ = run(tok, ids, [])
    assert "".join(deltas) == "𠀀𠀁" and not any("\ufffd" in d for d in deltas)
    assert "" in deltas[:-1]  # some token completed no character


def test_an_empty_stop_string_is_refused(tok):
    with pytest.raises(JaxdecError, match="empty"):
        TextStream(tok, ["ok", ""])
