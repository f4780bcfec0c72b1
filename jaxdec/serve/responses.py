"""OpenAI's response bodies and stream chunks, for completions and chat completions.

    choice = Choice(index=0)
    choice.add(output)                        # each engine RequestOutput of that choice
    fmt = CompletionFormat(tokenizer, logprobs=2)   # or ChatFormat
    fmt.choice(choice)                        # {"index", "text", "logprobs", "finish_reason"}
    fmt.chunk_choice(index, output, choice)   # the same for one stream chunk

Log-probabilities come from the engine per token: its own and the top alternatives'
(`RequestOutput.logprobs`). Completions report them the legacy way (`tokens`,
`token_logprobs`, `top_logprobs` as {token: logprob}, `text_offset`), chat completions as
`content: [{token, logprob, bytes, top_logprobs}]`.
"""

from __future__ import annotations

import dataclasses

from jaxdec.checkpoint.tokenizer import token_pieces


@dataclasses.dataclass
class Choice:
    """One choice as its outputs arrive."""

    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    n_cached: int = 0          # its prompt tokens served from the prefix cache
    offset: int = 0            # characters of token text reported so far (legacy logprobs)

    def add(self, out) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        if out.finished:
            self.finish_reason, self.n_cached = out.finish_reason, out.request.n_cached


def usage(prompt_lens: list[int], choices: list[Choice], n: int) -> dict:
    """Token counts: each prompt once, every choice's tokens; cached tokens are those of
    each prompt's first choice (the others may hit the pages it filled)."""
    prompt = sum(prompt_lens)
    completion = sum(len(c.token_ids) for c in choices)
    cached = sum(choices[i * n].n_cached for i in range(len(prompt_lens)))
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached}}


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes a token stands for (`token_pieces`: a token may be part of a character);
    its decoded text where the vocabulary spells none."""
    piece = token_pieces(tokenizer)[int(token_id)] if token_id < tokenizer.vocab_size else None
    return piece if piece is not None else tokenizer.decode([int(token_id)], skip_special_tokens=False).encode()


class _Format:
    object = chunk_object = id_prefix = ""

    def __init__(self, tokenizer, logprobs: int | None):
        self.tokenizer, self.n_logprobs = tokenizer, logprobs

    def token(self, token_id: int) -> tuple[str, bytes]:
        raw = token_bytes(self.tokenizer, token_id)
        return raw.decode("utf-8", errors="replace"), raw

    def first_chunk(self, index: int) -> dict | None:
        """A chunk each choice's stream opens with (chat: the assistant's role), or None."""
        return None


class CompletionFormat(_Format):
    object = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def logprobs(self, ids, entries, choice: Choice) -> dict | None:
        """Legacy logprobs of tokens `ids`; text offsets continue from `choice.offset`."""
        if self.n_logprobs is None:
            return None
        out = dict(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for token_id, (lp, top) in zip(ids, entries):
            text = self.token(token_id)[0]
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append({self.token(i)[0]: v for i, v in top})
            out["text_offset"].append(choice.offset)
            choice.offset += len(text)
        return out

    def choice(self, c: Choice) -> dict:
        return {"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                "logprobs": self.logprobs(c.token_ids, c.logprobs, c)}

    def chunk_choice(self, index: int, out, choice: Choice) -> dict:
        return {"index": index, "text": out.text, "finish_reason": out.finish_reason,
                "logprobs": self.logprobs(out.token_ids, out.logprobs, choice)}


class ChatFormat(_Format):
    object, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def logprobs(self, ids, entries) -> dict | None:
        if self.n_logprobs is None:
            return None
        content = []
        for token_id, (lp, top) in zip(ids, entries):
            content.append({**self._entry(token_id, lp),
                            "top_logprobs": [self._entry(i, v) for i, v in top]})
        return {"content": content, "refusal": None}

    def _entry(self, token_id: int, logprob: float) -> dict:
        text, raw = self.token(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    def choice(self, c: Choice) -> dict:
        return {"index": c.index, "message": {"role": "assistant", "content": c.text},
                "finish_reason": c.finish_reason, "logprobs": self.logprobs(c.token_ids, c.logprobs)}

    def chunk_choice(self, index: int, out, choice: Choice) -> dict:
        delta = {"content": out.text} if out.text or not out.finished else {}
        return {"index": index, "delta": delta, "finish_reason": out.finish_reason,
                "logprobs": self.logprobs(out.token_ids, out.logprobs)}

    def first_chunk(self, index: int) -> dict | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                "logprobs": None}
