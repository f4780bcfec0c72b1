"""Sharded decoding on a mesh of 8 fake CPU devices (conftest sets XLA's device count):
every layout gives the single-device greedy tokens; the compiled step has the collectives
the layout implies and no others; devices hold the bytes the rules say; bad meshes are
refused by name; and a 2-process run matches one process."""

from __future__ import annotations

import gc
import json
import math
import pathlib
import re
import subprocess
import sys
import tracemalloc

import jax
import numpy as np
import pytest

import jaxdec
from conftest import assert_one_line_error, jax_model
from jaxdec import api, decode, sharding
from jaxdec.cache import dense
from jaxdec.config import ModelConfig
from jaxdec.models import transformer
from jaxdec.sampling import Greedy

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land"]
TINY = ["deepseek_v3", "nemotron_h"]  # MLA+MoE with a shared expert; Mamba2+attention+MoE+MLP
TINY_LAYOUTS = ["model=4", "data=2,model=4", "expert=4", "data=8"]
pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")


@pytest.fixture(scope="module", autouse=True)
def _room():
    """Data-parallel layouts hold a copy of the model per device (4.4 GB for SmolLM2 on
    data=8): drop the session's cached models of the other test modules first (the HF
    torch models and Qwen's weights, several GB), and collect between tests."""
    import conftest

    conftest.hf_model.cache_clear()
    conftest.jax_model.cache_clear()
    gc.collect()
    yield
    gc.collect()


@pytest.fixture(autouse=True)
def _collect():
    yield
    gc.collect()


@pytest.fixture(scope="module")
def smollm2_reference():
    model = jax_model("smollm2")
    return model, api.generate(model, PROMPTS, max_new_tokens=10).token_ids


def _expected_param_bytes(cfg: ModelConfig, sizes: dict[str, int]) -> int:
    """Per-device bytes of float32 params, from the declaration's logical axes and the
    documented rules (not from the sharding code): attention and Mamba heads, MLP units and
    vocabulary split over `model` (kv heads, Mamba groups and vocabulary only when
    divisible), experts over `expert`."""
    model, expert = sizes.get("model", 1), sizes.get("expert", 1)
    split = {"q_heads": model, "mlp": model, "expert_mlp": model, "expert": expert,
             "kv_heads": model if cfg.n_kv_heads % model == 0 else 1,
             "vocab": model if cfg.vocab_size % model == 0 else 1, "mamba_heads": model,
             "mamba_groups": model if cfg.mamba and cfg.mamba.n_groups % model == 0 else 1}
    leaves = jax.tree.leaves(transformer.declare(cfg), is_leaf=lambda x: hasattr(x, "axes"))
    return sum(4 * math.prod(s.shape) // math.prod(split.get(a, 1) for a in s.axes) for s in leaves)


@pytest.mark.parametrize("spec", ["data=8", "model=3", "data=2,model=3"])
def test_smollm2_layouts_match_single_device(spec, smollm2_reference):
    """SmolLM2 (9 query heads, 3 kv heads) loaded straight onto the mesh: the same greedy
    tokens as one device, and each device holds the params and cache the rules say."""
    single, want = smollm2_reference
    model = jaxdec.load("smollm2", mesh=spec)
    assert api.generate(model, PROMPTS, max_new_tokens=10).token_ids == want
    sizes = sharding.parse_mesh(spec)
    held = sharding.device_bytes(model.params)
    assert len(held) == math.prod(sizes.values())
    assert set(held.values()) == {_expected_param_bytes(model.cfg, sizes)}
    cache = api.init_cache(model, 8, 64)
    one = dense.init_cache(single.cfg, 8, 64)
    data, split = sizes.get("data", 1), sizes.get("data", 1) * sizes.get("model", 1)
    kv = sum(e.k.nbytes + e.v.nbytes for e in one.layers)  # rows over data, kv heads over model
    rows_only = sum(e.pos.nbytes for e in one.layers) + one.lengths.nbytes  # slot positions, lengths: rows
    assert set(sharding.device_bytes(cache).values()) == {kv // split + rows_only // data}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    import tiny_families

    out = {}
    for name in TINY + ["qwen2_moe", "mamba2"]:
        out[name] = tmp_path_factory.mktemp(name)
        tiny_families.save(name, out[name])
    return out


TINY_ROWS = [[5, 17, 3, 99, 42], [7, 7, 1, 64, 23, 88, 2, 91, 30, 11, 6], [120, 0, 57]]


@pytest.fixture(scope="module")
def tiny_reference(tiny_dirs):
    """Single-device greedy tokens of each tiny model on ragged prompts."""
    return {name: api.generate_ids(jaxdec.load(tiny_dirs[name]), TINY_ROWS, max_new_tokens=10).token_ids
            for name in TINY}


@pytest.mark.parametrize("spec", TINY_LAYOUTS)
@pytest.mark.parametrize("name", TINY)
def test_tiny_families_layouts_match_single_device(name, spec, tiny_dirs, tiny_reference):
    """MLA, MoE and hybrid models read from HF safetensors straight onto each layout (head,
    unit and expert counts divide 4): the single-device greedy tokens, ragged prompts."""
    model = jaxdec.load(tiny_dirs[name], mesh=spec)
    assert api.generate_ids(model, TINY_ROWS, max_new_tokens=10).token_ids == tiny_reference[name]
    assert set(sharding.device_bytes(model.params).values()) == {
        _expected_param_bytes(model.cfg, sharding.parse_mesh(spec))}


def _collectives(model, batch: int) -> dict[str, list[str]]:
    cache = api.init_cache(model, batch, 64)
    with jax.set_mesh(model.mesh):
        hlo = decode.decode_step.lower(model.params, cache, np.zeros(batch, np.int32),
                                       jax.random.key(0), Greedy(), model.cfg).compile().as_text()
    found: dict[str, list[str]] = {}
    for line in hlo.splitlines():
        m = re.search(r"= \S+ (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                      r"(-start)?\(", line)
        if m:
            found.setdefault(m.group(1), []).append(line)
    return found


def test_hlo_collectives_match_the_layout():
    """Tensor parallel: one all-reduce after each row-parallel matmul (attention output and
    MLP down projection, 2 per layer) plus one for the vocabulary-split embedding lookup;
    the vocabulary-split argmax gathers its 3 partial maxima. Data parallel: none at all."""
    tp = _collectives(jaxdec.load("smollm2", mesh="model=3"), 2)
    n_layers = jax_model("smollm2").cfg.n_layers
    assert len(tp.pop("all-reduce")) == 2 * n_layers + 1
    assert len(tp.pop("all-gather")) == 2 and not tp  # argmax value and index, nothing else
    assert _collectives(jaxdec.load("smollm2", mesh="data=8"), 8) == {}


def test_hlo_expert_parallel_is_one_all_reduce_per_moe_layer(tiny_dirs):
    model = jaxdec.load(tiny_dirs["qwen2_moe"], mesh="expert=4")
    found = _collectives(model, 2)
    n_moe = sum(f == "moe" for _, f in model.cfg.kinds)
    assert n_moe > 0 and len(found.pop("all-reduce")) == n_moe and not found


def test_sharded_decode_step_with_explicit_shardings_and_pmap_style_shard_map():
    """`decode.sharded_decode_step` (jit with in/out shardings) and the pmap layout through
    shard_map (`decode.data_parallel_decode_step`, the unchanged decode_step per device)
    both give the single-device tokens step after step; the donated cache keeps its layout."""
    single = jax_model("smollm2")
    rng = np.random.default_rng(3)
    prompts = rng.integers(0, single.cfg.vocab_size, (8, 7)).astype(np.int32)
    lens = np.array([7, 3, 5, 7, 2, 6, 4, 7], np.int32)

    def run(model, step, n=6):
        cache = api.init_cache(model, 8, 32)
        with jax.set_mesh(model.mesh) if model.mesh is not None else _nothing():
            logits, cache = jax.jit(decode.prefill, static_argnames="cfg")(
                model.params, cache, prompts, lens, cfg=model.cfg)
        tok, out = np.asarray(logits).argmax(-1).astype(np.int32), []
        layout = jax.tree.leaves(jax.tree.map(lambda x: x.sharding, cache))
        for _ in range(n):
            tok, cache = step(model.params, cache, tok, jax.random.key(0))
            tok = np.asarray(tok)
            out.append(tok)
        assert all(x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(jax.tree.leaves(cache), layout))
        return np.stack(out, 1)

    want = run(single, lambda p, c, t, k: decode.decode_step(p, c, t, k, Greedy(), single.cfg))
    tp = jaxdec.load("smollm2", mesh="data=2,model=3")
    np.testing.assert_array_equal(run(tp, jaxdec.mesh_decode_step(tp, Greedy())), want)
    del tp
    gc.collect()
    dp = jaxdec.load("smollm2", mesh="data=8")
    np.testing.assert_array_equal(run(dp, decode.data_parallel_decode_step(dp.mesh, Greedy(), dp.cfg)), want)


@pytest.mark.slow  # (30 s: two more compiles of each path; -m slow runs it)
def test_sampling_and_scoring_on_a_mesh(smollm2_reference):
    """Sampled tokens (temperature, top-p; the same key) and scores on model=3 equal the
    single-device run's: random bits do not depend on the layout."""
    single, _ = smollm2_reference
    model = jaxdec.load("smollm2", mesh="data=2,model=3")
    sampler = jaxdec.Sample(temperature=0.8, top_p=0.9)
    want = api.generate(single, PROMPTS, max_new_tokens=12, sampler=sampler, seed=7).token_ids
    assert api.generate(model, PROMPTS, max_new_tokens=12, sampler=sampler, seed=7).token_ids == want
    rows = [[1, 504, 3458, 17, 9], [42, 7]]
    want = api.score(single, rows)
    got = api.score(model, rows)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.nanmax(np.abs(want)))


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_orbax_checkpoint_restores_into_the_sharded_layout(tiny_dirs, tmp_path):
    """`jaxdec convert` output restores directly into a mesh layout (each leaf arrives with
    its NamedSharding), and decodes as the source does."""
    src = tiny_dirs["deepseek_v3"]
    out = tmp_path / "ox"
    assert subprocess.run([sys.executable, "-m", "jaxdec", "convert", str(src), str(out)],
                          capture_output=True, cwd=ROOT).returncode == 0
    model = jaxdec.load(out, mesh="data=2,model=4")
    wq = model.params.layers[0].mixer.q_b
    assert wq.sharding.spec == jax.sharding.PartitionSpec(None, "model", None)
    rows = [[3, 1, 4, 1, 5], [9, 2, 6]]
    want = api.generate_ids(jaxdec.load(src), rows, max_new_tokens=10).token_ids
    assert api.generate_ids(model, rows, max_new_tokens=10).token_ids == want


def test_sharded_load_holds_one_tensor_at_a_time(monkeypatch):
    """Reading the GGUF (params cache off) onto model=3: beyond the shards the devices keep
    (on CPU, XLA keeps the host buffers it was handed), the host's numpy allocations peak at
    one tensor (the 113 MB embedding, dequantized) and one slice of it, never the 538 MB
    model (tracemalloc)."""
    monkeypatch.setenv("JAXDEC_PARAMS_CACHE", "0")
    tracemalloc.start()
    try:
        model = jaxdec.load("smollm2", mesh="model=3")
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    largest = max(x.nbytes for x in jax.tree.leaves(model.params))
    total = sum(x.nbytes for x in jax.tree.leaves(model.params))
    assert peak - kept < min(1.5 * largest, total / 3), (peak, kept, largest, total)


def test_bad_meshes_get_one_line_errors_naming_axis_and_sizes(tiny_dirs):
    tiny = jax_model("smollm2")
    seven = ModelConfig(vocab_size=64, d_model=56, n_layers=1, n_heads=7, n_kv_heads=7, head_dim=8, d_ff=64)
    assert_one_line_error(sharding.rules_for, seven, sharding.make_mesh("model=4"),
                          match="mesh axis 'model' of size 4 does not divide the 7 query heads")
    assert_one_line_error(sharding.make_mesh, "data=16", match="needs 16 devices; 8 available")
    assert_one_line_error(sharding.make_mesh, "data=2,modle=4", match="unknown mesh axis 'modle'")
    assert_one_line_error(sharding.make_mesh, "data=two", match="bad mesh spec")
    assert_one_line_error(sharding.make_mesh, "data=0", match="sizes must be positive")
    assert_one_line_error(jaxdec.load, "smollm2", mesh="model=4",
                          match="'model' of size 4 does not divide the 9 query heads")
    assert_one_line_error(api.shard, tiny, "model=3,expert=2",
                          match="'expert' of size 2: this model has no experts")
    assert_one_line_error(jaxdec.load, tiny_dirs["mamba2"], mesh="expert=4",
                          match="this model has no experts")
    assert_one_line_error(api.init_cache, api.shard(tiny, "data=2"), 3, 16,
                          match="'data' of size 2 does not divide the batch of 3 rows")
    r = subprocess.run([sys.executable, "-m", "jaxdec", "generate", "-p", "hi", "--mesh", "model=4"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == ("jaxdec: error: mesh axis 'model' of size 4 does "
                                                "not divide the 9 query heads of this model")


_WORKER = """
import json, sys
import jaxdec
from jaxdec import api, sharding
sharding.initialize_from_env()
model = jaxdec.load(sys.argv[1], mesh=sys.argv[2])
out = api.generate_ids(model, json.loads(sys.argv[3]), max_new_tokens=10)
held = sharding.device_bytes(model.params)
print(json.dumps({"ids": out.token_ids, "local": sorted(held.values())}))
"""


def test_two_processes_match_one(tiny_dirs):
    """Two processes on localhost, one CPU device each, joined by jax.distributed:
    (1) the CLI on SmolLM2 with the batch split (data=2) prints the single-process text
        (as does one process streaming on data=2,model=3);
    (2) a MoE model split over both (model=2: heads, MLP and expert units) generates the
    single-process tokens, each process holding half of the split weights."""
    launch = [sys.executable, str(ROOT / "scripts" / "launch_multihost.py"), "-n", "2", "--"]
    prompt = "The capital of France is"
    cli = ["-m", "jaxdec", "generate", "-p", prompt, "-n", "12", "--no-stream"]
    one = api.generate(jax_model("smollm2"), prompt, max_new_tokens=12).texts[0] + "\n"
    two = subprocess.run(launch + [sys.executable, *cli, "--mesh", "data=2"], capture_output=True,
                         text=True, cwd=ROOT, timeout=600)
    assert two.returncode == 0, two.stderr[-2000:]
    assert two.stdout == one and len(one.strip()) > 0
    assert "2 process(es)" in two.stderr
    streamed = subprocess.run([sys.executable, *cli[:-1], "--mesh", "data=2,model=3"],
                              capture_output=True, text=True, cwd=ROOT)
    assert streamed.returncode == 0 and streamed.stdout == one, streamed.stderr[-2000:]

    rows = [[5, 17, 3, 99, 42], [7, 7, 1]]
    src = tiny_dirs["qwen2_moe"]
    want = api.generate_ids(jaxdec.load(src), rows, max_new_tokens=10).token_ids
    r = subprocess.run(launch + [sys.executable, "-c", _WORKER, str(src), "model=2", json.dumps(rows)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["ids"] == want
    cfg = jaxdec.load(src).cfg
    assert got["local"] == [_expected_param_bytes(cfg, {"model": 2})]
