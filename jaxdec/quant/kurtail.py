"""KurTail (arXiv 2503.01483): W4A4KV4 with rotations learned by minimising kurtosis,
beside QuaRot's random Hadamard rotation (the baseline).

    params = quantize_w4a4kv4(params, cfg, rotation="kurtail", calib=tokens)

A rotation is an orthogonal change of basis folded into the weights, so that the rotated
model is the same function in exact arithmetic but its activations have no outlier channels
to ruin a 4-bit per-token grid. The pipeline (a Llama/Qwen2 model: attention + SwiGLU):

1. `fold_norms`: every RMSNorm weight is folded into the rows of the linears that read it
   (mixer_norm -> wq/wk/wv, ffn_norm -> w_gate/w_up, final_norm -> lm_head); the norms
   become ones, so they commute with any rotation; the embedding is untied (the LM head
   changes, the table does not).
2. R1, the residual rotation r [D, D] (`rotate_residual`): embedding rows x -> x r, readers
   of the stream W -> r^T W (wq, wk, wv, w_gate, w_up, lm_head), writers W -> W r (wo,
   w_down).
3. R2, one head-dim rotation per layer r2 [H, H] (`rotate_heads`): the columns of each kv
   head of wv (and bv) -> v r2, the rows of each query head of wo -> r2^T wo. It rotates
   the values (the V cache) and the output projection's input.
4. R3, keys: an online Hadamard of the head dim before the keys are quantised, undone after
   (`ActQuant.out_rotate`): it cannot be folded into wk because RoPE sits in between.
5. R4, the down projection's input: an online block Hadamard (`ActQuant.rotate`, w_down ->
   H^T w_down), since SwiGLU's product is not linear in anything foldable.

Which rotations are learned. "Layer by layer" (the paper's memory-light alternative to
SpinQuant's end-to-end training) means: only calibration activations are stored and each
rotation is fitted to the activations of the sites it rotates, with no backpropagation
through the model. R1 rotates one stream that every layer reads and writes, so it is ONE
matrix, fitted on the union of every layer's two normalised inputs (what the attention and
MLP linears read after `fold_norms`), each layer contributing the same number of tokens.
R2 is per layer, fitted on that layer's value vectors (all kv heads pooled). R3 and R4 are
online, fixed Hadamards, as in the paper. The Hadamard baseline (`rotation="hadamard"`)
uses random block-Hadamard matrices for R1 and R2 (`hadamard_rotation`) and the same R3 and
R4; `rotation="none"` uses none of them (and no R3/R4), with everything else equal.

The objective (`learn_rotation`): the mean over tokens of the kurtosis of the rotated
token vector over its channels, E[(z - mu)^4] / E[(z - mu)^2]^2 (3 for a Gaussian vector,
1.8 for a uniform one; a vector with a few outlier channels has a large one), minimised
over r = r0 @ cayley(A), A skew-symmetric (so r stays exactly orthogonal), from the random
Hadamard r0, with Adam on minibatches of tokens, the whole loop one jitted `lax.scan`.
Kurtosis is per token and scale free, so every token weighs the same whatever its norm.

Quantisation (`quantize_rotated`), fake-quantised to measure quality:
- weights: 4-bit asymmetric, per output channel by default (group = K, QuaRot's setting),
  by GPTQ (act_order, Hessians from `calibrate.run_layers` on the rotated model, each layer
  calibrated on the outputs of the already quantised layers before it) or RTN;
- activations: every block linear's input per token, symmetric absmax, 4 bits
  (`ActQuant.act_bits`);
- KV cache: keys and values per token and per kv head, symmetric absmax over the head
  dim, 4 bits (`ActQuant.out_bits` on wk and wv, the bias included via `out_shift`). Keys
  are quantised BEFORE RoPE: the projection's output is the only hook outside the model
  code. RoPE is an orthogonal rotation of each (i, i + H/2) pair, so it keeps the error's
  norm; a cache storing pre-RoPE keys (RoPE applied at read time) is exactly this scheme.
  QuaRot quantises after RoPE, which needs a hook in `project_qkv`.
- the embedding and the LM head stay in float, as in both papers.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxdec import transforms
from jaxdec.config import ModelConfig
from jaxdec.errors import JaxdecError
from jaxdec.models import transformer
from jaxdec.quant import calibrate, ptq
from jaxdec.formats import tap
from jaxdec.formats.actquant import ActQuant, block_hadamard, hadamard, largest_pow2_block
from jaxdec.formats.qarray import from_codes

ROTATIONS = ("kurtail", "hadamard", "none")
WEIGHT_METHODS = ("gptq", "rtn")
W_BITS = (2, 3, 4, 8)
ACT_BITS = (4, 8)
ORTHO_TOL = 1e-4
HIGH = jax.lax.Precision.HIGHEST
_WEIGHTS = (".mixer.wq", ".mixer.wk", ".mixer.wv", ".mixer.wo", ".ffn.w_gate", ".ffn.w_up",
            ".ffn.w_down")


# ---- rotations ------------------------------------------------------------------------------
def hadamard_rotation(d: int, seed: int = 0) -> np.ndarray:
    """QuaRot's random Hadamard rotation f32[d, d] = diag(+-1) blockdiag(H_b, ..., H_b), b the
    largest power of two dividing d (576 -> 9 blocks of 64, 896 -> 7 of 128)."""
    if d < 1:
        raise JaxdecError(f"hadamard_rotation: dimension {d} must be positive")
    b = largest_pow2_block(d)
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], d)
    return (signs[:, None] * np.kron(np.eye(d // b), hadamard(b))).astype(np.float32)


def check_rotation(r, d: int, name: str = "rotation") -> np.ndarray:
    """r as f32[d, d], or a one-line JaxdecError unless it is an orthogonal [d, d] matrix."""
    r = np.asarray(r)
    if r.shape != (d, d):
        raise JaxdecError(f"{name} has shape {list(r.shape)}, expected [{d}, {d}]")
    r64 = r.astype(np.float64)
    err = float(np.abs(r64.T @ r64 - np.eye(d)).max()) if np.all(np.isfinite(r64)) else np.inf
    if not err <= ORTHO_TOL:
        raise JaxdecError(f"{name} is not orthogonal: max |r^T r - I| = {err:.3g} > {ORTHO_TOL}")
    return r.astype(np.float32)


def kurtosis(z: jax.Array) -> jax.Array:
    """z [..., D] -> the kurtosis of each vector over its D channels [...] (Pearson's, not
    excess: 3 for Gaussian channels); a constant vector gets 0."""
    z = z.astype(jnp.float32)
    c = z - jnp.mean(z, axis=-1, keepdims=True)
    m2 = jnp.mean(c * c, axis=-1)
    m4 = jnp.mean(jnp.square(c * c), axis=-1)
    return jnp.where(m2 > 0, m4 / jnp.where(m2 > 0, m2, 1.0) ** 2, 0.0)


@jax.jit
def _mean_kurtosis(samples, r):
    return jnp.mean(kurtosis(jnp.dot(samples, r, precision=HIGH)))


def mean_kurtosis(samples, r=None) -> float:
    """The mean over the rows of samples [M, D] (times r [D, D]) of their kurtosis."""
    samples = jnp.asarray(samples, jnp.float32)
    r = jnp.eye(samples.shape[1]) if r is None else jnp.asarray(r, jnp.float32)
    return float(_mean_kurtosis(samples, r))


@jax.jit
def _layers_kurtosis(samples, r):  # [L, M, H] @ [L, H, H] -> the mean over layers and rows
    return jnp.mean(kurtosis(jnp.einsum("lmh,lhj->lmj", samples, r, precision=HIGH)))


def cayley(a: jax.Array) -> jax.Array:
    """The orthogonal (I + S)^-1 (I - S) of the skew part S = (A - A^T) / 2 of a [D, D]."""
    s = 0.5 * (a - a.T)
    eye = jnp.eye(a.shape[0], dtype=a.dtype)
    return jnp.linalg.solve(eye + s, eye - s)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LearnSettings:
    """Adam on the Cayley parameter: `steps` steps of `batch` tokens drawn at random."""

    steps: int = 300
    lr: float = 2e-3
    batch: int = 2048
    seed: int = 0


def _optimise_one(samples, r0, key, *, steps: int, lr: float, batch: int):
    """(A f32[D, D], loss per step f32[steps]) minimising mean kurtosis(x r0 cayley(A)). One
    problem per call: vmapped over a stack, XLA:CPU's batched LU ran ~50x slower than a loop."""
    opt = optax.adam(lr)
    samples = jnp.dot(samples, r0, precision=HIGH)  # once, not r0 @ cayley(A) every step
    loss = lambda a, x: jnp.mean(kurtosis(jnp.dot(x, cayley(a), precision=HIGH)))

    def step(carry, k):
        a, state = carry
        x = samples[jax.random.randint(k, (batch,), 0, samples.shape[0])]
        value, grad = jax.value_and_grad(loss)(a, x)
        updates, state = opt.update(grad, state)
        return (optax.apply_updates(a, updates), state), value

    a0 = jnp.zeros_like(r0)
    (a, _), history = jax.lax.scan(step, (a0, opt.init(a0)), jax.random.split(key, steps))
    return a, history


_optimise = jax.jit(_optimise_one, static_argnames=("steps", "lr", "batch"))


def learn_rotations(samples, r0, settings: LearnSettings = LearnSettings()) -> np.ndarray:
    """`learn_rotation` for L independent problems (one per layer), one jitted loop each:
    samples [L, M, D] and starts r0 [L, D, D] -> f32[L, D, D]."""
    x = np.asarray(samples)
    if x.ndim != 3 or x.shape[1] < 2 or not np.issubdtype(x.dtype, np.floating):
        raise JaxdecError(f"learn_rotation: samples must be float [M, D] matrices with M >= 2, "
                          f"got {x.dtype}{list(x.shape[1:])}")
    if not np.all(np.isfinite(x)):
        raise JaxdecError("learn_rotation: samples have non-finite values")
    if settings.steps < 1 or settings.batch < 1 or not settings.lr > 0:
        raise JaxdecError(f"learn_rotation: steps, batch and lr must be positive ({settings})")
    n, d = x.shape[0], x.shape[2]
    r0 = np.stack([check_rotation(r, d, "r0") for r in np.asarray(r0).reshape(-1, d, d)])
    if len(r0) != n:
        raise JaxdecError(f"learn_rotations: {len(r0)} starting rotations for {n} sample sets")
    keys = jax.random.split(jax.random.PRNGKey(settings.seed), n)
    run = partial(_optimise, steps=settings.steps, lr=float(settings.lr), batch=settings.batch)
    a = [run(jnp.asarray(xi, jnp.float32), jnp.asarray(ri), k)[0] for xi, ri, k in zip(x, r0, keys)]
    s = np.asarray(jax.device_get(a), np.float64)
    s = 0.5 * (s - s.transpose(0, 2, 1))
    eye = np.eye(d)
    q = np.linalg.solve(eye + s, eye - s)  # cayley in float64: orthogonal to 1e-12
    return (r0.astype(np.float64) @ q).astype(np.float32)


def learn_rotation(samples, r0=None, settings: LearnSettings = LearnSettings()) -> np.ndarray:
    """KurTail's rotation f32[D, D] for samples [M, D] (activation vectors, one per row):
    the orthogonal r minimising the mean kurtosis of the rows of samples @ r, from r0 (by
    default `hadamard_rotation(D, settings.seed)`); see the module docstring."""
    x = np.asarray(samples)
    if x.ndim != 2:
        raise JaxdecError(f"learn_rotation: samples must be a float [M, D] matrix, got "
                          f"{x.dtype}{list(x.shape)}")
    r0 = hadamard_rotation(x.shape[1], settings.seed) if r0 is None else r0
    return learn_rotations(x[None], np.asarray(r0)[None], settings)[0]


# ---- exact transforms -----------------------------------------------------------------------
def _check_model(cfg: ModelConfig, what: str) -> None:
    if set(cfg.kinds) != {("attention", "mlp")} or cfg.mlp_act != "silu":
        raise JaxdecError(f"{what}: only attention + gated-MLP layers (Llama, Qwen2) are "
                          f"supported, this model has {sorted(map(str, set(cfg.kinds)))}")


def _float(w, name: str) -> jax.Array:
    if not isinstance(w, jax.Array | np.ndarray):
        raise JaxdecError(f"{name} is a {type(w).__name__}: rotations need float weights")
    return jnp.asarray(w)


def _scale_rows(w, s) -> jax.Array:
    """w [D, ...] with row d multiplied by s[d]."""
    s = jnp.asarray(s, jnp.float32).reshape((-1,) + (1,) * (w.ndim - 1))
    return (w.astype(jnp.float32) * s).astype(w.dtype)


def fold_norms(params, cfg: ModelConfig):
    """The same model with every RMSNorm weight folded into the linears that read it and
    the norms set to ones; the embedding untied (module docstring, step 1)."""
    _check_model(cfg, "fold_norms")

    def one(layer):
        a, f, s1, s2 = layer.mixer, layer.ffn, layer.mixer_norm, layer.ffn_norm
        mixer = dataclasses.replace(a, wq=_scale_rows(_float(a.wq, "wq"), s1),
                                    wk=_scale_rows(_float(a.wk, "wk"), s1),
                                    wv=_scale_rows(_float(a.wv, "wv"), s1))
        ffn = dataclasses.replace(f, w_gate=_scale_rows(_float(f.w_gate, "w_gate"), s2),
                                  w_up=_scale_rows(_float(f.w_up, "w_up"), s2))
        return dataclasses.replace(layer, mixer_norm=jnp.ones_like(s1), mixer=mixer,
                                   ffn_norm=jnp.ones_like(s2), ffn=ffn)

    head = _float(params.lm_head, "lm_head")
    embed = head.T if params.embed is None else _float(params.embed, "embed")
    return dataclasses.replace(params, embed=embed, layers=tuple(map(one, params.layers)),
                               final_norm=jnp.ones_like(params.final_norm),
                               lm_head=_scale_rows(head, params.final_norm))


def _check_unit_norms(params, what: str) -> None:
    norms = [params.final_norm] + [n for l in params.layers for n in (l.mixer_norm, l.ffn_norm)]
    if params.embed is None or not all(bool(jnp.all(n == 1)) for n in norms):
        raise JaxdecError(f"{what}: the model must have unit norms and an untied embedding "
                          f"(run fold_norms first)")


def _left(r, w):   # r^T W, W [D, ...]: a reader of the rotated stream
    return jnp.tensordot(r.T, w.astype(jnp.float32), axes=1, precision=HIGH).astype(w.dtype)


def _right(w, r):  # W r, W [..., D]: a writer into the rotated stream
    return jnp.tensordot(w.astype(jnp.float32), r, axes=1, precision=HIGH).astype(w.dtype)


def rotate_residual(params, cfg: ModelConfig, r):
    """The same model on the residual stream rotated by the orthogonal r [D, D] (R1, module
    docstring step 2). Needs `fold_norms` first (unit norms, untied embedding)."""
    _check_model(cfg, "rotate_residual")
    r = jnp.asarray(check_rotation(r, cfg.d_model, "residual rotation"))
    _check_unit_norms(params, "rotate_residual")

    def one(layer):
        a, f = layer.mixer, layer.ffn
        mixer = dataclasses.replace(a, wq=_left(r, _float(a.wq, "wq")),
                                    wk=_left(r, _float(a.wk, "wk")),
                                    wv=_left(r, _float(a.wv, "wv")),
                                    wo=_right(_float(a.wo, "wo"), r))
        ffn = dataclasses.replace(f, w_gate=_left(r, _float(f.w_gate, "w_gate")),
                                  w_up=_left(r, _float(f.w_up, "w_up")),
                                  w_down=_right(_float(f.w_down, "w_down"), r))
        return dataclasses.replace(layer, mixer=mixer, ffn=ffn)

    return dataclasses.replace(params, embed=_right(_float(params.embed, "embed"), r),
                               layers=tuple(map(one, params.layers)),
                               lm_head=_left(r, _float(params.lm_head, "lm_head")))


def rotate_heads(params, cfg: ModelConfig, r2):
    """The same model with each layer's values rotated by its r2[l] [H, H] (R2, module
    docstring step 3): wv [D, K, H] -> wv r2, bv -> bv r2, wo [N, H, D] -> r2^T wo per
    query head (the query heads of a kv group read the same rotated values)."""
    _check_model(cfg, "rotate_heads")
    h, n_layers = cfg.head_dim, len(params.layers)
    r2 = np.asarray(r2)
    if r2.shape != (n_layers, h, h):
        raise JaxdecError(f"head rotations have shape {list(r2.shape)}, "
                          f"expected [{n_layers}, {h}, {h}]")
    r2 = [jnp.asarray(check_rotation(r, h, f"head rotation of layer {i}"))
          for i, r in enumerate(r2)]

    def one(layer, r):
        a = layer.mixer
        wv = _right(_float(a.wv, "wv"), r)
        bv = None if a.bv is None else _right(a.bv, r)
        wo = jnp.einsum("jh,njd->nhd", r, _float(a.wo, "wo").astype(jnp.float32),
                        precision=HIGH).astype(a.wo.dtype)
        return dataclasses.replace(layer, mixer=dataclasses.replace(a, wv=wv, bv=bv, wo=wo))

    return dataclasses.replace(params, layers=tuple(map(one, params.layers, r2)))


def down_block(cfg: ModelConfig) -> int:
    """The block of the online Hadamard on the down projection's input (F = 1536 -> 512)."""
    return largest_pow2_block(cfg.d_ff)


def _hadamard_rows(m: np.ndarray, block: int) -> np.ndarray:
    """blockdiag(H_block) @ m [K, N] in float64, with the float32 H the online op uses."""
    h = hadamard(block).astype(np.float64)
    m = np.asarray(m, np.float64)
    return np.einsum("bc,gcn->gbn", h, m.reshape(-1, block, m.shape[1])).reshape(m.shape)


def hadamard_down(params, cfg: ModelConfig, *, act_bits: int | None = None):
    """Every w_down -> `ActQuant(H^T w_down, rotate=block, act_bits=act_bits)` (R4): the
    same model when act_bits is None (the online Hadamard meets its transpose)."""
    _check_model(cfg, "hadamard_down")
    b = down_block(cfg)

    def one(layer):
        w = _float(layer.ffn.w_down, "w_down")
        wr = block_hadamard(w.T.astype(jnp.float32), b).T.astype(w.dtype)
        return dataclasses.replace(layer, ffn=dataclasses.replace(
            layer.ffn, w_down=ActQuant(w=wr, in_scale=None, act_bits=act_bits, rotate=b)))

    return dataclasses.replace(params, layers=tuple(map(one, params.layers)))


# ---- calibration samples --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Samples:
    """Activation vectors for the rotations, from a model after `fold_norms`."""

    residual: np.ndarray  # f32[2 * L * m, D]: m tokens' normalised attention and MLP inputs
    values: np.ndarray    # f32[L, M * K, H]: every token's value vectors (bias included)


@partial(jax.jit, static_argnames=("cfg", "kind"))
def _layer_samples(layer, x, positions, idx, cfg, kind):
    a, f = layer.mixer, layer.ffn
    tapped = dataclasses.replace(layer, mixer=dataclasses.replace(a, wq=tap.Tap(a.wq, "mixer")),
                                 ffn=dataclasses.replace(f, w_up=tap.Tap(f.w_up, "ffn")))
    with tap.recording() as seen:
        out = transformer.decoder_layer(x, tapped, positions, None, None, cfg, kind)[0]
    got = dict(seen)
    xm, xf = got["mixer"].astype(jnp.float32), got["ffn"][idx].astype(jnp.float32)
    v = jnp.einsum("md,dkh->mkh", xm, a.wv.astype(jnp.float32), precision=HIGH)
    if a.bv is not None:
        v = v + a.bv.astype(jnp.float32)
    return out, jnp.concatenate([xm[idx], xf]), v.reshape(-1, cfg.head_dim)


def collect_samples(params, cfg: ModelConfig, tokens, *, per_site: int = 256,
                    seed: int = 0) -> Samples:
    """The activations of a folded model (`fold_norms`) run on tokens i32[n, T]
    (calibration windows): `per_site` random tokens' inputs of every attention and MLP, and
    every token's values."""
    _check_unit_norms(params, "collect_samples")
    tokens = np.asarray(tokens, np.int32)
    n_tok = tokens.size
    if not 1 <= per_site <= n_tok:
        raise JaxdecError(f"collect_samples: per_site={per_site} must be in [1, {n_tok}]")
    rng = np.random.default_rng(seed)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    x = jax.jit(transformer.embed)(params, jnp.asarray(tokens))
    residual, values = [], []
    for layer, kind in zip(params.layers, cfg.kinds):
        idx = jnp.asarray(np.sort(rng.choice(n_tok, per_site, replace=False)))
        x, res, v = _layer_samples(layer, x, positions, idx, cfg, kind)
        residual.append(np.asarray(res))
        values.append(np.asarray(v))
    return Samples(residual=np.concatenate(residual), values=np.stack(values))


# ---- the rotated model ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Rotated:
    """A folded and rotated float model (the same function as the original) and what was
    learned: `kurtosis` maps "<site> <rotation> <split>" to a mean token kurtosis."""

    params: object
    rotation: str
    r1: np.ndarray | None  # f32[D, D]
    r2: np.ndarray | None  # f32[L, H, H]
    kurtosis: dict[str, float]


def rotate_model(params, cfg: ModelConfig, rotation: str, calib=None, *, seed: int = 0,
                 settings: LearnSettings = LearnSettings(), per_site: int = 256,
                 sample_windows: int = 8) -> Rotated:
    """`fold_norms`, then R1 and R2 of `rotation` (module docstring). KurTail learns them on
    the first `sample_windows` calibration windows (the first half trains, the second half
    is held out for the reported kurtosis)."""
    _check_rotation_name(rotation)
    params = fold_norms(params, cfg)
    if rotation == "none":
        return Rotated(params, rotation, None, None, {})
    d, h, n_layers = cfg.d_model, cfg.head_dim, len(params.layers)
    r1 = hadamard_rotation(d, seed)
    r2 = np.stack([hadamard_rotation(h, seed + 1 + i) for i in range(n_layers)])
    report = {}
    if rotation == "kurtail":
        if calib is None or len(calib) < 2:
            raise JaxdecError("kurtail needs at least 2 calibration windows to learn its rotations")
        half = min(sample_windows, len(calib)) // 2
        per_site = min(per_site, half * np.shape(calib)[1])
        train = collect_samples(params, cfg, calib[:half], per_site=per_site, seed=seed)
        held = collect_samples(params, cfg, calib[half:2 * half], per_site=per_site, seed=seed + 1)
        r1_new = learn_rotation(train.residual, r1, settings)
        r2_new = learn_rotations(train.values, r2, dataclasses.replace(
            settings, batch=min(settings.batch, train.values.shape[1])))
        eye = np.broadcast_to(np.eye(h, dtype=np.float32), r2.shape)
        for split, s in (("train", train), ("held-out", held)):
            for name, a, b in (("identity", None, eye), ("hadamard", r1, r2),
                               ("kurtail", r1_new, r2_new)):
                report[f"residual {name} {split}"] = mean_kurtosis(s.residual, a)
                report[f"values {name} {split}"] = float(_layers_kurtosis(s.values, b))
        r1, r2 = r1_new, r2_new
    params = rotate_heads(rotate_residual(params, cfg, r1), cfg, r2)
    return Rotated(params, rotation, r1, r2, report)


def _check_rotation_name(rotation: str) -> None:
    if rotation not in ROTATIONS:
        raise JaxdecError(f"unknown rotation {rotation!r} (one of {', '.join(ROTATIONS)})")


# ---- quantisation ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """What `quantize_rotated` does to each block linear (module docstring). None bits: that
    side stays in float. `group_size` None: one group per output channel (K)."""

    rotated: bool
    weight_method: str = "gptq"
    w_bits: int | None = 4
    act_bits: int | None = 4
    kv_bits: int | None = 4
    group_size: int | None = None
    act_order: bool = True

    def check(self, params, cfg: ModelConfig) -> "Plan":
        if self.weight_method not in WEIGHT_METHODS:
            raise JaxdecError(f"unknown weight method {self.weight_method!r} "
                              f"(one of {', '.join(WEIGHT_METHODS)})")
        for name, value, allowed in (("weight", self.w_bits, W_BITS),
                                     ("activation", self.act_bits, ACT_BITS),
                                     ("KV cache", self.kv_bits, ACT_BITS)):
            if value is not None and value not in allowed:
                raise JaxdecError(f"unsupported {name} bits {value!r} (one of "
                                  f"{', '.join(map(str, allowed))}, or None for float)")
        if self.group_size is not None:
            for name, (w, n_in) in zip(_WEIGHTS, _matmuls(params.layers[0])):
                k = math.prod(w.shape[:n_in])
                if self.group_size < 1 or k % self.group_size or self.group_size % 2:
                    raise JaxdecError(f"group size {self.group_size} must be an even divisor of "
                                      f"the input size {k} of {name.split('.')[-1]}")
        return self


def _matmuls(layer):
    a, f = layer.mixer, layer.ffn
    return [(a.wq, 1), (a.wk, 1), (a.wv, 1), (a.wo, 2), (f.w_gate, 1), (f.w_up, 1), (f.w_down, 1)]


def _weight(w, n_in: int, h, plan: Plan, block: int | None):
    """One float weight -> its (quantised) array, with the R4 Hadamard folded in when
    `block` (and the Hessian h of the raw input rotated to match)."""
    shape = tuple(w.shape)
    w2 = np.asarray(w, np.float32).reshape(math.prod(shape[:n_in]), -1)
    if block is not None:
        w2 = _hadamard_rows(w2, block).astype(np.float32)
        h = None if h is None else _hadamard_rows(_hadamard_rows(h, block).T, block)
    if plan.w_bits is None:
        return jnp.asarray(w2.reshape(shape))
    g = plan.group_size or w2.shape[0]
    if plan.weight_method == "gptq":
        grid = ptq.gptq(w2, h, bits=plan.w_bits, group_size=g, act_order=plan.act_order)
    else:
        grid = ptq.rtn(w2, bits=plan.w_bits, group_size=g)
    qa = from_codes(grid.codes, grid.scale, grid.offset, bits=plan.w_bits, group_size=g,
                    shape=shape, n_in=n_in)
    return jax.tree.map(jnp.asarray, qa)


def _quantize_layer(layer, stats, cfg: ModelConfig, plan: Plan):
    a, f = layer.mixer, layer.ffn
    h_dim = cfg.head_dim
    key_rotate = h_dim if plan.rotated and h_dim & (h_dim - 1) == 0 else None
    out = {}
    for name, (w, n_in) in zip(_WEIGHTS, _matmuls(layer)):
        block = down_block(cfg) if plan.rotated and name == ".ffn.w_down" else None
        st = stats.get(name)
        wq = _weight(w, n_in, None if st is None else st.h, plan, block)
        kv = {}
        if plan.kv_bits is not None and name in (".mixer.wk", ".mixer.wv"):
            bias = a.bk if name == ".mixer.wk" else a.bv
            shift = None if bias is None else jnp.asarray(bias, jnp.float32).reshape(-1)
            kv = dict(out_bits=plan.kv_bits, out_group=h_dim, out_shift=shift,
                      out_rotate=key_rotate if name == ".mixer.wk" else None)
        if plan.act_bits is not None or block is not None or kv:
            wq = ActQuant(w=wq, in_scale=None, act_bits=plan.act_bits, rotate=block, **kv)
        out[name.split(".")[-1]] = wq
    mixer = dataclasses.replace(a, **{k: out[k] for k in ("wq", "wk", "wv", "wo")})
    ffn = dataclasses.replace(f, **{k: out[k] for k in ("w_gate", "w_up", "w_down")})
    return dataclasses.replace(layer, mixer=mixer, ffn=ffn)


def quantize_rotated(rot: Rotated, cfg: ModelConfig, plan: Plan, calib=None, *, progress=None):
    """The block linears of a `rotate_model` result quantised by `plan`; GPTQ calibrates
    layer by layer on `calib` (`calibrate.run_layers`)."""
    plan.check(rot.params, cfg)
    one = lambda i, layer, stats: _quantize_layer(layer, stats, cfg, plan)
    if plan.w_bits is not None and plan.weight_method == "gptq":
        if calib is None:
            raise JaxdecError("gptq needs calibration tokens")
        return calibrate.run_layers(rot.params, cfg, calib, one, progress=progress)
    layers = tuple(one(i, layer, {}) for i, layer in enumerate(rot.params.layers))
    return dataclasses.replace(rot.params, layers=layers)


def quantize_w4a4kv4(params, cfg: ModelConfig, rotation: str = "kurtail", calib=None, *,
                     weight_method: str = "gptq", group_size: int | None = None,
                     w_bits: int | None = 4, act_bits: int | None = 4, kv_bits: int | None = 4,
                     seed: int = 0, settings: LearnSettings = LearnSettings(), progress=None):
    """`params` folded, rotated by `rotation` ("kurtail" | "hadamard" | "none") and
    quantised: weights `w_bits` (GPTQ or RTN, `group_size` None = per channel),
    activations `act_bits` per token, keys and values `kv_bits` per token and head (module
    docstring). Bad settings raise a one-line JaxdecError before any work."""
    _check_rotation_name(rotation)
    _check_model(cfg, "quantize_w4a4kv4")
    plan = Plan(rotated=rotation != "none", weight_method=weight_method, w_bits=w_bits,
                act_bits=act_bits, kv_bits=kv_bits, group_size=group_size).check(params, cfg)
    if plan.w_bits is not None and weight_method == "gptq" and calib is None:
        raise JaxdecError("gptq needs calibration tokens")
    rot = rotate_model(params, cfg, rotation, calib, seed=seed, settings=settings)
    return quantize_rotated(rot, cfg, plan, calib, progress=progress)


# quality-table rows (`jaxdec.bench.quant_table`, "kurtail:4" = W4A4KV4): name -> rotation
TABLE_ROWS = {"w4a4": "none", "hadamard": "hadamard", "kurtail": "kurtail"}


def table_row(params, cfg: ModelConfig, name: str, bits: int, calib, *, progress=None):
    """W{bits}A{bits}KV{bits} rotated by `TABLE_ROWS[name]` (weights by GPTQ per output
    channel): the quality table's row `name`:`bits`, and `jaxdec quantize --method name`."""
    if name not in TABLE_ROWS:
        raise JaxdecError(f"unknown rotation row {name!r} (one of {', '.join(TABLE_ROWS)})")
    return quantize_w4a4kv4(params, cfg, TABLE_ROWS[name], calib, w_bits=bits, act_bits=bits,
                            kv_bits=bits, progress=progress)


_ROW_SUMMARIES = {"w4a4": "W{b}A{b}KV{b}, GPTQ weights per output channel, no rotation",
                  "hadamard": "W{b}A{b}KV{b} after random block-Hadamard rotations (QuaRot)",
                  "kurtail": "W{b}A{b}KV{b} after rotations learned by minimising kurtosis"}


def _register_row(name: str) -> None:
    @transforms.register(name, needs_calib=True, summary=_ROW_SUMMARIES[name])
    def transform(params, cfg: ModelConfig, calib, *, bits: int = 4, progress=None):
        """`table_row` at `bits`; the config's LM head untied (the rotations untie it)."""
        params = table_row(params, cfg, name, bits, calib, progress=progress)
        return params, dataclasses.replace(cfg, tie_embeddings=False)


for _row in TABLE_ROWS:
    _register_row(_row)
