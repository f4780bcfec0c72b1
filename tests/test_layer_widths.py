"""Per-layer widths (a pruned model): query heads, kv heads and MLP units per layer.

A tiny random Llama-family model (GQA, QKV biases, one sliding-window layer) is pruned by
slicing its weights: in one layer a kv head goes with its whole group of query heads, in
another one query head of every group goes, and MLP neurons go in two layers. The
reference is the unpruned model with the same weights zeroed (the output-projection rows
of the dropped heads, the down-projection rows of the dropped neurons): the full forward,
prefill + decode through every cache kind, greedy generation, an orbax round trip and a
mesh layout all give what it gives, and the caches hold only the kept kv heads.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from conftest import assert_one_line_error

import jaxdec
from jaxdec import api, sharding
from jaxdec.cache import dense
from jaxdec.checkpoint.tokenizer import Tokenizer
from jaxdec.config import MambaConfig, ModelConfig, MoEConfig
from jaxdec.models import transformer
from jaxdec.pytree import is_spec

VOCAB = 288
BASE = ModelConfig(arch="llama", vocab_size=VOCAB, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2,
                   head_dim=16, d_ff=96, qkv_bias=True, layer_windows=(None, 8, None),
                   max_position=256, eos_ids=(VOCAB - 1,))
G = BASE.n_heads // BASE.n_kv_heads
# per layer: kept kv heads, kept query heads (in order: each kv head's kept queries together)
KEEP_HEADS = {1: ([1], [2, 3]),  # kv head 0 goes with its group (queries 0 and 1)
              2: ([0, 1], [0, 3])}  # one query of each group goes: GQA group 2 -> 1
N_FFN = {1: 64, 2: 80}  # MLP units kept (out of 96)


def _random_params(cfg: ModelConfig, rng):
    """Host (numpy) params of `cfg`, every leaf random: norms near 1, biases and weights
    around 0 (no zeros anywhere)."""
    def one(spec):
        x = rng.normal(0.0, 0.05 if spec.init != "normal" else 0.15, spec.shape)
        return (x + (spec.init == "ones")).astype(np.float32)
    return jax.tree.map(one, transformer.declare(cfg), is_leaf=is_spec)


def _prune(cfg, params, rng):
    """(pruned cfg and params, the unpruned params with the dropped units zeroed), on the
    host: the pruned weights are slices, the zeroed ones copies."""
    pruned, zeroed = list(params.layers), list(params.layers)
    heads, kv_heads, ffn = [cfg.n_heads] * cfg.n_layers, [cfg.n_kv_heads] * cfg.n_layers, \
        [cfg.d_ff] * cfg.n_layers
    for i, (kv, q) in KEEP_HEADS.items():
        g = len(q) // len(kv)  # the layer's new group: query j reads kv head j // g
        assert all(q[j] // G == kv[j // g] for j in range(len(q)))
        a = params.layers[i].mixer
        pruned[i] = dataclasses.replace(pruned[i], mixer=dataclasses.replace(
            a, wq=a.wq[:, q], wk=a.wk[:, kv], wv=a.wv[:, kv], wo=a.wo[q], bq=a.bq[q], bk=a.bk[kv],
            bv=a.bv[kv]))
        wo = a.wo.copy()
        wo[np.setdiff1d(np.arange(cfg.n_heads), q)] = 0.0
        zeroed[i] = dataclasses.replace(zeroed[i], mixer=dataclasses.replace(a, wo=wo))
        heads[i], kv_heads[i] = len(q), len(kv)
    for i, n in N_FFN.items():
        keep = np.sort(rng.choice(cfg.d_ff, n, replace=False))
        m = params.layers[i].ffn
        pruned[i] = dataclasses.replace(pruned[i], ffn=dataclasses.replace(
            m, w_gate=m.w_gate[:, keep], w_up=m.w_up[:, keep], w_down=m.w_down[keep]))
        w_down = m.w_down.copy()
        w_down[np.setdiff1d(np.arange(cfg.d_ff), keep)] = 0.0
        zeroed[i] = dataclasses.replace(zeroed[i], ffn=dataclasses.replace(zeroed[i].ffn, w_down=w_down))
        ffn[i] = n
    small = dataclasses.replace(cfg, layer_heads=tuple(heads), layer_kv_heads=tuple(kv_heads),
                                layer_ffn=tuple(ffn))
    return (small, dataclasses.replace(params, layers=tuple(pruned)),
            dataclasses.replace(params, layers=tuple(zeroed)))


def _tokenizer() -> Tokenizer:
    """A word-level tokenizer over the tiny vocabulary ("w0" .. "w287")."""
    words = {f"w{i}": i for i in range(VOCAB)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="w0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.decoder = tokenizers.decoders.WordPiece()
    return Tokenizer(backend=backend, eos_id=VOCAB - 1)


@pytest.fixture(scope="module")
def models():
    """(pruned Model, zeroed unpruned Model, the unpruned Model), fresh random weights."""
    rng = np.random.default_rng()
    params = _random_params(BASE, rng)
    cfg, small, zeroed = _prune(BASE, params, rng)
    tok, dev = _tokenizer(), lambda tree: jax.tree.map(jnp.asarray, tree)
    return (api.Model(cfg=cfg, params=dev(small), tokenizer=tok, source="pruned"),
            api.Model(cfg=BASE, params=dev(zeroed), tokenizer=tok, source="zeroed"),
            api.Model(cfg=BASE, params=dev(params), tokenizer=tok, source="unpruned"))


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _tokens(shape):
    return np.random.default_rng().integers(0, VOCAB - 1, shape).astype(np.int32)


def test_config_and_declaration_carry_the_widths(models):
    pruned = models[0]
    cfg = pruned.cfg
    assert not cfg.uniform_widths and BASE.uniform_widths
    assert [cfg.heads(i) for i in range(3)] == [4, 2, 2]
    assert [cfg.kv_heads(i) for i in range(3)] == [2, 1, 2]
    assert [cfg.ffn_width(i) for i in range(3)] == [96, 64, 80]
    assert [BASE.heads(i) for i in range(3)] == [4, 4, 4] and BASE.ffn_width(2) == 96
    decl = transformer.declare(cfg)
    shapes = lambda tree: jax.tree.map(lambda x: tuple(x.shape), tree)
    want = jax.tree.map(lambda s: s.shape, decl, is_leaf=lambda x: hasattr(x, "axes"))
    assert shapes(pruned.params) == want
    assert want.layers[1].mixer.wq == (64, 2, 16) and want.layers[1].mixer.wk == (64, 1, 16)
    assert want.layers[2].mixer.wo == (2, 16, 64) and want.layers[2].ffn.w_down == (80, 64)
    assert ModelConfig.from_dict(dataclasses.asdict(cfg)) == cfg


def test_full_forward_matches_the_zeroed_model(models):
    pruned, zeroed, unpruned = models
    tokens = _tokens((2, 29))
    got, want = jaxdec.score(pruned, tokens), jaxdec.score(zeroed, tokens)
    assert rel_err(got, want) < 1e-5
    assert rel_err(jaxdec.score(unpruned, tokens), want) > 1e-2  # the dropped units mattered


_forward = jax.jit(transformer.forward, static_argnames=("cfg",))


def _prefill_then_decode(model, tokens, split, kind, **options):
    """Logits of a prefill of tokens[:, :split], then one decode step per further token."""
    b, t = tokens.shape
    cache = dense.init_cache(model.cfg, b, 48, kind=kind, **options)
    pos = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    logits, cache = _forward(model.params, tokens[:, :split], pos[:, :split], cache, cfg=model.cfg)
    steps = [np.asarray(logits)]
    for s in range(split, t):
        logits, cache = _forward(model.params, tokens[:, s:s + 1], pos[:, s:s + 1], cache,
                                 cfg=model.cfg)
        steps.append(np.asarray(logits))
    np.testing.assert_array_equal(cache.lengths, [t] * b)
    return np.concatenate(steps, axis=1), cache


# the window kind's ring of 8 + 4 slots wraps, and a 13-token prompt is longer than its margin
KIND_OPTIONS = {"dense": {}, "paged": dict(page_size=8), "window": dict(margin=4), "int8": {},
                "int4": {}}


@pytest.mark.parametrize("kind", list(KIND_OPTIONS))
def test_prefill_and_decode_through_each_cache_kind(models, kind):
    """Each layer's entry holds that layer's kv heads (its bytes scale with them); a prefill
    then decode steps give the full forward's logits on the lossless kinds, and on the
    quantised kinds the zeroed model's through the same kind."""
    pruned, zeroed, _ = models
    tokens = _tokens((2, 21))
    full = jaxdec.score(zeroed, tokens)
    got, cache = _prefill_then_decode(pruned, tokens, 13, kind, **KIND_OPTIONS[kind])
    if kind in ("int8", "int4"):
        want, _ = _prefill_then_decode(zeroed, tokens, 13, kind)
        assert rel_err(got, want) < 1e-5
        assert rel_err(got, full) < {"int8": 2e-2, "int4": 2e-1}[kind]
    else:
        assert rel_err(got, full) < 1e-5
    ref_cache = dense.init_cache(BASE, 2, 48, kind=kind, **KIND_OPTIONS[kind])
    for i, (e, ref) in enumerate(zip(cache.layers, ref_cache.layers)):
        k = e.k_pages if kind == "paged" else e.k
        heads = k.shape[0] if kind == "paged" else getattr(k, "codes", k).shape[1]
        assert heads == pruned.cfg.kv_heads(i), (i, kind)
        fixed = e.pos.nbytes + (e.page_table.nbytes if kind == "paged" else 0)  # no kv heads
        assert (e.bytes() - fixed) * BASE.n_kv_heads == (ref.bytes() - fixed) * pruned.cfg.kv_heads(i)


def test_cache_bytes_follow_the_kv_heads_per_layer(models):
    pruned = models[0]
    h, s = BASE.head_dim, 33  # 32 slots + scratch, float32 k and v, int32 positions
    want = [2 * 4 * k * s * h + 4 * s for k in (2, 1, 2)]
    cache = dense.init_cache(pruned.cfg, 1, 32)
    assert [e.bytes() for e in cache.layers] == want
    assert cache.bytes() == sum(want) + 4
    # (bytes per token, fixed bytes): the dense kind's positions grow with the slots too
    assert dense.bytes_per_token(pruned.cfg) == (sum(2 * 4 * k * h + 4 for k in (2, 1, 2)), 0)
    assert dense.init_cache(BASE, 1, 32).bytes() - cache.bytes() == 2 * 4 * s * h


@pytest.mark.parametrize("kind", ["dense", "paged", "int8"])
def test_greedy_generation_is_the_zeroed_models(models, kind):
    pruned, zeroed, _ = models
    rows = [list(_tokens(n)) for n in (5, 17, 11)]
    run = lambda m: api.generate_ids(api.with_attention(m, kv_cache=kind), rows, max_new_tokens=12,
                                     stop_ids=()).token_ids
    got = run(pruned)
    assert got == run(zeroed)
    assert all(len(r) == 12 for r in got)


def test_orbax_round_trip(models, tmp_path):
    pruned = models[0]
    restored = jaxdec.load(str(jaxdec.save(pruned, tmp_path / "ckpt")))
    assert restored.cfg == pruned.cfg and not restored.cfg.uniform_widths
    assert jax.tree.map(jnp.shape, restored.params) == jax.tree.map(jnp.shape, pruned.params)
    tokens = _tokens((2, 14))
    np.testing.assert_array_equal(jaxdec.score(restored, tokens), jaxdec.score(pruned, tokens))


def test_mesh_layout_of_the_pruned_model(models):
    """model=2 splits every layer's query heads and MLP units; the kv heads replicate (layer
    1 keeps one); scores match one device. A layer width the axis does not divide is a
    one-line error naming the layer."""
    pruned = models[0]
    mesh = sharding.make_mesh("model=2")
    rules = sharding.rules_for(pruned.cfg, mesh)
    assert rules.mesh_axis("q_heads") == "model" and rules.mesh_axis("kv_heads") is None
    even = dataclasses.replace(pruned.cfg, layer_kv_heads=(2, 2, 2))
    assert sharding.rules_for(even, mesh).mesh_axis("kv_heads") == "model"
    tokens = _tokens((2, 10))
    np.testing.assert_allclose(jaxdec.score(api.shard(pruned, mesh), tokens),
                               jaxdec.score(pruned, tokens), rtol=1e-5, atol=1e-5)
    odd_heads = dataclasses.replace(pruned.cfg, layer_heads=(4, 3, 2), layer_kv_heads=(2, 1, 2))
    assert_one_line_error(sharding.rules_for, odd_heads, mesh,
                          match="does not divide the 3 query heads of layer 1")
    odd_ffn = dataclasses.replace(pruned.cfg, layer_ffn=(96, 64, 81))
    assert_one_line_error(sharding.rules_for, odd_ffn, mesh,
                          match="does not divide the 81 MLP units of layer 2")


# ---- bad input ---------------------------------------------------------------------------------


def test_bad_widths_are_one_line_errors():
    replace = lambda **kw: dataclasses.replace(BASE, **kw)
    assert_one_line_error(replace, layer_heads=(4, 4), match="layer_heads names 2 layers, n_layers is 3")
    assert_one_line_error(replace, layer_kv_heads=(2, 2, 2, 2), match="layer_kv_heads names 4 layers")
    assert_one_line_error(replace, layer_ffn=(96, 0, 96), match="layer_ffn must be positive")
    assert_one_line_error(replace, layer_heads=(4, 3, 4),
                          match="layer 1: 3 query heads are not a multiple of its 2 kv heads")
    assert_one_line_error(replace, layer_heads=(4, 2, 4), layer_kv_heads=(2, 4, 2),
                          match="layer 1: 2 query heads are not a multiple of its 4 kv heads")
    moe = replace(layer_types=("attention+mlp", "attention+moe", "attention+mlp"),
                  moe=MoEConfig(n_experts=4, top_k=2, d_expert=32))
    assert_one_line_error(dataclasses.replace, moe, layer_ffn=(96, 64, 96),
                          match="layer 1 is 'attention\\+moe': per-layer widths apply to attention "
                                "heads and dense MLPs only")
    assert dataclasses.replace(moe, layer_ffn=(64, 96, 80)).ffn_width(2) == 80
    mamba = replace(layer_types=("attention+mlp", "mamba", "attention+mlp"),
                    mamba=MambaConfig(n_heads=4, head_dim=16, n_groups=1, d_state=8))
    assert_one_line_error(dataclasses.replace, mamba, layer_heads=(4, 2, 4), match="layer 1 is 'mamba'")
    # (a config error is also a ValueError, as the config's other checks always were)
    with pytest.raises(ValueError):
        replace(layer_heads=(4, 3, 4))


def test_tensor_shapes_inconsistent_with_the_widths_are_one_line_errors(models, tmp_path):
    pruned, zeroed, _ = models
    # the pruned params under the unpruned config, the unpruned under narrower widths: the
    # first parameter that disagrees is named (before anything is compiled or written)
    wrong = dataclasses.replace(pruned, cfg=BASE)
    assert_one_line_error(jaxdec.score, wrong, _tokens((1, 8)), match=r"layers\.1\.mixer\.wq")
    assert_one_line_error(jaxdec.save, wrong, tmp_path / "bad", match=r"layers\.1\.mixer\.wq")
    assert not (tmp_path / "bad").exists()
    narrow = dataclasses.replace(zeroed, cfg=dataclasses.replace(BASE, layer_ffn=(96, 96, 80)))
    assert_one_line_error(api.generate_ids, narrow, [[1, 2, 3]], max_new_tokens=2,
                          match=r"layers\.2\.ffn\.w_gate has shape \(64, 96\), the config "
                                r"declares \(64, 80\)")
    # a checkpoint whose config disagrees with its tensors
    path = jaxdec.save(pruned, tmp_path / "ckpt")
    meta = json.loads((path / "jaxdec.json").read_text())
    assert meta["config"]["layer_ffn"] == [96, 64, 80]
    meta["config"]["layer_ffn"] = [96, 72, 80]
    (path / "jaxdec.json").write_text(json.dumps(meta))
    assert_one_line_error(jaxdec.load, str(path),
                          match=r"ckpt: tensor layers\.1\.ffn\.w_gate is stored with shape \(64, 64\), "
                                r"its config declares \(64, 72\)")
