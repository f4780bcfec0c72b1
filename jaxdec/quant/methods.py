"""The post-training quantisers of the survey as weight transforms `params -> params`.

    params = quantize_model(params, cfg, QuantSpec(method="gptq", bits=4, group_size=64),
                            calib=tokens)
    params, cfg = transforms.apply("gptq", params, cfg, tokens, bits=4, group_size=64)  # the same

Each method is registered as the weight transform of its name (`jaxdec.transforms`; options:
QuantSpec's fields, and `progress`). A group size that does not divide a matmul's input
size K gives its last group the K % group_size inputs left (`short_groups`).

Every matmul weight of the transformer blocks is quantised; the embedding, the LM head,
norms and biases keep their dtype (as the methods' papers do). Weight-only methods return
`QArray`s; methods that also quantise activations wrap them in `ActQuant`.

| method      | weights                          | activations                      | calibration |
| rtn         | group-wise round-to-nearest      | -                                | no  |
| hqq         | half-quadratic zero-point fit    | -                                | no  |
| gptq        | Hessian-based error feedback     | -                                | H = X^T X |
| awq         | activation-aware channel scales  | -                                | mean abs x, H |
| zeroquant   | group-wise round-to-nearest      | int8 per token, dynamic          | no  |
| llm_int8    | int8 per output channel          | int8 per token, features with |x| >= 6 in float | no |
| smoothquant | int8 per output channel of W s   | int8 per token of x / s          | max abs x |

Channel scales (AWQ, SmoothQuant) are folded into the op before: the RMSNorm weight for
q/k/v and gate/up, the up projection's columns for down, and the value projection's
columns (and bias) for the output projection, with one scale per kv head's channel
shared by the query heads of its group (GQA). The folded model is the same function in
exact arithmetic.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxdec import transforms
from jaxdec.config import ModelConfig
from jaxdec.errors import JaxdecError
from jaxdec.quant import calibrate, ptq
from jaxdec.formats.actquant import ActQuant
from jaxdec.formats.qarray import from_codes, quantize

# method -> (weight bits allowed, needs calibration statistics)
METHODS = {
    "rtn": ((2, 3, 4, 8), False),
    "hqq": ((2, 3, 4, 8), False),
    "gptq": ((2, 3, 4, 8), True),
    "awq": ((2, 3, 4, 8), True),
    "zeroquant": ((4, 8), False),
    "llm_int8": ((8,), False),
    "smoothquant": ((8,), True),
}
LLM_INT8_THRESHOLD = 6.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantSpec:
    """A method and its settings. `group_size` is the number of inputs sharing a scale
    (ignored by llm_int8 and smoothquant, which use one scale per output channel);
    `alpha` is SmoothQuant's migration strength; `act_order` is GPTQ's."""

    method: str
    bits: int = 4
    group_size: int = 64
    alpha: float = 0.5
    act_order: bool = False
    act_bits: int = 8

    def check(self) -> "QuantSpec":
        if self.method not in METHODS:
            raise JaxdecError(f"unknown quantisation method {self.method!r} "
                              f"(one of {', '.join(METHODS)})")
        allowed = METHODS[self.method][0]
        if self.bits not in allowed:
            raise JaxdecError(f"{self.method} does not support {self.bits}-bit weights "
                              f"(supported: {', '.join(map(str, allowed))})")
        if self.group_size < 1:
            raise JaxdecError(f"group size {self.group_size} must be positive")
        if not 0.0 <= self.alpha <= 1.0:
            raise JaxdecError(f"alpha={self.alpha} must be in [0, 1]")
        return self

    @property
    def per_channel(self) -> bool:
        return self.method in ("llm_int8", "smoothquant")

    @property
    def needs_calibration(self) -> bool:
        return METHODS[self.method][1]


def quantize_model(params, cfg: ModelConfig, spec: QuantSpec, *, calib: np.ndarray | None = None,
                   progress=None):
    """`params` with every block matmul quantised by `spec` (module docstring). `calib`
    (i32[n, T] tokens, `calibrate.calibration_tokens`) is required by the methods that
    need it. Bad settings raise a one-line JaxdecError before any work."""
    spec.check()
    _check_supported(cfg, spec)
    if spec.needs_calibration:
        if calib is None:
            raise JaxdecError(f"{spec.method} needs calibration tokens")
        need = max(_k_of(w, n_in) for w, n_in in _matmuls(params.layers[0], cfg))
        if calib.size < need:
            raise JaxdecError(f"calibration set too small: {calib.size} tokens, {spec.method} "
                              f"needs at least {need} (the largest matmul input)")
        one = lambda i, layer, stats: _layer(layer, cfg, spec, stats)
        return calibrate.run_layers(params, cfg, calib, one, progress=progress)
    layers = []
    for i, layer in enumerate(params.layers):
        layers.append(_layer(layer, cfg, spec, {}))
        if progress is not None:
            progress(i + 1, len(params.layers))
    return dataclasses.replace(params, layers=tuple(layers))


# ---- structure ------------------------------------------------------------------------------
def _check_supported(cfg: ModelConfig, spec: QuantSpec) -> None:
    kinds = set(cfg.kinds)
    if kinds != {("attention", "mlp")} or cfg.mlp_act != "silu":
        raise JaxdecError(f"{spec.method}: only attention + gated-MLP layers (Llama, Qwen2) "
                          f"are supported, this model has {sorted(map(str, kinds))}")


def _k_of(w, n_in: int) -> int:
    return math.prod(w.shape[:n_in])


def _matmuls(layer, cfg: ModelConfig):
    """(weight, n_in) of every matmul of an attention + MLP layer."""
    a, f = layer.mixer, layer.ffn
    return [(a.wq, 1), (a.wk, 1), (a.wv, 1), (a.wo, 2), (f.w_gate, 1), (f.w_up, 1), (f.w_down, 1)]


def short_groups(params, spec: QuantSpec) -> dict[str, tuple[int, int]]:
    """{matmul name: (input size K, inputs in its last group)} of the block matmuls whose K
    `spec.group_size` does not divide (first layer's names; their last group holds the
    K % group_size inputs left, `QArray`): what `jaxdec quantize` reports."""
    if spec.per_channel:
        return {}
    names = ["wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"]
    ks = {name: _k_of(w, n_in) for name, (w, n_in) in zip(names, _matmuls(params.layers[0], None))}
    return {name: (k, k % spec.group_size) for name, k in ks.items() if k % spec.group_size}


def short_group_note(params, spec: QuantSpec) -> str | None:
    """One line naming the matmuls whose last group is short (`short_groups`), or None:
    "group 128: last group of wq, wk, ... has 64 of 128 columns (576 = 4 x 128 + 64)"."""
    short = short_groups(params, spec)
    if not short:
        return None
    g = spec.group_size
    by_k = {}
    for name, k_rem in short.items():
        by_k.setdefault(k_rem, []).append(name)
    parts = [f"last group of {', '.join(names)} has {r} of {g} columns ({k} = {k // g} x {g} + {r})"
             for (k, r), names in by_k.items()]
    return f"group {g}: " + "; ".join(parts)


def _pad_inputs(w2: np.ndarray, g: int, h=None, x_mean=None):
    """w f32[K, N] (and H f[K, K], mean |x| f[K]) padded to whole groups of g inputs, for
    the per-matrix quantisers, which need g | K: the padding inputs repeat the last row (so
    min-max ranges stay the real rows') and have H = 0 (no calibration input reaches them:
    GPTQ treats them as dead, AWQ's errors ignore them). Unchanged when g divides K."""
    k = w2.shape[0]
    extra = -k % g
    if not extra:
        return w2, h, x_mean
    w2 = np.pad(w2, ((0, extra), (0, 0)), mode="edge")
    h = None if h is None else np.pad(np.asarray(h), ((0, extra), (0, extra)))
    x_mean = None if x_mean is None else np.pad(np.asarray(x_mean), (0, extra), mode="edge")
    return w2, h, x_mean


# ---- one layer ------------------------------------------------------------------------------
def _as_2d(w, n_in: int) -> np.ndarray:
    w = np.asarray(w, np.float32)
    return w.reshape(math.prod(w.shape[:n_in]), -1)


def _layer(layer, cfg: ModelConfig, spec: QuantSpec, stats):
    """One attention + MLP layer quantised by `spec`, with its matmuls' input `stats`."""
    a, f = layer.mixer, layer.ffn
    scales, grids = {}, {}
    if spec.method in ("awq", "smoothquant"):
        layer, scales, grids = _fold_channel_scales(layer, cfg, spec, stats)
        a, f = layer.mixer, layer.ffn
    one = lambda w, n_in, name: _weight(w, n_in, spec, stats.get(name), scales.get(name),
                                        grids.get(name))
    mixer = dataclasses.replace(a, wq=one(a.wq, 1, ".mixer.wq"), wk=one(a.wk, 1, ".mixer.wk"),
                                wv=one(a.wv, 1, ".mixer.wv"), wo=one(a.wo, 2, ".mixer.wo"))
    ffn = dataclasses.replace(f, w_gate=one(f.w_gate, 1, ".ffn.w_gate"),
                              w_up=one(f.w_up, 1, ".ffn.w_up"), w_down=one(f.w_down, 1, ".ffn.w_down"))
    return dataclasses.replace(layer, mixer=mixer, ffn=ffn)


def _weight(w, n_in: int, spec: QuantSpec, stats: calibrate.InputStats | None,
            s: np.ndarray | None, grid: ptq.Grid | None):
    """One weight [*in, *out] -> QArray (or ActQuant around one). `s` [K]: AWQ/SmoothQuant
    channel scales already divided out of the input upstream; the weight becomes diag(s) W
    (AWQ passes the `grid` its search quantised diag(s) W to)."""
    shape = tuple(w.shape)
    w2 = _as_2d(w, n_in)
    if s is not None:
        w2 = w2 * s[:, None].astype(np.float32)
    m = spec.method
    if grid is not None:
        qa = from_codes(grid.codes, grid.scale, grid.offset, bits=spec.bits,
                        group_size=spec.group_size, shape=shape, n_in=n_in)
    elif m in ("rtn", "zeroquant"):
        qa = quantize(jnp.asarray(w2.reshape(shape)), bits=spec.bits, group_size=spec.group_size,
                      n_in=n_in)
    elif m in ("llm_int8", "smoothquant"):
        qa = quantize(jnp.asarray(w2.reshape(shape)), bits=8, group_size=w2.shape[0],
                      symmetric=True, n_in=n_in)
    else:  # (a short last group: padded for the quantisers, the padding dropped by from_codes)
        if m == "gptq":
            wp, h, _ = _pad_inputs(w2, spec.group_size, stats.h)
            grid = ptq.gptq(wp, h, bits=spec.bits, group_size=spec.group_size,
                            act_order=spec.act_order)
        elif m == "hqq":
            grid = ptq.hqq(_pad_inputs(w2, spec.group_size)[0], bits=spec.bits,
                           group_size=spec.group_size)
        qa = from_codes(grid.codes, grid.scale, grid.offset, bits=spec.bits,
                        group_size=spec.group_size, shape=shape, n_in=n_in)
    qa = jax.tree.map(jnp.asarray, qa)
    if m == "zeroquant" or m == "smoothquant":
        return ActQuant(w=qa, in_scale=None, act_bits=spec.act_bits)
    if m == "llm_int8":
        return ActQuant(w=qa, in_scale=None, act_bits=8, outlier_threshold=LLM_INT8_THRESHOLD)
    return qa


# ---- channel scales (AWQ, SmoothQuant) ------------------------------------------------------
def _fold_channel_scales(layer, cfg: ModelConfig, spec: QuantSpec, stats):
    """Choose one scale vector s per input site, fold 1/s into the op before it, and return
    (layer, {weight name: s}, {weight name: AWQ's grid of diag(s) W})."""
    sites = [  # consumers sharing one input, and the producer 1/s folds into. Output-side
        # sites first: their folds change wv's and w_up's columns before those are quantised
        ((".mixer.wo",), "wv"),
        ((".ffn.w_down",), "w_up"),
        ((".mixer.wq", ".mixer.wk", ".mixer.wv"), "mixer_norm"),
        ((".ffn.w_gate", ".ffn.w_up"), "ffn_norm"),
    ]
    scales, grids = {}, {}
    for names, producer in sites:
        a, f = layer.mixer, layer.ffn
        weights = {".mixer.wq": (a.wq, 1), ".mixer.wk": (a.wk, 1), ".mixer.wv": (a.wv, 1),
                   ".mixer.wo": (a.wo, 2), ".ffn.w_gate": (f.w_gate, 1),
                   ".ffn.w_up": (f.w_up, 1), ".ffn.w_down": (f.w_down, 1)}
        parts = [_as_2d(*weights[n]) for n in names]
        st = stats[names[0]]
        gqa = a.wq.shape[1] // a.wv.shape[1] if producer == "wv" else 1  # this layer's
        s, grid = _site_scale(np.concatenate(parts, axis=1), st, spec, gqa, cfg.head_dim)
        cols = np.cumsum([0] + [p.shape[1] for p in parts])
        for n, c0, c1 in zip(names, cols[:-1], cols[1:]):
            scales[n] = s
            if grid is not None:
                grids[n] = _grid_columns(grid, c0, c1)
        layer = _fold(layer, producer, 1.0 / s, cfg)
    return layer, scales, grids


def _grid_columns(grid: ptq.Grid, c0: int, c1: int) -> ptq.Grid:
    return dataclasses.replace(grid, codes=grid.codes[:, c0:c1], scale=grid.scale[:, c0:c1],
                               offset=grid.offset[:, c0:c1])


def _group_heads(v: np.ndarray, gqa: int, head_dim: int, reduce) -> np.ndarray:
    """v [N * H] over query heads -> the same length, reduced over each kv head's group of
    `gqa` query heads (so one scale per kv head channel, foldable into wv)."""
    g = reduce(v.reshape(-1, gqa, head_dim), axis=1)  # [K, H]
    return np.repeat(g[:, None], gqa, axis=1).reshape(-1)


def _site_scale(w_cat: np.ndarray, st: calibrate.InputStats, spec: QuantSpec, gqa: int,
                head_dim: int) -> np.ndarray:
    if spec.method == "smoothquant":  # s_j = max|X_j|^a / max|W_j|^(1 - a)
        x_max, w_max = st.abs_max, np.abs(w_cat).max(axis=1).astype(np.float64)
        if gqa > 1:
            x_max = _group_heads(x_max, gqa, head_dim, np.max)
            w_max = _group_heads(w_max, gqa, head_dim, np.max)
        s = np.maximum(x_max, 1e-5) ** spec.alpha / np.maximum(w_max, 1e-5) ** (1 - spec.alpha)
        return np.clip(s, 1e-5, 1e5).astype(np.float32), None
    x_mean = st.abs_mean if gqa == 1 else _group_heads(st.abs_mean, gqa, head_dim, np.mean)
    k = w_cat.shape[0]
    s, grid = ptq.awq(*_pad_inputs(w_cat, spec.group_size, st.h, x_mean), bits=spec.bits,
                      group_size=spec.group_size)
    return np.asarray(s, np.float32)[:k], grid


def _fold(layer, producer: str, inv_s: np.ndarray, cfg: ModelConfig):
    """Multiply the producer of an input site by inv_s along the channels it produces."""
    a, f = layer.mixer, layer.ffn
    mul = lambda w, s: (jnp.asarray(w, jnp.float32) * jnp.asarray(s, jnp.float32)).astype(w.dtype)
    if producer in ("mixer_norm", "ffn_norm"):
        return dataclasses.replace(layer, **{producer: mul(getattr(layer, producer), inv_s)})
    if producer == "w_up":  # [D, F]
        return dataclasses.replace(layer, ffn=dataclasses.replace(f, w_up=mul(f.w_up, inv_s)))
    # wv [D, K, H] and bv [K, H]: one scale per kv channel (the query heads of a group share it)
    kv = inv_s.reshape(a.wv.shape[1], -1, cfg.head_dim)[:, 0]  # (this layer's kv heads)
    bv = None if a.bv is None else mul(a.bv, kv)
    return dataclasses.replace(layer, mixer=dataclasses.replace(a, wv=mul(a.wv, kv), bv=bv))


# ---- the weight transforms (`jaxdec.transforms`) --------------------------------------------
_SUMMARIES = {
    "rtn": "group-wise round-to-nearest weights",
    "hqq": "half-quadratic zero-point fit of group-wise weights",
    "gptq": "Hessian-based error feedback (GPTQ) weights",
    "awq": "activation-aware channel scales (AWQ), group-wise weights",
    "zeroquant": "group-wise weights, int8 per-token activations (ZeroQuant)",
    "llm_int8": "int8 weights per output channel, int8 activations with float outliers",
    "smoothquant": "W8A8 with activation scales migrated into the weights (SmoothQuant)",
}


def _register(method: str) -> None:
    @transforms.register(method, needs_calib=METHODS[method][1], summary=_SUMMARIES[method])
    def transform(params, cfg: ModelConfig, calib, *, progress=None, **options):
        """`quantize_model` with QuantSpec(method=method, **options); cfg unchanged."""
        spec = QuantSpec(method=method, **options)
        return quantize_model(params, cfg, spec, calib=calib, progress=progress), cfg


for _method in METHODS:
    _register(_method)
