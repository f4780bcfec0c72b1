"""Tiny random Hugging Face checkpoints of the MoE, MLA and Mamba families, built offline
(transformers config -> random model -> `save_pretrained`), with a word-level tokenizer."""

from __future__ import annotations

import pathlib

import numpy as np
import torch
import transformers as T

from tiny_hf import hf_logits  # noqa: F401  (re-exported: one HF forward for every tiny model)

VOCAB = 128

_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
         "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0,
         "mscale": 1.0, "mscale_all_dim": 1.0}

# name -> (config class, model class, config kwargs)
FAMILIES = {
    "deepseek_v3": (T.DeepseekV3Config, T.DeepseekV3ForCausalLM, dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1,
        routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=12, rope_parameters=_YARN, max_position_embeddings=128)),
    "qwen2_moe": (T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM, dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
        shared_expert_intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "qwen3_moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True)),
    "mixtral": (T.MixtralConfig, T.MixtralForCausalLM, dict(
        hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
    "mamba2": (T.Mamba2Config, T.Mamba2ForCausalLM, dict(
        hidden_size=32, num_hidden_layers=2, num_heads=8, head_dim=8, n_groups=2, state_size=16,
        expand=2, chunk_size=8, tie_word_embeddings=True)),
    "nemotron_h": (T.NemotronHConfig, T.NemotronHForCausalLM, dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=5, hybrid_override_pattern="M*-ME",
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, mamba_num_heads=8,
        mamba_head_dim=8, n_groups=2, ssm_state_size=16, chunk_size=8, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24,
        n_group=1, topk_group=1, routed_scaling_factor=1.5)),
}


def word_tokenizer(path: pathlib.Path, vocab: int = VOCAB) -> None:
    """A word-level tokenizer.json of `vocab` tokens ("w0", "w1", ...) into `path`."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


def build(name: str, seed: int = 0):
    """A random HF model of family `name` in eval mode. HF's init leaves norms at 1, biases at
    0 and the Mamba decays at fixed values; every parameter and buffer is perturbed."""
    cfg_cls, model_cls, kwargs = FAMILIES[name]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(vocab_size=VOCAB, **kwargs)).eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.3)
    model.generation_config.eos_token_id = None  # greedy runs its full length
    return model


def save(name: str, path: pathlib.Path, seed: int = 0):
    """`build` the model, `save_pretrained` it with a tokenizer into `path`; returns the model."""
    model = build(name, seed)
    model.save_pretrained(path)
    word_tokenizer(path)
    return model


def hf_greedy(model, prompt: np.ndarray, n: int) -> np.ndarray:
    with torch.no_grad():
        out = model.generate(torch.as_tensor(prompt), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[:, prompt.shape[1]:].numpy()
