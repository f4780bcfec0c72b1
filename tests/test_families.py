"""The MoE, MLA and Mamba2 families loaded from tiny random HF checkpoints (built offline with
`save_pretrained`): logits and greedy continuations against HF transformers' PyTorch models,
prefill-then-decode against the full forward (also for a hybrid of every kind of layer), the
orbax round trip, cache sizes, and errors for bad configs and checkpoints."""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import torch  # noqa: F401,E402  (the test extra installs it; HF needs it)

import jaxdec  # noqa: E402
from jaxdec import api, decode, pytree  # noqa: E402
from jaxdec.cache import dense  # noqa: E402
from jaxdec.config import MambaConfig, MLAConfig, ModelConfig, MoEConfig, RopeScaling  # noqa: E402
from jaxdec.models import transformer  # noqa: E402

import tiny_families as tf  # noqa: E402
from conftest import assert_one_line_error  # noqa: E402
from tiny_hf import rel_err  # noqa: E402

FAMILIES = sorted(tf.FAMILIES)


@functools.lru_cache(maxsize=None)
def _saved(name: str):
    """(HF model, checkpoint dir, jaxdec model) of a family, built once per session."""
    import tempfile

    path = pathlib.Path(tempfile.mkdtemp(prefix=f"jaxdec-{name}-"))
    model = tf.save(name, path, seed=FAMILIES.index(name) + 11)
    return model, path, jaxdec.load(str(path))


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_hf(name):
    hf, _, ours = _saved(name)
    tokens = np.random.default_rng(1).integers(0, tf.VOCAB, (2, 23))
    err = rel_err(jaxdec.score(ours, tokens), tf.hf_logits(hf, tokens))
    print(f"{name}: logits relative error {err:.2e} against HF")  # shown with pytest -s
    assert err <= 1e-4, err


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_32_tokens_match_hf_generate(name):
    hf, _, ours = _saved(name)
    prompt = np.random.default_rng(2).integers(0, tf.VOCAB, (2, 7))
    ref = tf.hf_greedy(hf, prompt, 32)
    out = api.generate_ids(ours, prompt.tolist(), max_new_tokens=32, stop_ids=())
    np.testing.assert_array_equal(np.array(out.token_ids), ref)


def _hybrid_of_every_kind():
    """A jaxdec-only config whose layers mix every mixer and feed-forward, and its params."""
    cfg = ModelConfig(
        arch="hybrid", vocab_size=97, d_model=48, n_layers=8, n_heads=4, n_kv_heads=2,
        head_dim=12, d_ff=64, norm_eps=1e-5, rope_scaling=RopeScaling(
            kind="yarn", factor=4.0, original_max_position=16, mscale=1.0, mscale_all_dim=0.7),
        layer_types=("mamba+mlp", "mla+moe", "attention+moe", "mlp", "mamba", "attention",
                     "moe", "mla"),
        mla=MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
        moe=MoEConfig(n_experts=6, top_k=2, d_expert=16, router="sigmoid", normalize=True,
                      scale=1.7, n_group=3, topk_group=2, router_bias=True, d_shared=24),
        mamba=MambaConfig(n_heads=6, head_dim=8, n_groups=2, d_state=8, chunk=4))
    params = pytree.init_params(transformer.declare(cfg), jax.random.key(3))
    # random norms, biases and Mamba decays instead of ones and zeros
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(4), len(leaves))
    leaves = [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    return cfg, jax.tree.unflatten(tree, leaves)


@pytest.mark.parametrize("name", FAMILIES + ["hybrid-of-every-kind"])
def test_prefill_then_decode_equals_full_forward(name):
    """Ragged prompts (13 and 8 tokens) prefilled, then 6 teacher-forced decode steps: every
    step's logits equal the full forward's at that position."""
    if name == "hybrid-of-every-kind":
        cfg, params = _hybrid_of_every_kind()
    else:
        model = _saved(name)[2]
        cfg, params = model.cfg, model.params
    rng = np.random.default_rng(5)
    seq = rng.integers(0, cfg.vocab_size, (2, 19)).astype(np.int32)
    lens = np.array([13, 8], np.int32)
    full = np.asarray(jax.jit(transformer.forward, static_argnames="cfg")(
        params, seq, np.broadcast_to(np.arange(19, dtype=np.int32), (2, 19)), None, cfg=cfg)[0])
    cache = dense.init_cache(cfg, 2, 32)
    prompts = np.where(np.arange(13)[None] < lens[:, None], seq[:, :13], 0)
    logits, cache = jax.jit(decode.prefill, static_argnames="cfg")(params, cache, prompts, lens, cfg=cfg)
    scale = np.abs(full).max()
    for b in range(2):
        np.testing.assert_allclose(np.asarray(logits)[b], full[b, lens[b] - 1], rtol=1e-4, atol=1e-4 * scale)
    step = jax.jit(transformer.forward, static_argnames="cfg")
    for i in range(6):
        tokens = seq[np.arange(2), lens + i][:, None]
        logits, cache = step(params, tokens, (lens + i)[:, None], cache, cfg=cfg)
        for b in range(2):
            np.testing.assert_allclose(np.asarray(logits)[b, 0], full[b, lens[b] + i], rtol=1e-4,
                                       atol=1e-4 * scale, err_msg=f"step {i} row {b}")


@pytest.mark.parametrize("name", ["deepseek_v3", "nemotron_h"])
def test_convert_to_orbax_and_back(name, tmp_path):
    _, _, model = _saved(name)
    restored = jaxdec.load(str(jaxdec.save(model, tmp_path / "ckpt")))
    assert restored.cfg == model.cfg
    tokens = np.random.default_rng(6).integers(0, tf.VOCAB, (1, 12))
    np.testing.assert_array_equal(jaxdec.score(restored, tokens), jaxdec.score(model, tokens))


@pytest.mark.parametrize("name", ["qwen3_moe", "nemotron_h"])
def test_quantised_and_bf16_loads_run_close(name):
    hf, path, _ = _saved(name)
    tokens = np.random.default_rng(7).integers(0, tf.VOCAB, (1, 16))
    ref = tf.hf_logits(hf, tokens)
    for kw in (dict(weights="int8"), dict(dtype="bfloat16")):
        err = rel_err(jaxdec.score(jaxdec.load(str(path), **kw), tokens), ref)
        assert err < 3e-2, (kw, err)


def test_cache_bytes_per_token_and_constant_mamba_state():
    """At one model width (D = 1024, 16 heads of 64): MHA 2*16*64, GQA (4 kv heads) 2*4*64,
    MLA (latent 256 + rope 32) and Mamba (nothing per token) values per layer per token."""
    base = dict(vocab_size=100, d_model=1024, n_layers=1, n_heads=16, head_dim=64, d_ff=64)
    kinds = {
        "MHA": ModelConfig(**base, n_kv_heads=16),
        "GQA": ModelConfig(**base, n_kv_heads=4),
        "MLA": ModelConfig(**base, n_kv_heads=16, layer_types=("mla",), mla=MLAConfig(
            kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64)),
        "Mamba": ModelConfig(**base, n_kv_heads=16, layer_types=("mamba",), mamba=MambaConfig(
            n_heads=32, head_dim=64, n_groups=1, d_state=128)),
    }
    grow = {k: dense.bytes_per_token(c, jnp.bfloat16)[0] for k, c in kinds.items()}
    assert grow == {"MHA": 2 * 16 * 64 * 2, "GQA": 2 * 4 * 64 * 2, "MLA": (256 + 32) * 2, "Mamba": 0}
    nbytes = lambda c: sum(x.nbytes for x in jax.tree.leaves(c.layers))
    mamba = kinds["Mamba"]
    assert nbytes(dense.init_cache(mamba, 1, 64)) == nbytes(dense.init_cache(mamba, 1, 8192))
    assert dense.bytes_per_token(mamba)[1] == (3 * (2048 + 2 * 128) * 4 + 32 * 64 * 128 * 4)


# ---- bad input ---------------------------------------------------------------------------------


def _copy(name: str, dst: pathlib.Path) -> pathlib.Path:
    import shutil

    shutil.copytree(_saved(name)[1], dst)
    return dst


def _one_line_error(path, match: str):
    assert_one_line_error(jaxdec.load, str(path), match=match)


def _edit_config(path: pathlib.Path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **changes}))


def _drop_tensor(path: pathlib.Path, name: str):
    import safetensors.numpy as stn

    tensors = stn.load_file(str(path / "model.safetensors"))
    del tensors[name]
    stn.save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_missing_expert_tensor_is_named(tmp_path):
    d = _copy("qwen2_moe", tmp_path / "m")
    _drop_tensor(d, "model.layers.2.mlp.experts.5.up_proj.weight")
    _one_line_error(d, r"missing 1 tensor\(s\): 'model.layers.2.mlp.experts.5.up_proj.weight'")


def test_missing_mamba_tensor_is_named(tmp_path):
    d = _copy("nemotron_h", tmp_path / "m")
    _drop_tensor(d, "backbone.layers.3.mixer.A_log")
    _one_line_error(d, "'backbone.layers.3.mixer.A_log'")


def test_config_inconsistent_with_tensor_shapes_names_the_tensor(tmp_path):
    d = _copy("deepseek_v3", tmp_path / "m")
    _edit_config(d, kv_lora_rank=12)
    _one_line_error(d, r"tensor 'model.layers.0.self_attn.kv_a_layernorm.weight' has shape \(16,\), "
                       r"expected \(12,\) from the config")


def test_inconsistent_configs(tmp_path):
    d = _copy("mamba2", tmp_path / "m")
    _edit_config(d, head_dim=4)
    _one_line_error(d, "num_heads \\* head_dim = 32 differs from expand \\* hidden_size = 64")
    d = _copy("nemotron_h", tmp_path / "n")
    _edit_config(d, hybrid_override_pattern="M*-X", layers_block_type=None)
    _one_line_error(d, "unknown layer letters \\['X'\\]")
    _edit_config(d, hybrid_override_pattern="M*-ME", n_group=3)
    _one_line_error(d, "8 experts do not split into 3 groups")
    _edit_config(d, n_group=1, mamba_num_heads=5)
    _one_line_error(d, "5 Mamba heads do not split into 2 groups")
    d = _copy("qwen3_moe", tmp_path / "q")
    _edit_config(d, num_experts_per_tok=9)
    _one_line_error(d, "top_k=9 experts per token is not in 1..8")
    _edit_config(d, num_experts_per_tok=None)
    _one_line_error(d, "config.json: missing field 'num_experts_per_tok'")
    d = _copy("deepseek_v3", tmp_path / "d")
    _edit_config(d, kv_lora_rank=None)
    _one_line_error(d, "config.json: missing field 'kv_lora_rank'")
    with pytest.raises(ValueError, match="layer 1 is 'mla' but the config has no mla settings"):
        ModelConfig(vocab_size=9, d_model=8, n_layers=2, n_heads=2, n_kv_heads=2, head_dim=4,
                    d_ff=8, layer_types=("attention+mlp", "mla"))
    with pytest.raises(ValueError, match="unknown layer type 'moe\\+mla'"):
        dataclasses.replace(ModelConfig(vocab_size=9, d_model=8, n_layers=1, n_heads=2, n_kv_heads=2,
                                        head_dim=4, d_ff=8), layer_types=("moe+mla",))
