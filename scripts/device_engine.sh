#!/usr/bin/env bash
# The serving engine on a lent GPU (the `device` tool): decode step times at 1-16 rows, and
# closed loops of 1 and 16 clients (issue 42's 16 / 1 >= 5x). Uses the device image's own
# python3 (JAX with CUDA); nothing is installed. Writes device_engine.{txt,json} to $OUT.
# Budget: under 5 minutes.
set -euo pipefail
OUT="${OUT:-./device_engine_out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/nvidia_smi.txt" || true
export PYTHONUNBUFFERED=1
timeout 280 python3 scripts/device_engine.py --out "$OUT"
