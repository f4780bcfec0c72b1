"""Decode speed on an accelerator: jaxdec against HF transformers, beside the HBM roofline.

    python scripts/device_bench.py --out DIR [--smoke]

Run by scripts/device_bench.sh on a lent GPU. The model is Qwen2.5-Coder-0.5B's
architecture (24 layers, d 896, GQA 14/2, QKV bias, tied 151,936-token head) with random
bf16 weights: the checkpoint cannot travel to the device machine, and speed does not
depend on the values. Both systems run the same shapes: batch 1, 8 and 32, a 32-token
prompt, 128 greedy new tokens (EOS ignored), and a 512-token prefill. The roofline of a
decode step is the bytes it must read (all weights once, the KV cache at the mean context)
over the copy bandwidth measured in the same run. `--smoke` runs a tiny config on
whatever backend is present (CI runs it on the CPU so this script cannot rot).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from jaxdec import decode  # noqa: E402
from jaxdec.cache import dense  # noqa: E402
from jaxdec.config import ModelConfig  # noqa: E402
from jaxdec.models import transformer  # noqa: E402
from jaxdec.pytree import init_params, param_bytes  # noqa: E402
from jaxdec.sampling import Greedy  # noqa: E402

QWEN = ModelConfig(arch="qwen2", vocab_size=151936, d_model=896, n_layers=24, n_heads=14,
                   n_kv_heads=2, head_dim=64, d_ff=4864, norm_eps=1e-6, rope_theta=1e6,
                   tie_embeddings=True, qkv_bias=True, max_position=32768, eos_ids=(151645,),
                   bos_id=None)
TINY = ModelConfig(arch="qwen2", vocab_size=512, d_model=64, n_layers=2, n_heads=4,
                   n_kv_heads=2, head_dim=16, d_ff=128, norm_eps=1e-6, rope_theta=1e6,
                   tie_embeddings=True, qkv_bias=True, max_position=1024, eos_ids=(0,),
                   bos_id=None)


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(gib: float) -> dict:
    """Device-to-device copy (bytes read + written) and a pure read (a sum)."""
    n = int(gib * 2**30 // 2)
    x = jnp.ones((n,), jnp.bfloat16)
    copy = jax.jit(lambda a: a * 2)
    read = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    t_copy = timed(lambda: copy(x).block_until_ready(), 10)
    t_read = timed(lambda: read(x).block_until_ready(), 10)
    return {"copy_gbs": round(2 * x.nbytes / t_copy / 1e9, 1),
            "read_gbs": round(x.nbytes / t_read / 1e9, 1)}


def jaxdec_decode(cfg, params, batch: int, prompt_len: int, new: int, repeats: int) -> dict:
    rng = np.random.default_rng(batch)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, prompt_len)), jnp.int32)
    lens = jnp.full((batch,), prompt_len, jnp.int32)
    limits = jnp.full((batch,), new, jnp.int32)
    static = dict(sampler=Greedy(), cfg=cfg, stop_ids=())
    capacity = -(-(prompt_len + new) // 64) * 64

    def run():
        cache = dense.init_cache(cfg, batch, capacity, jnp.bfloat16)
        t0 = time.perf_counter()
        p, cache = decode.start(params, cache, tokens, lens, jax.random.key(0), limits,
                                max_new_tokens=new, **static)
        jax.block_until_ready(p)
        t1 = time.perf_counter()
        p, cache = decode.advance(params, cache, p, jax.random.key(0), limits, new, **static)
        jax.block_until_ready(p)
        return t1 - t0, time.perf_counter() - t1

    run()
    runs = [run() for _ in range(repeats)]
    first = statistics.median(r[0] for r in runs)
    rest = statistics.median(r[1] for r in runs)
    return {"ttft_s": first, "decode_tok_s": batch * (new - 1) / rest}


def hf_decode(cfg, batch: int, prompt_len: int, new: int, repeats: int, device: str) -> dict:
    import torch
    import transformers

    hf_cfg = transformers.Qwen2Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        tie_word_embeddings=True, max_position_embeddings=cfg.max_position)
    model = transformers.Qwen2ForCausalLM(hf_cfg).to(device=device, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt_len), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def gen(n):
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, pad_token_id=0)
        sync()

    t1 = timed(lambda: gen(1), repeats)
    tn = timed(lambda: gen(new), repeats)
    return {"ttft_s": t1, "decode_tok_s": batch * (new - 1) / (tn - t1)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    cfg = TINY if args.smoke else QWEN
    new, prompt_len, repeats = (8, 8, 1) if args.smoke else (128, 32, 3)
    batches = (1, 2) if args.smoke else (1, 8, 32)
    device = jax.devices()[0]
    report = {"device": str(device.device_kind), "backend": jax.default_backend(),
              "jax": jax.__version__}
    report |= copy_bandwidth(0.01 if args.smoke else 2.0)
    params = init_params(transformer.declare(cfg), jax.random.key(0), jnp.bfloat16)
    weight_bytes = param_bytes(params)
    rows = []
    torch_device = "cuda" if jax.default_backend() == "gpu" else "cpu"
    for b in batches:
        ours = jaxdec_decode(cfg, params, b, prompt_len, new, repeats)
        kv = b * cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * (prompt_len + new // 2) * 2
        roofline = b * report["read_gbs"] * 1e9 / (weight_bytes + kv)
        try:
            theirs = hf_decode(cfg, b, prompt_len, new, repeats, torch_device)
        except Exception as e:  # noqa: BLE001 - the table goes on without the peer
            theirs = {"error": f"{type(e).__name__}: {e}"[:200]}
        rows.append({"batch": b, "jaxdec": ours, "hf": theirs, "roofline_tok_s": roofline})
    pre = jaxdec_decode(cfg, params, 1, 64 if args.smoke else 512, 2, repeats)
    report |= {"weight_bytes": weight_bytes, "rows": rows, "prefill_512_ttft_s": pre["ttft_s"]}
    lines = [f"{report['device']} ({report['backend']}, jax {report['jax']}): copy "
             f"{report['copy_gbs']} GB/s, read {report['read_gbs']} GB/s; weights "
             f"{weight_bytes / 1e6:.0f} MB bf16",
             f"{'batch':>5} {'jaxdec tok/s':>13} {'HF tok/s':>10} {'jaxdec/HF':>10} "
             f"{'roofline':>9} {'of roofline':>12}"]
    for r in rows:
        hf = r["hf"].get("decode_tok_s")
        ours = r["jaxdec"]["decode_tok_s"]
        lines.append(f"{r['batch']:>5} {ours:>13.1f} {hf if hf is None else round(hf, 1)!s:>10} "
                     f"{'-' if not hf else f'{ours / hf:.2f}':>10} {r['roofline_tok_s']:>9.0f} "
                     f"{ours / r['roofline_tok_s']:>12.2f}")
    lines.append(f"prefill 512 tokens: {pre['ttft_s'] * 1e3:.1f} ms "
                 f"({512 / pre['ttft_s']:.0f} tok/s)" if not args.smoke else "")
    text = "\n".join(lines)
    print(text)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "device_bench.txt").write_text(text + "\n")
    (out / "device_bench.json").write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
