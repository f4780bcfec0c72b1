"""The weight-transform registry (`jaxdec.transforms`): every registered transform applied to
a tiny random model runs and equals the function it wraps; one-line errors; the short last
group note."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_one_line_error
from jaxdec import pytree, transforms
from jaxdec.config import ModelConfig
from jaxdec.formats.qarray import QArray
from jaxdec.models import moefy, transformer
from jaxdec.quant import kurtail, methods

CFG = ModelConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                  d_ff=96, max_position=256)
GROUP = 40  # divides neither D = 64 nor F = 96: every block matmul's last group is short
MOEFY = dict(n_experts=4, top_k=2, n_shared=16)

_forward = jax.jit(transformer.forward, static_argnames="cfg")


@functools.lru_cache(maxsize=None)
def _params():
    return pytree.init_params(transformer.declare(CFG), jax.random.key(0))


def _calib() -> np.ndarray:  # fresh random windows, i32[4, 32]: 128 tokens >= the largest K
    return np.random.default_rng().integers(0, CFG.vocab_size, (4, 32)).astype(np.int32)


def _logits(params, cfg, tokens):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return np.asarray(_forward(params, jnp.asarray(tokens), positions, None, cfg)[0])


def _options(name: str) -> dict:
    if name in methods.METHODS:
        allowed = methods.METHODS[name][0]
        return {"bits": 4 if 4 in allowed else 8, "group_size": GROUP}
    if name in kurtail.TABLE_ROWS:
        return {"bits": 4}
    return dict(MOEFY)


def _direct(name: str, params, cfg, calib, options):
    """(params, cfg) from the function the transform `name` wraps, called directly."""
    if name in methods.METHODS:
        spec = methods.QuantSpec(method=name, **options)
        return methods.quantize_model(params, cfg, spec, calib=calib if spec.needs_calibration
                                      else None), cfg
    if name in kurtail.TABLE_ROWS:
        params = kurtail.table_row(params, cfg, name, options["bits"], calib)
        return params, dataclasses.replace(cfg, tie_embeddings=False)
    new_cfg, new_params = moefy.moefy_model(params, cfg, calib, **options)
    return new_params, new_cfg


def _assert_identical(got, want):
    """The same pytree (formats and static fields included), bit for bit."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_registry_lists_every_transform():
    assert set(transforms.names()) == {*methods.METHODS, *kurtail.TABLE_ROWS, "moefy"}
    assert len(transforms.names()) == len(set(transforms.names()))
    for name in transforms.names():
        entry = transforms.get(name)
        assert entry.name == name and entry.summary and "\n" not in entry.summary
    for name, (_, needs) in methods.METHODS.items():
        assert transforms.get(name).needs_calib == needs
    assert all(transforms.get(n).needs_calib for n in (*kurtail.TABLE_ROWS, "moefy"))


@pytest.mark.parametrize("name", transforms.names())
def test_transform_runs_and_equals_the_function_it_wraps(name):
    params, calib, options = _params(), _calib(), _options(name)
    got_params, got_cfg = transforms.apply(name, params, CFG, calib, **options)
    want_params, want_cfg = _direct(name, params, CFG, calib, options)
    assert got_cfg == want_cfg
    _assert_identical(got_params, want_params)
    tokens = np.random.default_rng().integers(0, CFG.vocab_size, (2, 9)).astype(np.int32)
    logits = _logits(got_params, got_cfg, tokens)
    assert logits.shape == (2, 9, CFG.vocab_size) and np.isfinite(logits).all()
    if name == "moefy":
        assert got_cfg.moe.n_experts == MOEFY["n_experts"]
        assert got_cfg.layer_types == ("attention+moe",) * CFG.n_layers
        return
    # the options reached the method: every block matmul (7 a layer) at the asked width, in
    # groups of GROUP where the method groups (LLM.int8 and SmoothQuant scale per channel)
    qs = [w for w in jax.tree.leaves(got_params, is_leaf=lambda x: isinstance(x, QArray))
          if isinstance(w, QArray)]
    assert len(qs) == 7 * CFG.n_layers and {q.bits for q in qs} == {options["bits"]}
    if "group_size" in options and name not in ("llm_int8", "smoothquant"):
        assert {q.group_size for q in qs} == {GROUP}


def test_unknown_name_is_one_line_error():
    assert_one_line_error(transforms.get, "magic", match="unknown weight transform 'magic'")
    assert_one_line_error(transforms.apply, "magic", _params(), CFG, match="gptq, awq")


@pytest.mark.parametrize("name", [n for n in transforms.names() if transforms.get(n).needs_calib])
def test_missing_calibration_is_one_line_error(name):
    assert_one_line_error(transforms.apply, name, _params(), CFG, **_options(name),
                          match=f"{name} needs calibration tokens")


def test_register_adds_a_transform(monkeypatch):
    monkeypatch.setattr(transforms._REGISTRY, "entries", dict(transforms._REGISTRY.entries))

    @transforms.register("identity", needs_calib=False, summary="the model unchanged")
    def identity(params, cfg, calib):
        return params, cfg

    assert "identity" in transforms.names()
    assert transforms.apply("identity", "p", CFG) == ("p", CFG)
    with pytest.raises(ValueError, match="registered twice"):
        transforms.register("identity", needs_calib=False, summary="again")(identity)


def test_short_group_note_names_the_short_groups():
    params, d, f = _params(), CFG.d_model, CFG.d_ff
    note = methods.short_group_note(params, methods.QuantSpec(method="gptq", group_size=GROUP))
    assert note == (f"group {GROUP}: last group of wq, wk, wv, wo, w_gate, w_up has {d % GROUP} "
                    f"of {GROUP} columns ({d} = {d // GROUP} x {GROUP} + {d % GROUP}); last "
                    f"group of w_down has {f % GROUP} of {GROUP} columns ({f} = {f // GROUP} x "
                    f"{GROUP} + {f % GROUP})")
    assert methods.short_group_note(params, methods.QuantSpec(method="gptq", group_size=32)) is None
    per_channel = methods.QuantSpec(method="smoothquant", bits=8, group_size=GROUP)
    assert methods.short_group_note(params, per_channel) is None


def test_quality_table_rows_go_through_the_registry():
    """The quality table's PTQ and rotation rows (`quant_table.Evaluator`) are the
    transforms' models, at the table's group size; a method without calibration never asks
    for the calibration set."""
    from jaxdec import api
    from jaxdec.bench import quant_table

    def no_corpus(text):
        raise AssertionError("rtn asked for calibration tokens")

    ev = object.__new__(quant_table.Evaluator)  # (no model is loaded by name here)
    ev.s, ev.encode, ev._calib = quant_table.Settings(group_size=GROUP), no_corpus, None
    ev.model = api.Model(cfg=CFG, params=_params(), tokenizer=None)
    rtn = ev._transformed(quant_table.parse_row("rtn:4"))
    _assert_identical(rtn.params, _direct("rtn", _params(), CFG, None,
                                          {"bits": 4, "group_size": GROUP})[0])
    ev._calib = _calib()
    for row, name, options in (("gptq:3", "gptq", {"bits": 3, "group_size": GROUP}),
                               ("hadamard:4", "hadamard", {"bits": 4})):
        got = ev._transformed(quant_table.parse_row(row))
        want_params, want_cfg = _direct(name, _params(), CFG, ev._calib, options)
        assert got.cfg == want_cfg
        _assert_identical(got.params, want_params)
