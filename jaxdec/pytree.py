"""Parameter declarations: one abstract description, everything else derived from it.

A model family declares its parameters once, as a tree of registered dataclasses whose
leaves are `ParamSpec`s (shape, logical axes, initializer). From that one declaration:

- `init_params(decl, key, dtype)` draws concrete arrays;
- `abstract_params(decl, dtype)` gives `jax.ShapeDtypeStruct`s (orbax restore, eval_shape);
- `logical_axes(decl)` and `partition_specs(decl, rules)` give the sharding layout.

Logical axis names used by the models (documented here, next to the rules that map them),
and the mesh axis each goes to on a device mesh (`jaxdec.sharding.rules_for`; "-" is
replicated; a model axis that does not divide the heads, MLP or expert units is an error):

    name          letter  what                                            mesh axis
    batch         B       rows of a batch (caches, tokens)                data
    vocab         V       vocabulary rows of the embedding / LM head      model, if it divides V
    embed         D       the model (residual) dimension                  -
    q_heads       N       query heads                                     model
    kv_heads      K       key/value heads (and the KV cache's)            model if it divides K, else -
    head_dim      H       per-head features                               -
    mlp           F       feed-forward hidden units                       model
    norm                  the D of a norm scale                           -
    q_lora                MLA's low-rank query dimension                  -
    kv_lora               MLA's latent (kv_a: latent plus RoPE key)       -  (the latent cache is
                          shared by all heads)
    expert        E       routed experts of a MoE layer                   expert
    expert_mlp            the hidden units of one expert                  model
    mamba_heads           Mamba2's heads (z, x, dt, conv x channels,      model
                          norm, out projection, SSM state)
    mamba_groups          Mamba2's B/C groups (in-projection, conv)       model if it divides them, else -

Weights are laid out for the contraction: a linear map is stored (in, out), because XLA's
CPU backend streams `x @ W` with W stored (K, N) several times faster than `x @ W.T`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec



@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One declared parameter: shape, one logical axis name per dimension, initializer.

    `n_in` marks a matmul weight (used as `layers.linear(x, w, n_in)`): its first `n_in`
    dims are contracted. Weight transforms (quantisation) act on exactly these. `n_batch`
    leading dims before them index a stack of such weights (a MoE layer's experts [E, D, F]:
    n_batch=1, n_in=1), each quantised on its own.
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: str = "normal"  # "normal" (std `scale`), "ones" or "zeros"
    scale: float = 0.02
    n_in: int | None = None
    n_batch: int = 0

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"shape {self.shape} and axes {self.axes} differ in rank")
        if self.n_batch and (self.n_in is None or self.n_batch + self.n_in >= len(self.shape)):
            raise ValueError(f"n_batch={self.n_batch} needs a matmul weight (n_in) after it")
        if self.init not in ("normal", "ones", "zeros"):
            raise ValueError(f"unknown initializer {self.init!r}")


def is_spec(x: Any) -> bool:
    return isinstance(x, ParamSpec)


def map_specs(fn: Callable[[ParamSpec], Any], decl: Any) -> Any:
    """tree_map over the ParamSpec leaves of a declaration."""
    return jax.tree.map(fn, decl, is_leaf=is_spec)


def init_params(decl: Any, key: jax.Array, dtype=jnp.float32) -> Any:
    """Concrete random parameters for a declaration (tests, tiny models)."""
    leaves, treedef = jax.tree.flatten(decl, is_leaf=is_spec)
    keys = jax.random.split(key, len(leaves))

    def one(spec: ParamSpec, k):
        if spec.init == "ones":
            return jnp.ones(spec.shape, dtype)
        if spec.init == "zeros":
            return jnp.zeros(spec.shape, dtype)
        return (spec.scale * jax.random.normal(k, spec.shape, jnp.float32)).astype(dtype)

    return jax.tree.unflatten(treedef, [one(s, k) for s, k in zip(leaves, keys)])


def abstract_params(decl: Any, dtype=jnp.float32) -> Any:
    return map_specs(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), decl)


def logical_axes(decl: Any) -> Any:
    return map_specs(lambda s: s.axes, decl)


@dataclasses.dataclass(frozen=True)
class LogicalRules:
    """Maps logical axis names to mesh axis names (or None: replicated).

    `rules` is a tuple of (logical, mesh_axis) pairs; unlisted logical names replicate.
    A parameter whose two dimensions would land on the same mesh axis is refused.
    """

    rules: tuple[tuple[str, str | None], ...] = ()

    def mesh_axis(self, logical: str | None) -> str | None:
        return dict(self.rules).get(logical) if logical is not None else None

    def spec(self, axes: tuple[str | None, ...]) -> PartitionSpec:
        mesh_axes = [self.mesh_axis(a) for a in axes]
        used = [m for m in mesh_axes if m is not None]
        if len(used) != len(set(used)):
            raise ValueError(f"logical axes {axes} map to colliding mesh axes {mesh_axes}")
        return PartitionSpec(*mesh_axes)


def partition_specs(decl: Any, rules: LogicalRules) -> Any:
    return map_specs(lambda s: rules.spec(s.axes), decl)


def param_bytes(tree: Any) -> int:
    """Bytes actually stored (codes, scales and offsets for a quantised matrix)."""
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))
