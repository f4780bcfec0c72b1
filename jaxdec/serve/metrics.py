"""The server's Prometheus metrics, in a registry of their own (one per app, never the
process-global one), named `jaxdec:...` as vLLM names its own `vllm:...`.

    metrics = Metrics(lambda: front.stats)   # the engine's counters, read at each scrape
    metrics.finished(request)                # latency histograms, from its token times
    body = metrics.render()                  # the text format, for GET /metrics

Gauges and counters of the engine (running, waiting, KV pages, preemptions, prefix-cache
tokens, generated tokens) are read from `stats()` when scraped, so they are never out of
step with the engine; the histograms (TTFT, TPOT, ITL, end-to-end) are observed when a
request finishes.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# seconds; TTFT includes queueing, so its buckets reach further than the per-token ones
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)

# engine.stats() key -> (kind, metric name, help)
ENGINE_STATS = {
    "running": ("gauge", "jaxdec:num_requests_running", "Requests holding a row."),
    "waiting": ("gauge", "jaxdec:num_requests_waiting", "Requests queued (new or preempted)."),
    "pages_used": ("gauge", "jaxdec:kv_pages_used", "KV pool pages held by requests."),
    "pages_free": ("gauge", "jaxdec:kv_pages_free", "KV pool pages nobody holds."),
    "pages_cached": ("gauge", "jaxdec:kv_pages_cached", "KV pool pages holding a cached prefix."),
    "preemptions": ("counter", "jaxdec:num_preemptions", "Requests preempted (recomputed later)."),
    "prefix_hit_tokens": ("counter", "jaxdec:prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache."),
    "prefix_query_tokens": ("counter", "jaxdec:prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache."),
    "generation_tokens": ("counter", "jaxdec:generation_tokens", "Tokens generated."),
    "computed_tokens": ("counter", "jaxdec:computed_tokens", "Tokens run through the model."),
    "steps": ("counter", "jaxdec:engine_steps", "Engine steps run."),
    "unprimed": ("gauge", "jaxdec:step_shapes_unprimed",
                 "Warmed step shapes not run yet: each one's first call (0.1-2 s) is still to pay."),
}


class _EngineCollector:
    """Reads the engine's counters at scrape time."""

    def __init__(self, stats: Callable[[], dict]):
        self.stats = stats

    def collect(self):
        stats = self.stats()
        for key, (kind, name, doc) in ENGINE_STATS.items():
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            yield family(name, doc, value=stats[key])
        queried = stats["prefix_query_tokens"]
        rate = stats["prefix_hit_tokens"] / queried if queried else 0.0
        yield GaugeMetricFamily("jaxdec:prefix_cache_hit_rate",
                                "Prefix-cache hit tokens / query tokens, since start.", value=rate)


class Metrics:
    def __init__(self, stats: Callable[[], dict]):
        """`stats()` returns the engine's latest `Engine.stats()` (thread-safe to call)."""
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats))
        r = self.registry
        self.prompt_tokens = Counter("jaxdec:prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.requests = Counter("jaxdec:request_success", "Requests finished, by finish reason.",
                                ["finished_reason"], registry=r)
        self.ttft = Histogram("jaxdec:time_to_first_token_seconds", "Arrival to first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("jaxdec:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              buckets=TOKEN_BUCKETS, registry=r)
        self.itl = Histogram("jaxdec:inter_token_latency_seconds", "Time between consecutive tokens.",
                             buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("jaxdec:e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=TTFT_BUCKETS, registry=r)

    def admitted(self, n_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(n_prompt_tokens)

    def finished(self, request) -> None:
        """Observe a finished `engine.request.Request` (the loop thread calls this)."""
        self.requests.labels(finished_reason=request.finish_reason).inc()
        times = request.token_times
        if not times:
            return
        self.ttft.observe(request.ttft)
        self.e2e.observe(times[-1] - request.arrival)
        if len(times) > 1:
            self.tpot.observe((times[-1] - times[0]) / (len(times) - 1))
        for gap in request.itl:
            self.itl.observe(gap)

    def render(self) -> bytes:
        return generate_latest(self.registry)
