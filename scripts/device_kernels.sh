#!/usr/bin/env bash
# The Pallas kernels on a lent GPU (the `device` tool): each checked against its reference
# and timed against the XLA path and the bytes-moved floor at the copy bandwidth measured
# in the same run. Uses the device image's own python3 (JAX with CUDA); nothing is
# installed. Writes device_kernels.{txt,json} to $OUT. Budget: under 5 minutes.
set -euo pipefail
OUT="${OUT:-./device_kernels_out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/nvidia_smi.txt" || true
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee "$OUT/jax.txt"
export PYTHONUNBUFFERED=1
timeout 280 python3 scripts/device_kernels.py --out "$OUT"
