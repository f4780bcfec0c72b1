"""Tree drafts: verify every branch of a draft tree in one target forward (greedy decoding).

A drafter with `tree = TreeSpec(depth, top_k, budget)` proposes, per row, `budget` draft
nodes numbered 1..N (node 0 is the row's last token x, the root), each with a parent that
precedes it (`draft_tree`). The target runs once over the N + 1 nodes:
- each node sits at position length + depth and sees the cache and its own ancestors (a
  tree attention mask, `transformer.Tree`);
- node i is written to cache slot length + i, since siblings share a position.
A node is accepted when its token is the target's argmax after its parent and its parent
is accepted; the deepest accepted node ends the kept path (siblings are distinct, so at
most one child of a node can match). The path's keys and values are then moved to the
slots of their positions (a gather and a scatter of depth + 1 slots per layer, whatever
the budget), `lengths` covers them, and the rest is stale as after a chain round.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxdec.cache import dense
from jaxdec.errors import JaxdecError
from jaxdec.models import transformer


@dataclasses.dataclass(frozen=True, kw_only=True)
class TreeSpec:
    """EAGLE-2's dynamic tree: `depth` draft levels, the `top_k` best nodes expanded per
    level with `top_k` children each, and the `budget` best nodes (by the drafter's joint
    probability) kept for verification."""

    depth: int = 5
    top_k: int = 4
    budget: int = 12

    def __post_init__(self):
        if min(self.depth, self.top_k, self.budget) < 1:
            raise JaxdecError(f"a draft tree needs depth, top_k and budget >= 1 (got {self})")
        if self.budget > self.top_k + (self.depth - 1) * self.top_k ** 2:
            raise JaxdecError(f"a tree of depth {self.depth} expanding {self.top_k} nodes by "
                              f"{self.top_k} has fewer than {self.budget} candidate nodes")


def structure(parents: jax.Array, depth: int):
    """From parents i32[B, N] of nodes 1..N (node 0 the root) -> (parent i32[B, N+1] with
    the root's -1, depth i32[B, N+1], ancestor-or-self bool[B, N+1, N+1])."""
    b, n = parents.shape
    parent = jnp.concatenate([jnp.full((b, 1), -1, parents.dtype), parents], axis=1)
    up = lambda x, node: jnp.take_along_axis(x, jnp.maximum(node, 0), axis=1)
    node = jnp.broadcast_to(jnp.arange(n + 1), (b, n + 1))
    anc = node[:, :, None] == node[:, None, :]
    level = jnp.zeros((b, n + 1), jnp.int32)
    for _ in range(depth):  # walk every node up one level at a time
        node = jnp.where(node >= 0, up(parent, node), -1)
        anc = anc | ((node[:, :, None] == jnp.arange(n + 1)) & (node[:, :, None] >= 0))
        level = level + (node >= 0)
    return parent, level, anc


def accepted_path(tokens: jax.Array, parent, level, anc, best: jax.Array, depth: int):
    """Greedy acceptance over a tree: tokens i32[B, N+1] (root first), best i32[B, N+1] the
    target's argmax at each node -> (n_acc i32[B], path i32[B, depth+1] node ids, next i32[B])."""
    up = lambda x: jnp.take_along_axis(x, jnp.maximum(parent, 0), axis=1)
    correct = tokens == up(best)
    is_root = parent < 0
    ok = is_root
    for _ in range(depth):
        ok = is_root | (correct & up(ok))
    deepest = jnp.argmax(jnp.where(ok, level, -1), axis=1)
    n_acc = jnp.take_along_axis(level, deepest[:, None], axis=1)[:, 0]
    on_path = jnp.take_along_axis(anc, deepest[:, None, None], axis=1)[:, 0]  # [B, N+1]
    at = on_path[:, None, :] & (level[:, None, :] == jnp.arange(depth + 1)[None, :, None])
    path = jnp.argmax(at, axis=2).astype(jnp.int32)  # [B, depth+1]; past n_acc: the root
    nxt = jnp.take_along_axis(best, deepest[:, None], axis=1)[:, 0]
    return n_acc, path, nxt


def compact(cache: dense.KVCache, base, path, n_acc, active, n_nodes: int) -> dense.KVCache:
    """Move the kept path's entries from their node slots to their positions' slots, and
    forget the other nodes: the cache then holds exactly the accepted tokens, on every kind."""
    steps = jnp.arange(path.shape[1])
    keep = active[:, None] & (steps <= n_acc[:, None])
    src = base[:, None] + path
    dst = jnp.where(keep, base[:, None] + steps, -1)
    nodes = jnp.arange(n_nodes)
    stale = jnp.where(active[:, None] & (nodes > n_acc[:, None]), base[:, None] + nodes, -1)
    move = lambda e: e if e is None else e.move(src, dst).drop(stale)
    return dataclasses.replace(cache, layers=tuple(map(move, cache.layers)))


def round(tparams, dparams, cache, p, key, limits, stops, *, cfg, drafter, emit):  # noqa: A001
    """One greedy tree round: draft a tree, verify it, keep the longest accepted path."""
    depth = drafter.tree.depth
    tokens, parents, dstate = drafter.draft_tree(dparams, p.drafter, p.last, p.active, key)
    nodes = jnp.concatenate([p.last[:, None], tokens], axis=1)  # [B, N+1]
    parent, level, anc = structure(parents, depth)
    base = cache.lengths
    live = p.active[:, None]
    positions = jnp.where(live, base[:, None] + level, -1)
    slots = jnp.where(live, base[:, None] + jnp.arange(nodes.shape[1]), -1)
    tree = transformer.Tree(mask=anc & live[:, :, None], slots=slots)
    h, cache, feats = transformer.hidden_and_taps(tparams, nodes, positions, cache, cfg, tree=tree,
                                                  taps=drafter.taps)
    best = jnp.argmax(transformer.logits_from_hidden(tparams, h), axis=-1).astype(jnp.int32)
    n_acc, path, nxt = accepted_path(nodes, parent, level, anc, best, depth)
    cache = compact(cache, base, path, n_acc, p.active, nodes.shape[1])
    cache = dataclasses.replace(cache, lengths=jnp.where(p.active, base + n_acc + 1, base))
    chunk = jnp.take_along_axis(nodes, path, axis=1)
    path_feats = tuple(jnp.take_along_axis(f, path[:, :, None], axis=1) for f in feats)
    dstate = drafter.accept(dparams, dstate, chunk, path_feats, n_acc, p.active)
    p = dataclasses.replace(p, drafter=dstate)
    return emit(p, chunk, n_acc, nxt, limits, stops), cache
