"""The compiled decode programs, read from XLA's optimized HLO: no copy of the KV cache per
step (the cache is donated and updated in place), and quantised weights never widened to
float32 inside the decode loop (the matmuls are our kernel's custom calls)."""

import re

import jax
import jax.numpy as jnp
import pytest

from jaxdec import decode
from jaxdec.cache import dense
from jaxdec.models import transformer
from jaxdec.ops import cpu_kernel
from jaxdec.formats.convert import quantize_params
from jaxdec.sampling import Greedy
from tiny_hf import build


def computations(hlo: str) -> dict[str, str]:
    return {c.split(" ", 1)[0]: c for c in re.split(r"\n(?=\S)", hlo) if c.strip()}


def loop_body(hlo: str) -> str:
    comps = computations(hlo)
    (name,) = set(re.findall(r"while\(.*?body=(%[\w.\-]+)", hlo))
    return comps[name]


def cache_copies(text: str, cache: dense.KVCache) -> list[str]:
    """Instructions that copy a whole K or V buffer (plain copies or copy fusions)."""
    shapes = {",".join(map(str, x.shape)) for layer in cache.layers for x in (layer.k, layer.v)}
    out = []
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%\S+ = f32\[([\d,]+)\]\S* (copy|fusion)\((.*)", line)
        if m and m.group(1) in shapes and (m.group(2) == "copy" or "copy" in line.split("=")[0]):
            out.append(line.strip()[:160])
    return out


@pytest.fixture(scope="module")
def tiny():
    _, cfg, params = build("llama", seed=11)
    return cfg, params


def _generate_hlo(cfg, params, cache):
    prompts = jnp.ones((2, 8), jnp.int32)
    return decode.generate_tokens.lower(
        params, cache, prompts, jnp.array([8, 5]), jax.random.key(0), jnp.array([6, 6]),
        sampler=Greedy(), cfg=cfg, max_new_tokens=6).compile().as_text()


def test_decode_step_updates_cache_in_place(tiny):
    cfg, params = tiny
    cache = dense.init_cache(cfg, 2, 64)
    hlo = decode.decode_step.lower(params, cache, jnp.array([1, 2]), jax.random.key(0),
                                   Greedy(), cfg).compile().as_text()
    assert cache_copies(hlo, cache) == []
    assert "input_output_alias" in hlo  # the donated cache is aliased to the output


def test_generation_loop_copies_no_cache(tiny):
    cfg, params = tiny
    cache = dense.init_cache(cfg, 2, 64)
    hlo = _generate_hlo(cfg, params, cache)
    assert cache_copies(loop_body(hlo), cache) == []


def _default_copy_insertion_hlo(cfg, params, cache):
    f = jax.jit(decode.decode_step.__wrapped__, static_argnames=("sampler", "cfg"),
                donate_argnames=("cache",))
    return f.lower(params, cache, jnp.array([1, 2]), jax.random.key(0), Greedy(),
                   cfg).compile().as_text()


@pytest.mark.skipif(not cpu_kernel.available(), reason=f"CPU kernel: {cpu_kernel.reason()}")
def test_tree_verification_writes_then_attends_without_copies(tiny):
    """A speculative tree's verification writes its nodes first too (to slots past the
    context) and attends over the updated cache, so even XLA's default copy insertion
    copies no buffer (attending over the cache as it was and writing after made it copy
    every one)."""
    cfg, params = tiny
    cache = dense.init_cache(cfg, 2, 64)
    positions = jnp.array([[3, 4, 4], [5, 6, 6]])
    tree = transformer.Tree(mask=jnp.array([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]] * 2, bool),
                            slots=jnp.array([[3, 4, 5], [5, 6, 7]]))

    def verify(params, cache, tokens):
        return transformer.hidden_and_taps(params, tokens, positions, cache, cfg, tree=tree)[:2]

    def hlo(**options):
        f = jax.jit(verify, donate_argnames=("cache",), compiler_options=options)
        return f.lower(params, cache, jnp.ones((2, 3), jnp.int32)).compile().as_text()

    text = hlo()
    assert cpu_kernel.ATTENTION_TARGET in text
    assert cache_copies(text, cache) == []
    assert cache_copies(hlo(**decode.COMPILER_OPTIONS), cache) == []


@pytest.mark.skipif(not cpu_kernel.available(), reason=f"CPU kernel: {cpu_kernel.reason()}")
def test_kernel_step_writes_then_attends_without_copies(tiny):
    """On the attention kernel a step writes its keys first and attends over the updated
    cache: nothing reads the old buffer after the write, so even the default copy
    insertion copies nothing."""
    cfg, params = tiny
    cache = dense.init_cache(cfg, 2, 64)
    hlo = _default_copy_insertion_hlo(cfg, params, cache)
    assert cpu_kernel.ATTENTION_TARGET in hlo
    assert cache_copies(hlo, cache) == []


@pytest.mark.skipif(not cpu_kernel.available(), reason=f"CPU kernel: {cpu_kernel.reason()}")
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantised_weights_stay_quantised_in_the_loop(tiny, weights):
    """Inside the while loop no f32 array of any weight matrix's shape exists, and every
    matmul is a call into the kernel: the codes are read as they are stored."""
    cfg, params = tiny
    qp = quantize_params(params, transformer.declare(cfg), weights)
    body = loop_body(_generate_hlo(cfg, qp, dense.init_cache(cfg, 2, 64)))
    weight_shapes = {f"{w.k},{w.n}" for w in jax.tree.leaves(
        qp, is_leaf=lambda x: hasattr(x, "bits")) if hasattr(w, "bits")}
    widened = [s for s in re.findall(r"f32\[([\d,]+)\]", body) if s in weight_shapes]
    assert widened == []
    n_matrices = 7 * cfg.n_layers + 1
    assert body.count(cpu_kernel.TARGET) >= n_matrices


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_a_long_chunk_dequantises_each_matrix_when_its_layer_runs(tiny, weights):
    """Past the kernel's rows (here: XLA's ops alone), a prompt chunk multiplies by XLA's
    dequantise + dot. Each matrix is dequantised when its layer reaches it
    (`cpu_kernel.after`), so the program's temporaries hold about a layer's f32 weights:
    XLA:CPU's scheduler had dequantised every layer's first, all live at once."""
    cfg, params = tiny
    qp = quantize_params(params, transformer.declare(cfg), weights)
    matrices = [w for w in jax.tree.leaves(qp.layers, is_leaf=lambda x: hasattr(x, "bits"))
                if hasattr(w, "bits")]
    widened = sum(4 * w.k * w.n for w in matrices)
    tokens = jnp.arange(1, 9, dtype=jnp.int32)[None]
    with cpu_kernel.xla_only():
        program = jax.jit(lambda p, t: transformer.hidden(p, t, jnp.arange(8)[None], None, cfg)[0])
        temp = program.lower(qp, tokens).compile().memory_analysis().temp_size_in_bytes
    assert cfg.n_layers >= 3
    assert temp < 1.5 * widened / cfg.n_layers, (temp, widened)
