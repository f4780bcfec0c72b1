"""EAGLE-3 drafter (jaxdec.speculative.eagle3) on a tiny random Llama: training matches inference,
the loss against a float64 NumPy definition, the vocabulary map, lossless generation."""

from __future__ import annotations

import collections
import dataclasses
import math
import types
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxdec import api, decode, layers, pytree, sampling
from jaxdec.cache import dense
from jaxdec.errors import JaxdecError
from jaxdec.models import transformer
from jaxdec.formats.qarray import QArray
from jaxdec.speculative import core, drafters, eagle3
from jaxdec.speculative.tree import TreeSpec
from jaxdec.train import loop
from conftest import assert_one_line_error
from tests import tiny_hf

TAPS = (0, 1, 2)
WIDTH = 24  # every whole sequence is padded to this width: one compile per function


@pytest.fixture(scope="module")
def tiny():
    _, cfg, params = tiny_hf.build("llama", 0)
    return types.SimpleNamespace(cfg=cfg, params=params)


def target_features(model, tokens):
    """(final hidden [B, T, D], taps tuple of [B, T, D]) of whole sequences, no cache."""
    return _features(model.params, jnp.asarray(tokens, jnp.int32), model.cfg)


@partial(jax.jit, static_argnames="cfg")
def _features(params, tokens, cfg):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    h, _, taps = transformer.hidden_and_taps(params, tokens, positions, None, cfg, taps=TAPS)
    return h, taps


ttt_logits = jax.jit(eagle3.ttt_logits, static_argnames=("steps", "cfg"))


def jitted(drafter):
    """The drafter's methods, each one jitted program (the sampler static)."""
    return types.SimpleNamespace(
        prefill=jax.jit(drafter.prefill), accept=jax.jit(drafter.accept),
        draft=jax.jit(drafter.draft, static_argnums=5), draft_tree=jax.jit(drafter.draft_tree))


def make_task(model, rng, **kw):
    data = {"tokens": rng.integers(0, model.cfg.vocab_size, (8, 40)), "mask": np.ones((8, 40))}
    kw = {"draft_vocab": 96, "unroll": 3, "k": 3, "taps": TAPS, **kw}
    return eagle3.Eagle3Task.for_target(model, data, **kw)


def strong_params(task, seed):
    """Random drafter weights of unit-variance outputs (not the small init), so that its
    distributions are far from uniform and argmaxes are not near ties."""
    rng = np.random.default_rng(seed)

    def draw(spec: pytree.ParamSpec):
        if spec.init == "ones":
            return jnp.asarray(1 + 0.2 * rng.standard_normal(spec.shape), jnp.float32)
        fan_in = math.prod(spec.shape[: spec.n_in or 1])
        return jnp.asarray(rng.standard_normal(spec.shape) / math.sqrt(fan_in), jnp.float32)

    return pytree.map_specs(draw, eagle3.declare(task.cfg))


# ---------------------------------------------------------------------------- vocabulary


def test_default_taps():
    assert eagle3.default_taps(30) == (2, 15, 27)  # SmolLM2
    assert eagle3.default_taps(24) == (2, 12, 21)  # Qwen2.5-0.5B


def test_vocab_map_keeps_the_most_frequent_tokens():
    rng = np.random.default_rng()
    v, n = 300, 40
    tokens = rng.integers(0, v, (6, 50)) ** 2 % v  # a skewed distribution
    mask = rng.random((6, 50)) < 0.7
    counts = eagle3.token_counts([{"tokens": tokens[:3], "mask": mask[:3]},
                                  {"tokens": tokens[3:], "mask": mask[3:]}], v)
    want = collections.Counter(tokens[mask].tolist())
    assert counts.tolist() == [want.get(i, 0) for i in range(v)]
    d2t, t2d = eagle3.vocab_map(counts, n)
    assert d2t.shape == (n,) and d2t.dtype == np.int32 and t2d.shape == (v,)
    assert t2d[d2t].all() and t2d.sum() == n and (np.diff(d2t) > 0).all()
    kept, dropped = counts[t2d], counts[~t2d]
    assert kept.min() >= dropped.max()
    # ties at the cut go to the lower ids
    at_cut = np.flatnonzero(counts == kept.min())
    assert t2d[at_cut].tolist() == sorted(t2d[at_cut].tolist(), reverse=True)


def test_bad_settings_raise(tiny):
    rng = np.random.default_rng()
    with pytest.raises(JaxdecError, match="draft vocabulary"):
        make_task(tiny, rng, draft_vocab=tiny.cfg.vocab_size + 1)
    with pytest.raises(JaxdecError, match="depth"):
        make_task(tiny, rng, k=2, tree=TreeSpec(depth=3, top_k=2, budget=4))
    with pytest.raises(JaxdecError, match="unroll"):
        make_task(tiny, rng, unroll=0)


# ---------------------------------------------------------------------------- training = inference


def _padded(rows, width):
    return api.pad_rows(rows, width=width)[0]


def _check_drafts(model, drafter, task, seqs, last, toks, q, rows):
    """The drafts (and q) of rows equal the TTT unroll's over seq + [last] + drafts[:-1],
    read at the chain whose context ends at the seq's last token."""
    k = drafter.k
    full = [list(seqs[b]) + [int(last[b])] + [int(t) for t in toks[b, : k - 1]] for b in range(len(seqs))]
    tokens = _padded(full, WIDTH)
    _, taps = target_features(model, tokens)
    logits = ttt_logits(drafter.params.net, drafter.params.embed, jnp.concatenate(taps, -1),
                        jnp.asarray(tokens), steps=k, cfg=task.cfg)
    d2t = np.asarray(task.d2t)
    for b in rows:
        at = np.asarray(logits[:, b, len(seqs[b]) - 1])  # [k, Vd]
        if q is None:
            np.testing.assert_array_equal(d2t[at.argmax(-1)], np.asarray(toks[b]))
        else:  # sampled drafts: their probabilities, given the drafts sampled before them
            want = np.zeros((k, model.cfg.vocab_size))
            want[:, d2t] = np.asarray(jax.nn.softmax(at, axis=-1))
            np.testing.assert_allclose(np.asarray(q[b]), want, atol=2e-5)


def _prefilled(model, drafter, lens, rng):
    """Random prompts of `lens` tokens prefilled into a fresh drafter state -> (prompt
    rows, params, jitted drafter, state, each row's newest token)."""
    seqs = [rng.integers(0, model.cfg.vocab_size, n).tolist() for n in lens]
    prompts = _padded(seqs, WIDTH)
    _, taps = target_features(model, prompts)
    dp, run = drafter.params, jitted(drafter)
    state = drafter.init(dp, len(lens), 64, jnp.float32)
    state = run.prefill(dp, state, jnp.asarray(prompts), jnp.asarray(lens), taps)
    return seqs, dp, run, state, rng.integers(0, model.cfg.vocab_size, len(lens))


@pytest.mark.parametrize("sampler", [sampling.Greedy(), sampling.Sample(temperature=1.0)],
                         ids=["greedy", "sample"])
def test_cached_drafting_matches_the_ttt_unroll(tiny, sampler):
    """prefill + draft, accept + draft again: the drafts and their probabilities are the
    training forward's (no cache, whole sequences) for the same tokens; rows not active
    keep their state."""
    rng = np.random.default_rng()
    task = make_task(tiny, rng, k=3)
    drafter = task.drafter(strong_params(task, seed=1))
    lens = np.array([7, 4, 9])
    seqs, dp, run, state, last = _prefilled(tiny, drafter, lens, rng)
    active = jnp.ones(3, bool)
    toks, q, state = run.draft(dp, state, jnp.asarray(last, jnp.int32), active,
                                   jax.random.key(0), sampler)
    assert (q is None) == isinstance(sampler, sampling.Greedy)
    _check_drafts(tiny, drafter, task, seqs, last, np.asarray(toks), q, range(3))

    # verification kept n_acc drafts; the target's features of [last, d_1..d_k]
    n_acc = rng.integers(0, drafter.k + 1, 3)
    chunk = np.concatenate([last[:, None], np.asarray(toks)], axis=1)
    full = [seqs[b] + chunk[b].tolist() for b in range(3)]
    _, taps = target_features(tiny, _padded(full, WIDTH))
    at = lens[:, None] + np.arange(drafter.k + 1)
    feats = tuple(jnp.take_along_axis(t, jnp.asarray(at)[:, :, None], axis=1) for t in taps)
    state = run.accept(dp, state, jnp.asarray(chunk), feats, jnp.asarray(n_acc, jnp.int32), active)
    seqs = [seqs[b] + chunk[b, : n_acc[b] + 1].tolist() for b in range(3)]
    last = rng.integers(0, tiny.cfg.vocab_size, 3)
    active = jnp.array([True, True, False])
    before = state
    toks, q, state = run.draft(dp, state, jnp.asarray(last, jnp.int32), active,
                               jax.random.key(1), sampler)
    _check_drafts(tiny, drafter, task, seqs, last, np.asarray(toks), q, range(2))
    for a, b in zip((state.cache.lengths, state.feats, state.tokens, state.count),
                    (before.cache.lengths, before.feats, before.tokens, before.count)):
        np.testing.assert_array_equal(np.asarray(a)[2], np.asarray(b)[2])
    assert (np.asarray(state.count)[:2] == 0).all() and int(before.count[2]) > 0


def _tree_reference(model, drafter, task, seq, last, spec):
    """EAGLE-2's dynamic tree built in Python from the TTT unroll's logits along each path
    -> (target ids [N], parents [N])."""
    d2t = np.asarray(task.d2t)

    def logp(path):  # the draft log-probabilities after seq, last, path
        tokens = _padded([seq + [last] + [int(d2t[p]) for p in path]], WIDTH)
        _, taps = target_features(model, tokens)
        lg = ttt_logits(drafter.params.net, drafter.params.embed, jnp.concatenate(taps, -1),
                        jnp.asarray(tokens), steps=spec.depth, cfg=task.cfg)
        return np.asarray(jax.nn.log_softmax(lg[len(path), 0, len(seq) - 1]), np.float64)

    def children(path, score, cid):
        lp = logp(path)
        top = np.argsort(-lp, kind="stable")[: spec.top_k]
        return [(path + [int(t)], score + lp[t], cid) for t in top]

    cands = [(p, s, -1) for p, s, _ in children([], 0.0, -1)]
    frontier = list(range(len(cands)))
    for _ in range(1, spec.depth):
        chosen = sorted(frontier, key=lambda c: -cands[c][1])[: spec.top_k]
        frontier = []
        for c in chosen:
            for kid in children(cands[c][0], cands[c][1], c):
                frontier.append(len(cands))
                cands.append(kid)
    keep = sorted(sorted(range(len(cands)), key=lambda c: (-cands[c][1], c))[: spec.budget])
    node = {c: i + 1 for i, c in enumerate(keep)}
    return (np.array([d2t[cands[c][0][-1]] for c in keep]),
            np.array([node.get(cands[c][2], 0) for c in keep]))


def test_draft_tree_is_eagle2s_tree_over_the_ttt_logits(tiny):
    """draft_tree's nodes and parents equal a Python EAGLE-2 tree built from the training
    forward's logits along each path (the drafter's tree attention sees exactly the
    context and each node's ancestors)."""
    rng = np.random.default_rng()
    spec = TreeSpec(depth=3, top_k=3, budget=9)
    task = make_task(tiny, rng, k=3, tree=spec)
    drafter = task.drafter(strong_params(task, seed=2))
    seqs, dp, run, state, last = _prefilled(tiny, drafter, np.array([6, 9]), rng)
    tokens, parents, _ = run.draft_tree(dp, state, jnp.asarray(last, jnp.int32),
                                            jnp.ones(2, bool), jax.random.key(0))
    for b in range(2):
        want_tokens, want_parents = _tree_reference(tiny, drafter, task, seqs[b], int(last[b]), spec)
        np.testing.assert_array_equal(np.asarray(parents[b]), want_parents)
        np.testing.assert_array_equal(np.asarray(tokens[b]), want_tokens)


# ---------------------------------------------------------------------------- the loss


def _np_rms(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)


def _np_rope(x, pos, inv_freq):
    ang = pos[..., None].astype(np.float64) * inv_freq  # [B, T, H/2]
    cos, sin = np.cos(ang)[:, :, None], np.sin(ang)[:, :, None]
    x1, x2 = np.split(x, 2, -1)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _np_ttt_logits(p, table, feats, tokens, steps, cfg):
    """The TTT unroll in float64 NumPy, its attention one softmax over the keys of every
    step concatenated under an explicit mask: (chain i, step s) is visible to (chain j,
    step t) when s == 0 and i <= j, or 1 <= s <= t and i == j."""
    t_cfg = cfg.target
    eps, (b, t) = t_cfg.norm_eps, tokens.shape
    inv_freq = layers.rope_inv_freq(t_cfg.head_dim, t_cfg.rope_theta, t_cfg.rope_scaling).astype(np.float64)
    g = feats @ p.fc
    emb = table[tokens]
    keys, vals, out = [], [], []
    j = np.arange(t)
    for s in range(steps):
        e = np.concatenate([emb[:, s + 1:], np.zeros((b, min(s + 1, t), emb.shape[2]))], 1)
        x = np.concatenate([_np_rms(e, p.emb_norm, eps), _np_rms(g, p.hid_norm, eps)], -1)
        pos = np.broadcast_to(j + s, (b, t))
        q = _np_rope(np.einsum("btd,dnh->btnh", x, p.attn.wq), pos, inv_freq)
        keys.append(_np_rope(np.einsum("btd,dkh->btkh", x, p.attn.wk), pos, inv_freq))
        vals.append(np.einsum("btd,dkh->btkh", x, p.attn.wv))
        mask = np.concatenate([j[None] <= j[:, None]] + [np.eye(t, dtype=bool)] * s, 1)  # [T, (s+1)T]
        k_all, v_all = np.concatenate(keys, 1), np.concatenate(vals, 1)
        group = q.shape[2] // k_all.shape[2]
        k_all, v_all = np.repeat(k_all, group, 2), np.repeat(v_all, group, 2)
        sc = np.einsum("btnh,bsnh->bnts", q, k_all) / math.sqrt(q.shape[-1])
        sc = np.where(mask, sc, -np.inf)
        w = np.exp(sc - sc.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        a = np.einsum("bnts,bsnh->btnh", w, v_all)
        x = g + np.einsum("btnh,nhd->btd", a, p.attn.wo)
        hm = _np_rms(x, p.mlp_norm, eps)
        gate = hm @ p.mlp.w_gate
        g = x + (gate / (1 + np.exp(-gate)) * (hm @ p.mlp.w_up)) @ p.mlp.w_down
        out.append(_np_rms(g, p.final_norm, eps) @ p.lm_head)
    return out


def _np_loss(logits, target, mask):
    """sum_t 0.8^t mean over masked positions of KL(softmax(target) || softmax(logits_t))."""
    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    b, t, _ = target.shape
    total = 0.0
    for s, lg in enumerate(logits):
        num = den = 0.0
        for r in range(b):
            for j in range(t - s - 2):  # chain j predicts x_{j+s+2} as the target at j+s+1 does
                m = mask[r, j + s + 2]
                lp, lq = log_softmax(target[r, j + s + 1]), log_softmax(lg[r, j])
                num += m * np.sum(np.exp(lp) * (lp - lq))
                den += m
        total += 0.8 ** s * num / max(den, 1.0)
    return total


@pytest.mark.parametrize("unroll", [1, 3])
def test_loss_is_the_weighted_multistep_kl(tiny, unroll):
    rng = np.random.default_rng()
    task = make_task(tiny, rng, unroll=unroll)
    params = strong_params(task, seed=int(rng.integers(1 << 30)))
    tokens = rng.integers(0, tiny.cfg.vocab_size, (2, 12))
    final, taps = target_features(tiny, tokens)
    mask = (rng.random((2, 12)) < 0.8).astype(np.float32)
    batch = {"tokens": jnp.asarray(tokens, jnp.int32), "mask": jnp.asarray(mask),
             "taps": jnp.stack(taps, 2), "final": final}
    frozen = task.frozen(tiny)
    loss, metrics = jax.jit(task.loss)(params, frozen, batch, jax.random.key(0))

    p64 = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    table = np.asarray(tiny.params.lm_head, np.float64).T  # tied embeddings
    feats = np.concatenate([np.asarray(t, np.float64) for t in taps], -1)
    logits = _np_ttt_logits(p64, table, feats, tokens, unroll, task.cfg)
    target = np.asarray(final, np.float64) @ table[task.d2t].T
    want = _np_loss(logits, target, mask)
    np.testing.assert_allclose(float(loss), want, rtol=2e-4)
    steps = [float(metrics[f"kl_{s}"]) for s in range(unroll)]
    np.testing.assert_allclose(float(loss), sum(0.8 ** s * x for s, x in enumerate(steps)), rtol=1e-5)


# ---------------------------------------------------------------------------- distillation, lossless


@pytest.fixture(scope="module")
def trained(tiny):
    """A drafter distilled for a hundred Adam steps on the tiny target's own greedy
    continuations of random prompts -> (task, params, loss curve, the prompts)."""
    rng = np.random.default_rng(0)
    b, plen, new = 16, 8, 24
    prompts = jnp.asarray(rng.integers(0, tiny.cfg.vocab_size, (b, plen)), jnp.int32)
    cache = dense.init_cache(tiny.cfg, b, plen + new)
    out, _ = decode.generate_tokens(tiny.params, cache, prompts, jnp.full(b, plen, jnp.int32),
                                    jax.random.key(0), jnp.full(b, new, jnp.int32),
                                    sampler=sampling.Greedy(), cfg=tiny.cfg, max_new_tokens=new)
    tokens = jnp.concatenate([prompts, out.tokens], 1)
    mask = jnp.concatenate([jnp.zeros((b, plen)), jnp.ones((b, new))], 1)
    task = eagle3.Eagle3Task.for_target(tiny, {"tokens": tokens, "mask": mask}, draft_vocab=64,
                                        unroll=2, k=3, taps=TAPS)
    final, taps = target_features(tiny, tokens)
    batch = {"tokens": tokens, "mask": mask, "taps": jnp.stack(taps, 2).astype(jnp.bfloat16),
             "final": final.astype(jnp.bfloat16)}
    frozen, opt = task.frozen(tiny), optax.adam(3e-3)
    params = task.init(jax.random.key(0))

    @jax.jit
    def step(params, state):
        (loss, _), grads = jax.value_and_grad(task.loss, has_aux=True)(params, frozen, batch, None)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    state, losses = opt.init(params), []
    for _ in range(120):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    return task, params, losses, np.asarray(prompts)


def test_a_few_adam_steps_lower_the_loss(trained):
    _, _, losses, _ = trained
    assert losses[-1] < 0.5 * losses[0], (losses[0], losses[-1])


@pytest.mark.parametrize("tree,weights,kind", [
    (None, None, "dense"), ("3,2,6", None, "dense"), (None, "int8", "dense"),
    *((t, None, k) for k in ("paged", "int8", "int4") for t in (None, "3,2,6"))],
    ids=["chain", "tree", "chain-int8", *(f"{t}-{k}-cache" for k in ("paged", "int8", "int4")
                                         for t in ("chain", "tree"))])
def test_greedy_speculation_is_lossless(tiny, trained, tree, weights, kind):
    """core.generate with the drafter emits exactly plain greedy decoding's tokens over the
    same cache kind, on ragged prompts: two it was trained on (drafts get accepted), two new
    ones. The tree drafter is made as `--draft-tree 3,2,6` makes it, the int8 one as
    `--draft-weights int8` does. Over a paged cache the pool is NaN but where rows write,
    and over a quantised kind the verification chunk reads its keys as stored, as a decode
    step does, so the tokens are plain decoding's on that kind, not dense's."""
    task, params, _, seen = trained
    drafter = task.drafter(params)
    if weights is not None:
        drafter = drafters.with_weights(drafter, weights)
        quantised = [w for w in jax.tree.leaves(drafter.params.net, is_leaf=lambda x: isinstance(x, QArray))
                     if isinstance(w, QArray)]
        assert len(quantised) >= 7 and all(w.bits == 8 for w in quantised), quantised
    if tree is not None:
        drafter = drafters.with_tree(drafter, tree)
        assert drafter.tree == TreeSpec(depth=3, top_k=2, budget=6) and drafter.k == 3
    rng = np.random.default_rng()
    b, new = 4, 20
    lens = np.concatenate([[seen.shape[1]] * 2, rng.integers(3, 11, 2)])
    rows = [*seen[rng.choice(len(seen), 2, replace=False)],
            *(rng.integers(0, tiny.cfg.vocab_size, n) for n in lens[2:])]
    prompts = jnp.asarray(_padded(rows, 10))
    lens, limits = jnp.asarray(lens, jnp.int32), jnp.asarray(rng.integers(8, new + 1, b), jnp.int32)
    cap = core.need_capacity(10, new, drafter)
    run = dict(sampler=sampling.Greedy(), cfg=tiny.cfg, max_new_tokens=new)
    options = dict(fill=np.nan, page_size=8) if kind == "paged" else {}
    cache = lambda: dense.init_cache(tiny.cfg, b, cap, kind=kind, **options)
    want, _ = decode.generate_tokens(tiny.params, cache(), prompts, lens, jax.random.key(0), limits, **run)
    got, _ = core.generate(tiny.params, drafter.params, cache(), prompts, lens, jax.random.key(0),
                           limits, drafter=drafter, **run)
    np.testing.assert_array_equal(np.asarray(got.tokens[:, :new]), np.asarray(want.tokens))
    assert int(jnp.sum(got.accepted[1:])) > 0, np.asarray(got.accepted)


def test_replayed_chains_match_speculative_decoding(tiny, trained):
    """The validation replay (`draft_chains` on the target's greedy continuation, one
    teacher-forced pass, then `replay_chains`) gives the accepted-length histogram that
    speculative decoding of those prompts measures (16 training prompts: drafts accepted)."""
    task, params, _, prompts = trained
    b, plen, new, limit = *prompts.shape, 24, 16
    cache = dense.init_cache(tiny.cfg, b, plen + new)
    run = dict(sampler=sampling.Greedy(), cfg=tiny.cfg)
    out, _ = decode.generate_tokens(tiny.params, cache, jnp.asarray(prompts), jnp.full(b, plen, jnp.int32),
                                    jax.random.key(0), jnp.full(b, new, jnp.int32), max_new_tokens=new, **run)
    tokens = jnp.concatenate([jnp.asarray(prompts), out.tokens], 1)
    mask = np.concatenate([np.zeros((b, plen)), np.ones((b, new))], 1)
    _, taps = target_features(tiny, tokens)
    drafts = jax.jit(task.draft_chains)(params, task.frozen(tiny), {"tokens": tokens,
                                                                    "taps": jnp.stack(taps, 2)})
    hist, emitted = loop.replay_chains(np.asarray(drafts), np.asarray(tokens), mask, n_new=limit)
    drafter = task.drafter(params)
    cap = core.need_capacity(plen, limit, drafter)
    got, _ = core.generate(tiny.params, drafter.params, dense.init_cache(tiny.cfg, b, cap),
                           jnp.asarray(prompts), jnp.full(b, plen, jnp.int32), jax.random.key(0),
                           jnp.full(b, limit, jnp.int32), drafter=drafter, max_new_tokens=limit, **run)
    real = core.stats(got)
    assert sum(real["accepted_hist"][1:]) > 10, real
    assert np.abs(hist - np.asarray(real["accepted_hist"])).sum() <= 2, (hist, real)
    assert abs(emitted / hist.sum() - real["mean_accepted"]) < 0.05, (hist, real)


def test_draft_tree_and_weights_option_errors(tiny, trained):
    task, params, _, _ = trained
    chain = drafters.with_tree(drafters.with_tree(task.drafter(params), "3,2,6"), "chain")
    assert chain.tree is None
    assert drafters.with_tree(task.drafter(params), "3x2x6").tree == TreeSpec(depth=3, top_k=2, budget=6)
    for bad, match in (("3,2", "DEPTH,TOP_K,BUDGET"), ("3x2", "DEPTH,TOP_K,BUDGET"),
                       ("3,y,6", "not an integer"), ("2,2,9", "fewer than 9 candidate")):
        assert_one_line_error(drafters.with_tree, task.drafter(params), bad, match=match)
    small = drafters.load("layers:1", tiny)
    assert_one_line_error(drafters.with_tree, small, "3,2,6", match="drafts chains only")
    assert_one_line_error(drafters.with_weights, task.drafter(params), "bf16", match="int8 or int4")
    assert_one_line_error(drafters.with_weights, small, "int8", match="only an EAGLE-3")


def test_from_meta_rebuilds_the_drafter(tiny, trained):
    task, params, _, _ = trained
    drafter = eagle3.from_meta(task.meta(), params, tiny)
    assert drafter == task.drafter(params)
    np.testing.assert_array_equal(np.asarray(drafter.params.d2t), task.d2t)
    as_dicts = jax.tree.map(np.asarray, dataclasses.asdict(params))
    rebuilt = eagle3.from_meta(task.meta(), as_dicts, tiny).params.net
    for a, b in zip(jax.tree.leaves(rebuilt), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("head", ["target", "frozen"])
def test_head_from_the_target(tiny, head, tmp_path):
    """`head="target"|"frozen"` starts the draft head at the target's LM head columns d2t
    and its final norm: the drafter's logits of a hidden state are the target's own logits
    of the draft vocabulary (a float64 NumPy reference). A frozen head is no trained param:
    AdamW with weight decay leaves it as it was, the checkpoint does not carry it, and the
    loaded drafter takes it from the target again."""
    from jaxdec.train import store

    rng = np.random.default_rng()
    task = make_task(tiny, rng, head=head)
    params = task.init(jax.random.key(int(rng.integers(1 << 30))))
    assert (params.lm_head is None) == (head == "frozen")
    h = rng.standard_normal((2, 5, tiny.cfg.d_model)).astype(np.float32)
    x = h.astype(np.float64)
    x = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + tiny.cfg.norm_eps)
    x = x * np.asarray(tiny.params.final_norm, np.float64)
    want = x @ np.asarray(tiny.params.lm_head, np.float64)[:, task.d2t]
    net = task.drafter(params).params.net
    got = eagle3.draft_logits(net, jnp.asarray(h), task.cfg)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)

    data = {"tokens": rng.integers(0, tiny.cfg.vocab_size, (2, 12)), "mask": np.ones((2, 12))}
    final, taps = target_features(tiny, data["tokens"])
    batch = {**data, "taps": jnp.stack(taps, 2).astype(jnp.bfloat16),
             "final": final.astype(jnp.bfloat16)}
    opt = optax.adamw(1e-2, weight_decay=0.1)
    grads = jax.grad(lambda p: task.loss(p, task.frozen(tiny), batch, None)[0])(params)
    moved = optax.apply_updates(params, opt.update(grads, opt.init(params), params)[0])
    assert (moved.lm_head is None) == (head == "frozen")
    assert not np.array_equal(np.asarray(moved.fc), np.asarray(params.fc))

    target = types.SimpleNamespace(cfg=tiny.cfg, params=tiny.params, source="tiny")
    path = store.save_drafter(tmp_path / "d", task, moved, {"target": store.target_info(target)})
    saved = store.read_meta(path)
    assert (saved["params"]["fields"]["lm_head"] is None) == (head == "frozen")
    assert saved["drafter"]["head"] == head
    loaded = store.load_drafter(path, target).params.net
    jax.tree.map(np.testing.assert_array_equal, loaded, task.drafter(moved).params.net)
    if head == "frozen":
        np.testing.assert_array_equal(np.asarray(loaded.lm_head),
                                      np.asarray(tiny.params.lm_head)[:, task.d2t])

    # A drafter saved before the layout move names its classes jaxdec.spec.*: it still loads.
    meta = path / store.META
    text = meta.read_text()
    assert "jaxdec.speculative." in text
    meta.write_text(text.replace("jaxdec.speculative.", "jaxdec.spec."))
    old = store.load_drafter(path, target).params.net
    jax.tree.map(np.testing.assert_array_equal, old, loaded)


def test_unknown_head_is_an_error(tiny):
    assert_one_line_error(make_task, tiny, np.random.default_rng(), head="tied",
                          match="unknown draft head")
