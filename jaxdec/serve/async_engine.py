"""The engine behind an event loop: one thread owns the `Engine`, the server's coroutines
talk to it through a queue.

    front = AsyncEngine(engine, metrics)
    front.start()
    queue = await front.submit([Submission(rid, prompt_ids, params, arrival)])  # or JaxdecError
    out = await queue.get()          # RequestOutputs of those requests, as the engine steps
    front.abort([rid])               # a client left: its rows and pages are freed
    front.shutdown()

The engine is not thread-safe, so every call into it happens on the loop thread: it takes
the calls queued since its last step (adds and aborts, run in order), steps while any
request is unfinished, and sleeps on a condition when idle. Before it sleeps, it runs each
warmed step shape that has not run yet once, on padding rows (`Engine.prime`, cheapest
first, one shape between checks of the queue): a shape's first call costs 0.1-1 s more
than its later ones, and then no request's step pays it. A request that arrives meanwhile
waits for the one shape running, at most. Each output goes to the asyncio
queue of its request through `loop.call_soon_threadsafe`. If a step raises, the thread
records the error and stops: `error` is set, every waiting queue receives it, and later
submissions raise `EngineDead`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Iterable
from typing import NamedTuple

from jaxdec.engine.engine import Engine, RequestOutput
from jaxdec.engine.request import SamplingParams


class EngineDead(RuntimeError):
    """The engine loop has stopped on an error; the server cannot generate any more."""


Sink = tuple[asyncio.AbstractEventLoop, asyncio.Queue]


class Submission(NamedTuple):
    """One engine request to add."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float          # time.monotonic() when its HTTP request came in (for TTFT)
    priority: int = 0       # lower runs first under the priority policy


class AsyncEngine:
    def __init__(self, engine: Engine, metrics=None, *, prime: bool = True):
        """`metrics` (a `serve.metrics.Metrics`, optional) hears of each finished request;
        `prime`: run the engine's warmed shapes once while idle."""
        self.engine, self.metrics, self.prime = engine, metrics, prime
        self.error: BaseException | None = None
        self.stats = engine.stats()          # the engine's counters after its latest step
        self._cond = threading.Condition()
        self._calls: list[tuple[Callable, concurrent.futures.Future | None]] = []
        self._sinks: dict[str, Sink] = {}    # unfinished request -> where its outputs go
        self._drain = False                  # aborted requests whose outputs a step releases
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="jaxdec-engine", daemon=True)

    # ---- the event loop's side --------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    async def submit(self, items: Iterable[Submission]) -> asyncio.Queue:
        """Add requests at once -> the queue their outputs arrive on (or the loop's error,
        should it die). If one is refused, none is queued and the refusal (a one-line
        JaxdecError) is raised."""
        items, queue = list(items), asyncio.Queue()
        sink = (asyncio.get_running_loop(), queue)
        await asyncio.wrap_future(self._call(lambda: self._add(items, sink), wait=True))
        return queue

    def abort(self, request_ids: Iterable[str]) -> None:
        """Abort requests that are still running or waiting (others are ignored)."""
        ids = list(request_ids)
        if ids and self.alive:
            with contextlib.suppress(EngineDead):  # (it died meanwhile: nothing runs any more)
                self._call(lambda: self._abort(ids), wait=False)

    def _call(self, fn: Callable, *, wait: bool) -> concurrent.futures.Future | None:
        future = concurrent.futures.Future() if wait else None
        with self._cond:
            if not self.alive:
                raise EngineDead(self.reason)
            self._calls.append((fn, future))
            self._cond.notify()
        return future

    @property
    def reason(self) -> str:
        """Why the loop is not running, in one line."""
        if self.error is None:
            return "the engine loop is not running"
        return f"the engine loop stopped: {type(self.error).__name__}: {self.error}".splitlines()[0]

    # ---- the loop thread's side ---------------------------------------------------------------
    def _add(self, items, sink: Sink) -> None:
        added = []
        try:
            for s in items:
                self.engine.add_request(s.prompt_ids, s.params, request_id=s.request_id,
                                        arrival=s.arrival, priority=s.priority)
                added.append(s.request_id)
                self._sinks[s.request_id] = sink
        except BaseException:
            self._abort(added)
            raise

    def _abort(self, ids: list[str]) -> None:
        for rid in ids:
            if self._sinks.pop(rid, None) is not None:
                self.engine.abort(rid)
                self._drain = True

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    idle = lambda: not (self._calls or self._stopping or self._drain or self.engine.has_unfinished())
                    primes = idle() and self.prime and self.engine.unprimed()
                    while idle() and not primes:
                        self._cond.wait()
                    if self._stopping:
                        return
                    calls, self._calls = self._calls, []
                if primes:
                    self.engine.prime(primes[0])
                    self.stats = self.engine.stats()  # (/metrics counts the shapes left to prime)
                    continue
                for fn, future in calls:
                    self._run_call(fn, future)
                if self._drain or self.engine.has_unfinished():
                    self._drain = False
                    self._deliver(self.engine.step())
                self.stats = self.engine.stats()
        except BaseException as e:  # noqa: BLE001 (whatever killed the loop, the server reports it)
            self._die(e)

    @staticmethod
    def _run_call(fn: Callable, future: concurrent.futures.Future | None) -> None:
        try:
            result = fn()
        except Exception as e:  # the caller's error (a refused request), not the loop's
            if future is not None:
                future.set_exception(e)
            return
        if future is not None:
            future.set_result(result)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:  # the engine is done with it: a server that runs for long
                self.engine.forget(out.request_id)  # must not keep it
            sink = self._sinks.pop(out.request_id, None) if out.finished else self._sinks.get(out.request_id)
            if sink is None:  # aborted: nobody is listening
                continue
            if out.finished and self.metrics is not None:
                self.metrics.finished(out.request)
            _put(sink, out)

    def _die(self, error: BaseException) -> None:
        with self._cond:
            self.error = error
            calls, self._calls = self._calls, []
        for _, future in calls:
            if future is not None:
                future.set_exception(EngineDead(self.reason))
        sinks, self._sinks = set(self._sinks.values()), {}
        for sink in sinks:
            _put(sink, EngineDead(self.reason))


def _put(sink: Sink, item) -> None:
    loop, queue = sink
    try:
        loop.call_soon_threadsafe(queue.put_nowait, item)
    except RuntimeError:  # the event loop has closed (the server is shutting down)
        pass
