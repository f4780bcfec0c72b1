"""Speculative decoding across vocabularies (`jaxdec.speculative.hetero`): greedy TLI and SLEM
give exactly plain greedy decoding (tiny models with made-up vocabularies, and
Qwen2.5-Coder drafted by SmolLM2); under sampling TLI and SLEM keep the target's
distribution (chi-square against the exact joint, which two biased verifiers fail); the
vocabulary tables agree with the tokenizers' own decoding; bad input is refused."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_fits, assert_one_line_error, chi2_pvalue, exact_joint, jax_model
from jaxdec import api, decode
from jaxdec.api import Model
from jaxdec.cache import dense
from jaxdec.config import ModelConfig
from jaxdec.models import transformer
from jaxdec.pytree import map_specs
from jaxdec.sampling import Greedy, Sample
from jaxdec.speculative import core, hetero, small_model

# Two made-up vocabularies over the same letters, in different orders: the target's
# letters, the drafter's letters and merges of them (its text is tokenized differently).
TARGET = [*"abcdefgh \n", "<e>"]
DRAFTER = ["<e>", "ba", "cd ", "hg", *"hgfedcba \nxyz", "xyz"]
T_EOS = TARGET.index("<e>")


def tiny_model(strings, added, seed, *, scale=4.0, like=None):
    """A random 2-layer model over `strings` (untied embeddings); with `like=(model, its
    strings)`, that model's layers and a shared token's embedding and head column (see
    `_translated`)."""
    vocab = hetero.Vocab.from_strings(strings, added=added)
    cfg = ModelConfig(arch="llama", vocab_size=len(strings), d_model=32, n_layers=2,
                      n_heads=2, n_kv_heads=1, head_dim=16, d_ff=48, norm_eps=1e-5,
                      rope_theta=1e4, tie_embeddings=False, max_position=256, eos_ids=())
    params = _np_params(cfg, seed)
    params = dataclasses.replace(params, lm_head=params.lm_head * scale)
    if like is not None:
        params = _translated(params, strings, *like)
    return Model(cfg=cfg, params=params, tokenizer=vocab)


def _np_params(cfg, seed):
    """Random params as declared (std-0.02 normals, ones, zeros), drawn by NumPy: no
    compile per shape."""
    rng = np.random.default_rng(seed)

    def one(spec):
        if spec.init != "normal":
            return (np.ones if spec.init == "ones" else np.zeros)(spec.shape, np.float32)
        return (spec.scale * rng.standard_normal(spec.shape)).astype(np.float32)

    return jax.tree.map(jnp.asarray, map_specs(one, transformer.declare(cfg)))


def _translated(params, strings, model, its_strings):
    """`model` re-indexed to `strings`: its layers; a shared token's embedding and head
    column; an unshared token its own random embedding and the head column of its first
    letter (a merge listed first wins the tie: the drafter then proposes "ba" where the
    model says "b") or zeros (rarely a first choice)."""
    src = {s: i for i, s in enumerate(its_strings)}
    embed, head = np.array(params.embed), np.zeros_like(params.lm_head)
    for i, s in enumerate(strings):
        if s in src:
            embed[i] = np.asarray(model.params.embed)[src[s]]
        if s in src or s[0] in src:
            head[:, i] = np.asarray(model.params.lm_head)[:, src[s] if s in src else src[s[0]]]
    return dataclasses.replace(model.params, embed=jnp.asarray(embed), lm_head=jnp.asarray(head))


def perturbed(params, rel: float):
    leaves, tree_def = jax.tree.flatten(params)
    rng = np.random.default_rng()
    return tree_def.unflatten([x + rel * np.std(x) * rng.standard_normal(x.shape).astype(x.dtype)
                               for x in leaves])


def plain(model, prompts, n, sampler=Greedy(), stop_ids=()):
    """Plain decoding (`decode.generate_tokens`) -> generated ids per row."""
    tokens, lens = api.pad_rows(prompts)
    cache = dense.init_cache(model.cfg, len(prompts), tokens.shape[1] + n)
    limits = np.full(len(prompts), n, np.int32)
    prog, _ = decode.generate_tokens(model.params, cache, tokens, lens, jax.random.key(0),
                                     limits, sampler=sampler, cfg=model.cfg, max_new_tokens=n,
                                     stop_ids=tuple(stop_ids))
    out, n_gen = np.asarray(prog.tokens), np.asarray(prog.n_generated)
    return [out[b, : n_gen[b]].tolist() for b in range(len(prompts))]


@pytest.fixture(scope="module")
def tiny_pair():
    target = tiny_model(TARGET, [T_EOS], seed=1, scale=2.0)
    drafter = tiny_model(DRAFTER, [0], seed=2, like=(target, TARGET))
    drafter = dataclasses.replace(drafter, params=perturbed(drafter.params, 0.3))
    return target, drafter


@pytest.mark.parametrize("method", hetero.METHODS)
def test_tiny_greedy_is_plain_greedy(tiny_pair, method):
    """Ragged rows, the target's stop id: identical tokens, on fresh prompts until drafts
    were both kept and refused (a tiny model's greedy loop is sometimes drafted perfectly)."""
    target, drafter = tiny_pair
    rng = np.random.default_rng()
    kept = refused = 0
    for _ in range(24):  # each draw keeps and refuses drafts about 2 times in 3 (tli, slem)
        prompts = [rng.integers(0, T_EOS, n).tolist() for n in (5, 11, 2, 7)]
        emitted = np.bincount(np.concatenate(plain(target, prompts, 40)), minlength=len(TARGET))
        stop = (int(np.argmin(np.where(emitted > 0, emitted, 1 << 30))),)  # emitted, rarely
        want = plain(target, prompts, 40, stop_ids=stop)
        got, st = hetero.generate(target, drafter, prompts, method=method, k=3,
                                  max_new_tokens=40, stop_ids=stop)
        assert got == want
        kept += st["drafts_kept"] > 0.3
        refused += st["row_rounds"] > 0 and min(st["kept_when_drafted"]) < 1
        if kept and refused:
            break
    assert kept and refused, (kept, refused, st)


# ---------------------------------------------------------------------------- sampling

SMALL_T = ["a", "b", "c", "ab", "bc", "ca"]  # 6 tokens
SMALL_D = ["d", "a", "ab", "b", "dd", "c", "cd"]  # 7 tokens, 4 of them the target's
ROWS = 3000  # samples per chi-square test, in one batch


def accept_all(logits, draft, q, key, sampler):
    """A broken verifier: min(1, p/q) replaced by 1 (every draft kept, the bonus from p)."""
    p = core.target_probs(logits, sampler)
    k = draft.shape[1]
    return (jnp.full(draft.shape[:1], k, jnp.int32),
            jax.random.categorical(key, jnp.log(p[:, k]), axis=-1).astype(jnp.int32))


def unrestricted_q(logits, allowed, key, sampler):
    """A broken proposal: drafts from V_both, but q not renormalised over V_both."""
    tok, _ = small_model.propose(jnp.where(allowed, logits, -jnp.inf), key, sampler)
    return tok, jax.nn.softmax(sampler.filter(logits), axis=-1)


@pytest.fixture(scope="module")
def small_pair():
    return tiny_model(SMALL_T, [], seed=3), tiny_model(SMALL_D, [], seed=4)


def _pvalue(pair, method, seed, rows=ROWS, n=3):
    """The first n tokens of `rows` samples after one prompt (k=2: the first from the
    prefill, the next from speculation) against the target's exact joint."""
    target, drafter = pair
    prompt = np.random.default_rng(seed).integers(0, len(SMALL_T), 4).tolist()
    got, _ = hetero.generate(target, drafter, [prompt] * rows, method=method, k=2,
                             max_new_tokens=n, sampler=Sample(), seed=seed, stop_ids=())
    return chi2_pvalue(np.array(got), exact_joint(target.params, target.cfg, prompt, n),
                       len(SMALL_T))


@pytest.mark.parametrize("method", hetero.METHODS)
def test_sampling_keeps_the_target_distribution(small_pair, method):
    assert_fits(lambda seed: _pvalue(small_pair, method, seed))


@pytest.mark.parametrize("bug", ["accept_all", "unrestricted_q"])
def test_biased_tli_fails_the_same_test(small_pair, monkeypatch, bug):
    module, name, fn, jitted = {"accept_all": (core, "accept_sample", accept_all, hetero._verify),
                                "unrestricted_q": (hetero, "propose", unrestricted_q, hetero._draft)}[bug]
    monkeypatch.setattr(module, name, fn)
    jitted.clear_cache()  # retrace with the bug
    try:
        assert _pvalue(small_pair, "tli", seed=11) < 1e-6
    finally:
        monkeypatch.undo()
        jitted.clear_cache()


# ---------------------------------------------------------------------------- vocabularies


def test_intersection_maps_same_bytes(small_pair):
    target, drafter = small_pair
    tv, dv = target.tokenizer, drafter.tokenizer
    d_ids, t_ids = hetero.intersection(dv, tv)
    assert sorted(SMALL_D[i] for i in d_ids) == ["a", "ab", "b", "c"]
    assert all(SMALL_D[d] == SMALL_T[t] for d, t in zip(d_ids, t_ids))


def test_real_vocabularies_against_their_tokenizers():
    """Each id's bytes decode as the tokenizer decodes that id alone; V_both pairs ids of
    equal text, special tokens with special tokens; random text, cut anywhere (even inside
    a character), is spelled back byte for byte."""
    rng = np.random.default_rng()
    target, drafter = jax_model("qwen2.5-coder-0.5b"), jax_model("smollm2")
    tv = hetero.vocab_of(target.tokenizer, target.cfg.vocab_size)
    dv = hetero.vocab_of(drafter.tokenizer, drafter.cfg.vocab_size)
    for vocab, tok in ((tv, target.tokenizer), (dv, drafter.tokenizer)):
        for i in rng.integers(0, tok.vocab_size, 300):
            text = tok.decode([int(i)], skip_special_tokens=False)
            if vocab.pieces[i] is not None and "\ufffd" not in text:
                assert vocab.pieces[i].decode() == text, i
    d_ids, t_ids = hetero.intersection(dv, tv)
    pick = rng.integers(0, len(d_ids), 300)
    assert [dv.pieces[i] for i in d_ids[pick]] == [tv.pieces[i] for i in t_ids[pick]]
    im_end = drafter.tokenizer.backend.token_to_id("<|im_end|>")
    assert t_ids[list(d_ids).index(im_end)] == target.tokenizer.backend.token_to_id("<|im_end|>")
    text = "def f(x):\n    return x ** 2  # é ü 中文 → ✓\n".encode()
    for vocab in (tv, dv):
        cut = int(rng.integers(1, len(text)))
        assert vocab.spell(vocab.encode(text[:cut])) == text[:cut]
        assert vocab.spell(vocab.encode(text[cut:])) == text[cut:]


# ---------------------------------------------------------------------------- errors


def test_disjoint_vocabularies_are_refused(small_pair):
    target, _ = small_pair
    other = tiny_model(["x", "y", "z", "xy", "zz"], [], seed=5)
    assert_one_line_error(hetero.generate, target, other, [[0, 1]], method="tli",
                          max_new_tokens=4, match="TLI needs the drafter to share")


def test_bad_arguments_are_refused(small_pair):
    target, drafter = small_pair
    call = lambda **kw: hetero.generate(target, drafter, [[0, 1, 2]], **{"max_new_tokens": 4, **kw})
    assert_one_line_error(call, k=8, capacity=10, match="needs a cache of 16 tokens")
    assert_one_line_error(call, k=0, match="positive integer")
    assert_one_line_error(call, method="slrs", match="unknown method")


# ---------------------------------------------------------------------------- real models

CODE_PROMPTS = [
    "Write a Python function that reverses a string.",
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a C function that computes the length of a string.",
    "Write a Python function that merges two sorted lists.",
    "Write a JavaScript function that debounces another function.",
    "Write a Python function that counts the words in a text.",
    "Write a SQL query that finds the second highest salary.",
    "Write a Python class for a stack with push and pop.",
    "Write a Python function that flattens a nested list.",
    "Write a Rust function that sums a vector of integers.",
    "Write a Python function that reads a CSV file into a list of dicts.",
    "Write a bash one-liner that counts lines in all .py files.",
    "Write a Python function that computes the GCD of two numbers.",
    "Write a Go function that reverses a slice of ints.",
    "Write a Python function that checks if a string is a palindrome.",
    "Write a Python decorator that times a function.",
    "Write a Python function that removes duplicates from a list, keeping order.",
    "Write a Java method that returns the maximum of an int array.",
    "Write a Python function that converts Celsius to Fahrenheit.",
    "Write a regular expression in Python that matches an email address.",
]


def _real_greedy(prompts, n=16):
    from jaxdec import api

    target, drafter = jax_model("qwen2.5-coder-0.5b"), jax_model("smollm2")
    rows = api.encode_prompts(target, prompts, chat=True)
    stops = target.tokenizer.stop_ids
    want = plain(target, rows, n, stop_ids=stops)
    for method in hetero.METHODS:
        got, st = hetero.generate(target, drafter, rows, method=method, k=3, max_new_tokens=n,
                                  stop_ids=stops)
        assert got == want, method
        assert st["drafts_kept"] > 0.2, (method, st)


def test_real_greedy_is_plain_greedy():
    _real_greedy(CODE_PROMPTS[:3])


@pytest.mark.slow
def test_real_greedy_is_plain_greedy_20_prompts():
    for i in range(0, len(CODE_PROMPTS), 7):
        _real_greedy(CODE_PROMPTS[i:i + 7])
