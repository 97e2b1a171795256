#!/usr/bin/env bash
# `afore bench serve` on one H200: plain vLLM 0.26 against `afore serve --device cuda --attn-workers 1
# --ffn-workers 2 --colocate`, once per transport (shm: the one-node data plane; torch-gloo: staged
# through gloo), all with CUDA graphs (vLLM's default; afore: piecewise), bf16, on a random-weight
# checkpoint at Qwen3-30B-A3B's expert and attention shapes (hidden 2048, 32 query / 4 KV heads of
# 128, 128 experts of 768, top-8) with the first $LAYERS of its 48 layers and a small trained
# tokenizer, built here. Colocated AFD on one GPU measures afore's overhead (exchanges staged
# through the host, the FFN on the same GPU), not AFD's benefit. Every afore process writes its
# per-target stage stamps (AFORE_STAGE_TRACE); the per-stage medians of a decode target go to
# $OUT/serve_cuda_stages.{json,md}. The three servers run side by side with a fixed KV cache each
# (started together, vLLM's memory profiling of one would see the others' allocations).
# Needs bench/device/stage.sh's staging (vLLM unpacked) and the request sets in
# .devcarry/bench-data (gsm8k.jsonl; sharegpt_head.json = the first 8 MB of the packaged ShareGPT
# JSON; the loader stops at the cut).
#   LAYERS=4 PROMPTS=48 bash bench/device/serve_cuda.sh       # $OUT/serve_cuda.tgz + the reports
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0
OUT=${OUT:-/tmp/serve-out}; mkdir -p "$OUT"
source bench/device/stage.sh || exit 1
# everything goes under $OUT/serve, packed into $OUT/serve_cuda.tgz at the end (the device tool
# brings back at most 8 files); the three markdown reports are also copied to $OUT
FINAL=$OUT; OUT=$OUT/serve; mkdir -p "$OUT"
LAYERS=${LAYERS:-4}; PROMPTS=${PROMPTS:-48}; MODEL=/tmp/qwen3-30b-a3b-shape-l$LAYERS
# one afore server per variant: a transport, "+m2" for --microbatches 2 (ping-pong: split decode steps run eagerly),
# "+serial" for --no-pingpong, "+eager" for --enforce-eager, "+exact" for --exact (the default with shm and one microbatch), "+noexact" for --no-exact (afore's own grouped GEMM, per-worker partial sums), "+spin" for --spin-us 2000 (every wait
# busy-polls 2 ms before it blocks; afore.serve.launcher.spin_seconds), "+host" for --exchange host (the per-layer exchange on the Python host, split graphs), "+workers" for --planner workers (every FFN worker plans
# itself: no demand emission, scheduler or plan ring), "+nopace" for copies at full rate (no pacing kernels
# on the FFN workers' side streams: with several processes on one GPU, a kernel of one process
# waits for another's time slice)
VARIANTS=${VARIANTS:-shm shm+nopace torch-gloo+nopace}
DATASETS=${DATASETS:-gsm8k sharegpt}
t0=$(date +%s)
[ -f "$MODEL/config.json" ] || python3 - "$MODEL" "$LAYERS" <<'PY'
import sys
from afore.models.tiny import build_tiny_checkpoint
# Qwen3-30B-A3B: hidden 2048, 32 heads x 128 (4 KV), 128 experts x 768, top-8, 48 layers
print(build_tiny_checkpoint("qwen3_moe", path=sys.argv[1], hidden_size=2048, num_attention_heads=32,
                            num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                            moe_intermediate_size=768, num_hidden_layers=int(sys.argv[2]), initializer_range=0.02))
PY
echo "checkpoint ready after $(( $(date +%s) - t0 )) s"
common=(--dtype bfloat16 --max-model-len 2048 --seed 0)
memory=(--gpu-memory-utilization 0.2 --kv-cache-memory-bytes $((4 << 30)))
# CAPTURE=N: CUDA graphs for batch sizes up to N only, in every server (vLLM's default captures 51
# sizes, which afore's piecewise capture runs through the FFN pool: minutes of start-up)
if [ -n "${CAPTURE:-}" ] && python3 -m vllm.entrypoints.openai.api_server --help=all 2>/dev/null | grep -q -- --max-cudagraph-capture-size; then
  memory+=(--max-cudagraph-capture-size "$CAPTURE")
elif [ -n "${CAPTURE:-}" ]; then
  echo "CAPTURE=$CAPTURE ignored: this vLLM has no --max-cudagraph-capture-size"
fi
FFN=${FFN:-2}  # FFN worker processes of each afore server, all on this one GPU
# plain vLLM too writes its model-runner phases (afore's plugin, AFORE_STAGE_TRACE: no other effect)
rm -f /tmp/plain-stages.*
AFORE_STAGE_TRACE=/tmp/plain-stages python3 -m vllm.entrypoints.openai.api_server --model "$MODEL" --host 127.0.0.1 --port 8100 \
  "${common[@]}" "${memory[@]}" > "$OUT/plain-vllm.log" 2>&1 &
pids=($!); servers="vllm=http://127.0.0.1:8100"; port=8000
for v in $VARIANTS; do
  t=${v%%+*}; extra=()
  case "$v" in *+nopace*) extra+=(--copy-rate-gbps 0) ;; esac; case "$v" in *+exact*) extra+=(--exact) ;; esac
  case "$v" in *+noexact*) extra+=(--no-exact) ;; esac
  case "$v" in *+m2*) extra+=(--microbatches 2) ;; esac; case "$v" in *+serial*) extra+=(--no-pingpong) ;; esac
  case "$v" in *+eager*) extra+=(--enforce-eager) ;; esac; case "$v" in *+spin*) extra+=(--spin-us 2000) ;; esac
  case "$v" in *+workers*) extra+=(--planner workers) ;; esac; case "$v" in *+host*) extra+=(--exchange host) ;; esac
  rm -f /tmp/stages-$v.*
  AFORE_STAGE_TRACE=/tmp/stages-$v python3 -m afore.cli serve --model "$MODEL" --device cuda --attn-workers 1 \
    --ffn-workers $FFN --colocate --transport $t "${extra[@]}" --policy afore --host 127.0.0.1 --port $port --verbose \
    "${common[@]}" "${memory[@]/#/--vllm-arg=}" > "$OUT/afore-$v.log" 2>&1 &
  pids+=($!); servers="$servers,afore-$v=http://127.0.0.1:$port"; port=$((port + 10))
done
for url in ${servers//,/ }; do
  python3 -c "import sys, time, urllib.request
for _ in range(400):
    try:
        urllib.request.urlopen(sys.argv[1] + '/health', timeout=2); break
    except OSError: time.sleep(1)" "${url#*=}"
done
echo "servers up after $(( $(date +%s) - t0 )) s"
note="1 x NVIDIA H200, vLLM 0.26.0, torch 2.11.0+cu130, bf16, CUDA graphs${CAPTURE:+ up to batch $CAPTURE}. Random weights at Qwen3-30B-A3B shapes, first $LAYERS of 48 layers. afore: A=1, F=$FFN colocated on the same GPU, policy afore, one server per variant (${VARIANTS// /, }; CUDA tensors staged through the host): this measures afore's overhead against plain vLLM on one GPU, not AFD's benefit."
# a sampling profile (py-spy, carried in .devcarry/mini) of every process of the first afore
# server during the first 40 s of the benchmarks (plain vLLM runs first, for a few seconds)
spy=/tmp/site/bin/py-spy
if [ -x $spy ]; then
  for p in $(pgrep -P "${pids[1]}") ${pids[1]}; do
    $spy record --idle --nonblocking --format raw --rate 200 --duration 40 --pid $p -o "$OUT/pyspy-$p.txt" \
      > "$OUT/pyspy-$p.log" 2>&1 &
  done
  for p in $(pgrep -P "${pids[1]}"); do pgrep -P $p | while read -r q; do
    $spy record --idle --nonblocking --format raw --rate 200 --duration 40 --pid $q -o "$OUT/pyspy-$q.txt" > /dev/null 2>&1 &
  done; done
  ps -o pid,ppid,args --forest -g "$(ps -o sid= -p "${pids[1]}" | tr -d ' ')" > "$OUT/pyspy-processes.txt" 2>&1
fi
rc=0
for ds in $DATASETS; do
  path=.devcarry/bench-data/$([ $ds = gsm8k ] && echo gsm8k.jsonl || echo sharegpt_head.json)
  python3 -m afore.cli bench serve --servers "$servers" --dataset $ds --dataset-path "$path" --num-prompts "$PROMPTS" \
    --concurrency 8 --max-tokens 128 --name serve_cuda_$ds --out "$OUT" --note "$note" || rc=1
done
kill -TERM "${pids[@]}"; wait "${pids[@]}"
python3 - "$OUT" "$LAYERS" $VARIANTS <<'PY'
import json, sys
from pathlib import Path
from afore.bench.dataplane.transport import runner_breakdown, runner_markdown, stage_breakdown
out, layers = Path(sys.argv[1]), int(sys.argv[2])
result, lines = {}, ["# Stage breakdown of a decode target, afore serve on one H200 (medians, us)", ""]
for t in sys.argv[3:]:
    # joined by the seq each trace records (microbatches only names older traces); decode targets hold at most 8 tokens here
    result[t] = stage_breakdown(Path(f"/tmp/stages-{t}"), num_layers=layers, microbatches=2, max_tokens=8)
    lines += [f"## afore-{t}: {result[t].get('targets', 0)} decode targets", "", "| stage | median us | mean us | n |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['median_us']:.0f} | {v['mean_us']:.0f} | {v['n']} |" for k, v in result[t].get("stages", {}).items()]
    lines.append("")
runner = {"vllm": runner_breakdown(Path("/tmp/plain-stages"))}
runner.update({f"afore-{t}": runner_breakdown(Path(f"/tmp/stages-{t}")) for t in sys.argv[3:]})
result["runner"] = runner
lines += runner_markdown(runner)
(out / "serve_cuda_stages.json").write_text(json.dumps(result, indent=1))
(out / "serve_cuda_stages.md").write_text("\n".join(lines))
print("\n".join(lines))
PY
cp "$OUT"/serve_cuda_gsm8k.md "$OUT"/serve_cuda_sharegpt.md "$OUT"/serve_cuda_stages.md "$FINAL"/ 2>/dev/null
tar -czf "$FINAL/serve_cuda.tgz" -C "$OUT" . && rm -rf "$OUT"
echo "done after $(( $(date +%s) - t0 )) s, rc $rc"
exit $rc
