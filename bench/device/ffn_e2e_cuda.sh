#!/usr/bin/env bash
# The FFN pool's GPU tests without vLLM, on a lent H200 host (Python 3.12, torch 2.11 + CUDA,
# cmake, no package registry): the FFN step (graphs, plan changes, no host sync) and the
# attention -> FFN round trip over the shm transport with several FFN worker processes on one
# GPU (copies by CUDA IPC), against the fp64 dense layer. msgspec and prometheus_client come
# from wheels carried in .devcarry/mini (pip download ... msgspec prometheus_client).
#   bash bench/device/ffn_e2e_cuda.sh      # writes $OUT/ffn_e2e_cuda.log
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# what the host lacks, from the carried wheels (pytest and safetensors only where missing)
need=".devcarry/mini/msgspec-*.whl .devcarry/mini/prometheus_client-*.whl"
python3 -c 'import pytest' 2>/dev/null || need="$need $(ls .devcarry/mini/{pytest,pluggy,iniconfig,packaging}-*.whl | tr '\n' ' ')"
python3 -c 'import safetensors' 2>/dev/null || need="$need $(ls .devcarry/mini/safetensors-*.whl)"
python3 -m pip install -q --no-deps --no-index --target /tmp/site $need 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
source bench/device/build_afore.sh || exit 1
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$OUT/ffn_e2e_cuda.log"
timeout "${GPU_TIMEOUT:-200}" python3 -m pytest -p no:cacheprovider -x -v -rA -m gpu -o faulthandler_timeout=60 \
  tests/transport/test_ffn_end_to_end.py tests/ffn/test_step_gpu.py 2>&1 | tee -a "$OUT/ffn_e2e_cuda.log"
echo "pytest exit code: ${PIPESTATUS[0]}" | tee -a "$OUT/ffn_e2e_cuda.log"
