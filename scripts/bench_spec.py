"""Speculative decoding vs plain jitted decoding on this machine, side by side in one run.

    python scripts/bench_spec.py --target smollm2 \
        --drafters checkpoints/eagle3-smollm2/drafter,checkpoints/pard-smollm2/drafter,layers:8
    python scripts/bench_spec.py --target qwen2.5-coder-0.5b --prompts code \
        --drafters smollm2@tli,smollm2@slem,smollm2@tli+int4

Each drafter is a trained drafter checkpoint (`DIR@tree=DxKxB`: an EAGLE-3 checkpoint
drafting EAGLE-2 trees of depth D, top-k K and B draft tokens; `DIR+int8`/`+int4`: its
weights quantised), a model (another vocabulary: `@tli` or `@slem`; `+int8`/`+int4`/`+gguf`:
its weights quantised, a cheaper drafter), or layers:N. Every method decodes each prompt
before the next prompt starts, so the machine's drifting speed falls on all rows alike. Prints mean accepted length, tokens/s, speed-up over plain decoding,
whether the tokens are identical (they must be), ms per round against the verification
forward alone, the ceiling (the speed-up if drafting were free), and acceptance by position.
"""

import argparse
import sys

from jaxdec.bench import spec_bench
from jaxdec.errors import JaxdecError


def prompt_set(kind: str, n: int, target: str):
    if kind == "code":
        from jaxdec.prompts import CODE_TASKS
        return list(CODE_TASKS[:n]), True
    import jaxdec
    from jaxdec.train import data
    # "train": the first corpus prompts, which `jaxdec distill` trains on (a drafter's
    # acceptance there against "heldout" shows how far it generalises)
    return data.prompt_set(jaxdec.load(target).tokenizer, split=kind, n=n), False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafters", required=True, help="comma-separated drafter sources")
    p.add_argument("--prompts", default="heldout", choices=["heldout", "train", "code"])
    p.add_argument("--n-prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=None, help="override the drafters' draft length")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the target's (and plain decoding's) dtype")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    try:
        prompts, chat = prompt_set(args.prompts, args.n_prompts, args.target)
        report = spec_bench.run(args.target, args.drafters.split(","), prompts, args.new_tokens,
                                k=args.k, dtype=args.dtype, chat=chat, label=args.prompts)
    except JaxdecError as e:
        print(f"bench_spec: error: {e}", file=sys.stderr)
        return 2
    print(spec_bench.table(report))
    if args.json:
        spec_bench.save(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
