#!/usr/bin/env bash
# The FFN step on a lent H200 (issue 12): the GPU tests of the step (graphs, no host sync,
# plan changes with copies) and `afore bench dataplane --part ffn`, reports under $OUT.
# vLLM (for the fused_moe comparison) comes from the team's bundle: carry the pieces
# .devcarry/vllm-bundle/piece-0N one per call, back to back (each call copies what it carries to
# /tmp/w), and unpack.sh, SHA256SUMS, BUNDLE_SHA256 with the last; this script unpacks once all
# are there. Without it the bench runs without the vLLM columns.
#   bash bench/device/ffn_h200.sh [bench args...]
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 TOKENIZERS_PARALLELISM=false
source bench/device/stage.sh || exit 1
[ -d /tmp/site/vllm ] || echo "vLLM bundle not unpacked: bench runs without vLLM"
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ffn/test_step_gpu.py 2>&1 | tee "$OUT/gpu_tests.log"
# --exact against vLLM's own fused_experts, bit for bit (needs the bundle: ffn_e2e_cuda.sh may run before it)
[ -d /tmp/site/vllm ] && timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -k "cuda and True" \
  tests/transport/test_ffn_end_to_end.py 2>&1 | tee -a "$OUT/gpu_tests.log"
timeout 270 python3 -c 'import sys; sys.argv[0] = "afore"; from afore.cli import main; sys.exit(main(sys.argv[1:]))' \
  bench dataplane --part ffn --out-dir "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
