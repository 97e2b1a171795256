#!/usr/bin/env bash
# afore bench ab --engine gpu on a lent H200 host: every policy (static, eplb, afore) on the real
# FFN pool (afore serve --role ffn: scheduler service, plan ring, F FFN worker processes with paced
# CUDA IPC copies (50 GB/s, the default) and the grouped GEMM), driven serially (today's data
# plane: a layer's microbatches posted, then all replies awaited) through the real connector by the
# traces in ../shared/traces (synthetic ones when absent), random bf16 weights, 4 MoE layers.
# Every process writes its stage trace (AFORE_STAGE_TRACE: the driver, the FFN workers, the
# scheduler); the report calibrates the stage model from them (transport each way, plan decode,
# agreement, FFN stage outside the GEMM, reply send, scheduling) and compares the simulated step
# time per policy with the measured one, beside the committed reports' prior; it also writes
# $OUT/ab_gpu_<model>_stages.json (the calibration, for --stage-calibration of a later run).
# Data plane (AB_TRANSPORTS, default "shm"): shm is the one-node runtime's (afore serve --role ffn
# --transport shm: the driver attaches as the attention end of the node's segment, pinned host
# slots, sparse rows, the C++ waits); torch is the split roles' connector (NCCL with a GPU per
# process, else --colocate and gloo staged through the host). AB_TRANSPORTS="shm torch" runs both
# (reports ab_gpu_<model>_<transport>). The report says which.
# Both models in one 600 s device call: Qwen3-30B-A3B first (45 s with start-up on 2026-12-02),
# then GLM-4.5-Air, which first writes a 17.7 GB checkpoint under ~/.cache/afore (a fresh host has
# none) and loads it into the workers: it runs only with the time left (AB_BUDGET, default 560 s
# from the start of this script) and is OPTIONAL: AB_MODELS=Qwen3-30B-A3B skips it, and when it is
# cut off its report is simply absent (the log says so).
#   bash bench/device/ab_gpu.sh     # writes $OUT/ab_gpu_<model>_<transport>.{json,md}, ..._stages.json,
#                                   # ..._traces.tar.gz (the raw stage traces) and $OUT/ab_gpu.log
# Needs on the host, beside torch + CUDA: msgspec, prometheus_client, safetensors (carried in
# .devcarry/mini) and the admin endpoint's fastapi + uvicorn (policy switch, /metrics of the FFN
# node): pip download fastapi uvicorn starlette pydantic pydantic_core anyio sniffio h11 click
# typing_extensions typing_inspection annotated_types idna -d .devcarry/mini on a machine with
# registry access first; the script stops with that list when they are missing.
set -uo pipefail
T0=$(date +%s)
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source bench/device/stage.sh || exit 1
python3 -c "import fastapi, uvicorn, msgspec, prometheus_client" || { echo "missing packages: carry their wheels in .devcarry/mini (see the header)" | tee "$OUT/ab_gpu.log"; exit 2; }
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; } | tee "$OUT/ab_gpu.log"
BUDGET=${AB_BUDGET:-560}
for model in ${AB_MODELS:-Qwen3-30B-A3B GLM-4.5-Air}; do
 for transport in ${AB_TRANSPORTS:-shm}; do
  left=$(( BUDGET - ($(date +%s) - T0) ))
  name="ab_gpu_${model//./-}_${transport}${AB_SUFFIX:-}"  # report names: letters, digits, - and _
  if [ "$left" -lt 60 ]; then
    echo "skipped $name: ${left} s left of AB_BUDGET=${BUDGET} s (optional; run it alone with AB_MODELS=$model)" | tee -a "$OUT/ab_gpu.log"
    continue
  fi
  # SIGINT: the driver stops its FFN node on the way out (a SIGTERM would leave it holding the GPU)
  timeout -s INT -k 30 "$left" python3 -m afore.cli bench ab --engine gpu --device cuda --gpu-model "$model" --layers 4 \
    --ffn-workers "${FFN_WORKERS:-2}" --steps "${AB_STEPS:-12}" --warmup 2 --tokens "${AB_TOKENS:-1024}" --microbatches 2 \
    --policies static,eplb,afore --transport "$transport" ${AB_ARGS:-} --out-dir "$OUT" --name "$name" 2>&1 | tee -a "$OUT/ab_gpu.log"
  echo "exit code ($name): ${PIPESTATUS[0]} after $(( $(date +%s) - T0 )) s" | tee -a "$OUT/ab_gpu.log"
  tar -czf "$OUT/${name}_traces.tar.gz" -C "$OUT/tmp" "$name" 2>/dev/null || true
 done
done
rm -rf "$OUT/tmp"
