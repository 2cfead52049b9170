#!/usr/bin/env bash
# Issue 16's multi-GPU run in one go, on a host with 2 GPUs or more (dummy bf16 weights at real shapes):
# NCCL all-reduce at decode sizes, the kernels' check, Llama-3-8B at TP=1 / TP=2 / PP=2 (greedy agreement with
# TP=1, nano-vllm throughput, KV blocks), Llama-3-70B at TP=2 with a short context, then `kvgate serve` at TP=1 and
# TP=2 under 100 and 200 clients (128/128 tokens). Each part has a time limit; tables go to OUT_DIR.
#   bash benchmarks/multi_gpu.sh [OUT_DIR]
#   PARTS="allreduce 8b" bash benchmarks/multi_gpu.sh OUT     # some of: allreduce check 8b 70b serve
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-$(mktemp -d)}
mkdir -p "$out"
parts=${PARTS:-allreduce check 8b 70b serve}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} PYTHONUNBUFFERED=1
has() { [[ " $parts " == *" $1 "* ]]; }
has allreduce && timeout 120 python benchmarks/allreduce.py --world-size 2 2>&1 | tee "$out/allreduce.txt"
has check && timeout 150 python benchmarks/kernels.py --check 2>&1 | tail -3 | tee "$out/check.txt"
has 8b && timeout 700 python benchmarks/parallel.py --model benchmarks/configs/llama-3-8b --layouts 1x1 2x1 1x2 \
  --timeout 220 2>&1 | tee "$out/llama-3-8b.txt" | grep -E "^(#|TPxPP|[0-9]x)"
has 70b && timeout 500 python benchmarks/parallel.py --model benchmarks/configs/llama-3-70b --layouts 2x1 \
  --max-model-len 2048 --greedy-prompts 4 --timeout 480 2>&1 | tee "$out/llama-3-70b.txt" | grep -E "^(#|TPxPP|[0-9]x)"
if has serve; then
  for tp in 1 2; do
    CONFIG=benchmarks/configs/llama-3-8b SERVE_FLAGS="--tensor-parallel-size $tp" LEVELS=128 CONCURRENCY="100 200" \
      NO_OFFLINE=1 timeout 500 bash benchmarks/serving_gpu.sh "$out/serve-tp$tp" 2>&1 | tail -4
  done
fi
echo "tables in $out"
