"""Shared fixtures: the two real models, loaded once per session, in jaxdec and in HF."""

from __future__ import annotations

import functools
import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# 8 CPU devices (faked by XLA) for the sharding tests; single-device code runs on the first.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()

REAL_MODELS = ["smollm2", "qwen2.5-coder-0.5b"]


def _memoize_gguf_parsing() -> None:
    """HF's GGUF loader, the reference of the parity tests, parses a model's file anew for
    its config, its weights and its tokenizer (`gguf.GGUFReader`: 4 s on SmolLM2's
    vocabulary), and builds gguf's tensor-name map once per submodule (397 times a load,
    6 s). Both are pure functions of their inputs. Memoized for the session (a file by its
    path, size, inode and modification time, so one a test rewrites is parsed again), the
    references are the same numbers in less time."""
    import gguf

    parsed = {}

    def key(path, mode):
        st = os.stat(path)
        return os.path.realpath(path), mode, st.st_size, st.st_ino, st.st_mtime_ns

    class Reader(gguf.GGUFReader):
        def __new__(cls, path, mode="r"):
            return parsed.get(key(path, mode)) or super().__new__(cls)

        def __init__(self, path, mode="r"):
            if not getattr(self, "_parsed", False):
                super().__init__(path, mode)
                self._parsed = True
                if mode == "r":
                    parsed[key(path, mode)] = self

    gguf.GGUFReader = Reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)


_memoize_gguf_parsing()


def assert_one_line_error(fn, *args, match: str, **kwargs):
    """fn(*args, **kwargs) raises a JaxdecError matching `match`, on one non-empty line."""
    from jaxdec.errors import JaxdecError

    with pytest.raises(JaxdecError, match=match) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value) and str(info.value).strip()


def exact_joint(params, cfg, prompt, n: int):
    """f64[V^n]: a model's probability of every n-token continuation of `prompt`, from one
    forward pass over all V^n continuations (V: a vocabulary of a few tokens)."""
    import jax.numpy as jnp
    import numpy as np
    from scipy import special

    from jaxdec.models import transformer

    v = cfg.vocab_size
    seqs = np.array(np.meshgrid(*[np.arange(v)] * n, indexing="ij")).reshape(n, -1).T
    full = np.concatenate([np.broadcast_to(prompt, (len(seqs), len(prompt))), seqs], axis=1)
    pos = np.broadcast_to(np.arange(full.shape[1]), full.shape)
    logits, _ = transformer.forward(params, jnp.asarray(full), jnp.asarray(pos), None, cfg)
    logp = special.log_softmax(np.asarray(logits, np.float64), axis=-1)
    steps = [np.take_along_axis(logp[:, len(prompt) - 1 + i], seqs[:, i:i + 1], 1)[:, 0]
             for i in range(n)]
    return np.exp(np.sum(steps, axis=0))


def chi2_pvalue(samples, probs, v: int) -> float:
    """Pearson's chi-square of sample rows (the tokens of n steps) against the exact joint
    over V^n, pooling the cells expected to hold fewer than 5 samples."""
    import numpy as np
    from scipy import stats

    counts = np.bincount(np.ravel_multi_index(np.asarray(samples).T, (v,) * samples.shape[1]),
                         minlength=probs.size)
    expected = probs * len(samples)
    small = expected < 5
    obs, exp = counts[~small], expected[~small]
    if small.any():  # (a pooled cell only where there is one: an empty one is 0 / 0)
        obs, exp = np.append(obs, counts[small].sum()), np.append(exp, expected[small].sum())
    return float(stats.chisquare(obs, exp / exp.sum() * obs.sum()).pvalue)


def assert_fits(pvalue, alpha: float = 1e-3):
    """pvalue(seed) > alpha for a fresh seed, or, when that draw falls below alpha (one run
    in 1/alpha of a correct sampler), for a second fresh seed: a correct sampler fails one
    run in 1/alpha^2, a biased one (p < 1e-6 at every seed) fails both draws."""
    import numpy as np

    seeds = np.random.default_rng().integers(1 << 30, size=2)
    first = pvalue(int(seeds[0]))
    if first <= alpha:
        second = pvalue(int(seeds[1]))
        assert second > alpha, f"p = {first:.2g} at seed {seeds[0]}, {second:.2g} at {seeds[1]}"


@functools.lru_cache(maxsize=None)
def jax_model(name: str, dtype: str = "float32"):
    import jaxdec

    return jaxdec.load(name, dtype=dtype)


def hf_model(name: str, dtype: str = "float32"):
    """HF transformers' PyTorch model, loaded from the same GGUF file: once a test module
    for each name and dtype (`hf_model(n)` and `hf_model(n, "float32")` are one load, ~40 s)."""
    return _hf_model(name, dtype)


@functools.lru_cache(maxsize=None)
def _hf_model(name: str, dtype: str):
    import torch
    import transformers

    from jaxdec.checkpoint import registry

    path = registry.resolve(name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype))
    return model.eval()


hf_model.cache_clear = _hf_model.cache_clear  # (modules free the loaded models, as of an lru_cache)


@functools.lru_cache(maxsize=None)
def hf_tokenizer(name: str):
    import transformers

    from jaxdec.checkpoint import registry

    path = registry.resolve(name)
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """Each test module's compiled executables (and HF's torch models) are let go when the
    module ends. Kept for the whole session they grew the process past 16 GB, and XLA's
    compiler then crashed late in the suite."""
    yield
    import gc

    import jax

    jax.clear_caches()
    hf_model.cache_clear()
    gc.collect()


@pytest.fixture(scope="session", params=REAL_MODELS)
def real_model_name(request):
    return request.param


SLOW_LIST = os.path.join(os.path.dirname(__file__), "slow.txt")


def _slow_ids() -> set[str]:
    with open(SLOW_LIST) as f:
        return {line.strip() for line in f if line.strip() and not line.startswith("#")}


def pytest_collection_modifyitems(config, items):
    """Tests named in slow.txt run only with -m slow (`make test-all`); when the whole suite
    is collected, a name there that matches no test is an error, so a rename cannot quietly
    move a slow test into `make test`.

    The Pallas kernel files run every reference case through the TPU (Mosaic) body in
    interpret mode by default; the GPU (Triton) body, whose interpret mode is the slower,
    runs every other case by default (each G and each head dim still appear) and all of
    them with `-m slow`."""
    slow = _slow_ids()
    seen = set()
    for item in items:
        node = item.nodeid.removeprefix("tests/")
        if node in slow:
            item.add_marker(pytest.mark.slow)
            seen.add(node)
    whole = not config.getoption("keyword") and all(
        os.path.abspath(a) == os.path.dirname(__file__) or a in ("tests", "tests/")
        for a in config.args)
    if whole and slow - seen:
        raise pytest.UsageError(f"{SLOW_LIST} names tests that do not exist: "
                                f"{', '.join(sorted(slow - seen))}")
    for item in items:
        cls = getattr(item, "cls", None)
        spec = getattr(item, "callspec", None)
        if (cls is not None and cls.__name__ == "TestInterpretGPU" and spec is not None
                and item.originalname == "test_matches_reference" and spec.indices
                and next(iter(spec.indices.values())) % 2):
            item.add_marker(pytest.mark.slow)
