"""The peers of `jaxdec bench`: HF transformers and llama.cpp, each measured in its own process.

Run as ``python -m jaxdec.bench.peers '<json spec>'`` (or ``python path/to/peers.py '<json spec>'``):
the result is ONE JSON object on the last line of stdout. `run_peer` launches that process, bounds
it with a timeout and parses the result; it never raises for a peer that fails or is missing.

This module imports nothing from jaxdec, so `run_peer` starts it by file path: the peer process
then holds neither JAX nor jaxdec, and its peak RSS is the peer's own.

Spec (dict, JSON):
    peer         "hf" | "hf-compile" | "llama.cpp"
    gguf         path of the GGUF file (HF dequantises it; llama.cpp runs its own quantisation)
    dtype        "float32" | "bfloat16" (HF only; ignored by llama.cpp)
    threads      int, threads to use (= cores)
    prompt_ids   list[int], the short prompt (32 tokens): TTFT, decode rates, greedy ids
    prefill_ids  list[int], the long prompt (512 tokens): prefill rate at batch 1
    batches      list[int], batch sizes for the decode rate, e.g. [1, 8, 32, 64]
    new_tokens   int, tokens generated per row (exactly; EOS does not stop generation)
    repeats      int, timed repeats per measurement; the median is reported
    budget_s     optional float: once this much wall time has passed, remaining batches are
                 skipped (with a note). run_peer sets it to 85% of its timeout.
    extra_bufts  optional bool (llama.cpp): llama_model_params.use_extra_bufts (weight repacking,
                 and the AMX buffer type in builds that have it). Default: the library's default.

Result (dict, JSON):
    prefill_tok_s  tokens/s of the 512-token prompt at batch 1 (call to first token)
    decode_tok_s   {str(batch): tokens/s summed over the batch}, decode phase only:
                   batch * (new_tokens - 1) / (time of last token - time of first token)
    ttft_s         batch 1, short prompt: seconds from the call to the first generated token
    load_s         seconds to load the model (HF: from_pretrained incl. dequantisation;
                   llama.cpp: llama_model_load_from_file, weights are mmapped)
    peak_rss_mb    getrusage max RSS of the peer process, MiB
    versions       {package: version}
    greedy_ids     the new_tokens greedy ids for prompt_ids at batch 1
    notes          list of strings
    runs           raw per-repeat numbers: {"ttft_s": [...], "prefill_tok_s": [...],
                   "decode_tok_s": {batch: [...]}}
    timed_out      only when run_peer killed the process: the result holds what finished
    error          only on failure: one line (the other fields may then be absent)

Greedy means argmax over the whole vocabulary at every step; EOS is an ordinary token (neither
peer stops on it), so both peers produce exactly new_tokens ids. A warm-up run precedes the
timed runs of every batch size. All rows of a batch hold the same short prompt.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

PEERS = ("hf", "hf-compile", "llama.cpp", "jaxdec")
LLAMA_MISSING = "llama-cpp-python not installed: run make bench"
_PARTIAL = "jaxdec-bench-partial: "   # stderr prefix of the snapshots written after each stage
_REQUIRED = ("peer", "gguf", "threads", "prompt_ids", "prefill_ids", "batches", "new_tokens")
_WARMUP_TOKENS = 8                    # new tokens of a warm-up run (hf-compile: all of them)


class PeerError(Exception):
    """A peer cannot run; the message is the one-line reason."""


# --------------------------------------------------------------------------------------------
# The parent side.
# --------------------------------------------------------------------------------------------

def run_peer(spec: dict, timeout: float) -> dict:
    """Measure one peer in a subprocess of its own and return its result dict.

    Never raises for a failing peer: the result is then ``{"error": "<one line>"}``. If the
    timeout kills the process after some stages finished, the result holds those stages with
    ``"timed_out": True`` and a note. For llama.cpp, a death by SIGILL (the AMX path of a native
    build) is retried once with ``extra_bufts=False``.
    """
    try:
        spec = dict(spec)
        missing = [k for k in _REQUIRED if k not in spec]
        if missing:
            return {"error": f"spec lacks {', '.join(missing)}"}
        if spec["peer"] not in PEERS:
            return {"error": f"unknown peer {spec['peer']!r}; expected one of {', '.join(PEERS)}"}
        if spec["peer"] == "llama.cpp" and importlib.util.find_spec("llama_cpp") is None:
            return {"error": LLAMA_MISSING}
        spec.setdefault("budget_s", 0.85 * timeout)
        result = _launch(spec, timeout)
        if (spec["peer"] == "llama.cpp" and result.get("_signal") == signal.SIGILL
                and spec.get("extra_bufts") is not False):
            first = result["error"]
            result = _launch({**spec, "extra_bufts": False}, timeout)
            result.setdefault("notes", []).append(
                f"first run died ({first}); rerun with use_extra_bufts=False")
        result.pop("_signal", None)
        return result
    except Exception as e:  # noqa: BLE001 - the benchmark goes on without this peer
        return {"error": _one_line(f"{type(e).__name__}: {e}")}


def _launch(spec: dict, timeout: float) -> dict:
    threads = str(int(spec["threads"]))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, os.path.abspath(__file__), json.dumps(spec)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:  # the process group we created: the peer and its helpers (inductor workers)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()

    final = _last_json(out.splitlines(), "")
    if final is not None and not timed_out:
        return final
    partial = _last_json(err.splitlines(), _PARTIAL)
    if timed_out:
        if partial is None:
            return {"error": f"timed out after {timeout:.0f} s before any measurement finished"}
        partial["timed_out"] = True
        partial.setdefault("notes", []).append(
            f"killed after the {timeout:.0f} s timeout: stages that had not finished are missing")
        return partial
    rc = proc.returncode
    if rc < 0:
        try:
            why = f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            why = f"killed by signal {-rc}"
    else:
        why = f"exit status {rc}"
    tail = [line for line in err.splitlines() if line.strip() and not line.startswith(_PARTIAL)]
    result = {"error": _one_line(f"{spec['peer']} {why}" + (f": {tail[-1]}" if tail else ""))}
    if rc < 0:
        result["_signal"] = -rc
    return result


def _last_json(lines: list[str], prefix: str) -> dict | None:
    for line in reversed(lines):
        if not line.startswith(prefix):
            continue
        try:
            value = json.loads(line[len(prefix):])
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------------------------
# The peer side: shared bookkeeping.
# --------------------------------------------------------------------------------------------

class _Run:
    """The result under construction, with the time budget and the partial snapshots."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.t0 = time.monotonic()
        self.budget = spec.get("budget_s")
        self.load_start = os.getloadavg()[0]
        self.result: dict[str, Any] = {
            "peer": spec["peer"], "gguf": os.path.basename(spec["gguf"]),
            "dtype": spec.get("dtype"), "threads": int(spec["threads"]),
            "prefill_tok_s": None, "decode_tok_s": {}, "ttft_s": None, "load_s": None,
            "peak_rss_mb": None, "versions": {}, "greedy_ids": [], "notes": [],
            "runs": {"ttft_s": [], "prefill_tok_s": [], "decode_tok_s": {}},
        }

    def note(self, text: str) -> None:
        self.result["notes"].append(text)

    def over_budget(self) -> bool:
        return self.budget is not None and time.monotonic() - self.t0 > float(self.budget)

    def snapshot(self, rss: bool = True) -> None:
        """Prints the result so far; `rss`: first records the peak RSS (False: a stage that
        only measures the machine leaves the peer's figure as it was)."""
        if rss:
            self.result["peak_rss_mb"] = round(
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1)  # KiB on Linux
        print(_PARTIAL + json.dumps(self.result), file=sys.stderr, flush=True)

    def measure(self, greedy_fn, prefill_fn) -> None:
        """The measurement plan both peers share.

        greedy_fn(batch, prompt, n_new) -> (t_first_s, t_decode_s, ids of row 0, rows equal to row 0)
            t_first_s: call to first token; t_decode_s: first token to last token.
        prefill_fn(prompt) -> seconds from the call to the first token, batch 1.
        """
        run = self
        spec = run.spec
        prompt = [int(t) for t in spec["prompt_ids"]]
        long_prompt = [int(t) for t in spec["prefill_ids"]]
        n_new = int(spec["new_tokens"])
        repeats = max(1, int(spec.get("repeats", 1)))
        # Compiling systems warm up at full length: a shorter run would compile another program.
        full = spec["peer"] in ("hf-compile", "jaxdec")
        warm_tokens = n_new if full else min(_WARMUP_TOKENS, n_new)
        if n_new < 2:
            raise PeerError("new_tokens must be at least 2 to separate decode from prefill")
        runs = run.result["runs"]

        batch_one: list[int] | None = None
        for batch in _order_batches(spec["batches"]):
            if batch > 1 and run.over_budget():
                run.note(f"batch {batch} skipped: the time budget of {run.budget:.0f} s is spent")
                continue
            t = time.monotonic()
            greedy_fn(batch, prompt, warm_tokens)                      # warm-up (compiles, pages in)
            if spec["peer"] == "hf-compile":
                run.note(f"batch {batch}: warm-up incl. compilation {time.monotonic() - t:.1f} s")
            rates = []
            for _ in range(repeats):
                t_first, t_decode, ids, rows_equal = greedy_fn(batch, prompt, n_new)
                rates.append(batch * (n_new - 1) / t_decode)
                if batch == 1:
                    runs["ttft_s"].append(t_first)
                    if batch_one is None:
                        batch_one = ids
                        run.result["greedy_ids"] = ids
                    elif ids != batch_one:
                        run.note("batch 1: greedy ids differ between repeats")
                else:
                    if rows_equal != batch:
                        run.note(f"batch {batch}: only {rows_equal}/{batch} rows equal row 0")
                    if batch_one is not None and ids != batch_one:
                        same = next((i for i, (a, b) in enumerate(zip(ids, batch_one)) if a != b),
                                    len(ids))
                        run.note(f"batch {batch}: row 0 parts from the batch-1 ids at token {same}")
            runs["decode_tok_s"][str(batch)] = [round(r, 3) for r in rates]
            run.result["decode_tok_s"][str(batch)] = round(statistics.median(rates), 3)
            if batch == 1:
                run.result["ttft_s"] = round(statistics.median(runs["ttft_s"]), 5)
                # the long prompt: one warm-up, then the timed repeats
                prefill_fn(long_prompt)
                rates = [len(long_prompt) / prefill_fn(long_prompt) for _ in range(repeats)]
                runs["prefill_tok_s"] = [round(r, 3) for r in rates]
                run.result["prefill_tok_s"] = round(statistics.median(rates), 3)
            run.snapshot()


def _order_batches(batches: list[int]) -> list[int]:
    """Batch 1 first (it yields TTFT and the greedy ids), then ascending, without repeats."""
    rest = sorted({int(b) for b in batches if int(b) > 1})
    return [1] + rest


def _version(dist: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------------------------
# HF transformers (eager, or static cache + torch.compile).
# --------------------------------------------------------------------------------------------

def _run_hf(run: _Run) -> None:
    spec = run.spec
    compiled = spec["peer"] == "hf-compile"
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, GenerationConfig
        from transformers.generation.streamers import BaseStreamer
    except ImportError as e:
        raise PeerError(f"HF transformers not installed ({e}): run make test") from e
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    dtype_name = spec.get("dtype") or "float32"
    if dtype_name not in dtypes:
        raise PeerError(f"dtype {dtype_name!r} not supported; expected float32 or bfloat16")
    threads = int(spec["threads"])
    torch.set_num_threads(threads)
    run.result["versions"] = {d: _version(d) for d in ("torch", "transformers", "accelerate", "gguf")}

    path = os.path.abspath(spec["gguf"])
    kwargs: dict[str, Any] = {}
    try:  # newer transformers can keep GGUF blocks packed (with `kernels`); this peer is dense
        from transformers import GgufConfig
        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                 gguf_file=os.path.basename(path),
                                                 dtype=dtypes[dtype_name], **kwargs)
    model.eval()
    run.result["load_s"] = round(time.perf_counter() - t, 3)
    if model.dtype != dtypes[dtype_name]:
        run.note(f"model loaded as {model.dtype}, not {dtype_name}")
    # EOS is an ordinary token: greedy argmax continues through it (as the llama.cpp peer does).
    model.generation_config.eos_token_id = None
    pad = getattr(model.config, "pad_token_id", None)
    if pad is None:
        pad = getattr(model.config, "eos_token_id", None)
    if isinstance(pad, (list, tuple)):
        pad = pad[0]
    pad = 0 if pad is None else int(pad)

    extra: dict[str, Any] = {}
    if compiled:
        from transformers import CompileConfig
        cc = CompileConfig(fullgraph=False, dynamic=False, mode="default")
        cc._compile_all_devices = True   # transformers compiles on CUDA/XPU only unless told
        extra = {"cache_implementation": "static", "compile_config": cc}
        run.note("static cache; the decode forward is torch.compile'd (inductor, mode=default); "
                 "the prefill forward runs eagerly, as transformers does")
    else:
        run.note("eager PyTorch, dynamic cache")
    linears: dict[str, int] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.ndim == 2 and "Embedding" not in type(module).__name__:
            key = f"{type(module).__name__}({str(weight.dtype).replace('torch.', '')})"
            linears[key] = linears.get(key, 0) + 1
    run.note("weights dequantised from the GGUF: " + ", ".join(f"{n} x {k}" for k, n in linears.items())
             + f"; attention implementation {getattr(model.config, '_attn_implementation', '?')}")

    class Clock(BaseStreamer):
        """generate() hands the prompt, then every new token, to put(): timestamp each."""

        def __init__(self):
            self.times: list[float] = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    def generate(batch: int, prompt: list[int], n_new: int):
        ids = torch.tensor([prompt] * batch, dtype=torch.long)
        config = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=n_new,
                                  min_new_tokens=n_new, eos_token_id=None, pad_token_id=pad,
                                  temperature=None, top_p=None, top_k=None, **extra)
        clock = Clock()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 generation_config=config, streamer=clock)
        new = out[:, len(prompt):]
        if new.shape[1] != n_new or len(clock.times) != n_new + 1:
            raise PeerError(f"generate produced {new.shape[1]} tokens, not {n_new}")
        return t0, clock.times, new

    def greedy_fn(batch, prompt, n_new):
        t0, times, new = generate(batch, prompt, n_new)
        rows_equal = int((new == new[0]).all(dim=1).sum())
        return times[1] - t0, times[-1] - times[1], new[0].tolist(), rows_equal

    def prefill_fn(prompt):
        # one new token: no decode step, so hf-compile compiles no graph for this cache shape
        t0, times, _ = generate(1, prompt, 1)
        return times[1] - t0

    if compiled:
        # compile the batch-1 graph under the budget first: a clear error if inductor fails
        t = time.perf_counter()
        try:
            generate(1, [int(x) for x in spec["prompt_ids"]], int(spec["new_tokens"]))
        except Exception as e:  # noqa: BLE001 - report why compilation fails on this machine
            raise PeerError(f"torch.compile failed: {_one_line(f'{type(e).__name__}: {e}', 300)}") from e
        run.note(f"first compiled generate (batch 1) took {time.perf_counter() - t:.1f} s")
    run.measure(greedy_fn, prefill_fn)


# --------------------------------------------------------------------------------------------
# llama.cpp through llama-cpp-python's low-level C API.
# --------------------------------------------------------------------------------------------

def _run_llama_cpp(run: _Run) -> None:
    spec = run.spec
    try:
        import numpy as np
        import llama_cpp as lc
    except ImportError as e:
        raise PeerError(LLAMA_MISSING) from e
    import logging
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # llama.cpp's info logs
    run.result["versions"] = {"llama-cpp-python": getattr(lc, "__version__", None) or
                              _version("llama-cpp-python"), "numpy": np.__version__}
    threads = int(spec["threads"])
    lc.llama_backend_init()

    mparams = lc.llama_model_default_params()
    mparams.n_gpu_layers = 0
    if spec.get("extra_bufts") is not None:
        if any(name == "use_extra_bufts" for name, *_ in type(mparams)._fields_):
            mparams.use_extra_bufts = bool(spec["extra_bufts"])
            run.note(f"use_extra_bufts={bool(spec['extra_bufts'])}")
        else:
            run.note("this llama-cpp-python has no use_extra_bufts; extra_bufts ignored")
    t = time.perf_counter()
    model = lc.llama_model_load_from_file(os.path.abspath(spec["gguf"]).encode(), mparams)
    if not model:
        raise PeerError(f"llama.cpp could not load {spec['gguf']}")
    run.result["load_s"] = round(time.perf_counter() - t, 3)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    info = lc.llama_print_system_info()
    run.note("llama.cpp system info: " + _one_line(info.decode() if isinstance(info, bytes) else info, 600))
    run.note("weights in the GGUF's own quantisation (dtype ignored); greedy = numpy argmax of "
             "the logits, batch > 1 via llama_decode with one sequence id per row (non-unified KV)")

    prompt_len = len(spec["prompt_ids"])
    per_seq = -(-(prompt_len + int(spec["new_tokens"])) // 256) * 256  # llama.cpp pads n_ctx to 256
    contexts: dict[tuple[int, int], Any] = {}
    batches: dict[int, Any] = {}

    def context(n_seq: int, n_ctx_seq: int, n_tokens: int):
        key = (n_seq, n_ctx_seq)
        if key not in contexts:
            cp = lc.llama_context_default_params()
            cp.n_ctx = n_seq * n_ctx_seq
            cp.n_batch = max(512, n_tokens)
            cp.n_ubatch = 512
            cp.n_seq_max = n_seq
            cp.n_threads = threads
            cp.n_threads_batch = threads
            cp.no_perf = True
            ctx = lc.llama_init_from_model(model, cp)
            if not ctx:
                raise PeerError(f"llama_init_from_model failed (n_seq_max={n_seq}, n_ctx={cp.n_ctx})")
            if lc.llama_n_seq_max(ctx) < n_seq:
                raise PeerError(f"llama.cpp allows {lc.llama_n_seq_max(ctx)} sequences, not {n_seq}")
            if not contexts:
                run.note(f"context defaults: flash_attn_type={cp.flash_attn_type}, "
                         f"kv_unified={cp.kv_unified}, type_k={cp.type_k}, n_ubatch=512")
            contexts[key] = ctx
        return contexts[key]

    def llama_batch(n_tokens: int):
        size = max(512, n_tokens)
        if size not in batches:
            batches[size] = lc.llama_batch_init(size, 0, 1)
        return batches[size]

    def decode(ctx, bt, tokens, positions, seqs, outputs) -> np.ndarray:
        """Submit one llama_batch; return the argmax of every output row, in batch order."""
        for i, (tok, pos, seq, out) in enumerate(zip(tokens, positions, seqs, outputs)):
            bt.token[i] = int(tok)
            bt.pos[i] = pos
            bt.n_seq_id[i] = 1
            bt.seq_id[i][0] = seq
            bt.logits[i] = out
        bt.n_tokens = len(tokens)
        rc = lc.llama_decode(ctx, bt)
        if rc != 0:
            raise PeerError(f"llama_decode returned {rc} (batch of {len(tokens)} tokens)")
        n_out = sum(outputs)
        logits = np.ctypeslib.as_array(lc.llama_get_logits(ctx), shape=(n_out * n_vocab,))
        return logits.reshape(n_out, n_vocab).argmax(axis=1)

    def generate(batch: int, prompt: list[int], n_new: int, n_ctx_seq: int):
        n_prompt = len(prompt)
        ctx = context(batch, n_ctx_seq, batch * n_prompt)
        bt = llama_batch(batch * n_prompt)
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        t0 = time.perf_counter()
        nxt = decode(ctx, bt, prompt * batch, list(range(n_prompt)) * batch,
                     [s for s in range(batch) for _ in range(n_prompt)],
                     [int(j == n_prompt - 1) for _ in range(batch) for j in range(n_prompt)])
        t_first = time.perf_counter()
        out = [nxt]
        seqs, ones = list(range(batch)), [1] * batch
        for step in range(1, n_new):
            nxt = decode(ctx, bt, nxt, [n_prompt + step - 1] * batch, seqs, ones)
            out.append(nxt)
        t_last = time.perf_counter()
        return t0, t_first, t_last, np.stack(out, axis=1)

    def greedy_fn(batch, prompt, n_new):
        t0, t_first, t_last, ids = generate(batch, prompt, n_new, per_seq)
        rows_equal = int((ids == ids[0]).all(axis=1).sum())
        return t_first - t0, t_last - t_first, [int(x) for x in ids[0]], rows_equal

    long_ctx = -(-(len(spec["prefill_ids"]) + 2) // 256) * 256

    def prefill_fn(prompt):
        t0, t_first, _, _ = generate(1, prompt, 1, long_ctx)
        return t_first - t0

    try:
        run.measure(greedy_fn, prefill_fn)
    finally:
        for bt in batches.values():
            lc.llama_batch_free(bt)
        for ctx in contexts.values():
            lc.llama_free(ctx)
        lc.llama_model_free(model)


# --------------------------------------------------------------------------------------------
# Entry point of the peer process.
# --------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Libraries may print to stdout; keep fd 1 for the final JSON line and send the rest to stderr.
    real_stdout = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    run = None
    try:
        if len(argv) != 1:
            raise PeerError("usage: python -m jaxdec.bench.peers '<json spec>'")
        spec = json.loads(argv[0])
        missing = [k for k in _REQUIRED if k not in spec]
        if missing:
            raise PeerError(f"spec lacks {', '.join(missing)}")
        run = _Run(spec)
        if spec["peer"] in ("hf", "hf-compile"):
            _run_hf(run)
        elif spec["peer"] == "llama.cpp":
            _run_llama_cpp(run)
        elif spec["peer"] == "jaxdec":  # imports jax and jaxdec in this process only
            sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
            from jaxdec.bench.jaxdec_peer import run_jaxdec
            run_jaxdec(run)
        else:
            raise PeerError(f"unknown peer {spec['peer']!r}; expected one of {', '.join(PEERS)}")
        # other processes on the cores make every number noisy: say how busy the machine was
        run.note(f"1-min load average {run.load_start:.2f} at start, {os.getloadavg()[0]:.2f} "
                 f"at end, on {os.cpu_count()} CPUs; wall {time.monotonic() - run.t0:.1f} s")
        run.snapshot()
        result, rc = run.result, 0
    except Exception as e:  # noqa: BLE001 - one line of error is the protocol
        msg = str(e) if isinstance(e, PeerError) else f"{type(e).__name__}: {e}"
        result = {"error": _one_line(msg)}
        if run is not None and (run.result["decode_tok_s"] or run.result["load_s"] is not None):
            run.snapshot()
            result = {**run.result, **result}
        rc = 1
    real_stdout.write(json.dumps(result) + "\n")
    real_stdout.flush()
    return rc


if __name__ == "__main__":
    sys.exit(main())
