"""Device meshes, the logical-axis rules of a model on a mesh, and placement.

    mesh = sharding.make_mesh("data=2,model=4")       # 8 devices: 2-way batch, 4-way tensor
    rules = sharding.rules_for(cfg, mesh)             # logical axis -> mesh axis, checked
    params = sharding.place(host_params, sharding.param_shardings(decl, params, mesh, rules))

Mesh axes have fixed roles, so that a model's code can ask the mesh it is traced under
(`jax.sharding.get_abstract_mesh()`, set by `jax.set_mesh`) how it is split:

    data    the batch (data parallelism)
    model   attention heads, MLP units and the vocabulary (tensor parallelism)
    expert  the routed experts of MoE layers (expert parallelism)

`rules_for(cfg, mesh)` maps the logical axes that `jaxdec.pytree` documents onto them:

    batch -> data;  q_heads, mlp, expert_mlp -> model;  expert -> expert;
    kv_heads -> model when the model axis divides the kv heads, else replicated (GQA with
                fewer kv heads than model shards: every shard holds all kv heads, the cache
                and the k/v projections are not split; cost: K / (K / model) times the kv
                cache bytes per device, the query heads stay split);
    vocab -> model when it divides the vocabulary, else replicated;
    mamba_heads -> model (Mamba2's heads, with their conv channels, gate and state);
    mamba_groups -> model when it divides the B/C groups, else replicated;
    embed, head_dim, norm, q_lora, kv_lora -> replicated (MLA's latent cache is shared by
                every head).

A model axis that does not divide the query heads, the Mamba heads, the MLP or an expert's
hidden units, or
an expert axis that does not divide the experts, is refused with an error naming the axis
and the sizes (jaxdec does not pad heads). Within a jit traced under a mesh with split
axes, the CPU's C++ kernels (single-device programs) give way to XLA's ops, which the SPMD
partitioner splits; MoE layers run their experts under `shard_map` (`moe.block`).
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxdec.config import ModelConfig
from jaxdec.errors import JaxdecError
from jaxdec.pytree import LogicalRules, ParamSpec, is_spec
from jaxdec.formats.qarray import QArray

AXES = ("data", "model", "expert")


# ---------------------------------------------------------------------------- meshes


def parse_mesh(spec: str) -> dict[str, int]:
    """"data=2,model=4" -> {"data": 2, "model": 4} (one-line JaxdecError when malformed)."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in str(spec).split(","))):
        m = re.fullmatch(r"([a-z_]+)\s*=\s*(\d+)", part)
        if m is None:
            raise JaxdecError(f"bad mesh spec {spec!r}: expected axis=size pairs such as "
                              "'data=2,model=4'")
        name, size = m.group(1), int(m.group(2))
        if name not in AXES:
            raise JaxdecError(f"unknown mesh axis {name!r} in {spec!r} (axes: {', '.join(AXES)})")
        if name in sizes:
            raise JaxdecError(f"mesh axis {name!r} given twice in {spec!r}")
        if size < 1:
            raise JaxdecError(f"mesh axis {name!r} has size {size}; sizes must be positive")
        sizes[name] = size
    if not sizes:
        raise JaxdecError(f"empty mesh spec {spec!r}: expected e.g. 'data=2,model=4'")
    return sizes


def make_mesh(spec: str | dict[str, int] | Mesh, devices=None) -> Mesh:
    """A mesh over the first prod(sizes) of `devices` (default: every device of every
    process, in JAX's global order). A mesh may use fewer devices than exist."""
    if isinstance(spec, Mesh):
        return spec
    sizes = parse_mesh(spec) if isinstance(spec, str) else dict(spec)
    devices = list(jax.devices() if devices is None else devices)
    need = math.prod(sizes.values())
    if need > len(devices):
        shown = ",".join(f"{a}={s}" for a, s in sizes.items())
        hint = (f" (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={need} fakes them)"
                if devices[0].platform == "cpu" else "")
        raise JaxdecError(f"mesh {shown} needs {need} devices; {len(devices)} available{hint}")
    grid = np.array(devices[:need], dtype=object).reshape(tuple(sizes.values()))
    return Mesh(grid, tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes))


def describe(mesh) -> str:
    return ",".join(f"{a}={s}" for a, s in mesh.shape.items())


def split_axes(mesh=None) -> dict[str, int]:
    """The axes of `mesh` (default: the mesh being traced under) that the SPMD partitioner
    splits: automatic axes of size > 1. Empty on one device and inside a shard_map."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if mesh is None or mesh.empty:
        return {}
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    return {a: s for a, s in mesh.shape.items() if s > 1 and types[a] != AxisType.Manual}


# ---------------------------------------------------------------------------- processes

ENV = ("JAXDEC_COORDINATOR", "JAXDEC_NUM_PROCESSES", "JAXDEC_PROCESS_ID")


def initialize_from_env() -> bool:
    """Join a multi-process run when `scripts/launch_multihost.py` (or a cluster's own
    launcher) set JAXDEC_COORDINATOR (host:port), JAXDEC_NUM_PROCESSES and
    JAXDEC_PROCESS_ID: `jax.distributed.initialize`, before any device is touched. After
    it, `jax.devices()` lists every process's devices and a mesh spans them all; XLA's
    collectives (gloo on CPU) carry the traffic. Returns whether it joined one."""
    coordinator = os.environ.get(ENV[0])
    if not coordinator:
        return False
    try:
        n, rank = int(os.environ[ENV[1]]), int(os.environ[ENV[2]])
    except (KeyError, ValueError):
        raise JaxdecError(f"{ENV[0]} is set: {ENV[1]} and {ENV[2]} must be integers") from None
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=n, process_id=rank)
    return True


# ---------------------------------------------------------------------------- rules


def rules_for(cfg: ModelConfig, mesh) -> LogicalRules:
    """The logical-axis rules of `cfg` on `mesh` (see the module docstring), checked: an
    axis that does not divide what it splits is a one-line JaxdecError naming both."""
    size = dict(mesh.shape)
    model, expert = size.get("model", 1), size.get("expert", 1)

    def need(axis: str, n_axis: int, count: int, what: str, where: str = "this model"):
        if count % n_axis:
            raise JaxdecError(f"mesh axis {axis!r} of size {n_axis} does not divide the "
                              f"{count} {what} of {where}")

    mixers = {m for m, _ in cfg.kinds}
    ffns = {f for _, f in cfg.kinds}
    for i, (mixer, ffn) in enumerate(cfg.kinds):  # (widths may differ per layer: name it)
        where = "this model" if cfg.uniform_widths else f"layer {i}"
        if mixer in ("attention", "mla"):
            need("model", model, cfg.heads(i), "query heads", where)
        if ffn == "mlp":
            need("model", model, cfg.ffn_width(i), "MLP units", where)
    if "mamba" in mixers:
        need("model", model, cfg.mamba.n_heads, "Mamba heads")
    if "moe" in ffns:
        need("expert", expert, cfg.moe.n_experts, "experts")
        need("model", model, cfg.moe.d_expert, "hidden units per expert")
        if cfg.moe.d_shared:
            need("model", model, cfg.moe.d_shared, "shared-expert units")
    elif expert > 1:
        raise JaxdecError(f"mesh axis 'expert' of size {expert}: this model has no experts")
    present = lambda axis: axis if axis in size else None
    rules = [("batch", present("data")), ("q_heads", present("model")),
             ("mlp", present("model")), ("expert_mlp", present("model")),
             ("expert", present("expert")), ("mamba_heads", present("model")),
             ("mamba_groups", present("model") if cfg.mamba and cfg.mamba.n_groups % model == 0
              else None),
             ("kv_heads", present("model") if all(cfg.kv_heads(i) % model == 0
                                                  for i in range(cfg.n_layers)) else None),
             ("vocab", present("model") if cfg.vocab_size % model == 0 else None)]
    return LogicalRules(tuple(rules))


def check_batch(rows: int, mesh) -> None:
    data = dict(mesh.shape).get("data", 1)
    if rows % data:
        raise JaxdecError(f"mesh axis 'data' of size {data} does not divide the batch of {rows} rows")


# ---------------------------------------------------------------------------- shardings


def _flat_axis(rules: LogicalRules, axes: tuple, size: int, mesh) -> str | None:
    """The mesh axis of a dimension that folds the logical `axes` (major first): the major
    axis's, when only it is split and the fold still divides evenly; else replicated."""
    mesh_axes = [rules.mesh_axis(a) for a in axes]
    if not mesh_axes or mesh_axes[0] is None or any(m is not None for m in mesh_axes[1:]):
        return None
    return mesh_axes[0] if size % dict(mesh.shape)[mesh_axes[0]] == 0 else None


def qarray_shardings(w: QArray, axes: tuple, mesh, rules: LogicalRules) -> QArray:
    """NamedShardings of a quantised weight's arrays (q [K, N], scale/offset [K/g, N]),
    following the logical axes of its in and out dimensions."""
    if w.n_batch:
        raise JaxdecError("quantised MoE experts are not laid out on a mesh yet: load the "
                          "model on a mesh without --weights int8/int4, or on one device")
    n_in = w.n_in
    out_axis = _flat_axis(rules, axes[n_in:], w.n, mesh)
    in_axis = _flat_axis(rules, axes[:n_in], w.n_groups, mesh)  # whole groups per shard
    in_axis = None if in_axis == out_axis else in_axis
    named = lambda: NamedSharding(mesh, PartitionSpec(in_axis, out_axis))
    return QArray(q=named(), scale=named(), offset=None if w.offset is None else named(),
                  bits=w.bits, group_size=w.group_size, shape=w.shape, n_in=w.n_in)


def param_shardings(decl, params, mesh, rules: LogicalRules):
    """A tree like `params` of NamedShardings from the declaration's logical axes."""

    def one(spec: ParamSpec | None, p):
        if spec is None:
            return None
        if isinstance(p, QArray):
            return qarray_shardings(p, spec.axes, mesh, rules)
        return NamedSharding(mesh, rules.spec(spec.axes))

    return jax.tree.map(one, decl, params, is_leaf=lambda x: x is None or is_spec(x))


def replicated(tree):
    """Pin small results (ids, flags) to every device when traced under a split mesh, so
    each process of a multi-process run can read them; else `tree`."""
    if not split_axes():
        return tree
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, PartitionSpec()), tree)


# ---------------------------------------------------------------------------- placement


def place(host_tree, shardings, dtype=None):
    """Device arrays laid out by `shardings` from host arrays (numpy, memory maps): each
    device receives only its own slice, read from the host array as it is needed (from a
    memory map, only those bytes are read). In a multi-process run, each process supplies
    the slices of its own devices. Floating leaves are cast to `dtype` when given."""

    def one(a, s):
        if a is None:
            return None
        a = a if hasattr(a, "shape") and hasattr(a, "dtype") else np.asarray(a)
        out = jnp.dtype(dtype) if dtype is not None and jnp.issubdtype(a.dtype, jnp.floating) else a.dtype
        return jax.make_array_from_callback(
            tuple(a.shape), s, lambda idx: np.ascontiguousarray(np.asarray(a[idx]).astype(out)))

    return jax.tree.map(one, host_tree, shardings, is_leaf=lambda x: x is None)


def to_host(tree):
    """numpy copies of the arrays in `tree`, also when they span other processes' devices
    (a replicated array is read from a local copy; a split one is gathered)."""

    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(x)
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, tree)


def device_bytes(tree) -> dict[Any, int]:
    """Bytes each device holds of the arrays in `tree` (its addressable shards)."""
    held: dict[Any, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return held


def max_device_bytes(tree) -> int:
    return max(device_bytes(tree).values(), default=0)
