"""Parameter declarations: init, abstract shapes and sharding specs derive from one place."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxdec import pytree
from jaxdec.formats import convert
from jaxdec.config import ModelConfig, RopeScaling
from jaxdec.models import transformer

CFG = ModelConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                  head_dim=8, d_ff=48, qkv_bias=True, tie_embeddings=True)


def test_init_and_abstract_agree_with_declaration():
    decl = transformer.declare(CFG)
    params = pytree.init_params(decl, jax.random.key(0), jnp.bfloat16)
    abstract = pytree.abstract_params(decl, jnp.bfloat16)
    assert jax.tree.structure(params) == jax.tree.structure(abstract)
    for p, a in zip(jax.tree.leaves(params), jax.tree.leaves(abstract)):
        assert p.shape == a.shape and p.dtype == a.dtype == jnp.bfloat16
    assert params.embed is None and params.lm_head.shape == (32, 128)  # tied: one table
    np.testing.assert_array_equal(params.layers[0].mixer_norm, 1)
    np.testing.assert_array_equal(params.layers[1].mixer.bq, 0)
    assert 0.015 < float(jnp.std(params.layers[0].mixer.wq.astype(jnp.float32))) < 0.025
    expected = 2 * (32 * 32 * 2 + 32 * 16 * 2 + 32 + 16 * 2 + 3 * 32 * 48 + 64) + 32 * 128 + 32
    assert convert.param_count(params) == expected


def test_partition_specs_follow_logical_axes():
    rules = pytree.LogicalRules((("q_heads", "model"), ("kv_heads", "model"), ("mlp", "model"),
                                 ("vocab", "model")))
    specs = pytree.partition_specs(transformer.declare(CFG), rules)
    assert specs.layers[0].mixer.wq == P(None, "model", None)
    assert specs.layers[0].ffn.w_down == P("model", None)
    assert specs.lm_head == P(None, "model")
    assert specs.final_norm == P(None)


def test_colliding_rules_are_refused():
    rules = pytree.LogicalRules((("embed", "model"), ("mlp", "model")))
    with pytest.raises(ValueError, match="colliding"):
        pytree.partition_specs(transformer.declare(CFG), rules)


def test_config_is_hashable_and_round_trips():
    cfg = ModelConfig(vocab_size=10, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4,
                      d_ff=8, rope_scaling=RopeScaling(factor=32.0), eos_ids=(3, 4))
    assert hash(cfg) == hash(ModelConfig.from_dict(json.loads(cfg.to_json())))
    assert ModelConfig.from_dict(json.loads(cfg.to_json())) == cfg
    with pytest.raises(ValueError):
        ModelConfig(vocab_size=10, d_model=8, n_layers=1, n_heads=3, n_kv_heads=2, head_dim=4, d_ff=8)
