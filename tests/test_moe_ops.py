"""MoE building blocks (jaxdec.models.moe) against HF transformers' Qwen2-MoE and
DeepSeek-V3 blocks and a float64 per-token reference of dropless dispatch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdec
from jaxdec.models import moe

import torch  # noqa: E402  (the test extra installs it)


def _randomize(module, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3)


def _experts_from_hf(hf_experts) -> moe.Experts:
    gate_up = hf_experts.gate_up_proj.detach().numpy()  # [E, 2F, D]
    f = gate_up.shape[1] // 2
    return moe.Experts(w_gate=jnp.asarray(gate_up[:, :f].transpose(0, 2, 1)),
                       w_up=jnp.asarray(gate_up[:, f:].transpose(0, 2, 1)),
                       w_down=jnp.asarray(hf_experts.down_proj.detach().numpy().transpose(0, 2, 1)))


def _mlp(m):
    t = lambda lin: jnp.asarray(lin.weight.detach().numpy().T)
    return t(m.gate_proj), t(m.up_proj), t(m.down_proj)


def test_qwen2_moe_block_matches_hf():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    cfg = Qwen2MoeConfig(hidden_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                         num_experts=8, num_experts_per_tok=3, norm_topk_prob=False)
    block = Qwen2MoeSparseMoeBlock(cfg).eval()
    _randomize(block, 1)
    x = np.random.default_rng(2).standard_normal((2, 7, 32)).astype(np.float32)
    with torch.no_grad():
        ref = block(torch.from_numpy(x)).numpy().reshape(14, 32)
    xs = jnp.asarray(x.reshape(14, 32))
    router = jnp.asarray(block.gate.weight.detach().numpy().T)
    w, idx = moe.route_softmax(xs @ router, 3, normalize=False)
    ours = moe.experts_dropless(xs, idx, w, _experts_from_hf(block.experts))
    ours = ours + moe.shared_expert(xs, *_mlp(block.shared_expert),
                                    gate=jnp.asarray(block.shared_expert_gate.weight.detach().numpy().T))
    np.testing.assert_allclose(np.asarray(ours), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_deepseek_v3_moe_block_matches_hf():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = DeepseekV3Config(hidden_size=32, moe_intermediate_size=16, n_routed_experts=16,
                           num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
                           norm_topk_prob=True, routed_scaling_factor=2.5)
    block = DeepseekV3MoE(cfg).eval()
    _randomize(block, 3)
    with torch.no_grad():
        block.gate.e_score_correction_bias.copy_(torch.randn(16) * 0.5)
    x = np.random.default_rng(4).standard_normal((3, 5, 32)).astype(np.float32)
    with torch.no_grad():
        ref = block(torch.from_numpy(x)).numpy().reshape(15, 32)
    xs = jnp.asarray(x.reshape(15, 32))
    router = jnp.asarray(block.gate.weight.detach().numpy().T)
    bias = jnp.asarray(block.gate.e_score_correction_bias.numpy())
    w, idx = moe.route_grouped_sigmoid(xs @ router, bias, 4, 4, 2, True, 2.5)
    ours = moe.experts_dropless(xs, idx, w, _experts_from_hf(block.experts))
    ours = ours + moe.shared_expert(xs, *_mlp(block.shared_experts))
    np.testing.assert_allclose(np.asarray(ours), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_grouped_routing_stays_in_the_best_groups():
    rng = np.random.default_rng(5)
    logits = jnp.asarray(rng.standard_normal((50, 16)).astype(np.float32))
    bias = jnp.asarray(rng.standard_normal(16).astype(np.float32) * 0.3)
    _, idx = moe.route_grouped_sigmoid(logits, bias, 3, 4, 2, False, 1.0)
    choice = 1 / (1 + np.exp(-np.asarray(logits, np.float64))) + np.asarray(bias)
    group_score = np.sort(choice.reshape(50, 4, 4), axis=-1)[..., -2:].sum(-1)
    best = np.argsort(-group_score, axis=1)[:, :2]
    for n in range(50):
        assert set(np.asarray(idx[n]) // 4) <= set(best[n])


@pytest.mark.parametrize("gated", [True, False])
def test_every_dispatch_equals_per_token_reference_even_when_one_expert_takes_all(gated):
    """float64 per-token reference for both dispatches (grouped matmuls over the sorted pairs,
    gathered experts read in place); SwiGLU and squared-ReLU experts. With every token routed to expert 0 (a skewed load a capacity-limited dispatch
    would drop) nothing is lost."""
    rng = np.random.default_rng(6)
    n, d, f, e, k = 12, 8, 6, 5, 2
    x = rng.standard_normal((n, d)).astype(np.float32)
    g, u, dn = (rng.standard_normal(s).astype(np.float32) * 0.4 for s in ((e, d, f), (e, d, f), (e, f, d)))
    p = moe.Experts(w_gate=jnp.asarray(g) if gated else None, w_up=jnp.asarray(u), w_down=jnp.asarray(dn))
    g, u, dn = (np.asarray(a, np.float64) for a in (g, u, dn))
    for idx in (rng.integers(0, e, (n, k)), np.stack([np.zeros(n, int), rng.integers(1, e, n)], 1)):
        w = rng.random((n, k)).astype(np.float32)
        ref = np.zeros((n, d))
        for i in range(n):
            for j in range(k):
                ex = idx[i, j]
                up = x[i] @ u[ex]
                if gated:
                    a = x[i] @ g[ex]
                    h = (a / (1 + np.exp(-a))) * up
                else:
                    h = np.maximum(up, 0) ** 2
                ref[i] += w[i, j] * h @ dn[ex]
        for fn in (moe.experts_dropless, moe.experts_gathered):
            ours = np.asarray(jax.jit(fn)(x, jnp.asarray(idx, jnp.int32), w, p))
            np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5, err_msg=fn.__name__)


def test_ragged_matmul_kernel_equals_grouped_reference():
    """cpu_kernel.ragged_matmul against float64 per group: empty groups, one group taking
    most rows, rows past the groups zero; f32 and bf16 weights; bad group sizes fail."""
    from jaxdec.ops import cpu_kernel

    rng = np.random.default_rng(10)
    for sizes in ([0, 7, 0, 30, 3], [40, 0, 0, 0, 0], [1, 1, 1, 1, 1]):
        r, k, n = 41, 96, 80
        x = rng.standard_normal((r, k)).astype(np.float32)
        for dtype in (jnp.float32, jnp.bfloat16):
            w = jnp.asarray(rng.standard_normal((5, k, n)).astype(np.float32), dtype)
            w64 = np.asarray(w.astype(jnp.float32), np.float64)
            x64 = x.astype(np.float64)
            if dtype == jnp.bfloat16 and cpu_kernel.has_amx():  # AMX rounds rows to bf16 from 16
                x64 = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)
            ref, row = np.zeros((r, n)), 0
            for e, size in enumerate(sizes):
                ref[row:row + size] = x64[row:row + size] @ w64[e]
                row += size
            ours = np.asarray(jax.jit(cpu_kernel.ragged_matmul)(x, w, np.array(sizes, np.int32)))
            tol = 1e-4 if dtype == jnp.float32 else 2e-2
            np.testing.assert_allclose(ours, ref, rtol=tol, atol=tol * np.abs(ref).max())
    if cpu_kernel.available():
        with pytest.raises(Exception, match="group sizes exceed the rows"):
            np.asarray(jax.jit(cpu_kernel.ragged_matmul)(x, w, np.array([40, 40, 0, 0, 0], np.int32)))


def test_expert_matmul_kernel_reads_the_chosen_experts():
    """cpu_kernel.expert_matmul (the C++ kernel on this CPU) against float64, f32 and bf16
    weights, several rows per slot; an index out of range fails instead of reading past w."""
    from jaxdec.ops import cpu_kernel

    rng = np.random.default_rng(9)
    # few rows per slot (decode: one pool job over every slot's columns), and many (per slot)
    for s, m, k, n, e in ((7, 1, 576, 200, 8), (7, 3, 40, 24, 5), (4, 20, 64, 48, 3)):
        x = rng.standard_normal((s, m, k)).astype(np.float32)
        idx = rng.integers(0, e, s).astype(np.int32)
        for dtype in (jnp.float32, jnp.bfloat16):
            w = jnp.asarray(rng.standard_normal((e, k, n)).astype(np.float32), dtype)
            w64 = np.asarray(w.astype(jnp.float32), np.float64)
            x64 = x.astype(np.float64)
            if dtype == jnp.bfloat16 and m >= 16 and cpu_kernel.has_amx():  # AMX rounds x to bf16
                x64 = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)
            ref = np.einsum("smk,skn->smn", x64, w64[idx])
            ours = np.asarray(jax.jit(cpu_kernel.expert_matmul)(x, w, idx))
            np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    if cpu_kernel.available():
        with pytest.raises(Exception, match="expert index out of range"):
            np.asarray(jax.jit(cpu_kernel.expert_matmul)(x, w, np.full(x.shape[0], e, np.int32)))


def test_moefied_smollm2_mlp_with_all_experts_is_the_dense_mlp():
    """SmolLM2's layer-5 MLP split into 8 experts (neurons in a random order): all experts at
    weight 1 give the dense MLP's output; dropping experts changes it."""
    from conftest import jax_model
    from jaxdec import layers

    lp = jax_model("smollm2").params.layers[5].ffn
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((9, lp.w_gate.shape[0])).astype(np.float32))
    order = rng.permutation(lp.w_gate.shape[1])
    ex = moe.moefy(lp.w_gate, lp.w_up, lp.w_down, 8, order=order)
    assert ex.w_gate.shape == (8, 576, 192) and ex.w_down.shape == (8, 192, 576)
    dense = np.asarray(layers.gated_mlp(x, lp.w_gate, lp.w_up, lp.w_down))
    all_on = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (9, 8))
    ours = np.asarray(moe.experts_dropless(x, all_on, jnp.ones((9, 8)), ex))
    np.testing.assert_allclose(ours, dense, rtol=1e-5, atol=1e-5 * np.abs(dense).max())
    half = np.asarray(moe.experts_dropless(x, all_on[:, :4], jnp.ones((9, 4)), ex))
    assert np.abs(half - dense).max() > 1e-2 * np.abs(dense).max()
    with pytest.raises(ValueError, match="do not split"):
        moe.moefy(lp.w_gate, lp.w_up, lp.w_down, 7)


def test_moefied_smollm2_with_all_experts_is_smollm2():
    """SmolLM2 MoEfied (neurons clustered, routers fitted on prose calibration windows, 192
    always-on shared neurons): all 8 experts active gives SmolLM2's logits (to float32
    rounding: the MLP's products are summed in 9 groups) and its greedy tokens; 2 active
    experts run the same loop with fewer expert reads and change the logits. (Without shared
    neurons the same code runs with an empty shared set: scripts/moe_curve.py.)"""
    n_shared = 192
    import dataclasses

    from conftest import jax_model
    from jaxdec import api, corpora
    from jaxdec.models import moefy

    dense = jax_model("smollm2")
    ids = corpora.corpus_token_ids("prose", dense.tokenizer.encode)
    calib = np.asarray(corpora.make_windows(ids, window=64, split="calib", max_windows=4))
    cfg, params = moefy.moefy_model(dense.params, dense.cfg, calib, n_experts=8, top_k=8,
                                    n_shared=n_shared)
    assert cfg.layer_types == ("attention+moe",) * 30 and cfg.moe.d_expert == (1536 - n_shared) // 8
    full = dataclasses.replace(dense, cfg=cfg, params=params)
    tokens = np.asarray(corpora.make_windows(ids, window=48, split="eval", max_windows=2))
    ref, ours = api.score(dense, tokens), api.score(full, tokens)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    prompt = [tokens[0, :12].tolist()]
    assert (api.generate_ids(full, prompt, max_new_tokens=12, stop_ids=()).token_ids
            == api.generate_ids(dense, prompt, max_new_tokens=12, stop_ids=()).token_ids)
    two = api.with_active_experts(full, 2)
    assert np.abs(api.score(two, tokens) - ref).max() > 1e-2 * np.abs(ref).max()
    with pytest.raises(jaxdec.JaxdecError, match="active experts must be 1..8"):
        api.with_active_experts(full, 9)
    with pytest.raises(jaxdec.JaxdecError, match="has no experts"):
        api.with_active_experts(dense, 2)
