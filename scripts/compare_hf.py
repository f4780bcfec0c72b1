"""jaxdec against HF transformers on a real model: logits error and greedy agreement.

    python scripts/compare_hf.py --model smollm2 [--new-tokens 64]

Prints, per prompt, the relative Frobenius error of jaxdec's float32 and bf16 logits
against HF's float32 forward (HF's own bf16 error beside it), then the number of prompts
whose greedy continuation is identical to HF's `generate`. Needs the `test` extra.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import transformers

import jaxdec
from jaxdec import prompts
from jaxdec.checkpoint import registry


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def hf_load(name: str, dtype):
    path = registry.resolve(name)
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype).eval()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", choices=list(registry.MODELS))
    ap.add_argument("--new-tokens", type=int, default=64, help="0: skip the greedy check")
    args = ap.parse_args()

    ours32, ours16 = jaxdec.load(args.model), jaxdec.load(args.model, dtype="bfloat16")
    hf32, hf16 = hf_load(args.model, torch.float32), hf_load(args.model, torch.bfloat16)
    rows = [ours32.tokenizer.encode(p) for p in prompts.PROMPTS]
    chat = ours32.tokenizer.apply_chat_template(list(prompts.CHAT))
    rows.append(ours32.tokenizer.encode(chat, add_special_tokens=False))
    s32, s16 = jaxdec.score(ours32, rows), jaxdec.score(ours16, rows)
    print(f"{'prompt':34s} {'T':>4s} {'f32 err':>9s} {'bf16 err':>9s} {'HF bf16':>9s}")
    for i, row in enumerate(rows):
        with torch.no_grad():
            ref = hf32(torch.tensor([row])).logits[0].numpy()
            ref16 = hf16(torch.tensor([row])).logits[0].float().numpy()
        label = (prompts.PROMPTS[i] if i < len(prompts.PROMPTS) else "<chat template>")[:32]
        print(f"{label!r:34s} {len(row):4d} {rel(s32[i, :len(row)], ref):9.2e} "
              f"{rel(s16[i, :len(row)], ref):9.2e} {rel(ref16, ref):9.2e}")

    if args.new_tokens <= 0:
        return
    t0 = time.perf_counter()
    res = jaxdec.generate(ours32, list(prompts.PROMPTS), max_new_tokens=args.new_tokens)
    stops = list(ours32.cfg.eos_ids)
    same = 0
    for i, row in enumerate(res.prompt_ids):
        with torch.no_grad():
            out = hf32.generate(torch.tensor([row]), attention_mask=torch.ones(1, len(row),
                                dtype=torch.long), max_new_tokens=args.new_tokens,
                                do_sample=False, eos_token_id=stops, pad_token_id=stops[0])
        hf_ids = out[0, len(row):].tolist()
        while len(hf_ids) > len(res.token_ids[i]) and hf_ids[-1] == stops[0]:
            hf_ids.pop()
        same += hf_ids == res.token_ids[i]
    print(f"greedy {args.new_tokens} tokens: {same}/{len(res.prompt_ids)} prompts identical to "
          f"HF generate ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
