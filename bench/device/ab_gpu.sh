#!/usr/bin/env bash
# afore bench ab --engine gpu on a lent H200 host: every policy (static, eplb, afore) on the real
# FFN pool (afore serve --role ffn: scheduler service, plan ring, F FFN worker processes with paced
# CUDA IPC copies and the grouped GEMM), driven through the real connector by the traces in
# ../shared/traces (synthetic ones when absent), Qwen3-30B-A3B and GLM-4.5-Air expert shapes with
# random bf16 weights, 4 MoE layers (GLM: 17.7 GB of checkpoint, written once under ~/.cache/afore).
# With fewer than F + 1 GPUs the F workers share them (--colocate, gloo staged through the host);
# the report says which. Not run yet: written and dry-run on CPU only (tests/bench/test_ab_gpu.py).
#   bash bench/device/ab_gpu.sh            # writes $OUT/ab_gpu_<model>.{json,md} and $OUT/ab_gpu.log
# Needs on the host, beside torch + CUDA: msgspec, prometheus_client, safetensors (carried in
# .devcarry/mini) and the admin endpoint's fastapi + uvicorn (policy switch, /metrics of the FFN
# node): pip download fastapi uvicorn starlette pydantic pydantic_core anyio sniffio h11 click
# typing_extensions typing_inspection annotated_types idna -d .devcarry/mini on a machine with
# registry access first; the script stops with that list when they are missing.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source bench/device/stage.sh || exit 1
python3 -c "import fastapi, uvicorn, msgspec, prometheus_client" || { echo "missing packages: carry their wheels in .devcarry/mini (see the header)" | tee "$OUT/ab_gpu.log"; exit 2; }
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; } | tee "$OUT/ab_gpu.log"
for model in Qwen3-30B-A3B GLM-4.5-Air; do
  timeout "${AB_TIMEOUT:-540}" python3 -m afore.cli bench ab --engine gpu --device cuda --gpu-model "$model" --layers 4 \
    --ffn-workers "${FFN_WORKERS:-2}" --steps 12 --warmup 2 --tokens 1024 --microbatches 2 --policies static,eplb,afore \
    --out-dir "$OUT" --name "ab_gpu_${model}" 2>&1 | tee -a "$OUT/ab_gpu.log"
  echo "exit code ($model): ${PIPESTATUS[0]}" | tee -a "$OUT/ab_gpu.log"
done
