"""Hugging Face transformers' perplexity on jaxdec's corpus windows: the reference number
printed beside jaxdec's own.

    python scripts/ppl_hf.py --model smollm2 --corpus prose --window 512 [--max-windows N]

The GGUF is dequantised by transformers into a float32 PyTorch model. The text is
tokenized with jaxdec's tokenizer (no special tokens) and scored through
`jaxdec.perplexity.evaluate`, so the windows are token for token the ones `jaxdec eval ppl`
scores; `--hf-tokenizer` uses HF's GGUF tokenizer instead (for SmolLM2 it splits a space
before a digit differently from llama.cpp and jaxdec, which shifts the windows).
`--tokens-only` prints the token count of every corpus and exits.
"""

import argparse
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from jaxdec import corpora
from jaxdec.checkpoint import registry
from jaxdec.checkpoint.gguf_reader import read_gguf_header
from jaxdec.checkpoint.tokenizer import Tokenizer
from jaxdec.perplexity import evaluate


def jaxdec_encoder(model: str):
    """jaxdec's tokenizer for the model as `text -> ids`, adding no special tokens."""
    tok = Tokenizer.from_gguf(read_gguf_header(registry.resolve(model)).metadata)
    return lambda text: tok.encode(text, add_special_tokens=False)


def hf_encoder(model: str):
    """The model's HF tokenizer as `text -> ids`, adding no BOS/special tokens."""
    path = registry.resolve(model)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return lambda text: tok.encode(text, add_special_tokens=False)


def hf_score_fn(model: str):
    """`tokens i32[B, T] -> f32[B, T, V]` logits of the float32 HF model."""
    path = registry.resolve(model)
    net = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                               dtype=torch.float32).eval()

    @torch.inference_mode()
    def score(tokens: np.ndarray) -> np.ndarray:
        return net(input_ids=torch.from_numpy(tokens).long()).logits.float().numpy()
    return score


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(registry.MODELS), required=True)
    p.add_argument("--corpus", choices=corpora.CORPORA, default="prose")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--max-windows", type=int, default=None)
    p.add_argument("--split", choices=corpora.SPLITS, default="eval")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--tokens-only", action="store_true")
    p.add_argument("--hf-tokenizer", action="store_true", help="tokenize with HF's tokenizer")
    args = p.parse_args()
    for name in corpora.CORPORA:
        corpora.fetch_corpus(name, progress=lambda s: None)
    encode = hf_encoder(args.model) if args.hf_tokenizer else jaxdec_encoder(args.model)
    if args.tokens_only:
        for name in corpora.CORPORA:
            n = corpora.corpus_token_ids(name, encode).shape[0]
            print(f"{args.model} {name}: {n:,} tokens ({corpora.corpus_source(name)})")
        return
    score = hf_score_fn(args.model)
    start = time.perf_counter()
    result = evaluate(score, encode, args.corpus, window=args.window,
                      max_windows=args.max_windows, split=args.split,
                      batch_size=args.batch_size)
    wall = time.perf_counter() - start
    print(f"HF transformers {torch.__version__} f32, {args.model}: {result}")
    print(f"wall {wall:.1f} s ({wall / result.n_windows:.2f} s/window, "
          f"torch threads {torch.get_num_threads()})")


if __name__ == "__main__":
    main()
