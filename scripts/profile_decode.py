"""Where batch-1 decode time goes, for the performance work of issue 3.

    python scripts/profile_decode.py [--model smollm2] [--weights gguf] [--steps 30]

Prints the time of one jitted `decode_step` (the cache donated), of the layer stack alone
(no cache, one token), and of the LM head alone, each the mean over `--steps` calls
after warm-up. `--weights` is `jaxdec.load`'s (float32 when left out; `jaxdec serve` and
`jaxdec bench serve` run "gguf").
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import jaxdec
from jaxdec import decode
from jaxdec.cache import dense
from jaxdec.models import transformer
from jaxdec.sampling import Greedy


def timed(fn, steps: int) -> float:
    jax.block_until_ready(fn())
    start = time.perf_counter()
    for _ in range(steps):
        jax.block_until_ready(fn())
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--weights", default=None, help="f32, bf16, int8, int4, gguf, ... (float32 when left out)")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    model = jaxdec.load(args.model, weights=args.weights)
    cfg, params = model.cfg, model.params
    state = {"cache": dense.init_cache(cfg, 1, 256), "tok": jnp.array([1])}

    def step():
        state["tok"], state["cache"] = decode.decode_step(params, state["cache"], state["tok"],
                                                          jax.random.key(0), Greedy(), cfg)
        return state["tok"]

    stack = jax.jit(lambda p, t: transformer.hidden(p, t, jnp.zeros((1, 1), jnp.int32), None,
                                                    cfg)[0])
    head = jax.jit(transformer.logits_from_hidden)
    h = jnp.ones((1, 1, cfg.d_model), params.final_norm.dtype)  # (the activations' dtype)
    print(f"{args.model}, weights {args.weights or 'float32'}")
    print(f"decode_step      {timed(step, args.steps):7.2f} ms")
    print(f"layers, no cache {timed(lambda: stack(params, jnp.array([[1]])), args.steps):7.2f} ms")
    print(f"lm head          {timed(lambda: head(params, h), args.steps):7.2f} ms")


if __name__ == "__main__":
    main()
