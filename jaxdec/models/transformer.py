"""The Llama family (Llama, SmolLM2, Qwen2) as a pure function.

    logits, cache = forward(params, tokens, positions, cache, cfg)

Prefill and decode are this same function on different shapes. `positions` (i32[B, T])
gives each token's position; a negative position marks padding (ragged batches). With
`cache=None` the tokens attend only to each other (scoring a whole sequence).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxdec import layers
from jaxdec.cache import dense
from jaxdec.config import ModelConfig
from jaxdec.pytree import ParamSpec


@partial(jax.tree_util.register_dataclass,
         data_fields=["attn_norm", "wq", "wk", "wv", "wo", "bq", "bk", "bv",
                      "mlp_norm", "w_gate", "w_up", "w_down"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class LayerParams:
    attn_norm: jax.Array  # [D]
    wq: jax.Array  # [D, N, H]
    wk: jax.Array  # [D, K, H]
    wv: jax.Array  # [D, K, H]
    wo: jax.Array  # [N, H, D]
    bq: jax.Array | None  # [N, H] (Qwen2) or None
    bk: jax.Array | None  # [K, H]
    bv: jax.Array | None  # [K, H]
    mlp_norm: jax.Array  # [D]
    w_gate: jax.Array  # [D, F]
    w_up: jax.Array  # [D, F]
    w_down: jax.Array  # [F, D]


@partial(jax.tree_util.register_dataclass,
         data_fields=["embed", "layers", "final_norm", "lm_head"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Params:
    embed: jax.Array | None  # [V, D]; None when tied (looked up from lm_head)
    layers: tuple[LayerParams, ...]
    final_norm: jax.Array  # [D]
    lm_head: jax.Array  # [D, V]


def declare(cfg: ModelConfig) -> Params:
    """The one declaration of every parameter: shape, logical axes, initializer."""
    d, n, k, h, f, v = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff,
                        cfg.vocab_size)
    norm = ParamSpec((d,), ("norm",), init="ones")
    bias = lambda heads, name: (ParamSpec((heads, h), (name, "head_dim"), init="zeros")
                                if cfg.qkv_bias else None)
    layer = LayerParams(
        attn_norm=norm,
        wq=ParamSpec((d, n, h), ("embed", "q_heads", "head_dim")),
        wk=ParamSpec((d, k, h), ("embed", "kv_heads", "head_dim")),
        wv=ParamSpec((d, k, h), ("embed", "kv_heads", "head_dim")),
        wo=ParamSpec((n, h, d), ("q_heads", "head_dim", "embed")),
        bq=bias(n, "q_heads"), bk=bias(k, "kv_heads"), bv=bias(k, "kv_heads"),
        mlp_norm=norm,
        w_gate=ParamSpec((d, f), ("embed", "mlp")),
        w_up=ParamSpec((d, f), ("embed", "mlp")),
        w_down=ParamSpec((f, d), ("mlp", "embed")),
    )
    return Params(
        embed=None if cfg.tie_embeddings else ParamSpec((v, d), ("vocab", "embed")),
        layers=tuple(layer for _ in range(cfg.n_layers)),
        final_norm=norm,
        lm_head=ParamSpec((d, v), ("embed", "vocab")),
    )


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    """[B, T] -> [B, T, D]. A tied model reads the columns of the LM head."""
    if params.embed is not None:
        return jnp.take(params.embed, tokens, axis=0)
    return jnp.moveaxis(jnp.take(params.lm_head, tokens, axis=1), 0, -1)


def attention_block(x, p: LayerParams, positions, kv: dense.KVLayer | None, cfg: ModelConfig):
    """x: [B, T, D] -> ([B, T, D], updated cache layer)."""
    with jax.named_scope("attention"):
        q = layers.linear(x, p.wq, "btd,dnh->btnh")
        k = layers.linear(x, p.wk, "btd,dkh->btkh")
        v = layers.linear(x, p.wv, "btd,dkh->btkh")
        if p.bq is not None:
            q, k, v = q + p.bq, k + p.bk, v + p.bv
        inv_freq = layers.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        q, k = layers.rope(q, positions, inv_freq), layers.rope(k, positions, inv_freq)
        if kv is None:  # attend within the chunk: keys are the chunk itself
            keys, values = k.swapaxes(1, 2), v.swapaxes(1, 2)
            mask = _chunk_mask(positions)
        else:
            kv = dense.write(kv, k, v, positions)
            keys, values = kv.k, kv.v
            mask = dense.visible(positions, kv.k.shape[2])
        out = layers.attention(q, keys, values, mask)
        return layers.linear(out, p.wo, "btnh,nhd->btd"), kv


def _chunk_mask(positions: jax.Array) -> jax.Array:
    """bool[B, T, T]: causal by position, padding (position < 0) sees and is seen by nothing."""
    q, k = positions[:, :, None], positions[:, None, :]
    return (k <= q) & (k >= 0) & (q >= 0)


def decoder_layer(x, p: LayerParams, positions, kv, cfg: ModelConfig):
    h, kv = attention_block(layers.rms_norm(x, p.attn_norm, cfg.norm_eps), p, positions, kv, cfg)
    x = x + h
    x = x + layers.gated_mlp(layers.rms_norm(x, p.mlp_norm, cfg.norm_eps),
                             p.w_gate, p.w_up, p.w_down)
    return x, kv


def hidden(params: Params, tokens, positions, cache: dense.KVCache | None, cfg: ModelConfig):
    """Final-norm hidden states [B, T, D] and the updated cache."""
    x = embed(params, tokens)
    new_layers = []
    for i, p in enumerate(params.layers):  # unrolled: faster than scan on XLA:CPU
        with jax.named_scope(f"layer_{i}"):
            x, kv = decoder_layer(x, p, positions, None if cache is None else cache.layers[i], cfg)
        new_layers.append(kv)
    x = layers.rms_norm(x, params.final_norm, cfg.norm_eps)
    if cache is None:
        return x, None
    return x, dense.KVCache(layers=tuple(new_layers),
                            lengths=dense.advance(cache.lengths, positions))


def logits_from_hidden(params: Params, h: jax.Array) -> jax.Array:
    """[..., D] -> float32 logits [..., V]."""
    with jax.named_scope("lm_head"):
        return jnp.einsum("...d,dv->...v", h, params.lm_head, preferred_element_type=jnp.float32)


def forward(params: Params, tokens, positions, cache, cfg: ModelConfig):
    """tokens, positions: i32[B, T] -> (f32 logits [B, T, V], cache)."""
    h, cache = hidden(params, tokens, positions, cache, cfg)
    return logits_from_hidden(params, h), cache


def params_from_hf(cfg: ModelConfig, tensors: dict[str, np.ndarray], dtype=jnp.float32) -> Params:
    """Build Params from Hugging Face-named tensors (HF shapes: linear weights [out, in])."""
    d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    arr = lambda a: jnp.asarray(np.asarray(a, np.float32), dtype)

    def layer(i: int) -> LayerParams:
        t = lambda name: tensors[f"model.layers.{i}.{name}"]
        bias = lambda name, heads: arr(t(name).reshape(heads, h)) if cfg.qkv_bias else None
        return LayerParams(
            attn_norm=arr(t("input_layernorm.weight")),
            wq=arr(t("self_attn.q_proj.weight").T.reshape(d, n, h)),
            wk=arr(t("self_attn.k_proj.weight").T.reshape(d, k, h)),
            wv=arr(t("self_attn.v_proj.weight").T.reshape(d, k, h)),
            wo=arr(t("self_attn.o_proj.weight").T.reshape(n, h, d)),
            bq=bias("self_attn.q_proj.bias", n), bk=bias("self_attn.k_proj.bias", k),
            bv=bias("self_attn.v_proj.bias", k),
            mlp_norm=arr(t("post_attention_layernorm.weight")),
            w_gate=arr(t("mlp.gate_proj.weight").T), w_up=arr(t("mlp.up_proj.weight").T),
            w_down=arr(t("mlp.down_proj.weight").T),
        )

    head = tensors["model.embed_tokens.weight"] if cfg.tie_embeddings else tensors["lm_head.weight"]
    return Params(
        embed=None if cfg.tie_embeddings else arr(tensors["model.embed_tokens.weight"]),
        layers=tuple(layer(i) for i in range(cfg.n_layers)),
        final_norm=arr(tensors["model.norm.weight"]),
        lm_head=arr(np.ascontiguousarray(head.T)),
    )
