"""PARD (An et al., arXiv 2504.18583): a small model of the target's family that drafts k
tokens in ONE forward.

    task = PardTask.for_target(model, dataset, n_layers=4, k=4)
    params = task.init(rng)                          # train with task.loss (jaxdec.train)
    drafter = task.drafter(params)                   # core.generate(..., drafter=drafter)

The drafter is the target's first `n_layers` layers under its final norm and (tied) LM head
(`small_model.truncated`). At inference it reads, after a context x_0..x_t, the input
[x_0..x_t, m, .., m] with k - 1 copies of a mask token m at positions t+1..t+k-1: the
output at x_t predicts x_{t+1}, the one at the i-th mask x_{t+1+i}. The mask token is an
id no text produces (`mask_token`).

Training (conditional drop-token, COD). A row x_0..x_{L} gives L inputs; copy 0 is the row
itself (position p predicts x_{p+1}); copy c >= 1 holds mask tokens, and its entry at
position p is the c-th mask after the context x_0..x_{p-c}: it sees that real prefix and
the masks of its own chain, copy c' at position p - c + c' for 1 <= c' <= c, and predicts
x_{p+1}, as inference's c-th mask does. Positions are reused by every copy. COD keeps all
of copy 0 and, of copy c, len * max(r^c, r_min) entries drawn among those whose chain
predecessor (copy c-1, position p-1) was kept, so every kept entry has its whole chain and
the packed length grows about linearly in k. The copies are packed into one sequence with
an explicit bool[T, T] attention mask (`cod_mask`) and run as one tree chunk.

The loss is forward KL against the target's next-token distribution at the entry's
position p (the data's `final` hidden states): at copy c this is the target's prediction
of x_{p+1} given x_0..x_p, which is what verification compares a c-th draft with when the
drafts before it were accepted; `loss="ce"` uses the target's tokens as hard labels.
"""

from __future__ import annotations

import dataclasses
import json
import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdec.config import ModelConfig
from jaxdec.errors import JaxdecError
from jaxdec.models import transformer
from jaxdec.speculative import small_model
from jaxdec.speculative import small_task as small
from jaxdec.train import losses

# ---------------------------------------------------------------------------- COD layout


def cod_counts(length: int, k: int, r: float, r_min: float) -> tuple[int, ...]:
    """Entries kept of each copy of a row of `length` inputs: all of copy 0, then
    floor(length * max(r^c, r_min)), at most one fewer than copy c - 1 keeps (the entry
    at the row's end has no successor) and never below 0."""
    counts = [length]
    for c in range(1, k):
        want = math.floor(length * max(r ** c, r_min) + 1e-9)
        counts.append(max(min(want, counts[-1] - 1), 0))
    return tuple(counts)


def cod_copies(counts: tuple[int, ...]) -> np.ndarray:
    """i32[T_total]: the copy of each packed entry (copy-major; static)."""
    return np.repeat(np.arange(len(counts), dtype=np.int32), counts)


def cod_keep(key, weights: jax.Array, counts: tuple[int, ...]) -> jax.Array:
    """i32[T_total]: the positions COD keeps of one row, copy by copy, ascending in each.

    weights f32[L]: the loss weight of each position's label. Among the candidates of copy
    c (positions whose predecessor in copy c-1 was kept) it draws uniformly, preferring
    those whose label counts (a prompt position teaches nothing)."""
    length = weights.shape[0]
    kept = jnp.ones(length, bool)
    out = [jnp.arange(length, dtype=jnp.int32)]
    for c, n in enumerate(counts[1:], start=1):
        candidate = jnp.concatenate([jnp.zeros(1, bool), kept[:-1]])
        score = jax.random.uniform(jax.random.fold_in(key, c), (length,)) + (weights > 0)
        _, idx = jax.lax.top_k(jnp.where(candidate, score, -1.0), n)
        idx = jnp.sort(idx).astype(jnp.int32)
        kept = jnp.zeros(length, bool).at[idx].set(True)
        out.append(idx)
    return jnp.concatenate(out)


def cod_mask(copies, positions: jax.Array) -> jax.Array:
    """bool[..., T, T]: what each packed entry sees. Entry (c, p) continues the context
    x_0..x_t, t = p - c: it sees the real tokens at positions <= t and the masks (c', t + c')
    of its own chain with c' <= c (itself included)."""
    c, p = jnp.asarray(copies), positions
    qc, qp, kc, kp = c[:, None], p[..., :, None], c[None, :], p[..., None, :]
    real = (kc == 0) & (kp <= qp - qc)
    chain = (kc >= 1) & (kc <= qc) & (kp - kc == qp - qc)
    return real | chain


def pack(inputs: jax.Array, copies, positions: jax.Array, mask_id: int) -> jax.Array:
    """i32[B, T_total]: the packed tokens: copy 0's real tokens, the mask token elsewhere."""
    real = jnp.take_along_axis(inputs, positions, axis=1)
    return jnp.where(jnp.asarray(copies)[None] == 0, real, mask_id).astype(jnp.int32)


def packed_hidden(params: transformer.Params, cfg: ModelConfig, inputs, copies, positions,
                  mask_id: int) -> jax.Array:
    """Final-norm hidden states [B, T_total, D] of the packed COD sequence, one forward
    under its own attention mask (a tree chunk without a cache: slots unused)."""
    tokens = pack(inputs, copies, positions, mask_id)
    tree = transformer.Tree(mask=cod_mask(copies, positions), slots=positions)
    h, _, _ = transformer.hidden_and_taps(params, tokens, positions, None, cfg, tree=tree)
    return h


# ---------------------------------------------------------------------------- the drafter


# small_model.State, with pending i32[B, k]: accepted drafts not fed yet (the first n_pending)
State = small_model.State


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pard(small_model.SmallModel):
    """Draft k tokens in one forward of [pending, last, k - 1 masks]; `params` are a full
    `transformer.Params` (a truncated target). Prefill is the small model's."""

    mask_id: int

    def init(self, params, batch, capacity, dtype):
        state = super().init(params, batch, capacity, dtype)
        return dataclasses.replace(state, pending=jnp.zeros((batch, self.k), jnp.int32))

    def draft_logits(self, params, state: State, last, active):
        """(f32[B, k, V] logits of x_{t+1}..x_{t+k}, state): feed the pending drafts and
        `last` (kept) and k - 1 masks (rolled back: their slots are left stale)."""
        b, k = last.shape[0], self.k
        tokens = jnp.concatenate([state.pending, last[:, None],
                                  jnp.full((b, k - 1), self.mask_id, jnp.int32)], axis=1)
        valid = jnp.concatenate([jnp.arange(k)[None] < state.n_pending[:, None],
                                 jnp.ones((b, k), bool)], axis=1) & active[:, None]
        lengths = state.cache.lengths
        positions = jnp.where(valid, lengths[:, None] + jnp.cumsum(valid, 1) - 1, -1)
        h, cache = transformer.hidden(params, tokens, positions, state.cache, self.cfg)
        real = jnp.where(active, lengths + state.n_pending + 1, lengths).astype(jnp.int32)
        state = State(cache=dataclasses.replace(cache, lengths=real), pending=state.pending,
                      n_pending=jnp.where(active, 0, state.n_pending))
        return transformer.logits_from_hidden(params, h[:, k:]), state

    def draft(self, params, state: State, last, active, key, sampler):
        logits, state = self.draft_logits(params, state, last, active)
        keys = jax.random.split(key, self.k)
        picks = [small_model.propose(logits[:, i], keys[i], sampler) for i in range(self.k)]
        tokens = jnp.stack([t for t, _ in picks], axis=1)
        q = None if picks[0][1] is None else jnp.stack([p for _, p in picks], axis=1)
        return tokens, q, state

    def accept(self, params, state: State, chunk, feats, n_acc, active):
        """x was fed with the draft; the accepted drafts wait for the next one."""
        del params, feats
        return dataclasses.replace(
            state, pending=jnp.where(active[:, None], chunk[:, 1:], state.pending),
            n_pending=jnp.where(active, n_acc, state.n_pending).astype(jnp.int32))


def mask_token(target_model) -> int:
    """An id no text produces: the last embedding row past the tokenizer's vocabulary
    (padding rows), else the tokenizer's last special token that is not BOS, EOS, PAD, a
    stop id or in the chat template (SmolLM2: 16, `<empty_output>`), else the last id that
    is not an EOS id."""
    cfg, tok = target_model.cfg, target_model.tokenizer
    if tok is None:
        return max(set(range(cfg.vocab_size)) - set(cfg.eos_ids))
    if tok.vocab_size < cfg.vocab_size:
        return cfg.vocab_size - 1
    used = {tok.bos_id, tok.eos_id, tok.pad_id, *tok.stop_ids, *cfg.eos_ids}
    template = tok.chat_template or ""
    special = [i for i, t in tok.backend.get_added_tokens_decoder().items()
               if t.special and i not in used and t.content not in template and i < cfg.vocab_size]
    return max(special) if special else max(set(range(cfg.vocab_size)) - set(cfg.eos_ids))


# ---------------------------------------------------------------------------- training

LOSS_KINDS = ("fkl", "ce")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PardTask:
    """The Task (see `jaxdec.train`) that trains a PARD drafter with COD."""

    cfg: ModelConfig  # the drafter's: the target's cut to n_layers layers
    n_layers: int
    mask_id: int
    k: int = 4
    r: float = 0.7
    r_min: float = 0.2
    train_embeddings: bool = False
    loss_kind: str = "fkl"
    seed: int = 0  # salts the COD draws (init is a copy, it draws nothing)
    name: str = "pard"
    taps: tuple[int, ...] = ()
    start: Any = dataclasses.field(default=None, compare=False, repr=False)  # truncated target

    @classmethod
    def for_target(cls, target_model, dataset=None, *, n_layers: int = 4, k: int = 4,
                   r: float = 0.7, r_min: float = 0.2, train_embeddings: bool = False,
                   seed: int = 0, loss: str = "fkl", mask_id: int | None = None) -> "PardTask":
        del dataset  # no taps
        mask_id = mask_token(target_model) if mask_id is None else mask_id
        check_options(target_model.cfg, k=k, r=r, r_min=r_min, loss=loss, mask_id=mask_id)
        cfg, start = small_model.truncated(target_model.cfg, target_model.params, n_layers)
        return cls(cfg=cfg, n_layers=n_layers, mask_id=mask_id, k=k, r=r, r_min=r_min,
                   train_embeddings=train_embeddings, loss_kind=loss, seed=seed, start=start)

    def init(self, rng) -> small.SmallParams:
        del rng
        return small.trainable_copy(self.start, self.train_embeddings)

    def frozen(self, target_model) -> small.Head:
        return small.target_head(target_model)

    def loss(self, params: small.SmallParams, frozen: small.Head, batch, rng):
        """Forward KL (or CE) over the kept COD entries whose label the target generated;
        metrics: top-1 agreement with the target per draft position (`top1_i`)."""
        full = small.model_params(params, frozen)
        inputs, weights = batch["tokens"][:, :-1], batch["mask"][:, 1:]
        counts = cod_counts(inputs.shape[1], self.k, self.r, self.r_min)
        copies = cod_copies(counts)
        keys = jax.random.split(jax.random.fold_in(rng, self.seed), inputs.shape[0])
        pos = jax.vmap(partial(cod_keep, counts=counts))(keys, weights)  # [B, T_total]
        q = transformer.logits_from_hidden(
            full, packed_hidden(full, self.cfg, inputs, copies, pos, self.mask_id))
        w = jnp.take_along_axis(weights, pos, axis=1)
        final = jnp.take_along_axis(batch["final"][:, :-1], pos[..., None], axis=1)
        p = jax.lax.stop_gradient(  # [B, T_total, V]: the target's logits at each entry
            transformer.logits_from_hidden(frozen, final.astype(full.final_norm.dtype)))
        if self.loss_kind == "fkl":
            loss = losses.forward_kl(p, q, w)
        else:
            labels = jnp.take_along_axis(batch["tokens"][:, 1:], pos, axis=1)
            loss = losses.cross_entropy(q, labels, w)
        ends = np.cumsum(counts)
        metrics = {f"top1_{c + 1}": losses.top1_agreement(p[:, e - n: e], q[:, e - n: e],
                                                          w[:, e - n: e])
                   for c, (n, e) in enumerate(zip(counts, ends)) if n > 0}
        return loss, metrics

    def drafter(self, params: small.SmallParams) -> Pard:
        head = small.Head(embed=self.start.embed, lm_head=self.start.lm_head)
        return Pard(cfg=self.cfg, k=self.k, mask_id=self.mask_id,
                    params=small.model_params(params, head))

    def meta(self) -> dict:
        return {"kind": self.name, "n_layers": self.n_layers, "k": self.k,
                "mask_id": self.mask_id, "r": self.r, "r_min": self.r_min,
                "train_embeddings": self.train_embeddings, "loss": self.loss_kind,
                "config": json.loads(self.cfg.to_json())}


def check_options(cfg: ModelConfig, *, k: int, r: float, r_min: float, loss: str,
                  mask_id: int) -> None:
    if k < 1:
        raise JaxdecError(f"a PARD drafter proposes at least 1 token per round (got k={k})")
    if not (0 < r <= 1 and 0 <= r_min <= 1):
        raise JaxdecError(f"COD keeps a share r in (0, 1] and r_min in [0, 1] of each copy "
                          f"(got r={r}, r_min={r_min})")
    if loss not in LOSS_KINDS:
        raise JaxdecError(f"unknown PARD loss {loss!r} (one of {', '.join(LOSS_KINDS)})")
    if not 0 <= mask_id < cfg.vocab_size:
        raise JaxdecError(f"mask token id {mask_id} is outside the vocabulary "
                          f"(0..{cfg.vocab_size - 1})")


def from_meta(meta: dict, params: small.SmallParams, target_model) -> Pard:
    """The saved drafter for `target_model` (`jaxdec.train.store`'s rebuild function)."""
    cfg, full = small.restored(meta["n_layers"], params, target_model)
    return Pard(cfg=cfg, k=meta["k"], mask_id=meta["mask_id"], params=full)
