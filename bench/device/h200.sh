#!/usr/bin/env bash
# Runs afore's GPU/host benchmarks on a lent H200 machine (Python 3.12, torch, triton, nanobind,
# no package registry), staged by bench/device/stage.sh (carried wheels, C++ build). The nccl part
# also carries .devcarry/tinyq (a tiny checkpoint made here by afore.models.tiny). Runs the parts
# named in $PARTS, writing reports under $OUT:
#   transport: demand mailbox and plan ring latency, plan decode on the reader (issue 13, item 3)
#   scheduler: the C++ core's plan latency on one core of this host (issue 13, item 4; synthetic
#              traces: ../shared/traces does not travel; no MILP, no policies)
#   migration, nccl: copy engine and NCCL worker benches (nccl: 2 GPUs)
#   PARTS="transport scheduler" bash bench/device/h200.sh
set -euo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/h200-out}; mkdir -p "$OUT"
source bench/device/stage.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for part in ${PARTS:-transport migration nccl}; do
  case "$part" in
    transport) python3 -m afore.bench.transport --producers 4 --readers 8 --experts 128 --iters 10000 \
                 --name transport_h200 --out-dir "$OUT" ;;
    scheduler) taskset -c 1 python3 -m afore.cli bench scheduler --no-policies --holdout 0 --time-limit 1 \
                 --out-dir "$OUT" ;;
    migration) python3 -m afore.bench.migration --out-dir "$OUT" ;;
    nccl) python3 -m afore.bench.migration --parts worker --worker-backends nccl,gloo,ffn-node \
            --model .devcarry/tinyq --name migration_worker_h200x2 --out-dir "$OUT" ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
