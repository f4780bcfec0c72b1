"""What every kernel folder shares: the dispatch contract, the online softmax of the
attention kernels, the merge of partial softmaxes, and the bytes-moved record.

Dispatch contract (every op's `api.py`):
- `implementation="xla"` runs the op's pure-jnp reference path (any backend);
- `implementation="pallas"` runs a kernel: the GPU body (Pallas on Triton) or the TPU body
  (Pallas on Mosaic TPU), chosen by `platform` ("gpu" | "tpu"; default: the backend's);
- `interpret=True` runs that body in Pallas interpret mode, on any backend (the CPU tests);
  on the CPU without it (and without an explicit `platform`, as `jax.export` lowerings for
  cuda and tpu pass) the call raises a one-line `KernelError`, never a silent fallback.

Attention layout (one letter vocabulary, `jaxdec.layers`): B rows, N query heads, K kv heads,
G = N // K query heads per kv head (head n reads kv head n // G), H head dim, S slots.
Scores and softmax are in float32; masked scores never enter the softmax (their
probabilities are set to 0, not exp(-big)), so a row that sees nothing gives output 0 and
log-sum-exp -inf.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxdec.errors import JaxdecError

IMPLEMENTATIONS = ("xla", "pallas")
PLATFORMS = ("gpu", "tpu")
MASKED = -1e30  # the running max of a row that has seen nothing yet (finite: no inf - inf)


class KernelError(JaxdecError):
    """A kernel asked for with arguments it cannot take (raised at trace time)."""


def check(cond: bool, op: str, msg: str):
    """Raise `KernelError("op: msg")` unless `cond`."""
    if not cond:
        raise KernelError(f"{op}: {msg}")


def resolve(op: str, implementation: str, interpret: bool, platform: str | None) -> str | None:
    """The platform whose body runs ("gpu" | "tpu"), or None for the XLA path."""
    check(implementation in IMPLEMENTATIONS, op,
          f"implementation={implementation!r}, expected one of {IMPLEMENTATIONS}")
    if implementation == "xla":
        return None
    if platform is None:  # the default backend's body; an explicit platform is trusted
        backend = jax.default_backend()  # (that is how `jax.export` lowers for cuda and tpu)
        platform = {"cuda": "gpu", "rocm": "gpu"}.get(backend, backend)
        if platform not in PLATFORMS:
            check(interpret, op, f"there is no Pallas kernel for the {backend} backend: pass "
                  "interpret=True (Pallas interpret mode) or implementation='xla'")
            platform = "tpu"
    check(platform in PLATFORMS, op, f"platform={platform!r}, expected one of {PLATFORMS}")
    return platform


def check_dtype(op: str, name: str, x, allowed) -> None:
    allowed = tuple(np.dtype(d) for d in allowed)
    check(np.dtype(x.dtype) in allowed, op,
          f"{name} has dtype {np.dtype(x.dtype).name}, expected one of "
          f"{', '.join(d.name for d in allowed)}")


def check_shape(op: str, name: str, x, shape: tuple) -> None:
    check(tuple(x.shape) == tuple(shape), op, f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)}")


def check_head_dim(op: str, h: int, platform: str | None) -> None:
    """Head dims the kernels tile: a multiple of 16 (so int4 halves stay lane-aligned on
    the GPU too); on the GPU (Triton tiles) also a power of two up to 256."""
    if platform is None:
        return
    check(h % 16 == 0, op, f"head_dim={h} must be a multiple of 16 for the Pallas kernel")
    if platform == "gpu":
        check(h <= 256 and h & (h - 1) == 0, op,
              f"head_dim={h} must be a power of two <= 256 for the GPU kernel")


def check_block(op: str, name: str, block: int, platform: str | None) -> None:
    """A key block: a multiple of 128 on the TPU (lanes of the transposed tiles), a power
    of two >= 16 on the GPU (Triton's dot)."""
    if platform == "tpu":
        check(block > 0 and block % 128 == 0, op, f"{name}={block} must be a multiple of 128 on the TPU")
    elif platform == "gpu":
        check(block >= 16 and block & (block - 1) == 0, op,
              f"{name}={block} must be a power of two >= 16 on the GPU")


def gpu_group_rows(g: int) -> int:
    """Query rows per kv head on the GPU: Triton's dot wants at least 16, a power of two."""
    return max(16, 1 << (g - 1).bit_length())


def softmax_step(carry, q, k, v, span, scale: float, v_hs: bool = False):
    """One key block of online (flash) softmax attention.

    carry: (m [G, 1] running max, l [G, 1] running sum, acc [G, H] unnormalised output),
    all float32; q: [G, H]; k: [S_b, H]; v: [S_b, H], or [H, S_b] when `v_hs` (the dense
    cache's V); span: (start, lo, hi): the block holds slots start .. start + S_b - 1, of
    which those in [lo, hi) are visible. See `softmax_step_parts` for the numerics.
    """
    m, l, acc = carry
    m, l, (acc,) = softmax_step_parts((m, l, (acc,)), (q,), (k,), (v,), span, scale, v_hs)
    return m, l, acc


def step_parts(carry, qs, ks, vs, span, scale: float):
    """`softmax_step_parts` on a carry whose acc is one array (one value part) or a tuple."""
    m, l, acc = carry
    m, l, accs = softmax_step_parts((m, l, acc if isinstance(acc, tuple) else (acc,)), qs, ks, vs,
                                    span, scale)
    return m, l, accs if isinstance(acc, tuple) else accs[0]


def _dot(a, b, contract: tuple[int, int]):
    """a . b over the given axes in a's dtype (b cast to it), accumulated in float32; float32
    operands at highest precision (no TF32 rounding on the GPU)."""
    high = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b.astype(a.dtype), (((contract[0],), (contract[1],)), ((), ())),
                               precision=high, preferred_element_type=jnp.float32)


def softmax_step_parts(carry, qs, ks, vs, span, scale: float, v_hs: bool = False):
    """`softmax_step` with the head dim split into parts that are never concatenated (the
    two nibble halves of a 4-bit cache): scores are the sum over i of qs[i] [G, H_i] .
    ks[i] [S_b, H_i]; each value part vs[j] [S_b, H_j] ([H_j, S_b] when `v_hs`) has its
    own accumulator. carry: (m [G, 1], l [G, 1], accs: a tuple of f32[G, H_j]).

    The dots run in the query's dtype (keys, probabilities and values cast to it: bf16
    queries use the tensor cores / MXU at full rate), accumulating in float32; the softmax
    is float32. Invisible keys get probability exactly 0 and their values are zeroed first:
    a block may run past the written slots, whose contents are arbitrary (even NaN).
    """
    m, l, accs = carry
    start, lo, hi = span
    n = ks[0].shape[0]
    dt = qs[0].dtype

    def visible(shape, axis):
        slot = start + jax.lax.broadcasted_iota(jnp.int32, shape, axis)
        return (slot >= lo) & (slot < hi)

    s = _dot(qs[0], ks[0], (1, 1))
    for q, k in zip(qs[1:], ks[1:]):
        s = s + _dot(q, k, (1, 1))
    valid = visible((1, n), 1)
    s = jnp.where(valid, s * scale, MASKED)
    m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
    p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
    alpha = jnp.exp(m - m_new)
    rows = valid if v_hs else visible((n, 1), 0)
    pvs = [_dot(p.astype(dt), jnp.where(rows, v.astype(dt), jnp.zeros((), dt)), (1, 1 if v_hs else 0))
           for v in vs]
    accs = tuple(alpha * acc + pv for acc, pv in zip(accs, pvs))
    return m_new, alpha * l + p.sum(axis=1, keepdims=True), accs


def finish(m, l, acc):
    """(output [.., H] f32, log-sum-exp [.., 1] f32) from a finished carry; rows that saw
    nothing give 0 and -inf."""
    seen = l > 0
    out = jnp.where(seen, acc / jnp.where(seen, l, 1.0), 0.0)
    return out, jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)


def merge(outs: jax.Array, lses: jax.Array, axis: int):
    """Merge partial attentions over disjoint key sets along `axis`: outs [..., P, ..., H]
    with lses [..., P, ..., 1] (-inf where a part saw nothing) -> (out, lse) without it."""
    top = jnp.max(lses, axis=axis, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp(lses - top)  # 0 for the empty parts
    total = jnp.sum(w, axis=axis, keepdims=True)
    out = jnp.sum(outs * w, axis=axis, keepdims=True) / jnp.where(total > 0, total, 1.0)
    lse = jnp.where(total > 0, top + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    return jnp.squeeze(out, axis), jnp.squeeze(lse, axis)


def group_queries(q: jax.Array, k_heads: int) -> jax.Array:
    """[B, N, H] -> [B, K, G, H]: the query heads that read each kv head."""
    b, n, h = q.shape
    return q.reshape(b, k_heads, n // k_heads, h)


@dataclasses.dataclass(frozen=True)
class Bytes:
    """What one call must move between HBM and the cores, from shapes (and lengths):
    `read` (inputs: only the slots, pages or blocks a kernel has to touch) and `written`.
    Divided by the measured copy bandwidth it is the floor the kernel is timed against."""

    read: int
    written: int

    @property
    def total(self) -> int:
        return self.read + self.written

    def floor_s(self, bandwidth: float) -> float:
        """The time this many bytes take at `bandwidth` bytes/s."""
        return self.total / bandwidth


def nbytes(shape, dtype) -> int:
    return int(math.prod(shape)) * np.dtype(dtype).itemsize


# ---- the launch scaffolding the attention ops share ------------------------------------
def split_count(rows: int, blocks: int, n_splits: int | None) -> int:
    """GPU splits per (row, kv head): enough programs for ~2 waves on a 132-SM GPU."""
    if n_splits is None:
        n_splits = -(-264 // rows)
    return max(1, min(n_splits, blocks))


def _out_shapes(lead: tuple, g: int, h: int, parts: int):
    """(block dims, array dims) of the output [*lead, (parts,) g, h / parts]."""
    tail = (g, h) if parts == 1 else (parts, g, h // parts)
    return tail, lead + tail


def gpu_attention_call(kernel, args, in_specs, *, b: int, kh: int, g: int, h: int, splits: int,
                       parts: int = 1, interpret: bool, name: str):
    """Launch a split-K Triton attention kernel on grid (row, kv head, split) whose refs end
    with o_ref f32[(parts,) Gp, H / parts] and lse_ref f32[Gp, 1] (Gp the padded query
    rows), then merge the splits -> (out f32[B, K, G, H], lse f32[B, K, G, 1])."""
    from jax.experimental.pallas import triton as plgpu

    rows = gpu_group_rows(g)
    tail, shape = _out_shapes((b, kh, splits), rows, h, parts)
    at = lambda i, j, p: (i, j, p) + (0,) * len(tail)
    out, lse = pl.pallas_call(
        kernel, grid=(b, kh, splits), in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, None) + tail, at),
                   pl.BlockSpec((None, None, None, rows, 1), lambda i, j, p: (i, j, p, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct(shape, jnp.float32),
                   jax.ShapeDtypeStruct((b, kh, splits, rows, 1), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret, name=name)(*args)
    if parts > 1:  # the head parts joined
        out = jnp.moveaxis(out, 3, -2).reshape(b, kh, splits, rows, h)
    out, lse = merge(out, lse, axis=2)
    return out[:, :, :g], lse[:, :, :g]


def gpu_init_carry(rows: int, h: int, parts: int = 1):
    """The online-softmax carry before any key: (m, l, acc), or (m, l, accs) with parts."""
    acc = lambda w: jnp.zeros((rows, w), jnp.float32)
    m = jnp.full((rows, 1), MASKED, jnp.float32)
    return (m, jnp.zeros((rows, 1), jnp.float32),
            acc(h) if parts == 1 else tuple(acc(h // parts) for _ in range(parts)))


def store(o_ref, lse_ref, m, l, acc):
    """Write a finished carry (acc, or a tuple of parts) to the kernel's outputs."""
    for i, a in enumerate(acc if isinstance(acc, tuple) else (acc,)):
        out, lse = finish(m, l, a)
        if isinstance(acc, tuple):
            o_ref[i] = out
        else:
            o_ref[...] = out
    lse_ref[...] = lse


def tpu_attention_call(kernel, args, in_specs, *, grid: tuple, n_prefetch: int, g: int, h: int,
                       parts: int = 1, interpret: bool, name: str):
    """Launch a Mosaic attention kernel on grid (row, kv head, step), the last axis the
    reduction, with `n_prefetch` scalar-prefetched arrays first in `args`; its refs end
    with o_ref, lse_ref and the scratch m_ref, l_ref f32[G, 1], acc_ref f32[(parts,) G,
    H / parts] -> (out f32[B, K, G, H], lse f32[B, K, G, 1])."""
    from jax.experimental.pallas import tpu as pltpu

    b, kh, _ = grid
    tail, shape = _out_shapes((b, kh), g, h, parts)
    fixed = lambda i, j, n, *refs: (i, j) + (0,) * len(tail)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=n_prefetch, grid=grid, in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None) + tail, fixed),
                   pl.BlockSpec((None, None, g, 1), lambda i, j, n, *refs: (i, j, 0, 0))],
        scratch_shapes=[pltpu.VMEM((g, 1), jnp.float32), pltpu.VMEM((g, 1), jnp.float32),
                        pltpu.VMEM(tail, jnp.float32)])
    out, lse = pl.pallas_call(
        kernel, grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(shape, jnp.float32),
                   jax.ShapeDtypeStruct((b, kh, g, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret, name=name)(*args)
    if parts > 1:
        out = jnp.moveaxis(out, 2, -2).reshape(b, kh, g, h)
    return out, lse


def tpu_reduction(step, last, active, refs, body) -> None:
    """The reduction of a Mosaic attention kernel over its last grid axis: zero the scratch
    carry at step 0; where `active`, run `body(carry) -> carry` on the carry read from and
    written back to scratch; store the outputs at step `last`. refs: (o_ref, lse_ref,
    m_ref, l_ref, acc_ref), acc_ref [G, H] or [parts, G, H / parts] (then the carry's acc
    is a tuple of parts)."""
    o_ref, lse_ref, m_ref, l_ref, acc_ref = refs
    parts = acc_ref.ndim == 3
    read = lambda: tuple(acc_ref[i] for i in range(acc_ref.shape[0])) if parts else acc_ref[...]

    @pl.when(step == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASKED, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(active)
    def _step():
        m, l, acc = body((m_ref[...], l_ref[...], read()))
        m_ref[...], l_ref[...] = m, l
        for i, a in enumerate(acc if parts else (acc,)):
            if parts:
                acc_ref[i] = a
            else:
                acc_ref[...] = a

    @pl.when(step == last)
    def _finish():
        store(o_ref, lse_ref, m_ref[...], l_ref[...], read())
