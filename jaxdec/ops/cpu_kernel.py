"""A CPU kernel for matmuls against quantised or dense weights, called from jitted code through
XLA FFI.

XLA's CPU backend has no fast path for int8/int4 weights at small batch: it materialises the
dequantised f32 matrix on every call.  `qmatmul` computes ``x @ W`` straight from the stored
codes with an AVX-512 (or portable scalar) C++ kernel, multi-threaded over the output columns.
`dense_matmul` runs the same kernel on plain float32 / bfloat16 weights W[K, N]: at small M
XLA's own dot streams the weights at about half the memory bandwidth (matrix-vector products
are memory-bound), and for bfloat16 weights it converts them to f32 first.

Weight format (shared with the `QArray` type; W is logical [K, N], y = x @ W):

* bits=8: ``q`` int8[K, N]
* bits=4: ``q`` uint8[K//2, N]; byte (i, n) holds the code of row 2i in its low nibble and of
  row 2i+1 in its high nibble; codes are unsigned 0..15.
* ``scale`` float16[K//g, N]; ``offset`` float16[K//g, N] or None.
* ``W[k, n] = q[k, n] * scale[k // g, n] + offset[k // g, n]``.

The kernel keeps x in f32 (no activation quantisation) and accumulates in f32 (bfloat16 weights
are widened exactly): its result differs from the float64 reference by f32 rounding only.
The exception is the AMX path (`has_amx`: batched decode and prefill, 16 rows of x or more, on
CPUs with AMX): there x and the dequantised weights are rounded to bf16 first, as in a bf16
framework Linear, and the tiles sum in f32.

`attention` is a decode-attention kernel over the dense KV cache in the same library (same
thread pool): it reads only the keys and values the queries can see.

The shared library is compiled on first use with the system C++ compiler into
``$JAXDEC_KERNEL_CACHE`` (default ``~/.cache/jaxdec/kernels``), under a name keyed by the
source, the compiler, the flags and the jaxlib version.  When there is no compiler, or the
build fails, `available()` is False, `reason()` says why, and `qmatmul` uses `qmatmul_xla`
(`dense_matmul`, `jnp.dot`).

Environment:

* ``JAXDEC_CPU_KERNEL=0``: never build or use the kernel.
* ``JAXDEC_CPU_THREADS``: threads per call (default: the CPUs this process may run on).
* ``JAXDEC_CPU_SPIN_US``: how long idle workers spin before sleeping (default 100).
* ``JAXDEC_CPU_ADAPTIVE=0``: never fall back to one thread on an oversubscribed machine.
* ``JAXDEC_CPU_SLAB_BYTES``: dense weights, M <= 4: bytes of W per slab of rows when K is split
  across threads (default 524288; 0: always split N).
* ``JAXDEC_CPU_AMX=0``: never use AMX tiles; ``JAXDEC_CPU_AMX_MIN_M`` (default 16): rows of x
  from which bf16 and quantised products use them (see `has_amx`).
* ``JAXDEC_QMM_IMPL=scalar``: force the portable path (for tests).
* ``CXX``: the compiler (default ``g++``, then ``c++``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from jaxdec.formats.qarray import dequantize_rows

__all__ = [
    "available", "reason", "info", "qmatmul", "qmatmul_xla", "dequantize", "dense_matmul",
    "dense_matmul_xla", "expert_matmul", "expert_matmul_xla", "ragged_matmul", "ragged_matmul_xla",
    "attention", "paged_attention", "set_threads", "set_spin_us", "set_adaptive",
    "MAX_KERNEL_M", "MAX_AVX2_KERNEL_M", "MAX_SCALAR_KERNEL_M", "MAX_DENSE_KERNEL_M",
    "MAX_ATTENTION_T", "has_simd", "isa",
]

SOURCE = Path(__file__).parent / "csrc" / "qmatmul.cc"
TARGET = "jaxdec_qmatmul"
DENSE_TARGET = "jaxdec_dense_matmul"
ATTENTION_TARGET = "jaxdec_attention"
PAGED_ATTENTION_TARGET = "jaxdec_paged_attention"
EXPERT_TARGET = "jaxdec_expert_matmul"
RAGGED_TARGET = "jaxdec_ragged_matmul"
FLAGS = ("-O3", "-shared", "-fPIC", "-std=c++17", "-pthread", "-fno-math-errno")

# Rows of x (after folding leading dimensions) from which `qmatmul` uses the XLA path
# (dequantise + dot) instead of the kernel, on CPUs without AMX.  Measured with
# scripts/bench_qmatmul.py on a 2-vCPU Sapphire Rapids: the kernel wins clearly up to M = 64, is
# level around M = 128..256 and 10-25% slower at M = 512 (both are then FMA-bound on f32; XLA's
# GEMM blocks better).  With AMX (see `has_amx`) the kernel takes every M: from 16 rows on it
# multiplies in bf16 tiles, 1.5-2x XLA's f32 GEMM.
MAX_KERNEL_M = 256

# The same on CPUs with AVX2 and no AVX-512 (`isa()` "avx2": AMD Zen 1-3, Intel client parts).
# Measured with scripts/bench_qmatmul.py on a 2-vCPU AMD EPYC, before the AVX2 panel path:
# int8/int4 weights, the kernel is 1.3-2.4x XLA's dequantise + dot at M = 16 (3.6-7x on the
# 49152-column LM head), ahead or level at M = 32, and from 0.75x to 1.3x at M = 128. With the
# panel path and `after`, engine prompt chunks [1, 32] and [1, 64] took the same time through
# the kernel as through XLA (within the host's noise), so the limit stays: below it a chunk's
# rows are a decode step's bit for bit.
MAX_AVX2_KERNEL_M = 128

# The same where the kernel runs its portable scalar loops (`isa()` "scalar": x86 without
# AVX2, and every non-x86 CPU). Its one win there is a row or a few against weights read from
# memory: XLA dequantises the whole matrix to f32 on every call (a SmolLM2 Q4_1 decode step
# [1, 1]: 384 ms through XLA, ~65 ms through the scalar loops), but from 16 rows XLA's
# dequantise + dot is ahead (step [16, 1]: 595 ms against 677, and a 32-token prompt chunk
# [1, 32] 2.5-3x), measured on the AMD EPYC with the scalar loops forced. Dense float32
# weights stay in the kernel below 64 rows whatever the CPU: its sums of a row do not depend
# on the row count up to 8 rows, which is what makes a speculative verification chunk give
# the decode steps' logits bit for bit (XLA's need not).
MAX_SCALAR_KERNEL_M = 16

# The same for `dense_matmul` (XLA: `jnp.dot`), by weight dtype.  Measured on the SmolLM2
# shapes with the kernel and XLA in separate processes on a quiet machine: float32, the kernel
# is ahead at M = 1 and 8 (up to 2.6x on the LM head at M = 8), level at M = 32 and behind on
# most shapes from M = 64 (XLA's GEMM, 2x at M = 512): `scripts/bench_qmatmul.py --m 1,8,32,64
# --variants "f32 dot,kf32"`.  Below 64 the kernel keeps them: XLA's first call of a loaded
# executable spends ~0.25 s building its GEMM runtimes, which every prompt under 64 tokens then
# skips (`jaxdec bench` line "CLI TTFT s warm").  bfloat16 with bfloat16 activations, on a
# CPU with AMX: XLA's dot runs on AMX (XNNPACK) and wins from M = 8 (1.2-2.6x at 8-32, 3x at
# 64).  Without AMX it loses to the kernel at every M from 8 to 64 (1.0-3.4x on SmolLM2's
# shapes, a host with AVX512-BF16 but no AMX: `scripts/bench_qmatmul.py --m 8,32,64
# --variants "bf16x dot,kbf16"`), so bfloat16 then takes float32's limit.
# bfloat16 weights with float32 activations: XLA widens the matrix to f32 on every call, so the
# kernel keeps them (see `_dense_limit`).
MAX_DENSE_KERNEL_M = {"float32": 64, "bfloat16": 8}

# Query rows per sequence (T) up to which `attention` runs the kernel: decode steps and short
# verification chunks.  Longer chunks (prefill) are GEMM-shaped, which XLA's dots do well.
MAX_ATTENTION_T = 16

# Weight dtypes the dense kernel reads, and the `dtype` attribute of each.
_DENSE_DTYPES = {jnp.dtype(jnp.float32): 0, jnp.dtype(jnp.bfloat16): 1}

_IMPLS = {"auto": 0, "scalar": 1, "simd": 2, "avx2": 3}

# When the default backend is the CPU, programs call the kernel directly. Set PORTABLE to
# stage `jax.lax.platform_dependent(cpu=kernel, default=xla)` instead: one program for every
# backend (needed to `jax.export` for GPU/TPU from a CPU process).
PORTABLE = False

_lock = threading.Lock()
_state: dict | None = None


def _cache_dir() -> Path:
    d = os.environ.get("JAXDEC_KERNEL_CACHE")
    return Path(d) if d else Path.home() / ".cache" / "jaxdec" / "kernels"


def _compiler() -> str | None:
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx) or (cxx if os.path.isfile(cxx) else None)
    return shutil.which("g++") or shutil.which("c++")


def _compiler_id(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.stdout else cxx
    except (OSError, subprocess.SubprocessError):
        return cxx


def _build(cxx: str, out: Path) -> str | None:
    """Compiles SOURCE into `out` (atomically); returns an error message or None."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *FLAGS, "-I", jax.ffi.include_dir(), str(SOURCE), "-o", tmp]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            tail = (res.stderr or res.stdout).strip().splitlines()[-20:]
            return f"compiler failed ({' '.join(cmd)}):\n" + "\n".join(tail)
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)  # atomic: concurrent builders of the same key both succeed
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return f"compiler could not run ({' '.join(cmd)}): {e}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load() -> dict:
    """Builds (if needed), loads and registers the kernel; never raises."""
    st: dict = {"ok": False, "reason": "", "path": None, "build_s": 0.0, "lib": None}
    if os.environ.get("JAXDEC_CPU_KERNEL", "1").strip().lower() in ("0", "false", "no", "off"):
        st["reason"] = "disabled by JAXDEC_CPU_KERNEL"
        return st
    try:
        src = SOURCE.read_bytes()
    except OSError as e:
        st["reason"] = f"kernel source missing: {e}"
        return st
    cxx = _compiler()
    if cxx is None:
        st["reason"] = "no C++ compiler found (set CXX or install g++)"
        return st
    key = hashlib.sha256()
    for part in (src, _compiler_id(cxx).encode(), cxx.encode(), " ".join(FLAGS).encode(),
                 jaxlib.__version__.encode(), jax.ffi.include_dir().encode()):
        key.update(part)
        key.update(b"\0")
    path = _cache_dir() / f"qmatmul-{key.hexdigest()[:20]}.so"
    st["path"] = str(path)
    try:
        lib = None
        if path.exists():
            try:
                lib = ctypes.cdll.LoadLibrary(str(path))
            except OSError:  # a damaged cache entry: build it again
                lib = None
        if lib is None:
            t0 = time.perf_counter()
            err = _build(cxx, path)
            st["build_s"] = time.perf_counter() - t0
            if err:
                st["reason"] = err
                return st
            lib = ctypes.cdll.LoadLibrary(str(path))
        lib.jaxdec_qmm_raw.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_longlong] * 3 + [
            ctypes.c_int, ctypes.c_longlong, ctypes.c_int]
        lib.jaxdec_qmm_raw.restype = None
        lib.jaxdec_dense_raw.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_longlong] * 3 + [ctypes.c_int] * 2
        lib.jaxdec_dense_raw.restype = None
        lib.jaxdec_qmm_set_min_parallel_bytes.argtypes = [ctypes.c_longlong]
        lib.jaxdec_qmm_set_dense.argtypes = [ctypes.c_int] * 3
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.jaxdec_qmatmul), platform="cpu")
        jax.ffi.register_ffi_target(DENSE_TARGET, jax.ffi.pycapsule(lib.jaxdec_dense_matmul),
                                    platform="cpu")
        jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(lib.jaxdec_attention),
                                    platform="cpu")
        jax.ffi.register_ffi_target(PAGED_ATTENTION_TARGET, jax.ffi.pycapsule(lib.jaxdec_paged_attention),
                                    platform="cpu")
        jax.ffi.register_ffi_target(EXPERT_TARGET, jax.ffi.pycapsule(lib.jaxdec_expert_matmul),
                                    platform="cpu")
        jax.ffi.register_ffi_target(RAGGED_TARGET, jax.ffi.pycapsule(lib.jaxdec_ragged_matmul),
                                    platform="cpu")
    except Exception as e:  # noqa: BLE001 -- any failure means "not available"
        st["reason"] = f"could not load/register {path}: {type(e).__name__}: {e}"
        return st
    st.update(ok=True, lib=lib)
    return st


def _get() -> dict:
    global _state
    if _state is None:
        with _lock:
            if _state is None:
                _state = _load()
    return _state


def available() -> bool:
    """True when the CPU kernel is built, loaded and registered (builds it on first call)."""
    return _get()["ok"]


def usable() -> bool:
    """The kernel is `available()` and the program being traced runs on one device per
    shard: not under a mesh whose axes XLA's SPMD partitioner splits (a custom call is a
    single-device program; the partitioner would gather its operands onto every device).
    Inside a `shard_map` the axes are manual and the kernel runs on each local shard."""
    from jaxdec.sharding import split_axes

    return not getattr(_XLA_ONLY, "on", False) and available() and not split_axes()


_XLA_ONLY = threading.local()


class xla_only:
    """`with xla_only():` traces XLA's ops only, no kernel custom calls: for programs that
    are differentiated (training steps), since a custom call has no derivative."""

    def __enter__(self):
        self.was = getattr(_XLA_ONLY, "on", False)
        _XLA_ONLY.on = True

    def __exit__(self, *exc):
        _XLA_ONLY.on = self.was


def reason() -> str:
    """Why the kernel is not available ('' when it is)."""
    return _get()["reason"]


def info() -> dict:
    """Build and runtime facts: ok, reason, path, build_s, simd, threads."""
    st = _get()
    out = {k: st[k] for k in ("ok", "reason", "path", "build_s")}
    if st["ok"]:
        lib = st["lib"]
        out["simd"] = bool(lib.jaxdec_qmm_has_simd())
        out["isa"] = isa()
        out["amx"] = has_amx()
        out["threads"] = int(lib.jaxdec_qmm_pool_threads())
        stats = (ctypes.c_longlong * 3)()
        lib.jaxdec_qmm_stats(stats)
        # parallel calls so far, how many of them straggled or had the caller preempted, and
        # how often that made the pool fall back to one thread for a while
        out["parallel_calls"], out["bad_parallel_calls"], out["serial_fallbacks"] = map(int, stats)
    return out


def isa() -> str:
    """The instruction set the kernel's matmuls run on this CPU: "avx512", "avx2" or
    "scalar" (portable loops); "" without the kernel. Each takes x up to its own row count
    (`MAX_KERNEL_M`, `MAX_AVX2_KERNEL_M`, `MAX_SCALAR_KERNEL_M`). The decode attention runs
    on the same instruction set."""
    st = _get()
    if not st["ok"]:
        return ""
    if "isa" not in st:
        st["isa"] = ("scalar", "avx2", "avx512")[int(st["lib"].jaxdec_qmm_isa())]
    return st["isa"]


def has_simd() -> bool:
    """True when the kernel runs its AVX-512 code on this CPU."""
    return isa() == "avx512"


def has_amx() -> bool:
    """True when the kernel multiplies bf16 and quantised weights in AMX tiles from 16 rows
    of x on (the CPU has AMX-BF16 and the OS granted the tile state): x and the dequantised
    weights are then rounded to bf16, and the products summed in f32. JAXDEC_CPU_AMX=0 turns
    the path off, JAXDEC_CPU_AMX_MIN_M moves the threshold (both read at load)."""
    st = _get()
    if not st["ok"]:
        return False
    if "amx" not in st:
        lib = st["lib"]
        st["amx"] = bool(lib.jaxdec_qmm_has_amx()) and lib.jaxdec_qmm_amx_min_m() > 0
    return st["amx"]


def set_threads(n: int) -> None:
    """Caps the threads a call uses (0: all the pool's; the pool size is fixed at first use
    from JAXDEC_CPU_THREADS or the CPU count)."""
    if available():
        _get()["lib"].jaxdec_qmm_set_active_threads(int(n))


def set_adaptive(on: bool) -> None:
    """Whether the pool falls back to one thread while the machine looks oversubscribed
    (default on; JAXDEC_CPU_ADAPTIVE=0 at load turns it off)."""
    if available():
        _get()["lib"].jaxdec_qmm_set_adaptive(int(bool(on)))


def set_spin_us(us: int) -> None:
    """How long idle workers spin for the next call before sleeping."""
    if available():
        _get()["lib"].jaxdec_qmm_set_spin_us(int(us))


# ---------------------------------------------------------------------------------------------
# XLA path (the numerical truth; also what runs on GPU/TPU)
# ---------------------------------------------------------------------------------------------

def dequantize(q, scale, offset=None, *, bits: int, group_size: int = 32,
               dtype=jnp.float32) -> jax.Array:
    """W f32[K, N] from the stored codes (see the module docstring for the layout)."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    rows = jnp.asarray(q).shape[0] * (2 if bits == 4 else 1)
    if rows % group_size:
        raise ValueError(f"group_size {group_size} does not divide K={rows}")
    return dequantize_rows(jnp.asarray(q), jnp.asarray(scale), offset, bits,
                           group_size).astype(dtype)


def qmatmul_xla(x, q, scale, offset=None, *, bits: int, group_size: int = 32,
                precision=None, ordered: bool = False) -> jax.Array:
    """``x @ dequantize(...)`` accumulated in f32 by XLA (any backend). `ordered`: the
    dequantisation not run before x is (see `after`; for XLA:CPU)."""
    deq = functools.partial(dequantize, bits=bits, group_size=group_size)
    w = after(x, deq, q, scale, offset) if ordered else deq(q, scale, offset)
    return jnp.matmul(jnp.asarray(x, jnp.float32), w, precision=precision,
                      preferred_element_type=jnp.float32)


# ---------------------------------------------------------------------------------------------
# Kernel path
# ---------------------------------------------------------------------------------------------

def _check(x, q, scale, offset, bits, group_size):
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if q.ndim != 2 or scale.ndim != 2:
        raise ValueError(f"q and scale must be 2-D, got {q.shape} and {scale.shape}")
    K = x.shape[-1]
    kq = K if bits == 8 else K // 2
    if (bits == 4 and K % 2) or q.shape[0] != kq:
        raise ValueError(f"x has K={K} but q has shape {q.shape} for bits={bits}")
    if group_size <= 0 or K % group_size or (bits == 4 and group_size % 2):
        raise ValueError(f"group_size {group_size} must divide K={K} (and be even for 4 bits)")
    N = q.shape[1]
    if scale.shape != (K // group_size, N):
        raise ValueError(f"scale shape {scale.shape} != {(K // group_size, N)}")
    if offset is not None and offset.shape != scale.shape:
        raise ValueError(f"offset shape {offset.shape} != scale shape {scale.shape}")
    want_q = jnp.int8 if bits == 8 else jnp.uint8
    if q.dtype != want_q:
        raise TypeError(f"bits={bits} codes must be {jnp.dtype(want_q).name}, got {q.dtype}")
    for name, a in (("scale", scale), ("offset", offset)):
        if a is not None and a.dtype != jnp.float16:
            raise TypeError(f"{name} must be float16, got {a.dtype}")


def _impl_code(impl: str | None) -> int:
    impl = impl or os.environ.get("JAXDEC_QMM_IMPL", "auto") or "auto"
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {sorted(_IMPLS)}, got {impl!r}")
    return _IMPLS[impl]


def _dispatch(x, operands, n, max_m, kernel, xla, cpu_xla=None):
    """y[..., n] = x[..., K] @ (the weights in `operands`).

    `kernel(x2, *operands)` (x2: f32[M, K], the leading dimensions folded) on CPU when the
    kernel is available and M < max_m, `xla(x2, *operands)` on other backends; the choice
    between them is staged with `jax.lax.platform_dependent`, so one jitted program serves all.
    Otherwise `xla(x, *operands)`, and `cpu_xla(x, *operands)` instead on CPU when given (not
    under a mesh that splits axes)."""
    lead, K = x.shape[:-1], x.shape[-1]
    M = int(np.prod(lead, dtype=np.int64)) if lead else 1
    from jaxdec.sharding import split_axes

    if M == 0 or split_axes():
        return xla(x, *operands)
    if M >= max_m or not usable():
        return xla(x, *operands) if cpu_xla is None else _staged(cpu_xla, xla, x, *operands)
    x2 = x.astype(jnp.float32).reshape(M, K)
    return _staged(kernel, xla, x2, *operands).reshape(*lead, n)


def after(x, fn, *args):
    """`fn(*args)`, computed once x is: for the weights' own ops before a product with x
    (dequantising).

    XLA:CPU's default scheduler (the concurrency-optimised one) runs every op as soon as its
    operands are ready, and ops that read parameters alone are ready at once: every layer's
    weights were dequantised at the start of a prompt chunk and all kept live (SmolLM2 Q4_1,
    [1, 256]: 428 MB of temporaries, touched anew on every run, and the chunk 1.5x slower).
    A conditional on x whose two branches are both `fn` runs after x, and its value is
    `fn`'s whatever the predicate. (Only the weights' ops go inside: a product inside a
    conditional ran slower.) Under vmap the conditional becomes a select of two equal
    values, which XLA folds back to one."""
    x0 = jnp.ravel(x)[0].astype(jnp.float32)
    return jax.lax.cond(x0 == x0, fn, fn, *args)


def _staged(kernel, xla, *args):
    """kernel(*args) when tracing for this CPU; with PORTABLE or another default backend,
    both staged with `jax.lax.platform_dependent` (the kernel on CPU, xla elsewhere). Only
    the kernel is traced otherwise: tracing the unused XLA branch too cost ~1 s of every CLI
    start-up."""
    if PORTABLE or jax.default_backend() != "cpu":
        return jax.lax.platform_dependent(*args, cpu=kernel, default=xla)
    return kernel(*args)


def _ffi(x2, q, scale, offset, *, bits, group_size, impl):
    M, N = x2.shape[0], q.shape[1]
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((M, N), jnp.float32),
                            vmap_method="expand_dims")
    has_offset = offset is not None
    # Without an offset the slot gets `scale` again (ignored by the kernel): no dummy buffer.
    return call(x2, q, scale, offset if has_offset else scale,
                bits=np.int64(bits), group_size=np.int64(group_size),
                has_offset=bool(has_offset), impl=np.int64(impl))


def qmatmul(x, q, scale, offset=None, *, bits: int, group_size: int = 32,
            impl: str | None = None) -> jax.Array:
    """y f32[..., N] = x[..., K] @ W, W stored quantised (layout in the module docstring).

    On CPU this runs the C++ kernel (when `available()` and the folded row count is below
    MAX_KERNEL_M); on any other backend, or without the kernel, `qmatmul_xla`.  The choice
    between CPU and other backends is staged with `jax.lax.platform_dependent`, so one jitted
    program serves both.  Works under jit, inside loops, and under vmap (the kernel folds vmapped
    rows of x into M when the weights are shared, and loops over batched weights otherwise).

    impl: "auto" (default; JAXDEC_QMM_IMPL overrides), "scalar" (portable C++ loops), "simd"
    (the best this CPU has: AVX-512 or AVX2) or "avx2" (the AVX2 code even where AVX-512 is
    there; scalar loops without AVX2).
    """
    x = jnp.asarray(x)
    q = jnp.asarray(q)
    scale = jnp.asarray(scale)
    offset = None if offset is None else jnp.asarray(offset)
    _check(x, q, scale, offset, bits, group_size)
    code = _impl_code(impl)
    xla = functools.partial(qmatmul_xla, bits=bits, group_size=group_size)
    kernel = functools.partial(_ffi, bits=bits, group_size=group_size, impl=code)
    return _dispatch(x, (q, scale, offset), q.shape[1], _quantised_limit(), kernel, xla,
                     functools.partial(xla, ordered=True))


def _quantised_limit() -> int:
    """Rows from which `qmatmul` hands over to XLA's dequantise + dot."""
    if has_amx():
        return 1 << 62
    return {"avx512": MAX_KERNEL_M, "avx2": MAX_AVX2_KERNEL_M}.get(isa(), MAX_SCALAR_KERNEL_M)


def dense_matmul_xla(x, w, *, precision=None) -> jax.Array:
    """``x @ w`` accumulated in f32 by XLA (any backend)."""
    return jnp.dot(jnp.asarray(x), jnp.asarray(w), precision=precision,
                   preferred_element_type=jnp.float32)


def _dense_ffi(x2, w, *, impl):
    call = jax.ffi.ffi_call(DENSE_TARGET, jax.ShapeDtypeStruct((x2.shape[0], w.shape[1]), jnp.float32),
                            vmap_method="expand_dims")
    return call(x2, w, dtype=np.int64(_DENSE_DTYPES[jnp.dtype(w.dtype)]), impl=np.int64(impl))


def _dense_limit(x_dtype, w_dtype) -> int:
    """Rows from which `dense_matmul` hands over to XLA's dot."""
    name = jnp.dtype(w_dtype).name
    if name == "bfloat16" and jnp.dtype(x_dtype) != jnp.bfloat16:
        # XLA would widen the matrix every call; the kernel (AMX from 16 rows) does not.
        return (1 << 62) if has_amx() else 128
    if name == "bfloat16" and not has_amx():
        name = "float32"
    return MAX_DENSE_KERNEL_M[name]


def dense_matmul(x, w, *, impl: str | None = None) -> jax.Array:
    """y f32[..., N] = x[..., K] @ w, for dense weights w float32 or bfloat16 [K, N].

    The f32 products are accumulated in f32, x is taken in f32 (bfloat16 weights are widened
    exactly), so the result differs from the exact product by f32 rounding only.  Dispatch as
    in `qmatmul`: the C++ kernel on CPU (when `available()` and the folded row count is below
    MAX_DENSE_KERNEL_M[w.dtype]), `dense_matmul_xla` (``jnp.dot(x, w, preferred_element_type=f32)``)
    otherwise and on other backends; so are weights of any other dtype.  Works under jit, in
    loops and under vmap.

    impl: as for `qmatmul`.
    """
    x = jnp.asarray(x)
    w = jnp.asarray(w)
    if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"dense_matmul: x {x.shape} and w {w.shape} do not make x[..., K] @ w[K, N]")
    code = _impl_code(impl)
    if jnp.dtype(w.dtype) not in _DENSE_DTYPES:
        return dense_matmul_xla(x, w)
    return _dense_differentiable(x, w, code)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _dense_differentiable(x, w, code):
    """The kernel dispatch, differentiable: the FFI call has no derivative of its own, and
    the product's is the product rule, dx @ w + x @ dw, by XLA (which reverse mode
    transposes), so gradients flow through any model that runs on the kernel."""
    kernel = functools.partial(_dense_ffi, impl=code)
    max_m = _dense_limit(x.dtype, w.dtype)
    return _dispatch(x, (w,), w.shape[1], max_m, kernel, dense_matmul_xla)


@_dense_differentiable.defjvp
def _dense_jvp(code, primals, tangents):
    (x, w), (dx, dw) = primals, tangents
    return (_dense_differentiable(x, w, code),
            dense_matmul_xla(dx, w) + dense_matmul_xla(x, dw))


def expert_matmul_xla(x, w, idx) -> jax.Array:
    """``y[s] = x[s] @ w[idx[s]]`` by XLA (a gathered copy of the chosen experts)."""
    return jnp.einsum("smk,skn->smn", x.astype(jnp.float32), w[idx].astype(jnp.float32))


def _expert_kernel(target: str, xla, x, w, ints, out_shape, impl: str | None) -> jax.Array:
    """The expert kernels' shared tail: `target`(x, w, ints) -> f32[out_shape] on CPU,
    `xla(x, w, ints)` where the kernel cannot run (other backends, other weight dtypes)."""
    if not usable() or jnp.dtype(w.dtype) not in _DENSE_DTYPES or x.size == 0:
        return xla(x, w, ints)

    def kernel(x, w, ints):
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(out_shape, jnp.float32),
                                vmap_method="sequential")
        return call(x, w, ints, dtype=np.int64(_DENSE_DTYPES[jnp.dtype(w.dtype)]),
                    impl=np.int64(_impl_code(impl)))

    return _staged(kernel, xla, x.astype(jnp.float32), w, ints)


def expert_matmul(x, w, idx, *, impl: str | None = None) -> jax.Array:
    """y f32[S, M, N] with y[s] = x[s] @ w[idx[s]]: x [S, M, K], w [E, K, N] float32 or
    bfloat16, idx i32[S]. The C++ kernel on CPU reads each chosen expert in place (a
    decoding MoE step reads only the experts its tokens use); `expert_matmul_xla` elsewhere.
    Indices must lie in [0, E) (the kernel checks and fails the call otherwise)."""
    x, w, idx = jnp.asarray(x), jnp.asarray(w), jnp.asarray(idx, jnp.int32)
    if x.ndim != 3 or w.ndim != 3 or idx.shape != x.shape[:1] or x.shape[2] != w.shape[1]:
        raise ValueError(f"expert_matmul: x {x.shape}, w {w.shape}, idx {idx.shape} do not make "
                         "x[S, M, K] @ w[idx[S], K, N]")
    return _expert_kernel(EXPERT_TARGET, expert_matmul_xla, x, w, idx,
                          (*x.shape[:2], w.shape[2]), impl)


def ragged_matmul_xla(x, w, group_sizes) -> jax.Array:
    """``jax.lax.ragged_dot`` accumulated in f32 (grouped matmuls on GPU and TPU)."""
    return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)


def ragged_matmul(x, w, group_sizes, *, impl: str | None = None) -> jax.Array:
    """y f32[R, N]: x [R, K] holds each expert's rows in turn (group_sizes i32[E] of them),
    w [E, K, N] float32 or bfloat16; each group of rows times its expert, rows past the
    groups zero (`jax.lax.ragged_dot`'s contract). On CPU the C++ kernel runs each expert
    once over exactly its rows; XLA:CPU's own lowering of ragged_dot multiplies every row by
    every expert and masks. Elsewhere `ragged_matmul_xla`."""
    x, w = jnp.asarray(x), jnp.asarray(w)
    sizes = jnp.asarray(group_sizes, jnp.int32)
    if x.ndim != 2 or w.ndim != 3 or sizes.shape != w.shape[:1] or x.shape[1] != w.shape[1]:
        raise ValueError(f"ragged_matmul: x {x.shape}, w {w.shape}, group_sizes {sizes.shape} do not "
                         "make x[R, K] grouped by w[E, K, N]")
    return _expert_kernel(RAGGED_TARGET, ragged_matmul_xla, x, w, sizes, (x.shape[0], w.shape[2]),
                          impl)


def _attention_ffi(q, *flat, scale: float, impl: int):
    call = jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            vmap_method="sequential")
    return call(q, *flat, scale=np.float32(scale), impl=np.int64(impl))


def attends(t: int, dtype) -> bool:
    """Whether `attention` runs the kernel for chunks of t queries over keys of `dtype`."""
    return t <= MAX_ATTENTION_T and jnp.dtype(dtype) in _DENSE_DTYPES and usable()


def attention(q, blocks, *, scale: float, xla, impl: str | None = None) -> jax.Array:
    """Attention of q [B, T, N, H] over key blocks (k [B, Kh, S, H], v [B, Kh, H, S], mask
    bool[B, T, S]) sharing one softmax, k and v float32 or bfloat16: f32[B, T, N, H].

    On CPU, when the kernel is available and T <= MAX_ATTENTION_T, the C++ kernel (one pass
    over the visible keys and values per (sequence, kv head); keys no query sees are never
    read). Otherwise, and on other backends, `xla(q, *blocks)`, the reference. `scale`
    multiplies the scores (1/sqrt(H) for standard attention).
    """
    b, t, n, h = q.shape
    ok = (b * t * n * h > 0 and all(k.dtype == v.dtype and attends(t, k.dtype) for k, v, _ in blocks))
    if not ok:
        return xla(q, *blocks)
    flat = [a for k, v, m in blocks for a in (k, v, m.astype(bool))]
    kernel = functools.partial(_attention_ffi, scale=float(scale), impl=_impl_code(impl))
    q32 = q.astype(jnp.float32)
    if PORTABLE or jax.default_backend() != "cpu":
        unflat = lambda q_, *f: xla(q_, *zip(f[0::3], f[1::3], f[2::3]))
        return jax.lax.platform_dependent(q32, *flat, cpu=kernel, default=unflat)
    return kernel(q32, *flat)


def paged_attention(q, k_pages, v_pages, table, mask, *, scale: float, xla, impl: str | None = None) -> jax.Array:
    """`attention` of q [B, T, N, H] over one block kept in a page pool: k and v pools
    [Kh, pages, ps, H] (float32 or bfloat16, a key and a value are rows), each row's page
    table i32[B, width] (every entry a pool page) and mask bool[B, T, width * ps] -> f32[B,
    T, N, H]. On CPU the kernel reads the visible slots where they lie, with the dense
    kernel's sums in its order (a paged cache decodes bit for bit as a dense one); where it
    cannot run, `xla()` (no arguments: the caller's own gathered view)."""
    b, t, n, h = q.shape
    ok = (b * t * n * h > 0 and k_pages.dtype == v_pages.dtype and attends(t, k_pages.dtype)
          and (k_pages.dtype != jnp.bfloat16 or h % 2 == 0))
    if not ok:
        return xla()
    call = jax.ffi.ffi_call(PAGED_ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            vmap_method="sequential")
    kernel = lambda: call(q.astype(jnp.float32), k_pages, v_pages, table.astype(jnp.int32), mask.astype(bool),
                          scale=np.float32(scale), impl=np.int64(_impl_code(impl)))
    if PORTABLE or jax.default_backend() != "cpu":
        return jax.lax.platform_dependent(cpu=kernel, default=xla)
    return kernel()
