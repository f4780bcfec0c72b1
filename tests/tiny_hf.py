"""Tiny random Hugging Face checkpoints of the Llama family, built offline in the tests."""

from __future__ import annotations

import numpy as np
import torch
import transformers

from jaxdec.config import ModelConfig, RopeScaling
from jaxdec.checkpoint import hf_layout

VOCAB, D, LAYERS, HEADS, KV_HEADS, FFN = 300, 64, 3, 4, 2, 96
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def build(arch: str, seed: int = 0):
    """(HF model in eval mode, matching jaxdec ModelConfig, jaxdec Params).

    llama: tied embeddings + llama3 RoPE scaling; qwen2: QKV bias + untied head. Weights are
    perturbed away from HF's init so that norms and biases are not all ones/zeros.
    """
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=FFN,
                  num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, max_position_embeddings=512)
    if arch == "llama":
        hc = transformers.LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=True,
                                      rope_scaling=LLAMA3_SCALING)
        model = transformers.LlamaForCausalLM(hc)
    else:
        hc = transformers.Qwen2Config(**common, rope_theta=1e6, tie_word_embeddings=False)
        model = transformers.Qwen2ForCausalLM(hc)
    model.eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    cfg = ModelConfig(
        arch=arch, vocab_size=VOCAB, d_model=D, n_layers=LAYERS, n_heads=HEADS,
        n_kv_heads=KV_HEADS, head_dim=D // HEADS, d_ff=FFN, norm_eps=hc.rms_norm_eps,
        rope_theta=10000.0 if arch == "llama" else 1e6, tie_embeddings=arch == "llama",
        qkv_bias=arch == "qwen2", max_position=512, eos_ids=(VOCAB - 1,),
        rope_scaling=RopeScaling(factor=8.0, original_max_position=64) if arch == "llama" else None,
    )
    tensors = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return model, cfg, hf_layout.params_from_hf(cfg, tensors)


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.float().numpy()


def rel_err(a, b) -> float:
    """Relative error under the Frobenius norm over the whole logits tensor."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def byte_tokenizer():
    """A byte-level BPE without merges: every text encodes, ids < 256 <= the tiny vocab."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    from jaxdec.checkpoint.tokenizer import Tokenizer

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend = tokenizers.Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(alphabet))}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend=backend)


def save_tiny_checkpoint(path, seed: int = 6):
    """The tiny Llama saved at `path` as a jaxdec checkpoint with `byte_tokenizer` (a target
    for the CLI and the scripts); returns `path`."""
    from jaxdec import api

    _, cfg, params = build("llama", seed=seed)
    api.save(api.Model(cfg=cfg, params=params, tokenizer=byte_tokenizer(), source="tiny"), path)
    return path
