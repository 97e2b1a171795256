#!/usr/bin/env bash
# The FFN pool's GPU tests without vLLM, on a lent H200 host (Python 3.12, torch 2.11 + CUDA,
# cmake, no package registry): the FFN step (graphs, plan changes, no host sync) and the
# attention -> FFN round trip over the shm transport with several FFN worker processes on one
# GPU (copies by CUDA IPC), against the fp64 dense layer. What the host lacks comes from the
# wheels carried in .devcarry/mini (bench/device/stage.sh says which).
#   bash bench/device/ffn_e2e_cuda.sh      # writes $OUT/ffn_e2e_cuda.log
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source bench/device/stage.sh || exit 1
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$OUT/ffn_e2e_cuda.log"
# the --exact case compares with vLLM's own fused_experts: it needs vLLM (the bundle unpacked);
# before that it is left for bench/device/ffn_h200.sh, which runs it
sel=(); [ -z "${PYTEST_K:-}" ] || sel=(-k "$PYTEST_K")
python3 -c "import vllm" 2>/dev/null || { sel=(-k "${PYTEST_K:+($PYTEST_K) and }not (cuda and True)"); echo "vLLM not unpacked yet: the --exact CUDA case runs in ffn_h200.sh" | tee -a "$OUT/ffn_e2e_cuda.log"; }
timeout "${GPU_TIMEOUT:-300}" python3 -m pytest -p no:cacheprovider -v -rA -m gpu --timeout "${TEST_TIMEOUT:-150}" \
  -o faulthandler_timeout=100 "${sel[@]}" tests/ffn/test_step_gpu.py tests/transport/test_ffn_end_to_end.py 2>&1 | tee -a "$OUT/ffn_e2e_cuda.log"
echo "pytest exit code: ${PIPESTATUS[0]}" | tee -a "$OUT/ffn_e2e_cuda.log"
