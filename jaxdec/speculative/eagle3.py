"""EAGLE-3 (Li et al., arXiv 2503.01840): a one-layer drafter over the target's own features.

    task = Eagle3Task.for_target(model, dataset, draft_vocab=8192, unroll=4, k=4)
    params = task.init(rng)                        # train with task.loss (jaxdec.train)
    progress, cache = core.generate(..., drafter=task.drafter(params), dparams=...)

The drafter reads the target's residual stream entering three layers (low, middle, high:
`default_taps`), fused by one linear map FC: g = FC([h_lo; h_mid; h_hi]). One Llama decoder
layer takes, at sequence position j, the pair (g_j, embed(x_{j+1})) as one 2D-wide input
[RMSNorm(embed); RMSNorm(g)] (attention from 2D to D, residual g, SwiGLU MLP) and predicts
x_{j+2} over a reduced draft vocabulary (`d2t` maps its ids to the target's, the most
frequent tokens of the training data). The token embedding is the target's, frozen.

Drafting k tokens feeds the drafter its own output hidden state (before the final norm) in
place of g, paired with its own last draft. Training-time test (TTT) trains exactly that:
step t of the unroll replaces g by the hidden state step t-1 produced, pairs it with the
next token, and attends as inference does (`ttt_logits`): the chain started at context
position j sees the keys of positions <= j (made from the target's features) and the keys
its own steps 1..t wrote at positions j+1..j+t. The loss is sum_t 0.8^t KL(p_target || q_t).

At inference the drafter keeps its own one-layer KV cache. Its `lengths` count the pairs
fed with the target's features; the pending pairs (features whose following token arrived
since) are fed at the next draft as one ragged chunk, the last one paired with the row's
newest token. Invariant: drafter lengths + pending count == the target cache's length.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdec import formats, layers
from jaxdec.cache import dense, entry
from jaxdec.config import ModelConfig
from jaxdec.errors import JaxdecError
from jaxdec.models import transformer
from jaxdec.pytree import ParamSpec, init_params
from jaxdec.speculative.small_model import propose
from jaxdec.speculative.tree import TreeSpec
from jaxdec.train import losses

STEP_WEIGHT = 0.8  # the loss weight of TTT step t is STEP_WEIGHT ** t (EAGLE-3)


def default_taps(n_layers: int) -> tuple[int, ...]:
    """The layers whose input residual stream is fused: (2, L // 2, L - 3) as EAGLE-3
    (SmolLM2's 30 layers: 2, 15, 27); the first three layers of a model under 6 layers."""
    return (2, n_layers // 2, n_layers - 3) if n_layers >= 6 else tuple(range(min(3, n_layers)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eagle3Config:
    target: ModelConfig  # heads, head dim, RoPE and norm eps of the drafter's layer
    n_taps: int = 3
    d_ff: int  # F of the drafter's MLP
    draft_vocab: int  # V_draft


# ------------------------------------------------------------------------------ params


@partial(jax.tree_util.register_dataclass,
         data_fields=["fc", "emb_norm", "hid_norm", "attn", "mlp_norm", "mlp", "final_norm",
                      "lm_head"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Eagle3Params:
    """The trained weights (all floating point)."""

    fc: jax.Array  # [n_taps * D, D]: fuses the tapped features into g
    emb_norm: jax.Array  # [D]: RMSNorm of the token embedding
    hid_norm: jax.Array  # [D]: RMSNorm of g (or of the drafter's own hidden state)
    attn: transformer.Attention  # wq [2D, N, H], wk/wv [2D, K, H], wo [N, H, D]
    mlp_norm: jax.Array  # [D]
    mlp: transformer.MLP  # w_gate/w_up [D, F], w_down [F, D]
    final_norm: jax.Array  # [D]
    lm_head: jax.Array  # [D, V_draft]


@partial(jax.tree_util.register_dataclass, data_fields=["net", "d2t", "embed"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class DrafterParams:
    """What drafting needs: the weights, the vocabulary map and the target's embedding."""

    net: Eagle3Params
    d2t: jax.Array  # i32[V_draft]: draft id -> target id
    embed: transformer.Params  # the target's token table only (layers=())


def declare(cfg: Eagle3Config) -> Eagle3Params:
    t = cfg.target
    d, n, k, h = t.d_model, t.n_heads, t.n_kv_heads, t.head_dim
    norm = ParamSpec((d,), ("norm",), init="ones")
    attn = transformer.Attention(
        wq=ParamSpec((2 * d, n, h), ("embed", "q_heads", "head_dim"), n_in=1),
        wk=ParamSpec((2 * d, k, h), ("embed", "kv_heads", "head_dim"), n_in=1),
        wv=ParamSpec((2 * d, k, h), ("embed", "kv_heads", "head_dim"), n_in=1),
        wo=ParamSpec((n, h, d), ("q_heads", "head_dim", "embed"), n_in=2),
        bq=None, bk=None, bv=None, q_norm=None, k_norm=None)
    mlp = transformer.MLP(w_gate=ParamSpec((d, cfg.d_ff), ("embed", "mlp"), n_in=1),
                          w_up=ParamSpec((d, cfg.d_ff), ("embed", "mlp"), n_in=1),
                          w_down=ParamSpec((cfg.d_ff, d), ("mlp", "embed"), n_in=1))
    return Eagle3Params(fc=ParamSpec((cfg.n_taps * d, d), (None, "embed"), n_in=1),
                        emb_norm=norm, hid_norm=norm, attn=attn, mlp_norm=norm, mlp=mlp,
                        final_norm=norm,
                        lm_head=ParamSpec((d, cfg.draft_vocab), ("embed", "vocab"), n_in=1))


def init(cfg: Eagle3Config, rng, dtype=jnp.float32) -> Eagle3Params:
    """Random weights as `declare` says."""
    return init_params(declare(cfg), rng, dtype)


HEADS = ("random", "target", "frozen")
"""The draft LM head of a trained EAGLE-3 drafter: a random init; the target's LM head
columns (of the draft vocabulary) and final norm as init; or those columns kept frozen (not
trained, not saved: a drafter rebuilds them from its target)."""


def _dense(w) -> jax.Array:
    return formats.dequantize(w) if isinstance(w, formats.QArray) else w


def with_head(net: Eagle3Params, head) -> Eagle3Params:
    """`net` whole: a frozen-head drafter's missing LM head (None) is `head()`, the
    target's columns of the draft vocabulary (what training, drafting and a reload use)."""
    return net if net.lm_head is not None else dataclasses.replace(net, lm_head=head())


def token_table(target: transformer.Params) -> transformer.Params:
    """The target's params reduced to what `transformer.embed` reads (no copy)."""
    tied = target.embed is None
    return transformer.Params(embed=target.embed, layers=(), final_norm=target.final_norm,
                              lm_head=target.lm_head if tied else None)


def head_columns(target: transformer.Params, d2t) -> jax.Array:
    """[D, V_draft]: the target's LM head restricted to the draft vocabulary."""
    if isinstance(target.lm_head, formats.QArray):
        return formats.take_columns(target.lm_head, d2t)
    return jnp.take(target.lm_head, jnp.asarray(d2t), axis=1)


# ------------------------------------------------------------------------------ vocabulary


def token_counts(dataset, vocab_size: int) -> np.ndarray:
    """i64[V]: how often each token is to be predicted in `dataset`: an array of ids, a
    batch ({"tokens", optional "mask"}, or an object with those attributes), or an
    iterable of either. Only masked positions (the target's own tokens) count."""
    counts = np.zeros(vocab_size, np.int64)
    for tokens, mask in _token_batches(dataset):
        tokens = np.asarray(tokens).reshape(-1)
        keep = np.ones(tokens.shape, bool) if mask is None else np.asarray(mask).reshape(-1) > 0
        counts += np.bincount(tokens[keep & (tokens >= 0) & (tokens < vocab_size)],
                              minlength=vocab_size)
    return counts


def _token_batches(dataset):
    get = lambda name: (dataset.get(name) if isinstance(dataset, dict)
                        else getattr(dataset, name, None))
    if isinstance(dataset, (np.ndarray, jax.Array)):
        yield dataset, None
    elif get("tokens") is not None:
        yield get("tokens"), get("mask")
    else:
        for part in dataset:
            yield from _token_batches(part)


def vocab_map(counts: np.ndarray, draft_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t i32[V_draft], t2d bool[V]): the `draft_vocab` most frequent target tokens (ties
    to the lower id), in increasing id order."""
    if not 0 < draft_vocab <= counts.shape[0]:
        raise JaxdecError(f"the draft vocabulary must hold 1..{counts.shape[0]} tokens "
                          f"(got {draft_vocab})")
    order = np.lexsort((np.arange(counts.shape[0]), -counts))  # by count, then by id
    d2t = np.sort(order[:draft_vocab]).astype(np.int32)
    t2d = np.zeros(counts.shape[0], bool)
    t2d[d2t] = True
    return d2t, t2d


# ------------------------------------------------------------------------------ the layer


def xla_linear(x: jax.Array, w: jax.Array, n_in: int = 1, *, dtype=None) -> jax.Array:
    """`layers.linear` in plain XLA ops, which can be differentiated (the CPU kernels that
    `layers.linear` runs for few rows cannot): training uses this one."""
    y = jnp.tensordot(x, w, axes=n_in, preferred_element_type=jnp.float32)
    return y.astype(dtype or x.dtype)


def act_dtype(net: Eagle3Params):
    """The drafter's activation dtype: its trained weights' (its norms keep it when the
    matmul weights are quantised, `drafters.with_weights`)."""
    return net.hid_norm.dtype


def fuse(net: Eagle3Params, feats: jax.Array, mm=layers.linear) -> jax.Array:
    """g = FC([h_lo; h_mid; h_hi]): [..., n_taps * D] -> [..., D] in the params' dtype."""
    return mm(feats.astype(act_dtype(net)), net.fc)


def _inputs(net: Eagle3Params, g, e, cfg: Eagle3Config) -> jax.Array:
    """[B, T, 2D]: the normed token embedding, then the normed feature."""
    eps = cfg.target.norm_eps
    return jnp.concatenate([layers.rms_norm(e.astype(g.dtype), net.emb_norm, eps),
                            layers.rms_norm(g, net.hid_norm, eps)], axis=-1)


def _finish(net: Eagle3Params, g, attended, cfg: Eagle3Config, mm=layers.linear) -> jax.Array:
    """The residual over g and the MLP sublayer: the layer's output hidden state [B, T, D]."""
    x = g + attended
    h = layers.rms_norm(x, net.mlp_norm, cfg.target.norm_eps)
    with jax.named_scope("mlp"):
        return x + mm(layers.mlp_act(mm(h, net.mlp.w_gate), mm(h, net.mlp.w_up)), net.mlp.w_down)


def draft_logits(net: Eagle3Params, h, cfg: Eagle3Config, mm=layers.linear) -> jax.Array:
    """f32[..., V_draft] from the layer's output hidden state."""
    with jax.named_scope("draft_head"):
        return mm(layers.rms_norm(h, net.final_norm, cfg.target.norm_eps), net.lm_head,
                  dtype=jnp.float32)


def layer(net: Eagle3Params, g, e, positions, kv, past, cfg: Eagle3Config, tree=None):
    """The drafter's decoder layer over its cache (inference): g, e [B, T, D] ->
    (hidden [B, T, D], kv)."""
    with jax.named_scope("eagle3_layer"):
        x = _inputs(net, g, e, cfg)
        a, kv = transformer.attention_block(x, net.attn, positions, kv, past, cfg.target, tree)
        return _finish(net, g, a, cfg), kv


# ------------------------------------------------------------------------------ training


def _shift(x: jax.Array, n: int) -> jax.Array:
    """x[:, n:] along axis 1, zero-padded at the end to the same length."""
    pad = jnp.zeros((x.shape[0], min(n, x.shape[1]), *x.shape[2:]), x.dtype)
    return jnp.concatenate([x[:, n:], pad], axis=1)


def ttt_attention(q, k0, v0, own: list) -> jax.Array:
    """The attention of TTT step t = len(own) (what drafting step t sees in the cache):
    query j (the chain whose context ends at j) sees the step-0 keys k0/v0 [B, T, K, H] of
    positions <= j and, from each later step s, only its own chain's key own[s-1][j]."""
    b, t, n, h = q.shape
    kh = k0.shape[2]
    qg = q.reshape(b, t, kh, n // kh, h) * jnp.asarray(1.0 / math.sqrt(h), q.dtype)
    f32 = dict(preferred_element_type=jnp.float32)
    causal = jnp.tril(jnp.ones((t, t), bool))
    scores = [jnp.where(causal, jnp.einsum("btkgh,bskh->bkgts", qg, k0, **f32), layers.NEG_INF)]
    scores += [jnp.einsum("btkgh,btkh->bkgt", qg, k, **f32)[..., None] for k, _ in own]
    probs = layers.block_softmax(scores)
    out = jnp.einsum("bkgts,bskh->btkgh", probs[0].astype(v0.dtype), v0, **f32)
    for p, (_, v) in zip(probs[1:], own):
        out = out + jnp.einsum("bkgt,btkh->btkgh", p[..., 0].astype(v.dtype), v, **f32)
    return out.reshape(b, t, n, h).astype(q.dtype)


def batch_feats(batch) -> jax.Array:
    """A batch's taps [B, T, n_taps, D] as the fused input's [B, T, n_taps * D]."""
    b, t = batch["tokens"].shape
    return batch["taps"].reshape(b, t, -1)


def chain_drafts(net: Eagle3Params, embed: transformer.Params, d2t, feats, tokens, steps: int,
                 cfg: Eagle3Config) -> jax.Array:
    """i32[steps, B, T]: the target ids of `ttt_logits`' argmaxes: entry [j, :, i] is draft
    j + 1 of a greedy chain whose verified context ends at i (it proposes x_{i+j+2}), for
    `jaxdec.train.loop.replay_chains`."""
    logits = ttt_logits(net, embed, feats, tokens, steps, cfg)
    return jnp.asarray(d2t, jnp.int32)[jnp.argmax(logits, -1)]


def ttt_logits(net: Eagle3Params, embed: transformer.Params, feats, tokens, steps: int,
               cfg: Eagle3Config) -> jax.Array:
    """f32[steps, B, T, V_draft]: the training-time-test unroll over whole sequences
    (no cache). feats [B, T, n_taps * D] are the target's tapped features of tokens
    i32[B, T]. Entry [t, :, j] predicts x_{j+t+2} from the chain whose context ends at j:
    step 0 pairs g_j with x_{j+1}; step t pairs the hidden state of step t-1 with x_{j+t+1}
    at position j + t."""
    g = fuse(net, feats, xla_linear)
    emb = transformer.embed(embed, tokens).astype(g.dtype)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    out, own = [], []
    for t in range(steps):
        with jax.named_scope(f"ttt_step_{t}"):
            x = _inputs(net, g, _shift(emb, t + 1), cfg)
            q, k, v = transformer.project_qkv(x, net.attn, positions + t, cfg.target, xla_linear)
            if t == 0:
                k0, v0 = k, v
            else:
                own.append((k, v))
            a = xla_linear(ttt_attention(q, k0, v0, own), net.attn.wo, n_in=2)
            g = _finish(net, g, a, cfg, xla_linear)
            out.append(draft_logits(net, g, cfg, xla_linear))
    return jnp.stack(out)


def ttt_loss(logits, target_logits, mask):
    """Weighted forward KL of the unroll -> (loss, metrics). logits f32[steps, B, T, Vd];
    target_logits f32[B, T, Vd] (the target's, on the draft vocabulary; position i
    predicts x_{i+1}); mask f32[B, T] (positions to predict)."""
    total, metrics = 0.0, {}
    for t in range(logits.shape[0]):
        p_logits, m = _shift(target_logits, t + 1), _shift(mask.astype(jnp.float32), t + 2)
        loss_t = losses.forward_kl(p_logits, logits[t], m)
        metrics[f"kl_{t}"] = loss_t
        metrics[f"acc_{t}"] = losses.top1_agreement(p_logits, logits[t], m)
        total = total + STEP_WEIGHT ** t * loss_t
    return total, metrics


# ------------------------------------------------------------------------------ inference


@partial(jax.tree_util.register_dataclass, data_fields=["cache", "feats", "tokens", "count"],
         meta_fields=[])
@dataclasses.dataclass(frozen=True)
class State:
    cache: dense.KVCache  # one KVLayer; lengths = the pairs fed with the target's features
    feats: jax.Array  # [B, k+1, D]: pending fused features g, at positions lengths + i
    tokens: jax.Array  # i32[B, k+1]: the token after each; the last pending one is `last`
    count: jax.Array  # i32[B]: pending pairs (>= 1 once prefilled)


def _keep(active, new: State, old: State) -> State:
    """`new` for the active rows, `old` elsewhere. The KV buffers are taken from `new`:
    rows not active write only to the scratch slot, which no query sees."""
    pick = lambda n, o: jnp.where(active.reshape(-1, *([1] * (n.ndim - 1))), n, o)
    cache = dataclasses.replace(new.cache, lengths=pick(new.cache.lengths, old.cache.lengths))
    return State(cache=cache, feats=pick(new.feats, old.feats), tokens=pick(new.tokens, old.tokens),
                 count=pick(new.count, old.count))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eagle3:
    """The EAGLE-3 drafter (a `jaxdec.speculative.core` Drafter); `params` are `DrafterParams`."""

    cfg: Eagle3Config
    k: int = 4
    taps: tuple[int, ...] = (2, 15, 27)
    tree: TreeSpec | None = None
    params: Any = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.k < 1:
            raise JaxdecError(f"an EAGLE-3 drafter drafts k >= 1 tokens (got {self.k})")
        if len(self.taps) != self.cfg.n_taps:
            raise JaxdecError(f"taps {self.taps} do not match the drafter's {self.cfg.n_taps} fused features")
        if self.tree is not None and self.tree.depth != self.k:
            raise JaxdecError(f"a tree drafter's k is its depth ({self.tree.depth}), not {self.k}")

    def init(self, params, batch, capacity, dtype):
        del params
        t = self.cfg.target
        extra = 0 if self.tree is None else (self.tree.depth - 1) * self.tree.top_k
        s = capacity + extra + 1
        kv = entry.KVLayer(k=jnp.zeros((batch, t.n_kv_heads, s, t.head_dim), dtype),
                           v=jnp.zeros((batch, t.n_kv_heads, t.head_dim, s), dtype),
                           pos=jnp.full((batch, s), -1, jnp.int32))
        z = jnp.zeros(batch, jnp.int32)
        return State(cache=dense.KVCache(layers=(kv,), lengths=z),
                     feats=jnp.zeros((batch, self.k + 1, t.d_model), dtype),
                     tokens=jnp.zeros((batch, self.k + 1), jnp.int32), count=z)

    def _feed(self, params: DrafterParams, cache, g, tokens, positions, past=None, tree=None):
        """Run pairs (g [B, T, D], target token ids [B, T]) at `positions` through the layer,
        writing their keys/values -> (hidden [B, T, D], cache). A tree chunk leaves
        `lengths` as they are."""
        net = params.net
        e = transformer.embed(params.embed, tokens)
        h, kv = layer(net, g.astype(act_dtype(net)), e, positions, cache.layers[0], past, self.cfg, tree)
        lengths = cache.lengths if tree is not None else dense.advance(cache.lengths, positions)
        return h, dense.KVCache(layers=(kv,), lengths=lengths)

    def prefill(self, params: DrafterParams, state: State, prompts, prompt_lens, feats):
        """Feed the prompt's complete pairs (g_j, x_{j+1}), j < len - 1; g_{len-1} waits for
        the first generated token."""
        g = fuse(params.net, jnp.concatenate(feats, axis=-1))  # [B, T, D]
        j = jnp.arange(prompts.shape[1])[None]
        positions = jnp.where(j < prompt_lens[:, None] - 1, state.cache.lengths[:, None] + j, -1)
        _, cache = self._feed(params, state.cache, g, _shift(prompts, 1), positions)
        last_g = jnp.take_along_axis(g, jnp.maximum(prompt_lens - 1, 0)[:, None, None], axis=1)
        pending = jnp.zeros_like(state.feats).at[:, :1].set(last_g.astype(state.feats.dtype))
        return State(cache=cache, feats=pending, tokens=jnp.zeros_like(state.tokens),
                     count=jnp.ones_like(state.count))

    def _feed_pending(self, params, state: State, last, active):
        """Feed the pending pairs (the last one paired with `last`) -> (hidden [B, D] of the
        last pair, cache with lengths past them)."""
        j = jnp.arange(state.tokens.shape[1])[None]
        tokens = jnp.where(j == state.count[:, None] - 1, last[:, None], state.tokens)
        valid = (j < state.count[:, None]) & active[:, None]
        positions = jnp.where(valid, state.cache.lengths[:, None] + j, -1)
        h, cache = self._feed(params, state.cache, state.feats, tokens, positions)
        at = jnp.maximum(state.count - 1, 0)[:, None, None]
        return jnp.take_along_axis(h, at, axis=1)[:, 0], cache

    def _to_target(self, params, tok, q):
        """Draft ids i32[B] -> target ids; probabilities over the draft vocabulary f32[B, Vd]
        -> over the target's (zero outside the draft vocabulary)."""
        if q is not None:
            b = q.shape[0]
            q = jnp.zeros((b, self.cfg.target.vocab_size), q.dtype).at[:, params.d2t].set(q)
        return params.d2t[tok], q

    def draft(self, params: DrafterParams, state: State, last, active, key, sampler):
        h, cache = self._feed_pending(params, state, last, active)
        context = cache.lengths
        keys = jax.random.split(key, self.k)
        toks, qs = [], []
        for i in range(self.k):  # unrolled: k is small
            tok, q = self._to_target(params, *propose(
                draft_logits(params.net, h, self.cfg), keys[i], sampler))
            toks.append(tok)
            qs.append(q)
            if i + 1 < self.k:  # feed the own hidden state and draft at position context + i
                positions = jnp.where(active, context + i, -1)[:, None]
                h, cache = self._feed(params, cache, h[:, None], tok[:, None], positions)
                h = h[:, 0]
        cache = dataclasses.replace(cache, lengths=context)  # the own steps' slots are stale
        new = dataclasses.replace(state, cache=cache, count=jnp.zeros_like(state.count))
        probs = None if qs[0] is None else jnp.stack(qs, axis=1)
        return jnp.stack(toks, axis=1), probs, _keep(active, new, state)

    def accept(self, params: DrafterParams, state: State, chunk, feats, n_acc, active):
        """Pending pairs for the next round: the target's features of chunk[:, :n_acc+1]
        with tokens chunk[:, 1:n_acc+1], then the round's correction (`last` next time)."""
        g = fuse(params.net, jnp.concatenate(feats, axis=-1)).astype(state.feats.dtype)
        new = dataclasses.replace(state, feats=g, tokens=_shift(chunk, 1),
                                  count=(n_acc + 1).astype(jnp.int32))
        return _keep(active, new, state)

    # -------------------------------------------------------------------------- trees

    def draft_tree(self, params: DrafterParams, state: State, last, active, key):
        """EAGLE-2's dynamic tree (greedy decoding) -> (tokens i32[B, N], parents i32[B, N],
        state): at each level the top_k frontier nodes by cumulative log-probability are
        fed (each attending to the context and its ancestors) and propose their top_k
        children; of all the nodes proposed the `budget` best are kept, in increasing
        candidate order (a parent before its children)."""
        del key
        spec = self.tree
        h, cache = self._feed_pending(params, state, last, active)
        logp, tok = self._top(params, h[:, None])  # [B, 1, top_k]
        frontier = _Frontier(tok=tok[:, 0], score=logp[:, 0], cid=_ids(0, spec.top_k, tok),
                             hidden=jnp.repeat(h[:, None], spec.top_k, axis=1),
                             anc=jnp.zeros((*tok[:, 0].shape, _tree_slots(spec)), bool))
        cands = [(frontier.tok, frontier.score, jnp.full_like(frontier.cid, -1))]
        for level in range(1, spec.depth):
            frontier, cache = self._expand(params, cache, frontier, level, active)
            cands.append((frontier.tok, frontier.score, frontier.parent))
        tokens, parents = _select(*map(partial(jnp.concatenate, axis=1), zip(*cands)), spec.budget)
        tree_slots = cache.lengths[:, None] + jnp.arange(_tree_slots(spec))  # forgotten: they hold
        cache = dataclasses.replace(cache, layers=(cache.layers[0].drop(tree_slots),))  # positions
        new = dataclasses.replace(state, cache=cache, count=jnp.zeros_like(state.count))
        return params.d2t[tokens], parents, _keep(active, new, state)

    def _top(self, params, h):
        """(log-probabilities, draft ids) of the top_k next tokens after hidden [B, T, D]."""
        logp = jax.nn.log_softmax(draft_logits(params.net, h, self.cfg), axis=-1)
        logp, tok = jax.lax.top_k(logp, self.tree.top_k)
        return jnp.minimum(logp, 0.0), tok.astype(jnp.int32)

    def _expand(self, params, cache, f: "_Frontier", level: int, active):
        """Feed the top_k nodes of a frontier at `level` (slots past the context) ->
        (the frontier of their children, cache)."""
        kk = self.tree.top_k
        _, pick = jax.lax.top_k(f.score, kk)
        sel = jax.tree.map(lambda x: jnp.take_along_axis(
            x, pick.reshape(*pick.shape, *([1] * (x.ndim - 2))), axis=1), f)
        rel = (level - 1) * kk + jnp.arange(kk)  # their tree slots
        live = active[:, None]
        context = cache.lengths
        positions = jnp.where(live, context[:, None] - 1 + level, -1)
        tree = transformer.Tree(mask=jnp.eye(kk, dtype=bool)[None] & live[:, :, None],
                                slots=jnp.where(live, context[:, None] + rel, -1))
        past = _tree_past(context, sel.anc, cache.n_slots) & live[:, :, None]
        h, cache = self._feed(params, cache, sel.hidden, params.d2t[sel.tok], positions, past, tree)
        anc = sel.anc | (jnp.arange(sel.anc.shape[2]) == rel[:, None])[None]
        logp, tok = self._top(params, h)  # [B, top_k, top_k]
        first = kk + (level - 1) * kk * kk
        children = _Frontier(
            tok=tok.reshape(tok.shape[0], -1), score=(sel.score[..., None] + logp).reshape(tok.shape[0], -1),
            cid=_ids(first, kk * kk, tok), hidden=jnp.repeat(h, kk, axis=1),
            anc=jnp.repeat(anc, kk, axis=1), parent=jnp.repeat(sel.cid, kk, axis=1))
        return children, cache


@partial(jax.tree_util.register_dataclass,
         data_fields=["tok", "score", "cid", "hidden", "anc", "parent"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class _Frontier:
    """Candidate nodes of one tree level, F per row."""

    tok: jax.Array  # i32[B, F]: draft ids
    score: jax.Array  # f32[B, F]: cumulative log-probability
    cid: jax.Array  # i32[B, F]: candidate ids (increasing by level: parents first)
    hidden: jax.Array  # [B, F, D]: the hidden state of the node that proposed them
    anc: jax.Array  # bool[B, F, n_tree]: tree slots of that node and its ancestors
    parent: jax.Array | None = None  # i32[B, F]: the proposing node's candidate id


def _ids(first: int, n: int, like) -> jax.Array:
    return jnp.broadcast_to(first + jnp.arange(n, dtype=jnp.int32), (like.shape[0], n))


def _tree_slots(spec: TreeSpec) -> int:
    return (spec.depth - 1) * spec.top_k


def _tree_past(context, anc, n_slots: int) -> jax.Array:
    """bool[B, T, S]: each node sees the context (slots < context) and its ancestors' tree
    slots (context + i for anc[b, t, i])."""
    s = jnp.arange(n_slots)[None]
    rel = s - context[:, None]  # [B, S]
    in_tree = (rel >= 0) & (rel < anc.shape[2])
    idx = jnp.broadcast_to(jnp.clip(rel, 0, max(anc.shape[2] - 1, 0))[:, None], (*anc.shape[:2], n_slots))
    seen = jnp.take_along_axis(anc, idx, axis=2) if anc.shape[2] else jnp.zeros(idx.shape, bool)
    return (s[:, None] < context[:, None, None]) | (seen & in_tree[:, None])


def _select(tok, score, parent, budget: int):
    """Keep the `budget` best candidates (ties: the earlier) in candidate order ->
    (draft ids i32[B, N], parents i32[B, N] as node numbers, 0 the root)."""
    b, c = tok.shape
    cid = jnp.broadcast_to(jnp.arange(c), (b, c))
    best = jnp.sort(jnp.lexsort((cid, -score), axis=-1)[:, :budget], axis=-1)
    node_of = jax.vmap(lambda sel: jnp.zeros(c, jnp.int32).at[sel].set(jnp.arange(1, budget + 1)))(best)
    par = jnp.take_along_axis(parent, best, axis=1)
    parents = jnp.where(par < 0, 0, jnp.take_along_axis(node_of, jnp.maximum(par, 0), axis=1))
    return jnp.take_along_axis(tok, best, axis=1), parents.astype(jnp.int32)


# ------------------------------------------------------------------------------ the task


@partial(jax.tree_util.register_dataclass, data_fields=["embed", "head"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Frozen:
    embed: transformer.Params  # the target's token table (`token_table`)
    head: jax.Array  # [D, V_draft]: the target's LM head columns d2t


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eagle3Task:
    """Distil an EAGLE-3 drafter (the `jaxdec.train` Task protocol)."""

    cfg: Eagle3Config
    taps: tuple[int, ...]
    k: int = 4
    tree: TreeSpec | None = None
    unroll: int = 4
    seed: int = 0
    name: str = "eagle3"
    d2t: np.ndarray = dataclasses.field(compare=False, repr=False)  # i32[V_draft]
    table: transformer.Params | None = dataclasses.field(default=None, compare=False, repr=False)
    head: str = "random"  # the draft LM head: one of HEADS
    target_head: Any = dataclasses.field(default=None, compare=False, repr=False)  # [D, V_draft]
    target_norm: jax.Array | None = dataclasses.field(default=None, compare=False, repr=False)

    @classmethod
    def for_target(cls, target_model, dataset, *, draft_vocab: int = 8192, unroll: int = 4,
                   k: int | None = None, tree: TreeSpec | None = None, seed: int = 0,
                   taps: tuple[int, ...] | None = None, d_ff: int | None = None,
                   head: str = "random") -> "Eagle3Task":
        """A task for `target_model` whose draft vocabulary is the `draft_vocab` tokens most
        often predicted in `dataset` (see `token_counts`); `head` is one of `HEADS`."""
        t = target_model.cfg
        if unroll < 1:
            raise JaxdecError(f"the TTT unroll needs >= 1 step (got {unroll})")
        if head not in HEADS:
            raise JaxdecError(f"unknown draft head {head!r} (known: {', '.join(HEADS)})")
        k = k if k is not None else (tree.depth if tree is not None else 4)
        d2t, _ = vocab_map(token_counts(dataset, t.vocab_size), draft_vocab)
        taps = tuple(taps) if taps is not None else default_taps(t.n_layers)
        cfg = Eagle3Config(target=t, n_taps=len(taps), d_ff=d_ff or t.d_ff, draft_vocab=draft_vocab)
        task = cls(cfg=cfg, taps=taps, k=k, tree=tree, unroll=unroll, seed=seed, d2t=d2t,
                   table=token_table(target_model.params), head=head,
                   target_head=head_columns(target_model.params, d2t),
                   target_norm=target_model.params.final_norm)
        task.drafter(None)  # checks k, taps and tree
        return task

    def init(self, rng) -> Eagle3Params:
        """Random weights; with a "target" or "frozen" head, the target's LM head columns
        and final norm instead (a frozen head is not a trained param: None)."""
        params = init(self.cfg, rng)
        if self.head == "random":
            return params
        dtype = params.fc.dtype
        return dataclasses.replace(
            params, final_norm=jnp.array(self.target_norm, dtype),
            lm_head=None if self.head == "frozen" else _dense(self.target_head).astype(dtype))

    def frozen(self, target_model) -> Frozen:
        return Frozen(embed=token_table(target_model.params),
                      head=head_columns(target_model.params, self.d2t))

    def loss(self, params: Eagle3Params, frozen: Frozen, batch, rng):
        """Weighted multi-step forward KL to the target on the draft vocabulary."""
        del rng
        logits = ttt_logits(self._whole(params, frozen), frozen.embed,
                            batch_feats(batch), batch["tokens"], self.unroll, self.cfg)
        final = batch["final"].astype(jnp.float32)
        target = xla_linear(final, frozen.head.astype(jnp.float32))
        loss, metrics = ttt_loss(logits, target, batch["mask"])
        return loss, {"loss": loss, **metrics}

    def draft_chains(self, params: Eagle3Params, frozen: Frozen, batch) -> jax.Array:
        """i32[k, B, T]: the target ids the drafter proposes, teacher-forced: entry [j, :, i]
        is draft j + 1 of the chain whose verified context ends at position i (it proposes
        x_{i+j+2}), the unroll run for all k drafts (past the trained steps too), as a
        chain round drafts them (see `jaxdec.train.loop.replay_chains`)."""
        return chain_drafts(self._whole(params, frozen), frozen.embed, self.d2t,
                            batch_feats(batch), batch["tokens"], self.k, self.cfg)

    @staticmethod
    def _whole(params: Eagle3Params, frozen: Frozen) -> Eagle3Params:
        """`params` with a frozen head filled in from the target's columns, as trained."""
        return with_head(params, lambda: _dense(frozen.head).astype(params.fc.dtype))

    def drafter(self, params) -> Eagle3:
        dp = None if params is None else DrafterParams(
            net=with_head(params, lambda: self.target_head), d2t=jnp.asarray(self.d2t, jnp.int32), embed=self.table)
        return Eagle3(cfg=self.cfg, k=self.k, taps=self.taps, tree=self.tree, params=dp)

    def meta(self) -> dict:
        tree = None if self.tree is None else dataclasses.asdict(self.tree)
        return {"kind": "eagle3", "taps": list(self.taps), "k": self.k, "tree": tree,
                "unroll": self.unroll, "d_ff": self.cfg.d_ff, "head": self.head,
                "draft_vocab": self.cfg.draft_vocab, "d2t": [int(i) for i in self.d2t]}


def from_meta(meta: dict, params, target_model) -> Eagle3:
    """Rebuild the drafter `Eagle3Task.meta` describes, its trained `params` (Eagle3Params,
    DrafterParams or their nested dicts) attached, over `target_model`'s embedding."""
    if meta.get("kind", "eagle3") != "eagle3":
        raise JaxdecError(f"not an EAGLE-3 drafter: {meta.get('kind')!r}")
    t = target_model.cfg
    taps = tuple(meta["taps"])
    cfg = Eagle3Config(target=t, n_taps=len(taps), d_ff=meta["d_ff"], draft_vocab=meta["draft_vocab"])
    tree = None if meta.get("tree") is None else TreeSpec(**meta["tree"])
    if isinstance(params, dict) and "net" in params:
        params = params["net"]
    net = params.net if isinstance(params, DrafterParams) else _as_params(params)
    d2t = jnp.asarray(meta["d2t"], jnp.int32)
    net = with_head(net, lambda: head_columns(target_model.params, d2t))  # frozen: not saved
    if net.lm_head.shape != (t.d_model, cfg.draft_vocab):
        raise JaxdecError(f"the drafter's LM head {net.lm_head.shape} does not fit a "
                          f"{t.d_model}-wide target and {cfg.draft_vocab} draft tokens")
    dp = DrafterParams(net=net, d2t=d2t, embed=token_table(target_model.params))
    return Eagle3(cfg=cfg, k=meta["k"], taps=taps, tree=tree, params=dp)


def _as_params(p) -> Eagle3Params:
    """Eagle3Params from themselves or from their nested dicts (a restore without a template)."""
    if isinstance(p, Eagle3Params):
        return p
    attn = p["attn"] if isinstance(p["attn"], transformer.Attention) else transformer.Attention(
        **{f: p["attn"].get(f) for f in ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "q_norm", "k_norm")})
    mlp = p["mlp"] if isinstance(p["mlp"], transformer.MLP) else transformer.MLP(**p["mlp"])
    return Eagle3Params(**{**p, "attn": attn, "mlp": mlp})
