"""The cache-entry interface, and the dense entries.

An entry is one layer's part of the decode cache. Every kind implements:

    write(..., slots, positions)   the chunk's keys/values (or latents) at `slots`, which
                                   remember their true `positions`
    attend(q, q_pos, impl, window) the kind's decode op: one query per row over the entry
    view(dtype)                    the entry as dense (k [B, K, S + 1, H], v [B, K, H, S + 1])
    visible / before               which slots a chunk of queries sees (from positions)
    move(src, dst), drop(slots)    copy slots (tree compaction), forget slots (eviction)
    reset_rows(rows)               empty whole rows (an engine reuses a row)
    bytes(), axes()                its size counted from its arrays; its logical axes

Slotted entries (`Slotted`: keys and values, latents) keep `pos` (i32[B, S + 1]), the
position of the token each slot holds, -1 for an empty slot. A slot's position is data,
not its index: a query at position p sees the slots whose position is in [0, p] (and, on a
sliding-window layer, > p - window). Rolling a row back (a rejected draft) is lowering the
cache's `lengths`: the dropped slots hold positions past every later query until they are
written again. Slot `S` (the last) is the scratch slot: padding (position < 0) and tokens
past the capacity are written there, so every scatter index is in bounds (XLA then updates
the buffer in place; a dropped write compiled to read-old/select/write plus copies), and
its position stays -1, so no query sees it.

`slots` name where a chunk goes as logical slots: a causal chunk writes token t to slot t
(slots == positions); a speculative tree's siblings share a position, so they are written
to consecutive slots past the context instead, and `move` later puts the accepted path at
its positions' slots. A kind maps logical slots to its storage (`where`): the dense kinds
one to one, the ring of a sliding window modulo its size, pages through a page table.

The Mamba state (`StateLayer`) is one fixed-size state per row: it has no slots.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxdec import layers
from jaxdec.cache import registry
from jaxdec.ops import cpu_kernel
from jaxdec.errors import JaxdecError
from jaxdec.formats.kvquant import put_rows, take_rows


def chunk_mask(positions: jax.Array, window: int | None = None) -> jax.Array:
    """bool[B, T, T]: causal by position (and within `window`); padding (position < 0)
    sees and is seen by nothing."""
    q, k = positions[:, :, None], positions[:, None, :]
    return (k <= q) & (k >= 0) & (q >= 0) & _within(q, k, window)


def _within(q, k, window: int | None):
    return True if window is None else q - k < window


class Slotted:
    """The slot bookkeeping of every slotted kind (module docstring). A subclass is a
    registered dataclass with a `pos` field and names the slot axis of its other fields
    (within a row) in `SLOT_AXES`."""

    SLOT_AXES: ClassVar[dict[str, int]] = {}
    pos: jax.Array  # i32[B, S + 1]
    kernel = None  # the kind's Pallas decode op (q [B, N, H], lengths i32[B]), if it has one
    writes_first = False  # True: every chunk is stored before it attends (a lossy kind)

    @property
    def n_slots(self) -> int:
        return self.pos.shape[1]

    @property
    def capacity(self) -> int:
        """The slots that hold tokens (the scratch slot aside)."""
        return self.n_slots - 1

    @property
    def max_tokens(self) -> int | None:
        """The most tokens a row can hold (None: any number, as a ring's)."""
        return self.capacity

    def holds_chunk(self, t: int) -> bool:
        """Whether a chunk of t tokens may be written before it attends: every key its
        queries see is still stored after the write (any chunk, but in a ring)."""
        return True

    def where(self, slots: jax.Array, positions: jax.Array) -> jax.Array:
        """i32[B, T]: the storage slot of each logical slot; padding (position < 0) and
        slots past the capacity go to scratch."""
        ok = (positions >= 0) & (slots >= 0) & (slots < self.capacity)
        return jnp.where(ok, slots, self.capacity)

    def write_fields(self, new: dict, slots, positions):
        """The entry with `new` ({field: [B, T, ...]}) and the positions written at `slots`."""
        at = self.where(slots, positions)
        pos = jnp.where(at == self.capacity, -1, positions)
        fields = {f: put_rows(getattr(self, f), x, at, self.SLOT_AXES[f]) for f, x in new.items()}
        return dataclasses.replace(self, pos=put_rows(self.pos, pos, at, 0), **fields)

    def move(self, src: jax.Array, dst: jax.Array):
        """The entry with logical slots `src` (i32[B, P]) copied to `dst`; a negative `dst`
        copies nowhere. Reads all of `src` before writing any of `dst`."""
        src_at, dst_at = self.where(src, src), self.where(dst, dst)
        pos = jnp.where(dst_at == self.capacity, -1, take_rows(self.pos, src_at, 0))
        fields = {f: put_rows(getattr(self, f), take_rows(getattr(self, f), src_at, a), dst_at, a)
                  for f, a in self.SLOT_AXES.items()}
        return dataclasses.replace(self, pos=put_rows(self.pos, pos, dst_at, 0), **fields)

    def drop(self, slots: jax.Array):
        """The entry with logical slots `slots` (i32[B, P]; negative: none) emptied."""
        at = self.where(slots, slots)
        return dataclasses.replace(self, pos=put_rows(self.pos, jnp.full(at.shape, -1, jnp.int32), at, 0))

    def reset_rows(self, rows: jax.Array):
        """The entry with the rows marked in `rows` (bool[B]) emptied."""
        return dataclasses.replace(self, pos=jnp.where(rows[:, None], -1, self.pos))

    def with_table(self, table, held=None):
        """A paged kind's entry reading through page table `table` (`paged.PagedKVLayer`)."""
        raise JaxdecError(f"a {type(self).__name__} cache entry has no page table: pages are "
                          "handed out only in the paged kind")

    def visible(self, q_pos: jax.Array, window: int | None = None) -> jax.Array:
        """bool[B, T, S + 1]: the slots each query (at q_pos i32[B, T]) sees."""
        q, k = q_pos[:, :, None], self.pos[:, None, :]
        return (k >= 0) & (k <= q) & _within(q, k, window)

    def before(self, q_pos: jax.Array, window: int | None = None) -> jax.Array:
        """bool[B, T, S + 1]: the slots a chunk of queries sees that were filled before it
        (positions below the chunk's first), for attending over the entry and the chunk's
        own keys separately."""
        first = jnp.min(jnp.where(q_pos >= 0, q_pos, jnp.iinfo(jnp.int32).max), axis=1)
        k = self.pos[:, None, :]
        return ((k >= 0) & (k < first[:, None, None]) & (q_pos[:, :, None] >= 0)
                & _within(q_pos[:, :, None], k, window))

    def with_chunk(self, past: jax.Array, slots, positions, mask: jax.Array) -> jax.Array:
        """bool[B, T, S + 1]: `past` plus the chunk's own slots as `mask` (bool[B, T, T],
        queries by chunk keys) shows them: the visibility over the entry after the chunk
        was written to `slots`. Scratch is seen by nobody."""
        at = self.where(slots, positions)
        own = (at[:, :, None] == jnp.arange(self.n_slots)) & (at[:, :, None] < self.capacity)
        return past | jnp.any(mask[:, :, :, None] & own[:, None], axis=2)

    def attend_chunk(self, q, k, v, positions, mask, slots, *, past=None, tree: bool = False,
                     impl: str = "xla", window: int | None = None):
        """A chunk's attention -> (out [B, T, N, H], the entry with the chunk written): the
        one path of a prompt, a verification chunk, a tree and a decode step, on every kind.

        q [B, T, N, H], k and v [B, T, K, H] at `positions` (i32[B, T]); `mask` (bool[B, T,
        T]) which chunk tokens each query sees, `slots` where the chunk is written; `past`
        (bool[B, T, S + 1]) overrides which of the entry's slots it sees. The chunk is
        stored, then attended over as stored: a decode step through the kind's decode op
        (`attend`); a quantised kind's every chunk (a prompt sees its own keys as stored,
        as its decode steps and drafts will) and any kind's short chunk that the entry
        holds whole (`holds_chunk`: a window ring, at most margin + 1 tokens) through the
        entry's view. Each query's sums run over its keys in slot order, as stored,
        whatever the chunk's length, so a draft's verification computes every row bit for
        bit as the decode step of that token would: greedy speculation is token-identical
        to plain decoding on every kind. A long chunk on a lossless kind (a prompt), or one
        longer than a ring's margin, attends to the entry as it was and to its own keys,
        which are the values the entry then holds."""
        t = q.shape[1]
        if t == 1 and not tree and past is None:
            kv = self.write(k, v, slots, positions)
            return kv.attend(q[:, 0], positions[:, 0], impl, window)[:, None], kv
        if self.writes_first or (cpu_kernel.attends(t, q.dtype) and self.holds_chunk(t)):
            kv = self.write(k, v, slots, positions)
            if not tree and past is None:
                seen = kv.visible(positions, window)
            else:
                seen = kv.with_chunk(kv.before(positions, window) if past is None else past,
                                     slots, positions, mask)
            return kv.attention(q, seen), kv
        seen = self.before(positions, window) if past is None else past
        out = layers.attention(q, (*self.view(q.dtype), seen),
                               (k.swapaxes(1, 2), v.transpose(0, 2, 3, 1), mask))
        return out, self.write(k, v, slots, positions)

    def attend(self, q, q_pos, impl: str, window: int | None = None):
        """One query per row, q [B, N, H] at q_pos i32[B], over the entry -> [B, N, H]:
        `layers.attention` over the visible slots of its view ("xla", a windowed layer, a
        kind without a kernel), else the kind's Pallas `kernel`, which reads slots
        [0, q_pos] (valid where slot == position: the append kinds)."""
        if impl == "xla" or window is not None or self.kernel is None:
            return self.attention(q[:, None], self.visible(q_pos[:, None], window))[:, 0]
        return self.kernel(q, jnp.where(q_pos >= 0, q_pos + 1, 0))

    def attention(self, q, seen: jax.Array) -> jax.Array:
        """`layers.attention` of q [B, T, N, H] over the slots `seen` (bool[B, T, S + 1])
        shows, of the entry's view; a kind that can read its storage in place overrides it."""
        return layers.attention(q, (*self.view(q.dtype), seen))

    def bytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self))


@partial(jax.tree_util.register_dataclass, data_fields=["k", "v", "pos"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class KVLayer(Slotted):
    """The dense kind: keys and values in the activation dtype."""

    k: jax.Array  # [B, K, S + 1, H]: S usable slots, then the scratch slot
    v: jax.Array  # [B, K, H, S + 1]: slots minor, the layout XLA's CPU dot wants for P @ V
    # (with V stored [.., S, H] it transposed every layer's V on every decode step)
    pos: jax.Array  # i32[B, S + 1]
    SLOT_AXES: ClassVar[dict[str, int]] = {"k": 1, "v": 2}

    @classmethod
    def shapes(cls, batch: int, k_heads: int, head_dim: int, slots: int, dtype):
        return {"k": ((batch, k_heads, slots, head_dim), dtype),
                "v": ((batch, k_heads, head_dim, slots), dtype), "pos": ((batch, slots), np.int32)}

    @classmethod
    def axes(cls):
        return cls(k=("batch", "kv_heads", None, "head_dim"), v=("batch", "kv_heads", "head_dim", None),
                   pos=("batch", None))

    def write(self, k, v, slots, positions):
        """Keys and values [B, T, K, H] at logical `slots`, remembering `positions`."""
        return self.write_fields({"k": k, "v": v}, slots, positions)

    def view(self, dtype):
        return self.k.astype(dtype), self.v.astype(dtype)

    def kernel(self, q, lengths):
        from pallas_kernels.decode_attention import decode_attention
        return decode_attention(q, self.k, self.v, lengths, v_layout="hs", **pallas_run())


@registry.register("dense", summary="keys and values in the activation dtype, a slot per position")
def _dense(cfg, layer, batch, max_len, dtype):
    return None  # every layer keeps the dense entry (`dense.init_cache` lays them out)


def pallas_run() -> dict:
    return dict(implementation="pallas", interpret=jax.default_backend() == "cpu")


@partial(jax.tree_util.register_dataclass, data_fields=["c", "k_rope", "pos"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class LatentLayer(Slotted):
    """The MLA kind: per token one latent and one RoPE key, shared by every head."""

    c: jax.Array  # [B, S + 1, kv_lora_rank]: the normed latent of each token
    k_rope: jax.Array  # [B, S + 1, qk_rope_head_dim]: its rotated key
    pos: jax.Array  # i32[B, S + 1]
    SLOT_AXES: ClassVar[dict[str, int]] = {"c": 0, "k_rope": 0}

    @classmethod
    def shapes(cls, batch: int, rank: int, rope_dim: int, slots: int, dtype):
        return {"c": ((batch, slots, rank), dtype), "k_rope": ((batch, slots, rope_dim), dtype),
                "pos": ((batch, slots), np.int32)}

    @classmethod
    def axes(cls):
        return cls(c=("batch", None, "kv_lora"), k_rope=("batch", None, None), pos=("batch", None))

    def write(self, c, k_rope, slots, positions):
        """Latents [B, T, R] and RoPE keys [B, T, r] at logical `slots`."""
        return self.write_fields({"c": c, "k_rope": k_rope}, slots, positions)


@partial(jax.tree_util.register_dataclass, data_fields=["conv_x", "conv_bc", "ssm"],
         meta_fields=[])
@dataclasses.dataclass(frozen=True)
class StateLayer:
    """The Mamba2 kind: the conv window and the SSM state, the same size at any length."""

    conv_x: jax.Array  # [B, d_conv - 1, n_heads, head_dim]: the last inputs of the causal conv
    conv_bc: jax.Array  # [B, d_conv - 1, 2, n_groups, d_state]: ... of its B, C channels
    ssm: jax.Array  # f32[B, n_heads, head_dim, d_state]
    max_tokens: ClassVar[None] = None

    @classmethod
    def axes(cls):
        return cls(conv_x=("batch", None, "mamba_heads", None),
                   conv_bc=("batch", None, None, "mamba_groups", None),
                   ssm=("batch", "mamba_heads", None, None))

    def with_table(self, table, held=None):
        raise JaxdecError("a Mamba layer keeps a fixed-size state: it has no pages")

    def reset_rows(self, rows: jax.Array):
        clear = lambda x: jnp.where(rows.reshape(-1, *([1] * (x.ndim - 1))), jnp.zeros_like(x), x)
        return jax.tree.map(clear, self)

    def bytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self))
