"""Benchmarks: jaxdec against its peers (see `jaxdec.bench.peers`)."""

from __future__ import annotations

import os


def host() -> str:
    """The machine in one line, for reports: CPU model, usable cores, the CPU kernel's
    instruction set (numbers from AVX-512, AVX2 and scalar hosts differ several-fold)."""
    from jaxdec.ops import cpu_kernel

    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    isa = cpu_kernel.isa() or f"none ({cpu_kernel.reason().splitlines()[0]})"
    amx = ", AMX" if cpu_kernel.has_amx() else ""
    return f"{model}, {cores} cores; CPU kernel: {isa}{amx}"
