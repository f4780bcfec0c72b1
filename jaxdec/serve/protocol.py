"""OpenAI's request bodies, checked by pydantic, and what each asks of the engine.

    body = CompletionRequest.model_validate(json)       # or ChatCompletionRequest
    body.refuse_unsupported()                           # ApiError(400) for echo, tools, ...
    params = body.sampling_params(max_tokens=16)        # one SamplingParams per choice

Parameters the engine cannot honour (echo, best_of, suffix, penalties, logit_bias, tools,
response formats other than text) are refused with a 400 that names them, and so is any
field OpenAI's API does not have (`extra="forbid"`), so nothing is silently ignored.
`top_k`, `min_p`, `ignore_eos` and `priority` are vLLM's extensions.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxdec.engine.request import SamplingParams


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """pydantic's errors -> one line and the parameter it names (`messages.0.content`)."""
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return "the body is not valid JSON", None
    if first.get("type") == "extra_forbidden":
        return f"unsupported parameter {param!r}", param
    if first.get("type") == "missing":
        return f"missing required parameter {param!r}", param
    msg = " ".join(str(first.get("msg", "invalid value")).split())
    return (f"{param}: {msg}" if param else msg), param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None      # OpenAI's default: 1
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    priority: int = 0
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def unsupported(self) -> dict[str, bool]:
        """Parameter -> whether this request sets it to something not served."""
        return {"presence_penalty": bool(self.presence_penalty),
                "frequency_penalty": bool(self.frequency_penalty),
                "logit_bias": bool(self.logit_bias)}

    def refuse_unsupported(self) -> None:
        for name, used in self.unsupported().items():
            if used:
                raise ApiError(400, f"{name} is not supported by this server", param=name)
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, *, max_tokens: int, logprobs: int | None) -> list[SamplingParams]:
        """One SamplingParams per choice; with a seed, choice i draws with seed + i (each
        differs, each reproducible). Bad values raise the engine's one-line JaxdecError."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        common = dict(max_tokens=max_tokens, stop=tuple(stop), logprobs=logprobs,
                      temperature=1.0 if self.temperature is None else self.temperature,
                      top_p=1.0 if self.top_p is None else self.top_p,
                      top_k=self.top_k or 0, min_p=self.min_p or 0.0, ignore_eos=self.ignore_eos)
        return [SamplingParams(**common, seed=None if self.seed is None else self.seed + i)
                for i in range(self.n)]


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> dict[str, bool]:
        return {**super().unsupported(), "echo": self.echo, "suffix": self.suffix is not None,
                "best_of": self.best_of is not None and self.best_of != self.n}

    def prompts(self) -> list[str | list[int]]:
        """The prompts (texts or token ids); each gets `n` choices."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p) or [""]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_dict(self) -> dict:
        """The message as the chat template takes it (text parts joined)."""
        content = self.content if isinstance(self.content, str) else "".join(
            part.text for part in self.content or ())
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    response_format: dict | None = None

    def unsupported(self) -> dict[str, bool]:
        tools = {name: getattr(self, name) is not None
                 for name in ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls")}
        text = self.response_format is None or self.response_format.get("type") == "text"
        return {**super().unsupported(), **tools, "response_format": not text}

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")

    @property
    def limit(self) -> int | None:
        """The output limit asked for (max_completion_tokens, or the older max_tokens)."""
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    @property
    def n_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
