"""A serving workload from the corpora: prompts, output lengths and Poisson arrival times.

    load = workload(tokenizer, n=64, rate=4.0, seed=0)   # [(prompt ids, output length, arrival s)]

Prompts are the openings of prose and code documents (200 to 1,200 characters, at most
400 tokens); output lengths are drawn from the lengths of other documents (half their
first 600 characters' tokens, clipped to [8, 128]). `scripts/bench_engine.py` drives the
engine with it in process; `jaxdec bench serve` sends the same prompts, as text, to servers.
"""

from __future__ import annotations

import numpy as np

MAX_PROMPT = 400            # tokens
OUTPUT_RANGE = (8, 128)     # tokens


def poisson_arrivals(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    """f64[n]: the send times (s) of n requests arriving as a Poisson process of `rate`
    per second (exponential gaps, the first after one gap)."""
    return np.cumsum(rng.exponential(1.0 / rate, size=n))


def workload(tokenizer, n: int, rate: float, seed: int) -> list[tuple[list[int], int, float]]:
    """n (prompt ids, output length, arrival s) from the corpora, Poisson arrivals. With one
    seed, the prompts and lengths are the same at every rate and the arrivals scale as 1/rate."""
    from jaxdec import corpora

    rng = np.random.default_rng(seed)
    docs = [d for name in ("prose", "code") for d in corpora.corpus_documents(name) if len(d) > 200]
    picks = rng.choice(len(docs), size=2 * n, replace=False)
    prompts = [tokenizer.encode(docs[i][:int(rng.integers(200, 1200))]) for i in picks[:n]]
    lengths = [int(np.clip(len(tokenizer.encode(docs[i][:600])) // 2, *OUTPUT_RANGE)) for i in picks[n:]]
    arrivals = poisson_arrivals(rng, n, rate)
    return [(p[:MAX_PROMPT], m, float(a)) for p, m, a in zip(prompts, lengths, arrivals)]
