"""Orbax checkpoints written by `jaxdec convert` / `jaxdec.save`.

Layout of a checkpoint directory:

    jaxdec.json      format version, ModelConfig, dtype, source, stored tensor types
    params/          the parameter pytree, written by orbax's StandardCheckpointer
    tokenizer.json, tokenizer_config.json   the tokenizer and chat template

A save is atomic from the user's point of view: everything is written into a sibling
temporary directory, and only a complete checkpoint is renamed into place. A good
checkpoint already at the destination is replaced only after the new one is complete, so
a failed or interrupted save never leaves a half-written checkpoint where a good one was.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
import uuid

import jax

from jaxdec.config import ModelConfig
from jaxdec.errors import JaxdecError

FORMAT = "jaxdec-orbax-1"
META = "jaxdec.json"


def is_checkpoint(path: pathlib.Path) -> bool:
    return (path / META).is_file()


def save(path, params, cfg: ModelConfig, tokenizer, *, source: str = "",
         tensor_types: dict[str, str] | None = None, extra: dict | None = None) -> pathlib.Path:
    dest = pathlib.Path(path).absolute()
    if dest.exists() and not (dest.is_dir() and is_checkpoint(dest)):
        raise JaxdecError(f"{dest} exists and is not a jaxdec checkpoint; refusing to overwrite it")
    dtype = str(params.final_norm.dtype)
    meta = {"format": FORMAT, "config": json.loads(cfg.to_json()), "dtype": dtype,
            "source": source, "tensor_types": tensor_types or {}, **(extra or {})}

    def sidecar(tmp: pathlib.Path) -> None:
        tokenizer.save(tmp)
        (tmp / META).write_text(json.dumps(meta, indent=1))

    return write_params_dir(dest, params, sidecar)


def write_params_dir(dest: pathlib.Path, params, sidecar) -> pathlib.Path:
    """Write `params` (orbax, into params/) and whatever `sidecar(dir)` adds into a
    temporary sibling of `dest`, then swap it into place: a crash leaves any old `dest` whole."""
    import orbax.checkpoint as ocp

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    try:
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(tmp / "params", params)
        checkpointer.wait_until_finished()
        sidecar(tmp)
        _swap_into_place(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _swap_into_place(tmp: pathlib.Path, dest: pathlib.Path) -> None:
    """Rename the finished tmp dir to dest; an old checkpoint is removed only afterwards."""
    old = None
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(dest, old)
    try:
        os.replace(tmp, dest)
    except BaseException:
        if old is not None:
            os.replace(old, dest)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def read_meta(path: pathlib.Path) -> dict:
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError) as e:
        raise JaxdecError(f"{path}: unreadable {META} ({e.__class__.__name__})") from None
    if meta.get("format") != FORMAT:
        raise JaxdecError(f"{path}: unknown checkpoint format {meta.get('format')!r}")
    return meta


def restore(path, abstract_params):
    """Restore the parameter pytree into the structure/dtypes of `abstract_params`; a
    stored tensor whose shape is not the one asked for (a config whose widths disagree with
    the tensors) is a one-line error naming it."""
    import orbax.checkpoint as ocp

    _check_stored_shapes(path, abstract_params)
    try:
        return ocp.StandardCheckpointer().restore(pathlib.Path(path).absolute() / "params",
                                                  abstract_params)
    except Exception as e:  # orbax raises many types for damaged checkpoints
        raise JaxdecError(f"{path}: cannot restore parameters ({e.__class__.__name__}: "
                          f"{str(e).splitlines()[0][:200] if str(e) else ''})") from None


def _key_name(keypath) -> str:
    """"layers.1.mixer.wq": a tree path as orbax names the array it stores."""
    part = lambda k: str(getattr(k, "name", getattr(k, "idx", getattr(k, "key", k))))
    return ".".join(part(k) for k in keypath)


def _check_stored_shapes(path, abstract_params) -> None:
    """Compare the shapes orbax recorded for the stored arrays with `abstract_params`'s
    (arrays it did not record are left to the restore to report)."""
    import orbax.checkpoint as ocp

    try:
        meta = ocp.StandardCheckpointer().metadata(pathlib.Path(path).absolute() / "params")
        meta = getattr(meta, "item_metadata", meta)
        stored = {m.name: tuple(m.shape) for m in jax.tree.leaves(getattr(meta, "tree", meta))
                  if isinstance(getattr(m, "name", None), str) and getattr(m, "shape", None) is not None}
    except Exception:  # no readable metadata: the restore itself reports the damage
        return
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
        name = _key_name(keypath)
        if name in stored and stored[name] != tuple(leaf.shape):
            raise JaxdecError(f"{path}: tensor {name} is stored with shape {stored[name]}, "
                              f"its config declares {tuple(leaf.shape)}")
