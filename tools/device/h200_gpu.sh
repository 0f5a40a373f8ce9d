#!/usr/bin/env bash
# unikern on one NVIDIA H200 through MLX's CUDA backend, step by step: set up, build the
# models, run the CUDA kernel tests, the three-engine benchmark (unikern, mlx-lm and
# llama.cpp on a 1B-shape bf16 and an 8B-shape 4-bit Llama), greedy parity and the
# start-up time. tools/device/README.md says what to send and in which calls.
#
#   OUT=$OUT bash tools/device/h200_gpu.sh /tmp/w0 .whl/p1 .whl/lc   # first call: set up, then the steps
#   OUT=$OUT bash tools/device/h200_gpu.sh                           # later calls, the machine still warm
#   GPU_STEPS="bench-1b parity-1b" OUT=$OUT bash tools/device/h200_gpu.sh   # only these steps
#   bash tools/device/h200_gpu.sh exec python3 -m tools.probe.probe_cuda --model /tmp/gpu/models/llama-1b
#                                     # any command, in this script's environment (after set-up)
#
# Steps, in this order (each one skipped once its output exists, so a call resumes where
# the last one's time ran out; a call lasts at most 10 minutes):
#   bench-1b      the three engines, 1B bf16 (tools/bench/bench_gpu.py bench --split)
#   parity-1b     greedy tokens against mlx-lm, 16 prompts in flight (tools/check/parity_check.py)
#   startup       a fresh worker's cold start, then warm starts on the kernel cache it left,
#                 with the weights read ahead and not (tools/bench/first_request.py --cold-warm
#                 --read-ahead-ab; STARTUP_ARGS replaces the last flag)
#   bench-8b-q4   the three engines, 8B 4-bit (mlx-lm's -q 4 against llama.cpp's Q4_0)
#   kernel-tests  the CUDA kernel tests against MLX's ops, TF32 off (PYTEST_GPU: which ones)
# and only where GPU_STEPS names them: bench-1b-iso (bench-1b with mlx-lm in a process of
# its own), startup-tf (startup with the transformers wheel of .whl/tf), parity-8b-q4,
# importtime (the worker's import, -X importtime), startup-nofuse, ab-fusion and
# parity-1b-nofuse (execute.fuse_elementwise=never: a fresh start, against the default
# through the library, greedy parity), startup-rows-off (a fresh start with MLX's gather for
# unikern's row kernel), engine-tests (the runner's kernels on CUDA), qwen2-place (tiny-qwen2
# with the engine's kernels off one at a time), q4-gemv (the 4-bit GEMV's variants,
# tools/probe/bench_q4_gemv.py), parity-1b-cudnn (parity-1b with cuDNN's SDPA), parity-1b-f32
# (parity-1b on the same weights in float32 with TF32 off),
# startup-probe (tools/probe/probe_startup.py),
# ab-tree (this tree's engine against OLD_TREE's, interleaved), and h200_x2.sh's two-GPU steps:
# nccl-tests, bench-tp-8b. The models a step needs are built first (bench_gpu.py models
# and gguf; llama.cpp builds in the background from .whl/lc's source).
#
# Environment: OUT (results: $OUT/gpu/, one log per step and summary.txt; default
# /tmp/h200-out), GPU_STEPS, GPU_BUDGET_S (seconds this call may use, 570), BENCH_ARGS
# (more bench_gpu.py bench arguments), PYTEST_GPU, WARM_STARTS, STARTUP_ARGS, AB_REPEATS (6),
# SERVE_ARGS, PARITY_ARGS (more parity_check.py arguments for parity-1b and parity-8b-q4), OLD_TREE, AB_ROUNDS (2),
# MLX_MEMORY_LIMIT_GIB (60; SERVE_MLX_GIB (30) for each of bench_http's MLX peers), KERNEL_TESTS_MIN_S (300), PROBE_SPY (startup-probe under
# py-spy, its wheel carried in the set-up's folders: slow, see tools/probe/probe_startup.py).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/h200-out}
G=/tmp/gpu  # models, llama.cpp and results: kept between calls while the machine is warm
RES=$G/res
M=$G/models
BIN=$G/llama-build/bin
mkdir -p "$RES" "$OUT"
START=$SECONDS
DEADLINE=$((SECONDS + ${GPU_BUDGET_S:-570}))
say() { echo "== [$((SECONDS - START)) s] $*" | tee -a "$RES/summary.txt"; }
left() { echo $((DEADLINE - SECONDS)); }
save() { mkdir -p "$OUT/gpu" && cp -r "$RES"/. "$OUT/gpu/"; }

# ---- set-up: the carried wheels, the environment, llama.cpp's source ----------------------
if [ ! -e /tmp/py/mlx ] && [ $# -gt 0 ] && [ "$1" != exec ]; then
  say "setup"
  H200_TMP=/tmp bash "$REPO/tools/device/h200_setup.sh" "$@" 2>&1 | tail -4 | tee -a "$RES/summary.txt"
fi
export PYTHONPATH=/tmp/py:/tmp/src:$REPO UNIKERN_MODEL_CACHE=/tmp/models TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1 MLX_MEMORY_LIMIT_GIB=${MLX_MEMORY_LIMIT_GIB:-60} CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PATH=$CUDA_HOME/bin:/tmp/py/bin:$PATH  # /tmp/py/bin: py-spy, where its wheel was carried
cd "$REPO"  # python3 -m tools.X and the tests' paths are relative to it
if [ "${1:-}" = exec ]; then shift; exec "$@"; fi
trap save EXIT
for d in "$@"; do [ -f "$d/llama.cpp.tgz" ] && [ ! -d $G/llama.cpp ] && tar -xzf "$d/llama.cpp.tgz" -C $G; done

want() { [ -z "${GPU_STEPS:-}" ] || [[ " $GPU_STEPS " == *" $1 "* ]]; }  # a default step, unless GPU_STEPS leaves it out
named() { [[ " ${GPU_STEPS:-} " == *" $1 "* ]]; }  # a step that runs only when GPU_STEPS names it
any_wanted() { local s; for s in "$@"; do want "$s" && return 0; done; return 1; }

run_step() {  # NAME DONE_FILE MIN_S COMMAND...: runs it unless DONE_FILE exists or fewer than MIN_S seconds are left
  local name=$1 done_file=$2 min_s=$3; shift 3
  [ -e "$done_file" ] && return 0
  if [ "$(left)" -lt "$min_s" ]; then say "SKIPPED $name: needs about $min_s s, $(left) s left; call again"; return 1; fi
  local t0=$SECONDS log="$RES/$name.log"
  timeout $(($(left) - 10)) "$@" > "$log" 2>&1
  local rc=$?
  say "$name: rc=$rc in $((SECONDS - t0)) s"
  grep -vE "^\s*$|\[(info|debug|warning)|it/s\]|s/it\]" "$log" | tail -"${TAIL:-4}" | tee -a "$RES/summary.txt"
  save
  return $rc
}

# the targets the steps need (LLAMA_TARGETS), with CUDA for sm_90; llama-server only when named
LLAMA_TARGETS=${LLAMA_TARGETS:-llama-batched-bench llama-quantize llama-bench}
build_llama() {
  local missing=0 t; for t in $LLAMA_TARGETS; do [ -x $BIN/$t ] || missing=1; done
  [ $missing = 0 ] && return 0
  local server=OFF; [[ " $LLAMA_TARGETS " == *" llama-server "* ]] && server=ON
  cmake -S $G/llama.cpp -B $G/llama-build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=$server -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF > $RES/llama-cmake.log 2>&1 &&
  cmake --build $G/llama-build -j${LLAMA_JOBS:-14} --target $LLAMA_TARGETS > $RES/llama-build.log 2>&1
}
wait_llama() {
  [ -n "${BUILD_PID:-}" ] || return 0
  wait "$BUILD_PID"; say "llama.cpp build: rc=$? $(tail -1 $RES/llama-build.log)"; BUILD_PID=
}

say "nvidia-smi: $(nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader)"
if any_wanted bench-1b bench-8b-q4 || named bench-1b-iso || named llama || named serve-8b-q4; then
  if [ -d $G/llama.cpp ]; then build_llama & BUILD_PID=$!; fi
fi

# ---- models: random Llama weights written by MLX, and as GGUF by llama.cpp's converter -----
if any_wanted bench-1b parity-1b startup || named parity-1b-cudnn || named startup-probe || named startup-nofuse || named startup-rows-off || named ab-fusion || named parity-1b-nofuse || named bench-1b-iso || named startup-tf || named ab-tree || named serve-1b; then
  run_step models-1b $M/llama-1b/config.json 60 python3 -m tools.bench.bench_gpu models --out $M --shapes 1b --quantize
fi
if any_wanted bench-1b || named bench-1b-iso || named serve-1b; then
  run_step gguf-1b $M/llama-1b-bf16.gguf 60 python3 -m tools.bench.bench_gpu gguf --out $M --shapes 1b --quantize \
    --llama-cpp $G/llama.cpp --llama-bin $BIN
fi

# the steps that need no llama.cpp build run first, while it builds in the background

# the 4-bit GEMV's variants at the 8B shapes against MLX's quantized matmul, CUPTI times
# (tools/probe/bench_q4_gemv.py); the fastest at one row goes to $RES/q4-best.txt, and with
# Q4_BEST=1 every later step of this call runs with it (UNIKERN_Q4_GEMV)
if named q4-gemv; then
  TAIL=16 run_step q4-gemv $RES/q4-gemv-8b.json 150 python3 -m tools.probe.bench_q4_gemv --rows 1 16 \
    ${Q4_ARGS:-} --best $RES/q4-best.txt --json $RES/q4-gemv-8b.json
fi
if [ -n "${Q4_BEST:-}" ] && [ -s $RES/q4-best.txt ]; then
  export UNIKERN_Q4_GEMV="$(cat $RES/q4-best.txt)"; say "UNIKERN_Q4_GEMV=$UNIKERN_Q4_GEMV"
fi

# bench_http runs its peers side by side on the one GPU (unikern serve, the library's
# engine, mlx_lm.server, llama-server): each MLX process gets this share of the memory
# limit, not the whole. At 60 GiB each, MLX's buffer caches of three MLX processes could
# outgrow the H200's 141 GB. On 2026-12-05 the 8B 4-bit run's 64-stream round failed
# twice, each time in the engine that ran after another had: the library's engine with
# cudaMallocAsync out of memory (after unikern serve), and before that unikern serve with
# an HTTP error status whose cause was not kept (after mlx_lm.server and the library)
SERVE_MLX_GIB=${SERVE_MLX_GIB:-30}

# the same two unikern doors with streams arriving at random (exponential gaps of 20 ms
# on average): TTFT from the first round on when requests do not come all at once
if named serve-1b-stagger; then
  TAIL=30 run_step serve-1b-stagger $RES/serve-1b-stagger.done 150 bash -c "MLX_MEMORY_LIMIT_GIB=$SERVE_MLX_GIB python3 -m tools.bench.bench_http \
    --model $M/llama-1b --peers unikern,library --stagger-ms 20 --tag=-h200-1b-stagger ${SERVE_ARGS:-} && \
    cp tools/results/bench-http-llama-1b-*-h200-1b-stagger* $RES/ && touch $RES/serve-1b-stagger.done"
fi

# ---- greedy parity and start-up, 1B bf16 ----------------------------------------------------
if want parity-1b; then
  TAIL=12 run_step parity-1b $RES/parity-1b.json 90 python3 -m tools.check.parity_check --model $M/llama-1b \
    --prompts 16 --max-tokens 32 ${PARITY_ARGS:-} --json $RES/parity-1b.json
fi
if named parity-1b-cudnn; then  # with MLX's cuDNN SDPA for the prompts (mlx-lm's too: one process)
  TAIL=12 run_step parity-1b-cudnn $RES/parity-1b-cudnn.json 90 env MLX_CUDA_USE_CUDNN_SDPA=1 python3 -m \
    tools.check.parity_check --model $M/llama-1b --prompts 16 --max-tokens 32 --json $RES/parity-1b-cudnn.json
fi
if named parity-1b-f32; then  # the same weights in float32, TF32 off: no bf16 step to tie on
  run_step models-1b-f32 $M/llama-1b-f32/config.json 90 python3 -m tools.bench.bench_gpu models --out $M --shapes 1b-f32
  TAIL=12 run_step parity-1b-f32 $RES/parity-1b-f32.json 120 env MLX_ENABLE_TF32=0 python3 -m tools.check.parity_check \
    --model $M/llama-1b-f32 --prompts 16 --max-tokens 32 ${PARITY_ARGS:-} --json $RES/parity-1b-f32.json
fi
if named parity-1b-nofuse; then
  TAIL=12 run_step parity-1b-nofuse $RES/parity-1b-nofuse.json 90 python3 -m tools.check.parity_check \
    --model $M/llama-1b --prompts 16 --max-tokens 32 --set execute.fuse_elementwise=never \
    --json $RES/parity-1b-nofuse.json
fi
if want startup; then
  run_step startup $RES/startup-1b.json 150 python3 -m tools.bench.first_request --model $M/llama-1b --cold-warm \
    --warm-starts ${WARM_STARTS:-2} ${STARTUP_ARGS:---read-ahead-ab} --json $RES/startup-1b.json
fi
# a fresh machine's start without MLX's fused element-wise kernels (execute.fuse_elementwise=never),
# then that setting against the default through the library, one process, both orders
if named startup-nofuse; then
  run_step startup-nofuse $RES/startup-1b-nofuse.json 120 python3 -m tools.bench.first_request --model $M/llama-1b \
    --cold-warm --warm-starts 1 --set execute.fuse_elementwise=never --json $RES/startup-1b-nofuse.json
fi
# a fresh start with MLX's gather in place of unikern's row kernel (cuda/rows.py): the A/B of
# the kernel that leaves MLX nothing to compile at start
if named startup-rows-off; then
  run_step startup-rows-off $RES/startup-1b-rows-off.json 100 env UNIKERN_ROW_KERNEL=0 python3 -m tools.bench.first_request \
    --model $M/llama-1b --cold-warm --warm-starts 1 --json $RES/startup-1b-rows-off.json
fi
# the engine's tests that run unikern's kernels through the runner on CUDA (tiny models of
# their own), the failures named; then tiny-qwen2's launch failure placed by turning the
# engine's kernels off one at a time (MLX_USE_CUDA_GRAPHS=0: the launch that fails names itself)
if named engine-tests; then
  TAIL=20 run_step engine-tests $RES/engine-tests.done 180 bash -c "MLX_ENABLE_TF32=0 python3 -m pytest -p no:cacheprovider \
    -p no:benchmark -q -rf -n 4 tests/test_rows.py tests/test_partial_prefix.py tests/test_compiled_prefill.py \
    tests/test_family_prefix.py tests/test_decode_blocks.py tests/test_ropes.py && touch $RES/engine-tests.done"
fi
if named qwen2-place; then
  # first MLX alone: mlx-lm generating from the model, and SDPA at head size 16 in bf16 with the
  # boolean mask a decode window passes (the engine's attention there when the paged kernel,
  # which takes head sizes of 32 lanes, does not)
  TAIL=3 run_step qwen2-mlx-lm $RES/qwen2-mlx-lm.done 40 bash -c "MLX_USE_CUDA_GRAPHS=0 python3 -m mlx_lm generate \
    --model \$(python3 -c 'from unikern.testing.modelgen import cached_model; print(cached_model(\"tiny-qwen2\"))') \
    --prompt 'a b c' --max-tokens 8 && touch $RES/qwen2-mlx-lm.done"
  TAIL=3 run_step qwen2-sdpa $RES/qwen2-sdpa.done 30 bash -c "MLX_USE_CUDA_GRAPHS=0 python3 -c '
import mlx.core as mx
for L in (16, 32, 256):
    q, k = mx.ones((2, 4, 1, 16), mx.bfloat16), mx.ones((2, 4, L, 16), mx.bfloat16)
    mx.eval(mx.fast.scaled_dot_product_attention(q, k, k, scale=0.25, mask=mx.ones((2, 1, 1, L), mx.bool_)))
    print(\"sdpa head 16, bool mask, L\", L, \"ok\")' && touch $RES/qwen2-sdpa.done"
  for s in none execute.block_kernel=never execute.fuse_blocks=never execute.paged_attention=never \
      execute.fuse_projections=never execute.compile_prefill=never; do
    sets=(); [ $s != none ] && sets=(--set $s)
    TAIL=3 run_step "qwen2-${s#execute.}" $RES/qwen2-${s#execute.}.json 45 env MLX_USE_CUDA_GRAPHS=0 python3 -m \
      tools.check.parity_check --model tiny-qwen2 --prompts 4 --max-tokens 8 "${sets[@]}" --json $RES/qwen2-${s#execute.}.json
  done
fi
if named ab-fusion; then
  for order in 1 2; do
    sides=(--a execute.fuse_elementwise=never); [ $order = 2 ] && sides=(--b execute.fuse_elementwise=never)
    TAIL=8 run_step ab-fusion-$order $RES/ab-fusion-1b-$order.json 100 python3 -m tools.bench.bench_ab \
      --model $M/llama-1b "${sides[@]}" --concurrency 1 16 64 --repeats ${AB_REPEATS:-6} --max-tokens 128 \
      --label "fusion off vs on, 1B bf16" --json $RES/ab-fusion-1b-$order.json
  done
fi
if named startup-probe; then  # where the start's seconds go: raw read, MLX's load, ops' first calls, warm-up steps
  TAIL=40 run_step startup-probe $RES/startup-probe-1b.json 200 python3 -m tools.probe.probe_startup --model $M/llama-1b \
    --ops --profile 30 --cold-warm --json $RES/startup-probe-1b.json ${PROBE_SPY:+--spy $RES}
fi
# the same with the transformers release pip installs beside unikern today (the image's is
# older, and its import slower): its wheel carried in .whl/tf, copied to /tmp/tfwhl
if named startup-tf && ls /tmp/tfwhl/transformers-*.whl > /dev/null 2>&1; then
  [ -d /tmp/tf/transformers ] || python3 -m pip install -q --no-index --no-deps --target /tmp/tf \
    /tmp/tfwhl/transformers-*.whl 2>&1 | tail -2
  run_step startup-tf $RES/startup-1b-tf.json 150 env PYTHONPATH=/tmp/tf:$PYTHONPATH python3 -m tools.bench.first_request \
    --model $M/llama-1b --cold-warm --warm-starts ${WARM_STARTS:-2} --json $RES/startup-1b-tf.json
fi
if named importtime; then  # the worker's imports as the command line makes them (PyTorch hidden from
  # transformers: unikern.platform.imports), three fresh processes, then where the time goes,
  # and MLX's CUDA start alone (the library, then a first array on the GPU)
  TAIL=12 run_step importtime $RES/importtime.txt 60 bash -c 'TIMEFORMAT="import: %R s"; \
    imp="from unikern.platform.imports import import_tokenizer_stack as s; s(); import unikern.frontends.worker"; \
    for i in 1 2 3; do time python3 -c "$imp"; done; \
    python3 -c "import time; t=time.perf_counter(); import mlx.core as mx; a=time.perf_counter(); \
mx.eval(mx.zeros(1)); b=time.perf_counter(); print(f\"mlx.core import {a-t:.2f} s, first GPU array {b-a:.2f} s\")"; \
    python3 -X importtime -c "$imp" 2> '"$RES"'/importtime.txt; \
    sort -t"|" -k2 -n '"$RES"'/importtime.txt | tail -8'
  # and, where the 1B model is built: its weights read through MLX against NumPy, and SDPA's
  # first calls at prefill shapes with MLX's cuDNN path and without
  if [ -e $M/llama-1b/config.json ]; then
    TAIL=30 run_step load-paths $RES/load-paths-1b.json 90 bash -c "python3 -m tools.probe.probe_load_paths weights \
      --model $M/llama-1b --json $RES/load-paths-1b.json && python3 -m tools.probe.probe_load_paths sdpa \
      --model $M/llama-1b --json $RES/sdpa-first-calls-1b.json"
  fi
fi

# ---- the three engines, 1B bf16 -------------------------------------------------------------
if want bench-1b; then
  wait_llama
  TAIL=9 run_step bench-1b $RES/bench-gpu-1b.json 120 python3 -m tools.bench.bench_gpu bench --model $M/llama-1b \
    --gguf $M/llama-1b-bf16.gguf --llama-bin $BIN --split ${BENCH_ARGS:-} --label "llama 1B shape, bfloat16" \
    --json $RES/bench-gpu-1b.json
fi
if named bench-1b-iso; then
  wait_llama
  TAIL=9 run_step bench-1b-iso $RES/bench-gpu-1b-iso.json 120 python3 -m tools.bench.bench_gpu bench \
    --model $M/llama-1b --gguf $M/llama-1b-bf16.gguf --llama-bin $BIN --split --isolate ${BENCH_ARGS:-} \
    --label "llama 1B shape, bfloat16, mlx-lm in its own process" --json $RES/bench-gpu-1b-iso.json
fi

# ---- this tree's engine against another checkout's (OLD_TREE: its kernel/ stages/ pipelines/
# tools/, e.g. `git archive COMMIT kernel stages pipelines tools`), unikern alone at 1B, the two
# interleaved in fresh processes, AB_ROUNDS times: a change measured on one machine start ----
if named ab-tree && [ -d "${OLD_TREE:-}" ]; then
  old_src=/tmp/oldsrc; rm -rf $old_src; mkdir -p $old_src/unikern
  ln -s "$OLD_TREE"/kernel/* $old_src/unikern/; ln -s "$OLD_TREE/stages" $old_src/unikern/stages
  ln -s "$OLD_TREE/pipelines" $old_src/unikern/pipelines
  old_bench=$([ -f "$OLD_TREE/tools/bench/bench_gpu.py" ] && echo "-m tools.bench.bench_gpu" || echo "$OLD_TREE/tools/bench_gpu.py")
  ab=(bench --model $M/llama-1b --engines unikern --concurrency 1 16 64 --repeats 3 ${BENCH_ARGS:-})
  for r in $(seq ${AB_ROUNDS:-2}); do
    TAIL=5 run_step ab-this-$r $RES/ab-this-$r.json 60 python3 -m tools.bench.bench_gpu "${ab[@]}" \
      --json $RES/ab-this-$r.json
    TAIL=5 run_step ab-old-$r $RES/ab-old-$r.json 60 bash -c "cd $OLD_TREE && \
      PYTHONPATH=/tmp/py:$old_src:$OLD_TREE python3 $old_bench ${ab[*]} --json $RES/ab-old-$r.json"
  done
fi

# ---- unikern serve against llama-server and mlx_lm.server over HTTP, and the library path,
# 1B bf16: streaming chat completions (tools/bench/bench_http.py; SERVE_ARGS adds to it);
# llama-server must be built (LLAMA_TARGETS="llama-server", step llama) ----
if named serve-1b; then
  wait_llama
  TAIL=30 run_step serve-1b $RES/serve-1b.done 300 bash -c "MLX_MEMORY_LIMIT_GIB=$SERVE_MLX_GIB python3 -m tools.bench.bench_http --model $M/llama-1b \
    --gguf $M/llama-1b-bf16.gguf --llama-server $BIN/llama-server --tag=-h200-1b ${SERVE_ARGS:-} && \
    cp tools/results/bench-http-llama-1b-*-h200-1b* $RES/ && touch $RES/serve-1b.done"
fi

# ---- the three engines, 8B 4-bit (mlx_lm convert -q against llama-quantize's Q4_0) ----------
if want bench-8b-q4 || named parity-8b-q4 || named serve-8b-q4; then
  run_step models-8b $M/llama-8b-q4/config.json 120 python3 -m tools.bench.bench_gpu models --out $M --shapes 8b \
    --quantize 8b
fi
if want bench-8b-q4 || named serve-8b-q4; then
  run_step gguf-8b-bf16 $M/llama-8b-q4_0.gguf 150 python3 -m tools.bench.bench_gpu gguf --out $M --shapes 8b \
    --quantize --llama-cpp $G/llama.cpp --llama-bin $BIN
  wait_llama
  run_step gguf-8b-q4 $M/llama-8b-q4_0.gguf 30 $BIN/llama-quantize $M/llama-8b-bf16.gguf $M/llama-8b-q4_0.gguf Q4_0
  [ -e $M/llama-8b-q4_0.gguf ] && rm -f $M/llama-8b-bf16.gguf  # 16 GB of disk back
fi
if want bench-8b-q4; then
  TAIL=9 run_step bench-8b-q4 $RES/bench-gpu-8b-q4.json 330 python3 -m tools.bench.bench_gpu bench \
    --model $M/llama-8b-q4 --gguf $M/llama-8b-q4_0.gguf --llama-bin $BIN --split ${BENCH_ARGS:-} \
    --label "llama 8B shape, 4-bit (Q4_0 for llama.cpp)" --json $RES/bench-gpu-8b-q4.json
fi
# the four servers over HTTP on the 8B 4-bit model (LLAMA_TARGETS="llama-server llama-quantize")
if named serve-8b-q4; then
  TAIL=30 run_step serve-8b-q4 $RES/serve-8b-q4.done 420 bash -c "MLX_MEMORY_LIMIT_GIB=$SERVE_MLX_GIB python3 -m tools.bench.bench_http \
    --model $M/llama-8b-q4 --gguf $M/llama-8b-q4_0.gguf --llama-server $BIN/llama-server --tag=-h200-8b-q4 \
    ${SERVE_ARGS:-} && cp tools/results/bench-http-llama-8b-q4-*-h200-8b-q4* $RES/ && touch $RES/serve-8b-q4.done"
fi
if named parity-8b-q4; then
  TAIL=12 run_step parity-8b-q4 $RES/parity-8b-q4.json 150 python3 -m tools.check.parity_check \
    --model $M/llama-8b-q4 --prompts 16 --max-tokens 32 ${PARITY_ARGS:-} --json $RES/parity-8b-q4.json
fi

# ---- the CUDA kernel tests: each kernel against MLX's own ops, float32 exact (TF32 off) -----
if want kernel-tests; then
  tests=${PYTEST_GPU:--p no:benchmark -n 4 tests/test_decode_blocks.py tests/test_quantized_rows.py \
tests/test_paged_attention.py tests/test_dense_mma.py tests/test_residual_norms.py tests/test_fused_projections.py \
tests/test_decode_window.py tests/test_rows.py tests/test_step_layout.py -k cuda}
  TAIL=6 run_step kernel-tests $RES/kernel-tests.done ${KERNEL_TESTS_MIN_S:-300} bash -c "MLX_ENABLE_TF32=0 python3 -m pytest \
    -p no:cacheprovider -q -rA $tests && touch $RES/kernel-tests.done"
fi

# ---- two GPUs of one host (nvidia-h200-x2, tools/device/h200_x2.sh) -------------------------
if named nccl-tests; then  # tensor and pipeline parallel over NCCL, one rank's tokens
  TAIL=10 run_step nccl-tests $RES/nccl-tests.done 200 bash -c "env MLX_ENABLE_TF32=0 UNIKERN_TEST_BACKEND=nccl \
    python3 -m pytest -p no:cacheprovider -q -rA -o filterwarnings=default --durations=0 tests/test_distributed.py \
    && touch $RES/nccl-tests.done"
fi
if named bench-tp-8b; then  # the 8B-shape bf16 model at 64 requests, one GPU against tensor parallel over two
  run_step models-8b-bf16 $M/llama-8b/config.json 120 python3 -m tools.bench.bench_gpu models --out $M --shapes 8b \
    --quantize
  TAIL=10 run_step bench-tp-8b $RES/bench-tp-llama-8b-nccl.json 300 python3 -m tools.bench.bench_tp \
    --model $M/llama-8b --tp 2 --backend nccl --concurrency 64 --max-tokens 64 --repeats 3 \
    --out $RES/bench-tp-llama-8b-nccl.json
fi
wait_llama
(cd $RES && tar -czf $G/res.tgz . && cp $G/res.tgz "$OUT/gpu-results.tgz")  # one file: every log
say "done; $(left) s left"
