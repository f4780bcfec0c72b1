"""The engine: continuous batching over a paged pool, with chunked prefill, prefix caching
and preemption by recompute.

    engine = jaxdec.Engine(model, max_num_seqs=8, max_num_batched_tokens=256)
    rid = engine.add_request("Once upon a time", SamplingParams(max_tokens=32))
    while engine.has_unfinished():
        for out in engine.step():          # RequestOutput: new tokens and text of a request
            print(out.request_id, out.text, out.finished)
    results = engine.generate(["a", "b"], SamplingParams(max_tokens=16))  # offline, vLLM's habit

Each `step` schedules on the host, then runs the model once or twice (`step.run_rows`):
1. **Schedule** under a token budget (`max_num_batched_tokens`) and `max_num_seqs` rows.
   Running requests come first, in the policy's order: a decoding request gets 1 token, a
   request still in its prompt a chunk of it (Sarathi's chunked prefill), as far as the
   budget goes. Then waiting requests are admitted in the policy's order while a row, the
   budget, pages and the policy (`row_limit`, `admits`) allow; under fcfs every step is
   filled while requests wait (work-conserving). A policy that does not mix decodes with
   prompt chunks (prefill-first) runs the chunks alone whenever there are any. An
   admitted request first takes the longest prefix of its tokens that the pool caches
   (`jaxdec.cache.pages.PagePool`), up to the page before its last token, which is always computed for
   its logits. When the pool has no page for a running request's next tokens, the policy's
   victim is preempted: its pages are released and it waits again at the front, to be
   recomputed from its prompt and the tokens it had generated. No request is admitted in
   a step that preempted.
2. **Run**: rows with one token run as the decode batch ([R, 1]), rows with a prompt chunk
   as prefill batches ([Bp, C]), one for each chunk bucket C, each packed into its first rows whatever pool rows the
   requests hold. The sizes are bucketed (`buckets`: R, Bp and C to powers of two, and
   the page-table width, which attention reads whole, to powers of two: each batch's
   table is as wide as its longest row needs, decode and prefill alike), so a lone request
   decodes at [1, 1], not padded to max_num_seqs rows, a short prompt's chunk attends over
   its own few pages, not max_model_len's, and after `warmup` the engine compiles nothing new,
   whatever the prompts, lengths and settings. (A row's floats depend on its batch's
   shape, so at near-ties a request's tokens can depend on what runs beside it, as in
   vLLM without its batch-invariant kernels.)
3. **Commit**: each row that reached its last token takes the sampled token; stop tokens,
   stop strings (`detok.TextStream`), `max_tokens` end it and free its row and pages at
   once; pages that filled up are published to the prefix cache.
"""

from __future__ import annotations

import dataclasses
import os
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdec import exec_cache
from jaxdec.batching import bucket, bucket_sizes, check_ids
from jaxdec.cache import dense, quantized
from jaxdec.cache.paged import page_pool
from jaxdec.engine import policy as policies
from jaxdec.engine.detok import TextStream
from jaxdec.cache.pages import PagePool, prefix_keys
from jaxdec.engine.request import Request, SamplingParams, Status
from jaxdec.engine.step import fill_pages, run_rows
from jaxdec.errors import JaxdecError
from jaxdec.sampling import RowParams


@dataclasses.dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    token_ids: list[int]          # new this step (one, or none while its prompt runs)
    text: str                     # new text this step (held back while a stop string may form)
    finished: bool
    finish_reason: str | None     # "stop", "length" or "abort"
    logprobs: list[tuple[float, list[tuple[int, float]]]]  # per new token: its own, the top ones
    request: Request              # the whole request: prompt, every output id, timings


def _fit(n: int, sizes: list[int]) -> int:
    """The smallest compiled size (ascending `sizes`) that holds n."""
    return next(x for x in sizes if x >= n)


MAP_SHARE = 0.9  # of vm.max_map_count that compiled steps may fill before the engine refuses more


def memory_maps() -> tuple[int, int]:
    """(memory maps this process holds, the kernel's limit vm.max_map_count); (0, 0) where
    /proc does not tell. XLA:CPU maps each compiled kernel's code and data apart: one step
    shape of SmolLM2 holds 340-600 maps, so some hundred shapes reach Linux's default limit
    of 65530, where the JIT's next mmap fails ("LLVM compilation error: Cannot allocate
    memory") and the process dies."""
    try:
        with open("/proc/self/maps", "rb") as f:
            used = sum(1 for _ in f)
        with open("/proc/sys/vm/max_map_count") as f:
            return used, int(f.read())
    except (OSError, ValueError):
        return 0, 0


def _reached(sizes: list[int], most: int) -> list[int]:
    """The compiled sizes (ascending) that some n in [1, most] fits into."""
    return [x for i, x in enumerate(sizes) if (sizes[i - 1] + 1 if i else 1) <= most]


class Engine:
    def __init__(self, model, *, max_num_seqs: int = 8, max_num_batched_tokens: int = 256,
                 max_model_len: int | None = None, page_size: int = 32, num_pages: int | None = None,
                 kv_cache_memory: int = 1 << 30, max_prefill_seqs: int = 4, policy: str = "fcfs",
                 max_chunk: int | None = None, enable_prefix_caching: bool = True,
                 fill: float = 0.0, seed: int = 0):
        """`max_model_len` (default: the model's context, at most 4096) bounds prompt plus
        output; the pool has `num_pages` pages of `page_size` tokens (default: enough for
        every row at full length, within `kv_cache_memory` bytes). `max_chunk` caps the
        prompt tokens one request runs in one step (default: the budget). `fill` is what
        unused pages hold at first (NaN in tests: it must never reach an output)."""
        cfg = model.cfg
        dense.check("paged", cfg.attention_impl, cfg)
        # the model's cache kind picks the page pool: the activation dtype, or quantised codes
        if model.kv_cache not in ("dense", "paged", *quantized.KINDS):
            raise JaxdecError(f"the engine keeps keys and values in a page pool in the activation dtype "
                              f"(kv_cache 'dense' or 'paged'), or {' or '.join(quantized.KINDS)}, "
                              f"not {model.kv_cache!r}")
        self.quant = model.kv_cache if model.kv_cache in quantized.KINDS else None
        if self.quant and cfg.attention_impl != "xla":
            raise JaxdecError("no Pallas kernel reads a quantised page pool yet: use attention_impl='xla'")
        if any(cfg.window(i) is not None for i in range(cfg.n_layers)):
            raise JaxdecError("the engine does not serve sliding-window layers yet (Gemma 3): "
                              "use jaxdec.generate")
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("page_size", page_size), ("max_prefill_seqs", max_prefill_seqs),
                            ("max_chunk", 1 if max_chunk is None else max_chunk),
                            ("num_pages", 1 if num_pages is None else num_pages)):
            if not isinstance(value, int) or value < 1:
                raise JaxdecError(f"{name} must be a positive integer (got {value!r})")
        self.model, self.cfg = model, cfg
        self.max_model_len = min(max_model_len or 4096, cfg.max_position)
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_prefill_seqs = min(max_prefill_seqs, max_num_seqs)
        self.max_chunk = max_num_batched_tokens if max_chunk is None else max_chunk
        self.prefix_caching, self.fill = enable_prefix_caching, fill
        self.page_size = page_size
        self.pages_per_row = -(-self.max_model_len // page_size)
        if num_pages is None:
            page_bytes = sum(2 * jax.tree.reduce(lambda n, x: n + x.nbytes, self._pool_pages(i, 0), 0)
                             for i, (mixer, _) in enumerate(cfg.kinds) if mixer == "attention")
            num_pages = min(max_num_seqs * self.pages_per_row,
                            max(self.pages_per_row, kv_cache_memory // page_bytes))
        self.pool = PagePool(num_pages)
        self.policy = policies.make(policy)  # (a name, or a policy object)
        self.sizes = self.buckets()
        self.scratch = num_pages
        self.table = np.full((max_num_seqs, self.pages_per_row), self.scratch, np.int32)
        self.pools = tuple(self._pool(i, num_pages) if mixer == "attention" else None
                           for i, (mixer, _) in enumerate(cfg.kinds))
        self.stop_ids = frozenset(model.tokenizer.stop_ids)
        self.free_rows = list(range(max_num_seqs))[::-1]
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._streams: dict[str, TextStream] = {}
        self._seeds: dict[str, int] = {}
        self._published: dict[str, int] = {}
        self._keys: dict[str, list[bytes]] = {}
        self._aborted: list[RequestOutput] = []
        self._watched: dict[str, list[RequestOutput]] = {}
        self._rng = np.random.default_rng(seed)
        self._steps = {}  # (rows, chunk, table width) -> the step's executable
        self._ran: set[tuple[int, int, int]] = set()  # the shapes that have run (`prime`)
        self._deferred: set[tuple[int, int, int]] = set()  # stored shapes to load while idle
        self._next_id = 0
        self.last_step = dict(decode_rows=0, prefill_rows=0, tokens=0)  # what the last step ran
        self.counters = dict(steps=0, preemptions=0, prefix_hit_tokens=0, prefix_query_tokens=0,
                             computed_tokens=0, generation_tokens=0)

    def _pool_pages(self, layer: int, num_pages: int):
        """One of a layer's two pools (keys, values) on the host: `num_pages` pages and the
        scratch page."""
        return page_pool(self.cfg.kv_heads(layer), self.cfg.head_dim, num_pages, self.page_size,
                         self.model.dtype, quant=self.quant, fill=self.fill)

    def _pool(self, layer: int, num_pages: int):
        put = lambda: jax.device_put(self._pool_pages(layer, num_pages), may_alias=False)
        return put(), put()

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
                    priority: int = 0, arrival: float | None = None) -> str:
        """Queue a prompt (text, or token ids) -> its request id. A prompt the model or the
        pool could never hold is refused at once with a one-line `JaxdecError`."""
        params = SamplingParams() if params is None else params
        ids = self.model.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self.check(ids, params)
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        if request_id in self.requests:
            raise JaxdecError(f"request id {request_id!r} is already in use")
        request = Request(request_id, ids, params, priority=priority)
        if arrival is not None:
            request.arrival = arrival
        self.requests[request_id] = request
        self._streams[request_id] = TextStream(self.model.tokenizer, params.stop)
        self._seeds[request_id] = params.seed if params.seed is not None else int(self._rng.integers(2**62))
        self.waiting.append(request)
        return request_id

    def check(self, ids: list[int], params: SamplingParams) -> None:
        """Refuse, with a one-line `JaxdecError`, a prompt (token ids) the model or the pool
        could never hold. It reads only what never changes, so any thread may ask (the
        server does, so that a refusal never waits for a step)."""
        if not ids:
            raise JaxdecError("empty prompt: nothing to condition on")
        check_ids([ids], self.cfg.vocab_size)
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise JaxdecError(f"prompt of {len(ids)} tokens + max_tokens {params.max_tokens} exceeds "
                              f"the engine's context of {self.max_model_len} tokens")
        if -(-total // self.page_size) > self.pool.n_pages:
            raise JaxdecError(f"prompt of {len(ids)} tokens + max_tokens {params.max_tokens} needs "
                              f"{-(-total // self.page_size)} pages; the pool has {self.pool.n_pages}")

    def abort(self, request_id: str) -> None:
        """Stop a request now; its row and pages are freed at once."""
        r = self.requests.get(request_id)
        if r is None:
            raise JaxdecError(f"no request {request_id!r} to abort")
        if r.finished:
            return
        if r.status is Status.RUNNING:
            self._release(r)
            self.running.remove(r)
        else:
            self.waiting.remove(r)
        out = self._finish(r, "abort", [], "", [])
        self._aborted.append(out)

    def forget(self, request_id: str) -> None:
        """Drop a finished request and its text (a server that runs for long keeps none)."""
        r = self.requests.get(request_id)
        if r is not None and not r.finished:
            raise JaxdecError(f"request {request_id!r} has not finished: abort it first")
        for table in (self.requests, self._streams, self._seeds):
            table.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> dict:
        """The counters a server exports: running, waiting, pages used and free, preemptions,
        prefix-cache tokens hit and queried, tokens computed, step shapes not yet primed."""
        return dict(running=len(self.running), waiting=len(self.waiting), pages_used=self.pool.n_used,
                    pages_free=self.pool.n_free, pages_cached=self.pool.n_cached,
                    unprimed=len(self._unprimed()), **self.counters)

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run and commit one step -> the outputs of the requests it touched."""
        start = time.perf_counter()
        outputs, self._aborted = self._aborted, []
        plan = self._schedule()
        # (decode_seconds: the decode batch's own time, without the step's prompt chunks;
        # first_call: a shape ran for its first time, or was loaded, and cost more than it will)
        self.last_step = dict(decode_rows=sum(n == 1 for _, n in plan), prefill_rows=sum(n > 1 for _, n in plan),
                              tokens=sum(n for _, n in plan), decode_seconds=0.0, first_call=False)
        if plan:
            self.counters["steps"] += 1
            results, ran = {}, len(self._ran)
            for group in self._groups(plan):
                decode, begun = group[0][1] == 1, time.perf_counter()
                results.update(self._run(group, decode=decode))
                if decode:
                    self.last_step["decode_seconds"] = time.perf_counter() - begun
            self.last_step["first_call"] = len(self._ran) > ran
            outputs += self._commit(plan, results)
        self.policy.observe(self, time.perf_counter() - start, outputs)
        for out in outputs:
            if out.request_id in self._watched:
                self._watched[out.request_id].append(out)
        return outputs

    def _groups(self, plan) -> list[list[tuple[Request, int]]]:
        """The plan's rows as the batches that run them: the prompt chunks by chunk bucket
        (a batch pads every row to its longest chunk: a 200-token chunk beside three short
        ones would run [4, 256], four times its tokens, where [1, 256] and [3, 32] run
        little more than theirs), then the decode rows."""
        by_chunk: dict[int, list] = {}
        for r, n in plan:
            if n > 1:
                by_chunk.setdefault(_fit(n, self.sizes["prefill_chunk"]), []).append((r, n))
        decode = [(r, n) for r, n in plan if n == 1]
        return [g for _, g in sorted(by_chunk.items())] + ([decode] if decode else [])

    def _schedule(self) -> list[tuple[Request, int]]:
        if self.policy.mixed:
            if self.policy.defers_prompts(self):  # (the decodes alone; prompts if nothing decodes)
                return self._plan(lambda n: n == 1) or self._plan(lambda n: True)
            return self._plan(lambda n: True)
        # a policy that does not mix: prompt chunks alone when there are any, else decodes
        return self._plan(lambda n: n > 1) or self._plan(lambda n: n == 1)

    def _plan(self, takes) -> list[tuple[Request, int]]:
        """The step's rows and their token counts n, of the rows whose `takes(n)`."""
        budget, plan, preempted, chunks = self.max_num_batched_tokens, [], False, 0
        scheduled = set()
        for r in self.policy.admit_order(self.running):
            if r.status is not Status.RUNNING or budget == 0:
                continue
            n = min(r.n_tokens - r.n_computed, budget, self.max_chunk)
            if (n > 1 and chunks == self.max_prefill_seqs) or not takes(n):
                continue
            while not self._reserve(r, r.n_computed + n):
                victim = self.policy.victim([x for x in self.running if x.id not in scheduled])
                self._preempt(victim)
                preempted = True
                if victim is r:
                    break
            if r.status is not Status.RUNNING:
                continue
            plan.append((r, n))
            scheduled.add(r.id)
            budget -= n
            chunks += n > 1
        if preempted:
            return plan
        for r in self.policy.admit_order(self.waiting):
            if not self.free_rows or budget == 0 or len(self.running) >= self.policy.row_limit(self) \
                    or not self.policy.admits(self, r):
                break
            keys = self._page_keys(r, r.n_tokens // self.page_size)
            hit = self.pool.match(keys)[:(r.n_tokens - 1) // self.page_size] if self.prefix_caching else []
            start = len(hit) * self.page_size
            n = min(r.n_tokens - start, budget, self.max_chunk)
            if (n > 1 and chunks == self.max_prefill_seqs) or not takes(n):
                break
            need = -(-(start + n) // self.page_size) - len(hit)
            if need > self.pool.n_free - sum(int(self.pool.refs[p] == 0) for p in hit):
                break  # head of the line waits for pages (FCFS order is kept)
            self.pool.acquire(hit)
            r.pages = hit + self.pool.allocate(need)
            r.n_computed = r.n_cached = start
            self._published[r.id] = len(hit)
            self.counters["prefix_hit_tokens"] += start
            self.counters["prefix_query_tokens"] += r.n_tokens
            r.row = self.free_rows.pop()
            self.table[r.row] = self.scratch
            self.table[r.row, :len(r.pages)] = r.pages
            r.status = Status.RUNNING
            self.waiting.remove(r)
            self.running.append(r)
            plan.append((r, n))
            budget -= n
            chunks += n > 1
        return plan

    def _reserve(self, r: Request, n_tokens: int) -> bool:
        """Give `r` pages for its first n_tokens tokens, if the pool has them."""
        need = -(-n_tokens // self.page_size) - len(r.pages)
        if need <= 0:
            return True
        if need > self.pool.n_free:
            return False
        new = self.pool.allocate(need)
        self.table[r.row, len(r.pages):len(r.pages) + need] = new
        r.pages += new
        return True

    def _release(self, r: Request) -> None:
        self.pool.release(r.pages)
        if self.fill != 0:  # a test's poison: freed pages that cache nothing take `fill`
            freed = [p for p in r.pages if self.pool.refs[p] == 0 and not self.pool.caches(p)]
            pages = np.full(self.pool.n_pages, self.scratch, np.int32)
            pages[:len(freed)] = freed
            self.pools = fill_pages(self.pools, pages, jnp.float32(self.fill))
        r.pages = []
        self.table[r.row] = self.scratch
        self.free_rows.append(r.row)
        r.row = None

    def preempt(self, request_id: str) -> None:
        """Preempt a running request now (as when pages run out): it is recomputed later."""
        r = self.requests.get(request_id)
        if r is None or r.status is not Status.RUNNING:
            raise JaxdecError(f"no running request {request_id!r} to preempt")
        self._preempt(r)

    def _preempt(self, r: Request) -> None:
        """Free a running request's row and pages; it waits again, to be recomputed."""
        self._release(r)
        self.running.remove(r)
        r.status, r.n_computed = Status.WAITING, 0
        r.n_preempted += 1
        self.counters["preemptions"] += 1
        self.waiting.insert(0, r)

    def buckets(self) -> dict[str, list[int]]:
        """The compiled sizes (`batching.bucket`): decode batches are [decode_rows, 1] and
        prefill batches [prefill_rows, prefill_chunk], each over a page table as wide as the
        rows need (one of `pages`: attention reads every slot of the table's width)."""
        return dict(decode_rows=bucket_sizes(1, self.max_num_seqs),
                    prefill_rows=bucket_sizes(1, self.max_prefill_seqs),
                    prefill_chunk=bucket_sizes(32, bucket(min(self.max_chunk, self.max_num_batched_tokens), 32)),
                    pages=bucket_sizes(4, self.pages_per_row))

    def shapes(self) -> list[tuple[int, int, int]]:
        """Every step shape (rows, chunk, table width) the engine can run, and no other:
        decode rows at every width, and prefill chunks at the widths that can hold them (a
        chunk of c tokens holds more than the next smaller chunk's, so its rows reach past
        that). A row bucket is reached only by as many rows as the token budget lets run at
        once: with a budget of 256, two chunks of more than 128 tokens never share a step,
        so [2, 256] and [4, 256] are never run."""
        sizes, budget = self.sizes, self.max_num_batched_tokens
        shapes = [(b, 1, p) for b in _reached(sizes["decode_rows"], budget) for p in sizes["pages"]]
        smaller = 1
        for c in sizes["prefill_chunk"]:
            least = -(-(smaller + 1) // self.page_size)
            shapes += [(b, c, p) for b in _reached(sizes["prefill_rows"], budget // (smaller + 1))
                       for p in sizes["pages"] if p >= least or p == sizes["pages"][-1]]
            smaller = c
        return shapes

    def warmup(self, *, defer: bool = False) -> int:
        """Compile every step shape now, or load it from jaxdec's executable cache when
        that is on (nothing runs) -> how many shapes it compiled or loaded; afterwards no
        prompt, length or setting compiles anything.

        defer=True: of the shapes stored in the executable cache, load only those over
        the narrowest table width (a fresh server's first requests), and leave the rest to
        `prime`, which loads them while the engine is idle (a request that needs one
        first loads it then, ~1-2 s on two cores, instead of a compile). Loading all 59
        shapes of SmolLM2 at 16 rows took 73 s on a 2-vCPU AMD host."""
        shapes = self.shapes()
        if defer:
            narrow = min(p for _, _, p in shapes)
            later = {s for s in shapes if s[2] != narrow and s not in self._steps
                     and exec_cache.stored(run_rows, *self._inputs([], *s)[0], cfg=self.cfg)}
            # (narrow first: a process loads in the order the last one used, `exec_cache.prefetch`)
            shapes = sorted((s for s in shapes if s not in later), key=lambda s: s[2] != narrow)
            self._deferred |= later
        # on threads: loading an executable (0.2-2.4 s on 2 cores, growing with its size)
        # runs outside the GIL, so two load in about half the time (65 shapes on an Intel
        # host: 11.4 s against 20.9 s); compiles take exec_cache's lock and run one at a time
        with ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:
            list(pool.map(lambda s: self._executable(*s, self._inputs([], *s)[0]), shapes))
        return len(shapes)

    def unprimed(self) -> list[tuple[int, int, int]]:
        """The step shapes compiled, loaded or deferred (`warmup(defer=True)`) that have not
        run yet, cheapest first (`prime` runs them; a shape that is none of these is not
        compiled for this)."""
        return sorted(self._unprimed(), key=lambda s: (s[0] * s[1] * s[2], s))

    def _unprimed(self) -> set[tuple[int, int, int]]:
        return (self._steps.keys() | self._deferred) - self._ran

    def prime(self, shape: tuple[int, int, int]) -> float:
        """Run one step of `shape` on padding rows alone -> its seconds. Padding rows read
        and write only the scratch page, so no request's pages or outputs change. A shape's
        first call costs more than its later ones (0.1-1 s on two cores: XLA sets up its
        runtime then): run here, while nothing waits, a request does not pay it."""
        start = time.perf_counter()
        self._launch([], *shape)  # (no rows: every row is padding)
        return time.perf_counter() - start

    def _executable(self, b: int, c: int, p: int, args):
        """The executable of the step of shape (rows b, chunk c, table width p): from
        jaxdec's executable cache when it is on, else compiled here; kept for the engine's
        life (its `len(engine._steps)` shapes are all it ever compiles)."""
        step = self._steps.get((b, c, p))
        if step is None:
            used, limit = memory_maps()
            if used > MAP_SHARE * limit > 0:
                raise JaxdecError(
                    f"the {len(self._steps)} step shapes compiled so far hold {used} of this host's {limit} "
                    f"memory maps (vm.max_map_count), and XLA's JIT crashes past it: lower --max-num-seqs "
                    f"or --max-model-len ({len(self.shapes())} step shapes now), or raise vm.max_map_count")
            step = exec_cache.compiled(run_rows, *args, cfg=self.cfg) or run_rows.lower(*args, cfg=self.cfg).compile()
            self._steps[b, c, p] = step
        return step

    def _run(self, group, *, decode: bool) -> dict:
        """Run one batch of rows -> {request id: (token, logprob, top ids, top logprobs)}."""
        return self._launch(group, *self.shape(group, decode=decode))

    def shape(self, group, *, decode: bool) -> tuple[int, int, int]:
        """The step shape (rows, chunk, table width) that runs these (request, tokens) rows."""
        sizes, fit = self.sizes, _fit
        widest = max(-(-(r.n_computed + n) // self.page_size) for r, n in group)
        if decode:
            b, c = fit(len(group), sizes["decode_rows"]), 1
        else:
            b, c = fit(len(group), sizes["prefill_rows"]), fit(max(n for _, n in group), sizes["prefill_chunk"])
        return b, c, fit(widest, sizes["pages"])

    def _launch(self, group, b: int, c: int, p: int) -> dict:
        args, where = self._inputs(group, b, c, p)
        sampled, chosen, (top_lp, top_ids), self.pools = self._executable(b, c, p, args)(*args)
        self._ran.add((b, c, p))
        sampled, chosen, top_lp, top_ids = map(np.asarray, (sampled, chosen, top_lp, top_ids))
        return {rid: (int(sampled[row]), float(chosen[row]), top_ids[row], top_lp[row])
                for rid, row in where.items()}

    def _inputs(self, group, b: int, c: int, p: int):
        """`run_rows`'s arguments for these rows, packed into the first rows of a [b, c]
        batch over a table of width p -> (the arguments, {request id: its row})."""
        tokens, positions = np.zeros((b, c), np.int32), np.full((b, c), -1, np.int32)
        lengths, last, counters = np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros(b, np.int32)
        table = np.full((b, p), self.scratch, np.int32)
        seeds = np.zeros((b, 2), np.uint32)
        temp, top_k = np.zeros(b, np.float32), np.zeros(b, np.int32)
        top_p, min_p = np.ones(b, np.float32), np.zeros(b, np.float32)
        where = {}
        for row, (r, n) in enumerate(group):
            where[r.id] = row
            tokens[row, :n] = r.all_ids[r.n_computed:r.n_computed + n]
            positions[row, :n] = np.arange(r.n_computed, r.n_computed + n)
            lengths[row], last[row], counters[row] = r.n_computed, n - 1, len(r.output_ids)
            table[row] = self.table[r.row, :p]
            seed = self._seeds[r.id]
            seeds[row] = (seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF
            sp = r.params
            temp[row], top_k[row], top_p[row], min_p[row] = sp.temperature, sp.top_k, sp.top_p, sp.min_p
        # host arrays go in as they are (jnp.asarray would be a transfer program per array)
        row_params = RowParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p)
        want_top = np.bool_(any(r.params.logprobs for r, _ in group))
        args = (self.model.params, self.pools, table, tokens, positions, lengths, last, row_params,
                seeds, counters, want_top)
        return args, where

    def _commit(self, plan, results) -> list[RequestOutput]:
        now, outputs = time.monotonic(), []
        for r, n in plan:
            r.n_computed += n
            self._publish(r)
            self.counters["computed_tokens"] += n
            if r.n_computed < r.n_tokens:  # mid-prompt: its sample is not a token
                continue
            token, lp, top_ids, top_lp = results[r.id]
            r.output_ids.append(token)
            r.token_times.append(now)
            r.first_token_time = r.first_token_time or now
            self.counters["generation_tokens"] += 1
            stream = self._streams[r.id]
            text = stream.put(token)
            n_top = r.params.logprobs or 0
            logprobs = [(lp, [(int(i), float(v)) for i, v in zip(top_ids[:n_top], top_lp[:n_top])])]
            reason = None
            if stream.stopped or (token in self.stop_ids and not r.params.ignore_eos) \
                    or token in r.params.stop_token_ids:
                reason = "stop"
            elif len(r.output_ids) >= r.params.max_tokens:
                reason = "length"
            if reason is None:
                outputs.append(RequestOutput(r.id, [token], text, False, None, logprobs, r))
                continue
            self._release(r)
            self.running.remove(r)
            outputs.append(self._finish(r, reason, [token], text, logprobs))
        return outputs

    def _finish(self, r: Request, reason: str, tokens, text: str, logprobs) -> RequestOutput:
        text += self._streams[r.id].finish() if reason != "abort" else ""
        r.status, r.finish_reason = Status.FINISHED, reason
        for table in (self._keys, self._published):
            table.pop(r.id, None)
        return RequestOutput(r.id, tokens, text, True, reason, logprobs, r)

    def _publish(self, r: Request) -> None:
        """Publish the pages of `r` that its computed tokens filled (prefix caching)."""
        full = min(r.n_computed // self.page_size, len(r.pages))
        done = self._published[r.id]
        if full <= done:
            return
        keys = self._page_keys(r, full)
        for i in range(done, full):
            self.pool.publish(r.pages[i], keys[i])
        self._published[r.id] = full

    def _page_keys(self, r: Request, n: int) -> list[bytes]:
        """The prefix keys of r's first n full pages, computed once per request (they depend
        on its tokens only, so they outlive a preemption)."""
        keys = self._keys.setdefault(r.id, [])
        if len(keys) < n:
            ps = self.page_size
            keys += prefix_keys(r.all_ids[len(keys) * ps:n * ps], ps, keys[-1] if keys else b"")
        return keys[:n]

    # ---- conveniences -------------------------------------------------------------------------
    def text(self, request_id: str) -> str:
        """The output text of a request so far."""
        return self._streams[request_id].text

    def stream(self, request_id: str) -> Iterator[RequestOutput]:
        """The outputs of one request as the engine steps (stepping it while it runs)."""
        queue = self._watched.setdefault(request_id, [])
        try:
            while True:
                while queue:
                    out = queue.pop(0)
                    yield out
                    if out.finished:
                        return
                if self.requests[request_id].finished:
                    return
                self.step()
        finally:
            self._watched.pop(request_id, None)

    def generate(self, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[Request]:
        """Run prompts (texts or token-id lists) to completion through the engine -> their
        requests, in order (vLLM's `LLM.generate`). `text(request.id)` is each output text."""
        params = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        while any(not self.requests[i].finished for i in ids):
            self.step()
        return [self.requests[i] for i in ids]
