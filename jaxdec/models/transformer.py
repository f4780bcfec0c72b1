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
from functools import partial

import jax
import jax.numpy as jnp

from jaxdec import formats, layers, sharding
from jaxdec.cache import dense, kinds
from jaxdec.config import ModelConfig
from jaxdec.models import mamba, mla, moe
from jaxdec.pytree import ParamSpec
from jaxdec.ops import cpu_kernel
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
    (None), as the config's layer type says."""

    mixer_norm: jax.Array | None  # [D]
    mixer: Mixer | None
    ffn_norm: jax.Array | None  # [D]
    ffn: FeedForward | None


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
    mixers = {"attention": _declare_attention, "mla": mla.declare, "mamba": mamba.declare}
    ffns = {"mlp": _declare_mlp, "moe": moe.declare}
    layer = lambda mixer, ffn: LayerParams(
        mixer_norm=norm if mixer else None, mixer=mixers[mixer](cfg) if mixer else None,
        ffn_norm=norm if ffn else None, ffn=ffns[ffn](cfg) if ffn else None)
    return Params(
        embed=None if cfg.tie_embeddings else ParamSpec((v, d), ("vocab", "embed")),
        layers=tuple(layer(mixer, ffn) for mixer, ffn in cfg.kinds),
        final_norm=norm,
        lm_head=ParamSpec((d, v), ("embed", "vocab"), n_in=1),
    )


def _declare_attention(cfg: ModelConfig) -> Attention:
    d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
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


def _declare_mlp(cfg: ModelConfig) -> MLP:
    d, f = cfg.d_model, cfg.d_ff
    return MLP(w_gate=ParamSpec((d, f), ("embed", "mlp"), n_in=1) if cfg.mlp_act == "silu" else None,
               w_up=ParamSpec((d, f), ("embed", "mlp"), n_in=1),
               w_down=ParamSpec((f, d), ("mlp", "embed"), n_in=1))


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


def project_qkv(x, p: Attention, positions, cfg: ModelConfig, mm=layers.linear):
    """x [B, T, D] -> q [B, T, N, H], k and v [B, T, K, H]: biases, q/k norms and RoPE
    applied. `mm` is the matmul (`layers.linear`; training passes a differentiable one)."""
    q, k, v = mm(x, p.wq), mm(x, p.wk), mm(x, p.wv)
    if p.bq is not None:
        q, k, v = q + p.bq, k + p.bk, v + p.bv
    if p.q_norm is not None:
        q, k = layers.rms_norm(q, p.q_norm, cfg.norm_eps), layers.rms_norm(k, p.k_norm, cfg.norm_eps)
    if cfg.attention_rope:
        inv_freq = layers.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        factor = cfg.rope_scaling.attention_factor if cfg.rope_scaling else 1.0
        q, k = layers.rope(q, positions, inv_freq, factor), layers.rope(k, positions, inv_freq, factor)
    return q, k, v


def attention_block(x, p: Attention, positions, kv: dense.KVLayer | None, past, cfg: ModelConfig,
                    tree: "Tree | None" = None):
    """x: [B, T, D] -> ([B, T, D], updated cache layer). `past` (bool[B, T, S]) marks the
    cache slots each query sees besides the chunk itself (None without a cache); `tree`
    replaces the chunk's causal mask and the slots it is written to (see `Tree`)."""
    with jax.named_scope("attention"):
        q, k, v = project_qkv(x, p, positions, cfg)
        mask, slots = (dense.chunk_mask(positions), positions) if tree is None else tree
        chunk = (k.swapaxes(1, 2), v.transpose(0, 2, 3, 1), mask)
        if kv is None:  # attend within the chunk only
            out = layers.attention(q, chunk)
        elif q.shape[1] == 1 and tree is None and (cfg.attention_impl != "xla" or not isinstance(kv, dense.KVLayer)):
            # a decode step through the kernel op of the entry's kind: write, then attend
            kv = kinds.write(kv, k, v, positions)
            seen = jnp.where(positions[:, 0] >= 0, positions[:, 0] + 1, 0)
            out = kinds.decode_attention(q[:, 0], kv, seen, cfg.attention_impl)[:, None]
        elif tree is None and isinstance(kv, dense.KVLayer) and cpu_kernel.attends(q.shape[1], kv.k.dtype):
            # a short chunk (a decode step, a speculative draft) on the CPU kernel: write, then
            # attend over the cache alone. Each query's sums then run over its keys in slot
            # order whatever the chunk's length, so a draft's verification computes every row
            # bit for bit as the decode step of that token would (greedy speculation stays
            # token-identical to plain decoding, in bf16 too).
            kv = kinds.write(kv, k, v, positions)
            out = layers.attention(q, (kv.k, kv.v, dense.with_chunk(past, positions, mask)))
        else:  # the cache as it was before this chunk, then the chunk itself
            out = layers.attention(q, (*kinds.dense_view(kv, q.dtype), past), chunk)
            kv = kinds.write(kv, k, v, slots)
        return layers.linear(out, p.wo, n_in=2), kv


def decoder_layer(x, p: LayerParams, positions, entry, past, cfg: ModelConfig, kind, tree=None):
    """One layer of kind (mixer, feed-forward) -> (x, its updated cache entry)."""
    mixer, ffn = kind
    p = dfloat11.decompress_tree(p, after=x)  # DFloat11 weights: one decode per layer, here
    if mixer is not None:
        h = layers.rms_norm(x, p.mixer_norm, cfg.norm_eps)
        if mixer == "attention":
            h, entry = attention_block(h, p.mixer, positions, entry, past, cfg, tree)
        elif mixer == "mla":
            with jax.named_scope("mla"):
                h, entry = mla.block(h, p.mixer, positions, entry, past, cfg, tree)
        else:
            if tree is not None:
                raise ValueError("a Mamba layer cannot verify a tree of tokens")
            with jax.named_scope("mamba"):
                h, entry = mamba.block(h, p.mixer, positions, entry, cfg)
        x = x + h
    if ffn is not None:
        h = layers.rms_norm(x, p.ffn_norm, cfg.norm_eps)
        if ffn == "mlp":
            h = layers.gated_mlp(h, p.ffn.w_gate, p.ffn.w_up, p.ffn.w_down)
        else:
            with jax.named_scope("moe"):
                h = moe.block(h, p.ffn, cfg)
        x = x + h
    return x, entry


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
    past = None if cache is None else dense.before(cache.lengths, positions, cache.n_slots)
    new_layers, tapped = [], []
    for i, (p, kind) in enumerate(zip(params.layers, cfg.kinds)):  # unrolled: faster than scan on XLA:CPU
        if i in taps:
            tapped.append(x)
        entry = None if cache is None else cache.layers[i]
        with jax.named_scope(f"layer_{i}"):
            x, entry = decoder_layer(x, p, positions, entry, past, cfg, kind, tree)
        new_layers.append(entry)
    x = layers.rms_norm(x, params.final_norm, cfg.norm_eps)
    tapped = tuple(tapped[sorted(taps).index(i)] for i in taps)
    if cache is None:
        return x, None, tapped
    cache = dense.KVCache(layers=tuple(new_layers), lengths=dense.advance(cache.lengths, positions))
    return x, sharding.constrain_cache(cache, cfg), tapped


def logits_from_hidden(params: Params, h: jax.Array) -> jax.Array:
    """[..., D] -> float32 logits [..., V]."""
    with jax.named_scope("lm_head"):
        return layers.linear(h, params.lm_head, dtype=jnp.float32)


def forward(params: Params, tokens, positions, cache, cfg: ModelConfig):
    """tokens, positions: i32[B, T] -> (f32 logits [B, T, V], cache)."""
    h, cache = hidden(params, tokens, positions, cache, cfg)
    return logits_from_hidden(params, h), cache
