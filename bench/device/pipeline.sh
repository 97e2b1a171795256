#!/usr/bin/env bash
# The data plane on one GPU without vLLM: the FFN step and shm round-trip tests on CUDA, then
# `afore bench dataplane --part pipeline` (one attention end, F FFN worker processes on the same
# GPU, Qwen3-30B-A3B expert shapes) on this tree and, when .devcarry/before holds a `git archive`
# of an earlier commit, on that one too (the same bench file copied in): before/after in one run.
#   bash bench/device/pipeline.sh        # writes $OUT/dataplane_pipeline_h200*.{json,md}, $OUT/ffn_e2e_cuda.log
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
R=$PWD
source bench/device/stage.sh || exit 1
TOKENS=${TOKENS:-1,8,64,256}
# TESTS: pytest -k expression for the FFN step and round-trip tests (all of them by default; "none" skips)
[ "${TESTS:-}" = none ] || OUT=$OUT GPU_TIMEOUT=${GPU_TIMEOUT:-240} PYTEST_K="${TESTS:-}" bash bench/device/ffn_e2e_cuda.sh > /dev/null 2>&1
tail -3 "$OUT/ffn_e2e_cuda.log" 2>/dev/null
# FFNS: the FFN worker counts to run, one report each (F = 2: dataplane_pipeline_h200, else _f<F>)
# MBS: targets per MoE call to run (M = 2: no suffix, else _m<M>)
# SCHEDULES: serial and/or pingpong (serial: no suffix, else _pingpong); ATTN_US: emulated attention per
# target before its post (a GPU spin kernel; 0 = none; with it the FFN busy share measures the bubble)
# (on one GPU the spin kernel time-slices with the FFN workers' kernels, separate CUDA contexts without MPS:
# there it measures the contention, on 2 GPUs the overlap)
for f in ${FFNS:-2}; do for m in ${MBS:-2}; do for sch in ${SCHEDULES:-serial}; do
  name=dataplane_pipeline_h200; [ "$f" = 2 ] || name=${name}_f$f; [ "$m" = 2 ] || name=${name}_m$m
  [ "$sch" = serial ] || name=${name}_$sch
  timeout ${PIPE_TIMEOUT:-240} python3 -m afore.cli bench dataplane --part pipeline --device cuda --pipe-tokens $TOKENS \
    --pipe-ffn $f --pipe-microbatches $m --pipe-steps ${STEPS:-100} --pipe-schedule $sch \
    --pipe-attention-us ${ATTN_US:-0} --out-dir "$OUT" --name $name 2>&1 | grep "^T=\|up after"
done; done; done
if [ -d .devcarry/before/afore ]; then
  cp afore/_*.so .devcarry/before/afore/ && cp afore/bench/dataplane/pipeline.py afore/bench/dataplane/__init__.py \
    .devcarry/before/afore/bench/dataplane/
  (cd .devcarry/before && PYTHONPATH=/tmp/site:$PWD timeout ${PIPE_TIMEOUT:-240} python3 -m afore.cli bench dataplane \
    --part pipeline --device cuda --pipe-tokens $TOKENS --pipe-steps ${STEPS:-100} --out-dir "$OUT" \
    --name dataplane_pipeline_h200_before 2>&1 | tail -30)
fi
