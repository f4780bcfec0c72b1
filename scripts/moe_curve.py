"""Fewer active experts on a real model: SmolLM2-135M MoEfied, quality against decode speed.

SmolLM2's 30 SwiGLU MLPs are split into E experts each (`jaxdec.models.moefy`: neurons grouped
by co-activation on the prose corpus's calibration windows, a linear router per layer fitted
to predict each expert's output norm). With all E experts active the model is SmolLM2 up to
float32 rounding (checked first). Then, for each number of active experts k, one run prints:

- perplexity on the prose corpus's eval windows, and its ratio to the dense model's;
- greedy agreement with the dense model: the share of generated positions (teacher-forced
  on the dense model's own greedy continuation) where the MoE's argmax equals the dense
  token, and the mean length of the identical free-running greedy prefix;
- batch-1 decode tokens/s (median of repeats, the jitted generation loop), beside the dense
  model's, and the weight bytes a step reads (the k/E share of the MLPs plus the rest).

    .venv/bin/python scripts/moe_curve.py [--experts 8] [--shared 0] [--active 8,6,4,2,1] [--calib 16]
        [--eval 20] [--window 512] [--prompts 8] [--new 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import numpy as np

import jaxdec
from jaxdec import api, corpora, perplexity, transforms


def _decode_rate(model, prompt: list[int], new: int, repeats: int) -> float:
    """Batch-1 decode tokens/s: (new - 8) tokens over the time between an 8-token and a
    `new`-token generation (prefill and dispatch cancel out)."""
    run = lambda n: api.generate_ids(model, [prompt], max_new_tokens=n, stop_ids=())
    run(8), run(new)  # compile both
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run(8)
        t1 = time.perf_counter()
        run(new)
        t2 = time.perf_counter()
        times.append((t2 - t1) - (t1 - t0))
    return (new - 8) / statistics.median(times)


def _agreement(model, dense_rows, prompts, new: int) -> tuple[float, float]:
    """(share of teacher-forced positions whose argmax is the dense greedy token, mean
    identical free-running greedy prefix in tokens)."""
    seqs = np.array([p + d for p, d in zip(prompts, dense_rows)], np.int32)
    logits = api.score(model, seqs)
    plen = len(prompts[0])
    pred = logits[:, plen - 1:-1].argmax(-1)
    forced = float((pred == np.array(dense_rows)).mean())
    ours = api.generate_ids(model, prompts, max_new_tokens=new, stop_ids=()).token_ids
    prefix = [next((i for i, (a, b) in enumerate(zip(o, d)) if a != b), new)
              for o, d in zip(ours, dense_rows)]
    return forced, float(np.mean(prefix))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--shared", type=int, default=0,
                    help="MLP neurons kept always on as a shared expert (0: none)")
    ap.add_argument("--active", default="8,6,4,2,1")
    ap.add_argument("--calib", type=int, default=16, help="calibration windows")
    ap.add_argument("--eval", type=int, default=20, help="perplexity windows")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    active = [int(k) for k in a.active.split(",")]

    dense = jaxdec.load("smollm2", dtype="float32")
    ids = corpora.corpus_token_ids("prose", dense.tokenizer.encode)
    calib = np.asarray(corpora.make_windows(ids, window=a.window, split="calib", max_windows=a.calib))
    evals = np.asarray(corpora.make_windows(ids, window=a.window, split="eval", max_windows=a.eval))
    prompts = [list(map(int, w[:a.prompt_len])) for w in evals[:a.prompts]]

    t0 = time.perf_counter()
    params, cfg = transforms.apply("moefy", dense.params, dense.cfg, calib, n_experts=a.experts,
                                   top_k=a.experts, n_shared=a.shared)
    print(f"MoEfied SmolLM2-135M into {a.experts} experts of {cfg.moe.d_expert} neurons per layer "
          f"(+ {a.shared} shared) on {len(calib)} calibration windows of {a.window} tokens in "
          f"{time.perf_counter() - t0:.0f} s")
    moe_model = dataclasses.replace(dense, cfg=cfg, params=params)

    probe = evals[:2, :128]
    d_logits, m_logits = api.score(dense, probe), api.score(moe_model, probe)
    print(f"all {a.experts} experts active vs dense: max |logit diff| "
          f"{np.abs(d_logits - m_logits).max():.2e} (logits up to {np.abs(d_logits).max():.1f}), "
          f"argmax equal at {np.mean(d_logits.argmax(-1) == m_logits.argmax(-1)):.1%} of positions")

    score = lambda m: perplexity.perplexity(lambda b: api.score(m, b), evals).ppl
    dense_ppl = score(dense)
    dense_rows = api.generate_ids(dense, prompts, max_new_tokens=a.new, stop_ids=()).token_ids
    dense_rate = _decode_rate(dense, prompts[0], 8 + 4 * a.new, a.repeats)

    mlp_bytes = sum(x.nbytes for p in params.layers for x in jax.tree.leaves(p.ffn.experts))
    rest_bytes = (sum(x.nbytes for p in params.layers for x in jax.tree.leaves(p.mixer))
                  + sum(x.nbytes for p in params.layers for x in jax.tree.leaves(p.ffn)) - mlp_bytes
                  + dense.params.lm_head.nbytes)
    print(f"\nperplexity on {len(evals)} prose eval windows of {a.window}; greedy agreement over "
          f"{len(prompts)} prompts x {a.new} tokens; batch-1 decode, f32 weights\n")
    print(f"{'active':>8} {'ppl':>9} {'x dense':>8} {'forced':>7} {'prefix':>7} "
          f"{'tok/s':>7} {'x dense':>8} {'MB/step':>8}")
    print(f"{'dense':>8} {dense_ppl:9.3f} {1.0:8.3f} {1.0:7.1%} {a.new:7.1f} {dense_rate:7.1f} "
          f"{1.0:8.2f} {(mlp_bytes + rest_bytes) / 1e6:8.1f}")
    for k in active:
        m = dataclasses.replace(moe_model, cfg=dataclasses.replace(
            cfg, moe=dataclasses.replace(cfg.moe, top_k=k)))
        ppl = score(m)
        forced, prefix = _agreement(m, dense_rows, prompts, a.new)
        rate = _decode_rate(m, prompts[0], 8 + 4 * a.new, a.repeats)
        step_mb = (mlp_bytes * k / a.experts + rest_bytes) / 1e6
        print(f"{f'{k}/{a.experts}':>8} {ppl:9.3f} {ppl / dense_ppl:8.3f} {forced:7.1%} "
              f"{prefix:7.1f} {rate:7.1f} {rate / dense_rate:8.2f} {step_mb:8.1f}", flush=True)


if __name__ == "__main__":
    main()
