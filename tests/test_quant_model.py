"""Quantised weights inside the model: the same function, a QArray where a matrix was.

References: the model run on the dequantised weights (float64-checked QArray semantics are
in test_qarray.py), the GGUF file's own values (gguf.quants, via the f32 load), and HF
transformers' greedy continuation for the real model.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdec
from jaxdec import decode
from jaxdec.api import Model
from jaxdec.cache import dense
from jaxdec.errors import JaxdecError
from jaxdec.models import transformer
from jaxdec.formats import QArray, dequantize
from jaxdec.ops import cpu_kernel
from jaxdec.formats.convert import quantize_params
from jaxdec.sampling import Greedy
from tiny_hf import VOCAB, build, rel_err

from conftest import jax_model

is_q = lambda x: isinstance(x, QArray)


def dequantized(params):
    return jax.tree.map(lambda w: dequantize(w) if is_q(w) else w, params, is_leaf=is_q)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request):
    _, cfg, params = build(request.param, seed=3)
    return cfg, params


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantised_forward_equals_dequantised_forward(tiny, weights):
    """Prefill and decode (the CPU kernel, M = batch x chunk rows) both compute the model on
    exactly the dequantised weights, while fewer than 16 rows go through each matmul; from 16
    rows on, CPUs with AMX round activations and weights to bf16 (checked to bf16 accuracy)."""
    cfg, params = tiny
    qp = quantize_params(params, transformer.declare(cfg), weights)
    assert all(is_q(getattr(qp.layers[0].mixer, n)) for n in ("wq", "wk", "wv", "wo"))
    assert is_q(qp.layers[0].ffn.w_down)
    assert is_q(qp.lm_head) and not is_q(qp.final_norm)
    ref_params = dequantized(qp)
    tokens = jnp.asarray(np.random.default_rng().integers(0, VOCAB, (2, 12)))
    pos = jnp.broadcast_to(jnp.arange(12), (2, 12))
    fwd = jax.jit(transformer.forward, static_argnames="cfg")
    for chunk in (slice(0, 7), slice(7, 8), slice(8, 9)):  # prefill, then decode steps
        if chunk.start == 0:
            cache_q, cache_r = dense.init_cache(cfg, 2, 32), dense.init_cache(cfg, 2, 32)
        ours, cache_q = fwd(qp, tokens[:, chunk], pos[:, chunk], cache_q, cfg=cfg)
        ref, cache_r = fwd(ref_params, tokens[:, chunk], pos[:, chunk], cache_r, cfg=cfg)
        assert rel_err(ours, ref) < 2e-5, chunk
    ours = fwd(qp, tokens, pos, None, cfg=cfg)[0]  # 24 rows per matmul
    ref = fwd(ref_params, tokens, pos, None, cfg=cfg)[0]
    assert rel_err(ours, ref) < (2e-2 if cpu_kernel.has_amx() else 2e-5)


def test_quantised_generation_runs_in_one_jit(tiny):
    cfg, params = tiny
    qp = quantize_params(params, transformer.declare(cfg), "int4")
    # 3 x 5 prompt rows: under the kernel's AMX threshold (16 rows), so both runs compute
    # on the same float32 values and greedy ids must agree exactly.
    prompts = jnp.asarray(np.random.default_rng().integers(0, VOCAB - 1, (3, 5)), jnp.int32)
    run = lambda p: decode.generate_tokens(
        p, dense.init_cache(cfg, 3, 32), prompts, jnp.array([5, 4, 3]), jax.random.key(0),
        jnp.full((3,), 12, jnp.int32), sampler=Greedy(), cfg=cfg, max_new_tokens=12)[0]
    np.testing.assert_array_equal(run(qp).tokens, run(dequantized(qp)).tokens)


def test_unknown_weight_format_is_one_line_error():
    with pytest.raises(JaxdecError, match="unknown weight format"):
        jaxdec.load("smollm2", weights="int3")


@pytest.fixture(scope="module")
def smollm2_gguf():
    return jaxdec.load("smollm2", weights="gguf")


def test_gguf_blocks_are_the_files_values(smollm2_gguf):
    """weights="gguf" keeps SmolLM2's Q4_1 layers and Q8_0 head as they are in the file:
    dequantised, they equal the f32 load (gguf.quants' dequantisation) exactly."""
    f32 = jax_model("smollm2")
    q = smollm2_gguf.params
    assert q.layers[0].mixer.wq.bits == 4 and q.lm_head.bits == 8 and smollm2_gguf.weights == "mixed int4/int8"
    for ours, ref in [(q.layers[0].mixer.wq, f32.params.layers[0].mixer.wq), (q.layers[7].mixer.wo, f32.params.layers[7].mixer.wo),
                      (q.layers[29].ffn.w_down, f32.params.layers[29].ffn.w_down), (q.lm_head, f32.params.lm_head)]:
        np.testing.assert_array_equal(np.asarray(dequantize(ours)), np.asarray(ref))


def test_gguf_weights_greedy_matches_f32(smollm2_gguf):
    """The same values in another storage: greedy ids equal the f32 model's (summation
    order differs, so a near-tie could part them; none does on this prompt). The prompt is
    shorter than 16 tokens, so its prefill too stays in float32 on CPUs with AMX."""
    f32 = jax_model("smollm2")
    prompt = "Write one sentence about the sea."
    a = jaxdec.generate(f32, prompt, max_new_tokens=24)
    b = jaxdec.generate(smollm2_gguf, prompt, max_new_tokens=24)
    assert len(a.prompt_ids[0]) < 16
    assert a.token_ids == b.token_ids


def test_quantised_checkpoint_round_trip(tiny, tmp_path):
    """save/load of an int4 model restores every QArray exactly (layout from jaxdec.json)."""
    cfg, params = tiny
    qp = quantize_params(params, transformer.declare(cfg), "int4")
    tok = jax_model("smollm2").tokenizer
    saved = jaxdec.save(Model(cfg=cfg, params=qp, tokenizer=tok), tmp_path / "q4")
    back = jaxdec.load(saved)
    for a, b in zip(jax.tree.leaves(qp), jax.tree.leaves(back.params)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert back.weights == "int4"


def test_params_cache_round_trips_every_format(tmp_path, monkeypatch):
    """A second load of a registry model comes from the converted-params cache and equals
    the first, for float32, bfloat16 (stored by numpy as raw records) and quantised weights."""
    monkeypatch.setenv("JAXDEC_HOME", str(tmp_path))
    jaxdec.load("smollm2")
    for weights in ("bf16", "int4"):
        first = jaxdec.load("smollm2", weights=weights)
        assert any((tmp_path / ".params_cache").iterdir())
        second = jaxdec.load("smollm2", weights=weights)
        for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(second.params)):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert second.weights == first.weights
