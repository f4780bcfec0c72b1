"""Trained drafters on disk: orbax params plus a `drafter.json` that says how to rebuild them.

    store.save_drafter("runs/small/drafter", task, params, {"target": store.target_info(model)})
    drafter = store.load_drafter("runs/small/drafter", model)   # drafter.params attached

Layout of a drafter directory:

    drafter.json   format, kind, the task's meta() (its config), the target it was trained
                   for, the training command, and the params' pytree skeleton
    params/        the parameter pytree, written by orbax's StandardCheckpointer

A kind maps to a "module:function" that rebuilds the drafter: `from_meta(meta, params,
target_model) -> drafter`, where `meta` is what the task's `meta()` returned and `params`
the restored pytree. The skeleton records the pytree's dataclasses by import path (only
jaxdec's are rebuilt) and its arrays' shapes and dtypes, so restoring needs no pickle and
no task object. A save goes to a temporary sibling directory renamed into place; an
existing drafter there is replaced only once the new one is complete.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import pathlib
from typing import Any

import jax
import numpy as np

from jaxdec.errors import JaxdecError

FORMAT = "jaxdec-drafter-1"
META = "drafter.json"
KINDS = {
    "small": "jaxdec.speculative.small_task:from_meta",
    "eagle3": "jaxdec.speculative.eagle3:from_meta",
    "pard": "jaxdec.speculative.pard:from_meta",
}


def target_info(model) -> dict:
    """What identifies a target model to its drafters: its name and shape."""
    cfg = model.cfg
    return {"name": _target_name(model.source), "arch": cfg.arch, "vocab_size": cfg.vocab_size,
            "d_model": cfg.d_model, "n_layers": cfg.n_layers}


def _target_name(source) -> str:
    """A registry name as it is; a path by its last component."""
    return pathlib.Path(str(source)).name if source else ""


def save_drafter(path, task_or_drafter, params, meta: dict | None = None) -> pathlib.Path:
    """Write `params` of the drafter that `task_or_drafter` describes (its `meta()` and
    kind: meta()["kind"], else its `name`) with `meta` (target, command, ...) into `path`."""
    from jaxdec.checkpoint.orbax_io import write_params_dir

    info = dict(task_or_drafter.meta())
    kind = info.get("kind", getattr(task_or_drafter, "name", None))
    if kind not in KINDS:
        raise JaxdecError(f"unknown drafter kind {kind!r} (known: {', '.join(KINDS)})")
    dest = pathlib.Path(path).absolute()
    if dest.exists() and not (dest / META).is_file():
        raise JaxdecError(f"{dest} exists and is not a drafter checkpoint; refusing to overwrite it")
    record = {"format": FORMAT, "kind": kind, **(meta or {}), "drafter": info,
              "params": skeleton(params)}
    return write_params_dir(dest, params,
                            lambda tmp: (tmp / META).write_text(json.dumps(record, indent=1)))


def read_meta(path) -> dict:
    """The drafter.json of a drafter directory; JaxdecError when absent or unreadable."""
    path = pathlib.Path(path)
    if not (path / META).is_file():
        raise JaxdecError(f"{path}: not a drafter checkpoint (no {META})")
    try:
        record = json.loads((path / META).read_text())
    except (OSError, ValueError) as e:
        raise JaxdecError(f"{path}: unreadable {META} ({e.__class__.__name__})") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise JaxdecError(f"{path}: unknown drafter format "
                          f"{record.get('format') if isinstance(record, dict) else None!r}")
    return record


def load_drafter(path, target_model):
    """The drafter saved in `path`, with its params, for `target_model` (refused when it
    was trained for another target)."""
    path = pathlib.Path(path).absolute()
    record = read_meta(path)
    check_target(record.get("target"), target_model, path)
    rebuild = _kind_function(record.get("kind"))
    params = _restore(path, lambda: from_skeleton(record["params"]))
    return rebuild(record["drafter"], params, target_model)


def _restore(path: pathlib.Path, abstract):
    """The params saved under `path`/params, shaped as `abstract()` describes."""
    import orbax.checkpoint as ocp

    try:
        return ocp.StandardCheckpointer().restore(path / "params", abstract())
    except JaxdecError:
        raise
    except Exception as e:  # orbax raises many types for damaged checkpoints
        raise JaxdecError(f"{path}: cannot restore drafter parameters ({e.__class__.__name__}: "
                          f"{(str(e).splitlines() or [''])[0][:200]})") from None


# the meta() entries a warm start may change: how a drafter drafts and trains, not its shapes
WARM_START_FREE = ("k", "tree", "unroll")


def load_params(path, task, like, target_model):
    """The trainable params saved in drafter directory `path`, to warm-start `task`: the
    drafter must be `task`'s kind for `target_model`, with `task.meta()` equal but for
    `WARM_START_FREE`, and params shaped as `like` (the task's fresh init)."""
    path = pathlib.Path(path).absolute()
    record = read_meta(path)
    check_target(record.get("target"), target_model, path)
    want, have = dict(task.meta()), dict(record.get("drafter") or {})
    differ = sorted(k for k in set(want) | set(have)
                    if k not in WARM_START_FREE and want.get(k) != have.get(k))
    if record.get("kind") != want.get("kind", task.name) or differ:
        what = ", ".join(differ) if differ else f"kind {record.get('kind')!r}"
        raise JaxdecError(f"{path}: cannot warm-start this {task.name} drafter from it "
                          f"(it differs in {what})")
    if _renamed(record.get("params")) != skeleton(like):
        raise JaxdecError(f"{path}: its params are not shaped as this drafter's")
    return _restore(path, lambda: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), like))


def check_target(saved: dict | None, target_model, path) -> None:
    """JaxdecError unless `saved` (a `target_info`) describes `target_model`."""
    if saved is None:
        return
    have = target_info(target_model)
    shape = ("arch", "vocab_size", "d_model", "n_layers")
    named = saved.get("name") and have["name"] and saved["name"] != have["name"]
    if named or any(saved.get(k) != have[k] for k in shape):
        raise JaxdecError(f"{path}: drafter trained for target {saved.get('name')!r} (vocab "
                          f"{saved.get('vocab_size')}, d_model {saved.get('d_model')}), not "
                          f"{have['name']!r} (vocab {have['vocab_size']}, d_model {have['d_model']})")


def _kind_function(kind):
    return registered(KINDS, kind, "drafter kind")


def registered(table: dict[str, str], kind, what: str):
    """The object `table[kind]` names as "module:attribute", imported when first asked for;
    a one-line JaxdecError for an unknown kind or a missing module."""
    if kind not in table:
        raise JaxdecError(f"unknown {what} {kind!r} (known: {', '.join(table)})")
    module, name = table[kind].split(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise JaxdecError(f"{what} {kind!r} needs {table[kind]}, which this jaxdec "
                          "does not have") from None


# ---------------------------------------------------------------------------- skeletons


def skeleton(tree) -> Any:
    """A JSON-able description of a pytree of arrays, None, tuples, lists, str-keyed dicts
    and dataclasses (their non-array fields as JSON values)."""
    if tree is None:
        return None
    if isinstance(tree, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
        return {"array": list(tree.shape), "dtype": str(tree.dtype)}
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        cls = type(tree)
        return {"class": f"{cls.__module__}:{cls.__qualname__}",
                "fields": {f.name: skeleton(getattr(tree, f.name))
                           for f in dataclasses.fields(tree)}}
    if isinstance(tree, (tuple, list)) and not hasattr(tree, "_fields"):
        return {type(tree).__name__: [skeleton(x) for x in tree]}
    if isinstance(tree, dict) and all(isinstance(k, str) for k in tree):
        return {"dict": {k: skeleton(v) for k, v in tree.items()}}
    if isinstance(tree, (bool, int, float, str)):
        return {"value": tree}
    raise JaxdecError(f"cannot describe a {type(tree).__name__} in a drafter's params")


def from_skeleton(desc) -> Any:
    """The pytree `skeleton` described, with jax.ShapeDtypeStruct leaves."""
    if desc is None:
        return None
    if "array" in desc:
        return jax.ShapeDtypeStruct(tuple(desc["array"]), np.dtype(_dtype(desc["dtype"])))
    if "class" in desc:
        cls = _jaxdec_class(desc["class"])
        return cls(**{k: from_skeleton(v) for k, v in desc["fields"].items()})
    if "tuple" in desc:
        return tuple(from_skeleton(x) for x in desc["tuple"])
    if "list" in desc:
        return [from_skeleton(x) for x in desc["list"]]
    if "dict" in desc:
        return {k: from_skeleton(v) for k, v in desc["dict"].items()}
    return desc["value"]


def _dtype(name: str):
    import jax.numpy as jnp

    return jnp.bfloat16 if name == "bfloat16" else name


# Modules that moved since drafters were first saved: old prefix -> new. A drafter saved
# before the move names its classes by the old paths and still loads.
RENAMED = {"jaxdec.spec": "jaxdec.speculative", "jaxdec.train.small": "jaxdec.speculative.small_task",
           "jaxdec.quant.qarray": "jaxdec.formats.qarray", "jaxdec.quant.dfloat11": "jaxdec.formats.dfloat11",
           "jaxdec.quant.actquant": "jaxdec.formats.actquant"}


def current_module(module: str) -> str:
    """`module` under its present name (see `RENAMED`): "jaxdec.spec.eagle3" ->
    "jaxdec.speculative.eagle3"."""
    for old, new in RENAMED.items():
        if module == old or module.startswith(old + "."):
            return new + module[len(old):]
    return module


def _renamed(desc):
    """Skeleton `desc` with its class paths under their present module names."""
    if isinstance(desc, dict):
        return {k: (_renamed_ref(v) if k == "class" else _renamed(v)) for k, v in desc.items()}
    if isinstance(desc, list):
        return [_renamed(x) for x in desc]
    return desc


def _renamed_ref(ref: str) -> str:
    module, _, qualname = ref.partition(":")
    return f"{current_module(module)}:{qualname}"


def _jaxdec_class(ref: str):
    module, _, qualname = ref.partition(":")
    module = current_module(module)
    if module.split(".")[0] != "jaxdec":
        raise JaxdecError(f"drafter params name a class outside jaxdec ({ref}); refusing it")
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        raise JaxdecError(f"drafter params name {ref}, which this jaxdec does not have") from None
    if not dataclasses.is_dataclass(obj):
        raise JaxdecError(f"drafter params name {ref}, which is not a dataclass")
    return obj
