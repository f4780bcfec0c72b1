"""KurTail and the QuaRot Hadamard baseline (`jaxdec.quant.kurtail`): the exact
equivalences of the folded and rotated models (against the original model and HF
transformers), the rotations, the kurtosis objective, the KV4 output quantiser, the W4A4KV4
pipeline on a tiny model, and one-line errors for bad input."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from conftest import assert_one_line_error, jax_model
from jaxdec import layers, prompts
from jaxdec.models import transformer
from jaxdec.formats import actquant, convert
from jaxdec.quant import calibrate, kurtail
from jaxdec.formats.actquant import ActQuant
from jaxdec.formats.qarray import QArray
from tiny_hf import VOCAB, build, hf_logits, rel_err

_forward = jax.jit(transformer.forward, static_argnames="cfg")


def _logits(params, cfg, tokens):
    tokens = np.asarray(tokens, np.int32)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return np.asarray(_forward(params, jnp.asarray(tokens), positions, None, cfg)[0])


def _random_rotation(d: int, seed: int) -> np.ndarray:
    q, r = np.linalg.qr(np.random.default_rng(seed).normal(size=(d, d)))
    return (q * np.sign(np.diag(r))).astype(np.float32)


def _rotate_all(params, cfg, seed: int):
    """fold_norms, a dense random R1, random R2 per layer and the down-proj Hadamard (float)."""
    p = kurtail.fold_norms(params, cfg)
    p = kurtail.rotate_residual(p, cfg, _random_rotation(cfg.d_model, seed))
    r2 = np.stack([_random_rotation(cfg.head_dim, seed + 1 + i) for i in range(cfg.n_layers)])
    return kurtail.hadamard_down(kurtail.rotate_heads(p, cfg, r2), cfg)


@pytest.fixture(scope="module")
def smol():
    model = jax_model("smollm2")
    enc = lambda t: model.tokenizer.encode(t, add_special_tokens=False)
    tokens = np.asarray(enc(" ".join(prompts.PROMPTS[:6]))[:64]).reshape(2, 32)
    return model, enc, tokens


@pytest.fixture(scope="module")
def learned(smol):
    """KurTail's rotations of SmolLM2, learned briefly on one 128-token calibration window
    (a second one held out)."""
    model, enc, _ = smol
    calib = calibrate.calibration_tokens(enc, n_windows=2, window=128)
    settings = kurtail.LearnSettings(steps=15, batch=256, lr=5e-3)
    return kurtail.rotate_model(model.params, model.cfg, "kurtail", calib, per_site=64,
                                sample_windows=2, settings=settings)


# ---- exact equivalences ---------------------------------------------------------------------
def test_fold_and_rotations_keep_smollm2_logits(smol, learned):
    """d 576 (not a power of two), GQA 9/3, tied embeddings: folded, then rotated by the
    learned (dense) R1 and per-layer R2, then the online block Hadamard (512) on the down
    projection."""
    model, _, tokens = smol
    want = _logits(model.params, model.cfg, tokens)
    folded = kurtail.fold_norms(model.params, model.cfg)
    assert model.params.embed is None and folded.embed.shape == (model.cfg.vocab_size, 576)
    assert rel_err(_logits(folded, model.cfg, tokens), want) < 2e-6
    rotated = kurtail.hadamard_down(learned.params, model.cfg)
    w_down = rotated.layers[0].ffn.w_down
    assert isinstance(w_down, ActQuant) and w_down.rotate == 512 and w_down.act_bits is None
    got = _logits(rotated, model.cfg, tokens)
    assert rel_err(got, want) < 1e-5
    assert np.abs(got - want).max() < 2e-3
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_rotated_tiny_models_match_hf(arch):
    """Against HF transformers: llama (tied, llama3 RoPE), qwen2 (qkv biases: bv is rotated
    with the values, untied head)."""
    hf, cfg, params = build(arch, seed=3)
    tokens = np.random.default_rng().integers(0, VOCAB, (2, 29))
    got = _logits(_rotate_all(params, cfg, seed=5), cfg, tokens)
    assert rel_err(got, hf_logits(hf, tokens)) < 1e-5


# ---- rotations and the objective ------------------------------------------------------------
@pytest.mark.parametrize("d, block", [(576, 64), (896, 128), (64, 64)])
def test_hadamard_rotation_is_random_block_hadamard(d, block):
    r = kurtail.hadamard_rotation(d, seed=7).astype(np.float64)
    np.testing.assert_allclose(r.T @ r, np.eye(d), atol=1e-6)
    mask = np.kron(np.eye(d // block), np.ones((block, block))) > 0
    assert np.all(r[~mask] == 0) and np.allclose(np.abs(r[mask]), block ** -0.5)
    assert not np.array_equal(r, kurtail.hadamard_rotation(d, seed=8))


def test_kurtosis_matches_scipy():
    rng = np.random.default_rng()
    x = rng.standard_t(4, size=(9, 576)) * rng.uniform(0.1, 10, size=(9, 1)) + 3.0
    x[2, 17] = 80.0  # an outlier channel
    want = scipy.stats.kurtosis(x, axis=1, fisher=False, bias=True)
    np.testing.assert_allclose(np.asarray(kurtail.kurtosis(jnp.asarray(x, jnp.float32))), want,
                               rtol=2e-5)
    assert float(kurtail.kurtosis(jnp.full((5,), 2.0))) == 0.0


def test_cayley_is_orthogonal():
    a = jnp.asarray(np.random.default_rng().normal(size=(96, 96)), jnp.float32)
    q = np.asarray(kurtail.cayley(a), np.float64)
    np.testing.assert_allclose(q.T @ q, np.eye(96), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(kurtail.cayley(jnp.zeros((8, 8)))), np.eye(8))


def test_learned_rotations_are_orthogonal_and_lower_held_out_kurtosis(learned):
    """On SmolLM2's normalised layer inputs: identity >> Hadamard > learned, on tokens the
    rotations were not fitted on."""
    r1 = learned.r1.astype(np.float64)
    np.testing.assert_allclose(r1.T @ r1, np.eye(576), atol=1e-5)
    assert np.abs(r1 - kurtail.hadamard_rotation(576, 0)).max() > 1e-2  # dense, not the start
    r2 = learned.r2.astype(np.float64)
    assert r2.shape == (30, 64, 64)
    np.testing.assert_allclose(np.einsum("lji,ljk->lik", r2, r2),
                               np.broadcast_to(np.eye(64), r2.shape), atol=1e-5)
    k = {name: learned.kurtosis[f"residual {name} held-out"]
         for name in ("identity", "hadamard", "kurtail")}
    assert k["identity"] > 5 * k["hadamard"] and k["kurtail"] < 0.9 * k["hadamard"], k
    assert learned.kurtosis["values kurtail train"] < learned.kurtosis["values hadamard train"]


# ---- KV4: the output quantiser --------------------------------------------------------------
def _kv_reference(y: np.ndarray, group: int, bits: int, h: np.ndarray | None) -> np.ndarray:
    """float64: per row and group, (rotate,) symmetric absmax quantise-dequantise, (rotate back)."""
    qmax = 2 ** (bits - 1) - 1
    z = y.reshape(y.shape[0], -1, group)
    z = z if h is None else z @ h
    scale = np.abs(z).max(-1, keepdims=True) / qmax
    z = np.clip(np.round(z / np.where(scale > 0, scale, 1)), -qmax, qmax) * scale
    z = z if h is None else z @ h.T
    return z.reshape(y.shape)


@pytest.mark.parametrize("rotate", [None, 16])
def test_kv4_output_quant_matches_numpy(rotate):
    rng = np.random.default_rng()
    x = rng.normal(size=(2, 5, 48)).astype(np.float32)
    w = rng.normal(size=(48, 3, 16)).astype(np.float32)   # [D, K, H]
    bias = rng.normal(size=(3, 16)).astype(np.float32) * 4
    a = ActQuant(w=jnp.asarray(w), in_scale=None, act_bits=None, out_bits=4, out_group=16,
                 out_rotate=rotate, out_shift=jnp.asarray(bias.reshape(-1)))
    got = np.asarray(layers.linear(jnp.asarray(x), a)) + bias   # what the cache would hold
    y = x.reshape(10, 48).astype(np.float64) @ w.reshape(48, 48) + bias.reshape(-1)
    h = None if rotate is None else actquant.hadamard(16).astype(np.float64)
    want = _kv_reference(y, 16, 4, h).reshape(got.shape)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    if rotate is None:  # at most 15 levels per token and head
        levels = got.reshape(10, 3, 16)
        assert max(len(np.unique(np.round(v, 5))) for v in levels.reshape(30, 16)) <= 15
    plain = ActQuant(w=jnp.asarray(w), in_scale=None, act_bits=None)
    np.testing.assert_allclose(np.asarray(layers.linear(jnp.asarray(x), plain)),
                               np.einsum("btd,dkh->btkh", x, w), rtol=1e-5, atol=1e-5)


# ---- the pipeline ---------------------------------------------------------------------------
def test_w4a4kv4_pipeline_on_tiny_qwen2():
    """Hadamard rotations + GPTQ: every block linear becomes ActQuant(4-bit QArray), KV4 on
    wk/wv (bias inside, keys Hadamard-rotated); with all bits None the rotated pipeline is
    the original model; the layout survives `convert.describe` / `abstract_like`."""
    hf, cfg, params = build("qwen2", seed=4)
    rng = np.random.default_rng(0)
    calib = rng.integers(0, VOCAB, (4, 32)).astype(np.int32)
    tokens = rng.integers(0, VOCAB, (2, 21))
    rot = kurtail.rotate_model(params, cfg, "hadamard")
    float_plan = kurtail.Plan(rotated=True, w_bits=None, act_bits=None, kv_bits=None)
    same = kurtail.quantize_rotated(rot, cfg, float_plan)
    want = _logits(params, cfg, tokens)
    assert rel_err(_logits(same, cfg, tokens), want) < 1e-5
    q = kurtail.quantize_rotated(rot, cfg, kurtail.Plan(rotated=True), calib)
    a, f = q.layers[0].mixer, q.layers[0].ffn
    for w in (a.wq, a.wk, a.wv, a.wo, f.w_gate, f.w_up, f.w_down):
        assert isinstance(w, ActQuant) and isinstance(w.w, QArray)
        assert w.w.bits == 4 and w.act_bits == 4
    assert (a.wk.out_bits, a.wk.out_group, a.wk.out_rotate) == (4, 16, 16)
    assert (a.wv.out_bits, a.wv.out_rotate, a.wq.out_bits) == (4, None, None)
    assert f.w_down.rotate == 32 and a.wk.out_shift.shape == (32,)
    assert rel_err(_logits(q, cfg, tokens), want) < 0.5
    layout = convert.describe(q)
    decl = transformer.declare(dataclasses.replace(cfg, tie_embeddings=False))
    abstract = convert.abstract_like(decl, jnp.float32, layout)
    assert jax.tree.structure(abstract) == jax.tree.structure(q)


# ---- bad input ------------------------------------------------------------------------------
def test_bad_input_is_one_line_error(smol):
    model, _, _ = smol
    cfg, params = model.cfg, model.params
    folded = kurtail.fold_norms(params, cfg)
    rotate = kurtail.rotate_residual
    assert_one_line_error(rotate, folded, cfg, 1.01 * np.eye(576), match="not orthogonal")
    assert_one_line_error(rotate, folded, cfg, np.eye(575), match=r"shape \[575, 575\]")
    assert_one_line_error(rotate, params, cfg, np.eye(576), match="fold_norms first")
    assert_one_line_error(kurtail.rotate_heads, folded, cfg, np.eye(64), match="head rotations")
    assert_one_line_error(kurtail.learn_rotation, np.zeros(5), match="samples")
    for kw, match in [(dict(w_bits=5), "weight bits 5"), (dict(act_bits=3), "activation bits 3"),
                      (dict(kv_bits=2), "KV cache bits 2"),
                      (dict(group_size=100), "group size 100"),
                      (dict(weight_method="awq"), "weight method"),
                      (dict(rotation="random"), "rotation")]:
        kw = {"rotation": "hadamard", **kw}
        assert_one_line_error(kurtail.quantize_w4a4kv4, params, cfg, calib=None, match=match,
                              **kw)
    assert_one_line_error(kurtail.quantize_w4a4kv4, params, cfg, "none", None, match="calibration")
    x = jnp.ones((2, 48))
    bad = ActQuant(w=jnp.ones((48, 48)), in_scale=None, act_bits=None, out_bits=4, out_group=7)
    assert_one_line_error(layers.linear, x, bad, match="out_group")
    bad = dataclasses.replace(bad, out_group=16, out_bits=3)
    assert_one_line_error(layers.linear, x, bad, match="out_bits")


def test_w4a4kv4_checkpoint_round_trip(smol, tmp_path):
    """SmolLM2 rotated (block-Hadamard) and quantised W4A4KV4 (RTN weights, for speed) is
    saved as orbax with its untied head and loads back to the same logits, as `jaxdec
    quantize --method hadamard` writes it."""
    import jaxdec

    model, _, tokens = smol
    params = kurtail.quantize_w4a4kv4(model.params, model.cfg, "hadamard", weight_method="rtn")
    q = dataclasses.replace(model, params=params,
                            cfg=dataclasses.replace(model.cfg, tie_embeddings=False))
    back = jaxdec.load(str(jaxdec.save(q, tmp_path / "w4a4kv4")))
    assert isinstance(back.params.layers[3].mixer.wk, ActQuant)
    assert back.params.layers[3].mixer.wk.out_bits == 4
    np.testing.assert_array_equal(jaxdec.api.score(back, tokens.tolist()),
                                  jaxdec.api.score(q, tokens.tolist()))
