"""Sharded decoding on fake CPU devices: per-device memory and decode speed per layout.

For SmolLM2 (the real model) and three random models of the other families at a width
where the matmuls dominate (MLA+MoE as DeepSeek-V3, MoE with a gated shared expert as
Qwen2-MoE, and a Mamba2/attention/MoE hybrid as Nemotron-H), each layout's run prints:
params and cache bytes held per device, prefill time and decode tokens/s of a batch, beside
the single-device run (C++ kernels) and the single-device run with XLA's own ops (what the
sharded programs run: the SPMD partitioner splits XLA ops, not custom calls).

The 8 devices are faked by XLA on this machine's CPU cores: they share the cores and the
memory bandwidth, so a layout's speed here measures partitioning overhead, not scaling.
The greedy tokens of every layout are checked against the single-device run.

    .venv/bin/python scripts/mesh_bench.py [--models smollm2,mla_moe,moe,hybrid]
        [--batch 8] [--new-tokens 32] [--prompt-len 32]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxdec  # noqa: E402
from jaxdec import api, decode, pytree, sharding  # noqa: E402
from jaxdec.config import MambaConfig, MLAConfig, ModelConfig, MoEConfig  # noqa: E402
from jaxdec.models import transformer  # noqa: E402
from jaxdec.sampling import Greedy  # noqa: E402

LAYOUTS = {"smollm2": ["data=8", "model=3", "data=2,model=3"],
           "mla_moe": ["model=4", "data=2,model=4", "expert=4", "data=8"],
           "moe": ["model=4", "data=2,model=4", "expert=4", "data=8"],
           "hybrid": ["model=4", "data=2,model=4", "expert=4", "data=8"]}


def random_config(name: str) -> ModelConfig:
    base = dict(vocab_size=8192, d_model=512, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64,
                d_ff=1536)
    moe = MoEConfig(n_experts=8, top_k=2, d_expert=512, d_shared=1024)
    if name == "mla_moe":
        return ModelConfig(arch="mla_moe", **base, layer_types=("mla+mlp",) + ("mla+moe",) * 3,
                           mla=MLAConfig(kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
                                         v_head_dim=64, q_lora_rank=192),
                           moe=MoEConfig(n_experts=8, top_k=2, d_expert=512, router="sigmoid",
                                         normalize=True, scale=2.5, n_group=4, topk_group=2,
                                         router_bias=True, d_shared=512))
    if name == "moe":
        return ModelConfig(arch="moe", **base, layer_types=("attention+moe",) * 4,
                           moe=MoEConfig(n_experts=8, top_k=2, d_expert=512, d_shared=1024,
                                         shared_gate=True))
    return ModelConfig(arch="hybrid", **dict(base, n_layers=6), mlp_act="relu2",
                       layer_types=("mamba", "moe", "attention", "moe", "mamba", "mlp"),
                       moe=moe, mamba=MambaConfig(n_heads=16, head_dim=64, n_groups=2, d_state=64))


def model_of(name: str, mesh=None) -> api.Model:
    if name == "smollm2":
        return jaxdec.load("smollm2", mesh=mesh)
    cfg = random_config(name)
    params = pytree.init_params(transformer.declare(cfg), jax.random.key(0))
    model = api.Model(cfg=cfg, params=params, tokenizer=None, source=name)
    return model if mesh is None else api.shard(model, mesh)


def run(model: api.Model, batch: int, prompt_len: int, new: int) -> dict:
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, model.cfg.vocab_size, (batch, prompt_len)).astype(np.int32)
    lens = np.full((batch,), prompt_len, np.int32)
    limits = np.full((batch,), new, np.int32)
    static = dict(sampler=Greedy(), cfg=model.cfg, max_new_tokens=new, stop_ids=())
    times = []
    for _ in range(2):  # the first run compiles
        cache = api.init_cache(model, batch, prompt_len + new + 1)
        t0 = time.perf_counter()
        p, cache = api._run(model, decode.start, model.params, cache, prompts, lens,
                            jax.random.key(0), limits, **static)
        jax.block_until_ready(p)
        t1 = time.perf_counter()
        p, cache = api._run(model, decode.advance, model.params, cache, p, jax.random.key(0),
                            limits, new, sampler=Greedy(), cfg=model.cfg, stop_ids=())
        tokens = sharding.to_host(p.tokens)
        times.append((t1 - t0, time.perf_counter() - t1))
    prefill, dec = times[-1]
    return {"params": sharding.max_device_bytes(model.params),
            "cache": sharding.max_device_bytes(cache), "prefill_s": prefill,
            "tok_s": batch * (new - 1) / dec, "tokens": tokens}


def xla_only(name: str, args) -> dict:
    """The single-device run with the C++ kernels off (a fresh process: the switch is read
    when the kernel library loads)."""
    cmd = [sys.executable, __file__, "--models", name, "--batch", str(args.batch),
           "--new-tokens", str(args.new_tokens), "--prompt-len", str(args.prompt_len), "--single-only"]
    out = subprocess.run(cmd, env=dict(os.environ, JAXDEC_CPU_KERNEL="0"), capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(LAYOUTS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--single-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    mib = lambda b: f"{b / 2**20:8.2f}"
    for name in args.models.split(","):
        single = run(model_of(name), args.batch, args.prompt_len, args.new_tokens)
        if args.single_only:
            print(json.dumps({k: v for k, v in single.items() if k != "tokens"}))
            return
        plain = xla_only(name, args)
        print(f"\n{name}: batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new "
              f"tokens, {jax.devices()[0].platform} x{len(jax.devices())} (fake devices)")
        print(f"{'layout':<22}{'params MiB/dev':>15}{'cache MiB/dev':>15}{'prefill s':>11}"
              f"{'decode tok/s':>14}{'vs 1 dev':>10}{'vs 1 dev XLA':>14}  tokens")
        rows = [("1 device (C++ kernels)", single), ("1 device (XLA ops)", dict(plain, tokens=None))]
        for spec in LAYOUTS[name]:
            rows.append((spec, run(model_of(name, spec), args.batch, args.prompt_len, args.new_tokens)))
        for label, r in rows:
            same = "" if r["tokens"] is None else (
                "same" if np.array_equal(r["tokens"], single["tokens"]) else "DIFFER")
            print(f"{label:<22}{mib(r['params']):>15}{mib(r['cache']):>15}{r['prefill_s']:>11.3f}"
                  f"{r['tok_s']:>14.1f}{r['tok_s'] / single['tok_s']:>10.2f}"
                  f"{r['tok_s'] / plain['tok_s']:>14.2f}  {same}")


if __name__ == "__main__":
    main()
