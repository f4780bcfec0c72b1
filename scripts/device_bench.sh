#!/usr/bin/env bash
# Decode speed on a lent GPU (the `device` tool): jaxdec vs HF transformers, beside the HBM
# roofline, plus a copy-bandwidth measurement. Uses the device image's own python3 (JAX with
# CUDA, PyTorch, transformers); nothing is installed. Writes device_bench.{txt,json} to $OUT.
# Budget: under 5 minutes.
set -euo pipefail
OUT="${OUT:-./device_bench_out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/nvidia_smi.txt" || true
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
timeout 280 python3 scripts/device_bench.py --out "$OUT"
