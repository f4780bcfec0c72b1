"""`jaxdec bench serve`: the HTTP server under load, beside llama.cpp's server, in one run.

Each system is a server process bound to 127.0.0.1 on a free port: `jaxdec serve` with one
scheduling policy (fcfs, static, prefill-first, sla; `fcfs seqs=K` at other batch limits),
or llama.cpp's `llama-server` on the same GGUF with as many slots, continuous batching and
the same context per slot. Once it answers GET /health, one client (`serve_client`) sends
it the same requests as every other system (`workload`: corpus prompts as text, output
lengths from the corpora): Poisson arrivals at each rate of a ladder, a burst (all at t=0),
then closed loops (1 user, then 16, each sending its next request when its last finished;
`rounds` requests a client, so the ramp-up and the drain, when fewer clients are busy, are
a small part of the loop).
The server is stopped when its runs end, however they end (an error, Ctrl-C, SIGTERM).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from jaxdec.bench import host, serve_client, serve_report, serve_stats
from jaxdec.bench.serve_stats import Slo
from jaxdec.errors import JaxdecError
from jaxdec.serve.server import free_port

HOST = "127.0.0.1"
LLAMA_CPP = "llama.cpp"
POLICIES = ("fcfs", "static", "prefill-first", "sla")
PAPER_SLA_GAIN = 1.22   # 2503.05248: capacity of SLA-aware batching over the best static batch limit
STATIC = "static"       # the baseline of 2504.07347 that every system is also compared with


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    model: str = "smollm2"
    systems: tuple[str, ...] = (*POLICIES, LLAMA_CPP)
    # requests/s, Poisson: around SmolLM2's capacity on 2 cores (fcfs held 1.5/s, static 1/s)
    rates: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0)
    requests: int = 32                    # per rate, and in the burst
    max_num_seqs: int = 16                # jaxdec's --max-num-seqs, llama.cpp's slots
    static_seqs: tuple[int, ...] = (4, 8, 16)   # fcfs also runs at each of these limits
    clients: tuple[int, ...] = (1, 16)    # closed loops
    rounds: int = 6                       # a closed loop of c clients sends rounds * c requests
    ttft_slo: float = 2.0                 # s
    tpot_slo: float = 0.1                 # s per output token (also the sla policy's target)
    context: int = 1024                   # tokens per request / slot
    num_kv_pages: int | None = None       # jaxdec's KV pool (None: room for every row)
    seed: int = 0
    llama_server: str | None = None       # the binary (needed when llama.cpp is a system)
    threads: int = os.cpu_count() or 1    # llama-server's -t
    start_timeout_s: float = 900.0        # a first jaxdec start compiles (~1-2 min)


QUICK = Settings(requests=8, rates=(1.0, 4.0), static_seqs=(), rounds=2)  # `--quick`: a smoke run


@dataclasses.dataclass(frozen=True, kw_only=True)
class System:
    name: str
    policy: str | None      # jaxdec serve's --policy; None: llama.cpp
    max_num_seqs: int

    def argv(self, s: Settings, gguf: str, port: int) -> list[str]:
        n = self.max_num_seqs
        if self.policy is None:
            return [s.llama_server, "-m", gguf, "-a", s.model, "--host", HOST, "--port", str(port),
                    "-np", str(n), "-c", str(n * s.context), "-cb", "-t", str(s.threads), "--metrics"]
        argv = [sys.executable, "-m", "jaxdec", "serve", "--model", s.model, "--weights", "gguf",
                "--host", HOST, "--port", str(port), "--policy", self.policy,
                "--max-num-seqs", str(n), "--max-model-len", str(s.context)]
        if s.num_kv_pages is not None:
            argv += ["--num-kv-pages", str(s.num_kv_pages)]
        sla = ["--tpot-slo", str(s.tpot_slo), "--ttft-slo", str(s.ttft_slo)]
        return argv + (sla if self.policy == "sla" else [])


def systems(s: Settings) -> list[System]:
    """--systems at --max-num-seqs, then fcfs at each other --static-seqs limit."""
    out = [System(name=n, policy=None if n == LLAMA_CPP else n, max_num_seqs=s.max_num_seqs)
           for n in s.systems]
    return out + [System(name=f"fcfs seqs={k}", policy="fcfs", max_num_seqs=k) for k in s.static_seqs
                  if not (k == s.max_num_seqs and "fcfs" in s.systems)]


def find_llama_server(path: str | None) -> str:
    """The llama-server binary: `path`, else the one beside this Python (`make llama-server`
    installs it there), else one on PATH."""
    beside = pathlib.Path(sys.executable).parent / "llama-server"
    found = path or (str(beside) if beside.is_file() else shutil.which("llama-server"))
    if not found or not os.access(found, os.X_OK) or not os.path.isfile(found):
        where = f"at {path}" if path else f"beside {sys.executable} or on PATH"
        raise JaxdecError(f"llama-server not found {where}: build it with `make llama-server` "
                          "(or pass --llama-server PATH)")
    return found


def gguf_path(model: str) -> str:
    from jaxdec.checkpoint import registry

    path = str(registry.resolve(model)) if model in registry.MODELS else model
    if not path.endswith(".gguf") or not os.path.isfile(path):
        raise JaxdecError(f"--model must be a named model or a .gguf file that both servers load (got {model!r})")
    return path


class ServerFailed(Exception):
    """A server that exited, or was not ready in time."""


def _tail(log: pathlib.Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "no output"


def _poll(proc: subprocess.Popen, log: pathlib.Path, timeout_s: float, done, what: str) -> None:
    """Until `done()` (an HTTP error counts as not yet); ServerFailed if the process exits or
    time runs out."""
    import httpx2

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerFailed(f"exited with status {proc.returncode}: {_tail(log)}")
        with contextlib.suppress(httpx2.HTTPError):
            if done():
                return
        time.sleep(0.5)
    raise ServerFailed(f"{what} after {timeout_s:.0f} s: {_tail(log)}")


def _get(url: str):
    import httpx2

    return httpx2.get(url, timeout=5.0, trust_env=False)


def _wait_ready(proc: subprocess.Popen, url: str, log: pathlib.Path, timeout_s: float) -> None:
    """Until GET /health answers 200."""
    _poll(proc, log, timeout_s, lambda: _get(f"{url}/health").status_code == 200, "not ready")


UNPRIMED = "jaxdec:step_shapes_unprimed"


def unprimed(metrics_text: str) -> int | None:
    """The step shapes a jaxdec server has not run yet, from its /metrics text (None: the
    gauge is absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(metrics_text):
        if family.name == UNPRIMED:
            return int(family.samples[0].value)
    return None


def _wait_primed(proc: subprocess.Popen, url: str, log: pathlib.Path, timeout_s: float) -> None:
    """Until a ready jaxdec server has run each warmed step shape once (it does so while
    idle, `AsyncEngine`): a shape's first call costs 0.1-2 s more than its later ones, and
    the first load would pay it."""
    _poll(proc, log, timeout_s, lambda: unprimed(_get(f"{url}/metrics").text) in (0, None),
          "step shapes not primed")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (its own session), SIGKILL if it lingers."""
    for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait_s)


@contextlib.contextmanager
def serving(argv: list[str], log: pathlib.Path, timeout_s: float, *, primed: bool = False):
    """A server started with `argv` (its port in it) -> its base URL, once ready (and with
    `primed`, once its step shapes have each run: `_wait_primed`); it is stopped when the
    block exits, however it exits."""
    port = argv[argv.index("--port") + 1]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # (Ctrl-C reaches us only: we stop it)
    try:
        url = f"http://{HOST}:{port}"
        _wait_ready(proc, url, log, timeout_s)
        if primed:
            _wait_primed(proc, url, log, timeout_s)
        yield f"{url}/v1"
    finally:
        _stop(proc)


def make_loads(tokenizer, s: Settings) -> tuple[list, list, list]:
    """The open loads [(name, rate or None, jobs)], the closed loops [(clients, jobs)] and
    two warm-up jobs; a job is (prompt text, output tokens, arrival s). Every load has
    prompts of its own, from the corpora (the same ones every run): a prompt sent again
    in a later load would come from the servers' prefix caches (jaxdec's pool keeps every
    earlier prompt, llama.cpp's slots their last), and the later loads would measure cache
    hits. The arrivals are the same draws at every rate, scaled as 1/rate."""
    from jaxdec.bench.workload import workload

    sizes = [s.requests] * (len(s.rates) + 1) + [max(s.rounds * c, s.requests // 4) for c in s.clients] + [2]
    drawn = workload(tokenizer, sum(sizes), 1.0, s.seed)   # arrivals at 1/s, scaled per rate below
    arrivals = [a for _, _, a in drawn[:s.requests]]
    texts = iter([(tokenizer.decode(ids), m) for ids, m, _ in drawn])
    blocks = [[next(texts) for _ in range(n)] for n in sizes]
    opened = [(f"{r:g}/s", r, [(p, m, a / r) for (p, m), a in zip(block, arrivals)])
              for r, block in zip(s.rates, blocks)]
    opened.append(("burst", None, [(p, m, 0.0) for p, m in blocks[len(s.rates)]]))
    closed = [(c, [(p, m, 0.0) for p, m in block]) for c, block in zip(s.clients, blocks[len(s.rates) + 1:])]
    return opened, closed, [(p, 8, 0.0) for p, _ in blocks[-1]]


def _records(records: list[serve_stats.Record]) -> list[dict]:
    return [{"sent": round(r.sent, 4), "first": round(r.chunks[0], 4) if r.chunks else None,
             "end": round(r.end, 4), "output_tokens": r.output_tokens,
             "asked": r.asked, "prompt_tokens": r.prompt_tokens, "error": r.error} for r in records]


def drive(url: str, s: Settings, loads: list, closed: list, warm: list, log) -> dict:
    """Every load against one ready server, after the warm-up jobs."""
    slo, model = Slo(ttft_s=s.ttft_slo, tpot_s=s.tpot_slo), s.model
    asyncio.run(serve_client.open_loop(url, model, warm))
    out = {"loads": [], "closed": []}
    for name, rate, jobs in loads:
        records = asyncio.run(serve_client.open_loop(url, model, jobs))
        out["loads"].append({"name": name, "rate": rate, **serve_stats.summarize(records, slo),
                             "records": _records(records)})
        log(f"  {name}: {serve_report.brief(out['loads'][-1])}")
    for clients, jobs in closed:
        records = asyncio.run(serve_client.closed_loop(url, model, jobs, clients))
        out["closed"].append({"clients": clients, **serve_stats.summarize(records, slo)})
        log(f"  closed loop, {clients} clients: {out['closed'][-1]['output_tok_s']:.1f} output tok/s")
    return out


def bench_system(system: System, s: Settings, gguf: str, loads: list, closed: list, warm: list, log) -> dict:
    argv = system.argv(s, gguf, free_port(HOST))
    result = {"argv": argv, "policy": system.policy, "max_num_seqs": system.max_num_seqs}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="jaxdec-bench-serve-") as tmp:
        try:
            # (a jaxdec server is driven once its step shapes have each run: no load pays a first call)
            with serving(argv, pathlib.Path(tmp, "server.log"), s.start_timeout_s,
                         primed=system.policy is not None) as url:
                result["ready_s"] = round(time.perf_counter() - start, 1)
                log(f"  ready in {result['ready_s']} s: {' '.join(argv)}")
                result |= drive(url, s, loads, closed, warm, log)
        except ServerFailed as e:
            result["error"] = f"server {e}"
            log(f"  error: {result['error']}")
    return result


def capacities(results: dict) -> dict:
    """Each system's highest sustained Poisson rate (SLO met by >= 90% of requests)."""
    return {name: serve_stats.capacity({ld["rate"]: ld["slo_attainment"]
                                        for ld in r.get("loads", ()) if ld["rate"] is not None})
            for name, r in results.items() if "error" not in r}


def sla_vs_static(results: dict, caps: dict) -> dict:
    """The sla policy's capacity over the best capacity of fcfs at a fixed batch limit."""
    fixed = [name for name, r in results.items() if r.get("policy") == "fcfs" and name in caps]
    best = max(fixed, key=lambda n: caps[n] or 0.0, default=None)
    sla, base = caps.get("sla"), (caps[best] if best else None)
    return {"sla_req_s": sla, "best_fixed": best, "best_fixed_req_s": base,
            "ratio": serve_stats.ratio(sla, base), "paper_ratio": PAPER_SLA_GAIN}


FIGURES = {"output_tok_s": lambda ld: ld["output_tok_s"], "goodput_req_s": lambda ld: ld["goodput_req_s"],
           "ttft_p50": lambda ld: ld["ttft_s"]["p50"], "tpot_p50": lambda ld: ld["tpot_s"]["p50"]}


def ratios(results: dict) -> dict:
    """"vs static" and "vs llama.cpp" -> system -> load -> each figure over the base's at
    the same load."""
    def against(base: str) -> dict:
        theirs = {ld["name"]: ld for ld in results.get(base, {}).get("loads", ())}
        return {name: {ld["name"]: {k: serve_stats.ratio(get(ld), get(theirs[ld["name"]]))
                                    for k, get in FIGURES.items()}
                       for ld in r.get("loads", ()) if ld["name"] in theirs}
                for name, r in results.items() if name != base and theirs and "error" not in r}

    return {f"vs {base}": against(base) for base in (STATIC, LLAMA_CPP)}


def run(s: Settings, log=print) -> dict:
    from jaxdec.checkpoint.gguf_reader import read_gguf_header
    from jaxdec.checkpoint.tokenizer import Tokenizer

    gguf = gguf_path(s.model)
    loads, closed, warm = make_loads(Tokenizer.from_gguf(read_gguf_header(gguf).metadata), s)
    results = {}
    for system in systems(s):
        log(f"{system.name} (max_num_seqs {system.max_num_seqs}) ...")
        results[system.name] = bench_system(system, s, gguf, loads, closed, warm, log)
    caps = capacities(results)
    return {"host": host(), "settings": dataclasses.asdict(s), "gguf": gguf, "systems": results,
            "capacity_req_s": caps,
            "sla_vs_static": sla_vs_static(results, caps), "ratios": ratios(results)}


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # so that every `finally` runs and stops its server


def main(s: Settings, json_path: str | None = None, plot_path: str | None = None) -> int:
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        report = run(s, log=lambda m: print(m, file=sys.stderr, flush=True))
    finally:
        signal.signal(signal.SIGTERM, previous)
    serve_report.print_report(report)
    if json_path:
        pathlib.Path(json_path).write_text(json.dumps(report, indent=1))
        print(f"wrote {json_path}")
    if plot_path:
        serve_report.plot(report, plot_path)
        print(f"wrote {plot_path}")
    return 1 if any("error" in r for r in report["systems"].values()) else 0
