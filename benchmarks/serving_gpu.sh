#!/usr/bin/env bash
# Issue 4's GPU serving benchmark in one go: kvgate serve with Qwen3-0.6B shapes (dummy bf16 weights and a
# synthetic byte-level tokenizer, as Qwen3's own is; DUMMY_TOKENIZER=word for the word-level one of results before
# 2026-12-05), `benchmarks/serving.py` at 128-token prompts (1000 requests at 50/100/200 clients) and
# 1024-token prompts (200 requests at 20/50/100 clients), then the offline engine on the same requests for the
# online/offline ratio (detokenized with the same tokenizer, as the server does).
#   bash benchmarks/serving_gpu.sh [OUT_DIR]        # tables in OUT_DIR (default: a temporary folder)
#   SERVE_FLAGS=--no-engine-core-process LEVELS=128 bash benchmarks/serving_gpu.sh OUT   # engine loop on a thread
#   CONFIG=benchmarks/configs/llama-3-8b SERVE_FLAGS="--tensor-parallel-size 2" LEVELS=128 CONCURRENCY="100 200" \
#     NO_OFFLINE=1 bash benchmarks/serving_gpu.sh OUT                  # another model's shapes, on 2 GPUs
#   SERVE_FLAGS="--api-server-count 2" LEVELS=128 CONCURRENCY=200 NUM_PROMPTS=1500 NO_OFFLINE=1 \
#     bash benchmarks/serving_gpu.sh OUT           # two HTTP server processes sharing the engine core
#   PY_SPY=py-spy NUM_PROMPTS=3000 LEVELS=128 CONCURRENCY=200 bash benchmarks/serving_gpu.sh OUT   # + where the
#     server's processes spend their time: py-spy --gil stacks (OUT/spy-PID.txt, 6 s from 3 s into the 128-token
#     level); each process's CPU seconds before and after that level are always printed
#   STEP_LOG=1 LEVELS=128 CONCURRENCY=200 NUM_PROMPTS=1500 NO_OFFLINE=1 bash benchmarks/serving_gpu.sh OUT   # + every
#     engine step's time, its wait for the GPU and its size, and each request's way to the engine, to the core and
#     to its first token (benchmarks/step_log: OUT/steps, summarized after the 128-token level)
#   SERVER_CPUS=0-7 CLIENT_CPUS=8-15 ... bash benchmarks/serving_gpu.sh OUT   # the server and the load generator on
#     CPUs of their own (taskset)
#   CONFIG=benchmarks/configs/qwen3-stub VOCAB=4000 WORKERS=1 SERVE_FLAGS="--dtype float32 --engine-core-process" \
#     LEVELS=128 CONCURRENCY=200 NUM_PROMPTS=600 NO_OFFLINE=1 bash benchmarks/serving_gpu.sh OUT   # on a CPU: a
#     one-layer model, for the server's own costs per request and per streamed token
# The load generator runs in WORKERS processes (8; 4 before 2026-12-07's eighth session, when it limited the TTFT
# tail at 200 clients: benchmarks/RESULTS.md).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-$(mktemp -d)}
mkdir -p "$out"
config=${CONFIG:-benchmarks/configs/qwen3-0.6b}
model=$(mktemp -d)/$(basename "$config")-dummy
port=${PORT:-8123}
python benchmarks/dummy_tokenizer.py $([[ ${DUMMY_TOKENIZER:-bytes} == word ]] || echo --byte-level) "$config" "$model" >/dev/null
if [[ -n ${STEP_LOG:-} ]]; then
  export PYTHONPATH=$PWD/benchmarks/step_log${PYTHONPATH:+:$PYTHONPATH} KVGATE_STEP_LOG_DIR=$out/steps
fi
${SERVER_CPUS:+taskset -c $SERVER_CPUS} python -m kvgate.gateway.cli serve --model "$model" --load-format dummy --port "$port" ${SERVE_FLAGS:-} >"$out/serve.log" 2>&1 &
server=$!
stop_server() { kill $server 2>/dev/null && wait $server 2>/dev/null; true; }  # once: a second SIGTERM exits at once
trap 'kill ${sampler:-} 2>/dev/null || true; stop_server' EXIT  # waits: the next run may take the port
for _ in $(seq 300); do curl -sf "localhost:$port/health" >/dev/null && break; sleep 1; done
curl -sf "localhost:$port/health" >/dev/null || { tail -20 "$out/serve.log"; exit 1; }
bench="${CLIENT_CPUS:+taskset -c $CLIENT_CPUS} python benchmarks/serving.py --base-url http://127.0.0.1:$port/v1 --model $(basename "$model") --vocab ${VOCAB:-100000} --workers ${WORKERS:-8} --engine-metrics"
levels=${LEVELS:-128 1024}
grep -m1 "ready in" "$out/serve.log" || true
pids="$server $(pgrep -P $server || true)"  # the API process and its children (the engine core's process among them)
cpu_s() { for p in $pids; do echo "$(awk '{print $1, $2, ($14 + $15) / 100}' /proc/$p/stat) s"; done; }
if [[ -n ${PY_SPY:-} ]]; then
  for p in $pids; do
    (sleep 3; $PY_SPY record -p $p -r 250 -d 6 --gil -f raw -o "$out/spy-$p.txt" >/dev/null 2>&1) &
  done
fi
# which CPU each server process's main thread ran on, twice a second (were the API process and the engine core on
# hyperthreads of one physical core?)
(while sleep 0.5; do for p in $pids; do echo "$p $(awk '{print $39}' /proc/$p/stat 2>/dev/null)"; done; done) >"$out/cpus.txt" &
sampler=$!
echo "CPU seconds before: $(cpu_s | tr '\n' ' ')"
[[ $levels == *128* ]] && $bench --input-len 128 --output-len 128 --num-prompts ${NUM_PROMPTS:-1000} --concurrency ${CONCURRENCY:-50 100 200} | tee "$out/serve128.txt"
echo "CPU seconds after the 128-token level: $(cpu_s | tr '\n' ' ')"
kill $sampler
if [[ -n ${STEP_LOG:-} ]]; then sleep 1.5; python benchmarks/step_log/summarize.py "$out/steps" | tee "$out/steps.txt"; fi
python benchmarks/cpu_placement.py "$out/cpus.txt" $pids || true
[[ $levels == *1024* ]] && $bench --input-len 1024 --output-len 128 --num-prompts 200 --concurrency 20 50 100 | tee "$out/serve1024.txt"
stop_server
[[ -n ${NO_OFFLINE:-} ]] && exit 0
# the offline engine on the same model directory, detokenizing with the same tokenizer as the server
offline="python benchmarks/throughput.py --model $model --load-format dummy --detokenize --min-output 128 --max-output 128"
[[ $levels == *128* ]] && $offline --num-seqs 1000 --min-input 128 --max-input 128 | tail -1 | tee "$out/offline128.txt"
[[ $levels == *1024* ]] && $offline --num-seqs 200 --min-input 1024 --max-input 1024 | tail -1 | tee "$out/offline1024.txt"
true
