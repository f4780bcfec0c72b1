"""The machine's ceiling for a decode step: its streaming-read bandwidth as XLA sees it,
and the bytes a step must read. `jaxdec bench` (its report) and the jaxdec peer (its
interleaved ceiling pairs) share them."""

from __future__ import annotations

import time


def bandwidth_probe(mib: int = 256):
    """-> measure(repeats): the streaming-read bandwidth of this machine as XLA sees it, in
    GB/s: a float32 matrix-vector product over a `mib` MiB matrix stored (K, N), the best of
    `repeats` (the ceiling: a busy moment only lowers it). The matrix is made and the product
    compiled once, so the probe can be taken again between other measurements."""
    import jax
    import jax.numpy as jnp

    k = 4096
    n = mib * 2**20 // (4 * k)
    w = jax.random.normal(jax.random.key(0), (k, n), jnp.float32)
    x = jax.random.normal(jax.random.key(1), (1, k), jnp.float32)
    f = jax.jit(lambda x, w: x @ w)
    f(x, w).block_until_ready()

    def measure(repeats: int = 15) -> float:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            f(x, w).block_until_ready()
            times.append(time.perf_counter() - t)
        return w.nbytes / min(times) / 1e9

    return measure


def bandwidth_gbs(mib: int = 256, repeats: int = 15) -> float:
    """`bandwidth_probe(mib)` taken once."""
    return bandwidth_probe(mib)(repeats)


def step_bytes(model, batch: int, context: int) -> float:
    """Bytes one decode step must read: the matmul weights once (stored size, so a
    quantised model's codes and scales), and each row's K and V at `context` tokens."""
    import jax

    from jaxdec.cache import dense

    p = model.params
    matrices = [p.lm_head] + [(layer.mixer, layer.ffn) for layer in p.layers]
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(matrices))
    grow, fixed = dense.bytes_per_token(model.cfg, p.final_norm.dtype)  # the cache dtype
    return float(weights + batch * (grow * context + fixed))
