#!/usr/bin/env bash
# Issue 13 on a lent GPU host (items 3 and 4), then issue 12's decode tile sweep, in one call:
#   - the host's CPU topology (which vCPUs share a physical core: the transport bench pins a
#     busy-polling process on each of 13 of them);
#   - `afore bench transport` (A = 4, F = 8, E = 128; plan decode on the reader) for this tree and,
#     when .devcarry/head holds a snapshot of an earlier commit (git archive), for that one too,
#     back to back on the same machine;
#   - `taskset -c 1 afore bench scheduler` (the C++ core's plan latency on one core; synthetic
#     traces, no MILP policies);
#   - bench/device/decode_sweep.py (GPU) for what is left of the call.
# Carry .devcarry/mini (wheels: msgspec, highspy, tqdm, ...) and .devcarry/head if wanted:
#   git archive HEAD -- afore csrc CMakeLists.txt pyproject.toml | tar -x -C .devcarry/head
#   bash bench/device/control_host.sh      # $OUT/control_host.tgz (every report) and decode_sweep.log
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/control-out}; mkdir -p "$OUT"
RES=/tmp/control-res; rm -rf "$RES"; mkdir -p "$RES"  # tarred into $OUT at the end (few files come back)
source bench/device/stage.sh || exit 1
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader; lscpu; lscpu -e; } > "$RES/host.txt" 2>&1
grep -E "Model name|Thread|Core|Socket|MHz" "$RES/host.txt" | head -8
if [ -d .devcarry/head/afore ]; then
  cmake -S .devcarry/head -B /tmp/afore-build-head -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v python3)" \
    > /tmp/cmake-head.log && cmake --build /tmp/afore-build-head -j "$(nproc)" > /tmp/build-head.log \
    && cp /tmp/afore-build-head/_*.so .devcarry/head/afore/ || tail -20 /tmp/cmake-head.log /tmp/build-head.log
  (cd .devcarry/head && PYTHONPATH=/tmp/site:$PWD timeout 120 python3 -m afore.bench.transport --producers 4 --readers 8 \
     --experts 128 --iters 10000 --name transport_head --out-dir "$RES")
fi
timeout 120 python3 -m afore.bench.transport --producers 4 --readers 8 --experts 128 --iters 10000 \
  --name transport_host --out-dir "$RES"
timeout "${SCHED_S:-150}" taskset -c 1 python3 -m afore.cli bench scheduler --no-policies --holdout 0 --time-limit 1 \
  --out-dir "$RES/sched"
tar czf "$OUT/control_host.tgz" -C "$RES" .  # again at the end: what ran comes back if the call is cut
OUT=$RES SWEEP_BUDGET_S=${SWEEP_BUDGET_S:-150} timeout 280 python3 bench/device/decode_sweep.py > "$RES/decode_sweep.log" 2>&1
cp "$RES/decode_sweep.log" "$OUT/" 2>/dev/null
tail -3 "$RES/decode_sweep.log"
tar czf "$OUT/control_host.tgz" -C "$RES" . && ls -R "$RES"
