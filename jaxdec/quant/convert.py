"""Weight transforms onto `QArray`: `params -> params`, driven by the declaration.

Every parameter declared with `n_in` (a matmul weight) is quantised; norms, biases and
embedding tables stay as they are. Weights that are already `QArray`s (a GGUF file's own
Q4/Q8 blocks, kept by the loader) are kept when they have the requested width.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxdec.errors import JaxdecError
from jaxdec.pytree import ParamSpec, is_spec
from jaxdec.quant.qarray import QArray, dequantize, quantize

# name -> (bits, keep any GGUF block width)
FORMATS = {"int8": (8, False), "int4": (4, False), "gguf": (8, True)}


def quantize_params(params, decl, weights: str, *, group_size: int = 32):
    """Quantise every matmul weight of `params` (declared by `decl`) to `weights`:

    - "int8" / "int4": group-wise round-to-nearest (int8 symmetric, int4 asymmetric), one
      f16 scale (and offset) per `group_size` inputs. A `QArray` leaf of the same width is
      kept as it is; one of another width is requantised from its dequantised values.
    - "gguf": keep every `QArray` leaf (the file's own blocks, whatever their width) and
      quantise the rest to int8.
    A weight whose contracted size is not a multiple of `group_size` stays unquantised.
    """
    if weights not in FORMATS:
        raise JaxdecError(f"unknown weight format {weights!r} (one of {', '.join(FORMATS)})")
    bits, keep_any = FORMATS[weights]

    def one(spec: ParamSpec | None, w):
        if spec is None or spec.n_in is None:
            return w
        if isinstance(w, QArray):
            if keep_any or w.bits == bits:
                return jax.tree.map(jnp.asarray, w)
            w = dequantize(w)
        if math.prod(w.shape[:spec.n_in]) % group_size:
            return w
        return quantize(jnp.asarray(w, jnp.float32), bits=bits, group_size=group_size,
                        n_in=spec.n_in)

    return jax.tree.map(one, decl, params, is_leaf=lambda x: x is None or is_spec(x))



def describe(params) -> dict[str, dict]:
    """The static layout of every `QArray` in `params`, by key path (checkpoint metadata)."""
    found = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, QArray))[0]
    return {jax.tree_util.keystr(path): {"bits": w.bits, "group_size": w.group_size,
                                         "shape": list(w.shape), "n_in": w.n_in,
                                         "offset": w.offset is not None}
            for path, w in found if isinstance(w, QArray)}


def abstract_like(decl, dtype, layout: dict[str, dict]):
    """`pytree.abstract_params` with the `QArray`s that `describe` recorded (orbax restore)."""

    def one(path, spec: ParamSpec | None):
        if spec is None:
            return None
        entry = layout.get(jax.tree_util.keystr(path))
        if entry is None:
            return jax.ShapeDtypeStruct(spec.shape, dtype)
        k, g = math.prod(spec.shape[:entry["n_in"]]), entry["group_size"]
        n = math.prod(spec.shape[entry["n_in"]:])
        rows = k if entry["bits"] == 8 else k // 2
        groups = jax.ShapeDtypeStruct((k // g, n), jnp.float16)
        return QArray(q=jax.ShapeDtypeStruct((rows, n), jnp.int8 if entry["bits"] == 8 else jnp.uint8),
                      scale=groups, offset=groups if entry["offset"] else None,
                      bits=entry["bits"], group_size=g, shape=tuple(entry["shape"]),
                      n_in=entry["n_in"])

    return jax.tree_util.tree_map_with_path(one, decl, is_leaf=lambda x: x is None or is_spec(x))
