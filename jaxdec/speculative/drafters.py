"""Drafters by name: a trained drafter directory, "layers:N", or a model.

    drafter = drafters.load("checkpoints/eagle3-smollm2", target)   # a trained drafter
    drafter = drafters.load("smollm2", target)        # a model: same vocabulary -> SmallModel,
                                                      # another vocabulary -> CrossVocab (TLI)
    drafter = drafters.load("layers:8", target)       # the target's first 8 layers
    jaxdec.generate(target, prompts, drafter=drafter)
"""

from __future__ import annotations

import dataclasses
import pathlib

from jaxdec.errors import JaxdecError
from jaxdec.speculative.tree import TreeSpec
from jaxdec.speculative import small_model
from jaxdec.speculative.core import DEFAULT_K
from jaxdec.speculative.hetero import CrossVocab


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
        from jaxdec.train import store
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
