"""What each `jaxdec` subcommand does, given already-parsed arguments (see cli.py)."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import pathlib
import sys
import time

import jaxdec
from jaxdec import api, pytree
from jaxdec.errors import JaxdecError
from jaxdec.sampling import make_sampler


def _sampler(args):
    if args.max_new_tokens <= 0:
        raise JaxdecError(f"--max-new-tokens must be positive (got {args.max_new_tokens})")
    return make_sampler(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        min_p=args.min_p)


class _Printer:
    """Streams one row's tokens to stdout as text and times the generation."""

    def __init__(self, tokenizer, out=sys.stdout):
        self.decoder, self.out = tokenizer.stream(), out
        self.start = time.perf_counter()
        self.first = self.last = None
        self.count = 0
        self.pieces: list[str] = []

    def __call__(self, step, tokens, active):
        if not active[0]:
            return
        now = time.perf_counter()
        self.first = self.first or now
        self.last, self.count = now, self.count + 1
        piece = self.decoder.put(int(tokens[0]))
        if piece:
            self.pieces.append(piece)
            self.out.write(piece)
            self.out.flush()

    def stats(self) -> str:
        if self.first is None:
            return "no tokens generated"
        ttft = self.first - self.start
        rate = (self.count - 1) / (self.last - self.first) if self.count > 1 else float("nan")
        return (f"{self.count} tokens; time to first token {ttft:.2f} s (prefill, and compile "
                f"on a cold cache); decode {rate:.1f} tok/s")


def _load(args):
    """The model of --model/--dtype/--weights/--active-experts, on --mesh when given (the
    mesh and the bytes each device holds go to stderr)."""
    mesh = getattr(args, "mesh", None)
    model = jaxdec.load(args.model, dtype=args.dtype, weights=args.weights,
                        active_experts=args.active_experts, mesh=mesh,
                        attention_impl=getattr(args, "attention_impl", "xla"),
                        kv_cache=getattr(args, "kv_cache", "dense"))
    if model.mesh is not None:
        import jax

        from jaxdec import sharding
        held = sharding.max_device_bytes(model.params) / 2**20
        print(f"[mesh {sharding.describe(model.mesh)} over {model.mesh.size} "
              f"{jax.devices()[0].platform} devices, {jax.process_count()} process(es): "
              f"params {held:.1f} MiB per device]", file=sys.stderr)
    return model


def _prefetch_programs(command: str, args, limit: int | None = None) -> None:
    """Start loading the compiled programs the last `command` of these settings ran (see
    `exec_cache.prefetch`; at most `limit`): they load while the model does."""
    from jaxdec import exec_cache

    tag = repr((command, sorted((k, v) for k, v in vars(args).items() if k not in ("prompt", "seed", "port"))))
    exec_cache.prefetch(tag, limit or exec_cache.PREFETCH_MAX)


def _drafter(args, model):
    if not getattr(args, "draft", None):
        return None
    if args.draft_k is not None and args.draft_k <= 0:
        raise JaxdecError(f"--draft-k must be positive (got {args.draft_k})")
    from jaxdec.speculative import drafters
    return drafters.load(args.draft, model, k=args.draft_k, method=args.draft_method,
                         weights=args.draft_weights, tree=args.draft_tree)


def _spec_line(res) -> str:
    if res.spec is None:
        return ""
    by_pos = " ".join(f"{x:.2f}" for x in res.spec["accept_by_position"])
    return (f"; speculative: {res.spec['rounds']} rounds, mean accepted length "
            f"{res.spec['mean_accepted']:.2f}, acceptance by position {by_pos}")


def generate(args) -> int:
    sampler = _sampler(args)
    _prefetch_programs("generate", args)
    model = _load(args)
    drafter = _drafter(args, model)
    if getattr(args, "engine", False):
        return _generate_engine(args, model, drafter)
    if args.no_stream:
        t0 = time.perf_counter()
        res = jaxdec.generate(model, args.prompt, max_new_tokens=args.max_new_tokens,
                              sampler=sampler, seed=args.seed, chat=args.chat, drafter=drafter)
        print(res.texts[0])
        print(f"[{len(res.token_ids[0])} tokens in {time.perf_counter() - t0:.2f} s"
              f"{_spec_line(res)}]", file=sys.stderr)
        return 0
    printer = _Printer(model.tokenizer)
    res = jaxdec.generate(model, args.prompt, max_new_tokens=args.max_new_tokens, sampler=sampler,
                          seed=args.seed, chat=args.chat, stream=printer, drafter=drafter)
    tail = printer.decoder.flush() if hasattr(printer.decoder, "flush") else ""
    sys.stdout.write(tail + "\n")
    print(f"[{printer.stats()}{_spec_line(res)}]", file=sys.stderr)
    return 0


def _generate_engine(args, model, drafter) -> int:
    """`jaxdec generate --engine`: the prompt as one request of a `jaxdec.Engine`."""
    from jaxdec.api import encode_prompts
    from jaxdec.engine.engine import Engine
    from jaxdec.engine.request import SamplingParams

    if drafter is not None:
        raise JaxdecError("--engine does not speculate yet: drop --draft")
    ids = encode_prompts(model, args.prompt, chat=args.chat)[0]
    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed)
    engine = Engine(model, max_num_seqs=1, max_model_len=len(ids) + args.max_new_tokens)
    start, first, count, last = time.perf_counter(), None, 0, None
    for out in engine.stream(engine.add_request(ids, params)):
        now = time.perf_counter()
        first, last, count = first or now, now, count + len(out.token_ids)
        if not args.no_stream:
            sys.stdout.write(out.text)
            sys.stdout.flush()
    print(engine.text(engine.requests["req-0"].id) if args.no_stream else "")
    rate = (count - 1) / (last - first) if count > 1 else float("nan")
    print(f"[{count} tokens; time to first token {first - start:.2f} s (prefill, and compile on a "
          f"cold cache); decode {rate:.1f} tok/s; engine]", file=sys.stderr)
    return 0


def chat(args) -> int:
    sampler = _sampler(args)
    model = _load(args)
    if not model.tokenizer.chat_template:
        raise JaxdecError(f"{args.model} has no chat template; use `jaxdec generate`")
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    print("jaxdec chat: /reset clears the conversation, /exit or Ctrl-D quits", file=sys.stderr)
    turn = 0
    while True:
        if interactive:
            sys.stderr.write("> ")
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        printer = _Printer(model.tokenizer)
        res = jaxdec.generate(model, [messages], max_new_tokens=args.max_new_tokens,
                              sampler=sampler, seed=args.seed + turn, chat=True, stream=printer)
        sys.stdout.write("\n")
        sys.stdout.flush()
        messages.append({"role": "assistant", "content": res.texts[0].strip()})
        print(f"[{printer.stats()}]", file=sys.stderr)
        turn += 1


def convert(args) -> int:
    from tqdm import tqdm

    with tqdm(desc=f"reading {args.src}", unit="tensor", file=sys.stderr, disable=None) as bar:
        def progress(done, total):
            bar.total = total
            bar.update(done - bar.n)

        model = jaxdec.load(args.src, dtype=args.dtype, weights=args.weights, progress=progress)
    print(f"writing {args.out} ...", file=sys.stderr)
    path = jaxdec.save(model, args.out)
    print(f"wrote {path} ({_human(_nbytes(model.params))} of {model.weights} parameters)")
    return 0


def _layer_bar(desc: str):
    """A tqdm bar and its `progress(done, total)` callback."""
    from tqdm import tqdm

    bar = tqdm(desc=desc, file=sys.stderr, disable=None)

    def progress(done, total):
        bar.total = total
        bar.update(done - bar.n)
    return bar, progress


def _calibration(args, model):
    from jaxdec.quant import calibrate

    encode = lambda text: model.tokenizer.encode(text, add_special_tokens=False)
    return calibrate.calibration_tokens(encode, n_windows=args.calib, window=args.calib_window)


def quantize(args) -> int:
    from jaxdec import transforms
    from jaxdec.quant import methods

    if args.method.upper() in _kquant_recipes():
        return _quantize_gguf(args)
    if args.method in ("kurtail", "hadamard"):
        return _quantize_rotated(args)
    options = dict(bits=args.bits, group_size=args.group, alpha=args.alpha,
                   act_order=args.act_order)
    spec = methods.QuantSpec(method=args.method, **options).check()
    model = jaxdec.load(args.src)
    note = methods.short_group_note(model.params, spec)
    if note:
        print(note)
    calib = _calibration(args, model) if transforms.get(spec.method).needs_calib else None
    bar, progress = _layer_bar(f"{spec.method} W{spec.bits}")
    with bar:
        params, cfg = transforms.apply(spec.method, model.params, model.cfg, calib,
                                       progress=progress, **options)
    quantized = dataclasses.replace(model, cfg=cfg, params=params,
                                    source=f"{model.source} ({spec.method} W{spec.bits})")
    path = jaxdec.save(quantized, args.out)
    print(f"wrote {path} ({_human(_nbytes(params))} of parameters)")
    return 0


def _quantize_rotated(args) -> int:
    """W{b}A{b}KV{b} with KurTail's learned or random block-Hadamard rotations folded into
    the weights (GPTQ weights per output channel): an orbax checkpoint."""
    from jaxdec import transforms
    from jaxdec.quant import kurtail

    if args.bits not in kurtail.ACT_BITS:  # checked before loading anything
        raise JaxdecError(f"{args.method} quantises weights, activations and KV cache to "
                          f"{' or '.join(map(str, kurtail.ACT_BITS))} bits, not {args.bits}")
    model = jaxdec.load(args.src)
    calib = _calibration(args, model)
    bar, progress = _layer_bar(f"{args.method} W{args.bits}A{args.bits}KV{args.bits}")
    with bar:  # (the rotations untie the LM head: cfg says so)
        params, cfg = transforms.apply(args.method, model.params, model.cfg, calib,
                                       bits=args.bits, progress=progress)
    quantized = dataclasses.replace(model, cfg=cfg, params=params,
                                    source=f"{model.source} ({args.method} W{args.bits}A{args.bits}KV{args.bits})")
    path = jaxdec.save(quantized, args.out)
    print(f"wrote {path} ({_human(_nbytes(params))} of parameters)")
    return 0


def _kquant_recipes() -> tuple[str, ...]:
    from jaxdec.quant import kquants

    return tuple(kquants.RECIPES)


def _quantize_gguf(args) -> int:
    from jaxdec.checkpoint import registry
    from jaxdec.checkpoint.gguf_reader import read_gguf_header
    from jaxdec.quant import gguf_writer, kquants

    src = pathlib.Path(args.src) if pathlib.Path(args.src).exists() else registry.resolve(args.src)
    if src.suffix != ".gguf":
        raise JaxdecError(f"k-quant recipes write GGUF from a GGUF source; {src} is not a .gguf file")
    recipe = args.method.upper()
    measured = None
    if recipe == "DQ3_K_M" and args.calib > 0:  # bits where the output suffers most
        model = jaxdec.load(str(src))
        calib = _calibration(args, model)
        bar, progress = _layer_bar("output KL per tensor")
        with bar:
            measured = kquants.kl_sensitivity(model.params, model.cfg, calib, progress=progress)
    bar, progress = _layer_bar(f"{recipe} sensitivity")
    with bar:
        types = kquants.recipe_types(src, recipe, measured=measured, progress=progress)
    bar, progress = _layer_bar(recipe)
    with bar:
        path = gguf_writer.write_gguf(src, args.out, types, file_type=recipe, progress=progress)
    sizes = {t.name: int(math.prod(t.shape)) for t in read_gguf_header(src).tensors.values()}
    print(f"wrote {path} ({_human(pathlib.Path(path).stat().st_size)}, "
          f"{kquants.bits_per_weight_of(types, sizes):.2f} bits per weight)")
    return 0


def compress_lossless(args) -> int:
    from tqdm import tqdm

    from jaxdec.models import transformer
    from jaxdec.formats import dfloat11

    model = jaxdec.load(args.src, dtype="bfloat16")
    if model.weights == "dfloat11":
        raise JaxdecError(f"{args.src} is DFloat11-compressed already")
    with tqdm(desc="DFloat11", unit="tensor", file=sys.stderr, disable=None) as bar:
        def progress(done, total):
            bar.total = total
            bar.update(done - bar.n)

        params = dfloat11.compress_params(model.params, transformer.declare(model.cfg),
                                          progress=progress)
    s = dfloat11.stats(dfloat11.pairs(model.params, params))
    print(f"writing {args.out} ...", file=sys.stderr)
    path = jaxdec.save(dataclasses.replace(model, params=params), args.out)
    print(f"wrote {path}: {s.n:,} weights in {_human(s.df11_bytes)} instead of "
          f"{_human(s.bf16_bytes)} of bfloat16 ({s.fraction:.1%}, {s.bits_per_weight:.2f} bits a "
          f"weight; exponent entropy {s.entropy_bits:.2f} bits); {_human(_nbytes(params))} in all")
    return 0


def info(args) -> int:
    model = jaxdec.load(args.src)
    cfg = model.cfg
    print(f"source        {model.source}")
    print(f"architecture  {cfg.arch}: {cfg.n_layers} layers, d_model {cfg.d_model}, "
          f"heads {cfg.n_heads}/{cfg.n_kv_heads} (GQA group {cfg.group}), head_dim "
          f"{cfg.head_dim}, ffn {cfg.d_ff}, vocab {cfg.vocab_size}")
    print(f"              rope theta {cfg.rope_theta:g}, scaling {cfg.rope_scaling}, context "
          f"{cfg.max_position}, tied embeddings {cfg.tie_embeddings}, qkv bias {cfg.qkv_bias}")
    if cfg.layer_types:
        runs = [(t, len(list(g))) for t, g in itertools.groupby(cfg.layer_types)]
        print("layers        " + ", ".join(f"{t} x{n}" if n > 1 else t for t, n in runs))
    for name in ("mla", "moe", "mamba"):
        if getattr(cfg, name) is not None:
            print(f"{name:<14}{getattr(cfg, name)}")
    from jaxdec.formats import convert

    n, stored = convert.param_count(model.params), _nbytes(model.params)
    print(f"parameters    {n:,} ({_human(stored)} stored: {model.weights} weights, "
          f"{8 * stored / n:.2f} bits a parameter; activations {model.dtype})")
    stored = collections.Counter(model.tensor_types.values())
    if stored:
        print("tensor types  " + ", ".join(f"{k} x{v}" for k, v in sorted(stored.items())))
    return 0


def eval(args) -> int:  # noqa: A001 (the subcommand's name)
    from jaxdec import perplexity

    model = _load(args)
    t0 = time.perf_counter()
    encode = lambda text: model.tokenizer.encode(text, add_special_tokens=False)
    result = perplexity.evaluate(lambda toks: api.score(model, toks), encode, args.corpus,
                                 window=args.window, max_windows=args.max_windows or None,
                                 batch_size=args.batch_size)
    print(f"{args.model} [{model.weights} weights] on {args.corpus}: {result} "
          f"({time.perf_counter() - t0:.0f} s)")
    return 0


def fetch(args) -> int:
    if args.name == "corpora":
        from jaxdec import corpora

        for name in corpora.CORPORA:
            corpora.fetch_corpus(name)
        print("corpora ready")
        return 0
    from jaxdec.checkpoint import registry

    print(registry.fetch(args.name))
    return 0


def _split(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _numbers(flag: str, text: str, kind=int) -> tuple:
    try:
        values = tuple(kind(x) for x in _split(text))
    except ValueError:
        raise JaxdecError(f"{flag} must be comma-separated {'integers' if kind is int else 'numbers'} "
                          f"(got {text!r})") from None
    if not values or min(values) <= 0 or not all(math.isfinite(v) for v in values):
        raise JaxdecError(f"{flag} must list positive values (got {text!r})")
    return values


def bench(args) -> int:
    if getattr(args, "bench_command", None) == "serve":
        return _bench_serve(args)
    from jaxdec.bench import decode_bench

    batches = _numbers("--batches", args.batches)
    if args.new_tokens < 2 or args.repeats < 1:
        raise JaxdecError("--new-tokens must be >= 2 and --repeats >= 1")
    if not _split(args.weights) and not _split(args.peers):
        raise JaxdecError("nothing to measure: give --weights and/or --peers")
    for w in _split(args.weights):
        if w not in api.WEIGHTS:
            raise JaxdecError(f"unknown weight format {w!r} (one of {', '.join(api.WEIGHTS)})")
    settings = decode_bench.Settings(
        model=args.model, weights=_split(args.weights), peers=_split(args.peers), batches=batches,
        new_tokens=args.new_tokens, repeats=args.repeats, ttft=not args.no_ttft)
    return decode_bench.main(settings, args.json)


def _bench_serve(args) -> int:
    """`jaxdec bench serve`: each server under the same load (jaxdec.bench.serve_bench)."""
    from jaxdec.bench import serve_bench

    systems = _split(args.systems)
    known = (*serve_bench.POLICIES, serve_bench.LLAMA_CPP)
    unknown = [x for x in systems if x not in known]
    if unknown or not systems or len(set(systems)) < len(systems):
        raise JaxdecError(f"--systems takes distinct names among {', '.join(known)} (got {args.systems!r})")
    base = serve_bench.QUICK if args.quick else serve_bench.Settings()  # (what a flag not given takes)
    rates = _numbers("--rates", args.rates, float) if args.rates else base.rates
    seqs = _numbers("--static-seqs", args.static_seqs) if args.static_seqs else base.static_seqs
    requests = base.requests if args.requests is None else args.requests
    threads = base.threads if args.llama_threads is None else args.llama_threads
    rounds = base.rounds if args.rounds is None else args.rounds
    for flag, value in (("--requests", requests), ("--rounds", rounds), ("--max-num-seqs", args.max_num_seqs),
                        ("--context", args.context), ("--ttft-slo", args.ttft_slo), ("--tpot-slo", args.tpot_slo),
                        ("--llama-threads", threads), ("--num-kv-pages", 1 if args.num_kv_pages is None else args.num_kv_pages)):
        if not value > 0:
            raise JaxdecError(f"{flag} must be positive (got {value})")
    binary = serve_bench.find_llama_server(args.llama_server) if serve_bench.LLAMA_CPP in systems else None
    settings = serve_bench.Settings(
        model=args.model, systems=systems, rates=tuple(sorted(set(rates))), requests=requests,
        max_num_seqs=args.max_num_seqs, static_seqs=tuple(sorted(set(seqs))),
        clients=tuple(sorted(set(_numbers("--clients", args.clients)))), ttft_slo=args.ttft_slo,
        tpot_slo=args.tpot_slo, context=args.context, num_kv_pages=args.num_kv_pages, seed=args.seed,
        llama_server=binary, threads=threads, rounds=rounds)
    serve_bench.gguf_path(settings.model)  # (a model neither server can load: refused now)
    return serve_bench.main(settings, args.json, args.plot)


def serve(args) -> int:
    """`jaxdec serve`: the engine, warmed up, behind an OpenAI-compatible HTTP server."""
    if args.mesh:
        raise JaxdecError("the server's engine runs on one device: drop --mesh")
    from jaxdec.engine import policy as policies
    from jaxdec.engine.engine import Engine
    from jaxdec.serve import app as serve_app, server  # (FastAPI and uvicorn: only here)

    policy = policies.make(args.policy, tpot_slo=args.tpot_slo, ttft_slo=args.ttft_slo)  # (bad flags fail before the model loads)
    if args.num_kv_pages is not None and args.num_kv_pages < 1:
        raise JaxdecError(f"--num-kv-pages must be positive (got {args.num_kv_pages})")
    sock = server.listen(args.host, args.port)  # (as does a taken port)
    _prefetch_programs("serve", args, limit=64)  # (every step shape the engine warms up)
    model = _load(args)  # (--kv-cache picks the engine's page pool; it refuses kinds it lacks)
    engine = Engine(model, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                    max_num_batched_tokens=args.max_num_batched_tokens, policy=policy,
                    num_pages=args.num_kv_pages, enable_prefix_caching=not args.no_prefix_caching)
    start = time.perf_counter()
    shapes = engine.warmup(defer=True)  # (stored shapes past the narrowest width load while idle)
    later = len(engine.unprimed()) - shapes
    name = args.served_model_name or args.model
    app = serve_app.make_app(engine, name)
    host, port = sock.getsockname()[:2]
    print(f"jaxdec serve: {name} ready on http://{host}:{port}/v1 ({shapes} step shapes warmed "
          f"up in {time.perf_counter() - start:.1f} s" + (f", {later} more load while idle" if later else "")
          + ")", file=sys.stderr, flush=True)
    server.run(app, sock)
    return 0


def _nbytes(tree) -> int:
    return pytree.param_bytes(tree)


def _human(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"



_DRAFTER_OPTIONS = ("layers", "loss", "train_head", "k", "draft_vocab", "unroll", "d_ff", "head")


def distill(args) -> int:
    from jaxdec import train
    from jaxdec.train import store

    warmup = args.steps // 20 if args.warmup is None else args.warmup
    cfg = train.TrainConfig(steps=args.steps, batch_size=args.batch, lr=args.lr, warmup=warmup,
                            schedule=args.schedule, weight_decay=args.weight_decay,
                            clip=args.clip, seed=args.seed, log_every=args.log_every,
                            ckpt_every=args.ckpt_every, eval_every=args.eval_every)
    model = jaxdec.load(args.target, dtype=args.dtype)
    opts = {k: getattr(args, k) for k in _DRAFTER_OPTIONS if getattr(args, k) is not None}
    t0 = time.perf_counter()
    result = train.distill(model, args.drafter, args.out, cfg, n_prompts=args.n_prompts,
                           n_new=args.n_new, prompt_len=args.prompt_len,
                           gen_batch=args.gen_batch, temperature=args.temperature,
                           samples=args.samples,
                           windows=args.windows, window_len=args.window_len,
                           val_prompts=args.val_prompts, cache_dir=args.cache_dir,
                           opts=opts, command=" ".join(sys.argv),
                           resume=not args.no_resume, stop_after=args.stop_after,
                           init_from=args.init)
    last = result.history[-1] if result.history else {}
    print(f"drafter {args.drafter} for {args.target}: {result.drafter_path} (step "
          f"{last.get('step', '?')}, loss {last.get('loss', float('nan')):.4f}; "
          f"{time.perf_counter() - t0:.0f} s)")
    if result.best_path is not None:
        best = store.read_meta(result.best_path)["val"]
        shown = ", ".join(f"{k} {v:.4f}" for k, v in best.items() if k != "step")
        print(f"best by validation loss: {result.best_path} (step {best['step']}: {shown})")
    return 0
