"""The public API: load, generate, score, save.

    model = jaxdec.load("smollm2", dtype="float32")
    out = jaxdec.generate(model, ["Hello"], max_new_tokens=32, sampler=Greedy(), seed=0)
    logits = jaxdec.score(model, [[1, 2, 3]])
    jaxdec.save(model, "checkpoints/smollm2")
"""

from __future__ import annotations

import dataclasses
import pathlib
from functools import partial
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxdec import decode, exec_cache, formats, sharding
from jaxdec.batching import as_rows, bucket, check_context, check_ids, pad_rows
from jaxdec.cache import dense
from jaxdec.checkpoint import hf_layout, orbax_io, params_cache, registry
from jaxdec.config import ModelConfig
from jaxdec.errors import JaxdecError
from jaxdec.models import transformer
from jaxdec.pytree import abstract_params
from jaxdec.formats import convert, dfloat11
from jaxdec.sampling import Greedy, Sampler

_DTYPES = {"float32": jnp.float32, "f32": jnp.float32, "bfloat16": jnp.bfloat16,
           "bf16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class Model:
    """A loaded model: static config, parameter pytree, tokenizer (with chat template)."""

    cfg: ModelConfig
    params: transformer.Params
    tokenizer: Any  # jaxdec.checkpoint.tokenizer.Tokenizer
    source: str = ""
    tensor_types: dict[str, str] = dataclasses.field(default_factory=dict)
    mesh: Mesh | None = None  # the device mesh the params are laid out on (None: one device)
    kv_cache: str = "dense"  # the attention layers' cache kind (`jaxdec.cache.dense`)

    @property
    def dtype(self):
        """The activation (and KV cache) dtype."""
        return self.params.final_norm.dtype

    @property
    def weights(self) -> str:
        """The weight format: float32, bfloat16, dfloat11, int8, int4, or mixed (a GGUF's blocks)."""
        bits = {w.bits for w in jax.tree.leaves(self.params, is_leaf=_is_q) if _is_q(w)}
        if not bits:
            df11 = any(map(dfloat11.is_df11, jax.tree.leaves(self.params, is_leaf=dfloat11.is_df11)))
            return "dfloat11" if df11 else str(self.dtype)
        return f"int{bits.pop()}" if len(bits) == 1 else "mixed " + "/".join(f"int{b}" for b in sorted(bits))


def _is_q(x) -> bool:
    return isinstance(x, formats.QArray)


def _dtype(dtype) -> Any:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise JaxdecError(f"unsupported dtype {dtype!r} (float32 or bfloat16)")
        return _DTYPES[dtype]
    return jnp.dtype(dtype)


WEIGHTS = ("f32", "bf16", "int8", "int4", "gguf")


def load(source: str | pathlib.Path = "smollm2", *, dtype="float32", weights: str | None = None,
         active_experts: int | None = None, progress=None, mesh=None,
         attention_impl: str = "xla", kv_cache: str = "dense") -> Model:
    """Load a model (see `_load`); `active_experts` runs a MoE model with that many experts
    per token instead of the number it was trained with (`with_active_experts`).

    `attention_impl` ("xla" | "pallas") is how decode steps attend, and `kv_cache` what
    the attention layers' cache keeps: a kind of `jaxdec.cache.registry` ("dense", "paged",
    "int8", "int4", "window"; the Pallas kernels run in interpret mode on the CPU).

    `mesh` (a `jax.sharding.Mesh` or a spec such as "data=2,model=4", see
    `jaxdec.sharding`) lays the model out over devices: each parameter is read and only its
    slices are placed on their devices (from an orbax checkpoint, each process reads only
    its shards), so the whole model is never on one device; generation then runs sharded."""
    dense.check(kv_cache, attention_impl)
    if mesh is not None and (kv_cache, attention_impl) != ("dense", "xla"):
        raise JaxdecError("a mesh runs the dense KV cache with XLA attention only, for now "
                          f"(got kv_cache={kv_cache!r}, attention_impl={attention_impl!r})")
    mesh = None if mesh is None else sharding.make_mesh(mesh)
    model = _load(source, dtype=dtype, weights=weights, progress=progress, mesh=mesh)
    model = with_attention(model, attention_impl, kv_cache)
    return model if active_experts is None else with_active_experts(model, active_experts)


def with_attention(model: Model, attention_impl: str = "xla", kv_cache: str = "dense") -> Model:
    """The same weights decoding with `attention_impl` over a `kv_cache` cache (see `load`)."""
    dense.check(kv_cache, attention_impl, model.cfg)
    cfg = dataclasses.replace(model.cfg, attention_impl=attention_impl)
    return dataclasses.replace(model, cfg=cfg, kv_cache=kv_cache)


def _layout(cfg: ModelConfig, mesh, params):
    """NamedShardings for `params` (concrete or abstract) of `cfg` on `mesh`, checked."""
    return sharding.param_shardings(transformer.declare(cfg), params, mesh,
                                    sharding.rules_for(cfg, mesh))


def _quantized(model: Model, weights: str | None) -> Model:
    if weights is None:
        return model
    params = convert.quantize_params(model.params, transformer.declare(model.cfg), weights)
    if model.mesh is not None:
        params = jax.device_put(params, _layout(model.cfg, model.mesh, params))
    return dataclasses.replace(model, params=params)


def with_active_experts(model: Model, k: int) -> Model:
    """The same weights routed to `k` experts per token (the inference-time knob for fewer,
    or more, active experts than trained). Routers keep their rules: softmax routers without
    `norm_topk_prob` weight the k experts by their full-softmax probabilities."""
    moe = model.cfg.moe
    if moe is None:
        raise JaxdecError(f"{model.source or 'model'} has no experts: --active-experts applies "
                          "to MoE models only")
    if not isinstance(k, (int, np.integer)) or not 0 < k <= moe.n_experts:
        raise JaxdecError(f"active experts must be 1..{moe.n_experts} (got {k})")
    cfg = dataclasses.replace(model.cfg, moe=dataclasses.replace(moe, top_k=int(k)))
    return dataclasses.replace(model, cfg=cfg)


def shard(model: Model, mesh) -> Model:
    """`model` laid out on `mesh` (a `Mesh`, or a spec such as "data=2,model=4") by the
    sharding rules of its config (`jaxdec.sharding`); moves arrays device to device. To
    read a checkpoint straight onto its shards, pass `mesh=` to `load` instead."""
    mesh = sharding.make_mesh(mesh)
    params = jax.device_put(model.params, _layout(model.cfg, mesh, model.params))
    return dataclasses.replace(model, params=params, mesh=mesh)


def init_cache(model: Model, batch: int, max_len: int) -> dense.KVCache:
    """An empty decode cache for `batch` rows of up to `max_len` tokens, in the model's
    activation dtype, laid out on the model's mesh (rows over `data`, kv heads as the
    heads are split) when it has one."""
    if model.mesh is None:
        return dense.init_cache(model.cfg, batch, max_len, model.dtype, kind=model.kv_cache)
    sharding.check_batch(batch, model.mesh)
    rules = sharding.rules_for(model.cfg, model.mesh)
    return dense.init_cache(model.cfg, batch, max_len, model.dtype,
                            shardings=dense.cache_shardings(model.cfg, model.mesh, rules))


def mesh_decode_step(model: Model, sampler: Sampler = Greedy()):
    """`decode.decode_step` for a model on a mesh, jitted with explicit input and output
    shardings (`decode.sharded_decode_step`): step(params, cache, last_tokens, rng) ->
    (next tokens, cache), the cache (from `init_cache`) donated and returned in its layout."""
    if model.mesh is None:
        raise JaxdecError("mesh_decode_step needs a model loaded with mesh=...")
    rules = sharding.rules_for(model.cfg, model.mesh)
    return decode.sharded_decode_step(model.mesh, _layout(model.cfg, model.mesh, model.params),
                                      dense.cache_shardings(model.cfg, model.mesh, rules),
                                      sampler, model.cfg)


def _idle_rows(model: Model, n: int) -> int:
    """Rows to add to a batch of `n` so that it splits over the mesh's `data` axis (score
    and generate fill them with padding and drop their results)."""
    return -n % dict(model.mesh.shape).get("data", 1) if model.mesh is not None else 0


def _run(model: Model, fn, *args, **static):
    """A jitted `fn`: through the executable cache on one device; on a mesh, traced under
    it (`jax.set_mesh`: the model's code sees how the mesh splits)."""
    if model.mesh is None:
        return exec_cache.call(fn, *args, **static)
    with jax.set_mesh(model.mesh):
        return fn(*args, **static)


def _load(source, *, dtype, weights, progress, mesh=None) -> Model:
    """Load a named model, a .gguf file, a HF directory, or a `jaxdec convert` checkpoint.

    `weights` picks the format of the matmul weights: "f32" or "bf16" (then also the
    activation dtype), "int8" or "int4" (group-wise, 32 per group; a GGUF's own Q8_0 or
    Q4_0/Q4_1 blocks of that width are kept bit-exact, other tensors are requantised), or
    "gguf" (every Q8_0/Q4_0/Q4_1 block kept as it is, the rest int8). Quantised weights
    run with `dtype` activations. `progress(done, total)` is called as GGUF tensors are
    dequantized (for progress bars).
    """
    if weights is not None and weights not in WEIGHTS:
        raise JaxdecError(f"unknown weight format {weights!r} (one of {', '.join(WEIGHTS)})")
    if weights in ("f32", "bf16"):
        dtype, weights = weights, None
    dt = _dtype(dtype)
    name = str(source)
    path = registry.resolve(name) if name in registry.MODELS else pathlib.Path(name)
    if not path.exists():
        raise JaxdecError(f"no such file or directory: {path}")
    if path.is_dir() and orbax_io.is_checkpoint(path):
        return _quantized(_load_orbax(path, dt, mesh), weights)
    named = name in registry.MODELS  # only the registry's models are cached (one copy each)
    cached = params_cache.entry(path, weights, dt) if named and params_cache.enabled() else None
    place = None if mesh is None else (lambda cfg, params: _layout(cfg, mesh, params))
    hit = cached and params_cache.load(cached, place)
    if hit:
        cfg, params, tok, types = hit
        return Model(cfg=cfg, params=params, tokenizer=tok, source=name, tensor_types=types,
                     mesh=mesh)
    model = _quantized(_read(path, name, dt, weights, progress, mesh), weights)
    if cached and mesh is None:  # (storing would gather a sharded model onto this host)
        params_cache.store(cached, model.cfg, model.params, model.tokenizer, model.tensor_types)
    return model


def _read(path: pathlib.Path, name: str, dtype, weights: str | None, progress, mesh) -> Model:
    """A GGUF file or HF directory, in float `dtype` or kept blocks (see `load`)."""
    if path.is_dir():
        from jaxdec.checkpoint.hf_reader import read_hf_dir
        ckpt = read_hf_dir(path)
    else:
        from jaxdec.checkpoint.gguf_reader import read_gguf
        ckpt = read_gguf(path, progress=progress, keep_blocks=weights is not None)
    keep = {n: b for n, b in ckpt.blocks.items()
            if weights == "gguf" or (weights and b.bits == convert.FORMATS[weights][0])}
    cfg = ckpt.config
    where = None if mesh is None else _layout(cfg, mesh, abstract_params(transformer.declare(cfg)))
    params = hf_layout.params_from_hf(cfg, ckpt.tensors, dtype, keep, shardings=where)
    return Model(cfg=cfg, params=params, tokenizer=ckpt.tokenizer, source=name,
                 tensor_types=dict(ckpt.tensor_types), mesh=mesh)


def _load_orbax(path: pathlib.Path, dtype, mesh) -> Model:
    from jaxdec.checkpoint.tokenizer import Tokenizer

    meta = orbax_io.read_meta(path)
    cfg = ModelConfig.from_dict(meta["config"])
    abstract = convert.abstract_like(transformer.declare(cfg), jnp.dtype(meta["dtype"]),
                                     meta.get("qarrays", {}))
    if mesh is not None and any(e.get("format") == "dfloat11" for e in meta.get("qarrays", {}).values()):
        raise JaxdecError(f"{path}: a DFloat11 checkpoint loads on one device only (no mesh)")
    if mesh is not None:  # orbax reads only the slices of this process's devices
        abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                abstract, _layout(cfg, mesh, abstract))
    params = dfloat11.check_restored_params(orbax_io.restore(path, abstract),
                                            meta.get("qarrays", {}), str(path))
    if params.final_norm.dtype != dtype:
        kept = lambda x: _is_q(x) or dfloat11.is_df11(x)  # (weights keep their format)
        params = jax.tree.map(lambda x: x if kept(x) else x.astype(dtype), params, is_leaf=kept)
    return Model(cfg=cfg, params=params, tokenizer=Tokenizer.load(path), source=str(path),
                 tensor_types=meta.get("tensor_types", {}), mesh=mesh)


def save(model: Model, path) -> pathlib.Path:
    """Write `model` as an orbax checkpoint directory (atomic; see checkpoint.orbax_io)."""
    transformer.check_params(model.params, model.cfg, model.source)
    return orbax_io.save(path, model.params, model.cfg, model.tokenizer, source=model.source,
                         tensor_types=model.tensor_types,
                         extra={"qarrays": convert.describe(model.params)})


# ---------------------------------------------------------------------------- scoring


@partial(jax.jit, static_argnames=("cfg",))
def _score(params, tokens, positions, cfg):
    return transformer.forward(params, tokens, positions, None, cfg)[0]


def score(model: Model, token_ids) -> np.ndarray:
    """Logits f32[B, T, V] for a batch of token id rows (ragged rows: NaN past their end)."""
    rows = as_rows(token_ids)
    if not rows or min(len(r) for r in rows) == 0:
        raise JaxdecError("score needs at least one non-empty row of token ids")
    transformer.check_params(model.params, model.cfg, model.source)
    check_ids(rows, model.cfg.vocab_size)
    tokens, lens = pad_rows(rows, 16)
    check_context(model.cfg, int(lens.max()), 0)
    steps = np.arange(tokens.shape[1])[None]
    positions = np.where(steps < lens[:, None], steps, -1).astype(np.int32)
    if model.mesh is not None:
        idle = _idle_rows(model, len(rows))  # padding positions: the rows see nothing
        tokens = np.concatenate([tokens, np.zeros((idle, tokens.shape[1]), np.int32)])
        positions = np.concatenate([positions, np.full((idle, tokens.shape[1]), -1, np.int32)])
        with jax.set_mesh(model.mesh):
            logits = np.array(sharding.to_host(_score(model.params, tokens, positions, model.cfg)))[:len(rows)]
    else:
        logits = np.array(_score(model.params, tokens, positions, model.cfg))
    logits = logits[:, : lens.max()]
    logits[np.arange(logits.shape[1])[None] >= lens[:, None]] = np.nan
    return logits


# ---------------------------------------------------------------------------- generation


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    texts: list[str]
    token_ids: list[list[int]]  # generated ids per row (a final stop token included)
    prompt_ids: list[list[int]]
    stopped: list[bool]  # True where the row ended on a stop token
    spec: dict | None = None  # speculative decoding's figures (`jaxdec.speculative.core.stats`)


def encode_prompts(model: Model, prompts, *, chat: bool) -> list[list[int]]:
    """Strings (or, with chat=True, strings or message lists) -> token id rows."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], dict)):
        prompts = [prompts]
    rows = []
    for p in prompts:
        if chat:
            messages = [{"role": "user", "content": p}] if isinstance(p, str) else list(p)
            text = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            rows.append(model.tokenizer.encode(text, add_special_tokens=False))
        else:
            rows.append(model.tokenizer.encode(p))
    if any(len(r) == 0 for r in rows):
        raise JaxdecError("empty prompt: nothing to condition on")
    return rows


def generate(model: Model, prompts, *, max_new_tokens: int = 64, sampler: Sampler = Greedy(),
             seed: int = 0, chat: bool = False, stop_ids: Sequence[int] | None = None,
             stream: Callable[[int, np.ndarray, np.ndarray], None] | None = None,
             drafter=None) -> GenerateResult:
    """Generate continuations of `prompts` (str, list of str; with chat=True also message
    lists). Rows stop at EOS/end-of-turn tokens (or `stop_ids`) or at `max_new_tokens`.

    `stream(step, tokens, active)` is called on the host after every step with the new
    tokens i32[B] and which rows were still generating.

    `drafter` switches speculative decoding on (`jaxdec.speculative.drafters.load` makes one from
    a trained drafter checkpoint or a model): the tokens are the same, greedy or sampled
    from the same distribution; only the speed differs. `result.spec` has its figures.
    """
    rows = encode_prompts(model, prompts, chat=chat)
    return generate_ids(model, rows, max_new_tokens=max_new_tokens, sampler=sampler, seed=seed,
                        stop_ids=stop_ids, stream=stream, drafter=drafter)


def generate_ids(model: Model, rows: list[list[int]], *, max_new_tokens: int,
                 sampler: Sampler = Greedy(), seed: int = 0, stop_ids=None,
                 stream=None, stream_chunk: int = 4, drafter=None) -> GenerateResult:
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens <= 0:
        raise JaxdecError(f"max_new_tokens must be a positive integer (got {max_new_tokens})")
    check_ids(rows, model.cfg.vocab_size)
    transformer.check_params(model.params, model.cfg, model.source)
    if drafter is not None:
        return _speculate(model, rows, drafter, max_new_tokens=int(max_new_tokens),
                                 sampler=sampler, seed=seed, stop_ids=stop_ids, stream=stream)
    n_rows = len(rows)
    if model.mesh is not None:  # fill the `data` axis with idle rows (token limit 0)
        rows = rows + [rows[0]] * _idle_rows(model, n_rows)
    lens = np.array([len(r) for r in rows])
    check_context(model.cfg, int(lens.max()), max_new_tokens)
    # Fixed shapes: prompt widths, output buffers and stop sets are bucketed or data, so a
    # sweep of prompt lengths, max_new_tokens and stop ids compiles nothing new once warm.
    tokens, lens = pad_rows(rows, width=bucket(int(lens.max()), 32))
    n_buffer = bucket(int(max_new_tokens), 16)
    capacity = int(-(-(tokens.shape[1] + n_buffer) // 64) * 64)
    cache = init_cache(model, len(rows), capacity)
    stop_set = sorted(set(model.cfg.eos_ids if stop_ids is None else stop_ids))
    stops = np.full(max(8, -(-len(stop_set) // 8) * 8), -1, np.int32)  # -1: no token
    stops[:len(stop_set)] = stop_set
    limits = np.where(np.arange(len(rows)) < n_rows, max_new_tokens, 0).astype(np.int32)
    # host arrays go in as they are: jnp.asarray would compile a copy program per shape
    args = (model.params, cache, tokens, lens, jax.random.key(seed), limits, stops)
    static = dict(sampler=sampler, cfg=model.cfg, max_new_tokens=n_buffer)
    if stream is None:
        progress, _ = _run(model, decode.generate_tokens, *args, **static)
    else:
        shown = stream if len(rows) == n_rows else (
            lambda step, ids, active: stream(step, ids[:n_rows], active[:n_rows]))
        progress = _streamed(model, args, static, shown, stream_chunk)
    progress = sharding.to_host(progress)  # (from every device, in a multi-process run)
    return result(model, rows[:n_rows], progress.tokens, progress.n_generated, progress.stopped)


def result(model: Model, rows, tokens, n_generated, stopped, spec=None) -> GenerateResult:
    """The GenerateResult of generated ids tokens[b, :n_generated[b]] for prompt `rows`."""
    ids = [list(map(int, tokens[i, : n_generated[i]])) for i in range(len(rows))]
    return GenerateResult(texts=[model.tokenizer.decode(r) for r in ids], token_ids=ids,
                          prompt_ids=rows, stopped=list(map(bool, stopped[:len(rows)])), spec=spec)


def _streamed(model: Model, args, static, stream, chunk: int):
    """Run the generation chunk by chunk, handing each step's ids to `stream(step, ids,
    active)` while the next chunk is already queued on the device.

    The first id is handed over as soon as the prefill has produced it, before the decode
    loop is dispatched (and compiled, on a cold cache). Chunks then double from `chunk` up
    to `_MAX_CHUNK` steps: every dispatch of the loop costs a few milliseconds of fixed
    overhead, which chunks of 4 did not hide.
    """
    params, _, _, _, rng, limits, stops = args
    progress, cache = _run(model, decode.start, *args, **static)
    static = {k: v for k, v in static.items() if k != "max_new_tokens"}
    done = target = _emit(progress, stream, 0)  # the first id, before the loop is compiled
    if _finished(progress, done):
        return progress
    pending = progress  # the latest dispatched result (the prefill's ids are read already)
    while True:
        target += chunk  # known on the host: no need to wait for the device to pick it
        chunk = min(2 * chunk, _MAX_CHUNK)
        nxt, cache = _run(model, decode.advance, params, cache, pending, rng, limits, target,
                          stops, **static)
        done = _emit(pending, stream, done)  # reads `pending` while `nxt` runs
        if _finished(pending, done):
            return pending
        pending = nxt


def _finished(progress, done: int) -> bool:
    return done >= progress.tokens.shape[1] or not sharding.to_host(progress.active).any()


def _emit(progress, stream, done: int) -> int:
    """Hand the ids of steps [done, progress.step) to `stream`; returns progress.step."""
    step = int(sharding.to_host(progress.step))  # waits for this chunk only
    cols = sharding.to_host(progress.tokens)[:, done:step]  # sliced on the host: no slice program
    for j in range(cols.shape[1]):
        stream(done + j, cols[:, j], cols[:, j] >= 0)
    return step


_MAX_CHUNK = 32
_SPEC_STREAM_ROUNDS = 4  # speculation rounds per streamed chunk


def _speculate(model: Model, rows, drafter, *, max_new_tokens, sampler, seed, stop_ids, stream):
    """`generate_ids` with speculation: a drafter of the target's vocabulary through
    `jaxdec.speculative.core`, one of another vocabulary through `hetero`."""
    from jaxdec.speculative import core, hetero

    if model.mesh is not None:
        raise JaxdecError("speculative decoding runs on one device for now (no mesh)")
    stops = tuple(sorted(set(model.cfg.eos_ids if stop_ids is None else stop_ids)))
    if isinstance(drafter, hetero.CrossVocab):
        ids, spec = hetero.generate(model, drafter.model, rows, method=drafter.method,
                                    k=drafter.k, max_new_tokens=max_new_tokens, sampler=sampler,
                                    seed=seed, stop_ids=stops)
        tokens = np.full((len(rows), max_new_tokens), -1, np.int64)
        for i, r in enumerate(ids):
            tokens[i, : len(r)] = r
        n_gen = np.array([len(r) for r in ids])
        stopped = np.array([bool(r) and r[-1] in stops for r in ids])
        _replay(stream, tokens, n_gen)
        return result(model, rows, tokens, n_gen, stopped, spec)
    tokens, lens = pad_rows(rows, 32)
    check_context(model.cfg, int(lens.max()), max_new_tokens + core.draft_width(drafter))
    need = core.need_capacity(tokens.shape[1], max_new_tokens, drafter)
    cache = init_cache(model, len(rows), int(-(-need // 64) * 64))
    core.check(model.cfg, cache, drafter, tokens.shape[1], max_new_tokens)
    static = dict(sampler=sampler, cfg=model.cfg, drafter=dataclasses.replace(drafter, params=None),
                  stop_ids=stops)
    args = (model.params, drafter.params)
    limits = np.full(len(rows), max_new_tokens, np.int32)
    rng = jax.random.key(seed)
    if stream is None:
        p, _ = _run(model, core.generate, *args, cache, tokens, lens, rng, limits,
                    max_new_tokens=max_new_tokens, **static)
    else:
        p = _speculate_streamed(model, args, cache, tokens, lens, rng, limits, max_new_tokens,
                                static, stream)
    p = jax.device_get(p)
    return result(model, rows, p.tokens, p.n_generated, p.stopped, core.stats(p))


def _speculate_streamed(model, args, cache, tokens, lens, rng, limits, max_new, static, stream):
    """Run rounds chunk by chunk, handing each column of tokens that every running row has
    produced to `stream(step, ids, active)` (rows accept different numbers per round)."""
    from jaxdec.speculative import core

    p, cache = _run(model, core.start, *args, cache, tokens, lens, rng, limits,
                    max_new_tokens=max_new, **static)
    done = 0
    while True:
        nxt, cache = _run(model, core.advance, *args, cache, p, rng, limits,
                          _SPEC_STREAM_ROUNDS, **static)
        host = jax.device_get(p)
        ready = int(np.min(np.where(host.active, host.n_generated, max_new)))
        done = _replay(stream, host.tokens, host.n_generated, done, ready)
        if not host.active.any():
            return p
        p = nxt


def _replay(stream, tokens, n_gen, done: int = 0, upto: int | None = None) -> int:
    """Hand columns [done, upto) of the emitted ids to `stream`; returns upto."""
    upto = int(np.max(n_gen)) if upto is None else upto
    if stream is not None:
        for j in range(done, upto):
            col = np.asarray(tokens[:, j])
            stream(j, col, col >= 0)
    return max(done, upto)
