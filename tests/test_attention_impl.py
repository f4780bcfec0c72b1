"""The attention implementation and KV cache kind chosen per config, on SmolLM2.

`jaxdec.load(src, attention_impl=..., kv_cache=...)` and the CLI's `--attention-impl` /
`--kv-cache`: generating through the Pallas kernels (interpret mode on the CPU) gives the
same greedy tokens as the XLA path over the dense and paged caches (and the paged cache,
lossless, the dense cache's); over the quantised caches the kernels equal the XLA path on
the same cache state, and generations agree on most tokens.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import assert_one_line_error, jax_model

from jaxdec import api, decode
from jaxdec.cache import dense, paged

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
NEW = 10


@pytest.fixture(scope="module")
def dense_xla():
    return api.generate(jax_model("smollm2"), PROMPTS, max_new_tokens=NEW).token_ids


@pytest.mark.parametrize("kind", ["paged", pytest.param("dense", marks=pytest.mark.slow)])
def test_pallas_path_gives_the_xla_tokens(kind, dense_xla):
    """Unquantised caches: the Pallas decode steps give exactly the XLA path's tokens, and
    the paged cache the dense cache's."""
    model = jax_model("smollm2")
    xla = api.generate(api.with_attention(model, "xla", kind), PROMPTS, max_new_tokens=NEW).token_ids
    pallas = api.generate(api.with_attention(model, "pallas", kind), PROMPTS, max_new_tokens=NEW).token_ids
    assert pallas == xla == dense_xla


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_cache_pallas_matches_xla(kind):
    """Quantised caches: over the same cache state, a decode step's attention through the
    kernel equals the XLA path's (float32 summation order apart). Whole generations
    agree on most tokens, not all: a 1-ulp difference in a key computed upstream (a different
    summation order, or XLA fusing the two programs differently) moves a code across a
    rounding boundary, which changes the logits by ~1e-2, and an int4 near tie can flip."""
    import jax.numpy as jnp

    model = api.with_attention(jax_model("smollm2"), "xla", kind)
    rows = api.encode_prompts(model, PROMPTS, chat=False)
    tokens, lens = api.pad_rows(rows, 8)
    cache = api.init_cache(model, len(rows), 64)
    _, cache = decode.prefill(model.params, cache, jnp.asarray(tokens), jnp.asarray(lens), model.cfg)
    q = jnp.asarray(np.random.default_rng(0).standard_normal((3, model.cfg.n_heads, 64)), jnp.float32)
    for entry in cache.layers[::7]:
        want = entry.attend(q, cache.lengths - 1, "xla")
        got = entry.attend(q, cache.lengths - 1, "pallas")
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_cache_generations_agree(kind, dense_xla):
    """Whole generations over a quantised cache: Pallas and XLA agree on most tokens (see
    above for why not all), and the quantised cache on most of the dense cache's."""
    model = api.with_attention(jax_model("smollm2"), "xla", kind)
    xla = api.generate(model, PROMPTS, max_new_tokens=NEW).token_ids
    pallas = api.generate(api.with_attention(model, "pallas", kind), PROMPTS, max_new_tokens=NEW).token_ids
    agree = lambda a, b: np.mean([x == y for r, t in zip(a, b) for x, y in zip(r, t)])
    assert agree(pallas, xla) >= 0.8
    assert agree(xla, dense_xla) >= (0.8 if kind == "int8" else 0.5)


def test_paged_cache_writes_through_the_page_table():
    """A decode step's key lands in pool page table[b, t // page] at offset t % page, and
    the dense view gives it back at slot t; padding goes to the scratch page."""
    import jax.numpy as jnp

    cfg = jax_model("smollm2").cfg
    layer = paged.empty(3, cfg.n_kv_heads, cfg.head_dim, 40, jnp.float32, page_size=16)
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((3, 2, 3, 64)), jnp.float32)
    positions = jnp.array([[0, 1], [17, 18], [-1, 39]], jnp.int32)
    out = layer.write(k, k + 1, positions, positions)
    table = np.asarray(out.page_table)
    for b, (t0, t1) in enumerate(np.asarray(positions)):
        for j, t in enumerate((t0, t1)):
            if t >= 0:
                np.testing.assert_array_equal(out.k_pages[:, table[b, t // 16], t % 16], k[b, j])
    assert np.all(np.asarray(out.k_pages[:, -1, 0]) == np.asarray(k[2, 0]))  # the padding token
    kd, vd = out.view(jnp.float32)
    np.testing.assert_array_equal(kd[1, :, 17], k[1, 0])
    np.testing.assert_array_equal(vd[1, :, :, 18], k[1, 1] + 1)
    assert dense.KVCache(layers=(out,), lengths=jnp.zeros(3, jnp.int32)).capacity == 48


def test_bad_choices_are_one_line_errors():
    assert_one_line_error(api.load, "smollm2", kv_cache="fp8", match="unknown KV cache kind 'fp8'")
    assert_one_line_error(api.load, "smollm2", attention_impl="cuda", match="unknown attention implementation")


def test_cli_flags():
    from test_cli import run

    r = run("generate", "--prompt", PROMPTS[0], "-n", "6", "--attention-impl", "pallas",
            "--kv-cache", "paged", "--no-stream")
    assert r.returncode == 0, r.stderr
    ours = api.generate(jax_model("smollm2"), PROMPTS[0], max_new_tokens=6)
    assert r.stdout.strip() == ours.texts[0].strip()
    r = run("generate", "--prompt", "hi", "--kv-cache", "int3")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    from jaxdec.cache import registry

    kinds = registry.names()  # (in registration order, which follows the modules' imports)
    assert set(kinds) == {"dense", "paged", "int8", "int4", "window"}
    assert r.stderr.strip() == f"jaxdec: error: unknown KV cache kind 'int3' (one of {', '.join(kinds)})"
