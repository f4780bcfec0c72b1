"""The load generator of `jaxdec bench serve`: one asyncio client (httpx2, streaming) that
drives every server the same way, through the OpenAI completions endpoint.

    records = asyncio.run(open_loop(url, "smollm2", jobs))        # each at its arrival time
    records = asyncio.run(closed_loop(url, "smollm2", jobs, 16))  # 16 clients, back to back

A job is (prompt text, output tokens, arrival s). Each request asks for exactly its output
length (`max_tokens`, `ignore_eos`: jaxdec's and llama.cpp's name for it alike), greedy,
streamed with a final usage chunk; the client notes when each text-carrying event arrived.
"""

from __future__ import annotations

import asyncio
import json
import time

from jaxdec.bench.serve_stats import Record

TIMEOUT_S = 900.0  # one request, connect to last byte


def body(model: str, prompt: str, max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def _client():
    import httpx2

    # No proxies from the environment: the servers are on 127.0.0.1. A connection per request
    # (none kept alive): llama-server's HTTP library closes a kept-alive connection after a few
    # requests, and a request sent on it as it closes fails ("Server disconnected without
    # sending a response"; 2-3 of 32 in a 16-client closed loop).
    return httpx2.AsyncClient(timeout=TIMEOUT_S, trust_env=False,
                              limits=httpx2.Limits(max_connections=None, max_keepalive_connections=0))


def _event(line: str):
    """The JSON object of one server-sent event line (None for other lines and [DONE])."""
    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
        return None
    return json.loads(line[5:])


async def _read(response, clock) -> tuple[list[float], dict, str | None]:
    """(text chunk times, usage, error) of one event stream."""
    chunks, usage = [], {}
    async for line in response.aiter_lines():
        event = _event(line)
        if event is None:
            continue
        if error := event.get("error"):
            return chunks, usage, str(error.get("message", error) if isinstance(error, dict) else error)[:200]
        if any(c.get("text") for c in event.get("choices") or ()):
            chunks.append(clock())
        usage = event.get("usage") or usage
    return chunks, usage, None


async def send(client, url: str, model: str, prompt: str, max_tokens: int, clock) -> Record:
    """One streamed completion; `clock()` gives seconds since the run began."""
    import httpx2

    sent, chunks, usage, error = clock(), [], {}, None
    try:
        async with client.stream("POST", f"{url}/completions", json=body(model, prompt, max_tokens)) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
            else:
                chunks, usage, error = await _read(r, clock)
    except (httpx2.HTTPError, json.JSONDecodeError) as e:
        error = f"{type(e).__name__}: {e}"[:200]
    return Record(sent=sent, chunks=tuple(chunks), end=clock(), error=error, asked=max_tokens,
                  output_tokens=int(usage.get("completion_tokens") or 0),
                  prompt_tokens=int(usage.get("prompt_tokens") or 0))


def _clock():
    start = time.perf_counter()
    return lambda: time.perf_counter() - start


async def open_loop(url: str, model: str, jobs: list[tuple[str, int, float]]) -> list[Record]:
    """Send each job at its arrival time (0 for all: a burst), whatever the server's state."""
    clock = _clock()

    async def at(prompt, max_tokens, arrival):
        await asyncio.sleep(max(0.0, arrival - clock()))
        return await send(client, url, model, prompt, max_tokens, clock)

    async with _client() as client:
        return list(await asyncio.gather(*(at(*job) for job in jobs)))


async def closed_loop(url: str, model: str, jobs: list[tuple[str, int, float]], clients: int) -> list[Record]:
    """`clients` concurrent users, each sending its next job as soon as its last finished
    (arrival times ignored); jobs are taken in order."""
    clock, queue = _clock(), iter(jobs)  # (shared: each user takes the next job)

    async def user() -> list[Record]:
        return [await send(client, url, model, prompt, max_tokens, clock)
                for prompt, max_tokens, _ in queue]

    async with _client() as client:
        done = await asyncio.gather(*(user() for _ in range(clients)))
    return sorted((r for rs in done for r in rs), key=lambda r: r.sent)
