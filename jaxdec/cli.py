"""The `jaxdec` command: the only place that parses arguments.

    jaxdec generate --model smollm2 --prompt "..." [--chat] [--temperature 0.7 --top-p 0.9]
    jaxdec chat     --model smollm2
    jaxdec convert  SRC OUT [--dtype bfloat16]
    jaxdec compress-lossless SRC OUT   (DFloat11)
    jaxdec info     SRC
    jaxdec eval ppl --model SRC --corpus prose|code
    jaxdec fetch    qwen2.5-coder-0.5b | gemma3-270m | corpora
    jaxdec serve    --model smollm2 --port 8000   (OpenAI-compatible: /v1/completions, ...)
    jaxdec bench    [serve --systems fcfs,sla,llama.cpp --json out.json]   (peers side by side)
    jaxdec distill  --target smollm2 --drafter small|eagle3|pard --out DIR [--steps N ...]

Every user error is one line on stderr and a non-zero exit; never a traceback.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys

from jaxdec.errors import JaxdecError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + message
        sys.stderr.write(f"jaxdec: error: {message}\n")
        raise SystemExit(2)


def _model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default="smollm2",
                   help="smollm2, qwen2.5-coder-0.5b, a .gguf file, a HF dir or a jaxdec checkpoint")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--weights", default=None, choices=["f32", "bf16", "int8", "int4", "gguf"],
                   help="weight format (default: --dtype); int8/int4 are group-wise "
                        "quantised, gguf keeps the file's own Q4/Q8 blocks")
    p.add_argument("--mesh", default=None, metavar="SPEC",
                   help="lay the model out on a device mesh, e.g. data=2,model=4 (axes data, "
                        "model, expert); on CPU, the devices are faked by XLA")
    p.add_argument("--active-experts", type=int, default=None,
                   help="MoE models: experts per token (default: as trained)")
    p.add_argument("--attention-impl", default="xla", choices=["xla", "pallas"],
                   help="how decode steps attend: XLA, or the Pallas kernels (interpret "
                        "mode on the CPU: slow, for checking)")
    p.add_argument("--kv-cache", default="dense", metavar="KIND",
                   help="the KV cache kind of attention layers, one of those registered in "
                        "jaxdec.cache.registry: dense, paged (pages of 32 tokens), int8 or "
                        "int4 (group-wise quantised, 32 channels per scale), window (Gemma 3's "
                        "sliding-window layers in a ring)")


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", "-n", type=int, default=128)
    p.add_argument("--temperature", "--temp", type=float, default=0.0, help="0 means greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jaxdec", description="JAX/XLA LLM decoding")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text, streamed to the terminal")
    _model_flags(g)
    _sampling_flags(g)
    g.add_argument("--prompt", "-p", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--no-stream", action="store_true", help="print the text when done")
    g.add_argument("--engine", action="store_true",
                   help="run through the serving engine (jaxdec.Engine: paged pool, chunked "
                        "prefill); greedy text is the same, sampled text draws per request")
    g.add_argument("--draft", default=None, metavar="SRC",
                   help="speculative decoding: a trained drafter checkpoint (jaxdec distill), "
                        "a model (same vocabulary: a small-model drafter; another vocabulary: "
                        "cross-vocabulary drafting), or layers:N (the target's first N layers)")
    g.add_argument("--draft-k", type=int, default=None,
                   help="draft tokens per round (tree depth for tree drafters)")
    g.add_argument("--draft-tree", default=None, metavar="D,K,B",
                   help="a trained EAGLE-3 drafter drafts EAGLE-2 trees: depth, top-k per "
                        "level, total draft tokens (greedy decoding; 'chain': no tree)")
    g.add_argument("--draft-method", default="tli", choices=["tli", "slem"],
                   help="cross-vocabulary drafting: token-level intersection or string-level "
                        "exact match")
    g.add_argument("--draft-weights", default=None, choices=["f32", "bf16", "int8", "int4", "gguf"],
                   help="the drafter's weight format (quantised: a cheaper drafter); a trained "
                        "EAGLE-3 drafter takes int8 or int4")

    c = sub.add_parser("chat", help="interactive multi-turn chat")
    _model_flags(c)
    _sampling_flags(c)
    c.add_argument("--system", default=None, help="system message")

    v = sub.add_parser("convert", help="convert a checkpoint to orbax")
    v.add_argument("src")
    v.add_argument("out")
    v.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    v.add_argument("--weights", default=None, choices=["f32", "bf16", "int8", "int4", "gguf"])

    z = sub.add_parser("compress-lossless", help="DFloat11: Huffman-code the bfloat16 weights' "
                                                 "exponents (bit-exact, ~70%% of bfloat16)")
    z.add_argument("src", help="a model name, .gguf file, HF dir or jaxdec checkpoint")
    z.add_argument("out", help="the orbax checkpoint to write (jaxdec generate --model OUT)")

    q = sub.add_parser("quantize", help="post-training quantisation (GPTQ, AWQ, HQQ, ...: "
                                        "orbax; k-quant recipes: GGUF)")
    q.add_argument("src", help="a model name, .gguf file, HF dir or jaxdec checkpoint")
    q.add_argument("out")
    q.add_argument("--method", required=True,
                   help="rtn, hqq, gptq, awq, zeroquant, llm_int8, smoothquant, or kurtail / "
                        "hadamard (W4A4KV4 with learned / random rotations; an orbax "
                        "checkpoint); or a k-quant recipe Q8_0, Q6_K, Q5_K, Q4_K, Q3_K, Q2_K, "
                        "Q4_K_M, Q3_K_M, DQ3_K_M (a GGUF file, from a GGUF source)")
    q.add_argument("--bits", type=int, default=4, help="weight bits (2, 3, 4, 8 by method)")
    q.add_argument("--group", type=int, default=64,
                   help="inputs per scale (a tensor whose inputs it does not divide gets a "
                        "shorter last group, reported)")
    q.add_argument("--calib", type=int, default=32, metavar="N",
                   help="calibration windows (half prose, half code; the corpora's calib "
                        "split); DQ3_K_M measures each tensor's output KL on 4 of them "
                        "(0: weighs tensors by relative error, data-free)")
    q.add_argument("--calib-window", type=int, default=256, help="tokens per calibration window")
    q.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant's migration strength")
    q.add_argument("--act-order", action="store_true", help="GPTQ: inputs by decreasing Hessian diagonal")

    i = sub.add_parser("info", help="architecture, parameters, bytes, tensor types")
    i.add_argument("src")

    e = sub.add_parser("eval", help="evaluations")
    esub = e.add_subparsers(dest="eval_command", required=True, parser_class=_Parser)
    ppl = esub.add_parser("ppl", help="perplexity on a fixed corpus")
    _model_flags(ppl)
    ppl.add_argument("--corpus", choices=["prose", "code"], default="prose")
    ppl.add_argument("--window", type=int, default=512)
    ppl.add_argument("--max-windows", type=int, default=100,
                     help="score the first N eval windows (100 x 512 = 51,100 tokens); 0: all")
    ppl.add_argument("--batch-size", type=int, default=4)

    f = sub.add_parser("fetch", help="download a named model or the evaluation corpora")
    f.add_argument("name", help="qwen2.5-coder-0.5b, gemma3-270m, smollm2, or corpora")

    _serve_parser(sub)

    b = sub.add_parser("bench", help="decode speed of jaxdec and its peers, side by side")
    b.add_argument("--model", "-m", default="smollm2")
    b.add_argument("--weights", default="f32,gguf",
                   help="comma-separated jaxdec weight formats (f32, bf16, int8, int4, gguf)")
    b.add_argument("--peers", default="hf,llama.cpp",
                   help="comma-separated: hf, hf-compile, llama.cpp (empty: none)")
    b.add_argument("--batches", default="1,8,32,64")
    b.add_argument("--new-tokens", type=int, default=128)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--no-ttft", action="store_true", help="skip the CLI start-up timings")
    b.add_argument("--json", default=None, help="write every figure to this file")
    _bench_serve_parser(b.add_subparsers(dest="bench_command", parser_class=_Parser, metavar="{serve}"))
    _distill_parser(sub)
    return parser


def _serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server on the engine")
    _model_flags(s)
    s.set_defaults(kv_cache="paged")  # the engine's page pool, in the activation dtype
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="0: any free port (printed when ready)")
    s.add_argument("--served-model-name", default=None,
                   help="the name clients ask for in `model` (default: --model)")
    s.add_argument("--max-num-seqs", type=int, default=8, help="requests running at once")
    s.add_argument("--max-num-batched-tokens", type=int, default=256, help="tokens per engine step")
    s.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output tokens per request (default: the model's context, at most 4096)")
    s.add_argument("--policy", default="fcfs", choices=["fcfs", "priority", "sla", "static", "prefill-first"],
                   help="the scheduler: fcfs and priority (which waiting request runs first; priority: "
                   "a request's `priority`, lower first) fill every step with decodes and prompt chunks; "
                   "sla admits by predicted KV use, sizes the running batch (2503.05248) and holds "
                   "prompt chunks back while decoding steps run over --tpot-slo on average; static "
                   "(run each batch to completion) and prefill-first "
                   "(prompts and decodes never share a step) are the baselines of `jaxdec bench serve`")
    s.add_argument("--tpot-slo", type=float, default=0.1,
                   help="seconds per output token that the sla policy keeps decoding under (default 0.1)")
    s.add_argument("--ttft-slo", type=float, default=2.0,
                   help="seconds to the first token: the sla policy shrinks the running batch when a "
                   "prompt has waited half of it behind decodes (default 2)")
    s.add_argument("--no-prefix-caching", action="store_true",
                   help="do not reuse the KV pages of shared prompt prefixes")
    s.add_argument("--num-kv-pages", type=int, default=None, metavar="N",
                   help="pages of 32 tokens in the KV pool, shared by every request (default: "
                   "every row at --max-model-len, within 1 GiB); fewer, and memory rather than "
                   "--max-num-seqs bounds the requests running at once")


def _bench_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="the HTTP server under load, its policies beside llama.cpp's server")
    s.add_argument("--model", "-m", default="smollm2", help="a named model or a .gguf file (both servers load it)")
    s.add_argument("--systems", default="fcfs,static,prefill-first,sla,llama.cpp",
                   help="comma-separated: jaxdec serve policies (fcfs, static, prefill-first, sla) "
                        "and llama.cpp (its llama-server)")
    s.add_argument("--rates", default=None, help="Poisson request rates per second, comma-separated "
                   "(default 0.25,0.5,0.75,1,1.5,2; --quick: 1,4)")
    s.add_argument("--requests", type=int, default=None, help="requests per rate and in the burst "
                   "(default 32; --quick: 8)")
    s.add_argument("--max-num-seqs", type=int, default=16, help="requests running at once (llama.cpp: slots)")
    s.add_argument("--static-seqs", default=None, help="also run fcfs at each of these --max-num-seqs, "
                   "comma-separated (default 4,8,16; --quick: none): the fixed batch limits sla is set against")
    s.add_argument("--clients", default="1,16", help="closed-loop client counts, comma-separated")
    s.add_argument("--rounds", type=int, default=None, help="requests a closed-loop client sends "
                   "(default 6; --quick: 2)")
    s.add_argument("--ttft-slo", type=float, default=2.0, help="seconds to the first token (default 2)")
    s.add_argument("--tpot-slo", type=float, default=0.1,
                   help="seconds per output token (default 0.1); the sla policy's target too")
    s.add_argument("--context", type=int, default=1024, help="tokens per request: jaxdec's "
                   "--max-model-len, llama.cpp's context per slot")
    s.add_argument("--num-kv-pages", type=int, default=None, metavar="N",
                   help="jaxdec's --num-kv-pages (default: a pool with room for every row): fewer, "
                   "and memory bounds the running batch, the case sla's admission by predicted KV "
                   "is for. llama.cpp keeps --context per slot")
    s.add_argument("--seed", type=int, default=0, help="which prompts and arrivals")
    s.add_argument("--llama-server", default=None, metavar="PATH",
                   help="the llama-server binary (default: beside this Python, then PATH)")
    s.add_argument("--llama-threads", type=int, default=None, metavar="N",
                   help="llama-server's -t (default: every core). Its threads wait for each other "
                        "at every op: on a host busy with other work, fewer can be faster")
    s.add_argument("--quick", action="store_true", help="a small smoke run")
    s.add_argument("--json", default=None, help="write every figure to this file")
    s.add_argument("--plot", default="bench-serve.png", help="queue length over time (PNG)")


def _distill_parser(sub) -> None:
    d = sub.add_parser("distill", help="train a speculative drafter on a target's own outputs")
    d.add_argument("--target", default="smollm2", help="the target model (as --model)")
    d.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    d.add_argument("--drafter", required=True, choices=["small", "eagle3", "pard"])
    d.add_argument("--out", required=True, help="run directory (resumed when it holds one)")
    d.add_argument("--steps", type=int, default=300)
    d.add_argument("--batch", type=int, default=8, help="training rows per step")
    d.add_argument("--lr", type=float, default=3e-4)
    d.add_argument("--warmup", type=int, default=None, help="default: 5%% of --steps")
    d.add_argument("--schedule", default="cosine", choices=["cosine", "constant"])
    d.add_argument("--weight-decay", type=float, default=0.0)
    d.add_argument("--clip", type=float, default=1.0, help="global gradient norm")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--log-every", type=int, default=10)
    d.add_argument("--ckpt-every", type=int, default=100)
    d.add_argument("--val-prompts", type=int, default=32, help="held-out prompts whose target "
                   "continuations validate the run (the last ones; 0: none); the lowest "
                   "validation loss's drafter is kept in OUT/best")
    d.add_argument("--eval-every", type=int, default=100, help="steps between validations")
    d.add_argument("--no-resume", action="store_true", help="refuse a run already in --out")
    d.add_argument("--init", metavar="DIR", help="warm-start from this saved drafter's params "
                   "(same kind, shapes and draft vocabulary; a new optimiser and schedule)")
    d.add_argument("--n-prompts", type=int, default=256, help="training prompts from the corpora")
    d.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt")
    d.add_argument("--n-new", type=int, default=64, help="target tokens generated per prompt")
    d.add_argument("--gen-batch", type=int, default=8, help="rows per generation batch")
    d.add_argument("--temperature", type=float, default=0.0, help="of the data; 0: greedy")
    d.add_argument("--samples", type=int, default=1, help="continuations per training prompt "
                   "(more than 1 needs --temperature > 0)")
    d.add_argument("--windows", type=int, default=0, help="also this many teacher-forced "
                   "windows of training-document text (scored, not generated)")
    d.add_argument("--window-len", type=int, default=128, help="tokens per --windows row")
    d.add_argument("--cache-dir", default=None, help="distillation data (default data/distill)")
    d.add_argument("--stop-after", type=int, default=None, help=argparse.SUPPRESS)
    o = d.add_argument_group("drafter options (each applies to some kinds)")
    o.add_argument("--layers", type=int, default=None, help="small, pard: target layers kept")
    o.add_argument("--loss", default=None, choices=["fkl", "rkl"], help="small: KL direction")
    o.add_argument("--train-head", action="store_true", default=None,
                   help="small: train the embedding and LM head too")
    o.add_argument("--k", type=int, default=None, help="draft tokens per round")
    o.add_argument("--draft-vocab", type=int, default=None, help="eagle3: draft vocabulary size")
    o.add_argument("--unroll", type=int, default=None, help="eagle3: training-time-test steps")
    o.add_argument("--d-ff", type=int, default=None, help="eagle3: the layer's MLP width "
                   "(default: the target's)")
    o.add_argument("--head", default=None, choices=["random", "target", "frozen"],
                   help="eagle3: the draft LM head: random, or the target's columns as init "
                   "or frozen (default: random)")


def enable_compile_cache() -> None:
    """JAX's persistent compilation cache, and jaxdec's cache of whole executables in its
    `exec` folder (a hit skips tracing too), so a second run starts fast. An empty
    JAXDEC_XLA_CACHE turns both off."""
    import jax

    from jaxdec import exec_cache
    from jaxdec.checkpoint.registry import home

    path = os.environ.get("JAXDEC_XLA_CACHE", str(home() / ".xla_cache"))
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if path:
        exec_cache.enable(os.path.join(path, "exec"))


def _start():
    """Import jax and the commands with the garbage collector paused: the import builds
    jax's long-lived objects, and collecting while they accumulate cost ~0.1 s of every
    start. They are then frozen (never scanned again) and collection resumes."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        enable_compile_cache()
        from jaxdec import commands
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()
    return commands


def _fake_cpu_devices(mesh: str | None) -> None:
    """Before jax starts: let the CPU platform offer the devices a --mesh asks for (XLA
    fakes them; `--xla_force_host_platform_device_count` touches no other platform). A
    count the user set in XLA_FLAGS is kept. In a multi-process run (JAXDEC_NUM_PROCESSES),
    each process offers its share."""
    if not mesh or "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    from jaxdec.sharding import parse_mesh  # imports jax without starting a backend

    need = math.prod(parse_mesh(mesh).values())
    share = -(-need // max(1, int(os.environ.get("JAXDEC_NUM_PROCESSES", "1") or 1)))
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={share}").strip()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _fake_cpu_devices(getattr(args, "mesh", None))
        commands = _start()
        from jaxdec import sharding
        sharding.initialize_from_env()
        return getattr(commands, args.command.replace("-", "_"))(args) or 0
    except JaxdecError as e:
        sys.stderr.write(f"jaxdec: error: {e}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("jaxdec: interrupted\n")
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
