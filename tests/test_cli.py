"""The `jaxdec` command: generation, conversion, info, and one-line errors on bad input."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import jaxdec
from conftest import jax_model
from jaxdec import api
from jaxdec.checkpoint import registry
from jaxdec.errors import JaxdecError


def run(*args, stdin: str | None = None, timeout=600):
    env = dict(os.environ, JAXDEC_XLA_CACHE=os.environ.get("JAXDEC_XLA_CACHE", ""))
    return subprocess.run([sys.executable, "-m", "jaxdec", *args], capture_output=True,
                          text=True, input=stdin, timeout=timeout, env=env)


def assert_one_line_error(r, *needles):
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxdec: error:"), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture(scope="module")
def smol_path():
    return registry.resolve("smollm2")


def test_missing_path():
    assert_one_line_error(run("info", "/nonexistent/model.gguf"), "/nonexistent/model.gguf")


def test_truncated_gguf(tmp_path, smol_path):
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(smol_path.read_bytes()[: 5_000_000])
    assert_one_line_error(run("info", str(bad)), "truncated.gguf")


def test_garbage_gguf(tmp_path):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(np.random.default_rng().bytes(4096))
    assert_one_line_error(run("generate", "--model", str(bad), "--prompt", "hi"), "garbage.gguf")


@pytest.mark.parametrize("flags,needle", [
    (["--max-new-tokens", "0"], "max-new-tokens"),
    (["--max-new-tokens", "-3"], "max-new-tokens"),
    (["--temperature", "-0.5"], "temperature"),
    (["--temperature", "0.7", "--top-p", "0"], "top_p"),
    (["--temperature", "0.7", "--top-p", "1.01"], "top_p"),
])
def test_bad_sampling_flags(flags, needle):
    assert_one_line_error(run("generate", "--prompt", "hello", *flags), needle)


def test_prompt_longer_than_context():
    model = jax_model("smollm2")
    with pytest.raises(JaxdecError, match="exceeds the model's context"):
        jaxdec.generate(model, "word " * (model.cfg.max_position + 10), max_new_tokens=4)
    r = run("generate", "--prompt", "word " * (model.cfg.max_position + 10), "-n", "4")
    assert_one_line_error(r, "context")


def test_generate_streams_and_reports_speed():
    r = run("generate", "--prompt", "The capital of France is", "-n", "12")
    assert r.returncode == 0, r.stderr
    ours = jaxdec.generate(jax_model("smollm2"), "The capital of France is", max_new_tokens=12)
    assert r.stdout.strip() == ours.texts[0].strip()
    assert "time to first token" in r.stderr and "tok/s" in r.stderr


def test_chat_is_multi_turn():
    r = run("chat", "-n", "24", stdin="My name is Ada. Please remember it.\nWhat is my name?\n")
    assert r.returncode == 0, r.stderr
    assert "Ada" in r.stdout


def test_info(smol_path):
    r = run("info", "smollm2")
    assert r.returncode == 0, r.stderr
    assert "30 layers" in r.stdout and "Q4_1" in r.stdout and "134,515,008" in r.stdout


def test_convert_round_trip_and_never_clobbers(tmp_path):
    """GGUF -> convert -> load gives identical logits; a failed convert keeps the old one."""
    out = tmp_path / "smol"
    r = run("convert", "smollm2", str(out))
    assert r.returncode == 0, r.stderr
    rows = [[1, 504, 3458, 282, 4290, 314], [9707, 28, 1288]]
    direct = api.score(jax_model("smollm2"), rows)
    restored = jaxdec.load(out)
    np.testing.assert_array_equal(api.score(restored, rows), direct)
    assert restored.tokenizer.encode("Hello world") == jax_model("smollm2").tokenizer.encode("Hello world")
    before = sorted(p.name for p in out.rglob("*"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(100))
    assert_one_line_error(run("convert", str(bad), str(out)), "bad.gguf")
    assert sorted(p.name for p in out.rglob("*")) == before
    assert [p.name for p in tmp_path.iterdir() if "partial" in p.name] == []
    np.testing.assert_array_equal(api.score(jaxdec.load(out), rows), direct)


def test_interrupted_save_keeps_old_checkpoint(tmp_path, monkeypatch):
    model = jax_model("smollm2")
    out = jaxdec.save(model, tmp_path / "ckpt")
    meta = (out / "jaxdec.json").read_text()

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(model.tokenizer.__class__, "save", boom)
    with pytest.raises(KeyboardInterrupt):
        jaxdec.save(model, out)
    assert (out / "jaxdec.json").read_text() == meta
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_refuses_to_overwrite_non_checkpoint(tmp_path):
    precious = tmp_path / "notes"
    precious.mkdir()
    (precious / "a.txt").write_text("keep me")
    with pytest.raises(JaxdecError, match="not a jaxdec checkpoint"):
        jaxdec.save(jax_model("smollm2"), precious)
    assert (precious / "a.txt").read_text() == "keep me"


def test_quantize_reports_short_groups(tmp_path):
    """`jaxdec quantize --group G` with G dividing neither the tiny model's D nor its F: one
    stdout line names the matmuls whose last group is short, and the checkpoint written is
    the "gptq" weight transform's model (`jaxdec.transforms`) on the same calibration set."""
    import dataclasses

    from jaxdec import transforms
    from jaxdec.quant import calibrate
    from tiny_hf import D, FFN, save_tiny_checkpoint

    src, out, g = save_tiny_checkpoint(tmp_path / "tiny"), tmp_path / "q", 40
    r = run("quantize", str(src), str(out), "--method", "gptq", "--bits", "4", "--group", str(g),
            "--calib", "2", "--calib-window", "64")
    assert r.returncode == 0, r.stderr[-2000:]
    notes = [line for line in r.stdout.splitlines() if line.startswith(f"group {g}:")]
    assert len(notes) == 1, r.stdout
    for names, k in (("wq, wk, wv, wo, w_gate, w_up", D), ("w_down", FFN)):
        assert f"{names} has {k % g} of {g} columns ({k} = {k // g} x {g} + {k % g})" in notes[0]
    model = jaxdec.load(str(src))
    encode = lambda text: model.tokenizer.encode(text, add_special_tokens=False)
    calib = calibrate.calibration_tokens(encode, n_windows=2, window=64)
    params, cfg = transforms.apply("gptq", model.params, model.cfg, calib, bits=4, group_size=g)
    rows = [[1, 50, 34, 28, 42, 31], [97, 28, 12]]
    np.testing.assert_array_equal(api.score(jaxdec.load(str(out)), rows),
                                  api.score(dataclasses.replace(model, params=params, cfg=cfg), rows))
