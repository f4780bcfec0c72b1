"""`jaxdec serve`: an OpenAI-compatible HTTP server on the engine (see docs/architecture.md).

- `async_engine.py`: the thread that owns the `Engine`, and the queues between it and the
  event loop.
- `app.py`: the FastAPI app (`make_app`): completions, chat completions, models, health and
  metrics.
- `protocol.py`: the request bodies; `responses.py`: the response bodies and stream chunks.
- `metrics.py`: the Prometheus metrics; `server.py`: listening and running under uvicorn.

FastAPI and uvicorn are imported only here, so the rest of `jaxdec` starts without them.
"""
