"""The figures of `jaxdec bench serve`, from what the client saw of each request: pure
functions of `Record`s, so every server is measured the same way.

    s = summarize(records, Slo(ttft_s=1.0, tpot_s=0.1))   # TTFT, TPOT, ITL, e2e, rates
    capacity({1.0: 1.0, 2.0: 0.95, 4.0: 0.5})              # -> 2.0
    t, q = queue_series(sent, left)                        # queue length over time
    queue_growth(records)                                  # -> its mean in each half of the sends

Definitions (those of vLLM's serving benchmark): TTFT is the first token's arrival less the
send time; TPOT is (last token - first token) / (output tokens - 1); ITL is every gap
between successive chunks that carried text, pooled over requests; end-to-end latency runs
from the send to the stream's end. Rates divide by the run's span, from its first send to
its last end. Goodput counts the requests that met both SLOs; a failed request meets none.
"""

from __future__ import annotations

import dataclasses

import numpy as np

ATTAINMENT = 0.9  # the share of requests that must meet the SLO for a rate to be sustained


@dataclasses.dataclass(frozen=True, kw_only=True)
class Record:
    """One streamed request; times in seconds from the start of its run."""

    sent: float
    chunks: tuple[float, ...]       # arrival of each event that carried text
    end: float                      # the stream closed (or failed)
    output_tokens: int              # the server's usage count (0: none given)
    asked: int = 0                  # max_tokens (with ignore_eos: the output length)
    prompt_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunks)

    @property
    def ttft(self) -> float:
        return self.chunks[0] - self.sent

    @property
    def tpot(self) -> float:
        if self.output_tokens < 2:
            return 0.0
        return (self.chunks[-1] - self.chunks[0]) / (self.output_tokens - 1)

    @property
    def left_queue(self) -> float:
        """When the request stopped waiting for its first token (its end if none came)."""
        return self.chunks[0] if self.chunks else self.end


@dataclasses.dataclass(frozen=True, kw_only=True)
class Slo:
    ttft_s: float
    tpot_s: float

    def met(self, r: Record) -> bool:
        return r.ok and r.ttft <= self.ttft_s and r.tpot <= self.tpot_s


def percentiles(x) -> dict:
    """p50, p99 and mean of x (None for each when x is empty)."""
    x = np.asarray(x, np.float64)
    if x.size == 0:
        return {"p50": None, "p99": None, "mean": None}
    p50, p99 = np.percentile(x, [50, 99])
    return {"p50": float(p50), "p99": float(p99), "mean": float(x.mean())}


def span(records: list[Record]) -> float:
    """Seconds from the first send to the last end."""
    return max(r.end for r in records) - min(r.sent for r in records)


def summarize(records: list[Record], slo: Slo) -> dict:
    """The latency percentiles (s) and throughputs (per s) of one run."""
    ok = [r for r in records if r.ok]
    duration = span(records)
    itl = [gap for r in ok for gap in np.diff(r.chunks)]
    good = sum(slo.met(r) for r in records)
    return {
        "requests": len(records), "failed": len(records) - len(ok), "duration_s": duration,
        "ttft_s": percentiles([r.ttft for r in ok]), "tpot_s": percentiles([r.tpot for r in ok]),
        "itl_s": percentiles(itl), "e2e_s": percentiles([r.end - r.sent for r in ok]),
        "output_tok_s": sum(r.output_tokens for r in ok) / duration,
        "request_s": len(ok) / duration, "goodput_req_s": good / duration,
        "slo_attainment": good / len(records),
        "tpot_attainment": sum(r.ok and r.tpot <= slo.tpot_s for r in records) / len(records),
        "ttft_attainment": sum(r.ok and r.ttft <= slo.ttft_s for r in records) / len(records),
        "outputs_as_asked": sum(r.ok and r.output_tokens == r.asked for r in records) / len(records),
        "mean_prompt_tokens": float(np.mean([r.prompt_tokens for r in ok])) if ok else None,
        "errors": sorted({r.error or "no text came" for r in records if not r.ok})[:3],
        "queue": queue_growth(records),
    }


def capacity(attainment: dict[float, float], threshold: float = ATTAINMENT) -> float | None:
    """The highest rate at which, as at every lower tested rate, at least `threshold` of the
    requests met the SLO; None when the lowest tested rate already missed it."""
    best = None
    for rate in sorted(attainment):
        if attainment[rate] < threshold:
            break
        best = rate
    return best


def queue_series(sent, left) -> tuple[np.ndarray, np.ndarray]:
    """Requests sent and not yet answered with a first token, over time.

    sent, left: f64[n] each request's send time and the time it left the queue. Returns
    f64[2n] event times, ascending, and i64[2n] the queue length from each of them on (at
    equal times, departures count first)."""
    sent, left = np.asarray(sent, np.float64), np.asarray(left, np.float64)
    times = np.concatenate([sent, left])
    steps = np.concatenate([np.ones(sent.size, np.int64), -np.ones(left.size, np.int64)])
    order = np.lexsort((steps, times))
    return times[order], np.cumsum(steps[order])


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def queue_mean(times, q, start: float, stop: float) -> float:
    """The time-average over [start, stop) of the step function `queue_series` returns (q[i]
    from times[i] on, 0 before the first event)."""
    edges = np.clip(np.concatenate([times, [np.inf]]), start, stop)
    return float(np.sum(q * np.diff(edges)) / (stop - start))


def queue_growth(records: list[Record]) -> dict:
    """The queue (requests waiting for their first token) while requests were being sent:
    its time-averaged length over the first and the second half of [first send, last send],
    and its peak. A server that keeps up holds the two halves level; one that falls behind
    (static batching beyond its capacity, 2504.07347) has a second half above the first."""
    sent = np.array([r.sent for r in records], np.float64)
    t, q = queue_series(sent, [r.left_queue for r in records])
    a, b = float(sent.min()), float(sent.max())
    if b <= a:  # a burst: every request sent at once
        return {"first_half": None, "second_half": None, "peak": int(q.max())}
    mid = (a + b) / 2
    return {"first_half": queue_mean(t, q, a, mid), "second_half": queue_mean(t, q, mid, b),
            "peak": int(q.max())}
