#!/usr/bin/env bash
# Issue 13 item 3 on a lent GPU host's CPU: `afore bench transport` (A = 4, F = 8, E = 128: the plan
# decode on every reader, and published -> usable) for this tree and for an earlier commit's
# snapshot in .devcarry/head, interleaved (head, this, head, this) on the same warm machine.
# Carry .devcarry/mini and .devcarry/head:
#   git archive <commit> -- afore csrc CMakeLists.txt pyproject.toml | tar -x -C .devcarry/head
#   bash bench/device/plan_decode.sh     # $OUT/plan_decode.tgz: every report and host.txt
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/plan-decode-out}; mkdir -p "$OUT"
RES=/tmp/plan-decode-res; rm -rf "$RES"; mkdir -p "$RES"
source bench/device/stage.sh || exit 1
{ lscpu; lscpu -e; } > "$RES/host.txt" 2>&1
grep -E "Model name|Thread|Core|Socket" "$RES/host.txt" | head -5
if [ -d .devcarry/head/afore ]; then
  cmake -S .devcarry/head -B /tmp/afore-build-head -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v python3)" \
    > /tmp/cmake-head.log && cmake --build /tmp/afore-build-head -j "$(nproc)" > /tmp/build-head.log \
    && cp /tmp/afore-build-head/_*.so .devcarry/head/afore/ || tail -20 /tmp/cmake-head.log /tmp/build-head.log
fi
for round in 1 2; do
  if [ -d .devcarry/head/afore ]; then
    (cd .devcarry/head && PYTHONPATH=/tmp/site:$PWD timeout 120 python3 -m afore.bench.transport --producers 4 --readers 8 \
       --experts 128 --iters 10000 --name "transport_head_r$round" --out-dir "$RES") | tail -12
  fi
  timeout 120 python3 -m afore.bench.transport --producers 4 --readers 8 --experts 128 --iters 10000 \
    --name "transport_r$round" --out-dir "$RES" | tail -12
  tar czf "$OUT/plan_decode.tgz" -C "$RES" .
done
ls "$RES"
