"""How much of the target's held-out output a reduced draft vocabulary can propose at all.

An EAGLE-3 drafter predicts over the `V_draft` tokens most often predicted in its training
data (`eagle3.vocab_map`); a target token outside them can never be drafted, which caps
acceptance. This builds the map from the distillation data of a `jaxdec distill` run (its
cached files: nothing is regenerated when the run made them) and prints, for each size,
the share of the target's greedy continuations of held-out prompts inside it.

    python scripts/draft_vocab_coverage.py --target smollm2 --n-prompts 2048 --n-new 96 \
        --gen-batch 32 --windows 4096 --vocab 4096,8192,16384
"""

import argparse
import sys

import numpy as np

import jaxdec
from jaxdec import train
from jaxdec.errors import JaxdecError
from jaxdec.speculative import eagle3


def coverage(model, args) -> list[tuple[int, float, float]]:
    tok, taps = model.tokenizer, train.task_taps("eagle3", model.cfg)
    parts = [train.make_dataset(model, train.prompt_set(tok, split="train", n=args.n_prompts),
                                n_new=args.n_new, taps=taps, batch=args.gen_batch,
                                cache_dir=args.cache_dir)]
    if args.windows:
        parts.append(train.make_dataset(model, train.window_rows(tok, n=args.windows), n_new=0,
                                        taps=taps, batch=args.gen_batch, cache_dir=args.cache_dir))
    held = train.make_dataset(model, train.heldout_prompts(tok, args.heldout), n_new=args.n_new,
                              taps=(), batch=args.gen_batch, cache_dir=args.cache_dir)
    wanted = held.tokens[held.mask > 0]
    v = model.cfg.vocab_size
    rows = []
    for size in args.vocab:
        on = lambda data: np.isin(wanted, eagle3.vocab_map(eagle3.token_counts(data, v), size)[0])
        rows.append((size, float(on(parts).mean()), float(on(parts[:1]).mean())))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--n-prompts", type=int, default=2048)
    p.add_argument("--n-new", type=int, default=96)
    p.add_argument("--gen-batch", type=int, default=32)
    p.add_argument("--windows", type=int, default=0)
    p.add_argument("--heldout", type=int, default=64, help="held-out prompts continued")
    p.add_argument("--vocab", default="4096,8192,16384")
    p.add_argument("--cache-dir", default=None, help="distillation data (default data/distill)")
    args = p.parse_args(argv)
    try:
        args.vocab = [int(x) for x in args.vocab.split(",")]
        rows = coverage(jaxdec.load(args.target), args)
    except (JaxdecError, ValueError) as e:
        print(f"draft_vocab_coverage: error: {e}", file=sys.stderr)
        return 2
    print(f"share of the target's greedy continuations of {args.heldout} held-out prompts "
          f"({args.n_new} tokens each) inside the draft vocabulary")
    print(f"{'V_draft':>8} {'map from all data':>18} {'continuations only':>19}")
    for size, all_, gen in rows:
        print(f"{size:>8} {all_:>17.1%} {gen:>18.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
