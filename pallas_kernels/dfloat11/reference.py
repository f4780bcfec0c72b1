"""The numerical truth of DFloat11 decompression: `jaxdec.formats.dfloat11.decompress`, the
library's pure-jnp decoder (every thread's codes decoded at once, a scan of the counts
places them). Bit-exact by construction: the kernel must give the very same bits."""

from __future__ import annotations

import jax

from jaxdec.formats import dfloat11


def decompress(a: dfloat11.DF11Array) -> jax.Array:
    """-> bf16[a.shape]."""
    return dfloat11.decompress(a)
