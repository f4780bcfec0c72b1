"""PARD: the COD layout against its definition re-derived in NumPy, training's packed forward
against the one-forward inference draft, the drafter's state against a stateless forward of
the whole context, lossless greedy speculation, and a loss that training lowers."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import assert_one_line_error
from jaxdec import api, decode
from jaxdec.cache import dense
from jaxdec.models import transformer
from jaxdec.sampling import Greedy, Sample
from jaxdec.speculative import core, pard, small_model
from jaxdec.train import store
from tiny_hf import VOCAB, build

MASK = VOCAB - 2  # the tiny vocabulary has no special tokens; VOCAB - 1 is its EOS


@pytest.fixture(scope="module")
def target():
    _, cfg, params = build("llama", seed=5)
    return api.Model(cfg=cfg, params=params, tokenizer=None)


# ---------------------------------------------------------------------------- COD layout


def np_keep_pattern(rng, length, k):
    """bool[k, L]: copy 0 whole; copy c a random subset of the positions whose predecessor
    in copy c-1 was kept (so every kept entry's chain exists)."""
    keep = np.zeros((k, length), bool)
    keep[0] = True
    for c in range(1, k):
        cand = np.flatnonzero(keep[c - 1][:-1]) + 1
        keep[c, rng.choice(cand, rng.integers(0, len(cand) + 1), replace=False)] = True
    return keep


def np_layout(keep, inputs, labels, weights):
    """The packed entries from the definition: (copy, position) in copy-major order; the
    real token or the mask; label x_{p+1}; and each entry's visible set, listed by name."""
    entries = [(c, p) for c in range(keep.shape[0]) for p in np.flatnonzero(keep[c])]
    tokens = [inputs[p] if c == 0 else MASK for c, p in entries]
    visible = np.zeros((len(entries), len(entries)), bool)
    index = {e: i for i, e in enumerate(entries)}
    for i, (c, p) in enumerate(entries):
        t = p - c  # the real context this entry continues: x_0..x_t
        seen = [(0, j) for j in range(t + 1)] + [(j, t + j) for j in range(1, c + 1)]
        for e in seen:
            visible[i, index[e]] = True  # KeyError if COD dropped a chain member
    pos = np.array([p for _, p in entries])
    return np.array(tokens), pos, visible, labels[pos], weights[pos]


def test_cod_mask_and_packing_match_the_definition():
    """Random keep patterns (not COD's sampler): tokens, positions, labels and the mask
    built by `pard` equal the entries and visible sets listed one by one."""
    rng = np.random.default_rng()
    for _ in range(5):
        k, length = int(rng.integers(2, 6)), int(rng.integers(6, 20))
        keep = np_keep_pattern(rng, length, k)
        row = rng.integers(0, VOCAB - 2, length + 1)
        weights = rng.random(length + 1).astype(np.float32)
        want_tok, want_pos, want_mask, want_lab, want_w = np_layout(keep, row[:-1], row[1:],
                                                                    weights[1:])
        copies = pard.cod_copies(tuple(keep.sum(1)))
        pos = jnp.asarray(want_pos[None], jnp.int32)
        np.testing.assert_array_equal(pard.pack(jnp.asarray(row[None, :-1]), copies, pos, MASK)[0],
                                      want_tok)
        np.testing.assert_array_equal(np.asarray(pard.cod_mask(copies, pos))[0], want_mask)
        np.testing.assert_array_equal(np.take(row[1:], want_pos), want_lab)
        np.testing.assert_array_equal(np.take(weights[1:], want_pos), want_w)


def test_cod_keep_draws_chains_of_the_paper_sizes():
    """COD's sampler: copy 0 whole, len * max(r^c, r_min) of copy c, each kept entry's
    predecessor kept, positions with a counting label preferred, draws that differ."""
    rng = np.random.default_rng()
    length, k, r, r_min = 40, 5, 0.7, 0.2
    counts = pard.cod_counts(length, k, r, r_min)
    assert counts == (40, 28, 19, 13, 9)  # floor(40 * [1, .7, .49, .343, max(.24, .2)])
    assert pard.cod_counts(10, 4, 1.0, 0.2) == (10, 9, 8, 7)  # no dropping: all that fit
    weights = (np.arange(length) >= 12).astype(np.float32)  # a 12-token prompt
    draws = []
    for seed in rng.integers(0, 2**31, 3):
        pos = np.asarray(pard.cod_keep(jax.random.key(int(seed)), jnp.asarray(weights), counts))
        copies = pard.cod_copies(counts)
        keep = np.zeros((k, length), bool)
        keep[copies, pos] = True
        assert (keep.sum(1) == counts).all() and keep[0].all()
        for c in range(1, k):
            sel = pos[copies == c]
            assert (np.diff(sel) > 0).all() and keep[c - 1, sel - 1].all()
        assert (weights[pos[copies == 1]] > 0).all()  # 28 candidates count: only those
        draws.append(pos)
    assert not all((d == draws[0]).all() for d in draws[1:])


# ---------------------------------------------------------------------------- training = inference


def truncated_drafter(target, n_layers, k):
    cfg, params = small_model.truncated(target.cfg, target.params, n_layers)
    return pard.Pard(cfg=cfg, k=k, mask_id=MASK, params=params)


def ragged(rng, lens):
    rows = np.zeros((len(lens), max(lens)), np.int32)
    for i, n in enumerate(lens):
        rows[i, :n] = rng.integers(0, VOCAB - 2, n)
    return rows, np.asarray(lens, np.int32)


def prefilled(drafter, prompts, lens, capacity=64):
    state = drafter.init(drafter.params, len(lens), capacity, jnp.float32)
    return jax.jit(drafter.prefill)(drafter.params, state, prompts, lens, ())


def inference_logits(drafter, prompts, lens, last):
    """The k logits of one draft after prefilling `prompts` (ragged) and feeding `last`."""
    logits, _ = jax.jit(drafter.draft_logits)(drafter.params, prefilled(drafter, prompts, lens),
                                              jnp.asarray(last), jnp.ones(len(lens), bool))
    return np.asarray(logits)


@partial(jax.jit, static_argnames="cfg")
def stateless_logits(params, seq, n, *, cfg):
    """Logits [T, V] of one sequence i32[T] scored causally without a cache; its first n
    tokens are real, the rest padding (one compile for every length)."""
    t = seq.shape[0]
    positions = jnp.where(jnp.arange(t) < n, jnp.arange(t), -1)[None]
    return transformer.forward(params, seq[None], positions, None, cfg)[0][0]


def test_packed_training_forward_equals_the_inference_draft(target):
    """With no dropping (r = 1), copy c at position t + c of the packed forward gives the
    logits the inference draft gives at its c-th mask after the context x_0..x_t."""
    rng = np.random.default_rng()
    k, length = 4, 24
    drafter = truncated_drafter(target, 2, k)
    rows = rng.integers(0, VOCAB - 2, (3, length)).astype(np.int32)
    counts = pard.cod_counts(length, k, 1.0, 1.0)
    pos = jax.vmap(lambda key: pard.cod_keep(key, jnp.ones(length), counts))(
        jax.random.split(jax.random.key(0), 3))
    copies = pard.cod_copies(counts)
    forward = jax.jit(pard.packed_hidden, static_argnums=(1, 5))
    h = forward(drafter.params, drafter.cfg, jnp.asarray(rows), copies, pos, MASK)
    packed = np.asarray(transformer.logits_from_hidden(drafter.params, h))
    ends = rng.integers(1, length - k + 1, 3)  # row b's context is x_0..x_t, t = ends[b]
    got = inference_logits(drafter, rows, ends, rows[np.arange(3), ends])
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    for b, t in enumerate(ends):
        for c in range(k):
            j = starts[c] + int(np.flatnonzero(np.asarray(pos[b, starts[c]:]) == t + c)[0])
            np.testing.assert_allclose(got[b, c], packed[b, j], rtol=2e-4, atol=2e-4)


def test_draft_state_follows_the_accepted_context(target):
    """Rounds with random accepted counts (0..k) and idle rows: every draft's logits equal a
    stateless forward of the row's whole verified context + `last` + k - 1 masks."""
    rng = np.random.default_rng()
    k = 3
    drafter = truncated_drafter(target, 2, k)
    prompts, lens = ragged(rng, [5, 9, 2])
    contexts = [list(prompts[i, :n]) for i, n in enumerate(lens)]
    state = prefilled(drafter, prompts, lens, 96)
    step, score = jax.jit(drafter.draft_logits), partial(stateless_logits, cfg=drafter.cfg)
    for _ in range(6):
        last = rng.integers(0, VOCAB - 2, 3).astype(np.int32)
        active = rng.random(3) < 0.8
        logits, state = step(drafter.params, state, jnp.asarray(last), jnp.asarray(active))
        for b in np.flatnonzero(active):
            seq = contexts[b] + [last[b]] + [MASK] * (k - 1)
            want = score(drafter.params, np.resize(np.array(seq, np.int32), 64), len(seq))
            np.testing.assert_allclose(np.asarray(logits[b]), np.asarray(want)[len(seq) - k:len(seq)],
                                       rtol=2e-4, atol=2e-4)
        drafts = rng.integers(0, VOCAB - 2, (3, k)).astype(np.int32)
        n_acc = rng.integers(0, k + 1, 3).astype(np.int32)
        chunk = np.concatenate([last[:, None], drafts], 1)
        state = drafter.accept(drafter.params, state, chunk, (), n_acc, active)
        for b in np.flatnonzero(active):
            contexts[b] += [last[b]] + list(drafts[b, :n_acc[b]])


# ---------------------------------------------------------------------------- lossless


@pytest.mark.parametrize("n_layers", [2, 3])
def test_greedy_speculation_is_plain_greedy(target, n_layers):
    """An untrained PARD drafter (a truncated target) under `core.generate`: ragged rows
    with their own limits get exactly plain greedy decoding's tokens."""
    rng = np.random.default_rng()
    cfg, params = target.cfg, target.params
    prompts, lens = ragged(rng, [6, 15, 3, 10])
    limits = np.array([20, 7, 20, 14], np.int32)
    cache = dense.init_cache(cfg, 4, 64)
    want, _ = decode.generate_tokens(params, cache, prompts, lens, jax.random.key(0), limits,
                                     sampler=Greedy(), cfg=cfg, max_new_tokens=20,
                                     stop_ids=cfg.eos_ids)
    drafter = truncated_drafter(target, n_layers, 3)
    got, _ = core.generate(params, drafter.params, dense.init_cache(cfg, 4, 64), prompts, lens,
                           jax.random.key(0), limits, sampler=Greedy(), cfg=cfg, drafter=drafter,
                           max_new_tokens=20, stop_ids=cfg.eos_ids)
    np.testing.assert_array_equal(np.asarray(got.n_generated), np.asarray(want.n_generated))
    np.testing.assert_array_equal(np.asarray(got.tokens)[:, :20], np.asarray(want.tokens))
    assert np.asarray(got.accepted)[1:].sum() > 0  # some drafts were kept


def test_sampling_drafts_carry_their_proposal(target):
    """Under sampling, draft i is drawn from q_i, the filtered softmax of its logits."""
    drafter = truncated_drafter(target, 2, 3)
    prompts, lens = ragged(np.random.default_rng(), [7, 4])
    state = prefilled(drafter, prompts, lens, 32)
    sampler = Sample(temperature=0.8, top_k=20)
    last, active = jnp.array([3, 4]), jnp.ones(2, bool)
    logits, _ = jax.jit(drafter.draft_logits)(drafter.params, state, last, active)
    draft = jax.jit(drafter.draft, static_argnums=5)
    tokens, q, _ = draft(drafter.params, state, last, active, jax.random.key(1), sampler)
    want = jax.nn.softmax(sampler.filter(logits.reshape(-1, VOCAB)), -1).reshape(q.shape)
    np.testing.assert_allclose(np.asarray(q), np.asarray(want), rtol=1e-5, atol=1e-7)
    assert (np.take_along_axis(np.asarray(q), np.asarray(tokens)[..., None], -1) > 0).all()


# ---------------------------------------------------------------------------- the task


def tiny_batch(target, rng, b=3, t=20, prompt=6):
    tokens = rng.integers(0, VOCAB - 2, (b, t)).astype(np.int32)
    h, _ = transformer.hidden(target.params, tokens, np.broadcast_to(np.arange(t), (b, t)),
                              None, target.cfg)
    mask = (np.arange(t) >= prompt).astype(np.float32)[None].repeat(b, 0)
    return {"tokens": jnp.asarray(tokens), "mask": jnp.asarray(mask),
            "taps": jnp.zeros((b, t, 0, target.cfg.d_model), jnp.bfloat16),
            "final": h.astype(jnp.bfloat16)}


@pytest.mark.parametrize("loss", ["fkl", "ce"])
def test_a_few_steps_lower_the_loss(target, loss):
    rng = np.random.default_rng()
    task = pard.PardTask.for_target(target, None, n_layers=2, k=3, loss=loss)
    assert task.mask_id == MASK
    params, frozen = task.init(jax.random.key(0)), task.frozen(target)
    assert params.embed is None and params.lm_head is None  # only the layers train
    batch, key = tiny_batch(target, rng), jax.random.key(int(rng.integers(2**31)))
    opt = optax.adam(3e-3)

    @jax.jit
    def step(params, opt_state):
        (value, metrics), grads = jax.value_and_grad(task.loss, has_aux=True)(
            params, frozen, batch, key)
        updates, opt_state = opt.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state, value, metrics

    opt_state, values = opt.init(params), []
    for _ in range(8):
        params, opt_state, value, metrics = step(params, opt_state)
        values.append(float(value))
    assert set(metrics) == {"top1_1", "top1_2", "top1_3"}
    assert np.isfinite(values).all() and values[-1] < 0.8 * values[0], values


def test_checkpoint_round_trip_and_bad_options(target, tmp_path):
    task = pard.PardTask.for_target(target, None, n_layers=2, k=3, train_embeddings=True)
    params = task.init(jax.random.key(0))
    params = dataclasses.replace(params, final_norm=params.final_norm * 1.5)
    path = store.save_drafter(tmp_path / "d", task, params, {"target": store.target_info(target)})
    loaded = store.load_drafter(path, target)
    assert loaded == task.drafter(params)  # cfg, k, mask id
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(task.drafter(params).params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    make = pard.PardTask.for_target
    assert_one_line_error(make, target, None, k=0, match="at least 1 token")
    assert_one_line_error(make, target, None, r=1.5, match="COD keeps")
    assert_one_line_error(make, target, None, mask_id=VOCAB, match="outside the vocabulary")
    assert_one_line_error(make, target, None, n_layers=9, match="keeps 1..3 layers")
