"""A request's output text, token by token: never half a character, never a stop string.

    text = TextStream(tokenizer, stop=("\\n\\n", "END"))
    for token in generated:
        delta = text.put(token)       # the text this token completes, maybe ""
        if text.stopped:              # a stop string was completed: generation ends here
            break
    delta = text.finish()             # at the end of generation: what was held back

Built on the tokenizer's incremental decoder (`Tokenizer.stream`), which releases text only
at character boundaries, so a character split across tokens is never emitted as U+FFFD.
On top of it, the stream holds back the longest tail of the text that could still grow into
a stop string, so a stop string that spans tokens never reaches the output: when one is
completed, the output ends just before it and `stopped` is set (the stop string itself is
not emitted, as in vLLM and OpenAI's API). The deltas joined equal the whole decode of the
tokens cut before the first stop string completed (tests/test_engine_detok.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxdec.errors import JaxdecError


def _held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of `text` are a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """`text` up to its first stop string (the earliest to end, then the earliest to start),
    and whether there was one."""
    ends = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    if not ends:
        return text, False
    return text[:min(ends)[1]], True


class TextStream:
    """Incremental output text of one request (host side, one per request)."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), *, skip_special_tokens: bool = True):
        if any(not s for s in stop):
            raise JaxdecError("a stop string must not be empty")
        self.stops = tuple(stop)
        self._decoder = tokenizer.stream(skip_special_tokens=skip_special_tokens)
        self._text = ""      # decoded so far (characters complete)
        self._emitted = 0    # how much of it went out
        self.stopped = False

    @property
    def text(self) -> str:
        """The output so far (what the deltas joined make)."""
        return self._text[:self._emitted]

    def put(self, token_id: int) -> str:
        if self.stopped:
            return ""
        # a new piece can complete a stop string that started in held-back text
        start = max(0, self._emitted - max((len(s) for s in self.stops), default=0))
        self._text += self._decoder.put(token_id)
        cut, hit = cut_at_stop(self._text[start:], self.stops)
        if hit:
            self.stopped = True
            return self._release(start + len(cut))
        return self._release(len(self._text) - _held_back(self._text, self.stops))

    def finish(self) -> str:
        """The end of generation (a length limit, an end-of-sequence token): release what
        was held back, since no stop string can complete any more."""
        if self.stopped:
            return ""
        self._text += self._decoder.flush()
        cut, hit = cut_at_stop(self._text, self.stops)
        self.stopped = hit
        return self._release(len(cut))

    def _release(self, upto: int) -> str:
        upto = max(upto, self._emitted)
        delta = self._text[self._emitted:upto]
        self._emitted = upto
        return delta
