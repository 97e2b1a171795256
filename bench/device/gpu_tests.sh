#!/usr/bin/env bash
# The GPU tests (pytest -m gpu, tests/gpu) on a lent H200 host: Python 3.12, torch 2.11.0+cu130,
# no package registry. vLLM 0.26.0 comes from the offline bundle (../shared/tools/vllm-cuda-bundle,
# make.sh -> .devcarry/vllm-bundle; its pieces copied to /tmp/w by earlier calls, this one
# carrying unpack.sh and the checksums). Tiny checkpoints are built here, on the host.
#   GPU_ARCHS=qwen3_moe GPU_DTYPES=bfloat16,float32 GPU_MODES=eager,graphs bash bench/device/gpu_tests.sh
# Writes under $OUT: gpu_tests.log, gpu_tests.jsonl (one line per comparison / fault), junit XML, logs.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
source bench/device/stage.sh || exit 1
[ -d /tmp/site/vllm ] || { echo "vLLM is not unpacked yet (bench/device/stage.sh)"; exit 1; }
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, vllm, afore; print('torch', torch.__version__, 'vllm', vllm.__version__)"; } | tee "$OUT/gpu_env.txt"
rm -f "$OUT/gpu_tests.jsonl"
GPU_RESULTS="$OUT/gpu_tests.jsonl" GPU_LOGS="$OUT" timeout "${GPU_TIMEOUT:-540}" \
  python3 -m pytest -p no:cacheprovider -q -rA -m gpu tests/gpu --junitxml="$OUT/gpu_junit.xml" 2>&1 | tee "$OUT/gpu_tests.log"
rc=${PIPESTATUS[0]}
echo "pytest exit code: $rc" | tee -a "$OUT/gpu_tests.log"
exit $rc
