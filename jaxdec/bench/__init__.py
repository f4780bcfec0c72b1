"""Benchmarks: jaxdec against its peers (see `jaxdec.bench.peers`)."""
