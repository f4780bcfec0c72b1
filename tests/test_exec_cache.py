"""The cache of compiled executables (jaxdec.exec_cache): a hit runs the very executable
the jit would have built (bit-identical outputs, the cache still donated), a second process
loads it without tracing, a damaged entry is recompiled and replaced, and the key follows
everything that changes the program."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdec import decode, exec_cache
from jaxdec.cache import dense
from jaxdec.ops import cpu_kernel
from jaxdec.sampling import Greedy, Sample
from tiny_hf import VOCAB, build


@pytest.fixture(scope="module")
def tiny():
    _, cfg, params = build("qwen2", seed=5)
    return cfg, params


@pytest.fixture
def cache_dir(tmp_path):
    exec_cache.disable()
    exec_cache.stats.clear()
    exec_cache.enable(tmp_path / "exec")
    yield tmp_path / "exec"
    exec_cache.disable()


def _forget():
    """Drop the executables this process loaded, so the next call reads the disk."""
    directory = exec_cache.directory()
    exec_cache.disable()
    exec_cache.enable(directory)


def _inputs(cfg, params, rng):
    """Fresh random ragged prompts, per-row limits and seed for `decode.generate_tokens`."""
    lens = rng.integers(3, 20, size=3).astype(np.int32)
    prompts = rng.integers(0, VOCAB - 1, (3, 32)).astype(np.int32)
    limits = rng.integers(5, 12, size=3).astype(np.int32)
    key = jax.random.key(int(rng.integers(2**31)))
    return lambda: (params, dense.init_cache(cfg, 3, 64), prompts, lens, key, limits)


def _same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_hit_is_bit_identical_to_the_jit(tiny, cache_dir):
    cfg, params = tiny
    args = _inputs(cfg, params, np.random.default_rng())
    static = dict(sampler=Sample(temperature=0.9, top_k=40), cfg=cfg, max_new_tokens=12,
                  stop_ids=(VOCAB - 1,))
    ref = decode.generate_tokens(*args(), **static)  # the plain jit, progress and cache

    cold = exec_cache.call(decode.generate_tokens, *args(), **static)
    assert exec_cache.stats == {"compiled": 1, "stored": 1}
    _same(cold, ref)
    _forget()
    donated = args()
    warm = exec_cache.call(decode.generate_tokens, *donated, **static)
    assert exec_cache.stats["disk"] == 1 and exec_cache.stats["compiled"] == 1
    _same(warm, ref)
    assert all(x.is_deleted() for x in jax.tree.leaves(donated[1]))  # still donated
    _same(exec_cache.call(decode.generate_tokens, *args(), **static), ref)
    assert exec_cache.stats["memory"] == 1


def test_streamed_chunks_from_the_cache_equal_one_jit(tiny, cache_dir):
    """`start` then `advance` chunk by chunk (a traced scalar target, the cache donated at
    every call), all from disk, give the one-jit generation exactly."""
    cfg, params = tiny
    args = _inputs(cfg, params, np.random.default_rng())
    static = dict(sampler=Greedy(), cfg=cfg, stop_ids=())
    ref, _ = decode.generate_tokens(*args(), max_new_tokens=16, **static)

    def streamed():
        a = args()
        p, cache = exec_cache.call(decode.start, *a, max_new_tokens=16, **static)
        for target in (4, 8, 16):
            p, cache = exec_cache.call(decode.advance, a[0], cache, p, a[4], a[5], target,
                                       **static)
        return p

    _same(streamed(), ref)
    _forget()
    _same(streamed(), ref)
    assert exec_cache.stats["compiled"] == 2 and exec_cache.stats["disk"] == 2


def test_prefetch_loads_the_programs_the_tags_last_run_used(tiny, cache_dir, monkeypatch):
    """A run under a prefetch tag lists the executables it used; after a restart,
    `prefetch(tag)` loads them on a thread and the calls run them (the jit's tokens). A
    call they do not fit is served as before; another tag, or the same tag under other
    jaxdec sources, prefetches nothing."""
    cfg, params = tiny
    args = _inputs(cfg, params, np.random.default_rng())
    static = dict(sampler=Greedy(), cfg=cfg, stop_ids=())

    def streamed(new):
        a = args()
        p, cache = exec_cache.call(decode.start, *a, max_new_tokens=new, **static)
        for target in (4, 8, new):
            p, cache = exec_cache.call(decode.advance, a[0], cache, p, a[4], a[5], target,
                                       **static)
        return p

    assert exec_cache.prefetch("generate") is None  # no list yet
    ref, _ = decode.generate_tokens(*args(), max_new_tokens=16, **static)
    _same(streamed(16), ref)
    (listed,) = cache_dir.glob("recent-*.txt")
    assert len(listed.read_text().split()) == 2 and exec_cache.stats["compiled"] == 2

    _forget()
    exec_cache.stats.clear()
    assert exec_cache.prefetch("another command") is None
    exec_cache.prefetch("generate").join()
    _same(streamed(16), ref)
    assert exec_cache.stats == {"prefetched": 2, "memory": 2}

    _forget()
    exec_cache.stats.clear()
    monkeypatch.setattr(exec_cache, "_process_ident", exec_cache._process() + " (edited sources)")
    assert exec_cache.prefetch("generate") is None  # (the list of other sources: stale programs)
    monkeypatch.undo()

    _forget()
    exec_cache.stats.clear()
    exec_cache.prefetch("generate")
    ref, _ = decode.generate_tokens(*args(), max_new_tokens=12, **static)
    _same(streamed(12), ref)  # other shapes: other programs, the prefetched ones unused
    assert exec_cache.stats == {"compiled": 2, "stored": 2, "memory": 2}


@pytest.mark.parametrize("damage", ["truncated", "flipped", "garbage"])
def test_damaged_entry_is_recompiled_and_replaced(tiny, cache_dir, damage):
    cfg, params = tiny
    args = _inputs(cfg, params, np.random.default_rng())
    static = dict(sampler=Greedy(), cfg=cfg, max_new_tokens=8, stop_ids=())
    ref = decode.generate_tokens(*args(), **static)
    exec_cache.call(decode.generate_tokens, *args(), **static)
    (entry,) = cache_dir.glob("*.exe")
    data = bytearray(entry.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "flipped":  # still unpickles: the checksum catches it
        data[len(data) // 2] ^= 0xFF
    else:
        data = bytearray(b"\0" + np.random.default_rng().bytes(4096))  # "\0": not pickle
    entry.write_bytes(bytes(data))

    _forget()
    _same(exec_cache.call(decode.generate_tokens, *args(), **static), ref)
    assert exec_cache.stats["bad"] == 1 and exec_cache.stats["compiled"] == 2
    assert entry.read_bytes() != bytes(data)  # replaced
    _forget()
    _same(exec_cache.call(decode.generate_tokens, *args(), **static), ref)
    assert exec_cache.stats["disk"] == 1 and exec_cache.stats["bad"] == 1


def test_least_recently_used_entries_are_evicted(tiny, cache_dir, monkeypatch):
    cfg, params = tiny
    args = _inputs(cfg, params, np.random.default_rng())
    run = lambda n: exec_cache.call(decode.generate_tokens, *args(), sampler=Greedy(),
                                    cfg=cfg, max_new_tokens=n, stop_ids=())
    run(4)
    (first,) = cache_dir.glob("*.exe")
    monkeypatch.setattr(exec_cache, "MAX_BYTES", int(2.5 * first.stat().st_size))
    run(5)
    os.utime(first, (1, 1))  # long unused
    _forget()
    run(5)  # a hit marks its entry as used now
    run(6)  # a third entry: over the limit, the oldest goes
    assert len(list(cache_dir.glob("*.exe"))) == 2 and not first.exists()
    assert exec_cache.stats["disk"] == 1 and exec_cache.stats["stored"] == 3


def test_disabled_is_the_plain_jit(tiny, tmp_path):
    cfg, params = tiny
    exec_cache.disable()
    args = _inputs(cfg, params, np.random.default_rng())
    static = dict(sampler=Greedy(), cfg=cfg, max_new_tokens=6, stop_ids=())
    _same(exec_cache.call(decode.generate_tokens, *args(), **static),
          decode.generate_tokens(*args(), **static))
    assert exec_cache.directory() is None and not list(tmp_path.iterdir())


def test_key_follows_what_changes_the_program(tiny, monkeypatch):
    cfg, params = tiny
    abstract = lambda x: jax.ShapeDtypeStruct(np.shape(x), jax.typeof(x).dtype)
    p = jax.tree.map(abstract, params)
    cache = jax.tree.map(abstract, dense.init_cache(cfg, 2, 64))
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    args = (p, cache, i32(2, 32), i32(2), jax.random.key(0), i32(2))
    static = dict(sampler=Greedy(), cfg=cfg, max_new_tokens=8, stop_ids=(3,))
    key = lambda fn=decode.start, a=args, **kw: exec_cache._key(fn, a, {**static, **kw})

    base = key()
    rng = np.random.default_rng()
    values = (params, dense.init_cache(cfg, 2, 64), rng.integers(0, VOCAB, (2, 32), np.int32),
              rng.integers(1, 32, 2, np.int32), jax.random.key(int(rng.integers(99))),
              rng.integers(1, 8, 2, np.int32))
    assert key(a=values) == base  # values do not matter, only their signature
    changed = [
        key(fn=decode.generate_tokens),
        key(max_new_tokens=9), key(stop_ids=(3, 4)), key(sampler=Sample(temperature=0.5)),
        key(cfg=cfg.__class__(**{**cfg.__dict__, "rope_theta": cfg.rope_theta * 2})),
        key(a=(p, cache, i32(2, 64), *args[3:])),  # shape
        key(a=(p, cache, jax.ShapeDtypeStruct((2, 32), jnp.int16), *args[3:])),  # dtype
        key(a=(jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16), p),
               *args[1:])),
        key(a=(p, cache, *args[2:5], jax.ShapeDtypeStruct((2,), jnp.int32, weak_type=True))),
    ]
    with monkeypatch.context() as m:
        m.setenv("JAXDEC_CPU_KERNEL", "0")
        changed.append(key())
    with monkeypatch.context() as m:
        m.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
        changed.append(key())
    with monkeypatch.context() as m:
        m.setattr(cpu_kernel, "PORTABLE", not cpu_kernel.PORTABLE)
        changed.append(key())
    with monkeypatch.context() as m:
        m.setattr(cpu_kernel, "MAX_KERNEL_M", cpu_kernel.MAX_KERNEL_M + 1)
        changed.append(key())
    with monkeypatch.context() as m:
        m.setattr(cpu_kernel, "MAX_DENSE_KERNEL_M", {**cpu_kernel.MAX_DENSE_KERNEL_M,
                                                     "float32": 7})
        changed.append(key())
    assert len({base, *changed}) == len(changed) + 1
    assert key() == base


def test_unstable_static_repr_bypasses_the_cache(cache_dir):
    """A static argument printed as `<... at 0x...>` differs from run to run: plain jit."""
    class Opaque:
        def __hash__(self):
            return 0

        def __eq__(self, other):
            return isinstance(other, Opaque)

    f = jax.jit(lambda x, tag: x * 2, static_argnames="tag")
    x = np.random.default_rng().standard_normal(4).astype(np.float32)
    np.testing.assert_array_equal(exec_cache.call(f, x, tag=Opaque()), x * 2)
    assert not exec_cache.stats and not cache_dir.exists()


# A second process: the CLI's cache set-up (cli.enable_compile_cache), a tiny random model,
# then `decode.start` and one `decode.advance`, counting how often the model is traced.
_CHILD = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from jaxdec import cli, decode, exec_cache
    from jaxdec.cache import dense
    from jaxdec.config import ModelConfig
    from jaxdec.models import transformer
    from jaxdec.pytree import init_params
    from jaxdec.sampling import Greedy

    mode, seed = sys.argv[1], int(sys.argv[2])
    cli.enable_compile_cache()
    traces = 0
    real = transformer.hidden
    def counting(*a, **k):
        global traces
        traces += 1
        return real(*a, **k)
    transformer.hidden = counting
    cfg = ModelConfig(vocab_size=300, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      head_dim=16, d_ff=96, max_position=512)
    params = init_params(transformer.declare(cfg), jax.random.key(seed))
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, 300, (2, 32)).astype(np.int32)
    lens = rng.integers(4, 30, 2).astype(np.int32)
    limits = np.full(2, 8, np.int32)
    key = jax.random.key(seed)
    plain = lambda fn, *a, **k: fn(*a, **k)
    static = dict(sampler=Greedy(), cfg=cfg, stop_ids=())
    for call in {"jit": [plain], "cache": [exec_cache.call],
                 "both": [plain, exec_cache.call]}[mode]:
        p, cache = call(decode.start, params, dense.init_cache(cfg, 2, 64), prompts, lens,
                        key, limits, max_new_tokens=8, **static)
        p, cache = call(decode.advance, params, cache, p, key, limits, 8, **static)
    print(json.dumps({"traces": traces, "stats": dict(exec_cache.stats),
                      "dir": str(exec_cache.directory()),
                      "tokens": np.asarray(p.tokens).tolist()}))
""")


def _child(tmp_path, mode: str, seed: int, xla_cache) -> dict:
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = dict(os.environ, JAXDEC_XLA_CACHE=str(xla_cache))
    r = subprocess.run([sys.executable, str(script), mode, str(seed)], capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_second_process_loads_without_tracing(tmp_path):
    """The first run compiles and stores (JAX's persistent cache already holding the same
    programs, from a plain-jit run: what it loads must not be what gets stored); the next
    process runs from the disk without tracing, with the plain jit's tokens."""
    seed = int(np.random.default_rng().integers(2**31))
    xla_cache = tmp_path / "xla"
    plain = _child(tmp_path, "jit", seed, xla_cache)
    first = _child(tmp_path, "cache", seed, xla_cache)
    second = _child(tmp_path, "cache", seed, xla_cache)
    assert first["dir"] == second["dir"] == str(xla_cache / "exec")
    assert plain["traces"] == 2 and first["traces"] == 2
    assert first["stats"] == {"compiled": 2, "stored": 2}
    assert second["traces"] == 0 and second["stats"] == {"disk": 2}
    assert plain["tokens"] == first["tokens"] == second["tokens"]
    assert sum(t >= 0 for row in second["tokens"] for t in row) == 16  # 8 per row


def test_store_after_a_plain_jit_call_in_the_same_process(tmp_path):
    """JAX's in-memory cache holds what the plain jit loaded from JAX's persistent cache;
    the exec cache still stores a fresh compile, which the next process can run."""
    seed = int(np.random.default_rng().integers(2**31))
    xla_cache = tmp_path / "xla"
    plain = _child(tmp_path, "jit", seed, xla_cache)
    both = _child(tmp_path, "both", seed, xla_cache)
    assert both["stats"] == {"compiled": 2, "stored": 2}
    loaded = _child(tmp_path, "cache", seed, xla_cache)
    assert loaded["stats"] == {"disk": 2}
    assert plain["tokens"] == both["tokens"] == loaded["tokens"]
