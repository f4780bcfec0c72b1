"""The OpenAI-compatible HTTP server around an `Engine` (FastAPI).

    app = make_app(engine, "smollm2")       # serve with uvicorn; the engine thread runs
                                            # while the app's lifespan does
    POST /v1/completions, /v1/chat/completions (the checkpoint's chat template)
    GET  /v1/models, /health (503 once the engine loop has died), /metrics (Prometheus)

A request becomes `n` engine requests per prompt, added at once (`AsyncEngine.submit`): a
request the engine refuses (a bad parameter, a prompt over the context, one the page pool
could never hold) is answered 400 at once and never queued. Outputs are streamed as
server-sent events (`data: {...}`, then `data: [DONE]`) or gathered into one body. A client
that leaves has its engine requests aborted, so their rows and pages are freed: a stream's
generator is cancelled when the client disconnects, and a waiting non-streamed request
polls for the disconnect. Every error has OpenAI's shape (`protocol.ApiError`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from jaxdec.api import encode_prompts
from jaxdec.errors import JaxdecError
from jaxdec.serve.async_engine import AsyncEngine, EngineDead, Submission
from jaxdec.serve.metrics import CONTENT_TYPE, Metrics
from jaxdec.serve.protocol import ApiError, ChatCompletionRequest, CompletionRequest, validation_message
from jaxdec.serve.responses import ChatFormat, Choice, CompletionFormat, usage

DISCONNECT_POLL = 0.25  # seconds between checks that a waiting client is still there
_GONE = object()        # put on a request's queue when its client has disconnected


@dataclasses.dataclass
class Job:
    """One HTTP request's engine requests: `n` choices per prompt, in OpenAI's order."""

    body: Any                   # CompletionRequest | ChatCompletionRequest
    fmt: Any                    # CompletionFormat | ChatFormat
    rids: list[str]             # engine request ids, one per choice
    prompt_lens: list[int]
    queue: asyncio.Queue        # their outputs (from AsyncEngine.submit)
    head: dict                  # id, created, model: the start of every body and chunk
    choices: list[Choice] = dataclasses.field(init=False)
    index: dict[str, int] = dataclasses.field(init=False)  # engine request id -> choice

    def __post_init__(self):
        self.choices = [Choice(index=i) for i in range(len(self.rids))]
        self.index = {rid: i for i, rid in enumerate(self.rids)}

    def unfinished(self) -> list[str]:
        return [rid for rid, c in zip(self.rids, self.choices) if c.finish_reason is None]

    def usage(self) -> dict:
        return usage(self.prompt_lens, self.choices, self.body.n)


class Server:
    """What the routes share: the engine's front, the metrics, the model's name."""

    def __init__(self, engine, model_name: str):
        self.model, self.name = engine.model, model_name
        self.max_model_len = engine.max_model_len
        self.metrics = Metrics(lambda: self.front.stats)
        self.front = AsyncEngine(engine, self.metrics)
        self.created = int(time.time())

    def check_model(self, name: str) -> None:
        if name != self.name:
            raise ApiError(404, f"the model {name!r} does not exist (this server serves {self.name!r})",
                           param="model", code="model_not_found")

    async def completions(self, body: CompletionRequest, request: Request):
        self.check_model(body.model)
        body.refuse_unsupported()
        prompts = [p if isinstance(p, list) else self.model.tokenizer.encode(p) for p in body.prompts()]
        params = _params(body, max_tokens=16 if body.max_tokens is None else body.max_tokens,
                         logprobs=body.logprobs)
        fmt = CompletionFormat(self.model.tokenizer, body.logprobs)
        return await self.respond(await self.submit(body, fmt, prompts, params), request)

    async def chat(self, body: ChatCompletionRequest, request: Request):
        self.check_model(body.model)
        body.refuse_unsupported()
        try:
            ids = encode_prompts(self.model, [[m.as_dict() for m in body.messages]], chat=True)[0]
        except JaxdecError as e:
            raise ApiError(400, str(e), param="messages") from None
        limit = max(1, self.max_model_len - len(ids)) if body.limit is None else body.limit
        params = _params(body, max_tokens=limit, logprobs=body.n_logprobs)
        fmt = ChatFormat(self.model.tokenizer, body.n_logprobs)
        return await self.respond(await self.submit(body, fmt, [ids], params), request)

    async def submit(self, body, fmt, prompts: list[list[int]], params) -> Job:
        """Add `body.n` choices of each prompt to the engine at once (refused: 400)."""
        rid, arrival = f"{fmt.id_prefix}-{uuid.uuid4().hex}", time.monotonic()
        rids = [f"{rid}-{i}" for i in range(len(prompts) * body.n)]
        items = [Submission(r, prompts[i // body.n], params[i % body.n], arrival, body.priority)
                 for i, r in enumerate(rids)]
        try:
            for s in items:  # (refused here, at once: the engine's loop may be mid-step)
                self.front.engine.check(s.prompt_ids, s.params)
            queue = await self.front.submit(items)
        except JaxdecError as e:
            raise ApiError(400, str(e)) from None
        except EngineDead as e:
            raise _unavailable(e) from None
        self.metrics.admitted(sum(len(p) for p in prompts))
        head = {"id": rid, "created": int(time.time()), "model": self.name}
        return Job(body, fmt, rids, [len(p) for p in prompts], queue, head)

    async def respond(self, job: Job, request: Request):
        """The job's answer: an event stream, or one body once every choice has finished
        (waiting, it watches for its client leaving)."""
        if job.body.stream:
            return _Stream(self._events(job), on_close=lambda: self.front.abort(job.unfinished()))
        watcher = asyncio.ensure_future(_watch(request, job.queue))
        try:
            async with contextlib.aclosing(self._outputs(job)) as outputs:
                async for out in outputs:
                    job.choices[job.index[out.request_id]].add(out)
        except EngineDead as e:
            raise _unavailable(e) from None
        finally:
            watcher.cancel()
        if job.unfinished():  # the client left
            return Response(status_code=499)
        return {**job.head, "object": job.fmt.object, "usage": job.usage(),
                "choices": [job.fmt.choice(c) for c in job.choices]}

    async def _outputs(self, job: Job):
        """The engine's outputs for the job until all its requests finish; those still
        unfinished when the consumer stops (a client gone, an error) are aborted."""
        pending = set(job.rids)
        try:
            while pending:
                out = await job.queue.get()
                if out is _GONE:
                    return
                if isinstance(out, EngineDead):
                    raise out
                if out.finished:
                    pending.discard(out.request_id)
                yield out
        finally:
            self.front.abort(pending)

    async def _events(self, job: Job):
        """Server-sent events: a chunk per output that carries text, tokens or an end."""
        fmt, extra = job.fmt, ({"usage": None} if job.body.include_usage else {})
        chunk = lambda parts: _sse({**job.head, "object": fmt.chunk_object, "choices": parts, **extra})
        opening = [fmt.first_chunk(i) for i in range(len(job.rids))]
        if opening[0] is not None:
            yield chunk(opening)
        async with contextlib.aclosing(self._outputs(job)) as outputs:
            try:
                async for out in outputs:
                    i = job.index[out.request_id]
                    job.choices[i].add(out)
                    if out.text or out.finished or (fmt.n_logprobs is not None and out.token_ids):
                        yield chunk([fmt.chunk_choice(i, out, job.choices[i])])
            except EngineDead as e:
                yield _sse(_unavailable(e).body())
                return
        if job.body.include_usage:
            yield _sse({**job.head, "object": fmt.chunk_object, "choices": [], "usage": job.usage()})
        yield "data: [DONE]\n\n"


class _Stream(StreamingResponse):
    """An event stream that calls `on_close()` when it ends, however it ends: a client can
    leave before its generator ever starts (then no `finally` of the generator runs)."""

    def __init__(self, content, *, on_close):
        super().__init__(content, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _params(body, *, max_tokens: int, logprobs: int | None):
    try:
        return body.sampling_params(max_tokens=max_tokens, logprobs=logprobs)
    except JaxdecError as e:
        raise ApiError(400, str(e)) from None


def _unavailable(e: Exception) -> ApiError:
    return ApiError(503, str(e), kind="server_error", code="engine_dead")


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _watch(request: Request, queue: asyncio.Queue) -> None:
    """Tell a waiting non-streamed request that its client has gone."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL)
    queue.put_nowait(_GONE)


def make_app(engine, model_name: str) -> FastAPI:
    """The app serving `engine` (a `jaxdec.Engine`) as `model_name`; the engine thread
    starts and stops with the app's lifespan. `app.state.server` is the `Server`."""
    server = Server(engine, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.front.start()
        try:
            yield
        finally:
            server.front.shutdown()

    app = FastAPI(title="jaxdec", lifespan=lifespan)
    app.state.server = server
    _error_handlers(app)
    _routes(app, server)
    return app


def _routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        return await server.chat(body, request)

    @app.get("/v1/models")
    async def models():
        card = {"id": server.name, "object": "model", "created": server.created, "owned_by": "jaxdec",
                "max_model_len": server.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        if not server.front.alive:
            return _error(_unavailable(EngineDead(server.front.reason)))
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        message, param = validation_message(list(e.errors()))
        return _error(ApiError(400, message, param=param))

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return _error(ApiError(e.status_code, str(e.detail), kind=kind))

    @app.exception_handler(Exception)
    async def bug(request, e: Exception):  # (uvicorn still logs the traceback)
        message = f"internal error: {type(e).__name__}: {e}".splitlines()[0]
        return _error(ApiError(500, message, kind="server_error"))
