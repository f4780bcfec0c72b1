"""pallas_kernels/sparse_attention against its float32 reference (highest precision).

`BlockSparseCases` holds the kernel cases; the interpret-mode subclasses run them on any
backend (CI, on the CPU) through both bodies, the GPU (Triton) one and the TPU (Mosaic)
one; `TestOnDevice` runs them compiled where a GPU or TPU backend is present. The mask
helpers and Quest's page selection are checked by hand and against float64 NumPy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_attention import reference as dense
from pallas_kernels.lowering import lower
from pallas_kernels.sparse_attention import (
    block_sparse_attention, blocks_from_mask, bytes_moved, page_bounds, page_scores,
    quest_attention, quest_select, reference, sink_local_mask, update_bounds)

TOL = {jnp.float32: (2e-5, 2e-5), jnp.bfloat16: (2e-2, 2e-2)}
# (group size G, head dim H, V layout, dtype): every G with every H, layouts and dtypes mixed
CASES = [(1, 64, "sh", jnp.float32), (3, 64, "hs", jnp.bfloat16), (7, 64, "sh", jnp.bfloat16),
         (1, 128, "hs", jnp.float32), (3, 128, "sh", jnp.float32), (7, 128, "hs", jnp.bfloat16)]
GARBAGE = 10 ** 6  # what list entries past n_kept hold: never read
# the references, jitted: one compile per shape instead of one per op
sparse_reference = jax.jit(reference.block_sparse_attention, static_argnames=("scale", "block_k", "v_layout"))
dense_reference = jax.jit(dense.decode_attention, static_argnames=("scale", "v_layout"))


def random_inputs(seed: int, b: int, g: int, kh: int, s: int, h: int, v_layout: str, dtype):
    """Fresh normal q, k, v and ragged lengths that include 0 and the capacity S."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, kh * g, h))
    k = rng.standard_normal((b, kh, s, h))
    v = rng.standard_normal((b, kh, s, h) if v_layout == "sh" else (b, kh, h, s))
    lengths = np.concatenate([[0, s], rng.integers(1, s, b - 2)]).astype(np.int32)
    rng.shuffle(lengths)
    cast = lambda x: jnp.asarray(x, dtype)
    return cast(q), cast(k), cast(v), jnp.asarray(lengths)


def random_lists(seed: int, b: int, kh: int, n_blocks: int):
    """Kept lists: random subsets of the blocks in random order, n_kept from 0 to all of
    them (both present), garbage past n_kept."""
    rng = np.random.default_rng(seed)
    kept = np.stack([rng.permutation(n_blocks) for _ in range(b * kh)]).reshape(b, kh, n_blocks)
    n_kept = rng.integers(0, n_blocks + 1, (b, kh))
    n_kept.flat[0], n_kept.flat[-1] = 0, n_blocks
    kept = np.where(np.arange(n_blocks) < n_kept[..., None], kept, GARBAGE)
    return jnp.asarray(kept, jnp.int32), jnp.asarray(n_kept, jnp.int32)


def check_close(out, lse, want, want_lse, dtype):
    atol, rtol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=atol, rtol=rtol)
    np.testing.assert_allclose(lse, want_lse, atol=1e-4, rtol=1e-5)  # -inf where nothing seen


class BlockSparseCases:
    interpret = False
    platform: str | None = None

    def run(self, fn, *args, **kwargs):
        return fn(*args, implementation="pallas", interpret=self.interpret, platform=self.platform,
                  **kwargs)

    @pytest.mark.parametrize("g,h,v_layout,dtype", CASES)
    def test_matches_reference(self, g, h, v_layout, dtype):
        s = 392  # three full key blocks and a partial one
        q, k, v, lengths = random_inputs(g * h, 3, g, 2, s, h, v_layout, dtype)
        kept, n_kept = random_lists(g + h, 3, 2, 4)
        out, lse = self.run(block_sparse_attention, q, k, v, lengths, kept, n_kept,
                            v_layout=v_layout, return_lse=True)
        want, want_lse = sparse_reference(
            q, k, v, lengths, jnp.minimum(kept, 3), n_kept, scale=h ** -0.5, block_k=128,
            v_layout=v_layout)
        assert out.dtype == q.dtype and out.shape == q.shape
        check_close(out, lse, want, want_lse, dtype)
        assert np.all(np.asarray(lse)[0, :g] == -np.inf)  # n_kept[0, 0] == 0

    def test_all_blocks_is_dense_attention(self):
        """Every block kept, in shuffled order: dense decode attention."""
        q, k, v, lengths = random_inputs(5, 3, 3, 2, 300, 64, "sh", jnp.float32)
        kept = jnp.asarray(np.random.default_rng(6).permuted(np.tile(np.arange(3), (3, 2, 1)), axis=2),
                           jnp.int32)
        out, lse = self.run(block_sparse_attention, q, k, v, lengths, kept,
                            jnp.full((3, 2), 3, jnp.int32), return_lse=True)
        check_close(out, lse, *dense_reference(q, k, v, lengths, scale=0.125), jnp.float32)

    def test_shared_lists_short_cache_and_splits(self):
        """Lists shared by every row ([K, M]), a cache shorter than one block (padded), and a
        long list shared between GPU splits."""
        q, k, v, lengths = random_inputs(7, 3, 2, 2, 40, 64, "hs", jnp.float32)
        kept, n_kept = jnp.zeros((2, 1), jnp.int32), jnp.asarray([1, 0], jnp.int32)
        want, _ = sparse_reference(q, k, v, lengths, jnp.broadcast_to(kept, (3, 2, 1)),
                                                   jnp.broadcast_to(n_kept, (3, 2)), scale=0.125,
                                                   block_k=128, v_layout="hs")
        out = self.run(block_sparse_attention, q, k, v, lengths, kept, n_kept, v_layout="hs")
        np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
        q, k, v, lengths = random_inputs(8, 3, 1, 1, 512, 64, "sh", jnp.float32)
        kept, n_kept = random_lists(9, 3, 1, 4)
        want, _ = sparse_reference(q, k, v, lengths, jnp.minimum(kept, 3), n_kept,
                                                   scale=0.125, block_k=128)
        out = self.run(block_sparse_attention, q, k, v, lengths, kept, n_kept, n_splits=3)
        np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)

    def test_quest_attention(self):
        """top_k >= n_pages is dense attention; a smaller top_k attends to quest_select's pages."""
        q, k, v, lengths = random_inputs(10, 3, 3, 2, 300, 64, "sh", jnp.bfloat16)
        kmin, kmax = page_bounds(k, lengths, 128)
        out = self.run(quest_attention, q, k, v, lengths, kmin, kmax, top_k=4, page_size=128)
        want, _ = dense_reference(q, k, v, lengths, scale=0.125)
        np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=2e-2, rtol=2e-2)
        out = self.run(quest_attention, q, k, v, lengths, kmin, kmax, top_k=1, page_size=128)
        kept, n_kept = quest_select(q, kmin, kmax, lengths, 1, 128)
        want, _ = sparse_reference(q, k, v, lengths, kept, n_kept, scale=0.125,
                                                   block_k=128)
        np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=2e-2, rtol=2e-2)


class TestInterpretGPU(BlockSparseCases):
    interpret, platform = True, "gpu"


class TestInterpretTPU(BlockSparseCases):
    interpret, platform = True, "tpu"


@pytest.mark.skipif(jax.default_backend() not in ("gpu", "tpu"), reason="needs a GPU or TPU")
class TestOnDevice(BlockSparseCases):
    pass


def test_xla_path_is_the_reference():
    q, k, v, lengths = random_inputs(3, 4, 3, 2, 50, 64, "hs", jnp.float32)
    kept, n_kept = random_lists(4, 4, 2, 4)
    from numpy_attention import attention_f64, prefix_visible

    kept_np, n_np = np.minimum(np.asarray(kept), 3), np.asarray(n_kept)
    visible = prefix_visible(lengths, 2, 50).copy()
    for b, j in np.ndindex(n_np.shape):  # only the listed blocks of 16 slots
        listed = np.zeros(50, bool)
        for block in kept_np[b, j, :n_np[b, j]]:
            listed[block * 16:(block + 1) * 16] = True
        visible[b, j] &= listed
    want = attention_f64(q, k, v, visible, 0.125, "hs")
    got = block_sparse_attention(q, k, v, lengths, kept, n_kept, block_k=16, implementation="xla",
                                 v_layout="hs")
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


def test_traced_lists_are_clamped():
    """Under jit the lists cannot be checked: ids and n_kept are clamped into range."""
    q, k, v, lengths = random_inputs(11, 2, 1, 1, 256, 64, "sh", jnp.float32)
    kept, n_kept = jnp.asarray([[[7, -3]], [[-1, 1]]], jnp.int32), jnp.asarray([[5], [1]], jnp.int32)
    run = jax.jit(functools.partial(block_sparse_attention, interpret=True, platform="tpu"))
    want, _ = sparse_reference(q, k, v, lengths, jnp.asarray([[[1, 0]], [[0, 1]]]),
                                               jnp.asarray([[2], [1]]), scale=0.125, block_k=128)
    np.testing.assert_allclose(run(q, k, v, lengths, kept, n_kept), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
@pytest.mark.parametrize("v_layout", ["sh", "hs"])
def test_lowers_for_the_device(platform, v_layout):
    """The kernel lowers for cuda (Triton) and tpu (Mosaic) from this CPU machine: a 32k
    cache of bf16 with GQA 28/4, head dim 128, 32 kept blocks of 256; and Quest on it."""
    sd = jax.ShapeDtypeStruct
    b, kh, s, h = 2, 4, 32768, 128
    q, k = sd((b, 7 * kh, h), jnp.bfloat16), sd((b, kh, s, h), jnp.bfloat16)
    v = sd((b, kh, s, h) if v_layout == "sh" else (b, kh, h, s), jnp.bfloat16)
    lists = (sd((b, kh, 32), jnp.int32), sd((b, kh), jnp.int32))
    lower(functools.partial(block_sparse_attention, platform=platform, v_layout=v_layout),
          (q, k, v, sd((b,), jnp.int32)) + lists, platform)
    bounds = sd((b, kh, s // 128, h), jnp.float32)
    lower(functools.partial(quest_attention, platform=platform, v_layout=v_layout, top_k=32,
                            page_size=128), (q, k, v, sd((b,), jnp.int32), bounds, bounds), platform)


@pytest.mark.parametrize("change,match", [
    (dict(k_dtype=jnp.int8), "k has dtype int8"),
    (dict(kept_dtype=jnp.float32), "kept has dtype float32"),
    (dict(kept=[[[0, 1], [1, 2]], [[1, 0], [GARBAGE, -1]]]),
     r"kept\[0, 1, 1\]=2 \(row 0, kv head 1\) is not a block id in \[0, 2\)"),
    (dict(n_kept=[[1, 3], [0, 0]]), r"n_kept\[0, 1\]=3 is outside \[0, 2\]"),
    (dict(kept_shape=(2, 3, 2)), r"kept has shape \(2, 3, 2\), expected \(2, 2, 2\)"),
    (dict(h=72), "head_dim=72 must be"),
    (dict(block_k=96), "block_k=96 must be"),
    (dict(block_k=0), "block_k=0 must be positive"),
    (dict(implementation="triton"), "implementation='triton'"),
])
def test_bad_input_is_a_one_line_error(change, match):
    from conftest import assert_one_line_error

    h = change.get("h", 64)
    q = jnp.ones((2, 4, h), jnp.float32)
    k = jnp.ones((2, 2, 256, h), change.get("k_dtype", jnp.float32))
    kept = np.asarray(change.get("kept", [[[0, 1], [1, 0]], [[1, 0], [GARBAGE, -1]]]))
    kept = np.zeros(change["kept_shape"]) if "kept_shape" in change else kept
    n_kept = np.asarray(change.get("n_kept", [[1, 2], [2, 0]]), np.int32)
    assert_one_line_error(block_sparse_attention, q, k, k, jnp.ones((2,), jnp.int32),
                          kept.astype(change.get("kept_dtype", np.int32)), n_kept, match=match,
                          interpret=True, platform="gpu", block_k=change.get("block_k", 128),
                          implementation=change.get("implementation", "pallas"))


@pytest.mark.parametrize("change,match", [
    (dict(top_k=0), "top_k=0 must be at least 1"),
    (dict(page_size=64), r"kmin has shape \(1, 1, 2, 64\), expected \(1, 1, 4, 64\)"),
])
def test_bad_quest_input_is_a_one_line_error(change, match):
    from conftest import assert_one_line_error

    q, k, v, lengths = random_inputs(0, 2, 1, 1, 256, 64, "sh", jnp.float32)
    kmin, kmax = page_bounds(k[:1], lengths[:1], 128)
    args = (q[:1], k[:1], v[:1], lengths[:1], kmin, kmax)
    assert_one_line_error(quest_attention, *args, match=match, implementation="xla",
                          top_k=change.get("top_k", 1), page_size=change.get("page_size", 128))


def test_on_cpu_without_interpret_is_refused():
    from conftest import assert_one_line_error

    q, k, v, lengths = random_inputs(0, 2, 1, 1, 64, 64, "sh", jnp.float32)
    kept, n_kept = random_lists(0, 2, 1, 1)
    assert_one_line_error(block_sparse_attention, q, k, v, lengths, kept, n_kept, match="interpret=True")


def test_bytes_moved_counts_kept_blocks():
    """S = 1000: blocks 0..6 hold 128 slots, block 7 holds 104; entries past n_kept and
    unlisted blocks do not count."""
    k = jax.ShapeDtypeStruct((2, 4, 1000, 128), jnp.bfloat16)
    q = jax.ShapeDtypeStruct((2, 28, 128), jnp.bfloat16)
    kept = np.zeros((2, 4, 3), np.int32)
    kept[0, 0], kept[1, 2] = [7, 2, 5], [3, 0, 0]
    n_kept = np.zeros((2, 4), np.int32)
    n_kept[0, 0], n_kept[1, 2] = 3, 1
    moved = bytes_moved(q, k, kept, n_kept, block_k=128)
    slots = 104 + 128 + 128 + 128
    assert moved.read == 2 * 28 * 128 * 2 + 2 * slots * 128 * 2 + 4 * (24 + 8 + 2)
    assert moved.written == 2 * 28 * 128 * 2


def test_blocks_from_mask():
    mask = np.array([[[True, False, True, True], [False] * 4],
                     [[False, True, False, False], [True, True, False, True]]])
    kept, n_kept = blocks_from_mask(mask)
    assert isinstance(kept, np.ndarray) and kept.shape == (2, 2, 3)
    np.testing.assert_array_equal(n_kept, [[3, 0], [1, 3]])
    for got in (kept, np.asarray(jax.jit(blocks_from_mask)(jnp.asarray(mask))[0])):
        np.testing.assert_array_equal(got[0, 0, :3], [0, 2, 3])
        np.testing.assert_array_equal(got[1, 0, :1], [1])
        np.testing.assert_array_equal(got[1, 1, :3], [0, 1, 3])
    kept, n_kept = blocks_from_mask(mask[0])  # [K, n_blocks]: lists shared by every row
    assert kept.shape == (2, 3) and list(n_kept) == [3, 0]


def test_sink_local_mask_by_hand():
    """6 blocks of 16 slots, 1 sink block, 2 local: lengths 0, 10, 40, 96 use 0, 1, 3, 6
    blocks and keep nothing, block 0, blocks 0 1 2, blocks 0 4 5."""
    lengths = np.array([0, 10, 40, 96])
    kept, n_kept = blocks_from_mask(sink_local_mask(6, 1, 2, lengths, block_k=16, kv_heads=2))
    assert kept.shape == (4, 2, 3)
    np.testing.assert_array_equal(n_kept, [[0, 0], [1, 1], [3, 3], [3, 3]])
    np.testing.assert_array_equal(kept[1:, 0], [[0, 1, 2], [0, 1, 2], [0, 4, 5]])
    kept_j, n_kept_j = jax.jit(lambda n: blocks_from_mask(
        sink_local_mask(6, 1, 2, n, block_k=16, kv_heads=2)))(jnp.asarray(lengths, jnp.int32))
    assert kept_j.shape == (4, 2, 6)
    np.testing.assert_array_equal(n_kept_j, n_kept)
    np.testing.assert_array_equal(kept_j[:, :, :3], kept)


def quest_inputs(seed: int, b=4, kh=2, g=3, s=200, h=32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, kh * g, h)).astype(np.float32)
    k = rng.standard_normal((b, kh, s, h)).astype(np.float32)
    lengths = np.concatenate([[0, s, 1], rng.integers(2, s, b - 3)]).astype(np.int32)
    return q, k, lengths


def numpy_quest(q, k, lengths, page_size: int):
    """Float64 Quest by the definition: bounds over each page's written tokens, the bound
    sum_h max(q_h kmin_h, q_h kmax_h) per query head, maxed over the group."""
    b, kh, s, h = k.shape
    n_pages = -(-s // page_size)
    kmin = np.full((b, kh, n_pages, h), np.inf)
    kmax = np.full((b, kh, n_pages, h), -np.inf)
    scores = np.full((b, kh, n_pages), -np.inf)
    qg = q.astype(np.float64).reshape(b, kh, -1, h)
    for i in range(b):
        for p in range(-(-lengths[i] // page_size)):
            page = k[i, :, p * page_size:min((p + 1) * page_size, lengths[i])].astype(np.float64)
            kmin[i, :, p], kmax[i, :, p] = page.min(axis=1), page.max(axis=1)
            bound = np.maximum(qg[i] * kmin[i, :, p, None], qg[i] * kmax[i, :, p, None]).sum(-1)
            scores[i, :, p] = bound.max(axis=-1)
    return kmin, kmax, scores


def test_quest_selection_matches_float64_numpy():
    page_size, top_k = 16, 4
    q, k, lengths = quest_inputs(12)
    kmin, kmax = page_bounds(jnp.asarray(k), jnp.asarray(lengths), page_size)
    want_min, want_max, want_scores = numpy_quest(q, k, lengths, page_size)
    np.testing.assert_array_equal(kmin, want_min)
    np.testing.assert_array_equal(kmax, want_max)
    scores = np.asarray(page_scores(jnp.asarray(q), kmin, kmax, jnp.asarray(lengths), page_size))
    used = -(-lengths // page_size)
    last = np.broadcast_to(np.arange(scores.shape[-1]) == (used - 1)[:, None, None], scores.shape)
    np.testing.assert_allclose(np.where(last, 0, scores), np.where(last, 0, want_scores),
                               rtol=1e-5, atol=1e-4)
    assert np.all(scores[last] == np.inf)
    kept, n_kept = quest_select(jnp.asarray(q), kmin, kmax, jnp.asarray(lengths), top_k, page_size)
    np.testing.assert_array_equal(n_kept, np.minimum(top_k, used)[:, None] + np.zeros((1, 2), int))
    for (i, j), n in np.ndenumerate(np.asarray(n_kept)):
        chosen = set(np.asarray(kept)[i, j, :n].tolist())
        assert n == 0 or used[i] - 1 in chosen  # the page of the last token, always
        ranked = np.where(last[i, j], np.inf, want_scores[i, j])
        rest = [p for p in range(used[i]) if p not in chosen]
        if rest:  # every chosen page scores at least as high as every other (to f32 noise)
            assert min(ranked[list(chosen)]) >= max(ranked[rest]) - 1e-4


def test_update_bounds_streams_tokens():
    """Bounds of L tokens updated with token L equal the bounds of L + 1 tokens; a negative
    or past-the-end position writes nothing."""
    page_size = 16
    _, k, lengths = quest_inputs(13, s=64)
    k, lengths = jnp.asarray(k), jnp.asarray(lengths)
    kmin, kmax = page_bounds(k, lengths, page_size)
    positions = lengths.at[0].set(-1)  # row 0 writes nothing; row 1 is full (position S)
    k_new = k[jnp.arange(4), :, jnp.minimum(positions, 63)]  # [B, K, H]
    got = update_bounds(kmin, kmax, k_new, positions, page_size=page_size)
    want = page_bounds(k, jnp.where(positions < 0, lengths, lengths + 1), page_size)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
