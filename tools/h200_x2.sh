#!/usr/bin/env bash
# Issue 18 on two H200s of one host (nvidia-h200-x2, NCCL): tests/test_distributed.py over
# NCCL, then the 8B-shape bf16 model at 64 concurrent requests on 1 GPU against tensor
# parallelism over 2 (tools/bench_tp.py); and, on one GPU, issue 17's dequantize_rows A/B
# on the 8B 4-bit model (tools/bench_gpu.py). Wheels as tools/h200_gpu.sh:
#   run(carry=[".whl/p0"]):  mkdir -p /tmp/w0 && cp -r .whl/p0/. /tmp/w0/
#   run(carry=[".whl/p1"]), within 30 s:  OUT=$OUT bash tools/h200_x2.sh /tmp/w0 .whl/p1
# Results: $OUT/x2-results.tgz (every log and JSON) and the summary on stdout.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/h200-out}
G=/tmp/gpu; RES=$G/res; M=$G/models
mkdir -p "$RES" "$OUT"
START=$SECONDS; DEADLINE=$((SECONDS + ${GPU_BUDGET_S:-470}))
say() { echo "== [$((SECONDS - START)) s] $*" | tee -a "$RES/summary.txt"; }
pack() { (cd $RES && tar -czf "$OUT/x2-results.tgz" .); }
trap pack EXIT
[ -e /tmp/py/mlx ] || H200_TMP=/tmp bash "$REPO/tools/h200_run.sh" setup "$@" 2>&1 | tail -3 | tee -a "$RES/summary.txt"
export PYTHONPATH=/tmp/py:/tmp/src:$REPO UNIKERN_MODEL_CACHE=/tmp/models TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1 MLX_MEMORY_LIMIT_GIB=${MLX_MEMORY_LIMIT_GIB:-60} CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
say "$(nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader | tr '\n' ';')"
want() { [ -z "${X2_STEPS:-}" ] || [[ " $X2_STEPS " == *" $1 "* ]]; }  # X2_STEPS: a subset of the steps
run() {  # NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  want "$name" || return 0
  local left=$((DEADLINE - SECONDS)); [ "$left" -lt 20 ] && { say "SKIPPED $name"; return; }
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS
  timeout "$limit" "$@" > "$RES/$name.log" 2>&1
  say "$name: rc=$? in $((SECONDS - t0)) s"
  grep -vE "^\s*$|\[(info|debug|warning)" "$RES/$name.log" | tail -${TAIL:-6} | tee -a "$RES/summary.txt"
  pack
}
cd "$REPO"
TAIL=30 run pytest-nccl ${PYTEST_LIMIT_S:-150} env MLX_ENABLE_TF32=0 UNIKERN_TEST_BACKEND=nccl python3 -m pytest \
  -p no:cacheprovider -q -rA -o filterwarnings=default --durations=0 tests/test_distributed.py
run models-8b 120 python3 tools/bench_gpu.py models --out $M --shapes 8b --quantize 8b
TAIL=10 run bench-tp-8b 200 python3 tools/bench_tp.py --model $M/llama-8b --tp 2 --backend nccl --concurrency 64 \
  --max-tokens 64 --repeats 3 --out $RES/bench-tp-llama-8b-nccl.json
TAIL=4 run dq-auto 90 python3 tools/bench_gpu.py bench --model $M/llama-8b-q4 --engines unikern --repeats 3 \
  --label "8B 4-bit, dequantize_rows auto" --json $RES/bench-gpu-8b-q4-auto.json
TAIL=4 run dq-never 90 python3 tools/bench_gpu.py bench --model $M/llama-8b-q4 --engines unikern --repeats 1 \
  --concurrency 1 16 64 --set execute.dequantize_rows=never --label "8B 4-bit, dequantize_rows never" \
  --json $RES/bench-gpu-8b-q4-never.json
say "done"
