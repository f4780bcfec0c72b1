"""The perplexity harness: float64 numerics against an independent reference, the fixed
window split, and the two corpora (fetched once per session)."""

import math
import re

import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import log_softmax

from jaxdec import corpora
from jaxdec.errors import JaxdecError
from jaxdec.perplexity import PerplexityResult, evaluate, perplexity


def _reference_nll(logits: np.ndarray, tokens: np.ndarray) -> float:
    """Mean NLL of tokens[:, 1:] with scipy's float64 log_softmax."""
    logp = log_softmax(logits.astype(np.float64), axis=-1)[:, :-1]  # [B, T-1, V]
    picked = np.take_along_axis(logp, tokens[:, 1:, None].astype(np.int64), axis=-1)
    return float(-picked.mean())


def _table_score_fn(table: np.ndarray):
    """A score_fn that returns fixed logits, checking it is called with the right rows."""
    def score(tokens):
        return table[tokens[:, 0]]  # tokens[:, 0] holds the window's row number
    return score


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_matches_float64_reference(dtype, batch_size):
    rng = np.random.default_rng(0)
    n, t, v = 7, 150, 1000  # t > 64 so several row blocks are used
    logits = (rng.standard_normal((n, t, v)) * 4.0 + 3.0).astype(dtype)
    tokens = rng.integers(0, v, size=(n, t), dtype=np.int32)
    tokens[:, 0] = np.arange(n)
    result = perplexity(_table_score_fn(logits), tokens, batch_size=batch_size)
    want = _reference_nll(logits, tokens)
    assert result.nll == pytest.approx(want, rel=1e-10, abs=0)
    assert result.ppl == pytest.approx(math.exp(want), rel=1e-10, abs=0)
    assert (result.n_tokens, result.n_windows) == (n * (t - 1), n)


def test_result_does_not_depend_on_batch_size_or_array_type():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((5, 20, 64)).astype(np.float32)
    tokens = rng.integers(0, 64, size=(5, 20), dtype=np.int32)
    tokens[:, 0] = np.arange(5)
    table = _table_score_fn(logits)
    results = {perplexity(table, tokens, batch_size=b) for b in (1, 2, 5, 9)}
    results.add(perplexity(lambda x: jnp.asarray(table(x)), tokens, batch_size=2))
    assert len(results) == 1


@pytest.mark.parametrize("v", [2, 1000, 49152, 151936])
def test_uniform_logits_give_vocab_size(v):
    tokens = np.random.default_rng(v).integers(0, v, size=(3, 9), dtype=np.int32)
    result = perplexity(lambda x: np.full((*x.shape, v), 1.5, np.float32), tokens)
    assert result.nll == pytest.approx(math.log(v), rel=1e-14)
    assert result.ppl == pytest.approx(v, rel=1e-12)


def test_bad_logits_shape_is_refused():
    tokens = np.zeros((2, 8), np.int32)
    with pytest.raises(ValueError, match=r"expected \[B, T, V\]"):
        perplexity(lambda x: np.zeros((2, 7, 5)), tokens)


def test_result_str_is_one_line():
    r = PerplexityResult(ppl=12.5, nll=math.log(12.5), n_tokens=1022, n_windows=2,
                         source="prose")
    assert "\n" not in str(r) and "ppl 12.5000" in str(r)


@pytest.mark.parametrize("n_tokens,window", [(10_000, 100), (10_099, 100), (5 * 37 + 3, 5)])
def test_windows_are_fixed_disjoint_and_cover_the_split(n_tokens, window):
    ids = np.arange(n_tokens, dtype=np.int32)
    ev = corpora.make_windows(ids, window=window, split="eval")
    ca = corpora.make_windows(ids, window=window, split="calib")
    n_all = n_tokens // window
    assert len(ca) == (n_all + 1) // 10 and len(ev) == n_all - len(ca)
    assert np.all(ca.index % 10 == 9) and np.all(ev.index % 10 != 9)
    assert sorted([*ev.index, *ca.index]) == list(range(n_all))
    for w in (ev, ca):
        assert w.tokens.dtype == np.int32 and w.tokens.shape == (len(w), window)
        np.testing.assert_array_equal(w.tokens[:, 0], w.index * window)
        np.testing.assert_array_equal(np.asarray(w), w.tokens)
    assert not set(ev.tokens.ravel()) & set(ca.tokens.ravel())
    again = corpora.make_windows(ids, window=window, split="eval")
    np.testing.assert_array_equal(again.tokens, ev.tokens)


def test_max_windows_takes_the_first_of_the_split():
    ids = np.arange(5000, dtype=np.int32)
    full = corpora.make_windows(ids, window=10, split="eval")
    few = corpora.make_windows(ids, window=10, split="eval", max_windows=12)
    np.testing.assert_array_equal(few.tokens, full.tokens[:12])
    assert list(few.index) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12]


def test_bad_split_and_window_are_user_errors():
    with pytest.raises(JaxdecError, match="unknown split"):
        corpora.make_windows(np.arange(100), window=10, split="train")
    with pytest.raises(JaxdecError, match="at least 2"):
        corpora.make_windows(np.arange(100), window=1, split="eval")


def test_document_chunks_rejoin_to_the_text():
    docs = ["a" * 5, "b" * 30, "c", "d" * 70, "e" * 3]
    for size in (1, 10, 40, 1000):
        chunks = list(corpora.document_chunks(docs, chunk_chars=size))
        assert "".join(chunks) == corpora.SEPARATOR.join(docs)


def test_fortune_overstrikes_and_bells_are_cleaned():
    raw = "whiter *___\b\b\band* fresher.\x07\nRen'\be and _\bn \n%\n\n%\nsecond\n"
    assert corpora.split_fortunes(raw) == ["whiter *and* fresher.\nRene and n", "second"]


def test_missing_data_and_missing_apt_name_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXDEC_DATA", str(tmp_path))
    with pytest.raises(JaxdecError, match="jaxdec fetch corpora"):
        corpora.corpus_text("prose")
    monkeypatch.setattr(corpora.shutil, "which", lambda tool: None)
    with pytest.raises(JaxdecError, match=r"apt-get download fortunes=1:1\.99\.1-7\.3"):
        corpora.fetch_corpus("prose", progress=lambda s: None)
    with pytest.raises(JaxdecError, match="unknown corpus"):
        corpora.corpus_text("poetry")


@pytest.fixture(scope="session")
def fetched():
    """Fetch the corpora once (`make test` has fetched them: this finds them in place); a
    fetch that cannot run fails the tests that need them."""
    for name in corpora.CORPORA:
        corpora.fetch_corpus(name, progress=lambda s: None)
    return corpora.CORPORA


@pytest.fixture(scope="session")
def smollm2_encode():
    from jaxdec.checkpoint import registry
    import transformers

    p = registry.resolve("smollm2")
    tok = transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    return lambda text: tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("name", corpora.CORPORA)
def test_corpus_text_is_clean_and_large(fetched, name):
    text = corpora.corpus_text(name)
    assert len(text) >= 200_000
    assert text == corpora.corpus_text(name)
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f\ufffd]", text)
    assert sum(c.isascii() for c in text) / len(text) > 0.999
    letters = sum(c.isalpha() for c in text) / len(text)
    assert letters > (0.6 if name == "prose" else 0.4)


@pytest.mark.parametrize("name", corpora.CORPORA)
def test_corpus_has_50k_smollm2_tokens(fetched, smollm2_encode, name):
    ids = corpora.corpus_token_ids(name, smollm2_encode)
    assert ids.dtype == np.int32 and ids.shape[0] >= 50_000
    whole = smollm2_encode(corpora.corpus_text(name))
    assert abs(len(whole) - ids.shape[0]) <= 100  # chunking changes only chunk seams
    assert len(corpora.make_windows(ids, window=512, split="eval")) >= 80


def test_evaluate_wires_corpus_windows_and_source(fetched):
    v = 256
    result = evaluate(lambda x: np.zeros((*x.shape, v), np.float32),
                      lambda text: list(text.encode("utf-8")), "code", window=64,
                      max_windows=5, batch_size=2)
    assert result.n_windows == 5 and result.n_tokens == 5 * 63
    assert result.ppl == pytest.approx(v, rel=1e-12)
    assert "CPython" in result.source and "eval split" in result.source
