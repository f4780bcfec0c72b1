"""Drafters by name, and speculative generation through the public API.

    drafter = drafters.load("checkpoints/eagle3-smollm2", target)   # a trained drafter
    drafter = drafters.load("smollm2", target)        # a model: same vocabulary -> SmallModel,
                                                      # another vocabulary -> CrossVocab (TLI)
    drafter = drafters.load("layers:8", target)       # the target's first 8 layers
    jaxdec.generate(target, prompts, drafter=drafter)
"""

from __future__ import annotations

import dataclasses
import math
import pathlib

import jax
import numpy as np

from jaxdec.errors import JaxdecError
from jaxdec.speculative.tree import TreeSpec
from jaxdec.speculative import core, small_model

DEFAULT_K = 4
_STREAM_ROUNDS = 4  # rounds per streamed chunk


@dataclasses.dataclass(frozen=True)
class CrossVocab:
    """A drafter model with another vocabulary (`jaxdec.speculative.hetero`): "tli" (token-level
    intersection, lossless under sampling too) or "slem" (string-level exact match)."""

    model: object
    method: str = "tli"
    k: int = DEFAULT_K


def load(src: str, target, *, k: int | None = None, method: str = "tli",
         weights: str | None = None, tree: str | None = None):
    """A drafter for `target` from a drafter checkpoint directory, "layers:N", or a model
    (a registry name, a .gguf file, a HF dir or a jaxdec checkpoint) whose matmul weights
    are loaded as `weights` (`jaxdec.load`'s: "int8", "int4", ... a cheaper drafter; a
    trained EAGLE-3 drafter's are quantised to "int8" or "int4", `with_weights`).
    `tree` "DEPTH,TOP_K,BUDGET" makes a checkpoint's drafter draft EAGLE-2 trees
    (`jaxdec.speculative.tree.TreeSpec`; "chain" makes a tree drafter draft chains)."""
    import jaxdec

    path = pathlib.Path(src)
    if (path / "drafter.json").exists():
        from jaxdec.speculative import store
        drafter = store.load_drafter(path, target)
        drafter = drafter if weights is None else with_weights(drafter, weights, src)
        drafter = drafter if tree is None else with_tree(drafter, tree, src)
        return drafter if k is None else with_k(drafter, k)
    if tree is not None:
        raise JaxdecError(f"{src}: only a trained tree-capable drafter (EAGLE-3) drafts trees")
    if src.startswith("layers:"):
        n = _int(src.split(":", 1)[1], "layers:N")
        cfg, params = small_model.truncated(target.cfg, target.params, n)
        return small_model.SmallModel(cfg=cfg, k=k or DEFAULT_K, params=params)
    model = jaxdec.load(src, dtype=str(target.dtype), weights=weights)
    if same_vocab(model.tokenizer, target.tokenizer):
        return small_model.SmallModel(cfg=model.cfg, k=k or DEFAULT_K, params=model.params)
    if method not in ("tli", "slem"):
        raise JaxdecError(f"unknown cross-vocabulary method {method!r} (tli or slem)")
    return CrossVocab(model=model, method=method, k=k or DEFAULT_K)


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise JaxdecError(f"{what}: {text!r} is not an integer") from None


def with_weights(drafter, weights: str, src: str = "the drafter"):
    """A trained EAGLE-3 drafter with its matmul weights stored as `weights` ("int8" or
    "int4", group-wise; "f32": as trained). Drafting reads the drafter's weights every
    draft token, a sizeable share of a round when the target is small."""
    from jaxdec.formats import convert
    from jaxdec.speculative import eagle3

    if weights == "f32":
        return drafter
    if not isinstance(drafter, eagle3.Eagle3):
        raise JaxdecError(f"{src}: only an EAGLE-3 drafter's trained weights can be quantised")
    if weights not in ("int8", "int4"):
        raise JaxdecError(f"{src}: a trained drafter's weights can be int8 or int4, not {weights!r}")
    net = convert.quantize_params(drafter.params.net, eagle3.declare(drafter.cfg), weights)
    return dataclasses.replace(drafter, params=dataclasses.replace(drafter.params, net=net))


def with_tree(drafter, text: str, src: str = "the drafter"):
    """`drafter` drafting the tree "DEPTH,TOP_K,BUDGET" or "DxKxB" (or chains: "chain")."""
    if text == "chain":
        return dataclasses.replace(drafter, tree=None)
    if not hasattr(drafter, "draft_tree"):
        raise JaxdecError(f"{src}: a {type(drafter).__name__} drafter drafts chains only")
    parts = text.replace("x", ",").split(",")  # "4,4,12" or "4x4x12" (in a list of sources)
    if len(parts) != 3:
        raise JaxdecError(f"a draft tree is DEPTH,TOP_K,BUDGET (got {text!r})")
    depth, top_k, budget = (_int(x, "draft tree") for x in parts)
    spec = TreeSpec(depth=depth, top_k=top_k, budget=budget)
    return dataclasses.replace(drafter, k=depth, tree=spec)


def with_k(drafter, k: int):
    if drafter.tree is not None:
        return dataclasses.replace(drafter, k=k, tree=dataclasses.replace(drafter.tree, depth=k))
    return dataclasses.replace(drafter, k=k)


def same_vocab(a, b) -> bool:
    """Whether two tokenizers give every token string the same id."""
    va, vb = a.backend.get_vocab(with_added_tokens=True), b.backend.get_vocab(with_added_tokens=True)
    return va == vb


def generate(model, rows, drafter, *, max_new_tokens, sampler, seed, stop_ids, stream):
    """`jaxdec.generate` with speculation (see `jaxdec.api.generate`)."""
    from jaxdec import api

    if model.mesh is not None:
        raise JaxdecError("speculative decoding runs on one device for now (no mesh)")
    stops = tuple(sorted(set(model.cfg.eos_ids if stop_ids is None else stop_ids)))
    if isinstance(drafter, CrossVocab):
        from jaxdec.speculative import hetero
        ids, spec = hetero.generate(model, drafter.model, rows, method=drafter.method,
                                    k=drafter.k, max_new_tokens=max_new_tokens, sampler=sampler,
                                    seed=seed, stop_ids=stops)
        tokens = np.full((len(rows), max_new_tokens), -1, np.int64)
        for i, r in enumerate(ids):
            tokens[i, : len(r)] = r
        n_gen = np.array([len(r) for r in ids])
        stopped = np.array([bool(r) and r[-1] in stops for r in ids])
        _replay(stream, tokens, n_gen)
        return api.result(model, rows, tokens, n_gen, stopped, spec)
    tokens, lens = api.pad_rows(rows, 32)
    api._check_context(model.cfg, int(lens.max()), max_new_tokens + core.draft_width(drafter))
    need = core.need_capacity(tokens.shape[1], max_new_tokens, drafter)
    cache = api.init_cache(model, len(rows), int(math.ceil(need / 64) * 64))
    core.check(model.cfg, cache, drafter, tokens.shape[1], max_new_tokens)
    static = dict(sampler=sampler, cfg=model.cfg, drafter=dataclasses.replace(drafter, params=None),
                  stop_ids=stops)
    args = (model.params, drafter.params)
    limits = np.full(len(rows), max_new_tokens, np.int32)
    rng = jax.random.key(seed)
    if stream is None:
        p, _ = api._run(model, core.generate, *args, cache, tokens, lens, rng, limits,
                        max_new_tokens=max_new_tokens, **static)
    else:
        p = _streamed(model, args, cache, tokens, lens, rng, limits, max_new_tokens, static, stream)
    p = jax.device_get(p)
    return api.result(model, rows, p.tokens, p.n_generated, p.stopped, core.stats(p))


def _streamed(model, args, cache, tokens, lens, rng, limits, max_new, static, stream):
    """Run rounds chunk by chunk, handing each column of tokens that every running row has
    produced to `stream(step, ids, active)` (rows accept different numbers per round)."""
    from jaxdec import api

    p, cache = api._run(model, core.start, *args, cache, tokens, lens, rng, limits,
                        max_new_tokens=max_new, **static)
    done = 0
    while True:
        nxt, cache = api._run(model, core.advance, *args, cache, p, rng, limits, _STREAM_ROUNDS,
                              **static)
        host = jax.device_get(p)
        ready = int(np.min(np.where(host.active, host.n_generated, max_new)))
        done = _replay(stream, host.tokens, host.n_generated, done, ready)
        if not host.active.any():
            return p
        p = nxt


def _replay(stream, tokens, n_gen, done: int = 0, upto: int | None = None) -> int:
    """Hand columns [done, upto) of the emitted ids to `stream`; returns upto."""
    upto = int(np.max(n_gen)) if upto is None else upto
    if stream is not None:
        for j in range(done, upto):
            col = np.asarray(tokens[:, j])
            stream(j, col, col >= 0)
    return max(done, upto)
