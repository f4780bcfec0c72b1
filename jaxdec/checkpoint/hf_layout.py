"""Where every jaxdec parameter lives in a Hugging Face checkpoint, for every family.

One table (`layout`) maps each declared parameter (by its path in `transformer.Params`) to
the HF tensor(s) it comes from and how to convert them. From it:

- `hf_tensor_shapes(cfg)`: every HF tensor a model of `cfg` has, with its HF shape (what a
  reader checks a checkpoint against);
- `params_from_hf(cfg, tensors)`: the jaxdec `Params` built from HF-named float32 tensors.

Names follow what `save_pretrained` writes (the hub's own layout): per-expert tensors
(`experts.{j}.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.{j}.w1.weight`), and the
`backbone.` prefix of Mamba2 and Nemotron-H.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxdec import formats
from jaxdec.config import ModelConfig
from jaxdec.models import mamba, transformer
from jaxdec.pytree import ParamSpec, is_spec

# arch -> (embedding, layer prefix, final norm)
_FRAME = {
    "mamba2": ("backbone.embeddings.weight", "backbone.layers.{i}.", "backbone.norm_f.weight"),
    "nemotron_h": ("backbone.embeddings.weight", "backbone.layers.{i}.", "backbone.norm_f.weight"),
}
_LLAMA_FRAME = ("model.embed_tokens.weight", "model.layers.{i}.", "model.norm.weight")


@dataclasses.dataclass(frozen=True)
class Source:
    """The HF tensors one parameter comes from.

    kind: "linear" (one [out, in] weight, transposed to [in, out]), "vector" (as stored),
    "plus_one" (a norm weight w that scales by 1 + w, Gemma's, read as 1 + w),
    "conv" (torch's depthwise [C, 1, K] -> [K, C]), "experts" (one [out, in] weight per
    expert, stacked and transposed to [E, in, out]).
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    kind: str
    part: tuple[int, int] | None = None  # rows [start, stop) of the first HF axis only


def _linear(name, out, inp):
    return Source((name,), ((out, inp),), "linear")


def _vector(name, *shape):
    return Source((name,), (tuple(shape),), "vector")


def _norm(cfg: ModelConfig, name: str, n: int) -> Source:
    """An RMSNorm weight [n]: HF's Gemma stores w and scales by 1 + w."""
    return Source((name,), ((n,),), "plus_one" if cfg.arch == "gemma3" else "vector")


def _attention(cfg: ModelConfig, pre: str) -> dict[str, Source]:
    d, h, q, kv = cfg.d_model, cfg.head_dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    out = {"wq": _linear(pre + "q_proj.weight", q, d), "wk": _linear(pre + "k_proj.weight", kv, d),
           "wv": _linear(pre + "v_proj.weight", kv, d), "wo": _linear(pre + "o_proj.weight", d, q)}
    if cfg.qkv_bias:
        out |= {"bq": _vector(pre + "q_proj.bias", q), "bk": _vector(pre + "k_proj.bias", kv),
                "bv": _vector(pre + "v_proj.bias", kv)}
    if cfg.qk_norm:
        out |= {"q_norm": _norm(cfg, pre + "q_norm.weight", h), "k_norm": _norm(cfg, pre + "k_norm.weight", h)}
    return out


def _mla(cfg: ModelConfig, pre: str) -> dict[str, Source]:
    m, d, n = cfg.mla, cfg.d_model, cfg.n_heads
    out = {"kv_a": _linear(pre + "kv_a_proj_with_mqa.weight", m.kv_lora_rank + m.qk_rope_head_dim, d),
           "kv_a_norm": _vector(pre + "kv_a_layernorm.weight", m.kv_lora_rank),
           "kv_b": _linear(pre + "kv_b_proj.weight", n * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
           "o": _linear(pre + "o_proj.weight", d, n * m.v_head_dim)}
    if m.q_lora_rank is None:
        return out | {"q": _linear(pre + "q_proj.weight", n * m.qk_head_dim, d)}
    return out | {"q_a": _linear(pre + "q_a_proj.weight", m.q_lora_rank, d),
                  "q_a_norm": _vector(pre + "q_a_layernorm.weight", m.q_lora_rank),
                  "q_b": _linear(pre + "q_b_proj.weight", n * m.qk_head_dim, m.q_lora_rank)}


def _mamba(cfg: ModelConfig, pre: str) -> dict[str, Source]:
    """HF's fused in_proj and conv1d, each read in the parts jaxdec stores split."""
    m, d = cfg.mamba, cfg.d_model
    fused = Source((pre + "in_proj.weight",), ((m.d_inner + m.conv_dim + m.n_heads, d),), "linear")
    conv_w = Source((pre + "conv1d.weight",), ((m.conv_dim, 1, m.d_conv),), "conv")
    conv_b = _vector(pre + "conv1d.bias", m.conv_dim)
    chans = mamba.conv_parts(m)
    return {**{name: dataclasses.replace(fused, part=rows)
               for name, rows in mamba.in_proj_parts(m).items()},
            **{f"conv_{c}_w": dataclasses.replace(conv_w, part=chans[c]) for c in chans},
            **{f"conv_{c}_b": dataclasses.replace(conv_b, part=chans[c]) for c in chans},
            "dt_bias": _vector(pre + "dt_bias", m.n_heads), "A_log": _vector(pre + "A_log", m.n_heads),
            "D": _vector(pre + "D", m.n_heads), "norm": _vector(pre + "norm.weight", m.d_inner),
            "out_proj": _linear(pre + "out_proj.weight", d, m.d_inner)}


def _mlp(cfg: ModelConfig, pre: str, f: int, names=("gate_proj", "up_proj", "down_proj"),
         fields=("w_gate", "w_up", "w_down")) -> dict[str, Source]:
    d = cfg.d_model
    out = {fields[1]: _linear(f"{pre}{names[1]}.weight", f, d),
           fields[2]: _linear(f"{pre}{names[2]}.weight", d, f)}
    if cfg.mlp_act != "relu2":
        out[fields[0]] = _linear(f"{pre}{names[0]}.weight", f, d)
    return out


def _moe(cfg: ModelConfig, pre: str) -> dict[str, Source]:
    m, d, e = cfg.moe, cfg.d_model, cfg.moe.n_experts
    if cfg.arch == "mixtral":
        pre, names = pre.replace("mlp.", "block_sparse_moe."), ("w1", "w3", "w2")
    else:
        names = ("gate_proj", "up_proj", "down_proj")
    experts = lambda name, out, inp: Source(tuple(f"{pre}experts.{j}.{name}.weight" for j in range(e)),
                                            ((out, inp),) * e, "experts")
    out = {"router": _linear(pre + "gate.weight", e, d),
           "experts.w_up": experts(names[1], m.d_expert, d),
           "experts.w_down": experts(names[2], d, m.d_expert)}
    if cfg.mlp_act == "silu":
        out["experts.w_gate"] = experts(names[0], m.d_expert, d)
    if m.router_bias:
        out["router_bias"] = _vector(pre + "gate.e_score_correction_bias", e)
    if m.d_shared:
        shared = pre + ("shared_expert." if cfg.arch == "qwen2_moe" else "shared_experts.")
        out |= _mlp(cfg, shared, m.d_shared, fields=("shared_gate", "shared_up", "shared_down"))
    if m.shared_gate:
        out["shared_scale"] = _linear(pre + "shared_expert_gate.weight", 1, d)
    return out


def layout(cfg: ModelConfig) -> dict[str, Source]:
    """Parameter path ("layers.3.mixer.wq", as `_path` spells it) -> its HF source."""
    embed, layer, final = _FRAME.get(cfg.arch, _LLAMA_FRAME)
    d, v = cfg.d_model, cfg.vocab_size
    out = {"final_norm": _norm(cfg, final, d)}
    if cfg.tie_embeddings:
        out["lm_head"] = _linear(embed, v, d)
    else:
        out |= {"embed": _vector(embed, v, d), "lm_head": _linear("lm_head.weight", v, d)}
    backbone = cfg.arch in _FRAME  # one norm per layer, every sublayer is `mixer.`
    for i, (mixer, ffn) in enumerate(cfg.kinds):
        pre = layer.format(i=i)
        here = {}
        if mixer:
            here["mixer_norm"] = _norm(cfg, pre + ("norm.weight" if backbone else "input_layernorm.weight"), d)
            if cfg.post_norms:
                here["mixer_post_norm"] = _norm(cfg, pre + "post_attention_layernorm.weight", d)
            sub = pre + ("mixer." if backbone else "self_attn.")
            here |= {"mixer." + k: s for k, s in {"attention": _attention, "mla": _mla,
                                                 "mamba": _mamba}[mixer](cfg, sub).items()}
        if ffn:
            here["ffn_norm"] = _norm(cfg, pre + ("norm.weight" if backbone else
                                                 "pre_feedforward_layernorm.weight" if cfg.post_norms
                                                 else "post_attention_layernorm.weight"), d)
            if cfg.post_norms:
                here["ffn_post_norm"] = _norm(cfg, pre + "post_feedforward_layernorm.weight", d)
            sub = pre + ("mixer." if backbone else "mlp.")
            parts = _moe(cfg, sub) if ffn == "moe" else _mlp(
                cfg, sub, cfg.d_ff, names=("gate_proj", "up_proj", "down_proj"))
            here |= {"ffn." + k: s for k, s in parts.items()}
        out |= {f"layers.{i}.{k}": s for k, s in here.items()}
    return out


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The Hugging Face name and shape of every tensor a model of `cfg` has."""
    return {n: s for src in layout(cfg).values() for n, s in zip(src.names, src.shapes)}


def _path(keypath) -> str:
    parts = []
    for k in keypath:
        if isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        else:
            parts.append(str(getattr(k, "key", k)))
    return ".".join(parts)


def params_from_hf(cfg: ModelConfig, tensors, dtype=jnp.float32,
                   blocks: dict[str, formats.QArray] | None = None, shardings=None) -> transformer.Params:
    """Build `Params` from HF-named float32 tensors (in HF shapes, as `hf_tensor_shapes`;
    a mapping, possibly `common.LazyTensors` that reads each one when it is looked up).

    A linear weight named in `blocks` (a `QArray` of the [in, out] matrix) is used as it
    is, reshaped to the declared logical shape; the other weights are cast to `dtype`.
    With `shardings` (a tree like the declaration of NamedShardings), each parameter is
    converted on the host and only its slices are placed on their devices
    (`sharding.place`), one parameter at a time: the whole model is never on one device,
    and the host holds one tensor at a time.
    """
    from jaxdec import sharding

    table, blocks = layout(cfg), blocks or {}
    decl = transformer.declare(cfg)
    where = (shardings if shardings is not None
             else jax.tree.map(lambda _: None, decl, is_leaf=is_spec))
    leaf_of = dict(jax.tree_util.tree_flatten_with_path(where, is_leaf=lambda x: x is None)[0])

    def arr(keypath, a):
        place = leaf_of.get(keypath)
        if place is None:
            return jnp.asarray(np.asarray(a, np.float32), dtype)
        return sharding.place(a, place, dtype)

    def one(keypath, spec: ParamSpec | None):
        if spec is None:
            return None
        src = table[_path(keypath)]
        if src.kind == "linear" and src.names[0] in blocks and src.part is None:
            qa = blocks[src.names[0]]
            return dataclasses.replace(jax.tree.map(jnp.asarray, qa), shape=spec.shape,
                                       n_in=spec.n_in)
        convert: Callable[[list[np.ndarray]], np.ndarray] = {
            # views, not copies: a sharded load copies only each device's slice
            "linear": lambda ts: ts[0].T,
            "vector": lambda ts: ts[0],
            "plus_one": lambda ts: 1.0 + ts[0],
            "conv": lambda ts: ts[0][:, 0, :].T,
            "experts": lambda ts: np.stack([t.T for t in ts]),
        }[src.kind]
        ts = [tensors[n] for n in src.names]
        if src.part is not None:
            ts = [t[slice(*src.part)] for t in ts]
        return arr(keypath, convert(ts).reshape(spec.shape))

    return jax.tree_util.tree_map_with_path(one, decl, is_leaf=lambda x: x is None or is_spec(x))
