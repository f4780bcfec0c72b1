"""Distil the target into a small model of its own vocabulary: its first layers.

The drafter starts as the target truncated to its first `layers` layers under the target's
final norm and LM head (`small_model.truncated`, a usable drafter before any training) and
learns to match the target's next-token distributions on the target's own continuations:
forward KL(p || q) (`loss="fkl"`, mass-covering) or reverse KL(q || p) (`"rkl"`). The
target's logits come from the dataset's final hidden states through the target's frozen
LM head. By default only the layers and the final norm train; the embedding and LM head
stay the target's (shared, frozen, and left out of the checkpoint: a SmolLM2 head is
28M of its 135M parameters), and `train_head=True` trains a copy of them too.
"""

from __future__ import annotations

import dataclasses
import json
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from jaxdec.config import ModelConfig
from jaxdec.errors import JaxdecError
from jaxdec.models import transformer
from jaxdec.speculative import small_model
from jaxdec.train import losses

LOSSES = {"fkl": losses.forward_kl, "rkl": losses.reverse_kl}


@partial(jax.tree_util.register_dataclass,
         data_fields=["layers", "final_norm", "embed", "lm_head"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SmallParams:
    """What trains. A None head part is the target's (`Head`), supplied when run."""

    layers: tuple[transformer.LayerParams, ...]  # the drafter's layers
    final_norm: jax.Array  # [D]
    embed: jax.Array | None  # [V, D]: a trained untied embedding; None: tied or the target's
    lm_head: jax.Array | None  # [D, V]: a trained LM head; None: the target's


@partial(jax.tree_util.register_dataclass, data_fields=["embed", "lm_head"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Head:
    """The target's frozen embedding and LM head."""

    embed: jax.Array | None  # [V, D]; None when tied to the LM head
    lm_head: jax.Array  # [D, V]


def model_params(params: SmallParams, head: Head) -> transformer.Params:
    """The drafter's full `transformer.Params`: trained parts, the rest from `head`."""
    own = params.lm_head is not None
    return transformer.Params(embed=params.embed if own else head.embed, layers=params.layers,
                              final_norm=params.final_norm,
                              lm_head=params.lm_head if own else head.lm_head)


def trainable_copy(start: transformer.Params, with_head: bool) -> SmallParams:
    """The parts of a truncated target `start` that train, copied (the target is not
    donated): its layers and final norm, and its embedding and LM head `with_head`."""
    copy = lambda tree: jax.tree.map(jnp.array, tree)
    return SmallParams(layers=copy(start.layers), final_norm=jnp.array(start.final_norm),
                       embed=copy(start.embed) if with_head else None,
                       lm_head=jnp.array(start.lm_head) if with_head else None)


def restored(n_layers: int, params: SmallParams, target_model):
    """(cfg, full transformer.Params) of a saved truncated drafter of `n_layers` layers
    over `target_model`: its params in the target's dtype, the head parts it did not train
    taken from the target."""
    cfg, _ = small_model.truncated(target_model.cfg, target_model.params, n_layers)
    dtype = target_model.dtype
    params = jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating)
                          else x, params)
    return cfg, model_params(params, target_head(target_model))


def target_head(target_model) -> Head:
    return Head(embed=target_model.params.embed, lm_head=target_model.params.lm_head)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SmallDistill:
    """The Task (see `jaxdec.train`) for a truncated-target drafter."""

    cfg: ModelConfig  # the drafter's: the target's config cut to `layers` layers
    layers: int
    loss_kind: str = "fkl"
    train_head: bool = False
    k: int = 4  # draft tokens per round of the drafter it yields
    name: str = "small"
    taps: tuple[int, ...] = ()
    start: Any = dataclasses.field(default=None, compare=False, repr=False)  # truncated target

    @classmethod
    def for_target(cls, target_model, dataset=None, *, layers: int = 4, loss: str = "fkl",
                   train_head: bool = False, k: int = 4) -> "SmallDistill":
        del dataset  # the task needs no taps
        if loss not in LOSSES:
            raise JaxdecError(f"unknown loss {loss!r} for the small drafter (one of "
                              f"{', '.join(LOSSES)})")
        if k < 1:
            raise JaxdecError(f"a drafter proposes at least 1 token per round (got k={k})")
        cfg, start = small_model.truncated(target_model.cfg, target_model.params, layers)
        return cls(cfg=cfg, layers=layers, loss_kind=loss, train_head=train_head, k=k,
                   start=start)

    def init(self, rng) -> SmallParams:
        del rng
        return trainable_copy(self.start, self.train_head)

    def frozen(self, target_model) -> Head:
        return target_head(target_model)

    def loss(self, params: SmallParams, frozen: Head, batch, rng):
        """KL between the target's and the drafter's next-token distributions at every
        generated token (position t predicts tokens[t + 1])."""
        del rng
        full = model_params(params, frozen)
        inputs = batch["tokens"][:, :-1]
        positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
        h, _ = transformer.hidden(full, inputs, positions, None, self.cfg)
        q_logits = transformer.logits_from_hidden(full, h)
        final = batch["final"][:, :-1].astype(full.final_norm.dtype)
        p_logits = jax.lax.stop_gradient(transformer.logits_from_hidden(frozen, final))
        mask = batch["mask"][:, 1:]
        loss = LOSSES[self.loss_kind](p_logits, q_logits, mask)
        return loss, {"top1": losses.top1_agreement(p_logits, q_logits, mask)}

    def drafter(self, params: SmallParams) -> small_model.SmallModel:
        head = Head(embed=self.start.embed, lm_head=self.start.lm_head)
        return small_model.SmallModel(cfg=self.cfg, k=self.k, params=model_params(params, head))

    def meta(self) -> dict:
        return {"kind": self.name, "layers": self.layers, "k": self.k, "loss": self.loss_kind,
                "train_head": self.train_head, "config": json.loads(self.cfg.to_json())}


def from_meta(meta: dict, params: SmallParams, target_model) -> small_model.SmallModel:
    """The saved drafter for `target_model` (`jaxdec.train.store`'s rebuild function)."""
    cfg, full = restored(meta["layers"], params, target_model)
    return small_model.SmallModel(cfg=cfg, k=meta["k"], params=full)
