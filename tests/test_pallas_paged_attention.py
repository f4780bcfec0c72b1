"""pallas_kernels/paged_attention against its float32 reference (highest precision), and
against decode attention's reference on the equivalent dense cache.

The pool is built from a random dense KV: every row's pages are scattered to a random
permutation of the pool's pages, the pool's other pages hold NaN, and the table entries
past a row's used pages name those NaN pages, so the indirection is really exercised and a
kernel that let an unused page into its result would fail. `PagedAttentionCases` holds the
cases; the interpret-mode subclasses run them on any backend (CI, on the CPU) through both
bodies, the GPU (Triton) one and the TPU (Mosaic) one; `TestOnDevice` runs them compiled
where a GPU or TPU backend is present.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_attention import reference as dense_reference
from pallas_kernels.paged_attention import bytes_moved, paged_attention, reference, tpu
from pallas_kernels.lowering import lower

TOL = {jnp.float32: (2e-5, 2e-5), jnp.bfloat16: (2e-2, 2e-2)}
PAGE = 16  # a power of two >= 16 (GPU) and a multiple of 16 (TPU, bf16)
# (group size G, head dim H, pages per block, dtype): every G with every H, the rest mixed
CASES = [(1, 64, 1, jnp.float32), (3, 64, 2, jnp.bfloat16), (7, 64, 4, jnp.bfloat16),
         (1, 128, 4, jnp.bfloat16), (3, 128, 1, jnp.float32), (7, 128, 2, jnp.float32)]


def random_inputs(seed: int, b: int, g: int, kh: int, per_row: int, h: int, dtype, lengths=None,
                  spare: int = 5):
    """Fresh normal q and dense k, v [B, K, S, H] (S = per_row * PAGE), ragged lengths that
    include 0 and S (unless given), and the same cache paged:
    (q, k, v, lengths, k_pages, v_pages, table)."""
    rng = np.random.default_rng(seed)
    s, n_pages = per_row * PAGE, b * per_row + spare
    q = rng.standard_normal((b, kh * g, h))
    k, v = rng.standard_normal((2, b, kh, s, h))
    if lengths is None:
        lengths = np.concatenate([[0, s], rng.integers(1, s, b - 2)]).astype(np.int32)
        rng.shuffle(lengths)
    lengths = np.asarray(lengths, np.int32)
    table = rng.permutation(n_pages)[:b * per_row].reshape(b, per_row).astype(np.int32)
    unused = np.setdiff1d(np.arange(n_pages), table[np.arange(per_row) < -(-lengths[:, None] // PAGE)])
    table = np.where(np.arange(per_row) < -(-lengths[:, None] // PAGE), table,
                     rng.choice(unused, table.shape)).astype(np.int32)

    def pool(x):  # [B, K, S, H] -> [K, P, PAGE, H], unused pages NaN
        pages = np.full((kh, n_pages, PAGE, h), np.nan)
        used = np.arange(per_row)[None, :] < -(-lengths[:, None] // PAGE)
        rows = x.reshape(b, kh, per_row, PAGE, h).transpose(1, 0, 2, 3, 4)
        pages[:, table[used]] = rows[:, used]
        return pages

    cast = lambda x: jnp.asarray(x, dtype)
    return (cast(q), cast(k), cast(v), jnp.asarray(lengths), cast(pool(k)), cast(pool(v)),
            jnp.asarray(table))


class PagedAttentionCases:
    interpret = False
    platform: str | None = None

    def run(self, *args, **kwargs):
        return paged_attention(*args, implementation="pallas", interpret=self.interpret,
                               platform=self.platform, **kwargs)

    @pytest.mark.parametrize("g,h,pages_per_block,dtype", CASES)
    def test_matches_reference(self, g, h, pages_per_block, dtype):
        q, k, v, lengths, k_pages, v_pages, table = random_inputs(g * h, 4, g, 2, 11, h, dtype)
        out, lse = self.run(q, k_pages, v_pages, table, lengths, pages_per_block=pages_per_block,
                            return_lse=True)
        want, want_lse = reference.paged_attention(q, k_pages, v_pages, table, lengths, scale=h ** -0.5)
        dense, dense_lse = dense_reference.decode_attention(q, k, v, lengths, scale=h ** -0.5)
        atol, rtol = TOL[dtype]
        assert out.dtype == q.dtype and out.shape == q.shape
        np.testing.assert_allclose(want, dense, atol=1e-6, rtol=1e-6)
        np.testing.assert_allclose(want_lse, dense_lse, atol=1e-6, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=atol, rtol=rtol)
        np.testing.assert_allclose(lse, want_lse, atol=1e-4, rtol=1e-5)  # -inf where empty
        assert np.all(np.asarray(out)[np.asarray(lengths) == 0] == 0)

    def test_splits_and_short_rows(self):
        """Blocks shared between GPU splits, rows shorter than one block, a block wider than
        the table."""
        q, _, _, lengths, k_pages, v_pages, table = random_inputs(1, 5, 2, 2, 9, 64, jnp.float32)
        want, _ = reference.paged_attention(q, k_pages, v_pages, table, lengths, scale=0.125)
        got = self.run(q, k_pages, v_pages, table, lengths, pages_per_block=2, n_splits=3)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
        q, _, _, short, k_pages, v_pages, table = random_inputs(2, 5, 2, 1, 5, 64, jnp.float32,
                                                                lengths=[0, 1, 16, 17, 20])
        want, _ = reference.paged_attention(q, k_pages, v_pages, table, short, scale=0.125)
        got = self.run(q, k_pages, v_pages, table, short, pages_per_block=8)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


class TestInterpretGPU(PagedAttentionCases):
    interpret, platform = True, "gpu"


class TestInterpretTPU(PagedAttentionCases):
    interpret, platform = True, "tpu"

    def test_pages_per_block_need_not_be_a_power_of_two(self):
        q, _, _, lengths, k_pages, v_pages, table = random_inputs(4, 3, 3, 1, 5, 64, jnp.float32)
        want, _ = reference.paged_attention(q, k_pages, v_pages, table, lengths, scale=0.125)
        got = self.run(q, k_pages, v_pages, table, lengths, pages_per_block=3)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(jax.default_backend() not in ("gpu", "tpu"), reason="needs a GPU or TPU")
class TestOnDevice(PagedAttentionCases):
    pass


@pytest.mark.parametrize("pages_per_block", [1, 3, 4])
def test_tpu_index_maps_follow_only_used_pages(pages_per_block):
    """Every page a TPU input fetches is one the row uses (its first for an empty row), and
    past the row's last block no input changes page: the pipeline fetches nothing new."""
    per_row, page = 10, 16
    lengths = jnp.arange(0, per_row * page + 1, 7, dtype=jnp.int32)
    blocks = -(-per_row // pages_per_block)
    for row, length in enumerate(np.asarray(lengths)):
        used = -(-length // page)
        fetched = np.array([[int(tpu.logical_page(lengths, row, n, t, page, pages_per_block))
                             for t in range(pages_per_block)] for n in range(blocks)])
        assert fetched.max() <= max(used - 1, 0)
        last_block = max(used - 1, 0) // pages_per_block
        assert (fetched[last_block:] == fetched[last_block]).all()
        if last_block > 0:  # in the last block, an input past the last page keeps its page
            over = fetched[last_block - 1] + pages_per_block > max(used - 1, 0)
            assert (fetched[last_block][over] == fetched[last_block - 1][over]).all()
        computed = (np.arange(blocks)[:, None] * pages_per_block + np.arange(pages_per_block)) < used
        assert (fetched[computed] == np.nonzero(computed.reshape(-1))[0]).all()


def test_xla_path_is_the_reference():
    """The XLA path (the kernels' reference) against an independent float64 definition
    over the dense cache the pages were cut from; lengths outside the table are clamped."""
    from numpy_attention import attention_f64, prefix_visible

    q, k, v, lengths, k_pages, v_pages, table = random_inputs(3, 4, 3, 2, 5, 64, jnp.float32)
    want = attention_f64(q, k, v, prefix_visible(lengths, 2, k.shape[2]), 0.125)
    got = paged_attention(q, k_pages, v_pages, table, lengths, implementation="xla")
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
    clamped = paged_attention(q, k_pages, v_pages, table, jnp.asarray([-3, 0, 81, 99], jnp.int32),
                              implementation="xla")
    want, _ = reference.paged_attention(q, k_pages, v_pages, table, jnp.asarray([0, 0, 80, 80]), scale=0.125)
    np.testing.assert_allclose(clamped, want, atol=1e-6)


def test_traced_page_ids_are_clamped_into_the_pool():
    """A traced table is not checked but clamped (in api.py, before either body runs)."""
    q, _, _, lengths, k_pages, v_pages, table = random_inputs(5, 3, 1, 1, 4, 64, jnp.float32)
    k_pages, v_pages = jnp.nan_to_num(k_pages), jnp.nan_to_num(v_pages)  # clamped ids may hit them
    n_pages = k_pages.shape[1]
    bad = table.at[:, 0].set(jnp.asarray([-7, n_pages, 10 ** 6]))
    run = jax.jit(functools.partial(paged_attention, interpret=True, platform="tpu"))
    want, _ = reference.paged_attention(q, k_pages, v_pages, jnp.clip(bad, 0, n_pages - 1), lengths,
                                        scale=0.125)
    np.testing.assert_allclose(run(q, k_pages, v_pages, bad, lengths), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
@pytest.mark.parametrize("page,pages_per_block", [(64, 1), (16, 4)])
def test_lowers_for_the_device(platform, page, pages_per_block):
    """The kernel lowers for cuda (Triton) and tpu (Mosaic) from this CPU machine: rows of
    32k tokens of bf16 with GQA 28/4 and head dim 128, in a pool with a scratch page."""
    sd = jax.ShapeDtypeStruct
    b, kh, h, per_row = 2, 4, 128, 32768 // page
    pool = sd((kh, b * per_row + 1, page, h), jnp.bfloat16)
    args = (sd((b, 7 * kh, h), jnp.bfloat16), pool, pool, sd((b, per_row), jnp.int32), sd((b,), jnp.int32))
    lower(functools.partial(paged_attention, platform=platform, pages_per_block=pages_per_block),
          args, platform)


@pytest.mark.parametrize("change,match", [
    (dict(k_dtype=jnp.int8), "k_pages has dtype int8"),
    (dict(table_dtype=jnp.int16), "page_table has dtype int16"),
    (dict(lengths_dtype=jnp.float32), "lengths has dtype float32"),
    (dict(page_id=(1, 2, 40)), r"row 1 names page 40 \(page_table\[1, 2\]\), outside .* \[0, 40\)"),
    (dict(page_id=(0, 0, -1)), "row 0 names page -1"),
    (dict(h=72), "head_dim=72 must be"),
    (dict(h=96), "head_dim=96 must be a power of two"),
    (dict(page=24), "page_size=24 must be a power of two >= 16 on the GPU"),
    (dict(page=8, platform="tpu", k_dtype=jnp.bfloat16), "page_size=8 must be a multiple of 16"),
    (dict(pages_per_block=3), "pages_per_block=3 must be a power of two on the GPU"),
    (dict(pages_per_block=0, platform="tpu"), "pages_per_block=0 must be >= 1"),
    (dict(heads=5), "5 query heads do not share 2 kv heads"),
    (dict(implementation="triton"), "implementation='triton'"),
])
def test_bad_input_is_a_one_line_error(change, match):
    from conftest import assert_one_line_error

    h, page = change.get("h", 64), change.get("page", 16)
    q = jnp.ones((2, change.get("heads", 4), h), jnp.float32)
    k_pages = jnp.ones((2, 40, page, h), change.get("k_dtype", jnp.float32))
    table = np.arange(8, dtype=change.get("table_dtype", np.int32)).reshape(2, 4)
    if "page_id" in change:
        row, col, page_id = change["page_id"]
        table[row, col] = page_id
    lengths = jnp.full((2,), 3 * page, change.get("lengths_dtype", jnp.int32))
    assert_one_line_error(paged_attention, q, k_pages, k_pages, jnp.asarray(table), lengths, match=match,
                          interpret=True, platform=change.get("platform", "gpu"),
                          pages_per_block=change.get("pages_per_block", 1),
                          implementation=change.get("implementation", "pallas"))


def test_unused_table_entries_may_hold_anything():
    """Only the entries a row uses are checked (lengths concrete); past them anything goes."""
    q, _, _, _, k_pages, v_pages, table = random_inputs(6, 2, 1, 1, 4, 64, jnp.float32)
    lengths = jnp.asarray([16, 0], jnp.int32)
    loose = table.at[0, 1:].set(-1).at[1].set(10 ** 6)
    want, _ = reference.paged_attention(q, k_pages, v_pages, table, lengths, scale=0.125)
    got = paged_attention(q, k_pages, v_pages, loose, lengths, interpret=True, platform="tpu")
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_on_cpu_without_interpret_is_refused():
    from conftest import assert_one_line_error

    q, _, _, lengths, k_pages, v_pages, table = random_inputs(0, 2, 1, 1, 2, 64, jnp.float32)
    assert_one_line_error(paged_attention, q, k_pages, v_pages, table, lengths, match="interpret=True")


def test_bytes_moved_counts_used_pages():
    q = jax.ShapeDtypeStruct((2, 28, 128), jnp.bfloat16)
    k_pages = jax.ShapeDtypeStruct((4, 100, 64, 128), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    moved = bytes_moved(q, k_pages, table, np.array([0, 65]))  # 0 and 2 pages
    assert moved.read == 2 * 28 * 128 * 2 + 2 * 2 * 4 * 64 * 128 * 2 + 2 * 4 + 2 * 4
    assert moved.written == 2 * 28 * 128 * 2
    capped = bytes_moved(q, k_pages, table, np.array([10 ** 6, -5]))  # clamped to 8 and 0 pages
    assert capped.read == 2 * 28 * 128 * 2 + 2 * 8 * 4 * 64 * 128 * 2 + 8 * 4 + 2 * 4
