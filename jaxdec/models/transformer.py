"""Every jaxdec model family as one pure function: the Llama family (Llama, SmolLM2,
Qwen2), MoE (Mixtral, Qwen2/3-MoE), MLA (DeepSeek-V3), Mamba2 and hybrids (Nemotron-H).

    logits, cache = forward(params, tokens, positions, cache, cfg)

Each layer is a pre-norm residual mixer (attention, MLA or Mamba2) and/or feed-forward (MLP
or MoE), by `cfg.layer_types`; the cache holds one entry per layer (`jaxdec.cache.dense`).
Prefill and decode are this same function on different shapes. `positions` (i32[B, T])
gives each token's position; a negative position marks padding (ragged batches). With
`cache=None` the tokens attend only to each other (scoring a whole sequence).
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp

from jaxdec import formats, layers
from jaxdec.cache import dense, entry
from jaxdec.config import ModelConfig
from jaxdec.errors import JaxdecError
from jaxdec.models import mamba, mla, moe
from jaxdec.pytree import ParamSpec
from jaxdec.formats import dfloat11


@partial(jax.tree_util.register_dataclass,
         data_fields=["wq", "wk", "wv", "wo", "bq", "bk", "bv", "q_norm", "k_norm"],
         meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Attention:
    wq: jax.Array  # [D, N, H]
    wk: jax.Array  # [D, K, H]
    wv: jax.Array  # [D, K, H]
    wo: jax.Array  # [N, H, D]
    bq: jax.Array | None  # [N, H] (Qwen2) or None
    bk: jax.Array | None  # [K, H]
    bv: jax.Array | None  # [K, H]
    q_norm: jax.Array | None  # [H] (Qwen3) or None
    k_norm: jax.Array | None  # [H]


@partial(jax.tree_util.register_dataclass, data_fields=["w_gate", "w_up", "w_down"],
         meta_fields=[])
@dataclasses.dataclass(frozen=True)
class MLP:
    w_gate: jax.Array | None  # [D, F]; None for the squared-ReLU MLP
    w_up: jax.Array  # [D, F]
    w_down: jax.Array  # [F, D]


Mixer = Attention | mla.MLAParams | mamba.MixerParams
FeedForward = MLP | moe.MoEParams


@partial(jax.tree_util.register_dataclass,
         data_fields=["mixer_norm", "mixer", "ffn_norm", "ffn"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class LayerParams:
    """One layer: x += mixer(norm(x)), then x += ffn(norm(x)); either part may be absent
    (None), as the config's layer type says. With `cfg.post_norms` a layer is a
    `PostNormLayerParams`."""

    mixer_norm: jax.Array | None  # [D]
    mixer: Mixer | None
    ffn_norm: jax.Array | None  # [D]
    ffn: FeedForward | None
    mixer_post_norm = None  # not fields here (saved checkpoints keep their tree): see below
    ffn_post_norm = None


@partial(jax.tree_util.register_dataclass,
         data_fields=["mixer_norm", "mixer", "ffn_norm", "ffn", "mixer_post_norm", "ffn_post_norm"],
         meta_fields=[])
@dataclasses.dataclass(frozen=True)
class PostNormLayerParams(LayerParams):
    """A layer that norms each part's output again before adding it (Gemma, `cfg.post_norms`):
    x += post_norm(mixer(norm(x))), then x += post_norm(ffn(norm(x)))."""

    mixer_post_norm: jax.Array | None = None  # [D]
    ffn_post_norm: jax.Array | None = None  # [D]


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
    d, v = cfg.d_model, cfg.vocab_size
    norm = ParamSpec((d,), ("norm",), init="ones")
    # each declared for layer i (attention and MLP widths may differ per layer)
    mixers = {"attention": _declare_attention, "mla": lambda cfg, i: mla.declare(cfg),
              "mamba": lambda cfg, i: mamba.declare(cfg)}
    ffns = {"mlp": _declare_mlp, "moe": lambda cfg, i: moe.declare(cfg)}

    def layer(i, mixer, ffn):
        parts = dict(mixer_norm=norm if mixer else None, mixer=mixers[mixer](cfg, i) if mixer else None,
                     ffn_norm=norm if ffn else None, ffn=ffns[ffn](cfg, i) if ffn else None)
        if not cfg.post_norms:
            return LayerParams(**parts)
        return PostNormLayerParams(**parts, mixer_post_norm=norm if mixer else None,
                                   ffn_post_norm=norm if ffn else None)
    return Params(
        embed=None if cfg.tie_embeddings else ParamSpec((v, d), ("vocab", "embed")),
        layers=tuple(layer(i, mixer, ffn) for i, (mixer, ffn) in enumerate(cfg.kinds)),
        final_norm=norm,
        lm_head=ParamSpec((d, v), ("embed", "vocab"), n_in=1),
    )


def _declare_attention(cfg: ModelConfig, i: int) -> Attention:
    d, n, k, h = cfg.d_model, cfg.heads(i), cfg.kv_heads(i), cfg.head_dim
    bias = lambda heads, name: (ParamSpec((heads, h), (name, "head_dim"), init="zeros")
                                if cfg.qkv_bias else None)
    qk_norm = ParamSpec((h,), ("norm",), init="ones") if cfg.qk_norm else None
    return Attention(
        wq=ParamSpec((d, n, h), ("embed", "q_heads", "head_dim"), n_in=1),
        wk=ParamSpec((d, k, h), ("embed", "kv_heads", "head_dim"), n_in=1),
        wv=ParamSpec((d, k, h), ("embed", "kv_heads", "head_dim"), n_in=1),
        wo=ParamSpec((n, h, d), ("q_heads", "head_dim", "embed"), n_in=2),
        bq=bias(n, "q_heads"), bk=bias(k, "kv_heads"), bv=bias(k, "kv_heads"),
        q_norm=qk_norm, k_norm=qk_norm)


def _declare_mlp(cfg: ModelConfig, i: int) -> MLP:
    d, f = cfg.d_model, cfg.ffn_width(i)
    return MLP(w_gate=ParamSpec((d, f), ("embed", "mlp"), n_in=1) if cfg.mlp_act != "relu2" else None,
               w_up=ParamSpec((d, f), ("embed", "mlp"), n_in=1),
               w_down=ParamSpec((f, d), ("mlp", "embed"), n_in=1))


def check_params(params: Params, cfg: ModelConfig, source: str = "") -> None:
    """A one-line JaxdecError naming the first parameter of `params` whose shape is not
    the one `cfg` declares (e.g. a pruned model's weights under other widths), or that is
    missing or not declared. Weights of any format are compared by their logical shape."""
    prefix = f"{source}: " if source else ""
    is_leaf = lambda x: x is None or isinstance(x, ParamSpec)
    for keypath, spec in jax.tree_util.tree_flatten_with_path(declare(cfg), is_leaf=is_leaf)[0]:
        value, name = params, []
        for k in keypath:
            name.append(k.name if isinstance(k, jax.tree_util.GetAttrKey) else str(k.idx))
            if isinstance(k, jax.tree_util.GetAttrKey):
                value = getattr(value, k.name, None)
            else:
                value = value[k.idx] if isinstance(value, (tuple, list)) and k.idx < len(value) else None
            if value is None:
                break
        name = ".".join(name)
        if (spec is None) != (value is None):
            what = "is missing" if value is None else "is not declared by the config"
            raise JaxdecError(f"{prefix}parameter {name} {what} (config {cfg.arch}, "
                              f"{cfg.n_layers} layers)")
        while spec is not None and not hasattr(value, "shape") and hasattr(value, "w"):
            value = value.w  # (an activation-quantised weight's matrix)
        shape = getattr(value, "shape", None)
        if spec is not None and shape is not None and tuple(shape) != tuple(spec.shape):
            raise JaxdecError(f"{prefix}parameter {name} has shape {tuple(shape)}, the config "
                              f"declares {tuple(spec.shape)}")
    if len(params.layers) != cfg.n_layers:
        raise JaxdecError(f"{prefix}the parameters have {len(params.layers)} layers, the config "
                          f"{cfg.n_layers}")


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    """[B, T] -> [B, T, D]. A tied model reads the columns of the LM head."""
    dtype = params.final_norm.dtype
    if isinstance(params.embed, dfloat11.DF11Array):  # decodes only the rows' blocks
        return dfloat11.take_rows(params.embed, tokens).astype(dtype)
    if params.embed is not None:
        return _take(params.embed, tokens, axis=0)
    if isinstance(params.lm_head, dfloat11.DF11Array):
        if dfloat11.slice_rows(params.lm_head) is not None:  # decoded a slice at a time
            return dfloat11.take_columns(params.lm_head, tokens).astype(dtype)
        head = dfloat11.decompress(params.lm_head, after=tokens)  # whole, then its columns
        return jnp.moveaxis(_take(head, tokens, axis=1), 0, -1).astype(dtype)
    if isinstance(params.lm_head, formats.QArray):
        return jnp.moveaxis(formats.take_columns(params.lm_head, tokens), 0, -1).astype(dtype)
    return jnp.moveaxis(_take(params.lm_head, tokens, axis=1), 0, -1)


def _take(table: jax.Array, idx: jax.Array, axis: int) -> jax.Array:
    """`jnp.take` that moves a bfloat16 table's bits as uint16: XLA:CPU gathers bf16 by
    widening the whole table to f32 first, which a decode loop hoists but a chunked one
    (streaming) pays on every chunk (the 576x49152 LM head: ~0.1 s)."""
    if table.dtype != jnp.bfloat16:
        return jnp.take(table, idx, axis=axis)
    bits = jnp.take(jax.lax.bitcast_convert_type(table, jnp.uint16), idx, axis=axis)
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


def project_qkv(x, p: Attention, positions, cfg: ModelConfig, mm=layers.linear, *,
                window: int | None = None):
    """x [B, T, D] -> q [B, T, N, H], k and v [B, T, K, H]: biases, q/k norms and RoPE (a
    windowed layer's, `cfg.rope_of(window)`) applied, q rescaled so that `layers.attention`'s
    H ** -0.5 makes `cfg.query_scale`. `mm` is the matmul (`layers.linear`; training passes a
    differentiable one)."""
    q, k, v = mm(x, p.wq), mm(x, p.wk), mm(x, p.wv)
    if p.bq is not None:
        q, k, v = q + p.bq, k + p.bk, v + p.bv
    if p.q_norm is not None:
        q, k = layers.rms_norm(q, p.q_norm, cfg.norm_eps), layers.rms_norm(k, p.k_norm, cfg.norm_eps)
    if cfg.attention_rope:
        theta, scaling = cfg.rope_of(window)
        inv_freq = layers.rope_inv_freq(cfg.head_dim, theta, scaling)
        factor = scaling.attention_factor if scaling else 1.0
        q, k = layers.rope(q, positions, inv_freq, factor), layers.rope(k, positions, inv_freq, factor)
    if cfg.query_scale is not None:
        q = q * jnp.asarray(cfg.query_scale * math.sqrt(cfg.head_dim), q.dtype)
    return q, k, v


def attention_block(x, p: Attention, positions, kv, past, cfg: ModelConfig,
                    tree: "Tree | None" = None, window: int | None = None):
    """x: [B, T, D] -> ([B, T, D], updated cache entry). Queries see the entry's slots by
    their positions (`jaxdec.cache.entry`) and the chunk's own keys causally, within
    `window` on a sliding-window layer; `past` (bool[B, T, S + 1]) overrides which slots
    of the entry they see, `tree` the chunk's causal mask and the slots it is written to
    (see `Tree`)."""
    with jax.named_scope("attention"):
        q, k, v = project_qkv(x, p, positions, cfg, window=window)  # (Gemma 3's local RoPE)
        mask, slots = (entry.chunk_mask(positions, window), positions) if tree is None else tree
        if kv is None:  # attend within the chunk only
            out = layers.attention(q, (k.swapaxes(1, 2), v.transpose(0, 2, 3, 1), mask))
        else:  # write, then attend over what the entry holds (`Slotted.attend_chunk`)
            out, kv = kv.attend_chunk(q, k, v, positions, mask, slots, past=past, tree=tree is not None,
                                      impl=cfg.attention_impl, window=window)
        return layers.linear(out, p.wo, n_in=2), kv


def decoder_layer(x, p: LayerParams, positions, kv, past, cfg: ModelConfig, kind, tree=None,
                  window: int | None = None):
    """One layer of kind (mixer, feed-forward) -> (x, its updated cache entry `kv`)."""
    mixer, ffn = kind
    p = dfloat11.decompress_tree(p, after=x)  # DFloat11 weights: one decode per layer, here
    if mixer is not None:
        h = layers.rms_norm(x, p.mixer_norm, cfg.norm_eps)
        if mixer == "attention":
            h, kv = attention_block(h, p.mixer, positions, kv, past, cfg, tree, window)
        elif mixer == "mla":
            with jax.named_scope("mla"):
                h, kv = mla.block(h, p.mixer, positions, kv, past, cfg, tree)
        else:
            if tree is not None:
                raise ValueError("a Mamba layer cannot verify a tree of tokens")
            with jax.named_scope("mamba"):
                h, kv = mamba.block(h, p.mixer, positions, kv, cfg)
        if p.mixer_post_norm is not None:
            h = layers.rms_norm(h, p.mixer_post_norm, cfg.norm_eps)
        x = x + h
    if ffn is not None:
        h = layers.rms_norm(x, p.ffn_norm, cfg.norm_eps)
        if ffn == "mlp":
            h = layers.gated_mlp(h, p.ffn.w_gate, p.ffn.w_up, p.ffn.w_down, cfg.mlp_act)
        else:
            with jax.named_scope("moe"):
                h = moe.block(h, p.ffn, cfg)
        if p.ffn_post_norm is not None:
            h = layers.rms_norm(h, p.ffn_post_norm, cfg.norm_eps)
        x = x + h
    return x, kv


@partial(jax.tree_util.register_dataclass, data_fields=["mask", "slots"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Tree:
    """A chunk of tokens that is not one causal run (speculative tree verification): which
    chunk tokens each query sees, and the cache slots the chunk is written to (siblings
    share a position, so they cannot share the slot that position names)."""

    mask: jax.Array  # bool[B, T, T]: query t sees chunk token s
    slots: jax.Array  # i32[B, T]: where each token's keys/values go; < 0 for nowhere

    def __iter__(self):
        return iter((self.mask, self.slots))


def hidden(params: Params, tokens, positions, cache: dense.KVCache | None, cfg: ModelConfig):
    """Final-norm hidden states [B, T, D] and the updated cache."""
    x, cache, _ = hidden_and_taps(params, tokens, positions, cache, cfg)
    return x, cache


def hidden_and_taps(params: Params, tokens, positions, cache: dense.KVCache | None,
                    cfg: ModelConfig, *, tree: Tree | None = None, taps: tuple[int, ...] = ()):
    """`hidden`, with a tree chunk (`Tree`) and the residual stream entering each layer of
    `taps` ([B, T, D] each, in order: the features a speculative drafter reads)."""
    x = embed(params, tokens)
    if cfg.embed_scale is not None:  # in the activation dtype, as HF's Gemma does
        x = x * jnp.asarray(cfg.embed_scale, x.dtype)
    new_layers, tapped = [], []
    for i, (p, kind) in enumerate(zip(params.layers, cfg.kinds)):  # unrolled: faster than scan on XLA:CPU
        if i in taps:
            tapped.append(x)
        kv = None if cache is None else cache.layers[i]
        with jax.named_scope(f"layer_{i}"):
            x, kv = decoder_layer(x, p, positions, kv, None, cfg, kind, tree, cfg.window(i))
        new_layers.append(kv)
    x = layers.rms_norm(x, params.final_norm, cfg.norm_eps)
    tapped = tuple(tapped[sorted(taps).index(i)] for i in taps)
    if cache is None:
        return x, None, tapped
    cache = dense.KVCache(layers=tuple(new_layers), lengths=dense.advance(cache.lengths, positions))
    return x, dense.constrain(cache, cfg), tapped


def logits_from_hidden(params: Params, h: jax.Array) -> jax.Array:
    """[..., D] -> float32 logits [..., V]."""
    with jax.named_scope("lm_head"):
        return layers.linear(h, params.lm_head, dtype=jnp.float32)


def forward(params: Params, tokens, positions, cache, cfg: ModelConfig):
    """tokens, positions: i32[B, T] -> (f32 logits [B, T, V], cache)."""
    h, cache = hidden(params, tokens, positions, cache, cfg)
    return logits_from_hidden(params, h), cache
