"""Greedy chain speculation replayed from one teacher-forced pass, for an EAGLE-3 drafter:
the mean accepted length and acceptance by position that `bench_spec.py` would measure on
the same held-out prompts, without decoding (as `jaxdec distill` validates with val_mal).

    python scripts/replay_spec.py --target smollm2 --drafter runs/eagle3-all/best --n-prompts 16
    python scripts/bench_spec.py --target smollm2 --drafters runs/eagle3-all/best --n-prompts 16

Also prints the first draft's teacher-forced agreement with the target's next token over
every position: higher than its acceptance per round, as rounds land on hard stretches.
"""

import argparse
import sys

import jax
import numpy as np

import jaxdec
from jaxdec.errors import JaxdecError
from jaxdec.ops import cpu_kernel
from jaxdec.speculative import eagle3
from jaxdec.train import store
from jaxdec.train import data, loop


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", required=True, help="a trained EAGLE-3 drafter directory")
    p.add_argument("--n-prompts", type=int, default=16, help="the first held-out prompts")
    p.add_argument("--new-tokens", type=int, default=64)
    args = p.parse_args(argv)
    try:
        model = jaxdec.load(args.target)
        drafter = store.load_drafter(args.drafter, model)
        if not isinstance(drafter, eagle3.Eagle3):
            raise JaxdecError(f"{args.drafter}: not an EAGLE-3 drafter")
        prompts = data.heldout_prompts(model.tokenizer, args.n_prompts)
        ds = data.make_dataset(model, prompts, n_new=args.new_tokens, taps=drafter.taps,
                               batch=len(prompts))
    except JaxdecError as e:
        print(f"replay_spec: error: {e}", file=sys.stderr)
        return 2
    dp, rows = drafter.params, ds.rows(np.arange(len(ds)))
    with cpu_kernel.xla_only():
        drafts = np.asarray(jax.jit(eagle3.chain_drafts, static_argnums=(5, 6))(
            dp.net, dp.embed, dp.d2t, eagle3.batch_feats(rows), ds.tokens, drafter.k,
            drafter.cfg))
    hist, emitted = loop.replay_chains(drafts, ds.tokens, ds.mask, n_new=args.new_tokens)
    stats = loop.chain_stats(hist, emitted)
    later = ds.mask[:, 2:] > 0  # positions whose token a first draft proposes
    agree = float(np.mean((drafts[0, :, :-2] == ds.tokens[:, 2:])[later]))
    print(f"{args.drafter}: {len(prompts)} held-out prompts x {args.new_tokens} tokens, k="
          f"{drafter.k}, replayed: MAL {stats['mal']:.3f}, rounds {int(hist.sum())}, "
          f"accepted-drafts histogram {hist.tolist()}, acceptance by position "
          + " ".join(f"{stats[f'accept_{j}']:.3f}" for j in range(1, len(hist)))
          + f"; first draft's teacher-forced agreement {agree:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
