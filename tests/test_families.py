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
from jaxdec.checkpoint import hf_layout  # noqa: E402
from jaxdec.formats import QArray, dequantize, dfloat11  # noqa: E402
from jaxdec.models import moe, transformer  # noqa: E402
from jaxdec.ops import cpu_kernel  # noqa: E402
from jaxdec.pytree import is_spec  # noqa: E402

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


# ---- weight formats on the MoE and MLA families ---------------------------------------------

MOE_FAMILIES = [n for n in FAMILIES if n != "mamba2"]  # (every family with experts)
# The format's error against HF's float32 logits, measured on these checkpoints over 16
# draws of 2 x 16 random tokens: (lowest, highest) median over tokens of the per-token
# relative error (int8 0.9-1.7e-2, int4 0.14-0.24, bf16 0.6-1.4e-2, int8 weights with
# bf16 activations 1.2-2.3e-2; float32 weights give ~4e-7, so the lower bound says the
# weights really were rounded), and the highest relative error over the whole tensor,
# where a rounded router logit may send a token to another expert (up to 7e-2 measured
# for int8 and bf16; int4 0.25). Bounds are the measured ranges with margin.
FORMAT_ERROR = {"int8": (4e-3, 2.5e-2, 0.1), "int4": (7e-2, 0.35, 0.4),
                "bf16": (2e-3, 2e-2, 0.1), "int8+bf16": (4e-3, 3.5e-2, 0.1)}
is_q = lambda x: isinstance(x, QArray)


@functools.lru_cache(maxsize=None)
def _loaded(name: str, weights: str, dtype: str = "float32"):
    return jaxdec.load(str(_saved(name)[1]), weights=weights, dtype=dtype)


def _format_error(ours, ref, fmt: str) -> str:
    """Check `ours` against HF's `ref` logits for the bounds of `fmt`; a line to print."""
    a, b = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    per_token = np.median(np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1))
    whole = rel_err(a, b)
    lo, hi, whole_hi = FORMAT_ERROR[fmt]
    assert lo < per_token < hi and whole < whole_hi, (fmt, per_token, whole)
    return f"relative error {per_token:.2e} per token (median), {whole:.2e} in all, against HF"


def _matmul_weights(model):
    """(path, declaration, weight) of every declared matmul weight (`n_in`) of `model`."""
    decl = jax.tree_util.tree_flatten_with_path(transformer.declare(model.cfg), is_leaf=is_spec)[0]
    params = dict(jax.tree_util.tree_flatten_with_path(model.params, is_leaf=is_q)[0])
    return [(hf_layout._path(path), spec, params[path]) for path, spec in decl
            if spec.n_in is not None]


def _hf_on_stored_weights(model, name: str, dst: pathlib.Path):
    """HF's model of `name` with every quantised weight of `model` replaced by the values it
    stores (dequantised, written back into HF's [out, in] tensors of the checkpoint)."""
    import shutil

    import safetensors.numpy as stn

    shutil.copytree(_saved(name)[1], dst)
    tensors = stn.load_file(str(dst / "model.safetensors"))
    table = hf_layout.layout(model.cfg)
    for path, _, w in _matmul_weights(model):
        src, v = table[path], np.asarray(dequantize(w), np.float32)
        assert src.kind in ("linear", "experts"), (path, src)
        mats = [v.reshape(w.k, w.n).T] if src.kind == "linear" else [e.reshape(w.k, w.n).T for e in v]
        for hf_name, m in zip(src.names, mats):
            rows = slice(*src.part) if src.part else slice(None)  # (Mamba's fused in_proj)
            assert tensors[hf_name][rows].shape == m.shape, hf_name
            tensors[hf_name] = tensors[hf_name].copy()
            tensors[hf_name][rows] = m
    stn.save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return tf.FAMILIES[name][1].from_pretrained(dst).eval()


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_quantized_weights_stay_within_the_formats_error_of_hf(name, weights, tmp_path):
    """int8/int4 loads of the MoE and MLA checkpoints: every matmul weight is a QArray of
    that width (each MoE expert stack one per expert, MLA's q_a, q_b, kv_a, kv_b and o too);
    the logits are HF's up to the format's error, and HF's own model run on the weights
    the QArrays store gives the same logits up to float32 rounding and the same greedy
    tokens."""
    hf = _saved(name)[0]
    model = _loaded(name, weights)
    bits = int(weights[3:])
    assert model.weights == weights
    found = _matmul_weights(model)
    for path, spec, w in found:
        assert is_q(w) and w.bits == bits, (path, type(w).__name__)
        assert (w.shape, w.n_in, w.n_batch) == (spec.shape, spec.n_in, spec.n_batch), path
    kinds = model.cfg.kinds
    experts = [p for p, s, _ in found if ".experts." in p]
    assert len(experts) == (2 if model.cfg.mlp_act == "relu2" else 3) * sum(f == "moe" for _, f in kinds)
    assert all(w.n_batch == 1 for p, _, w in found if p in experts)
    if name == "deepseek_v3":
        mla = {p.rsplit(".", 1)[1] for p, _, _ in found if ".mixer." in p}
        assert mla == {"q_a", "q_b", "kv_a", "kv_b", "o"}, mla

    rng = np.random.default_rng(FAMILIES.index(name) * 10 + bits)
    tokens = rng.integers(0, tf.VOCAB, (2, 16))
    ours = jaxdec.score(model, tokens)
    line = _format_error(ours, tf.hf_logits(hf, tokens), weights)
    stored = _hf_on_stored_weights(model, name, tmp_path / "stored")
    # 2 x 7 = 14 rows: below the CPU kernel's AMX path for the dense projections (16 rows
    # on, x rounded to bf16 there, `cpu_kernel.has_amx`); the MLA and expert products of a
    # CPU with AMX still reach it (5e-3 to 3.4e-2 there), so the bound is bf16's
    # rounding of x there and float32's elsewhere
    short = tokens[:, :7]
    exact = rel_err(jaxdec.score(model, short), tf.hf_logits(stored, short))
    print(f"{name} {weights}: {line}; {exact:.1e} against HF on the stored weights")
    assert exact < (5e-2 if cpu_kernel.has_amx() else 1e-5), exact
    prompt = rng.integers(0, tf.VOCAB, (2, 6))
    out = api.generate_ids(model, prompt.tolist(), max_new_tokens=4, stop_ids=())
    np.testing.assert_array_equal(np.array(out.token_ids), tf.hf_greedy(stored, prompt, 4))


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_float_weights_and_gguf_choice_on_moe_and_mla(name):
    """The other `--weights` choices on a HF checkpoint: "f32" is the default load, "gguf"
    (no GGUF blocks to keep) is int8, "bf16" and int8 with bfloat16 activations stay within
    their error of HF and generate."""
    hf, path, f32 = _saved(name)
    rng = np.random.default_rng(FAMILIES.index(name) * 10 + 5)
    tokens = rng.integers(0, tf.VOCAB, (2, 16))
    ref = tf.hf_logits(hf, tokens)
    np.testing.assert_array_equal(jaxdec.score(jaxdec.load(str(path), weights="f32"), tokens),
                                  jaxdec.score(f32, tokens))
    gguf = jaxdec.load(str(path), weights="gguf")
    assert gguf.weights == "int8"
    int8 = _loaded(name, "int8")
    assert jax.tree.structure(gguf.params) == jax.tree.structure(int8.params)
    for a, b in zip(jax.tree.leaves(gguf.params), jax.tree.leaves(int8.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for label, model in (("bf16", jaxdec.load(str(path), weights="bf16")),
                         ("int8+bf16", _loaded(name, "int8", "bfloat16"))):
        assert model.dtype == jnp.bfloat16
        if label == "bf16":
            assert model.weights == "bfloat16"
            assert all(w.dtype == jnp.bfloat16 for _, _, w in _matmul_weights(model))
        print(f"{name} {label}: {_format_error(jaxdec.score(model, tokens), ref, label)}")
        out = np.array(api.generate_ids(model, tokens[:, :6].tolist(), max_new_tokens=3,
                                        stop_ids=()).token_ids)
        assert out.shape == (2, 3) and ((0 <= out) & (out < tf.VOCAB)).all()


def test_mla_with_dfloat11_weights_is_its_bfloat16():
    """DFloat11 (lossless bfloat16) on DeepSeek-V3: kv_b and the other MLA projections are
    compressed and decoded where MLA uses them; the logits are the bfloat16 model's."""
    path = _saved("deepseek_v3")[1]
    bf16 = jaxdec.load(str(path), weights="bf16")
    small = dataclasses.replace(bf16, params=dfloat11.compress_params(
        bf16.params, transformer.declare(bf16.cfg)))
    assert small.weights == "dfloat11"
    mixer = small.params.layers[1].mixer
    assert all(dfloat11.is_df11(getattr(mixer, f)) for f in ("q_a", "q_b", "kv_a", "kv_b", "o"))
    tokens = np.random.default_rng(31).integers(0, tf.VOCAB, (2, 12))
    np.testing.assert_array_equal(jaxdec.score(small, tokens), jaxdec.score(bf16, tokens))


def _numpy_dequantized(w) -> np.ndarray:
    """float64 [E, K, N] of a QArray expert stack, from its codes by the QArray formula."""
    q = np.asarray(w.q)
    if w.bits == 4:  # two codes a byte along K: row 2i low nibble, 2i + 1 high
        q = np.stack([q & 0x0F, q >> 4], axis=2).reshape(q.shape[0], 2 * q.shape[1], q.shape[2])
    per_row = lambda a: np.repeat(np.asarray(a, np.float64), w.group_size, axis=1)
    v = q.astype(np.float64) * per_row(w.scale)
    if w.offset is not None:
        v = v + per_row(w.offset)
    return v[:, :w.k].reshape(w.shape)


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("name", ["deepseek_v3", "nemotron_h"])
def test_quantized_experts_run_the_expert_kernels(name, weights):
    """A loaded MoE layer's quantised experts (SwiGLU: DeepSeek-V3; squared ReLU:
    Nemotron-H) through both dispatches, gathered (decode: the quantised matmul kernel on
    the chosen experts' codes) and dropless (prefill: the grouped-matmul kernel), equal a
    float64 NumPy MoE over the dequantised experts, on fresh random tokens and routes."""
    model = _loaded(name, weights)
    layer = next(i for i, (_, f) in enumerate(model.cfg.kinds) if f == "moe")
    p = model.params.layers[layer].ffn.experts
    assert is_q(p.w_up) and is_q(p.w_down) and (p.w_gate is None) == (name == "nemotron_h")
    up, down = _numpy_dequantized(p.w_up), _numpy_dequantized(p.w_down)
    gate = None if p.w_gate is None else _numpy_dequantized(p.w_gate)
    e, d = up.shape[0], up.shape[1]
    k = model.cfg.moe.top_k
    rng = np.random.default_rng(41 + int(weights[3:]))
    for n, target in ((e // k, "jaxdec_qmatmul"), (13, "jaxdec_ragged_matmul")):
        x = rng.standard_normal((n, d)).astype(np.float32)
        idx = np.stack([rng.permutation(e)[:k] for _ in range(n)]).astype(np.int32)
        gates = rng.random((n, k)).astype(np.float32)
        ref = np.zeros((n, d))
        for i in range(n):
            for j in range(k):
                x64, ex = x[i].astype(np.float64), idx[i, j]
                u = x64 @ up[ex]
                if gate is None:
                    h = np.maximum(u, 0) ** 2
                else:
                    a = x64 @ gate[ex]
                    h = a / (1 + np.exp(-a)) * u
                ref[i] += gates[i, j] * (h @ down[ex])
        run = jax.jit(moe.experts)
        assert target in run.lower(x, idx, gates, p).as_text(), (n, target)
        ours = np.asarray(run(x, idx, gates, p), np.float64)
        np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max(),
                                   err_msg=f"{n} tokens")


def test_quantized_experts_on_a_mesh_are_a_one_line_error():
    assert_one_line_error(jaxdec.load, str(_saved("qwen3_moe")[1]), weights="int8",
                          mesh="data=2", match="quantised MoE experts are not laid out on a mesh")


def test_cache_bytes_per_token_and_constant_mamba_state():
    """At one model width (D = 1024, 16 heads of 64): MHA 2*16*64, GQA (4 kv heads) 2*4*64,
    MLA (latent 256 + rope 32) and Mamba (nothing per token) values per layer per token,
    plus the int32 position of each slot."""
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
    assert grow == {"MHA": 2 * 16 * 64 * 2 + 4, "GQA": 2 * 4 * 64 * 2 + 4, "MLA": (256 + 32) * 2 + 4,
                    "Mamba": 0}
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
