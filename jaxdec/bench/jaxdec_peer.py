"""jaxdec measured the way `peers` measures HF and llama.cpp, in its own process.

`peers.main` calls `run_jaxdec(run)` (a `peers._Run`) for ``{"peer": "jaxdec", ...}``; the spec adds
`model` (a registry name or path: the same GGUF the peers read) and `weights` (f32, bf16,
int8, int4 or gguf). Time to first token is `decode.start` (prefill and the first
sampled id); the decode phase is `decode.advance` to the last token, so the split is
exact. Every shape is compiled by a warm-up of full length before it is timed. The
streamed path (`api.generate_ids(stream=...)`, chunk by chunk) is timed at batch 1 as
well, so the benchmark shows what streaming costs.
"""

from __future__ import annotations

import importlib.metadata
import time

import numpy as np

_STREAM_CHUNK = 4


def run_jaxdec(run) -> None:
    import jax
    import jax.numpy as jnp

    import jaxdec
    from jaxdec import decode
    from jaxdec.api import generate_ids
    from jaxdec.cache import dense
    from jaxdec.sampling import Greedy

    spec = run.spec
    t = time.monotonic()
    model = jaxdec.load(spec.get("model", spec["gguf"]), weights=spec.get("weights", "f32"))
    jax.block_until_ready(model.params)
    run.result["load_s"] = round(time.monotonic() - t, 3)
    run.result["weights"] = model.weights
    run.result["versions"] = {d: importlib.metadata.version(d) for d in ("jax", "jaxlib")}
    cfg = model.cfg

    def generation(batch: int, prompt: list[int], n_new: int):
        tokens = jnp.asarray(np.tile(np.asarray(prompt, np.int32), (batch, 1)))
        capacity = -(-(len(prompt) + n_new) // 64) * 64
        cache = dense.init_cache(cfg, batch, capacity, model.dtype)
        lens = jnp.full((batch,), len(prompt), jnp.int32)
        limits = jnp.full((batch,), n_new, jnp.int32)
        static = dict(sampler=Greedy(), cfg=cfg, stop_ids=())
        t0 = time.perf_counter()
        progress, cache = decode.start(model.params, cache, tokens, lens, jax.random.key(0),
                                       limits, max_new_tokens=n_new, **static)
        jax.block_until_ready(progress)
        t1 = time.perf_counter()
        progress, cache = decode.advance(model.params, cache, progress, jax.random.key(0),
                                         limits, n_new, **static)
        out = np.asarray(progress.tokens)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, out

    def greedy_fn(batch, prompt, n_new):
        t_first, t_decode, out = generation(batch, prompt, n_new)
        rows_equal = int(np.sum(np.all(out == out[0], axis=1)))
        return t_first, t_decode, [int(x) for x in out[0]], rows_equal

    def prefill_fn(prompt):
        return generation(1, prompt, 2)[0]

    run.measure(greedy_fn, prefill_fn)
    prompt, n_new = [int(t) for t in spec["prompt_ids"]], int(spec["new_tokens"])
    one_jit = lambda: (n_new - 1) / generation(1, prompt, n_new)[1]  # noqa: E731
    _streaming(run, model, generate_ids, prompt, n_new, one_jit)
    _ceiling_pairs(run, model, one_jit, len(prompt) + n_new // 2)


def _streaming(run, model, generate_ids, prompt: list[int], n_new: int, one_jit) -> None:
    """Batch-1 decode rate through the streamed path (chunks of 4 ids handed to a callback),
    and its ratio to the one-jit rate (`one_jit()`, tok/s) in interleaved pairs, so the
    machine's drift over the run does not enter the ratio (the median pair's)."""
    seen = []

    def stream(step, ids, active):
        seen.append((time.perf_counter(), step))

    def once() -> float:
        seen.clear()
        generate_ids(model, [prompt], max_new_tokens=n_new, stop_ids=(), stream=stream,
                     stream_chunk=_STREAM_CHUNK)
        first = next(t for t, s in seen if s == 0)
        return (n_new - 1) / (seen[-1][0] - first)

    once()
    pairs = [(one_jit(), once()) for _ in range(max(1, int(run.spec.get("repeats", 1))))]
    run.result["streamed_decode_tok_s"] = round(float(np.median([s for _, s in pairs])), 3)
    run.result["stream_ratio"] = round(float(np.median([s / j for j, s in pairs])), 3)
    run.snapshot()


def _ceiling_pairs(run, model, one_jit, context: int) -> None:
    """Batch-1 decode as a fraction of its bandwidth ceiling (the bytes a step reads over the
    streaming-read bandwidth), from interleaved pairs of the bandwidth probe and a one-jit
    decode: the ceiling of the report is measured minutes before the decode, and this shared
    machine's bandwidth drifts by 20-30% over minutes. The median pair's fraction; the probe's
    matrix is left out of the peer's peak RSS."""
    from jaxdec.bench.roofline import bandwidth_probe, step_bytes

    probe = bandwidth_probe()
    step = step_bytes(model, 1, context)
    pairs = [(probe(5), one_jit()) for _ in range(max(3, int(run.spec.get("repeats", 1))))]
    del probe
    run.result["ceiling_pairs"] = [[round(bw, 2), round(tok, 3)] for bw, tok in pairs]
    run.result["ceiling_fraction_b1"] = round(
        float(np.median([tok * step / (bw * 1e9) for bw, tok in pairs])), 3)
    run.snapshot(rss=False)
