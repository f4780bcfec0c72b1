"""Weight transforms onto `QArray`: `params -> params`, driven by the declaration.

Every parameter declared with `n_in` (a matmul weight, or a stack of them such as a MoE
layer's experts, `n_batch`) is quantised; norms, biases, routers and embedding tables stay
as they are. Weights that are already `QArray`s (a GGUF file's own
Q4/Q8 blocks, kept by the loader) are kept when they have the requested width.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

from jaxdec.errors import JaxdecError
from jaxdec.pytree import ParamSpec, is_spec
from jaxdec.formats import dfloat11
from jaxdec.formats.actquant import ActQuant
from jaxdec.formats.qarray import QArray, dequantize, quantize

# name -> (bits, keep any GGUF block width)
FORMATS = {"int8": (8, False), "int4": (4, False), "gguf": (8, True)}

# One compiled program per weight shape: run eagerly, `quantize` dispatched (and compiled)
# each of its dozens of small ops separately, several seconds per model even when tiny.
_quantize = jax.jit(partial(quantize, symmetric=None),
                    static_argnames=("bits", "group_size", "n_in", "n_batch"))


def quantize_params(params, decl, weights: str, *, group_size: int = 32):
    """Quantise every matmul weight of `params` (declared by `decl`) to `weights`:

    - "int8" / "int4": group-wise round-to-nearest (int8 symmetric, int4 asymmetric), one
      f16 scale (and offset) per `group_size` inputs. A `QArray` leaf of the same width is
      kept as it is; one of another width is requantised from its dequantised values.
    - "gguf": keep every `QArray` leaf (the file's own blocks, whatever their width) and
      quantise the rest to int8.
    A weight whose contracted size K is not a multiple of `group_size` is quantised too,
    its last group holding the K % group_size inputs left (`QArray`).
    """
    if weights not in FORMATS:
        raise JaxdecError(f"unknown weight format {weights!r} (one of {', '.join(FORMATS)})")
    bits, keep_any = FORMATS[weights]

    def one(spec: ParamSpec | None, w):
        if spec is None or spec.n_in is None:
            return w
        if isinstance(w, dfloat11.DF11Array):
            w = dfloat11.decompress(w)
        if isinstance(w, QArray):
            if keep_any or w.bits == bits:
                return jax.tree.map(jnp.asarray, w)
            w = dequantize(w)
        return _quantize(jnp.asarray(w, jnp.float32), bits=bits, group_size=group_size,
                         n_in=spec.n_in, n_batch=spec.n_batch)

    return jax.tree.map(one, decl, params, is_leaf=lambda x: x is None or is_spec(x))



def describe(params) -> dict[str, dict]:
    """The static layout of every `QArray` (bare or inside an `ActQuant`) in `params`, by
    key path (checkpoint metadata)."""
    wrapped = lambda x: isinstance(x, (QArray, ActQuant, dfloat11.DF11Array))
    found = jax.tree_util.tree_flatten_with_path(params, is_leaf=wrapped)[0]
    out = {}
    for path, w in found:
        if isinstance(w, ActQuant):
            if not isinstance(w.w, QArray):
                raise JaxdecError("only ActQuant weights holding a QArray can be saved")
            out[jax.tree_util.keystr(path)] = {
                **_qarray_entry(w.w), "act": {"bits": w.act_bits, "rotate": w.rotate,
                                              "outlier_threshold": w.outlier_threshold,
                                              "in_scale": w.in_scale is not None,
                                              "out_bits": w.out_bits, "out_group": w.out_group,
                                              "out_rotate": w.out_rotate,
                                              "out_shift": w.out_shift is not None}}
        elif isinstance(w, QArray):
            out[jax.tree_util.keystr(path)] = _qarray_entry(w)
        elif isinstance(w, dfloat11.DF11Array):  # (stream sizes and a checksum)
            out[jax.tree_util.keystr(path)] = dfloat11.layout(w)
    return out


def _qarray_entry(w: QArray) -> dict:
    return {"bits": w.bits, "group_size": w.group_size, "shape": list(w.shape), "n_in": w.n_in,
            "offset": w.offset is not None, "n_batch": w.n_batch}


def abstract_like(decl, dtype, layout: dict[str, dict]):
    """`pytree.abstract_params` with the `QArray`s (and `ActQuant`s) that `describe`
    recorded (orbax restore)."""

    def one(path, spec: ParamSpec | None):
        if spec is None:
            return None
        entry = layout.get(jax.tree_util.keystr(path))
        if entry is None:
            return jax.ShapeDtypeStruct(spec.shape, dtype)
        if entry.get("format") == "dfloat11":
            return dfloat11.abstract(entry, spec.shape)
        nb, g = entry.get("n_batch", 0), entry["group_size"]
        batch, k = spec.shape[:nb], math.prod(spec.shape[nb:nb + entry["n_in"]])
        n, kp = math.prod(spec.shape[nb + entry["n_in"]:]), -(-k // g) * g
        rows = kp // 2 if entry["bits"] == 4 else kp
        groups = jax.ShapeDtypeStruct((*batch, kp // g, n), jnp.float16)
        code = jnp.int8 if entry["bits"] == 8 else jnp.uint8
        qa = QArray(q=jax.ShapeDtypeStruct((*batch, rows, n), code),
                    scale=groups, offset=groups if entry["offset"] else None,
                    bits=entry["bits"], group_size=g, shape=tuple(entry["shape"]),
                    n_in=entry["n_in"], n_batch=nb)
        act = entry.get("act")
        if act is None:
            return qa
        in_scale = jax.ShapeDtypeStruct((k,), jnp.float32) if act["in_scale"] else None
        out_shift = jax.ShapeDtypeStruct((n,), jnp.float32) if act.get("out_shift") else None
        return ActQuant(w=qa, in_scale=in_scale, act_bits=act["bits"], rotate=act["rotate"],
                        outlier_threshold=act["outlier_threshold"], out_shift=out_shift,
                        out_bits=act.get("out_bits"), out_group=act.get("out_group"),
                        out_rotate=act.get("out_rotate"))

    return jax.tree_util.tree_map_with_path(one, decl, is_leaf=lambda x: x is None or is_spec(x))


def param_count(tree: Any) -> int:
    """Logical parameter count (a quantised or DFloat11 matrix counts its K * N weights)."""
    is_q = lambda x: isinstance(x, (QArray, dfloat11.DF11Array))
    return sum(math.prod(x.shape) if is_q(x) else int(x.size)
               for x in jax.tree.leaves(tree, is_leaf=is_q))
