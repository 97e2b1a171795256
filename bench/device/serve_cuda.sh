#!/usr/bin/env bash
# `afore bench serve` on one H200: plain vLLM 0.26 against `afore serve --device cuda --attn-workers 1
# --ffn-workers 2 --colocate --transport torch-gloo`, both with CUDA graphs (vLLM's default;
# afore: piecewise), bf16, on a random-weight checkpoint at Qwen3-30B-A3B's expert and attention
# shapes (hidden 2048, 32 query / 4 KV heads of 128, 128 experts of 768, top-8) with the first
# $LAYERS of its 48 layers and a small trained tokenizer, built here. Colocated AFD on one GPU
# measures afore's overhead (exchanges staged through the host, the FFN on the same GPU), not
# AFD's benefit. Needs vLLM in /tmp/site and afore built (bench/device/gpu_tests.sh does both)
# and the request sets in .devcarry/bench-data (gsm8k.jsonl; sharegpt_head.json = the first 8 MB
# of the packaged ShareGPT JSON; the loader stops at the cut).
#   LAYERS=4 PROMPTS=64 bash bench/device/serve_cuda.sh       # reports under $OUT
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/serve-out}; mkdir -p "$OUT"
LAYERS=${LAYERS:-4}; PROMPTS=${PROMPTS:-64}; MODEL=/tmp/qwen3-30b-a3b-shape-l$LAYERS
t0=$(date +%s)
python3 - "$MODEL" "$LAYERS" <<'PY'
import sys
from afore.models.tiny import build_tiny_checkpoint
# Qwen3-30B-A3B: hidden 2048, 32 heads x 128 (4 KV), 128 experts x 768, top-8, 48 layers
print(build_tiny_checkpoint("qwen3_moe", path=sys.argv[1], hidden_size=2048, num_attention_heads=32,
                            num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                            moe_intermediate_size=768, num_hidden_layers=int(sys.argv[2]), initializer_range=0.02))
PY
echo "checkpoint built in $(( $(date +%s) - t0 )) s"
common=(--dtype bfloat16 --max-model-len 2048 --seed 0)
python3 -m vllm.entrypoints.openai.api_server --model "$MODEL" --host 127.0.0.1 --port 8100 "${common[@]}" \
  --gpu-memory-utilization 0.3 > "$OUT/plain-vllm.log" 2>&1 &
plain=$!
python3 -m afore.cli serve --model "$MODEL" --device cuda --attn-workers 1 --ffn-workers 2 --colocate \
  --transport torch-gloo --policy afore --host 127.0.0.1 --port 8000 --verbose "${common[@]}" \
  --vllm-arg=--gpu-memory-utilization=0.3 > "$OUT/afore-serve.log" 2>&1 &
afore=$!
for url in http://127.0.0.1:8100 http://127.0.0.1:8000; do
  python3 -c "import sys, time, urllib.request
for _ in range(300):
    try:
        urllib.request.urlopen(sys.argv[1] + '/health', timeout=2); break
    except OSError: time.sleep(1)" "$url"
done
echo "servers up after $(( $(date +%s) - t0 )) s"
note="1 x NVIDIA H200, vLLM 0.26.0, torch 2.11.0+cu130, bf16, CUDA graphs. Random weights at Qwen3-30B-A3B shapes, first $LAYERS of 48 layers. afore: A=1, F=2 colocated on the same GPU, torch-gloo transport (CUDA tensors staged through the host), policy afore: this measures afore's overhead against plain vLLM on one GPU, not AFD's benefit."
rc=0
for ds in gsm8k sharegpt; do
  path=.devcarry/bench-data/$([ $ds = gsm8k ] && echo gsm8k.jsonl || echo sharegpt_head.json)
  python3 -m afore.cli bench serve --servers vllm=http://127.0.0.1:8100,afore=http://127.0.0.1:8000 \
    --dataset $ds --dataset-path "$path" --num-prompts "$PROMPTS" --concurrency 8 --max-tokens 128 \
    --name serve_cuda_$ds --out "$OUT" --note "$note" || rc=1
done
kill -TERM $afore $plain; wait $afore $plain
echo "done after $(( $(date +%s) - t0 )) s, rc $rc"
exit $rc
