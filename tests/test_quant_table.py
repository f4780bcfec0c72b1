"""The quality table's harness: rows cached per model and resumed, the table written between
its markers in a document whose other text is kept (no model is loaded here: the evaluator
is replaced by one that counts what it is asked to measure)."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import numpy as np
import pytest

from jaxdec.bench import quant_table

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("quant_quality", ROOT / "scripts" / "quant_quality.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Fake:
    """An Evaluator that measures nothing: random numbers, and a record of its rows."""
    made: list[str] = []
    asked: list[dict] = []

    def __init__(self, name, settings):
        _Fake.made.append(name)
        self.rng = np.random.default_rng()

    def row(self, spec):
        _Fake.asked.append(spec)
        return {**spec, "ppl": {"prose": float(self.rng.uniform(10, 90)), "code": float(self.rng.uniform(2, 9))},
                "agree": float(self.rng.uniform()), "prefix": float(self.rng.integers(0, 256)),
                "bpw": float(self.rng.uniform(2, 9))}


def test_rows_are_cached_and_resumed(tmp_path, monkeypatch):
    monkeypatch.setattr(quant_table, "Evaluator", _Fake)
    _Fake.made, _Fake.asked = [], []
    cache = str(tmp_path / "{model}.json")
    s = quant_table.Settings(windows=3)
    first = quant_table.run(["smollm2"], ["f32", "gptq:3"], s, cache, log=lambda _: None)
    assert [a["method"] for a in _Fake.asked] == ["f32", "gptq"]
    # a rerun with one more row measures only that row; the cached ones come back as stored
    again = quant_table.run(["smollm2"], ["f32", "gptq:3", "Q3_K_M"], s, cache, log=lambda _: None)
    assert [a["method"] for a in _Fake.asked] == ["f32", "gptq", "Q3_K_M"]
    assert again["smollm2"]["gptq:3"] == first["smollm2"]["gptq:3"]
    # all cached: nothing measured, no evaluator (no model load)
    made = len(_Fake.made)
    quant_table.run(["smollm2"], ["gptq:3"], s, cache, log=lambda _: None)
    assert len(_Fake.made) == made and len(_Fake.asked) == 3
    # other settings: the cache does not apply
    quant_table.run(["smollm2"], ["f32"], quant_table.Settings(windows=4), cache, log=lambda _: None)
    assert len(_Fake.asked) == 4
    stored = json.loads((tmp_path / "smollm2.json").read_text())
    assert json.loads(stored["settings"])["windows"] == 4 and list(stored["rows"]) == ["smollm2 f32"]


def test_table_goes_between_the_markers(tmp_path, monkeypatch):
    monkeypatch.setattr(quant_table, "Evaluator", _Fake)
    cache = str(tmp_path / "{model}.json")
    quant_table.run(["smollm2"], ["f32", "awq:4"], quant_table.Settings(), cache, log=lambda _: None)
    doc = tmp_path / "doc.md"
    script = _script()
    doc.write_text(f"# title\n\nbefore\n\n{script.BEGIN}\nold table\n{script.END}\n\nafter\n")
    assert script.main(["--models", "smollm2", "--cached", "--cache", cache, "--out", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# title\n\nbefore\n\n") and text.endswith("\n\nafter\n")
    assert "old table" not in text and "| smollm2 | awq W4 |" in text
    assert text.count(script.BEGIN) == 1 and text.count(script.END) == 1


def test_bad_row_is_one_line_error():
    with pytest.raises(quant_table.JaxdecError, match="bad table row 'gptq:x'"):
        quant_table.parse_row("gptq:x")
    assert _script().main(["--models", "smollm2", "--rows", "nonsense:4"]) == 1


def test_committed_table_is_the_committed_cache():
    """docs/quantization.md's table is what the committed cache renders (no row in the doc
    that no measurement backs, none measured and left out)."""
    script = _script()
    models = sorted(p.stem for p in (ROOT / "docs" / "quant_table").glob("*.json"))
    order = ["smollm2", "qwen2.5-coder-0.5b"]
    models = [m for m in order if m in models] + [m for m in models if m not in order]
    done = quant_table.load_cached(models, str(ROOT / "docs" / "quant_table" / "{model}.json"))
    doc = (ROOT / "docs" / "quantization.md").read_text()
    inside = doc[doc.index(script.BEGIN) + len(script.BEGIN):doc.index(script.END)].strip()
    assert inside == quant_table.table(done)
