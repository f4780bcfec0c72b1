"""Cross-platform lowering without the hardware: `jax.export` lowers a jitted function for
the `cuda` or `tpu` platform from this CPU machine. For a Pallas kernel that runs the
Pallas-to-Triton (GPU) or Pallas-to-Mosaic (TPU) lowering in full, so a body that uses an
op or a block shape the backend's Pallas lowering refuses fails here. What it cannot show
is the last step, which runs only when XLA compiles the module on the device: Triton's
PTX generation, and Mosaic's own layout passes (`apply_vector_layout`).
"""

from __future__ import annotations

import jax

TARGETS = {"gpu": ("cuda", "__gpu$xla.gpu.triton"), "tpu": ("tpu", "tpu_custom_call")}


def lower(fn, args, platform: str) -> str:
    """The StableHLO text of jit(fn)(*args) exported for `platform` ("gpu" | "tpu"); raises
    AssertionError when the kernel's custom call is not in it. `args` are arrays or
    `jax.ShapeDtypeStruct`s."""
    target, call = TARGETS[platform]
    exported = jax.export.export(
        jax.jit(fn), platforms=[target],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(call)])(*args)
    text = exported.mlir_module()
    assert call in text, f"no {call} in the {target} lowering"
    return text


def count_kernels(text: str, platform: str) -> int:
    """How many kernel launches (custom calls) a lowering holds."""
    return text.count(TARGETS[platform][1] + "(") + text.count(f"@{TARGETS[platform][1]}(")
