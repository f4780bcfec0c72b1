"""The bytes each Pallas kernel must move at the shapes `scripts/device_kernels.py` times
(8 rows, GQA 32/8, head dim 128, a full 32k-token cache; an 8x8192x8192 matmul), from
each op's `bytes_moved` (shapes only: nothing is allocated), with the floor at a given
bandwidth and the ratios to bf16.

    python scripts/kernel_bytes.py [--bandwidth-tbs 4.8]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from jaxdec.formats.kvquant import QuantKV  # noqa: E402
from jaxdec.formats.qarray import QArray  # noqa: E402
from pallas_kernels import decode_attention as da  # noqa: E402
from pallas_kernels import paged_attention as pa  # noqa: E402
from pallas_kernels import quantized_kv_attention as qa  # noqa: E402
from pallas_kernels import quantized_matmul as qm  # noqa: E402
from pallas_kernels import sparse_attention as sa  # noqa: E402

B, N, K, S, H, PAGE, M, D = 8, 32, 8, 32768, 128, 64, 8, 8192
sds = jax.ShapeDtypeStruct


def rows():
    q, k, lengths = sds((B, N, H), jnp.bfloat16), sds((B, K, S, H), jnp.bfloat16), np.full(B, S)
    yield "decode_attention bf16", da.bytes_moved(q, k, lengths)
    table = np.arange(B * S // PAGE, dtype=np.int32).reshape(B, -1)
    yield f"paged_attention page {PAGE}", pa.bytes_moved(q, sds((K, B * S // PAGE + 1, PAGE, H), jnp.bfloat16),
                                                         table, lengths)
    for bits in (8, 4):
        scale = sds((B, K, S, H // 32), jnp.bfloat16)
        t = QuantKV(codes=sds((B, K, S, H * bits // 8), jnp.int8 if bits == 8 else jnp.uint8),
                    scale=scale, offset=None if bits == 8 else scale, bits=bits,
                    granularity="group", group_size=32)
        yield f"quantized_kv_attention int{bits} g32", qa.bytes_moved(q, t, t, lengths)
    kept = np.zeros((B, K, S // 128 // 8), np.int32)
    yield "block_sparse_attention 1/8 blocks", sa.bytes_moved(q, k, kept, np.full((B, K), kept.shape[2]))
    x = sds((M, D), jnp.bfloat16)
    for bits in (8, 4):
        params = sds((D // 128, D), jnp.float16)
        w = QArray(q=sds((D * bits // 8, D), jnp.int8 if bits == 8 else jnp.uint8), scale=params,
                   offset=None if bits == 8 else params, bits=bits, group_size=128, shape=(D, D))
        yield f"quantized_matmul int{bits} g128 M={M}", qm.bytes_moved(x, w)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bandwidth-tbs", type=float, default=4.8, help="HBM bandwidth (H200: 4.8)")
    args = ap.parse_args(argv)
    table = list(rows())
    bf16 = table[0][1].total
    print(f"{'kernel':<40} {'MB moved':>9} {'floor ms':>9} {'vs bf16 attn':>12}")
    for name, moved in table:
        print(f"{name:<40} {moved.total / 1e6:>9.1f} {moved.floor_s(args.bandwidth_tbs * 1e12) * 1e3:>9.3f} "
              f"{moved.total / bf16:>12.3f}")
    print(f"bf16 weight of the matmul: {D * D * 2 / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
