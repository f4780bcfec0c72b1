"""The cache-entry interface over every kind (`jaxdec.cache.entry`, `jaxdec.cache.dense`).

Every kind's prefill + decode against the dense XLA path (identical greedy tokens for the
lossless kinds, near for the quantised), a ragged batch against each row alone, the window
ring against HF-style full attention with a sliding-window mask (a float64 NumPy
reference), NaN-filled unused pages, pages handed out at run time, reused rows, `move` and
`drop` against a NumPy model of the slots, bytes from the arrays, and the one-line errors.
"""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_one_line_error
from tiny_hf import VOCAB, build

from jaxdec import api, decode
from jaxdec.cache import dense, entry, paged, registry, window
from jaxdec.config import MambaConfig, ModelConfig
from jaxdec.models import transformer
from jaxdec.sampling import Greedy
from jaxdec.speculative import core

KINDS = ["dense", "paged", "int8", "int4"]


@pytest.fixture(scope="module")
def tiny():
    _, cfg, params = build("llama", seed=3)
    return cfg, params


def _prompts(lens, seed=None):
    rng = np.random.default_rng(seed)
    rows = [rng.integers(0, VOCAB - 1, n) for n in lens]
    prompts = np.zeros((len(rows), max(lens)), np.int32)
    for i, r in enumerate(rows):
        prompts[i, :len(r)] = r
    return rows, prompts


def _generate(cfg, params, prompts, lens, new, kind="dense", capacity=96, cache=None, **options):
    b = prompts.shape[0]
    cache = dense.init_cache(cfg, b, capacity, kind=kind, **options) if cache is None else cache
    out = decode.generate_tokens(params, cache, jnp.asarray(prompts), jnp.asarray(lens, jnp.int32),
                                 jax.random.key(0), jnp.full((b,), new, jnp.int32), sampler=Greedy(),
                                 cfg=cfg, max_new_tokens=new, stop_ids=())
    return np.asarray(out[0].tokens), out[1]


FORWARD = jax.jit(transformer.forward, static_argnames="cfg")


def _teacher_forced(cfg, params, prompts, lens, tokens, kind):
    """Each step's argmax [B, N] over a `kind` cache: a ragged prefill, then decode steps
    fed `tokens` (i32[B, N], dense's greedy output), so one flip does not count for every
    later step."""
    b, n = tokens.shape
    width = prompts.shape[1]
    positions = np.where(np.arange(width)[None] < np.asarray(lens)[:, None], np.arange(width)[None], -1)
    cache = dense.init_cache(cfg, b, 96, kind=kind)
    logits, cache = FORWARD(params, jnp.asarray(prompts), jnp.asarray(positions), cache, cfg=cfg)
    tops = [np.asarray(logits)[np.arange(b), np.asarray(lens) - 1].argmax(-1)]
    for j in range(n - 1):
        logits, cache = FORWARD(params, jnp.asarray(tokens[:, j:j + 1]), cache.lengths[:, None], cache, cfg=cfg)
        tops.append(np.asarray(logits)[:, 0].argmax(-1))
    return np.stack(tops, 1)


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_ragged_batch_equals_rows_alone_and_dense(tiny, kind):
    """Every kind's ragged batch gives each row's tokens alone; the lossless kinds give
    dense's tokens, the quantised ones pick dense's next token at most steps (teacher-forced:
    a tiny random model's logits have near-ties, and one flip would move every later token)."""
    cfg, params = tiny
    lens = [5, 23, 12]
    rows, prompts = _prompts(lens)
    want, _ = _generate(cfg, params, prompts, lens, 16)
    got, _ = _generate(cfg, params, prompts, lens, 16, kind)
    for i, r in enumerate(rows):
        alone, _ = _generate(cfg, params, r[None].astype(np.int32), [len(r)], 16, kind)
        np.testing.assert_array_equal(got[i], alone[0])
    if kind in ("dense", "paged"):
        np.testing.assert_array_equal(got, want)
        return
    agree = np.mean(_teacher_forced(cfg, params, prompts, lens, want, kind) == want)
    assert agree >= {"int8": 0.9, "int4": 0.85}[kind], agree  # measured 0.98-1.0 for both


def test_nan_in_unused_pages_never_changes_an_output(tiny):
    """A pool twice the rows' need, every page NaN, pages given at run time by the
    allocator (rows own only what they write, part of their last page unwritten): the
    tokens are the dense cache's."""
    cfg, params = tiny
    lens = [7, 19]
    _, prompts = _prompts(lens)
    want, _ = _generate(cfg, params, prompts, lens, 12)
    cache = dense.init_cache(cfg, 2, 96, kind="paged", page_size=16, pool_pages=24, fill=np.nan)
    allocator = paged.FreeList(2, 6, 24, seed=1)
    for row, n in enumerate(lens):
        allocator.give(row, -(-(n + 12) // 16))
    cache = dataclasses.replace(cache, layers=tuple(e.with_table(allocator.table) for e in cache.layers))
    got, out = _generate(cfg, params, prompts, lens, 12, cache=cache)
    np.testing.assert_array_equal(got, want)
    assert np.isnan(np.asarray(out.layers[0].k_pages)).any()  # the check has teeth


def test_allocator_gives_frees_and_shares():
    a = paged.FreeList(3, 4, 8, seed=0)
    first = a.give(0, 3)
    assert len(set(first)) == 3 and a.table[0, 3] == a.scratch
    a.share(0, 1, 2)
    np.testing.assert_array_equal(a.table[1, :2], a.table[0, :2])
    a.give(1, 2)
    assert len(a.free_pages) == 8 - 5
    a.free(0)  # its shared pages stay with row 1
    assert len(a.free_pages) == 8 - 4 and set(a.table[1, :2]) == set(first[:2])
    a.free(1)
    assert len(a.free_pages) == 8
    assert_one_line_error(a.give, 2, 9, match="free pages|do not fit")


def test_shared_prefix_pages_give_the_same_tokens(tiny):
    """Two rows with the same 32-token prefix: row 1 reads row 0's first two pages (written
    by row 0's prefill, the same values it would write itself) and both decode as alone."""
    cfg, params = tiny
    rows, prompts = _prompts([40])
    prompts = np.repeat(prompts, 2, axis=0)
    prompts[1, 32:] = (prompts[1, 32:] + 1) % (VOCAB - 1)
    want, _ = _generate(cfg, params, prompts, [40, 40], 8)
    a = paged.FreeList(2, 4, 8, seed=2)
    a.give(0, 4)
    a.share(0, 1, 2)
    a.give(1, 2)
    cache = dense.init_cache(cfg, 2, 64, kind="paged", page_size=16, pool_pages=8, fill=np.nan)
    cache = dataclasses.replace(cache, layers=tuple(e.with_table(a.table) for e in cache.layers))
    got, _ = _generate(cfg, params, prompts, [40, 40], 8, cache=cache)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kind", KINDS)
def test_reset_rows_reuses_a_row(tiny, kind):
    """After a generation, resetting row 0 and prefilling a new prompt there gives what a
    fresh cache gives (row 1's state is kept)."""
    cfg, params = tiny
    _, prompts = _prompts([9, 14])
    _, used = _generate(cfg, params, prompts, [9, 14], 10, kind)
    used = used.reset_rows(jnp.array([True, False]))
    assert int(used.lengths[0]) == 0 and int(used.lengths[1]) == 14 + 10 - 1  # (last token unfed)
    _, fresh_prompt = _prompts([11])
    new = np.zeros((2, 11), np.int32)
    new[0] = fresh_prompt[0]
    got, _ = _generate(cfg, params, new, [11, 0], 6, cache=used)
    want, _ = _generate(cfg, params, fresh_prompt, [11], 6, kind)
    np.testing.assert_array_equal(got[0], want[0])


@pytest.mark.parametrize("kind", KINDS)
def test_move_and_drop_against_a_numpy_model_of_slots(kind):
    cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=64, d_ff=32)
    e = dense.init_cache(cfg, 2, 32, kind=kind, **(dict(page_size=8) if kind == "paged" else {})).layers[0]
    rng = np.random.default_rng()
    k = jnp.asarray(rng.standard_normal((2, 10, 1, 64)), jnp.float32)
    slots = jnp.asarray(np.stack([np.arange(10), np.arange(3, 13)]), jnp.int32)
    e = e.write(k, -k, slots, slots + 100)
    before_k, before_v = map(np.asarray, e.view(jnp.float32))
    src = jnp.array([[7, 8, 9], [5, 6, 7]])
    dst = jnp.array([[2, 3, -1], [20, 21, 22]])
    e = e.move(src, dst).drop(jnp.array([[0, -1], [4, 12]]))
    k2, v2 = map(np.asarray, e.view(jnp.float32))
    pos = np.asarray(e.pos)
    want = np.full((2, 33), -1)
    want[0, :10], want[1, 3:13] = np.arange(100, 110), np.arange(103, 113)
    want[0, [2, 3]] = [107, 108]
    want[1, [20, 21, 22]] = [105, 106, 107]
    want[0, 0] = want[1, 4] = want[1, 12] = -1
    np.testing.assert_array_equal(pos, want)
    for b, (s, d) in enumerate(zip(np.asarray(src), np.asarray(dst))):
        for i, j in zip(s, d):
            if j >= 0:
                np.testing.assert_array_equal(k2[b, :, j], before_k[b, :, i])
                np.testing.assert_array_equal(v2[b, :, :, j], before_v[b, :, :, i])
    assert e.bytes() == sum(x.nbytes for x in jax.tree.leaves(e))


def _windowed(window: int):
    _, cfg, params = build("llama", seed=5)
    return dataclasses.replace(cfg, layer_windows=(window, None, window)), params


def _full_recompute(cfg, params, tokens):
    """Logits of the whole sequence run at once without a cache: every token attends
    within the chunk, under `chunk_mask`'s window (checked against the definition below)."""
    padded = np.zeros(64, np.int32)  # one width (one compile); causal: the padding after is unseen
    padded[:len(tokens)] = tokens
    logits, _ = FORWARD(params, jnp.asarray(padded)[None], jnp.arange(64)[None], None, cfg=cfg)
    return np.asarray(logits[0, :len(tokens)])


def test_chunk_mask_window_is_the_definition():
    pos = jnp.asarray(np.random.default_rng().permutation(20)[None].astype(np.int32))
    m = np.asarray(entry.chunk_mask(pos, 5))[0]
    p = np.asarray(pos)[0]
    want = (p[None, :] <= p[:, None]) & (p[:, None] - p[None, :] < 5)
    np.testing.assert_array_equal(m, want)


@pytest.mark.parametrize("kind", ["dense", "window", "paged", "int8"])
def test_windowed_layers_decode_as_full_recompute(kind):
    """A model with 8-token windows on two of its three layers, prompts longer than the
    window: a ragged prefill then 12 decode steps over each kind (the window kind keeps a
    ring of 8 + 8 slots on the windowed layers, so it wraps) give at every step the logits
    of running the whole sequence at once without a cache."""
    window = 8
    cfg, params = _windowed(window)
    rows, prompts = _prompts([13, 21])
    atol = 0.15 if kind == "int8" else 5e-5
    cache = dense.init_cache(cfg, 2, 48, kind=kind, **({"margin": 8} if kind == "window" else {}))
    if kind == "window":
        assert cache.layers[0].capacity == 16 and cache.layers[1].capacity == 48
    positions = jnp.where(jnp.arange(21)[None] < jnp.array([[13], [21]]), jnp.arange(21)[None], -1)
    logits, cache = FORWARD(params, jnp.asarray(prompts), positions, cache, cfg=cfg)
    seqs = [list(r) for r in rows]
    for i, r in enumerate(rows):
        np.testing.assert_allclose(np.asarray(logits)[i, :len(r)],
                                   _full_recompute(cfg, params, np.asarray(r)), atol=atol)
    last = jnp.argmax(logits[jnp.arange(2), jnp.array([12, 20])], -1).astype(jnp.int32)
    for _ in range(12):
        step, cache = FORWARD(params, last[:, None], cache.lengths[:, None], cache, cfg=cfg)
        for i in range(2):
            seqs[i].append(int(last[i]))
            np.testing.assert_allclose(np.asarray(step)[i, 0],
                                       _full_recompute(cfg, params, np.asarray(seqs[i]))[-1], atol=atol)
        last = jnp.argmax(step[:, 0], -1).astype(jnp.int32)


def test_bad_kinds_are_one_line_errors(tiny):
    cfg, _ = tiny
    mamba = ModelConfig(vocab_size=50, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=32,
                        d_ff=32, layer_types=("mamba", "attention+mlp"),
                        mamba=MambaConfig(n_heads=4, head_dim=16, n_groups=1, d_state=8))
    assert_one_line_error(dense.init_cache, mamba, 1, 32, kind="paged", match="Mamba layer")
    assert_one_line_error(dense.init_cache, cfg, 1, 32, kind="window", match="sliding-window layers")
    wcfg, _ = _windowed(64)
    assert_one_line_error(dense.init_cache, wcfg, 1, 128, kind="window", margin=-1, match="margin")
    assert_one_line_error(window.RingKVLayer.empty, 1, 2, 8, 64, 32, jnp.float32, match="does not fit")
    # a window the cache cannot hold more than: the ring would never wrap, so dense entries
    assert all(type(e) is entry.KVLayer for e in dense.init_cache(wcfg, 1, 32, kind="window").layers)
    assert any(type(e) is window.RingKVLayer for e in dense.init_cache(wcfg, 1, 256, kind="window").layers)
    assert_one_line_error(dense.init_cache, cfg, 1, 32, kind="fp8", match="unknown KV cache kind")
    assert_one_line_error(dense.init_cache, cfg, 1, 32, kind="int8", page_size=16, match="takes no options")
    assert_one_line_error(dense.init_cache, cfg, 1, 32, kind="paged", margin=4, match="not margin")
    odd = dataclasses.replace(cfg, head_dim=30)
    assert_one_line_error(dense.init_cache, odd, 1, 32, kind="int4", match="cannot group heads of 30")
    assert_one_line_error(dense.init_cache, mamba, 1, 32, kind="int8", match="Mamba layer")
    ring = dense.init_cache(wcfg, 1, 256, kind="window", margin=3)  # a ring rolls back 3 + 1
    chain = lambda k: types.SimpleNamespace(k=k, tree=None)
    core.check(wcfg, ring, chain(3), 8, 16)
    assert_one_line_error(core.check, wcfg, ring, chain(4), 8, 16,
                          match="a draft of 5 tokens is more than layer 0's cache entry")


def test_a_new_kind_is_one_registration(tiny):
    """A kind registered from outside the library (here, a dense entry that counts its
    makes) is a choice of init_cache and jaxdec.load's check, with no other change."""
    made = []

    @registry.register("counting", summary="dense, counted")
    def make(cfg, layer, batch, max_len, dtype):
        made.append(layer)
        shapes = entry.KVLayer.shapes(batch, cfg.kv_heads(layer), cfg.head_dim, max_len + 1, dtype)
        return entry.KVLayer(**{f: jnp.full(shape, -1 if dt == np.int32 else 0, dt)  # pos -1: empty
                                for f, (shape, dt) in shapes.items()})

    try:
        assert "counting" in registry.names()
        cfg, params = tiny
        dense.check("counting", "xla", cfg)
        lens = [6, 11]
        _, prompts = _prompts(lens)
        want, _ = _generate(cfg, params, prompts, lens, 8)
        got, _ = _generate(cfg, params, prompts, lens, 8, "counting")
        assert made == list(range(cfg.n_layers))
        np.testing.assert_array_equal(got, want)
    finally:
        registry.unregister("counting")


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_quantised_page_pool_stores_what_its_kind_stores(kind):
    """A paged entry over an int8/int4 pool (the engine's) quantises each token as the int8
    and int4 kinds do: after the same random writes (two chunks, rows through shuffled
    tables, pages nobody holds NaN), its view is theirs to the bit, and so is a decode step's
    attention over it."""
    from jaxdec.cache.quantized import QuantKVLayer

    rng = np.random.default_rng()
    b, kh, h, ps, per_row, n_pool = 3, 2, 64, 8, 4, 16
    pool = lambda: jax.device_put(paged.page_pool(kh, h, n_pool, ps, jnp.float32, quant=kind, fill=np.nan))
    table = rng.permutation(n_pool)[:b * per_row].reshape(b, per_row).astype(np.int32)
    pages = paged.PagedKVLayer(k_pages=pool(), v_pages=pool(), page_table=jnp.asarray(table),
                               pos=jnp.full((b, per_row * ps + 1), -1, jnp.int32))
    flat = QuantKVLayer.empty(kind, b, kh, h, per_row * ps + 1, jnp.float32)
    for start, t in ((0, 11), (11, 1)):
        k, v = (jnp.asarray(rng.standard_normal((b, t, kh, h)), jnp.float32) for _ in range(2))
        positions = jnp.broadcast_to(jnp.arange(start, start + t, dtype=jnp.int32), (b, t))
        pages, flat = pages.write(k, v, positions, positions), flat.write(k, v, positions, positions)
    for ours, theirs in zip(pages.view(jnp.float32), flat.view(jnp.float32)):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    q, q_pos = jnp.asarray(rng.standard_normal((b, kh * 3, h)), jnp.float32), jnp.full((b,), 11, jnp.int32)
    np.testing.assert_array_equal(np.asarray(pages.attend(q, q_pos, "xla")), np.asarray(flat.attend(q, q_pos, "xla")))
