"""Decode cache sizes of the four mixers at one model width, and what decoding holds and
costs as the sequence grows.

Part 1 (arithmetic from the cache entries `jaxdec.cache.dense.init_cache` allocates): bytes
per token per layer and the fixed per-row state, for MHA, GQA, MLA and Mamba2 at the same
width (default D = 2048: 16 query heads of 128; GQA with 4 kv heads; MLA as DeepSeek-V3
proportions, latent 512 + RoPE key 64; Mamba2 with expand 2, 64 heads of 64, state 128).

Part 2 (measured): a 4-layer random model of each kind decodes one token per step on a cache
filled to L tokens, for growing L: the bytes of the cache the step carries (the arrays
themselves) and the median step time. Mamba's stay flat; the others grow with L.

    .venv/bin/python scripts/cache_bytes.py [--width 2048] [--contexts 256,2048,8192]
        [--layers 4] [--dtype bfloat16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxdec import decode, pytree
from jaxdec.cache import dense
from jaxdec.config import MambaConfig, MLAConfig, ModelConfig
from jaxdec.models import transformer
from jaxdec.sampling import Greedy


def configs(width: int, layers: int) -> dict[str, ModelConfig]:
    heads, head_dim = max(1, width // 128), 128
    base = dict(vocab_size=1024, d_model=width, n_layers=layers, n_heads=heads,
                head_dim=head_dim, d_ff=2 * width)
    return {
        "MHA": ModelConfig(**base, n_kv_heads=heads),
        "GQA": ModelConfig(**base, n_kv_heads=min(4, heads)),
        "MLA": ModelConfig(**base, n_kv_heads=heads, layer_types=("mla+mlp",) * layers,
                           mla=MLAConfig(kv_lora_rank=512, qk_nope_head_dim=128,
                                         qk_rope_head_dim=64, v_head_dim=128)),
        "Mamba2": ModelConfig(**base, n_kv_heads=heads, layer_types=("mamba+mlp",) * layers,
                              mamba=MambaConfig(n_heads=2 * width // 64, head_dim=64, n_groups=1,
                                                d_state=128)),
    }


def _filled_cache(cfg: ModelConfig, context: int, dtype) -> dense.KVCache:
    """A one-row cache holding `context` tokens of random content (decode reads it all)."""
    cache = dense.init_cache(cfg, 1, context + 64, dtype)  # room for the timed steps
    rng = np.random.default_rng(0)
    fill = lambda x: jnp.asarray(rng.standard_normal(x.shape).astype(np.float32) * 0.1, x.dtype)
    return dataclasses.replace(jax.tree.map(fill, cache),
                               lengths=jnp.full((1,), context, jnp.int32))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--contexts", default="256,2048,8192")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    dtype = jnp.dtype(a.dtype)
    kinds = configs(a.width, a.layers)

    print(f"cache per layer at D = {a.width}, {a.dtype} entries (Mamba's SSM state is float32)\n")
    print(f"{'mixer':>7} {'bytes/token':>12} {'x MHA':>7} {'fixed bytes/row':>16}")
    one = lambda c: dataclasses.replace(c, n_layers=1, layer_types=c.layer_types[:1])
    mha = dense.bytes_per_token(one(kinds["MHA"]), dtype)[0]
    for name, cfg in kinds.items():
        grow, fixed = dense.bytes_per_token(one(cfg), dtype)
        print(f"{name:>7} {grow:12,} {grow / mha:7.3f} {fixed:16,}")

    contexts = [int(c) for c in a.contexts.split(",")]
    print(f"\ndecoding one token at context L ({a.layers} layers, batch 1): cache bytes carried, "
          f"median step ms\n")
    print(f"{'mixer':>7} " + " ".join(f"{f'L={c}':>22}" for c in contexts))
    for name, cfg in kinds.items():
        params = pytree.init_params(transformer.declare(cfg), jax.random.key(1), dtype)
        cells = []
        for c in contexts:
            cache = _filled_cache(cfg, c, dtype)
            nbytes = sum(x.nbytes for x in jax.tree.leaves(cache.layers))
            last = jnp.zeros((1,), jnp.int32)
            key = jax.random.key(0)
            tok, cache = decode.decode_step(params, cache, last, key, Greedy(), cfg)  # compile
            times = []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                tok, cache = decode.decode_step(params, cache, tok, key, Greedy(), cfg)
                tok.block_until_ready()
                times.append(time.perf_counter() - t0)
            cells.append(f"{nbytes / 2**20:10.2f} MiB {statistics.median(times) * 1e3:7.2f} ms")
        print(f"{name:>7} " + " ".join(f"{cell:>22}" for cell in cells), flush=True)


if __name__ == "__main__":
    main()
