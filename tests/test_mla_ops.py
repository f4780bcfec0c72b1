"""Multi-head latent attention (jaxdec.models.mla) against HF transformers' DeepseekV3Attention:
expanded and absorbed forms, YaRN RoPE, query LoRA or not, prefill then decode from latents."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxdec import layers
from jaxdec.config import MLAConfig, ModelConfig, RopeScaling
from jaxdec.models import mla

import torch  # noqa: E402  (the test extra installs it)

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def _hf(q_lora_rank, rope, interleave, seed):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3Attention,
                                                                      DeepseekV3RotaryEmbedding)

    hf_cfg = DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                              q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8,
                              qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=128,
                              rope_parameters=dict(rope), rope_interleave=interleave,
                              attention_bias=False, rms_norm_eps=1e-6)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    attn = DeepseekV3Attention(hf_cfg, 0).eval()
    with torch.no_grad():
        for prm in attn.parameters():
            prm.copy_(torch.randn_like(prm) * (0.3 if prm.ndim > 1 else 1.0))
    rotary = DeepseekV3RotaryEmbedding(hf_cfg)
    t = lambda lin: jnp.asarray(lin.weight.detach().numpy().T)
    n, qk = 4, 16
    params = mla.MLAParams(
        q=None if q_lora_rank else t(attn.q_proj).reshape(64, n, qk),
        q_a=t(attn.q_a_proj) if q_lora_rank else None,
        q_a_norm=jnp.asarray(attn.q_a_layernorm.weight.detach().numpy()) if q_lora_rank else None,
        q_b=t(attn.q_b_proj).reshape(q_lora_rank, n, qk) if q_lora_rank else None,
        kv_a=t(attn.kv_a_proj_with_mqa), kv_a_norm=jnp.asarray(attn.kv_a_layernorm.weight.detach().numpy()),
        kv_b=t(attn.kv_b_proj).reshape(16, n, 20), o=t(attn.o_proj).reshape(n, 12, 64))
    cfg = ModelConfig(vocab_size=10, d_model=64, n_layers=1, n_heads=4, n_kv_heads=4, head_dim=16,
                      d_ff=8, norm_eps=1e-6, rope_theta=rope["rope_theta"], rope_scaling=_yarn(rope),
                      layer_types=("mla",),
                      mla=MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                                    q_lora_rank=q_lora_rank, rope_interleave=interleave))
    return attn, rotary, params, cfg


def _yarn(rope):
    if rope["rope_type"] != "yarn":
        return None
    return RopeScaling(kind="yarn", factor=rope["factor"],
                       original_max_position=rope["original_max_position_embeddings"],
                       beta_fast=rope["beta_fast"], beta_slow=rope["beta_slow"], mscale=rope["mscale"],
                       mscale_all_dim=rope["mscale_all_dim"])


def _hf_forward(attn, rotary, x, start: int):
    b, t, _ = x.shape
    pos = torch.arange(start, start + t)[None].expand(b, t)
    cos, sin = rotary(torch.from_numpy(x), pos)
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None].expand(b, 1, t, t)
    with torch.no_grad():
        return attn(torch.from_numpy(x), (cos, sin), attention_mask=mask)[0].numpy()


CASES = [(24, YARN, True), (None, YARN, True), (None, {"rope_type": "default", "rope_theta": 500.0}, False)]


@pytest.mark.parametrize("q_lora_rank,rope,interleave", CASES)
def test_prefill_and_absorbed_decode_match_hf(q_lora_rank, rope, interleave):
    attn, rotary, p, cfg = _hf(q_lora_rank, rope, interleave, seed=1)
    x = np.random.default_rng(2).standard_normal((2, 11, 64)).astype(np.float32)
    ref = _hf_forward(attn, rotary, x, start=0)
    scale = np.abs(ref).max()
    pos = jnp.broadcast_to(jnp.arange(11), (2, 11))
    q_nope, q_rope = mla.queries(p, x, pos, cfg)
    c, k_rope = mla.latents(p, x, pos, cfg)
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((11, 11), bool)), (2, 11, 11))
    for absorbed in (False, True):
        out = mla.attend(p, q_nope, q_rope, [(c, k_rope, causal)], cfg, absorbed=absorbed)
        np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-4 * scale)
    # decode: each new token attends to the cached latents of all earlier ones (absorbed form)
    for i in range(7, 11):
        qn, qr = mla.queries(p, x[:, i:i + 1], pos[:, i:i + 1], cfg)
        out = mla.attend(p, qn, qr, [(c[:, :i], k_rope[:, :i], jnp.ones((2, 1, i), bool)),
                                     (c[:, i:i + 1], k_rope[:, i:i + 1], jnp.ones((2, 1, 1), bool))],
                         cfg, absorbed=True)
        np.testing.assert_allclose(np.asarray(out)[:, 0], ref[:, i], rtol=1e-4, atol=1e-4 * scale)


def test_yarn_frequencies_match_hf():
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for rope in (YARN, {**YARN, "mscale": 0.7, "factor": 40.0, "beta_fast": 16.0}):
        hf_cfg = DeepseekV3Config(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=16,
                                  max_position_embeddings=4096, rope_parameters=dict(rope))
        inv_hf, attn_hf = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
        y = _yarn(rope)
        inv, attn_factor = layers.rope_inv_freq(16, rope["rope_theta"], y), y.attention_factor
        np.testing.assert_allclose(inv, inv_hf.numpy(), rtol=1e-6)
        assert attn_factor == pytest.approx(attn_hf, rel=1e-6)

