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

from jaxdec import layers, quant
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
        wq=ParamSpec((d, n, h), ("embed", "q_heads", "head_dim"), n_in=1),
        wk=ParamSpec((d, k, h), ("embed", "kv_heads", "head_dim"), n_in=1),
        wv=ParamSpec((d, k, h), ("embed", "kv_heads", "head_dim"), n_in=1),
        wo=ParamSpec((n, h, d), ("q_heads", "head_dim", "embed"), n_in=2),
        bq=bias(n, "q_heads"), bk=bias(k, "kv_heads"), bv=bias(k, "kv_heads"),
        mlp_norm=norm,
        w_gate=ParamSpec((d, f), ("embed", "mlp"), n_in=1),
        w_up=ParamSpec((d, f), ("embed", "mlp"), n_in=1),
        w_down=ParamSpec((f, d), ("mlp", "embed"), n_in=1),
    )
    return Params(
        embed=None if cfg.tie_embeddings else ParamSpec((v, d), ("vocab", "embed")),
        layers=tuple(layer for _ in range(cfg.n_layers)),
        final_norm=norm,
        lm_head=ParamSpec((d, v), ("embed", "vocab"), n_in=1),
    )


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    """[B, T] -> [B, T, D]. A tied model reads the columns of the LM head."""
    if params.embed is not None:
        return _take(params.embed, tokens, axis=0)
    if isinstance(params.lm_head, quant.QArray):
        dtype = params.final_norm.dtype
        return jnp.moveaxis(quant.take_columns(params.lm_head, tokens), 0, -1).astype(dtype)
    return jnp.moveaxis(_take(params.lm_head, tokens, axis=1), 0, -1)


def _take(table: jax.Array, idx: jax.Array, axis: int) -> jax.Array:
    """`jnp.take` that moves a bfloat16 table's bits as uint16: XLA:CPU gathers bf16 by
    widening the whole table to f32 first, which a decode loop hoists but a chunked one
    (streaming) pays on every chunk (the 576x49152 LM head: ~0.1 s)."""
    if table.dtype != jnp.bfloat16:
        return jnp.take(table, idx, axis=axis)
    bits = jnp.take(jax.lax.bitcast_convert_type(table, jnp.uint16), idx, axis=axis)
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


def attention_block(x, p: LayerParams, positions, kv: dense.KVLayer | None, past, cfg: ModelConfig):
    """x: [B, T, D] -> ([B, T, D], updated cache layer). `past` (bool[B, T, S]) marks the
    cache slots each query sees besides the chunk itself (None without a cache)."""
    with jax.named_scope("attention"):
        q, k, v = layers.linear(x, p.wq), layers.linear(x, p.wk), layers.linear(x, p.wv)
        if p.bq is not None:
            q, k, v = q + p.bq, k + p.bk, v + p.bv
        inv_freq = layers.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        q, k = layers.rope(q, positions, inv_freq), layers.rope(k, positions, inv_freq)
        chunk = (k.swapaxes(1, 2), v.transpose(0, 2, 3, 1), _chunk_mask(positions))
        if kv is None:  # attend within the chunk only
            out = layers.attention(q, chunk)
        else:  # the cache as it was before this chunk, then the chunk itself
            out = layers.attention(q, (kv.k, kv.v, past), chunk)
            kv = dense.write(kv, k, v, positions)
        return layers.linear(out, p.wo, n_in=2), kv


def _chunk_mask(positions: jax.Array) -> jax.Array:
    """bool[B, T, T]: causal by position, padding (position < 0) sees and is seen by nothing."""
    q, k = positions[:, :, None], positions[:, None, :]
    return (k <= q) & (k >= 0) & (q >= 0)


def decoder_layer(x, p: LayerParams, positions, kv, past, cfg: ModelConfig):
    h, kv = attention_block(layers.rms_norm(x, p.attn_norm, cfg.norm_eps), p, positions, kv,
                            past, cfg)
    x = x + h
    x = x + layers.gated_mlp(layers.rms_norm(x, p.mlp_norm, cfg.norm_eps),
                             p.w_gate, p.w_up, p.w_down)
    return x, kv


def hidden(params: Params, tokens, positions, cache: dense.KVCache | None, cfg: ModelConfig):
    """Final-norm hidden states [B, T, D] and the updated cache."""
    x = embed(params, tokens)
    past = None if cache is None else dense.before(cache.lengths, positions, cache.n_slots)
    new_layers = []
    for i, p in enumerate(params.layers):  # unrolled: faster than scan on XLA:CPU
        kv = None if cache is None else cache.layers[i]
        with jax.named_scope(f"layer_{i}"):
            x, kv = decoder_layer(x, p, positions, kv, past, cfg)
        new_layers.append(kv)
    x = layers.rms_norm(x, params.final_norm, cfg.norm_eps)
    if cache is None:
        return x, None
    return x, dense.KVCache(layers=tuple(new_layers),
                            lengths=dense.advance(cache.lengths, positions))


def logits_from_hidden(params: Params, h: jax.Array) -> jax.Array:
    """[..., D] -> float32 logits [..., V]."""
    with jax.named_scope("lm_head"):
        return layers.linear(h, params.lm_head, dtype=jnp.float32)


def forward(params: Params, tokens, positions, cache, cfg: ModelConfig):
    """tokens, positions: i32[B, T] -> (f32 logits [B, T, V], cache)."""
    h, cache = hidden(params, tokens, positions, cache, cfg)
    return logits_from_hidden(params, h), cache


def params_from_hf(cfg: ModelConfig, tensors: dict[str, np.ndarray], dtype=jnp.float32,
                   blocks: dict[str, quant.QArray] | None = None) -> Params:
    """Build Params from Hugging Face-named tensors (HF shapes: linear weights [out, in]).

    A linear weight named in `blocks` (a `QArray` of the [in, out] matrix) is used as it
    is, reshaped to the declared logical shape; the other weights are cast to `dtype`.
    """
    d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    blocks = blocks or {}
    arr = lambda a: jnp.asarray(np.asarray(a, np.float32), dtype)

    def matrix(name: str, shape: tuple[int, ...], n_in: int = 1):
        if name in blocks:
            qa = blocks[name]
            return dataclasses.replace(jax.tree.map(jnp.asarray, qa), shape=shape, n_in=n_in)
        return arr(np.ascontiguousarray(tensors[name].T).reshape(shape))

    def layer(i: int) -> LayerParams:
        pre = f"model.layers.{i}."
        t = lambda name: tensors[pre + name]
        bias = lambda name, heads: arr(t(name).reshape(heads, h)) if cfg.qkv_bias else None
        return LayerParams(
            attn_norm=arr(t("input_layernorm.weight")),
            wq=matrix(pre + "self_attn.q_proj.weight", (d, n, h)),
            wk=matrix(pre + "self_attn.k_proj.weight", (d, k, h)),
            wv=matrix(pre + "self_attn.v_proj.weight", (d, k, h)),
            wo=matrix(pre + "self_attn.o_proj.weight", (n, h, d), n_in=2),
            bq=bias("self_attn.q_proj.bias", n), bk=bias("self_attn.k_proj.bias", k),
            bv=bias("self_attn.v_proj.bias", k),
            mlp_norm=arr(t("post_attention_layernorm.weight")),
            w_gate=matrix(pre + "mlp.gate_proj.weight", (d, cfg.d_ff)),
            w_up=matrix(pre + "mlp.up_proj.weight", (d, cfg.d_ff)),
            w_down=matrix(pre + "mlp.down_proj.weight", (cfg.d_ff, d)),
        )

    head = "model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"
    return Params(
        embed=None if cfg.tie_embeddings else arr(tensors["model.embed_tokens.weight"]),
        layers=tuple(layer(i) for i in range(cfg.n_layers)),
        final_norm=arr(tensors["model.norm.weight"]),
        lm_head=matrix(head, (d, cfg.vocab_size)),
    )
