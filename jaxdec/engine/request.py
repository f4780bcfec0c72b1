"""What a user asks the engine for, and where each request stands.

    params = SamplingParams(max_tokens=64, temperature=0.7, top_p=0.9, seed=1, stop=("\\n\\n",))
    request = Request("r1", prompt_ids, params, priority=0)

`SamplingParams` is checked when it is made (a one-line `JaxdecError` for a bad value), so
the engine never admits a request it cannot run. A `Request` carries its progress on the
host: `n_computed` tokens of `all_ids` are in its pages, `output_ids` were generated.
"""

from __future__ import annotations

import dataclasses
import enum
import time

from jaxdec.errors import JaxdecError
from jaxdec.sampling import Greedy, Sample, make_sampler


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """One request's decoding settings (vLLM's and OpenAI's names). temperature 0 is greedy;
    top_k 0, top_p 1 and min_p 0 are off. `seed` makes a sampled request's tokens
    reproducible whatever else runs beside it (None: the engine draws one)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None   # how many most likely alternatives to report per token


    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise JaxdecError(f"max_tokens must be a positive integer (got {self.max_tokens!r})")
        self.sampler  # checks temperature, top_k, top_p, min_p  # noqa: B018
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise JaxdecError(f"seed must be in [0, 2**63) (got {self.seed})")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise JaxdecError(f"logprobs must be in [0, 20] (got {self.logprobs})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise JaxdecError("stop strings must be non-empty strings")

    @property
    def sampler(self) -> Greedy | Sample:
        return make_sampler(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                            min_p=self.min_p)


class Status(enum.Enum):
    WAITING = "waiting"      # queued (new, or preempted and to be recomputed)
    RUNNING = "running"      # holds a row and pages
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    """A request and its progress (host-side, mutated by the engine only)."""

    id: str
    prompt_ids: list[int]
    params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    priority: int = 0          # lower runs first under the priority policy (vLLM's habit)
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    # progress
    output_ids: list[int] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None   # "stop", "length" or "abort"
    n_computed: int = 0        # tokens of all_ids whose keys and values are in its pages
    n_cached: int = 0          # prompt tokens found in the prefix cache at its (last) admission
    pages: list[int] = dataclasses.field(default_factory=list)
    row: int | None = None
    n_preempted: int = 0
    first_token_time: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.prompt_ids = [int(t) for t in self.prompt_ids]
        if not self.prompt_ids:
            raise JaxdecError(f"request {self.id}: the prompt is empty")

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def n_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first output token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival

    @property
    def itl(self) -> list[float]:
        """Seconds between consecutive output tokens."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]
