"""The speculative core against plain decoding: greedy tokens identical (chains, trees,
batched ragged rows), and under sampling the target's distribution (a chi-square test that
a deliberately biased verifier fails)."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_fits, assert_one_line_error, chi2_pvalue, exact_joint
from jaxdec import decode
from jaxdec.cache import dense
from jaxdec.config import ModelConfig
from jaxdec.errors import JaxdecError
from jaxdec.models import transformer
from jaxdec.pytree import init_params
from jaxdec.sampling import Greedy, Sample
from jaxdec.speculative import core, small_model, tree
from tiny_hf import VOCAB, build


@pytest.fixture(scope="module")
def tiny():
    _, cfg, params = build("llama", seed=3)
    return cfg, params


def ragged_prompts(rng, lens, vocab):
    prompts = np.zeros((len(lens), max(lens)), np.int32)
    for i, n in enumerate(lens):
        prompts[i, :n] = rng.integers(0, vocab - 1, n)
    return prompts, np.asarray(lens, np.int32)


def plain(cfg, params, prompts, lens, limits, n, sampler=Greedy(), seed=0):
    cache = dense.init_cache(cfg, len(lens), 128)
    prog, _ = decode.generate_tokens(params, cache, prompts, lens, jax.random.key(seed), limits,
                                     sampler=sampler, cfg=cfg, max_new_tokens=n, stop_ids=cfg.eos_ids)
    return np.asarray(prog.tokens), np.asarray(prog.n_generated)


def speculate(cfg, params, drafter, prompts, lens, limits, n, sampler=Greedy(), seed=0, cap=128):
    cache = dense.init_cache(cfg, len(lens), cap)
    prog, _ = core.generate(params, drafter.params, cache, prompts, lens, jax.random.key(seed),
                            limits, sampler=sampler, cfg=cfg, drafter=drafter, max_new_tokens=n,
                            stop_ids=cfg.eos_ids)
    return prog


def perturbed(params, rel: float):
    """The params with fresh noise of `rel` times each array's spread added."""
    leaves, tree_def = jax.tree.flatten(params)
    rng = np.random.default_rng()
    return tree_def.unflatten([x + rel * np.std(x) * rng.standard_normal(x.shape).astype(x.dtype)
                               for x in leaves])


@dataclasses.dataclass(frozen=True, kw_only=True)
class Noisy(small_model.SmallModel):
    """A small-model drafter whose drafts are random tokens a quarter of the time, so that
    rounds keep everything, nothing, and every count between."""

    def draft(self, params, state, last, active, key, sampler):
        tokens, q, state = super().draft(params, state, last, active, key, sampler)
        k1, k2 = jax.random.split(jax.random.fold_in(key, 1))
        noise = jax.random.randint(k1, tokens.shape, 0, self.cfg.vocab_size)
        return jnp.where(jax.random.uniform(k2, tokens.shape) < 0.25, noise, tokens), q, state


@pytest.mark.parametrize("k", [1, 3, 5])
def test_chain_greedy_is_plain_greedy(tiny, k):
    """A perturbed copy drafts, a quarter of its drafts replaced by noise; ragged rows with
    different token limits each get exactly the plain greedy tokens."""
    cfg, params = tiny
    rng = np.random.default_rng()
    prompts, lens = ragged_prompts(rng, [5, 17, 11, 2], VOCAB)
    limits = np.array([24, 9, 24, 17], np.int32)
    want, n_want = plain(cfg, params, prompts, lens, limits, 24)
    drafter = Noisy(cfg=cfg, k=k, params=perturbed(params, 0.3))
    got = speculate(cfg, params, drafter, prompts, lens, limits, 24)
    np.testing.assert_array_equal(np.asarray(got.n_generated), n_want)
    np.testing.assert_array_equal(np.asarray(got.tokens)[:, :24], want)
    hist = np.asarray(got.accepted)
    assert hist.sum() == np.asarray(got.rounds).sum()
    assert hist[1:].sum() > 0 and hist[0] > 0, hist  # drafts kept, and drafts rejected


# ---------------------------------------------------------------------------- trees


@partial(jax.tree_util.register_dataclass, data_fields=["done"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class OracleState:
    done: jax.Array  # i32[B]: tokens emitted so far


@dataclasses.dataclass(frozen=True, kw_only=True)
class Oracle:
    """Draws random trees that hide the target's own greedy continuation along the branch
    to a deepest node, cut at a random depth: paths of every length through every branch get kept, so
    the key/value compaction after each round is exercised."""

    tree: tree.TreeSpec
    vocab: int = VOCAB
    taps: tuple[int, ...] = ()
    params: Any = dataclasses.field(default=None, compare=False)  # i32[B, L]: the plain greedy tokens

    @property
    def k(self):
        return self.tree.depth

    def init(self, params, batch, capacity, dtype):
        return OracleState(done=jnp.ones(batch, jnp.int32))  # the prefill emitted token 0

    def prefill(self, params, state, prompts, prompt_lens, feats):
        return state

    def draft_tree(self, params, state, last, active, key):
        spec, truth = self.tree, params
        b, n = truth.shape[0], spec.budget
        k1, k2, k3 = jax.random.split(key, 3)
        # parents: node i (1..N) hangs under a random earlier node; a random chain is the truth
        parents = jax.vmap(lambda kk: jax.random.randint(kk, (n,), 0, jnp.arange(1, n + 1)))(
            jax.random.split(k1, b))
        parent, level, _ = tree.structure(parents, n)
        depth_ok = level[:, 1:] <= spec.depth
        parents = jnp.where(depth_ok, parents, 0)
        parent, level, anc = tree.structure(parents, spec.depth)
        leaf = jnp.argmax(level + jax.random.uniform(k2, level.shape), axis=1)  # a deepest node
        on_path = jnp.take_along_axis(anc, leaf[:, None, None], axis=1)[:, 0, 1:]  # [B, N]
        cut = jax.random.randint(k3, (b,), 0, spec.depth + 1)
        want = jnp.take_along_axis(truth, jnp.clip(state.done[:, None] + level[:, 1:] - 1, 0,
                                                    truth.shape[1] - 1), axis=1)
        noise = jax.random.randint(k3, (b, n), 0, self.vocab)
        tokens = jnp.where(on_path & (level[:, 1:] <= cut[:, None]), want, noise)
        return tokens.astype(jnp.int32), parents.astype(jnp.int32), state

    def draft(self, params, state, last, active, key, sampler):
        raise AssertionError("greedy tree rounds never draft a chain")

    def accept(self, params, state, chunk, feats, n_acc, active):
        return OracleState(done=jnp.where(active, state.done + n_acc + 1, state.done))


@pytest.mark.parametrize("spec", [tree.TreeSpec(depth=4, top_k=3, budget=9),
                                  tree.TreeSpec(depth=2, top_k=2, budget=6)])
def test_tree_greedy_is_plain_greedy(tiny, spec):
    cfg, params = tiny
    rng = np.random.default_rng()
    prompts, lens = ragged_prompts(rng, [7, 3, 12], VOCAB)
    limits = np.array([30, 30, 21], np.int32)
    want, n_want = plain(cfg, params, prompts, lens, limits, 30)
    truth = np.where(want < 0, 0, want)
    got = speculate(cfg, params, Oracle(params=np.pad(truth, ((0, 0), (0, 8))), tree=spec),
                    prompts, lens, limits, 30)
    np.testing.assert_array_equal(np.asarray(got.tokens)[:, :30], want)
    np.testing.assert_array_equal(np.asarray(got.n_generated), n_want)
    hist = np.asarray(got.accepted)
    assert hist[0] > 0 and hist[2:].sum() > 0, hist  # paths kept (moved) and nothing kept


def test_tree_structure_against_definition():
    """Depths and ancestor sets from random parent arrays, against a walk in Python."""
    rng = np.random.default_rng()
    n, b = 11, 4
    parents = np.stack([[rng.integers(0, i) for i in range(1, n + 1)] for _ in range(b)])
    parent, level, anc = map(np.asarray, tree.structure(jnp.asarray(parents), n))
    for r in range(b):
        for i in range(n + 1):
            chain, node = {i}, i
            while node:
                node = parents[r, node - 1]
                chain.add(node)
            assert level[r, i] == len(chain) - 1
            assert set(np.flatnonzero(anc[r, i])) == chain


# ---------------------------------------------------------------------------- sampling

V_SMALL = 6


def small_vocab_model(seed: int, scale: float):
    cfg = ModelConfig(arch="llama", vocab_size=V_SMALL, d_model=32, n_layers=2, n_heads=2,
                      n_kv_heads=1, head_dim=16, d_ff=48, norm_eps=1e-5, rope_theta=1e4,
                      tie_embeddings=False, max_position=64, eos_ids=())
    params = init_params(transformer.declare(cfg), jax.random.key(seed))
    return cfg, dataclasses.replace(params, lm_head=params.lm_head * scale)


def biased_accept(logits, draft, q, key, sampler):
    """A classic bug: on rejection resample from p itself, not from norm(max(0, p - q))."""
    p = core.target_probs(logits, sampler)
    pick = lambda x: jnp.take_along_axis(x[:, : draft.shape[1]], draft[..., None], axis=2)[..., 0]
    u_key, r_key = jax.random.split(key)
    n_acc = core.leading(jax.random.uniform(u_key, draft.shape) * pick(q) < pick(p))
    at = jnp.take_along_axis(p, n_acc[:, None, None], axis=1)[:, 0]
    return n_acc, jax.random.categorical(r_key, jnp.log(at), axis=-1).astype(jnp.int32)


def test_sampling_keeps_the_target_distribution(monkeypatch):
    """3 tokens after a fixed prompt, 20k rows in one batch, k=3: the first from the prefill,
    the next from speculation rounds (accepted drafts, replacements and bonus tokens all
    appear). Their joint matches the target's exact distribution; the biased verifier's
    does not."""
    cfg, params = small_vocab_model(1, scale=4.0)
    dcfg, dparams = small_vocab_model(2, scale=4.0)  # another model: q differs from p
    sampler = Sample(temperature=1.0)
    drafter = small_model.SmallModel(cfg=dcfg, k=3, params=dparams)
    rows, n = 20_000, 3
    prompt = np.random.default_rng().integers(0, V_SMALL, 5).astype(np.int32)
    prompts = np.broadcast_to(prompt, (rows, 5)).copy()
    lens, limits = np.full(rows, 5, np.int32), np.full(rows, n, np.int32)
    probs = exact_joint(params, cfg, prompt, n)

    def pvalue(seed):
        got = np.asarray(speculate(cfg, params, drafter, prompts, lens, limits, n, sampler,
                                   seed=seed, cap=16).tokens)[:, :n]
        assert (got >= 0).all()
        return chi2_pvalue(got, probs, V_SMALL)

    assert_fits(pvalue)
    monkeypatch.setattr(core, "accept_sample", biased_accept)
    jax.clear_caches()
    assert pvalue(seed=7) < 1e-6
    jax.clear_caches()


# ---------------------------------------------------------------------------- errors


def test_draft_past_capacity_is_refused(tiny):
    """A draft longer than the cache holds, or prompts + new tokens + a draft past it."""
    cfg, params = tiny
    cache = dense.init_cache(cfg, 1, 8)
    drafter = small_model.SmallModel(cfg=cfg, k=8, params=params)
    assert_one_line_error(core.check, cfg, cache, drafter, 1, 1, match="draft of 8 tokens")
    drafter = small_model.SmallModel(cfg=cfg, k=2, params=params)
    assert_one_line_error(core.check, cfg, cache, drafter, 3, 4, match="do not fit")
    with pytest.raises(JaxdecError, match="do not fit"):  # the same check when traced
        speculate(cfg, params, drafter, np.ones((1, 3), np.int32), np.array([3], np.int32),
                  np.array([4], np.int32), 4, cap=8)


def family(name, path):
    import jaxdec
    import tiny_families
    tiny_families.save(name, path, seed=5)
    return jaxdec.load(str(path))


def test_mamba_target_is_refused(tmp_path):
    model = family("mamba2", tmp_path)
    drafter = small_model.SmallModel(cfg=model.cfg, k=2, params=model.params)
    cache = dense.init_cache(model.cfg, 1, 16)
    assert_one_line_error(core.check, model.cfg, cache, drafter, 3, 4, match="Mamba")


def test_mla_target_chain_and_tree(tmp_path):
    """DeepSeek-V3's latent cache rolls back and compacts like the KV cache."""
    model = family("deepseek_v3", tmp_path)
    cfg, params = model.cfg, model.params
    prompts, lens = ragged_prompts(np.random.default_rng(), [6, 13], cfg.vocab_size)
    limits = np.array([20, 14], np.int32)
    want, n_want = plain(cfg, params, prompts, lens, limits, 20)
    chain = small_model.SmallModel(cfg=cfg, k=3, params=perturbed(params, 0.3))
    got = speculate(cfg, params, chain, prompts, lens, limits, 20)
    np.testing.assert_array_equal(np.asarray(got.tokens)[:, :20], want)
    truth = np.pad(np.where(want < 0, 0, want), ((0, 0), (0, 8)))
    got = speculate(cfg, params, Oracle(params=truth, tree=tree.TreeSpec(depth=3, top_k=2, budget=6),
                                             vocab=cfg.vocab_size),
                    prompts, lens, limits, 20)
    np.testing.assert_array_equal(np.asarray(got.tokens)[:, :20], want)
    assert np.asarray(got.accepted)[2:].sum() > 0
