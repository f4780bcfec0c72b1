"""The decode-attention CPU kernel (cpu_kernel.attention) against a float64 NumPy reference of
the definition: one softmax over the visible keys of every block."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdec import layers
from jaxdec.ops import cpu_kernel as ck

pytestmark = pytest.mark.skipif(not ck.available(), reason=f"CPU kernel unavailable: {ck.reason()}")


def reference(q, blocks) -> np.ndarray:
    """float64 [B, T, N, H]; a query that sees no key gets zeros (the kernel's convention)."""
    q = np.asarray(q, np.float64)
    b, t, n, h = q.shape
    kv = blocks[0][0].shape[1]
    g = n // kv
    k = np.concatenate([np.asarray(k, np.float32).astype(np.float64) for k, _, _ in blocks], axis=2)
    v = np.concatenate([np.asarray(v, np.float32).astype(np.float64) for _, v, _ in blocks], axis=3)
    mask = np.concatenate([np.asarray(m) for _, _, m in blocks], axis=2)  # [B, T, S]
    out = np.zeros_like(q)
    for bi in range(b):
        for ti in range(t):
            seen = mask[bi, ti]
            if not seen.any():
                continue
            for ni in range(n):
                kh = ni // g
                s = k[bi, kh][seen] @ q[bi, ti, ni] / math.sqrt(h)
                p = np.exp(s - s.max())
                out[bi, ti, ni] = (v[bi, kh][:, seen] @ p) / p.sum()
    return out


def make(B, T, N, Kh, H, S, dtype, seed, *, p_visible=0.6):
    """A cache block (random visibility, row 0's first query sees none of it) and the chunk's
    own keys under a causal mask."""
    rng = np.random.default_rng(seed)
    cast = lambda a: jnp.asarray(a.astype(np.float32), dtype)
    q = rng.standard_normal((B, T, N, H)).astype(np.float32)
    cache = (cast(rng.standard_normal((B, Kh, S, H))), cast(rng.standard_normal((B, Kh, H, S))),
             jnp.asarray(rng.random((B, T, S)) < p_visible).at[0, 0].set(False))
    chunk = (cast(rng.standard_normal((B, Kh, T, H))), cast(rng.standard_normal((B, Kh, H, T))),
             jnp.asarray(np.broadcast_to(np.tril(np.ones((T, T), bool)), (B, T, T))))
    return jnp.asarray(q), (cache, chunk)


def run(q, blocks, impl="auto"):
    f = jax.jit(lambda q, blocks: ck.attention(q, blocks, scale=1 / math.sqrt(q.shape[-1]),
                                                xla=layers.attention_reference, impl=impl))
    return np.asarray(f(q, blocks))


# Decode (T = 1) at SmolLM2's and Qwen2.5-0.5B's head layouts, a verify chunk, a head dim that
# is not a multiple of 16, MHA, and T at the kernel's limit.
SHAPES = [(2, 1, 9, 3, 64, 37), (2, 1, 14, 2, 64, 130), (3, 4, 8, 2, 40, 70), (1, 1, 4, 4, 16, 5),
          (2, ck.MAX_ATTENTION_T, 6, 1, 24, 50)]


@pytest.mark.parametrize("impl", ["auto", "scalar", "avx2"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(shape, dtype, impl):
    q, blocks = make(*shape, dtype, seed=sum(shape))
    out = run(q, blocks, impl)
    np.testing.assert_allclose(out, reference(q, blocks), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("impl", ["auto", "scalar", "avx2"])
def test_query_that_sees_nothing_gets_zeros(impl):
    """A padding row (no visible key in any block) comes out as zeros, finite."""
    q, (cache, chunk) = make(2, 1, 6, 3, 32, 20, jnp.float32, seed=13)
    chunk = (chunk[0], chunk[1], chunk[2].at[1].set(False))
    cache = (cache[0], cache[1], cache[2].at[1].set(False))
    out = run(q, (cache, chunk), impl)
    assert np.all(out[1] == 0) and np.all(np.abs(out[0]) > 0)


def test_single_block_and_three_blocks():
    """Any number of blocks shares one softmax."""
    q, (cache, chunk) = make(2, 2, 6, 3, 32, 20, jnp.float32, seed=7)
    np.testing.assert_allclose(run(q, (cache,)), reference(q, (cache,)), rtol=2e-5, atol=2e-5)
    three = (cache, cache, chunk)
    np.testing.assert_allclose(run(q, three), reference(q, three), rtol=2e-5, atol=2e-5)


def test_agrees_with_xla_reference_where_every_query_sees_a_key():
    q, blocks = make(3, 1, 9, 3, 64, 65, jnp.float32, seed=8, p_visible=1.0)
    ours = run(q, blocks)
    xla = np.asarray(jax.jit(layers.attention_reference)(q, *blocks))
    np.testing.assert_allclose(ours, xla, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["auto", "avx2"])
def test_thread_independence(impl):
    """Work items (sequence, kv head) never depend on the split: bit-identical results."""
    q, blocks = make(8, 1, 9, 3, 64, 300, jnp.float32, seed=9)
    y_all = run(q, blocks, impl)
    try:
        ck.set_threads(1)
        y_one = run(q, blocks, impl)
    finally:
        ck.set_threads(0)
    np.testing.assert_array_equal(y_all, y_one)


def _calls(text: str) -> int:
    return text.count(ck.ATTENTION_TARGET)


def test_long_chunks_use_xla():
    """Prefill-sized chunks (T > MAX_ATTENTION_T) stay on XLA's dots."""
    q, blocks = make(1, ck.MAX_ATTENTION_T + 1, 4, 2, 16, 8, jnp.float32, seed=10)
    f = jax.jit(lambda q, b: layers.attention(q, *b))
    assert _calls(f.lower(q, blocks).as_text()) == 0
    q, blocks = make(1, 1, 4, 2, 16, 8, jnp.float32, seed=10)
    assert _calls(f.lower(q, blocks).as_text()) == 1


def test_portable_lowering(monkeypatch):
    """PORTABLE: the CPU program calls the kernel, a CUDA export has only XLA ops."""
    monkeypatch.setattr(ck, "PORTABLE", True)
    q, blocks = make(2, 1, 4, 2, 16, 8, jnp.float32, seed=11)
    f = jax.jit(lambda q, b: layers.attention(q, *b))
    assert _calls(f.lower(q, blocks).compile().as_text()) >= 1
    text = jax.export.export(f, platforms=["cuda"])(q, blocks).mlir_module()
    assert ck.ATTENTION_TARGET not in text


def test_bad_blocks():
    q, (cache, chunk) = make(2, 1, 6, 3, 16, 8, jnp.float32, seed=12)
    k, v, m = cache
    f = jax.jit(lambda q, b: ck._attention_ffi(q, *[a for blk in b for a in blk], scale=1.0,
                                               impl=0))
    with pytest.raises(Exception, match="block shapes"):
        f(q, ((k[:, :, :, :8], v, m),))
    with pytest.raises(Exception, match="float32 or bfloat16"):
        f(q, ((k, v.astype(jnp.bfloat16), m),))


# ---- the paged kernel (cpu_kernel.paged_attention): a page pool read through page tables ----

def make_paged(B, T, N, Kh, H, width, ps, dtype, seed):
    """Pools [Kh, pages, ps, H] whose pages nobody sees hold NaN, shuffled tables (rows 0 and
    1 share their first page), causal-ish masks with holes, and the dense view of the same."""
    rng = np.random.default_rng(seed)
    pages = B * width + 3
    k = rng.standard_normal((Kh, pages, ps, H)).astype(np.float32)
    v = rng.standard_normal((Kh, pages, ps, H)).astype(np.float32)
    table = rng.permutation(pages)[:B * width].reshape(B, width).astype(np.int32)
    table[1, 0] = table[0, 0]
    lengths = rng.integers(1, width * ps + 1, size=B)
    slots = np.arange(width * ps)
    mask = (slots[None, None] < lengths[:, None, None]) & (rng.random((B, T, width * ps)) < 0.9)
    mask[0, 0] = False  # a query that sees nothing
    seen = np.zeros((pages, ps), bool)
    for b in range(B):
        for s in np.flatnonzero(mask[b].any(0)):
            seen[table[b, s // ps], s % ps] = True
    k[:, ~seen], v[:, ~seen] = np.nan, np.nan
    dense_k = k[:, table].reshape(Kh, B, width * ps, H).transpose(1, 0, 2, 3)
    dense_v = v[:, table].reshape(Kh, B, width * ps, H).transpose(1, 0, 3, 2)
    cast = lambda a: jnp.asarray(a, dtype)
    dense = (cast(np.nan_to_num(dense_k)), cast(np.nan_to_num(dense_v)), jnp.asarray(mask))
    q = jnp.asarray(rng.standard_normal((B, T, N, H)).astype(np.float32))
    return q, (cast(k), cast(v), jnp.asarray(table), jnp.asarray(mask)), dense


def run_paged(q, paged, impl="auto"):
    f = jax.jit(lambda q, k, v, t, m: ck.paged_attention(q, k, v, t, m, scale=1 / math.sqrt(q.shape[-1]),
                                                         xla=None, impl=impl))
    return np.asarray(f(q, *paged))


@pytest.mark.parametrize("impl", ["auto", "scalar", "avx2"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(3, 1, 9, 3, 64, 4, 32), (2, 3, 14, 2, 64, 3, 16), (2, 2, 4, 2, 24, 5, 8)])
def test_paged_is_the_dense_kernel_bit_for_bit(shape, dtype, impl):
    """Over the same slots, the paged kernel computes what the dense kernel does on the
    gathered view, to the bit, and never reads a slot no query sees (NaN there)."""
    q, paged, dense = make_paged(*shape, dtype, seed=sum(shape))
    out = run_paged(q, paged, impl)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out, run(q, (dense,), impl))
    np.testing.assert_allclose(out, reference(q, (dense,)), rtol=2e-5, atol=2e-5)


def test_paged_bad_table():
    q, (k, v, table, mask), _ = make_paged(2, 1, 4, 2, 16, 2, 8, jnp.float32, seed=3)
    with pytest.raises(Exception, match="page index is out of range"):
        run_paged(q, (k, v, table.at[1, 1].set(k.shape[1]), mask))
