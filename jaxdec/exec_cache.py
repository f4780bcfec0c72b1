"""A disk cache of compiled executables, keyed without tracing.

JAX's persistent compilation cache keys an executable by its lowered program, so every
run still traces and lowers each jitted function before it can look the executable up
(about 0.7 s for the prefill of SmolLM2, most of a warm start-up). This cache keys the
*call* instead: the function's name, the jaxdec sources, the jax/jaxlib versions, the
backend, the environment and the kernel settings that change what gets traced, the
static arguments and the abstract signature (tree, shapes, dtypes, weak types) of the
dynamic ones. A hit deserializes the executable (`jax.experimental.serialize_executable`)
and runs it; a miss lowers and compiles the jit's program afresh (not through JAX's
persistent cache: see `_compile`), then stores it.

    exec_cache.enable(path)                 # `jaxdec.cli.enable_compile_cache` does this
    out = exec_cache.call(decode.start, *args, sampler=..., cfg=..., ...)

Until `enable` is called, `call(fn, *args, **static)` is plain `fn(*args, **static)`.
Entries are single-device programs, loaded onto the first local device: a model on a
device mesh calls its jitted functions directly (`api._run`).
Dynamic arguments go positionally, static ones by keyword; donation works as declared by
the jit. Entries are written atomically (temporary file, then rename); an entry that
cannot be read, fails its checksum or belongs to another key is ignored and rewritten.
A loaded executable is kept for the rest of the process.

A command that runs the same programs each time (`jaxdec generate` with one model and
settings) names itself with `prefetch(tag)` before it loads its model: the executables the
last run of that tag used (a list kept beside the entries) start loading on a background
thread, which deserialization lets run in parallel (it releases the GIL), so their load
overlaps the model's. A prefetched executable serves a call only when its stored key is
the call's; one the call does not ask for is dropped unused.

Every change to the jaxdec sources starts a new set of entries; past `MAX_BYTES` the
least recently used are deleted. Only load entries this user wrote: unpickling and
loading an executable runs code.
"""

from __future__ import annotations

import collections
import hashlib
import os
import pathlib
import pickle
import sys
import tempfile
import threading

import jax

_FORMAT = "jaxdec-exec-cache 1"
MAX_BYTES = 2 << 30  # beyond this, the least recently used entries are deleted
_PACKAGE = pathlib.Path(__file__).resolve().parent

_dir: pathlib.Path | None = None
_lock = threading.Lock()
_compile_lock = threading.Lock()
_loaded: dict[str, jax.stages.Compiled] = {}  # digest -> executable, for this process
_process_ident: str | None = None
_prefetching: dict[str, threading.Event] = {}  # digest -> set once its prefetch ended
_prefetched: dict[str, tuple[str, jax.stages.Compiled] | None] = {}  # digest -> (key, exe)
_tag: str | None = None  # the prefetch tag of this process: the digests it uses are kept
_limit = 4  # how many of them (`prefetch`'s limit)
_used: list[str] = []

stats: collections.Counter = collections.Counter()
"""How calls were served: memory, disk, compiled; stored entries; bad (unreadable) ones."""


def enable(directory) -> None:
    """Cache executables under `directory` (created on the first store)."""
    global _dir
    _dir = pathlib.Path(directory)


def disable() -> None:
    """Back to plain jit calls (executables already loaded are dropped)."""
    global _dir, _tag
    for done in list(_prefetching.values()):
        done.wait()
    _dir = _tag = None
    with _lock:
        _loaded.clear()
        _prefetching.clear()
        _prefetched.clear()
        _used.clear()


PREFETCH_MAX = 4  # executables a tag remembers, unless `prefetch` is told more


def prefetch(tag: str, limit: int = PREFETCH_MAX) -> threading.Thread | None:
    """Start loading, on a thread, the executables the last run that called
    `prefetch(tag)` used, in the order it used them; from now on the first `limit`
    digests this process uses are remembered for `tag` (a server warming up its step
    shapes uses more than a command's few). None (nothing to do) when the cache is off or
    the tag has no list yet."""
    global _tag, _limit
    if _dir is None:
        return None
    _tag, _limit = tag, limit
    try:
        digests = _recent_path(tag).read_text().split()[:limit]
    except OSError:
        return None
    digests = [d for d in digests if len(d) == 40 and all(c in "0123456789abcdef" for c in d)]
    if not digests:
        return None
    with _lock:
        digests = [d for d in digests if d not in _loaded and d not in _prefetching]
        _prefetching.update((d, threading.Event()) for d in digests)
    # not a daemon: the process waits for it at exit rather than tear XLA down under it
    thread = threading.Thread(target=_prefetch, args=(digests,), name="jaxdec-exec-prefetch")
    thread.start()
    return thread


def _prefetch(digests: list[str]) -> None:
    try:
        _settings()  # registers the CPU kernel's FFI targets, which the programs call
        for digest in digests:
            loaded = _read(digest, None)
            with _lock:
                _prefetched[digest] = loaded
            _prefetching[digest].set()
    finally:  # a prefetch only ever saves time: whatever failed is read again when called
        for digest in digests:
            _prefetching[digest].set()


def _recent_path(tag: str) -> pathlib.Path:
    """The tag's list, for these versions and jaxdec sources (`_process`): after an upgrade
    or an edit, the last run's executables are stale, never called again, and loading them
    would only add XLA's memory maps (~600-1,200 each: 64 of them ran a warm server past
    vm.max_map_count)."""
    return _dir / f"recent-{hashlib.sha256((tag + _process()).encode()).hexdigest()[:16]}.txt"


def _remember(digest: str) -> None:
    """Add `digest` to this process's list for its prefetch tag, rewritten atomically."""
    if _tag is None or digest in _used or len(_used) >= _limit:
        return
    _used.append(digest)
    try:
        _dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".recent.", suffix=".tmp", dir=_dir)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(_used) + "\n")
        os.replace(tmp, _recent_path(_tag))
    except OSError:
        pass


def directory() -> pathlib.Path | None:
    return _dir


def call(fn, *args, **static):
    """`fn(*args, **static)` for a jitted `fn`, through the cache when it is enabled."""
    exe = compiled(fn, *args, **static)
    return fn(*args, **static) if exe is None else exe(*args)


def compiled(fn, *args, **static) -> jax.stages.Compiled | None:
    """The executable `call` would run for these arguments (to call again and again with
    arguments of the same signature, skipping the key); None when the cache is off or a
    static argument has no stable repr (then the jit is the way to call it)."""
    if _dir is None:
        return None
    key = _key(fn, args, static)
    if key is None:  # a static argument without a stable repr: let jit key it
        return None
    digest = _digest(key)
    with _lock:
        exe = _loaded.get(digest)
    if exe is not None:
        stats["memory"] += 1
        return exe
    exe = _take_prefetched(digest, key)
    if exe is not None:
        stats["prefetched"] += 1
    elif (exe := _read(digest, key)) is not None:
        stats["disk"] += 1
    else:
        exe = _compile(fn, args, static)
        stats["compiled"] += 1
        _write(digest, key, exe)
    with _lock:
        _loaded[digest] = exe
    _remember(digest)
    return exe


def stored(fn, *args, **static) -> bool:
    """Whether `compiled` would find this executable loaded or on disk (no compile)."""
    key = None if _dir is None else _key(fn, args, static)
    if key is None:
        return False
    digest = _digest(key)
    with _lock:
        if digest in _loaded:
            return True
    return _path(digest).is_file()


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:40]


def _take_prefetched(digest: str, key: str) -> jax.stages.Compiled | None:
    """The prefetched executable of `digest` if it was stored under `key` (waiting for the
    prefetch when it has yet to reach it)."""
    with _lock:
        done = _prefetching.get(digest)
    if done is None:
        return None
    done.wait()
    with _lock:
        loaded = _prefetched.pop(digest, None)
    if loaded is None or loaded[0] != key:
        return None
    return loaded[1]


# ---------------------------------------------------------------------------- the key


def _key(fn, args, static) -> str | None:
    """Everything the executable of `fn(*args, **static)` depends on, as text."""
    statics = repr(sorted(static.items()))
    if " at 0x" in statics:  # a default object repr: not the same from one run to the next
        return None
    leaves, tree = jax.tree.flatten(args)
    avals = [jax.typeof(x) for x in leaves]
    sig = repr([(tuple(a.shape), str(a.dtype), a.weak_type) for a in avals])
    parts = [_FORMAT, f"{fn.__module__}.{fn.__qualname__}", _process(), _settings(),
             statics, str(tree), sig]
    if jax.device_count() > 1:  # which devices hold the inputs
        parts.append(repr(sorted({repr(getattr(x, "sharding", None)) for x in leaves})))
    return "\n".join(parts)


def _process() -> str:
    """What stays fixed for the life of a process: versions, backend, the jaxdec sources."""
    global _process_ident
    if _process_ident is None:
        import jaxlib

        devices = jax.devices()
        _process_ident = repr((
            jax.__version__, jaxlib.__version__, sys.version_info[:2], jax.default_backend(),
            devices[0].client.platform_version, [d.device_kind for d in devices],
            _sources_digest()))
    return _process_ident


def _sources_digest() -> str:
    """A hash of every jaxdec and pallas_kernels source file (the traced code and the
    kernels it calls)."""
    h = hashlib.sha256()
    kernels = _PACKAGE.parent / "pallas_kernels"
    files = (sorted(_PACKAGE.rglob("*.py")) + sorted((_PACKAGE / "ops" / "csrc").glob("*"))
             + sorted(kernels.rglob("*.py")))
    for f in files:
        if f.is_file():
            h.update(str(f.relative_to(_PACKAGE.parent)).encode() + b"\0")
            h.update(f.read_bytes() + b"\0")
    return h.hexdigest()


def _settings() -> str:
    """What tests and users may change within a process: environment, jax flags, kernel
    switches (cheap to read on every call)."""
    from jaxdec.ops import cpu_kernel

    env = sorted((k, v) for k, v in os.environ.items()
                 if k.startswith("JAXDEC_") or k == "XLA_FLAGS")
    flags = [getattr(jax.config, name) for name in (
        "jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl",
        "jax_numpy_dtype_promotion", "jax_numpy_rank_promotion")]
    # available() also registers the kernel's FFI targets, which a loaded executable calls
    kernel = (cpu_kernel.available(), cpu_kernel.has_amx(), cpu_kernel.PORTABLE,
              cpu_kernel.isa(), cpu_kernel.MAX_KERNEL_M, cpu_kernel.MAX_AVX2_KERNEL_M,
              cpu_kernel.MAX_SCALAR_KERNEL_M,
              sorted(cpu_kernel.MAX_DENSE_KERNEL_M.items()), cpu_kernel.MAX_ATTENTION_T)
    return repr((env, flags, kernel))


# ---------------------------------------------------------------------------- entries


def _compile(fn, args, static) -> jax.stages.Compiled:
    """Lower and compile as the jit would, but never reuse an executable that JAX loaded
    from its persistent cache: on XLA:CPU (jaxlib 0.10.2) such an executable serializes
    without some of its functions ("Function bitcast_gather_fusion not found" when the
    copy runs), so only a fresh compile is safe to store. JAX's persistent cache is off
    for this compile, and an option left at its default value keeps JAX's in-memory
    cache from handing back an executable a plain jit call loaded from disk."""
    from jax.experimental.compilation_cache import compilation_cache

    lowered = fn.lower(*args, **static)
    with _compile_lock:  # the switch is process-wide
        was = jax.config.jax_enable_compilation_cache
        compilation_cache.reset_cache()  # JAX decides once whether it uses its cache
        jax.config.update("jax_enable_compilation_cache", False)
        try:
            return lowered.compile({"xla_dump_max_hlo_modules": -1})
        finally:
            jax.config.update("jax_enable_compilation_cache", was)
            compilation_cache.reset_cache()


def _path(digest: str) -> pathlib.Path:
    return _dir / f"{digest}.exe"


def _read(digest: str, key: str | None):
    """The executable stored for `key`, loaded; None when absent or unusable. key=None
    (a prefetch, which knows the digest only): (its stored key, the executable)."""
    from jax.experimental import serialize_executable

    path = _path(digest)
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        os.utime(path)  # recently used: evicted last
    except OSError:  # a read-only cache still serves
        pass
    try:
        entry = pickle.loads(data)
        payload = entry["payload"]
        if (key is not None and entry["key"] != key) or (
                hashlib.sha256(payload).hexdigest() != entry["sha256"]):
            raise ValueError("stale or damaged entry")
        serialized, in_tree, out_tree = pickle.loads(payload)
        # the entries are single-device programs (mesh runs bypass the cache); without the
        # device named, a process with several devices would load one onto all of them
        exe = serialize_executable.deserialize_and_load(
            serialized, in_tree, out_tree, execution_devices=jax.local_devices()[:1])
        return exe if key is not None else (entry["key"], exe)
    except Exception:  # noqa: BLE001 -- any damage means a miss; the entry is rewritten
        stats["bad"] += 1
        return None


def _write(digest: str, key: str, exe: jax.stages.Compiled) -> None:
    """Store `exe` (best effort: an executable that cannot be serialized or a directory
    that cannot be written only costs the next run a compile)."""
    from jax.experimental import serialize_executable

    try:
        payload = pickle.dumps(serialize_executable.serialize(exe))
    except Exception:  # noqa: BLE001 -- e.g. programs with constants are not serializable
        return
    entry = pickle.dumps({"key": key, "sha256": hashlib.sha256(payload).hexdigest(),
                          "payload": payload})
    tmp = None
    try:
        _dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{digest}.", suffix=".tmp", dir=_dir)
        with os.fdopen(fd, "wb") as f:
            f.write(entry)
        os.replace(tmp, _path(digest))
        tmp = None
        stats["stored"] += 1
        _evict()
    except OSError:
        pass
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _evict() -> None:
    """Delete the least recently used files (entries, and temporary files a crash left
    behind) until the directory holds at most MAX_BYTES."""
    files = []
    for f in _dir.iterdir():
        try:
            st = f.stat()
        except OSError:
            continue
        files.append((st.st_mtime, st.st_size, f))
    total = sum(size for _, size, _ in files)
    for _, size, f in sorted(files):
        if total <= MAX_BYTES:
            break
        try:
            f.unlink()
            total -= size
        except OSError:
            pass
