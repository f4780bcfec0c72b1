"""Drafter distillation: the losses against float64 NumPy, the data against HF
transformers, drafter checkpoints, and a killed training run that resumes exactly."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from conftest import assert_one_line_error
from jaxdec import api, corpora
from jaxdec.train import store
from jaxdec.speculative import small_task as small
from jaxdec.train import data, loop, losses
from tiny_hf import VOCAB, build, byte_tokenizer, save_tiny_checkpoint

REPO = pathlib.Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------- losses


def np_log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def np_kl(p_logits, q_logits):
    lp, lq = np_log_softmax(p_logits), np_log_softmax(q_logits)
    return (np.exp(lp) * (lp - lq)).sum(-1)


def random_case(rng, shape=(3, 7), vocab=50):
    p = rng.standard_normal((*shape, vocab)) * 3
    q = rng.standard_normal((*shape, vocab)) * 3
    mask = (rng.random(shape) < 0.6).astype(np.float32)
    mask[0, 0] = 1.0
    return p.astype(np.float32), q.astype(np.float32), mask


def test_kl_losses_match_numpy():
    p, q, mask = random_case(np.random.default_rng())
    for fn, ref in ((losses.forward_kl, np_kl(p, q)), (losses.reverse_kl, np_kl(q, p))):
        want = (ref * mask).sum() / mask.sum()
        np.testing.assert_allclose(float(fn(jnp.asarray(p), jnp.asarray(q), mask)), want, rtol=1e-5)


def test_cross_entropy_and_agreement_match_numpy():
    rng = np.random.default_rng()
    p, q, mask = random_case(rng)
    labels = rng.integers(0, p.shape[-1], mask.shape)
    nll = -np.take_along_axis(np_log_softmax(q), labels[..., None], -1)[..., 0]
    np.testing.assert_allclose(float(losses.cross_entropy(q, labels, mask)),
                               (nll * mask).sum() / mask.sum(), rtol=1e-5)
    same = (p.argmax(-1) == q.argmax(-1)) * mask
    np.testing.assert_allclose(float(losses.top1_agreement(p, q, mask)), same.sum() / mask.sum())
    assert float(losses.forward_kl(p, q, np.zeros_like(mask))) == 0.0  # empty mask: 0, not NaN


logit_rows = hnp.arrays(np.float32, (2, 9), elements=st.floats(-20, 20, width=32))


@settings(deadline=None, max_examples=40)
@given(logit_rows, logit_rows, st.floats(-5, 5))
def test_kl_nonnegative_and_zero_only_for_equal(a, b, shift):
    kl_ab = np.asarray(losses.kl(a, b))
    assert (kl_ab >= -1e-6).all()
    np.testing.assert_allclose(np.asarray(losses.kl(a, a + np.float32(shift))), 0, atol=1e-5)
    gap = np.abs(np.exp(np_log_softmax(a)) - np.exp(np_log_softmax(b))).sum(-1)
    assert (kl_ab[gap > 1e-2] > 0).all()  # distinct distributions: strictly positive


# ---------------------------------------------------------------------------- data


@pytest.fixture(scope="module")
def tiny():
    hf, cfg, params = build("llama", seed=5)
    return hf, api.Model(cfg=cfg, params=params, tokenizer=None, source="tiny-llama-5")


def test_prompt_splits_are_disjoint_document_prefixes():
    tok = byte_tokenizer()
    train = data.prompt_set(tok, split="train", prompt_len=20, n=60)
    held = data.heldout_prompts(tok, 30, prompt_len=20)
    assert all(len(r) == 20 for r in train + held)
    assert not {tuple(r) for r in train} & {tuple(r) for r in held}
    prose = [d for i, d in enumerate(data.documents("prose")) if i % 10 == 9]
    code = [d for i, d in enumerate(data.documents("code")) if i % 10 == 9]
    first = lambda docs: next(tok.encode(d)[:20] for d in docs if len(tok.encode(d)) >= 20)
    assert held[0] == first(prose) and held[1] == first(code)  # interleaved corpora
    assert_one_line_error(data.prompt_set, tok, split="test", match="unknown prompt split")


def test_validation_prompts_mix_the_corpora_from_the_end():
    """Validation takes each corpus's held-out prompts from its end, interleaved as the
    benches' first ones are, and shares none with them."""
    tok = byte_tokenizer()
    prose, code = (data.prompt_set(tok, split="heldout", prompt_len=20, corpus_names=(c,))
                   for c in ("prose", "code"))
    val = data.validation_prompts(tok, 7, prompt_len=20)
    assert val == [prose[-1], code[-1], prose[-2], code[-2], prose[-3], code[-3], prose[-4]]
    assert not {tuple(r) for r in val} & {tuple(r) for r in data.heldout_prompts(tok, 30, prompt_len=20)}
    every = data.prompt_set(tok, split="heldout", prompt_len=20)
    assert sorted(map(tuple, data.validation_prompts(tok, len(every), prompt_len=20))) == sorted(
        map(tuple, every))
    assert_one_line_error(data.validation_prompts, tok, len(every) + 1, prompt_len=20,
                          match="validation prompts")


def test_windows_are_consecutive_cuts_of_training_documents_only():
    """Windows are the training documents' text, joined as they were split, cut into rows
    of 50 tokens (corpora interleaved); no held-out document appears in them."""
    tok = byte_tokenizer()
    rows = data.window_rows(tok, window=50)
    train_docs = lambda name: [d for i, d in enumerate(data.documents(name)) if i % 10 != 9]
    cut = lambda ids: [ids[i: i + 50] for i in range(0, len(ids) - 49, 50)]
    prose = cut(tok.encode(corpora.SEPARATOR.join(train_docs("prose"))))
    code = cut(tok.encode("\n\n\n".join(train_docs("code"))))
    m = min(len(prose), len(code))
    assert len(rows) == len(prose) + len(code)
    assert rows[: 2 * m: 2] == prose[:m] and rows[1: 2 * m: 2] == code[:m]
    assert data.window_rows(tok, window=50, n=5) == [prose[0], code[0], prose[1], code[1], prose[2]]
    text = tok.decode([t for r in rows for t in r])
    held = [d for i, d in enumerate(data.documents("code")) if i % 10 == 9 and len(d) > 400]
    assert held and not any(d in text for d in held[:20])  # held-out documents never appear
    assert_one_line_error(data.window_rows, tok, window=50, n=10**7, match="training documents")
    assert_one_line_error(data.window_rows, tok, window=50, n=-3, match="positive count")


def test_batches_depend_on_seed_and_step_only():
    n, b = 23, 4
    epoch = np.concatenate([data.batch_rows(n, b, 7, s) for s in range(n // b)])
    assert len(set(epoch)) == len(epoch) == (n // b) * b  # each row at most once an epoch
    again = [data.batch_rows(n, b, 7, s) for s in (3, 9, 40)]
    np.testing.assert_array_equal(np.concatenate(again), np.concatenate(
        [data.batch_rows(n, b, 7, s) for s in (3, 9, 40)]))
    assert not np.array_equal(data.batch_rows(n, b, 7, 0), data.batch_rows(n, b, 8, 0))
    assert_one_line_error(data.batch_rows, 3, 4, 0, 0, match="at least that many")


def test_dataset_is_the_targets_greedy_continuation_and_features(tiny, tmp_path, monkeypatch):
    """Tokens: the target's greedy continuation (each generated token is HF's argmax given
    the row so far, up to a float near tie; a row stops early only at EOS); final and taps:
    HF's hidden states (bf16); mask: exactly the generated tokens. A second call loads the
    cached file."""
    hf, model = tiny
    rng = np.random.default_rng()
    prompts = [list(rng.integers(0, VOCAB - 1, n)) for n in (9, 6, 9)]
    n_new, taps = 10, (2, 0)
    ds = data.make_dataset(model, prompts, n_new=n_new, taps=taps, batch=2, cache_dir=tmp_path)
    assert ds.tokens.shape == (3, 9 + n_new) and ds.taps.shape == (3, 9 + n_new, 2, 64)
    for i, p in enumerate(prompts):
        n = len(p) + int(ds.mask[i].sum())
        seq = ds.tokens[i, :n]
        np.testing.assert_array_equal(seq[: len(p)], p)
        assert n == len(p) + n_new or seq[-1] == VOCAB - 1
        with torch.no_grad():
            out = hf(torch.tensor(seq[None].astype(np.int64)), output_hidden_states=True)
        logits = out.logits[0].numpy()[len(p) - 1: n - 1]
        chosen = np.take_along_axis(logits, seq[len(p):, None], 1)[:, 0]
        np.testing.assert_array_less(logits.max(1) - chosen, 1e-4)  # greedy up to a near tie
        t = np.arange(ds.mask.shape[1])
        np.testing.assert_array_equal(ds.mask[i], (t >= len(p)) & (t < n))
        final = ds.final[i, :n].astype(np.float32)
        hs = out.hidden_states
        np.testing.assert_allclose(final, hs[-1][0].numpy(), rtol=2e-2, atol=2e-2)
        for j, layer in enumerate(taps):
            np.testing.assert_allclose(ds.taps[i, :n, j].astype(np.float32), hs[layer][0].numpy(),
                                       rtol=2e-2, atol=2e-2)
    monkeypatch.setattr(data, "_generate", lambda *a: pytest.fail("regenerated"))
    again = data.make_dataset(model, prompts, n_new=n_new, taps=taps, batch=2, cache_dir=tmp_path)
    np.testing.assert_array_equal(again.final.view(np.uint16), ds.final.view(np.uint16))
    for fewer in [(0,), ()]:  # cut from the file above, not regenerated
        cut = data.make_dataset(model, prompts, n_new=n_new, taps=fewer, batch=2,
                                cache_dir=tmp_path)
        assert cut.tap_layers == fewer and cut.taps.shape[2] == len(fewer)
        np.testing.assert_array_equal(cut.taps.view(np.uint16),
                                      ds.taps[:, :, [taps.index(t) for t in fewer]].view(np.uint16))
        np.testing.assert_array_equal(cut.tokens, ds.tokens)
    with pytest.raises(pytest.fail.Exception, match="regenerated"):  # other continuations
        data.make_dataset(model, prompts, n_new=n_new - 1, taps=(), batch=2, cache_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 1  # no temporary file left behind


def test_sampled_continuations_several_per_prompt(tiny, tmp_path):
    """samples=3 at a temperature: each prompt three times over, continued differently (a
    near-uniform random target gives distinct samples), the mask 0 on the prompts; greedy
    or scored rows refuse more than one sample."""
    _, model = tiny
    rng = np.random.default_rng()
    prompts = [list(rng.integers(0, VOCAB - 1, 6)) for _ in range(3)]
    ds = data.make_dataset(model, prompts, n_new=12, batch=2, temperature=1.0, samples=3,
                           cache_dir=tmp_path)
    assert len(ds) == 9 and ds.meta["samples"] == 3 and ds.meta["n_prompts"] == 9
    for i, p in enumerate(prompts):
        rows = ds.tokens[[i, i + 3, i + 6]]
        np.testing.assert_array_equal(rows[:, :6], np.asarray([p] * 3))
        assert len({tuple(r[6:]) for r in rows}) == 3, rows
    np.testing.assert_array_equal(ds.mask[:, :6], 0)
    assert_one_line_error(data.make_dataset, model, prompts, n_new=12, batch=2, samples=2,
                          cache_dir=tmp_path, match="temperature > 0")
    assert_one_line_error(data.make_dataset, model, prompts, n_new=0, batch=2, samples=2,
                          temperature=1.0, cache_dir=tmp_path, match="n_new > 0")


def test_scored_rows_and_concat(tiny, tmp_path):
    """n_new=0 scores the rows as given (HF's hidden states; every token after the first is
    to be predicted); concat pads narrower rows with mask 0."""
    hf, model = tiny
    rng = np.random.default_rng()
    rows = [list(rng.integers(0, VOCAB, n)) for n in (12, 7, 12)]
    ds = data.make_dataset(model, rows, n_new=0, taps=(1,), batch=2, cache_dir=tmp_path)
    assert ds.tokens.shape == (3, 12)
    for i, r in enumerate(rows):
        np.testing.assert_array_equal(ds.tokens[i, : len(r)], r)
        np.testing.assert_array_equal(ds.mask[i], (np.arange(12) >= 1) & (np.arange(12) < len(r)))
        with torch.no_grad():
            hs = hf(torch.tensor(np.asarray(r, np.int64)[None]), output_hidden_states=True).hidden_states
        np.testing.assert_allclose(ds.final[i, : len(r)].astype(np.float32), hs[-1][0].numpy(),
                                   rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(ds.taps[i, : len(r), 0].astype(np.float32), hs[1][0].numpy(),
                                   rtol=2e-2, atol=2e-2)
    short = data.make_dataset(model, [r[:5] for r in rows[:2]], n_new=0, taps=(1,), batch=2,
                              cache_dir=tmp_path)
    both = data.concat([ds, short])
    assert both.tokens.shape == (5, 12) and both.tap_layers == (1,)
    np.testing.assert_array_equal(both.mask[3:, 5:], 0)
    np.testing.assert_array_equal(both.final[3:, :5].view(np.uint16), short.final.view(np.uint16))
    other = data.make_dataset(model, rows, n_new=0, taps=(0,), batch=2, cache_dir=tmp_path)
    assert_one_line_error(data.concat, [ds, other], match="different targets or taps")


# ---------------------------------------------------------------------------- small task


@pytest.fixture(scope="module")
def tiny_data(tiny, tmp_path_factory):
    _, model = tiny
    rng = np.random.default_rng(11)  # fixed: one dataset serves the module
    prompts = [list(rng.integers(0, VOCAB - 1, 9)) for _ in range(16)]
    # shapes as in the test above: its compiled generation serves
    return data.make_dataset(model, prompts, n_new=10, taps=(), batch=2,
                             cache_dir=tmp_path_factory.mktemp("distill"))


def test_small_loss_aligns_draft_and_target_positions(tiny, tiny_data):
    """A full-depth copy of the target drafts the target itself: KL ~ 0 and top-1 = 1 (an
    off-by-one between the two would not be); a 1-layer cut is far from it."""
    _, model = tiny
    batch = tiny_data.rows(np.arange(8))
    for layers, low in ((3, True), (1, False)):
        task = small.SmallDistill.for_target(model, tiny_data, layers=layers)
        loss, metrics = jax.jit(task.loss)(task.init(None), task.frozen(model), batch, None)
        assert (float(loss) < 1e-3) == low, (layers, float(loss))
        assert (float(metrics["top1"]) > 0.97) == low


def test_drafter_checkpoint_round_trip_and_errors(tiny, tiny_data, tmp_path):
    _, model = tiny
    task = small.SmallDistill.for_target(model, tiny_data, layers=2, k=3)
    params = jax.tree.map(lambda x: x + 0.01 * np.random.default_rng().standard_normal(x.shape)
                          .astype(x.dtype), task.init(None))
    path = store.save_drafter(tmp_path / "d", task, params, {"target": store.target_info(model)})
    drafter = store.load_drafter(path, model)
    assert drafter.k == 3 and drafter.cfg == task.cfg
    want = task.drafter(params).params
    jax.tree.map(np.testing.assert_array_equal, drafter.params, want)
    store.save_drafter(path, task, task.init(None))  # replaces a drafter, never in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    (tmp_path / "other").mkdir()
    assert_one_line_error(store.save_drafter, tmp_path / "other", task, params,
                          match="not a drafter checkpoint; refusing")
    assert_one_line_error(store.load_drafter, tmp_path / "nothing", model, match="no drafter.json")
    _, cfg2, params2 = build("qwen2", seed=1)
    other = api.Model(cfg=cfg2, params=params2, tokenizer=None, source="tiny-qwen")
    store.save_drafter(path, task, params, {"target": store.target_info(model)})
    assert_one_line_error(store.load_drafter, path, other, match="trained for target 'tiny-llama-5'")
    (path / "drafter.json").write_text("{not json")
    assert_one_line_error(store.load_drafter, path, model, match="unreadable drafter.json")


# ---------------------------------------------------------------------------- the loop


def test_training_lowers_the_loss_and_saves_the_drafter(tiny, tiny_data, tmp_path):
    _, model = tiny
    task = small.SmallDistill.for_target(model, tiny_data, layers=1)
    cfg = loop.TrainConfig(steps=24, batch_size=4, lr=3e-3, warmup=2, log_every=1, ckpt_every=50)
    result = loop.train(task, model, tiny_data, cfg, tmp_path)
    first = np.mean([h["loss"] for h in result.history[:4]])
    last = np.mean([h["loss"] for h in result.history[-4:]])
    assert last < 0.7 * first, (first, last)
    loaded = store.load_drafter(result.drafter_path, model)
    jax.tree.map(np.testing.assert_array_equal, loaded.params.layers, result.params.layers)
    assert_one_line_error(loop.train, task, model, tiny_data, cfg, tmp_path, resume=False,
                          match="already holds a training run")
    other = dataclasses.replace(cfg, lr=0.5)
    assert_one_line_error(loop.train, task, model, tiny_data, other, tmp_path,
                          match=r"other settings \(train\)")


def test_validation_logs_and_keeps_the_best_drafter(tiny, tiny_data, tmp_path):
    """With validation rows, every eval_every steps (and the last) logs val_loss and the
    task's metrics; OUT/best holds the params of the lowest val_loss (re-evaluated from the
    saved drafter, they give that line's values), and a second call resumes past it."""
    _, model = tiny
    subset = lambda idx: data.Dataset(**tiny_data.rows(idx), meta={**tiny_data.meta, "rows": list(
        map(int, idx))})
    train_rows, val = subset(np.arange(12)), subset(np.arange(12, 16))
    task = small.SmallDistill.for_target(model, train_rows, layers=1)
    cfg = loop.TrainConfig(steps=14, batch_size=4, lr=3e-2, log_every=10, ckpt_every=7,
                           eval_every=3)
    result = loop.train(task, model, train_rows, cfg, tmp_path, val=val)
    evals = [h for h in result.history if "val_loss" in h]
    assert [h["step"] for h in evals] == [3, 6, 9, 12, 14]
    assert [h["step"] for h in result.history if "val_loss" not in h] == [10]
    assert {"val_top1", "val_loss"} <= set(evals[0]) and 0 <= evals[0]["val_top1"] <= 1
    best = min(evals, key=lambda h: h["val_loss"])
    record = store.read_meta(result.best_path)["val"]
    assert record["step"] == best["step"] and record["val_loss"] == best["val_loss"]
    saved = store.load_drafter(result.best_path, model)
    params = dataclasses.replace(result.params, layers=saved.params.layers,
                                 final_norm=saved.params.final_norm)
    again = loop.make_evaluator(task, val, 4, cfg.seed)(params, task.frozen(model))
    np.testing.assert_allclose(again["val_loss"], best["val_loss"], rtol=1e-5)
    assert (best["step"] == 14) == np.array_equal(np.asarray(jax.tree.leaves(
        saved.params.layers)[0]), np.asarray(jax.tree.leaves(result.params.layers)[0]))
    longer = dataclasses.replace(cfg, steps=15)
    assert_one_line_error(loop.train, task, model, train_rows, longer, tmp_path, val=val,
                          match=r"other settings \(train\)")


def test_replay_chains_counts_rounds_as_a_decoder_would():
    """A row of 8 generated tokens (positions 2..9), k=2, drafts set by hand: round 1 (context
    ends at 1) keeps both drafts, round 2 (at 4) none although its second draft matches,
    round 3 (at 5) one, round 4 (at 7) one (its second would be past the data); the last
    round's token past the 8th is not counted. A masked-out row adds nothing."""
    rng = np.random.default_rng()
    tokens = rng.permutation(1000)[:20].reshape(2, 10) + 1
    mask = np.zeros((2, 10))
    mask[0, 2:] = 1
    drafts = np.full((2, 2, 10), -1)
    for j, i, pos in ((0, 1, 3), (1, 1, 4), (1, 4, 7), (0, 5, 7), (0, 7, 9), (0, 2, 4)):
        drafts[j, 0, i] = tokens[0, pos]
    drafts[0, 1] = tokens[1]  # the masked row's "matches" must not count
    hist, emitted = loop.replay_chains(drafts, tokens, mask)
    assert hist.tolist() == [1, 2, 1] and emitted == 7
    hist, emitted = loop.replay_chains(drafts, tokens, mask, n_new=5)
    assert hist.tolist() == [1, 0, 1] and emitted == 4


def test_warm_start_begins_from_the_saved_drafter(tiny, tiny_data, tmp_path):
    """init_from: the new run's first loss is the saved params' loss on its first batch
    (a fresh init's is far higher); k may change, shapes may not; the run records the
    source, so resuming it with another is refused."""
    _, model = tiny
    task = small.SmallDistill.for_target(model, tiny_data, layers=1, k=3)
    cfg = loop.TrainConfig(steps=12, batch_size=4, lr=1e-2, log_every=1, ckpt_every=50,
                           seed=3)
    first = loop.train(task, model, tiny_data, cfg, tmp_path / "a")
    again = dataclasses.replace(task, k=5)
    cfg2 = dataclasses.replace(cfg, steps=4, seed=4)
    warm = loop.train(again, model, tiny_data, cfg2, tmp_path / "b",
                      init_from=first.drafter_path)
    batch = tiny_data.batch(0, cfg2.batch_size, cfg2.seed)
    want, _ = jax.jit(again.loss)(first.params, again.frozen(model), batch, None)
    np.testing.assert_allclose(warm.history[0]["loss"], float(want), rtol=1e-5)
    cold, _ = jax.jit(again.loss)(again.init(None), again.frozen(model), batch, None)
    assert float(want) < 0.7 * float(cold), (float(want), float(cold))
    assert json.loads((tmp_path / "b" / loop.RUN_FILE).read_text())["init"] == str(
        first.drafter_path)
    assert_one_line_error(loop.train, again, model, tiny_data, cfg2, tmp_path / "b",
                          init_from=tmp_path / "a" / "ckpt", match=r"other settings \(init\)")
    assert_one_line_error(loop.train, again, model, tiny_data, cfg2, tmp_path / "c",
                          init_from=tmp_path / "a" / "ckpt", match="no drafter.json")
    deeper = small.SmallDistill.for_target(model, tiny_data, layers=2)
    assert_one_line_error(loop.train, deeper, model, tiny_data, cfg2, tmp_path / "d",
                          init_from=first.drafter_path, match=r"differs in config, layers\)")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """The tiny Llama saved as a jaxdec checkpoint with a byte tokenizer (for the CLI)."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("target") / "tiny", seed=6)


def distill_cli(target, out, cache, *extra):
    """The script on the tiny target; the runs share a compilation cache beside the data."""
    args = [sys.executable, str(REPO / "scripts" / "train_drafter.py"), "--target", str(target),
            "--drafter", "small", "--out", str(out), "--cache-dir", str(cache), "--steps", "8",
            "--batch", "4", "--lr", "1e-2", "--n-prompts", "12", "--prompt-len", "8",
            "--n-new", "8", "--gen-batch", "12", "--layers", "1", "--log-every", "1",
            "--ckpt-every", "3", "--windows", "6", "--window-len", "16", "--val-prompts", "3",
            "--eval-every", "4", *extra]
    env = dict(os.environ, JAXDEC_XLA_CACHE=str(cache / "xla"))
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)


def test_killed_run_resumes_with_identical_losses(tiny_checkpoint, tmp_path):
    """Stopped hard after step 6's checkpoint, with a step logged past it and a torn log
    line, the resumed run logs exactly the losses of an uninterrupted one, its validation
    losses and best drafter too. The data: 12 prompts' continuations and 6 teacher-forced
    windows; 3 held-out prompts' continuations validate."""
    cache = tmp_path / "cache"
    r = distill_cli(tiny_checkpoint, tmp_path / "a", cache, "--stop-after", "5")
    assert r.returncode == 0 and not (tmp_path / "a" / "drafter").exists(), r.stderr
    assert [m["step"] for m in loop.read_metrics(tmp_path / "a")] == list(range(1, 7))
    with open(tmp_path / "a" / loop.METRICS_FILE, "a") as f:
        f.write('{"step": 7, "loss": 123.0}\n{"step": 8, "lo')
    r = distill_cli(tiny_checkpoint, tmp_path / "a", cache)
    assert r.returncode == 0, r.stderr
    r = distill_cli(tiny_checkpoint, tmp_path / "b", cache)
    assert r.returncode == 0, r.stderr
    resumed, straight = loop.read_metrics(tmp_path / "a"), loop.read_metrics(tmp_path / "b")
    assert [m["step"] for m in resumed] == list(range(1, 9))
    np.testing.assert_allclose([m["loss"] for m in resumed], [m["loss"] for m in straight],
                               rtol=1e-6, atol=0)
    val = lambda lines: [(m["step"], m["val_loss"]) for m in lines if "val_loss" in m]
    assert [s for s, _ in val(straight)] == [4, 8]
    np.testing.assert_allclose(val(resumed), val(straight), rtol=1e-6, atol=0)
    assert (store.read_meta(tmp_path / "a" / "best")["val"]
            == store.read_meta(tmp_path / "b" / "best")["val"])
    assert "best by validation loss" in r.stdout
    assert (tmp_path / "a" / "drafter" / "drafter.json").is_file()
    parts = json.loads((tmp_path / "a" / loop.RUN_FILE).read_text())["data"]["parts"]
    assert [(m["n_prompts"], m["n_new"]) for m in parts] == [(12, 8), (6, 0)]
