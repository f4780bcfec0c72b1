"""A cache of converted parameters, so a second load of a GGUF / HF model is a file read.

Reading a GGUF dequantises (or repacks) every tensor, about 2 s for SmolLM2, most of a
warm start-up. The first load of a registry model (`smollm2`, ...) in a given weight
format and dtype writes the resulting parameters as one .npy file per leaf, with the config and tokenizer, under
`home()/.params_cache/<key>/`; later loads memory-map them. The key hashes the source's
path, size and modification time and the jaxdec version, so a changed file is re-read.
Entries are written to a temporary directory and renamed into place: a crash leaves no
half entry. `JAXDEC_PARAMS_CACHE=0` turns the cache off.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import pathlib
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from jaxdec.checkpoint.registry import home
from jaxdec.config import ModelConfig

_VERSION = 2  # raised whenever what a load converts changes (2: Gemma 3 chat template)


def enabled() -> bool:
    return os.environ.get("JAXDEC_PARAMS_CACHE", "1") != "0"


def entry(source: pathlib.Path, weights: str | None, dtype) -> pathlib.Path:
    st = source.stat()
    ident = json.dumps([_VERSION, importlib.metadata.version("jaxdec"), str(source.resolve()),
                        st.st_size, st.st_mtime_ns, weights, str(jnp.dtype(dtype))])
    return home() / ".params_cache" / hashlib.sha256(ident.encode()).hexdigest()[:24]


def load(path: pathlib.Path, layout=None):
    """(config, params, tokenizer, tensor_types) from a cache entry, or None if absent.
    `layout(cfg, abstract_params)`, when given, returns the params' NamedShardings: each
    device then receives only its slices of the memory-mapped leaves."""
    from jaxdec.checkpoint.tokenizer import Tokenizer
    from jaxdec.models import transformer
    from jaxdec.formats import convert

    meta_file = path / "meta.json"
    if not meta_file.is_file():
        return None
    meta = json.loads(meta_file.read_text())
    cfg = ModelConfig.from_dict(meta["config"])
    abstract = convert.abstract_like(transformer.declare(cfg), jnp.dtype(meta["dtype"]),
                                     meta["qarrays"])
    leaves, treedef = jax.tree.flatten(abstract)
    host = [np.load(path / f"{i}.npy", mmap_mode="r") for i in range(len(leaves))]
    # numpy stores bfloat16 as raw 2-byte records ("|V2"): view them back as bfloat16
    host = [a.view(s.dtype) if a.dtype.kind == "V" and a.dtype.itemsize == s.dtype.itemsize
            else a for a, s in zip(host, leaves)]
    for a, spec in zip(host, leaves):
        if a.shape != spec.shape or a.dtype != spec.dtype:
            return None  # stale or damaged entry: the caller re-reads the source
    if layout is None:
        params = jax.tree.unflatten(treedef, jax.device_put(host))
    else:
        from jaxdec import sharding
        params = sharding.place(jax.tree.unflatten(treedef, host), layout(cfg, abstract))
    return cfg, params, Tokenizer.load(path), meta["tensor_types"]


def store(path: pathlib.Path, cfg: ModelConfig, params, tokenizer, tensor_types) -> None:
    """Write an entry (best effort: a cache that cannot be written is skipped)."""
    from jaxdec.formats import convert

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        for i, leaf in enumerate(jax.tree.leaves(params)):
            np.save(tmp / f"{i}.npy", np.asarray(leaf))
        tokenizer.save(tmp)
        meta = {"config": json.loads(cfg.to_json()), "dtype": str(params.final_norm.dtype),
                "qarrays": convert.describe(params), "tensor_types": tensor_types}
        (tmp / "meta.json").write_text(json.dumps(meta))
        os.replace(tmp, path)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
