"""Scheduling policies: objects the scheduler asks how to fill each step.

    engine = Engine(model, policy="sla")                       # by name, default settings
    engine = Engine(model, policy=policy.SLA(tpot_slo=0.05))   # or an object

A policy answers six questions, and each class below changes only the answers it needs:
- `admit_order(waiting)`: which waiting request is admitted first;
- `victim(running)`: which running request is preempted first when pages run out;
- `row_limit(engine)`: how many requests may run at once this step (admission stops there;
  running requests are never preempted to shrink the batch, it drains as they finish);
- `admits(engine, request)`: whether the next request in line may be admitted now (if not,
  it and everything behind it waits);
- `mixed`: whether decodes and prompt chunks share a step. A policy that does not mix runs
  prompt chunks alone whenever there are any, and decodes otherwise;
- `defers_prompts(engine)` (asked of a mixing policy): whether this step's prompt chunks wait
  while requests decode. The step then runs the decodes alone; a step with nothing to
  decode runs prompt chunks whatever the answer.
After each step the engine calls `observe(engine, seconds, outputs)`.

The policies:
- **fcfs** admits by arrival and preempts the newest. Every step takes all running decodes
  plus prompt chunks up to the token budget: work-conserving mixed batching, which
  2504.07347 shows throughput-optimal.
- **priority** admits by (priority, arrival), lower first (vLLM's habit), and preempts the
  lowest priority, the newest among equals.
- **sla** (2503.05248) sizes the running batch as a control variable, b = min(b_mem, b_sla):
  - memory: a request is admitted only if the pages that every running request and it are
    predicted to hold at their end (prompt + predicted output, `predicted_tokens`) fit in
    (1 - `headroom`) of the pool, so a burst is not admitted only to be preempted later;
  - latency: an exponential average of the decode batches' time (the paper's per-token
    decode latency: the time b decoding rows take, without the prompt chunks a mixed step
    also runs, which the batch bound does not change, and without a shape's costlier first
    call) is checked every `window` decode steps against `tpot_slo` (less the prompts'
    share of time, below):
    over it, b_sla shrinks to (1 - `shrink`) of the running batch (once the batch has
    drained to b_sla, so each cut is measured before the next); under (1 - `margin`) of it
    while requests wait at the limit (and the bank below is not overdrawn), b_sla grows by
    one (additive increase, multiplicative decrease).
  - prompt pacing: a decoding request waits for the whole step, prompt chunks included, and
    the batch bound does not shorten those. So every step that decodes banks `tpot_slo`
    minus its whole time (first calls left out; at most one `tpot_slo` is banked), and a
    prompt chunk joins the decodes only while the bank is not overdrawn. Over any N steps
    that decode, their mean time is at most `tpot_slo` + (`tpot_slo` + the longest step) / N
    (while the decode batches alone are under it: the bound's job), and prompts take the
    slack that is left: time to first token is traded for time per output token, which the
    batch bound alone cannot do (the bound cuts the decode batch; on a CPU a 256-token chunk
    costs ten of its steps).
  - yielding to prompts (not the paper's: it has no TTFT target): the slack a decode step
    leaves is `tpot_slo` minus its time, so the larger the batch the slower prompts drain
    through the bank. So the decode batch is held not to `tpot_slo` but to `tpot_slo` x
    (1 - the share of the last `horizon` seconds that ran prompt chunks): sized for the SLO
    minus the prompt load. And when a request has waited half of `ttft_slo` for its first
    token while the bank is overdrawn, b_sla is cut as it is over that target.
- **static** and **prefill-first** are the baselines of `jaxdec bench serve`, the two
  schedules 2504.07347 shows unstable under moderate load:
  - static batching: FCFS, each batch run to completion (admission closes once a running
    request has produced a token, and opens again when the batch has drained);
  - prefill-first: FCFS without mixing; prompts run before decodes (vLLM's v0 default).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from jaxdec.engine.request import Request
from jaxdec.errors import JaxdecError


class FCFS:
    name = "fcfs"
    mixed = True

    def key(self, r: Request):
        return (r.arrival,)

    def admit_order(self, waiting: Sequence[Request]) -> list[Request]:
        return sorted(waiting, key=self.key)

    def victim(self, running: Sequence[Request]) -> Request:
        """The running request to preempt: the one that would be admitted last."""
        return max(running, key=self.key)

    def row_limit(self, engine) -> int:
        return engine.max_num_seqs

    def admits(self, engine, r: Request) -> bool:
        return True

    def defers_prompts(self, engine) -> bool:
        return False

    def observe(self, engine, seconds: float, outputs) -> None:
        pass


class Priority(FCFS):
    name = "priority"

    def key(self, r: Request):
        return (r.priority, r.arrival)


class Static(FCFS):
    name = "static"

    def admits(self, engine, r: Request) -> bool:
        return not any(x.output_ids for x in engine.running)


class PrefillFirst(FCFS):
    name = "prefill-first"
    mixed = False


class SLA(FCFS):
    name = "sla"

    def __init__(self, tpot_slo: float = 0.1, ttft_slo: float = 2.0, *, headroom: float = 0.1,
                 shrink: float = 0.25, margin: float = 0.2, window: int = 4, smoothing: float = 0.3,
                 horizon: float = 10.0):
        for name, value in (("tpot_slo", tpot_slo), ("ttft_slo", ttft_slo), ("horizon", horizon)):
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise JaxdecError(f"{name} must be a positive number of seconds (got {value!r})")
        for name, value in (("headroom", headroom), ("shrink", shrink), ("margin", margin),
                            ("smoothing", smoothing)):
            if not 0 <= value < 1:
                raise JaxdecError(f"{name} must be in [0, 1) (got {value!r})")
        self.tpot_slo, self.ttft_slo = float(tpot_slo), float(ttft_slo)
        self.headroom, self.shrink, self.margin = headroom, shrink, margin
        self.window, self.smoothing = window, smoothing
        self.b_sla: int | None = None       # the latency bound on running requests
        self.itl: float | None = None       # the decode steps' time, exponentially averaged
        self.mean_output: float | None = None  # finished requests' output lengths, averaged
        self.banked = 0.0                   # s: tpot_slo minus each decoding step's time, summed
        self._since = 0                     # decode steps since b_sla last moved
        self.horizon = horizon              # s: how far back the prompts' share of time reaches
        self._prompt_seconds = self._seconds = 0.0  # (exponentially decayed sums over that horizon)

    def row_limit(self, engine) -> int:
        if self.b_sla is None:
            self.b_sla = engine.max_num_seqs
        return self.b_sla

    def predicted_tokens(self, r: Request) -> int:
        """Prompt + the output `r` is predicted to end with: the average finished output
        (max_tokens until one finishes), at least what it has, at most max_tokens."""
        guess = r.params.max_tokens if self.mean_output is None else math.ceil(self.mean_output)
        out = min(r.params.max_tokens, max(len(r.output_ids) + 1, guess))
        return len(r.prompt_ids) + out

    def admits(self, engine, r: Request) -> bool:
        pages = lambda x: -(-self.predicted_tokens(x) // engine.page_size)
        held = sum(pages(x) for x in engine.running)
        return held + pages(r) <= (1 - self.headroom) * engine.pool.n_pages

    def defers_prompts(self, engine) -> bool:
        return self.banked < 0

    def overdue(self, engine) -> bool:
        """Whether a request has waited half of `ttft_slo` for its first token (admitted or not)."""
        since = time.monotonic() - self.ttft_slo / 2
        return any(r.first_token_time is None and r.arrival < since
                   for queue in (engine.waiting, engine.running) for r in queue)

    def observe(self, engine, seconds: float, outputs) -> None:
        for out in outputs:
            if out.finished and out.finish_reason != "abort":
                n = len(out.request.output_ids)
                self.mean_output = n if self.mean_output is None else 0.9 * self.mean_output + 0.1 * n
        step = engine.last_step
        if step["first_call"] or not (step["decode_rows"] or step["prefill_rows"]):
            return
        decay = math.exp(-seconds / self.horizon)  # (the prompts' share of the last `horizon` s)
        self._prompt_seconds = decay * self._prompt_seconds + seconds - step["decode_seconds"]
        self._seconds = decay * self._seconds + seconds
        if not step["decode_rows"]:
            return
        self.banked = min(self.tpot_slo, self.banked + self.tpot_slo - seconds)  # (the whole step)
        a, decode = self.smoothing, step["decode_seconds"]  # (the decode batch alone)
        self.itl = decode if self.itl is None else (1 - a) * self.itl + a * decode
        self._since += 1
        if self._since < self.window:
            return
        b, n, target = self.row_limit(engine), len(engine.running), self.decode_target()
        # (while the batch drains to b, the average still measures more: cut once it has)
        if n <= b and (self.itl > target or (self.banked < 0 and self.overdue(engine))):
            self.b_sla, self._since = max(1, min(n - 1, math.floor(n * (1 - self.shrink)))), 0
        elif self.itl < (1 - self.margin) * target and n >= b and engine.waiting and self.banked >= 0:
            self.b_sla, self._since = min(engine.max_num_seqs, b + 1), 0

    def decode_target(self) -> float:
        """The decode batch's time that leaves prompts their recent share of each step:
        `tpot_slo` x (1 - the share of the last `horizon` seconds that ran prompt chunks)."""
        share = self._prompt_seconds / self._seconds if self._seconds else 0.0
        return self.tpot_slo * (1 - share)


POLICIES = {p.name: p for p in (FCFS, Priority, SLA, Static, PrefillFirst)}


def make(policy, **options):
    """A policy object from its name (with `options` for its constructor), or the object."""
    if not isinstance(policy, str):
        return policy
    if policy not in POLICIES:
        raise JaxdecError(f"unknown scheduling policy {policy!r} (one of {', '.join(POLICIES)})")
    cls = POLICIES[policy]
    return cls(**options) if cls is SLA else cls()
