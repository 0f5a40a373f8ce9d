#!/usr/bin/env bash
# Issue 17 on an NVIDIA H200: unikern, mlx-lm and llama.cpp on the same 1B-shape bf16 and
# 8B-shape 4-bit Llama (tools/bench_gpu.py), the warm-start time, parity and a profile.
# Every step is skipped when its output exists, so calling this again on a still-warm
# machine resumes where the last call's time ran out (a call lasts at most 10 minutes).
#
#   tools/pack_h200_bundle.sh .whl                   # here, once: the wheels and llama.cpp's source
#   run(carry=[".whl/p0"]):  mkdir -p /tmp/w0 && cp -r .whl/p0/. /tmp/w0/
#   run(carry=[".whl/p1", ".whl/lc"]), within 30 s:  OUT=$OUT bash tools/h200_gpu.sh /tmp/w0 .whl/p1 .whl/lc
#   run() again while warm, as often as needed:      OUT=$OUT bash tools/h200_gpu.sh
#   (step ready-1b-tf: run(carry=[".whl/tf"]): mkdir -p /tmp/tfwhl && cp .whl/tf/*.whl /tmp/tfwhl/)
#
# .whl/p0 and .whl/p1 are MLX's CUDA wheels in two parts with the small wheels unikern
# needs there; .whl/lc/llama.cpp.tgz is the llama.cpp source vendored by the
# llama-cpp-python sdist, without docs, models, tests and the other backends
# (tools/pack_llama_cpp.sh). A call carries 64 MiB at most, the tracked tree included:
# .whl/p1 and .whl/lc fit together, .whl/tf travels alone. Results: $OUT/gpu/ (JSON,
# logs, summary.txt).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/h200-out}
G=/tmp/gpu  # models, llama.cpp and results: kept between calls while the machine is warm
RES=$G/res
mkdir -p "$RES" "$OUT"
START=$SECONDS
DEADLINE=$((SECONDS + ${GPU_BUDGET_S:-570}))
say() { echo "== [$((SECONDS - START)) s] $*" | tee -a "$RES/summary.txt"; }
left() { echo $((DEADLINE - SECONDS)); }
save() { mkdir -p "$OUT/gpu" && cp -r "$RES"/. "$OUT/gpu/"; }
trap save EXIT  # (the tarball at the end carries what the per-file copy may leave out)

if [ ! -e /tmp/py/mlx ] && [ $# -gt 0 ]; then
  say "setup"
  H200_TMP=/tmp bash "$REPO/tools/h200_run.sh" setup "$@" 2>&1 | tail -4 | tee -a "$RES/summary.txt"
fi
export PYTHONPATH=/tmp/py:/tmp/src:$REPO UNIKERN_MODEL_CACHE=/tmp/models TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1 MLX_MEMORY_LIMIT_GIB=${MLX_MEMORY_LIMIT_GIB:-60} CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PATH=$CUDA_HOME/bin:$PATH
cd "$REPO"  # the test steps name tests/ relative to it
for d in "$@"; do [ -f "$d/llama.cpp.tgz" ] && [ ! -d $G/llama.cpp ] && tar -xzf "$d/llama.cpp.tgz" -C $G; done
BIN=$G/llama-build/bin

build_llama() {  # only the three targets the benchmark needs
  [ -x $BIN/llama-batched-bench ] && [ -x $BIN/llama-quantize ] && return 0
  cmake -S $G/llama.cpp -B $G/llama-build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF > $RES/llama-cmake.log 2>&1 &&
  cmake --build $G/llama-build -j14 --target llama-batched-bench llama-quantize llama-bench > $RES/llama-build.log 2>&1
}

want() { [ -z "${GPU_STEPS:-}" ] || [[ " $GPU_STEPS " == *" $1 "* ]]; }  # GPU_STEPS: a subset of the steps
named() { [[ " ${GPU_STEPS:-} " == *" $1 "* ]]; }  # steps that run only when GPU_STEPS names them

step() {  # NAME DONE_FILE COMMAND...: runs it unless DONE_FILE exists, time is short or GPU_STEPS leaves it out
  local name=$1 done_file=$2; shift 2
  if [ -e "$done_file" ] || ! want "$name"; then return 0; fi
  if [ "$(left)" -lt 30 ]; then say "SKIPPED $name: $(left) s left"; return 1; fi
  local t0=$SECONDS
  local log="$RES/${LOG:-$name}.log"  # LOG: another name, for a step run more than once
  timeout $(($(left) - 10)) "$@" > "$log" 2>&1
  local rc=$?
  say "${LOG:-$name}: rc=$rc in $((SECONDS - t0)) s"
  grep -vE "^\s*$|\[(info|debug|warning)|it/s\]|s/it\]" "$log" | tail -${TAIL:-4} | tee -a "$RES/summary.txt"
  save
  return $rc
}

if [ ! -x $BIN/llama-batched-bench ] && want llama; then build_llama & BUILD_PID=$!; fi
say "nvidia-smi: $(nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader)"
M=$G/models
# That machine runs Python with PYTHONDONTWRITEBYTECODE=1. Step bytecode compiles the
# packages the import pulls in once, as pip does at install; in session 9 it wrote
# nothing new (they carried their bytecode), so bytecode is not why the import is slow.
if named bytecode; then
  step bytecode $RES/bytecode.log.done bash -c "python3 -m compileall -q -j 16 \$(python3 -c \
    'import importlib.util as u, pathlib as p; print(*(p.Path(u.find_spec(m).origin).parent for m in (\"transformers\", \"torch\", \"huggingface_hub\", \"tokenizers\", \"jinja2\", \"safetensors\")))') \
    > /dev/null; touch $RES/bytecode.log.done"
fi
# the warm start's import (issue 17): the same import three times in fresh processes,
# then where its time goes (-X importtime)
if named importtime; then
  TAIL=8 step importtime $RES/importtime.txt bash -c 'TIMEFORMAT="import: %R s"; for i in 1 2 3; do \
    time python3 -c "import unikern.frontends.worker, mlx_lm.utils"; done; \
    python3 -X importtime -c "import unikern.frontends.worker, mlx_lm.utils" 2> '"$RES"'/importtime.txt; \
    sort -t"|" -k2 -n '"$RES"'/importtime.txt | tail -4'
fi
step models-1b $M/llama-1b/config.json python3 "$REPO/tools/bench_gpu.py" models --out $M --shapes 1b --quantize
# float32 parity is asked with TF32 off (issue 17); session 7's run a, with TF32 on, failed
# three float32 families at margins of 0.006-0.2
TAIL=12 step pytest-gpu $RES/pytest-gpu.log.done bash -c "MLX_ENABLE_TF32=0 python3 -m pytest -p no:cacheprovider \
  -q -rA ${PYTEST_GPU:-tests/test_paged_attention.py tests/test_fused_projections.py tests/test_quantized_rows.py} \
  && touch $RES/pytest-gpu.log.done"
step gguf-1b $M/llama-1b-bf16.gguf python3 "$REPO/tools/bench_gpu.py" gguf --out $M --shapes 1b --quantize \
  --llama-cpp $G/llama.cpp --llama-bin $BIN
step models-8b $M/llama-8b-q4/config.json python3 "$REPO/tools/bench_gpu.py" models --out $M --shapes 8b --quantize 8b
step gguf-8b-bf16 $M/llama-8b-q4_0.gguf python3 "$REPO/tools/bench_gpu.py" gguf --out $M --shapes 8b --quantize \
  --llama-cpp $G/llama.cpp --llama-bin $BIN
if [ -n "${BUILD_PID:-}" ]; then
  wait $BUILD_PID; say "llama.cpp build: rc=$? $(tail -1 $RES/llama-build.log)"
fi
step gguf-8b-q4 $M/llama-8b-q4_0.gguf $BIN/llama-quantize $M/llama-8b-bf16.gguf $M/llama-8b-q4_0.gguf Q4_0
[ -e $M/llama-8b-q4_0.gguf ] && rm -f $M/llama-8b-bf16.gguf  # 16 GB of disk back
TAIL=9 step bench-1b $RES/bench-gpu-1b.json python3 "$REPO/tools/bench_gpu.py" bench --model $M/llama-1b \
  --gguf $M/llama-1b-bf16.gguf --llama-bin $BIN --split ${BENCH_ARGS:-} --label "llama 1B shape, bfloat16" --json $RES/bench-gpu-1b.json
TAIL=9 step bench-8b-q4 $RES/bench-gpu-8b-q4.json python3 "$REPO/tools/bench_gpu.py" bench --model $M/llama-8b-q4 \
  --gguf $M/llama-8b-q4_0.gguf --llama-bin $BIN --split ${BENCH_ARGS:-} --label "llama 8B shape, 4-bit (Q4_0 for llama.cpp)" \
  --json $RES/bench-gpu-8b-q4.json
# the 1B bench with mlx-lm in a process of its own (bench --isolate), so that this one holds
# the unikern engine alone; runs only when GPU_STEPS names it. Session 20's step_gaps runs
# (unikern alone in its process) were faster than its bench's unikern runs
if named bench-1b-iso; then
  TAIL=9 step bench-1b-iso $RES/bench-gpu-1b-iso.json python3 "$REPO/tools/bench_gpu.py" bench --model $M/llama-1b \
    --gguf $M/llama-1b-bf16.gguf --llama-bin $BIN --split --isolate ${BENCH_ARGS:-} \
    --label "llama 1B shape, bfloat16, mlx-lm in its own process" --json $RES/bench-gpu-1b-iso.json
fi
step ready-1b $RES/ready-1b.json python3 "$REPO/tools/first_request.py" --model $M/llama-1b --cold-warm \
  --warm-starts ${WARM_STARTS:-1} --json $RES/ready-1b.json
# the warm start with the transformers release that pip installs beside unikern today
# (5.24.0; the image has 5.17.0, whose import pulls in generation, scikit-learn and
# torch.distributed): its wheel in /tmp/tfwhl, installed apart, first on the path
if named ready-1b-tf && ls /tmp/tfwhl/transformers-*.whl > /dev/null 2>&1; then
  [ -d /tmp/tf/transformers ] || python3 -m pip install -q --no-index --no-deps --target /tmp/tf \
    /tmp/tfwhl/transformers-*.whl 2>&1 | tail -2
  step ready-1b-tf $RES/ready-1b-tf.json env PYTHONPATH=/tmp/tf:$PYTHONPATH python3 "$REPO/tools/first_request.py" \
    --model $M/llama-1b --cold-warm --warm-starts ${WARM_STARTS:-1} --json $RES/ready-1b-tf.json
fi
TAIL=12 step parity-1b $RES/parity-1b.json python3 "$REPO/tools/parity_check.py" --model $M/llama-1b --prompts 16 \
  --max-tokens 32 ${PARITY_ARGS:-} --json $RES/parity-1b.json
# the 8B 4-bit model's greedy tokens against mlx-lm's with PARITY_8B_SETS (e.g. the
# tensor-core kernel: "execute.quantized_mma=always") and PARITY_8B_ARGS (e.g.
# "--mlx-lm-batch": how far mlx-lm's own batch_generate strays); runs only when GPU_STEPS names it
if named parity-8b-q4; then
  sets=(); for p in ${PARITY_8B_SETS:-}; do sets+=(--set "$p"); done
  TAIL=12 step parity-8b-q4 $RES/parity-8b-q4.json python3 "$REPO/tools/parity_check.py" --model $M/llama-8b-q4 \
    --prompts 16 --max-tokens 32 "${sets[@]}" ${PARITY_8B_ARGS:-} --json $RES/parity-8b-q4.json
fi
TAIL=12 step profile-decode-1b $RES/profile-decode-1b.json python3 "$REPO/tools/profile_decode.py" \
  --model $M/llama-1b --tokens 64 --repeats 5 --json $RES/profile-decode-1b.json
# execute.dequantize_rows (stages/execute/quantized.py): the 8B 4-bit model with MLX's
# quantized kernel for every row count against dequantized weights from 8 rows
TAIL=6 step bench-8b-q4-auto $RES/bench-gpu-8b-q4-auto.json python3 "$REPO/tools/bench_gpu.py" bench \
  --model $M/llama-8b-q4 --engines mlx-lm unikern --repeats 3 --label "llama 8B shape, 4-bit, dequantize_rows auto" \
  --json $RES/bench-gpu-8b-q4-auto.json
TAIL=6 step bench-8b-q4-never $RES/bench-gpu-8b-q4-never.json python3 "$REPO/tools/bench_gpu.py" bench \
  --model $M/llama-8b-q4 --engines unikern --repeats 3 --set execute.dequantize_rows=never \
  --label "llama 8B shape, 4-bit, dequantize_rows never" --json $RES/bench-gpu-8b-q4-never.json
# issue 17, session 6: where a one-row decode token's time goes (host build / MLX encode /
# GPU kernels) under MLX's CUDA settings, then the engines under the settings that matter
TAIL=40 step probe-1b $RES/probe-1b.json python3 "$REPO/tools/probe_cuda.py" --model $M/llama-1b \
  --json $RES/probe-1b.json
# the engine's own decode (ModelRunner windows) with and without paged attention, one row and 64;
# PROBE_PROMPT: the prompt's length (64 by default; longer for the attention at long contexts);
# PROBE_ENGINE_ROWS_VARIANTS: another list for the steps of more than one row
for rows in ${PROBE_ENGINE_ROWS:-1 64}; do
  n=rows$rows; [ -n "${PROBE_PROMPT:-}" ] && n=$n-prompt$PROBE_PROMPT
  variants=${PROBE_ENGINE_VARIANTS:-engine engine-paged engine-paged-group}
  [ "$rows" -gt 1 ] && variants=${PROBE_ENGINE_ROWS_VARIANTS:-$variants}
  LOG=probe-engine-1b-$n TAIL=30 step probe-engine "$RES/probe-engine-1b-$n.json" python3 "$REPO/tools/probe_cuda.py" \
    --model $M/llama-1b --rows "$rows" --prompt "${PROBE_PROMPT:-64}" \
    --variants $variants --repeats 3 --rounds ${PROBE_ROUNDS:-1} \
    --json "$RES/probe-engine-1b-$n.json"
done
# what a kernel's read of a small array costs, by where MLX put it (tools/probe_memory.py);
# runs only when GPU_STEPS names it
if named probe-memory; then
  TAIL=12 step probe-memory "$RES/probe-memory.json" python3 "$REPO/tools/probe_memory.py" --json "$RES/probe-memory.json"
fi
# the host's cost per MLX primitive, by kind (tools/probe_ops.py); runs only when GPU_STEPS names it
if named probe-ops; then
  TAIL=16 step probe-ops "$RES/probe-ops.json" python3 "$REPO/tools/probe_ops.py" --json "$RES/probe-ops.json"
fi
# the fused block's GEMV kernel variant by variant against MLX's matmul (which prologue or
# epilogue is slow; BLOCK_GEMV_ARGS, e.g. "--set UNROLL=1"); runs only when GPU_STEPS names it
if named bench-block-gemv; then
  TAIL=16 step bench-block-gemv "$RES/bench-block-gemv${BLOCK_GEMV_LABEL:-}.json" python3 "$REPO/tools/bench_block_gemv.py" \
    ${BLOCK_GEMV_ARGS:-} --json "$RES/bench-block-gemv${BLOCK_GEMV_LABEL:-}.json"
fi
# two settings of unikern in one process, runs interleaved (tools/bench_ab.py): AB_A and AB_B
# (space-separated STAGE.KEY=VALUE; empty: the defaults), AB_MODEL (1b, 8b-q4), AB_LABEL
# names the file, AB_ARGS more of bench_ab's arguments (e.g. "--concurrency 1"); runs only
# when GPU_STEPS names it
if named ab; then
  LOG=ab-${AB_MODEL:-1b}${AB_LABEL:-} TAIL=8 step ab "$RES/ab-${AB_MODEL:-1b}${AB_LABEL:-}.json" python3 "$REPO/tools/bench_ab.py" \
    --model $M/llama-${AB_MODEL:-1b} --a ${AB_A:-} --b ${AB_B:-} --repeats ${AB_REPEATS:-6} ${AB_ARGS:-} \
    --label "llama ${AB_MODEL:-1b}${AB_LABEL:-}" --json "$RES/ab-${AB_MODEL:-1b}${AB_LABEL:-}.json"
fi
# a prompt's prefill step as the engine runs it: host build, MLX's encode and wait, GPU kernels
# (tools/probe_prefill.py; PREFILL_ARGS more arguments, e.g. "--set prefill_rows=0",
# PREFILL_LABEL names the file); runs only when GPU_STEPS names it
if named probe-prefill; then
  LOG=probe-prefill${PREFILL_LABEL:-} TAIL=40 step probe-prefill "$RES/probe-prefill${PREFILL_LABEL:-}.json" \
    python3 "$REPO/tools/probe_prefill.py" --model $M/llama-1b --profile ${PREFILL_ARGS:-} \
    --json "$RES/probe-prefill${PREFILL_LABEL:-}.json"
fi
# the block kernel's phases (block_kernel.TIMES) and variants of its constants, on random
# 1B-shape blocks (tools/probe_block_phases.py; PHASES_ARGS, e.g. "--variants default
# UNROLL=2"); runs only when GPU_STEPS names it
if named probe-phases; then
  TAIL=40 step probe-phases "$RES/probe-phases${PHASES_LABEL:-}.json" python3 "$REPO/tools/probe_block_phases.py" \
    ${PHASES_ARGS:-} --json "$RES/probe-phases${PHASES_LABEL:-}.json"
fi
# the engine's run split into time inside the model thread's steps and the gaps between them
# (GAPS_ARGS, e.g. "--set execute.gil_switch_ms=0.2": the GIL handed over sooner to the model thread)
TAIL=6 step gaps-1b "$RES/gaps-1b${GAPS_LABEL:-}.json" python3 "$REPO/tools/step_gaps.py" --model $M/llama-1b \
  --concurrency 1 16 64 ${GAPS_ARGS:-} --json "$RES/gaps-1b${GAPS_LABEL:-}.json"
# the 8B 4-bit model's decode step: MLX's quantized matmul against unikern's GEMV and
# tensor-core kernels, at one row and (PROBE_8B_ROWS) more
for rows in ${PROBE_8B_ROWS:-1}; do
  variants=${PROBE_8B_ROW1_VARIANTS:-default qgemv engine-paged engine-paged-qgemv}
  [ "$rows" -gt 1 ] && variants=${PROBE_8B_VARIANTS:-engine-paged engine-paged-qgemv-all engine-paged-qmma}
  LOG=probe-8b-q4-rows$rows TAIL=30 step probe-8b-q4 "$RES/probe-8b-q4-rows$rows.json" python3 "$REPO/tools/probe_cuda.py" --model $M/llama-8b-q4 \
    --rows "$rows" --variants $variants --repeats 3 --json "$RES/probe-8b-q4-rows$rows.json"
done
for v in ${BENCH_ENV_VARIANTS:-}; do  # e.g. "MLX_USE_CUDA_GRAPHS=0": the 1B bench with that setting
  n=${v//=/-}  # step bench-1b-env: GPU_STEPS names it so
  TAIL=6 step bench-1b-env "$RES/bench-gpu-1b-$n.json" env "$v" python3 "$REPO/tools/bench_gpu.py" bench \
    --model $M/llama-1b --engines mlx-lm unikern --repeats 3 --concurrency 1 64 --label "llama 1B, $v" \
    --json "$RES/bench-gpu-1b-$n.json"
done
for r in $(seq "${BENCH_SET_ROUNDS:-1}"); do  # rounds interleave the variants (an A/B, twice...)
  for m in ${BENCH_SET_MODELS:-1b}; do  # each model under each --set variant, e.g. "execute.fuse_projections=never"
    engines="mlx-lm unikern"; [ "$m" = 8b-q4 ] && engines=unikern
    for v in ${BENCH_SET_VARIANTS:-}; do  # a variant of several settings: comma-separated
      n=${v//=/-}; n=${n//,/_}; [ "$r" -gt 1 ] && n="$n-round$r"
      sets=(); IFS=, read -ra parts <<< "$v"; for p in "${parts[@]}"; do sets+=(--set "$p"); done
      TAIL=6 step bench-set "$RES/bench-gpu-$m-$n.json" python3 "$REPO/tools/bench_gpu.py" bench --model $M/llama-$m \
        --engines $engines --repeats ${BENCH_SET_REPEATS:-3} "${sets[@]}" --label "llama $m, $v, round $r" \
        --json "$RES/bench-gpu-$m-$n.json"
    done
  done
done
# two GPUs of one host (nvidia-h200-x2; tools/h200_x2.sh names these): issue 18's tests over
# NCCL, and the 8B-shape bf16 model at 64 requests on 1 GPU against tensor parallelism 2
if named pytest-nccl; then
  TAIL=30 step pytest-nccl $RES/pytest-nccl.log.done bash -c "env MLX_ENABLE_TF32=0 UNIKERN_TEST_BACKEND=nccl \
    python3 -m pytest -p no:cacheprovider -q -rA -o filterwarnings=default --durations=0 tests/test_distributed.py \
    && touch $RES/pytest-nccl.log.done"
fi
if named bench-tp-8b; then
  TAIL=10 step bench-tp-8b $RES/bench-tp-llama-8b-nccl.json python3 "$REPO/tools/bench_tp.py" --model $M/llama-8b \
    --tp 2 --backend nccl --concurrency 64 --max-tokens 64 --repeats 3 --out $RES/bench-tp-llama-8b-nccl.json
fi
(cd $RES && tar -czf $G/res.tgz . && mkdir -p "$OUT" && cp $G/res.tgz "$OUT/gpu-results.tgz")  # one file: every log
say "done; $(left) s left"
