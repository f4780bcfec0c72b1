"""Where the time goes: per-op times of plain and speculative decoding, from a JAX trace.

    python scripts/profile_spec.py --target smollm2 --drafter runs/eagle3-w4k/drafter+int8
    python scripts/profile_spec.py --target smollm2 --drafter "runs/eagle3-w4k/drafter@tree=4x4x7+int8"
    python scripts/profile_spec.py --target smollm2 --new-tokens 128     # plain decoding only

Decodes one held-out prompt plainly, then with the drafter (a `bench_spec` drafter source; without
`--drafter`, plainly only; `--weights` picks the target's weight format),
each under `jax.profiler.trace` after a warm-up that compiles, and prints the ops that took
the most time: per generated token for plain decoding, per round for speculation. The CPU
kernels are named by target and result shape (`jaxdec_dense_matmul f32[5,1536]` is a 5-token
verification's MLP up-projection), other ops by their HLO name. Tracing adds a little to
every op; read the shares, and bench_spec for speeds.
"""

import argparse
import collections
import gzip
import json
import os
import pathlib
import re
import sys
import tempfile

DUMP = tempfile.mkdtemp(prefix="jaxdec-hlo-")
# before jax starts: the optimised HLO names each op that the trace events point at
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_dump_to={DUMP} --xla_dump_hlo_as_text").strip()

import jax  # noqa: E402

import jaxdec  # noqa: E402
from jaxdec.bench import spec_bench  # noqa: E402
from jaxdec.errors import JaxdecError  # noqa: E402
from jaxdec.train import data  # noqa: E402

_OP = re.compile(r"\s*(?:ROOT )?%(\S+) = (\S+) (custom-call|copy)\(")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_CONTROL = {"while", "conditional", "call"}  # their events span the ops inside them


def op_labels(dump_dir) -> dict:
    """(module, op name) -> "target result-shape" for the custom calls and copies of every
    optimised module XLA dumped."""
    labels = {}
    for f in pathlib.Path(dump_dir).glob("*after_optimizations.txt"):
        text = f.read_text()
        module = re.match(r"HloModule (\S+?)[,\s]", text)
        if not module:
            continue
        for line in text.splitlines():
            m = _OP.match(line)
            if m:
                target = _TARGET.search(line)
                shape = re.sub(r"\{[^}]*\}", "", m.group(2))
                labels[module.group(1), m.group(1)] = f"{target.group(1) if target else 'copy'} {shape}"
    return labels


def op_times(trace_dir, labels) -> collections.Counter:
    """Microseconds per op label over the trace's XLA op events (control flow left out:
    its time is its body's)."""
    path = next(pathlib.Path(trace_dir).rglob("*.json.gz"))
    events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    total = collections.Counter()
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") != "X" or "hlo_op" not in args:
            continue
        op = args["hlo_op"]
        if re.sub(r"\.\d+$", "", op) in _CONTROL:
            continue
        label = labels.get((args.get("hlo_module"), op)) or re.sub(r"\.\d+$", "", op)
        total[label] += e.get("dur", 0.0)
    return total


def profile(gen, prompt, labels_dir, out_dir):
    """`gen` (compiled) on `prompt` under the profiler -> (its output, op times)."""
    with jax.profiler.trace(out_dir, create_perfetto_trace=True):
        out = gen(prompt)
    return out, op_times(out_dir, op_labels(labels_dir))


def report(title, times, per, unit, top) -> str:
    total = sum(times.values())
    lines = [f"{title}: {total / 1e3 / per:.1f} ms of ops per {unit}"]
    for label, us in times.most_common(top):
        lines.append(f"  {us / 1e3 / per:8.2f} ms  {us / total:5.1%}  {label}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", help="a bench_spec drafter source (none: plain decoding only)")
    p.add_argument("--weights", default="f32", help="the target's weight format (jaxdec.load)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt", type=int, default=0, help="which held-out prompt")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    try:
        model = jaxdec.load(args.target, weights=args.weights)
        prompt = data.prompt_set(model.tokenizer, split="heldout", n=args.prompt + 1)[args.prompt]
        drafter = spec_bench.load_drafter(args.drafter, model) if args.drafter else None
    except JaxdecError as e:
        print(f"profile_spec: error: {e}", file=sys.stderr)
        return 2
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, d in (("plain", None), ("spec", drafter))[:2 if drafter else 1]:
            gen = spec_bench._generator(model, [prompt], args.new_tokens, d)
            runs[name] = profile(gen, prompt, DUMP, f"{tmp}/{name}")
    plain, t_plain = runs["plain"]
    n = len(plain.token_ids[0])
    print(report(f"plain decoding, {n} tokens (prefill included)", t_plain, n, "token", args.top))
    if not drafter:
        return 0
    spec, t_spec = runs["spec"]
    rounds = spec.spec["rounds"]
    print(report(f"{args.drafter}: {rounds} rounds, mean accepted length "
                 f"{spec.spec['mean_accepted']:.2f} (prefill included)", t_spec, rounds, "round",
                 args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
