#!/usr/bin/env bash
# Runs afore's GPU/host benchmarks on a lent H200 machine (Python 3.12, torch, triton, nanobind,
# no package registry). Carries: .whl (cp312 wheels of msgspec), .devcarry/tinyq (a tiny checkpoint
# made here by afore.models.tiny). Builds the C++ extensions in place with plain cmake, then runs
# the parts named in $PARTS, writing reports under $OUT.
#   PARTS="migration nccl" bash bench/device/h200.sh    (migration, nccl: 2 GPUs)
set -euo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
cmake -S . -B /tmp/afore-build -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v python3)" > /tmp/cmake.log
cmake --build /tmp/afore-build -j 16 > /tmp/build.log
cp /tmp/afore-build/_*.so afore/
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for part in ${PARTS:-transport migration nccl}; do
  case "$part" in
    transport) python3 -m afore.bench.transport --producers 4 --readers 8 --experts 128 --iters 10000 \
                 --name transport_h200 --out-dir "$OUT" ;;
    migration) python3 -m afore.bench.migration --out-dir "$OUT" ;;
    nccl) python3 -m afore.bench.migration --parts worker --worker-backends nccl,gloo,ffn-node \
            --model .devcarry/tinyq --name migration_worker_h200x2 --out-dir "$OUT" ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
