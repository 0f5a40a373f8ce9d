#!/usr/bin/env bash
# unikern on an NVIDIA H200 through MLX's CUDA backend (issue 7): installs the carried
# wheels, then benchmarks, checks greedy parity, reads stats.platform and profiles,
# writing everything under $OUT (one tarball plus a summary).
#
# The GPU machine has Python 3.12 with PyTorch/transformers but no MLX and no network.
# What travels (see tools/results/H200.md): MLX's CUDA wheel split in two parts by
# ../shared/tools/mlx-cuda-bundle.sh (the first part in one call, copied to /tmp/w0, the
# second in the next call while the machine is warm), mlx + mlx-lm, the missing small
# wheels (msgspec, structlog, zstandard, trio, outcome, sniffio, anyio) and a `git archive`
# of the commit under test, which this script runs from.
#
#   tools/h200_run.sh all WHEEL_DIR...     # setup + every measurement
#   H200_PHASES="variants proto80 proto5 protoparity" tools/h200_run.sh all WHEEL_DIR...
#                                          # the prototype measurements instead
#   tools/h200_run.sh setup WHEEL_DIR...   # install only
#
# How it was sent (repo root here; .whl/ is in .git/info/exclude):
#   .whl/p0: mlx_cuda_13-...whl.parts/part.00 + the small wheels
#   .whl/p1: mlx_cuda_13-...whl.parts/{part.01,SHA256}, mlx and mlx-lm wheels, COMMIT and
#            src.tar = `git archive HEAD` with tools/h200_run.sh + tools/parity_check.py appended
#   run(carry=[".whl/p0"]):  mkdir -p /tmp/w0 && cp -r .whl/p0/. /tmp/w0/
#   run(carry=[".whl/p1"]), within 30 s:  W1=$PWD/.whl/p1; mkdir -p /tmp/repo &&
#       tar -xf $W1/src.tar -C /tmp/repo && cp $W1/COMMIT /tmp/repo/ && cd /tmp/repo &&
#       OUT=$OUT bash tools/h200_run.sh all /tmp/w0 $W1
#
# Environment: OUT (results; default /tmp/h200-out), MLX_MEMORY_LIMIT_GIB (40),
# KV_BUDGET (8 GiB), H200_QUICK=1 (tiny settings, for a dry run on a CPU machine).
set -uo pipefail
OUT=${OUT:-/tmp/h200-out}
export H200_TMP=${H200_TMP:-/tmp}; T=$H200_TMP  # scratch: $T/py (installed wheels), $T/src (package farm), $T/whl
PY=$T/py
SRC=$T/src
REPO=$(cd "$(dirname "$0")/.." && pwd)
RES=$T/res  # every log and JSON; pack() tars it into $OUT/h200.tgz after each phase
LOGS=$RES/logs
mkdir -p "$OUT" "$LOGS"
export UNIKERN_MODEL_CACHE=${UNIKERN_MODEL_CACHE:-/tmp/models}
export MLX_MEMORY_LIMIT_GIB=${MLX_MEMORY_LIMIT_GIB:-40}
export KV_BUDGET=${KV_BUDGET:-8589934592}
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-$T/mlx-ptx}  # MLX CUDA's JIT cache, shared by the runs
export H200_QUICK=${H200_QUICK:-0}; QUICK=$H200_QUICK
SUMMARY=$RES/summary.txt
DEADLINE=$((SECONDS + ${H200_BUDGET_S:-560}))  # stop starting phases past this

say() { echo "== $*" | tee -a "$SUMMARY"; }

setup() {
  local start=$SECONDS
  mkdir -p $T/whl "$PY"
  for dir in "$@"; do cp -r "$dir"/. $T/whl/ 2>/dev/null; done
  for parts in $T/whl/*.whl.parts; do
    [ -d "$parts" ] || continue
    local name; name=$(basename "$parts" .parts)
    cat "$parts"/part.* > "$T/whl/$name"
    if [ "$(sha256sum "$T/whl/$name" | cut -d' ' -f1)" != "$(cat "$parts/SHA256")" ]; then
      say "SHA256 MISMATCH for $name"; return 1
    fi
    say "reassembled $name (sha256 ok)"
  done
  if ls "$T"/whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$PY" "$T"/whl/*.whl 2>&1 | grep -v "^$" | tail -5
  fi
  # libmlx.so looks for the CUDA libraries at $ORIGIN/../../nvidia/...: point that at the
  # image's own nvidia-* wheels (PyTorch's), and put them on LD_LIBRARY_PATH as well
  local nv; nv=$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null)
  if [ -n "$nv" ] && [ ! -e "$PY/nvidia" ]; then ln -s "$nv" "$PY/nvidia"; fi
  # the package map of pyproject.toml, as a symlink farm
  rm -rf "$SRC"; mkdir -p "$SRC/unikern"
  ln -s "$REPO"/kernel/* "$SRC/unikern/"
  ln -s "$REPO/stages" "$SRC/unikern/stages"
  ln -s "$REPO/pipelines" "$SRC/unikern/pipelines"
  # cap MLX's memory in every process: set the limit as soon as mlx.core is imported,
  # without importing it earlier (unikern must preload its BLAS before mlx loads)
  cat > "$PY/sitecustomize.py" <<'EOF'
import importlib.machinery, importlib.util, os, sys

_limit = int(float(os.environ.get("MLX_MEMORY_LIMIT_GIB", "0")) * (1 << 30))


class _CapMLX:
    def find_spec(self, name, path=None, target=None):
        if name != "mlx.core" or not _limit:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        inner = spec.loader

        class Loader:
            def create_module(self, spec):
                return inner.create_module(spec)

            def exec_module(self, module):
                inner.exec_module(module)
                module.set_memory_limit(_limit)

        spec.loader = Loader()
        return spec


sys.meta_path.insert(0, _CapMLX())

# run the sitecustomize this one shadows, if any
_here = os.path.dirname(os.path.abspath(__file__))
for _d in sys.path:
    _f = os.path.join(_d or ".", "sitecustomize.py")
    if os.path.abspath(_d or ".") != _here and os.path.isfile(_f):
        _s = importlib.util.spec_from_file_location("_shadowed_sitecustomize", _f)
        _s.loader.exec_module(importlib.util.module_from_spec(_s))
        break
EOF
  say "setup done in $((SECONDS - start)) s"
}

env_report() {
  {
    date -u; echo "commit $(cat "$REPO/COMMIT" 2>/dev/null || git -C "$REPO" rev-parse HEAD)"
    uname -a; nvidia-smi; python3 --version
    nvidia-smi --query-gpu=name,memory.total,memory.free,driver_version,clocks.sm,clocks.mem --format=csv
    timeout "$PHASE_TIMEOUT" python3 - <<'EOF'
import importlib, platform
for name in ["mlx", "mlx_lm", "torch", "transformers", "tokenizers", "anyio", "msgspec", "structlog",
             "psutil", "zstandard", "numpy", "pytest", "hypothesis", "trio", "yaml", "matplotlib"]:
    try:
        mod = importlib.import_module(name)
        print(f"{name:14} {getattr(mod, '__version__', '?'):12} {getattr(mod, '__file__', '')}")
    except Exception as exc:
        print(f"{name:14} MISSING ({type(exc).__name__}: {exc})")
import mlx.core as mx
print("mlx.core", mx.__version__)
print("mlx default device", mx.default_device(), "cuda", mx.cuda.is_available(), "metal", mx.metal.is_available())
print("device_info", mx.device_info(mx.gpu) if mx.cuda.is_available() else mx.device_info(mx.cpu))
print("memory limit now", mx.set_memory_limit(40 << 30) / 2**30, "GiB (expected", __import__("os").environ["MLX_MEMORY_LIMIT_GIB"], ")")
import os, time
n = 512 if os.environ.get("H200_QUICK") == "1" else 4096
for dt in (mx.float32, mx.bfloat16):
    a = mx.random.normal((n, n)).astype(dt)
    mx.eval(a @ a)
    t = time.perf_counter()
    for _ in range(20):
        b = a @ a
        mx.eval(b)
    dt_s = (time.perf_counter() - t) / 20
    print(f"matmul {n}^3 {dt}: {2 * n**3 / dt_s / 1e12:.1f} TFLOP/s")
import torch
t = torch.from_dlpack(mx.arange(8))
print("torch.from_dlpack(mx.arange(8)):", t.device, t.tolist())
EOF
    MLX_ENABLE_TF32=0 timeout 60 python3 -c "
import mlx.core as mx, time
a = mx.random.normal((4096, 4096)); mx.eval(a @ a); t = time.perf_counter()
for _ in range(20): mx.eval(a @ a)
print(f'matmul 4096^3 float32 with MLX_ENABLE_TF32=0: {2 * 4096**3 * 20 / (time.perf_counter() - t) / 1e12:.1f} TFLOP/s')"
  } > "$LOGS/env.txt" 2>&1
  grep -E "^commit|NVIDIA H|MISSING|^mlx|^torch |device_info|memory limit|matmul|from_dlpack|Python 3" "$LOGS/env.txt" | tee -a "$SUMMARY"
}

build_models() {
  timeout "$PHASE_TIMEOUT" python3 - <<'EOF' 2>&1 | tee -a "$SUMMARY"
import json, os, time
from unikern.testing.modelgen import PRESETS, cached_model, parameter_count
paths = {}
for name, spec in [("llama-5m", "llama-5m"), ("llama-80m", "llama-80m"),
                   ("llama-80m-bf16", dict(PRESETS["llama-80m"], dtype="bfloat16"))]:
    t = time.perf_counter()
    paths[name] = str(cached_model(spec))
    print(f"model {name}: {parameter_count(spec) / 1e6:.1f}M params at {paths[name]} ({time.perf_counter() - t:.1f} s)")
json.dump(paths, open(os.environ["H200_TMP"] + "/model_paths.json", "w"))
EOF
}

model_dir() { python3 -c "import json; print(json.load(open('$T/model_paths.json'))['$1'])"; }

bench() {  # NAME [extra bench args]; BENCH_TAG names the results apart, BENCH_ARGS replaces the defaults
  local name=$1; shift
  local tag=$name${BENCH_TAG:-}
  local args=(${BENCH_ARGS:---concurrency 1 16 64 --repeats 5})
  [ "$QUICK" = 1 ] && args=(--concurrency 1 4 --repeats 1 --max-tokens 8)
  say "bench $tag ${args[*]} $*"
  timeout "$PHASE_TIMEOUT" python3 "$REPO/tools/bench.py" --model "$(model_dir "$name")" "${args[@]}" \
    --json "$RES/h200-bench-$tag.json" "$@" > "$LOGS/bench-$tag.log" 2>&1
  echo "rc=$?" >> "$LOGS/bench-$tag.log"
  grep -vE "^\s*$|\[(info|debug)" "$LOGS/bench-$tag.log" | tail -8 | tee -a "$SUMMARY"
}

decode_profile() {  # tools/profile_decode.py: per-token cost, mlx-lm's loop against the runner's variants
  say "profile_decode llama-80m"
  local args=(--tokens 64 --repeats 5)
  [ "$QUICK" = 1 ] && args=(--tokens 8 --repeats 1)
  timeout "$PHASE_TIMEOUT" python3 "$REPO/tools/profile_decode.py" --model "$(model_dir llama-80m)" "${args[@]}" \
    --json "$RES/h200-profile-decode.json" > "$LOGS/profile-decode.log" 2>&1
  echo "rc=$?" >> "$LOGS/profile-decode.log"
  grep -E "ms/token|rc=|Error" "$LOGS/profile-decode.log" | tee -a "$SUMMARY"
}

parity() {  # [TAG ENV=VALUE MODELS...]: all prompts in flight at once, and mlx-lm's batch_generate
  local tag=${1:-}; shift || true
  local envset=${1:-}; shift || true
  local models=("$@")
  [ ${#models[@]} -eq 0 ] && models=(llama-5m llama-80m llama-80m-bf16)
  local dirs=(); for m in "${models[@]}"; do dirs+=("$(model_dir "$m")"); done
  say "parity$tag (tools/parity_check.py --mlx-lm-batch${envset:+, $envset}): ${models[*]}"
  local n=16 t=32
  [ "$QUICK" = 1 ] && n=4 t=6
  env $envset timeout "$PHASE_TIMEOUT" python3 "$REPO/tools/parity_check.py" --model "${dirs[@]}" \
    --prompts $n --max-tokens $t --mlx-lm-batch --json "$RES/h200-parity$tag.json" \
    > "$LOGS/parity_check$tag.log" 2>&1
  echo "rc=$?" >> "$LOGS/parity_check$tag.log"
  grep -vE "\[(info|debug|warning)" "$LOGS/parity_check$tag.log" | tail -30 | tee -a "$SUMMARY"
}

parity_diag() {  # the bf16 parity run alone, with the compiled decode step on and off, CUDA graphs off
  local bf16; bf16=$(model_dir llama-80m-bf16)
  local variant
  for variant in "default|" "nocompile|--set execute.compile_decode=never" "nographs|MLX_USE_CUDA_GRAPHS=0" \
                 "default-again|"; do
    local tag=${variant%%|*} rest=${variant#*|} envset="" sets=""
    case $rest in MLX_*) envset=$rest ;; *) sets=$rest ;; esac
    say "parity bf16 alone: $tag ${envset}${sets}"
    env PYTHONFAULTHANDLER=1 $envset timeout 60 python3 "$REPO/tools/parity_check.py" --model "$bf16" --prompts 16 \
      --max-tokens 32 $sets --json "$RES/h200-parity-bf16-$tag.json" > "$LOGS/parity-bf16-$tag.log" 2>&1
    echo "rc=$?" >> "$LOGS/parity-bf16-$tag.log"
    grep -E "^parity|rc=|Error|error|terminate|File" "$LOGS/parity-bf16-$tag.log" | head -12 | tee -a "$SUMMARY"
  done
}

first_request() {  # NAME: fresh workers (empty MLX kernel cache each), warm-up on and off
  say "first requests of a fresh worker, $1: execute.warmup auto / never"
  timeout "$PHASE_TIMEOUT" python3 "$REPO/tools/first_request.py" --model "$(model_dir "$1")" --variants auto never \
    --fresh-cache --json "$RES/h200-first-request-$1.json" > "$LOGS/first-request-$1.log" 2>&1
  echo "rc=$?" >> "$LOGS/first-request-$1.log"
  grep -E "^warmup|rc=|Error" "$LOGS/first-request-$1.log" | tee -a "$SUMMARY"
}

pytest_parity() {
  say "pytest tests/test_parity.py"
  (cd "$REPO" && timeout "$PHASE_TIMEOUT" python3 -m pytest -q -p no:cacheprovider -o filterwarnings=default \
    tests/test_parity.py) > "$LOGS/pytest-parity.log" 2>&1
  echo "rc=$?" >> "$LOGS/pytest-parity.log"
  tail -15 "$LOGS/pytest-parity.log" | tee -a "$SUMMARY"
}

worker_stats() {
  say "worker stats (llama-80m)"
  # stats, one request, stats again while its blocks are resident, stats after it
  # (a warm-up request first: the first forward JIT-compiles MLX's CUDA kernels)
  { printf '{"op":"stats"}\n{"op":"generate","id":"r0","prompt_tokens":[5,6,7],"max_tokens":4}\n'
    sleep 8; printf '{"op":"generate","id":"r1","prompt_tokens":[5,6,7,8,9,10,11,12],"max_tokens":1000}\n'
    sleep 1; printf '{"op":"stats"}\n'; sleep 5; printf '{"op":"stats"}\n'; } \
    | timeout "$PHASE_TIMEOUT" python3 -m unikern worker --model "$(model_dir llama-80m)" \
    --set "kv.kv_budget_bytes=$KV_BUDGET" > "$RES/h200-worker-stats.ndjson" 2> "$LOGS/worker.log"
  echo "rc=$?" >> "$LOGS/worker.log"
  python3 - "$RES/h200-worker-stats.ndjson" <<'EOF' 2>&1 | tee -a "$SUMMARY"
import json, sys
for line in open(sys.argv[1]):
    ev = json.loads(line)
    if ev.get("event") == "stats":
        print("stats.platform", json.dumps(ev.get("platform")))
        print("stats.memory", json.dumps(ev.get("memory")))
        print("stats.kv", json.dumps(ev.get("kv")), "stats.bridge", json.dumps(ev.get("bridge")))
    elif ev.get("event") != "token":
        print(json.dumps(ev)[:300])
EOF
}

write_profiler() {
  sed -n "/^: <<'PROFILE_PY'\$/,/^PROFILE_PY\$/p" "$0" | sed '1d;$d' > "$T/h200_profile.py"
}

profile() {
  say "profile llama-80m"
  write_profiler
  [ "$QUICK" = 1 ] && export PROF_STEPS=5
  timeout "$PHASE_TIMEOUT" python3 "$T/h200_profile.py" "$(model_dir llama-80m)" "$RES/h200-profile.json" "$KV_BUDGET" \
    > "$LOGS/profile.log" 2>&1
  echo "rc=$?" >> "$LOGS/profile.log"
  grep -E "^  (forward|engine|mlx-lm)|^profile|rc=|Error" "$LOGS/profile.log" | tee -a "$SUMMARY"
}

# PROTOTYPES (monkeypatched in by the profiler, not in the repo): schedule the next step
# before the tokens fan out (overlap), and decode_lookahead 32 instead of 8
variants() {
  say "engine variants llama-80m: overlap prototype x lookahead 8/32, each twice"
  write_profiler
  timeout "$PHASE_TIMEOUT" python3 "$T/h200_profile.py" variants "$(model_dir llama-80m)" "$RES/h200-variants.json" \
    "$KV_BUDGET" > "$LOGS/variants.log" 2>&1
  echo "rc=$?" >> "$LOGS/variants.log"
  grep -E "^  engine|rc=|Error" "$LOGS/variants.log" | tee -a "$SUMMARY"
}

proto_bench() {  # NAME [TAG ENV=VALUE...]: tools/bench.py with prototypes (default: overlap + lookahead 32)
  local name=$1 tag=${2:-}; shift 2 || shift
  local settings=("$@")
  [ ${#settings[@]} -eq 0 ] && settings=(PROTO_OVERLAP=1 PROTO_LOOKAHEAD=32)
  say "bench $name with the prototypes (${settings[*]})"
  write_profiler
  env "${settings[@]}" timeout "$PHASE_TIMEOUT" python3 "$T/h200_profile.py" proto-bench \
    "$REPO/tools/bench.py" --model "$(model_dir "$name")" --concurrency 1 16 64 --repeats 3 \
    --json "$RES/h200-proto-bench-$name$tag.json" > "$LOGS/proto-bench-$name$tag.log" 2>&1
  echo "rc=$?" >> "$LOGS/proto-bench-$name$tag.log"
  grep -vE "^\s*$|\[(info|debug|warning)" "$LOGS/proto-bench-$name$tag.log" | tail -8 | tee -a "$SUMMARY"
}

switch_variants() {
  say "GIL switch interval 5 ms vs 0.5 ms, with and without the overlap prototype (llama-80m, 3 rounds)"
  write_profiler
  timeout "$PHASE_TIMEOUT" python3 "$T/h200_profile.py" switch "$(model_dir llama-80m)" "$RES/h200-switch.json" \
    "$KV_BUDGET" > "$LOGS/switch.log" 2>&1
  echo "rc=$?" >> "$LOGS/switch.log"
  grep -E "^  engine|rc=|Error" "$LOGS/switch.log" | tee -a "$SUMMARY"
}

proto_parity() {
  say "parity with the prototypes (MLX_ENABLE_TF32=0)"
  write_profiler
  PROTO_OVERLAP=1 PROTO_LOOKAHEAD=32 MLX_ENABLE_TF32=0 timeout "$PHASE_TIMEOUT" python3 "$T/h200_profile.py" \
    proto-bench "$REPO/tools/parity_check.py" --model "$(model_dir llama-5m)" "$(model_dir llama-80m)" \
    --prompts 16 --max-tokens 32 --json "$RES/h200-proto-parity.json" > "$LOGS/proto-parity.log" 2>&1
  echo "rc=$?" >> "$LOGS/proto-parity.log"
  grep -vE "\[(info|debug|warning)" "$LOGS/proto-parity.log" | tail -8 | tee -a "$SUMMARY"
}

offload_bench() {
  say "disk warm-restart (tools/bench_offload.py --preset llama-80m, bf16)"
  timeout "$PHASE_TIMEOUT" python3 "$REPO/tools/bench_offload.py" --preset llama-80m --prompt-tokens 2048 \
    --repeats 3 --json "$RES/h200-offload.json" > "$LOGS/offload.log" 2>&1
  echo "rc=$?" >> "$LOGS/offload.log"
  grep -vE "^\s*$|\[(info|debug|warning)" "$LOGS/offload.log" | tail -25 | tee -a "$SUMMARY"
}

pack() {
  (cd "$RES" && tar -czf "$OUT/h200.tgz.tmp" . && mv "$OUT/h200.tgz.tmp" "$OUT/h200.tgz")
  cp "$SUMMARY" "$OUT/summary.txt"
}

left() { echo $((DEADLINE - SECONDS)); }

phase() {  # NAME TIMEOUT_S FUNCTION ARGS...: runs it if time is left, with its timeout cut to fit
  local name=$1 limit=$2; shift 2
  local remaining; remaining=$(left)
  if [ "$remaining" -lt 25 ]; then say "SKIPPED $name: ${remaining}s left"; return; fi
  [ "$limit" -gt $((remaining - 5)) ] && limit=$((remaining - 5))
  local t0=$SECONDS
  PHASE_TIMEOUT=$limit "$@"
  say "[$name: $((SECONDS - t0)) s, $(left) s left]"
  pack
}

cmd=${1:-all}; shift || true
export PYTHONPATH=$PY:$SRC:$REPO${PYTHONPATH:+:$PYTHONPATH}
[ -d /usr/local/cuda ] && export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
case $cmd in
  setup) setup "$@" ;;
  all)
    setup "$@" || { pack; exit 1; }
    cp "$0" "$LOGS/h200_run.sh"
    if [ -n "${H200_PHASES:-}" ]; then  # e.g. H200_PHASES="variants proto80 proto5 protoparity"
      [ -z "${H200_SKIP_ENV:-}" ] && phase env 90 env_report  # H200_SKIP_ENV=1: no versions/matmul report
      phase models 120 build_models
      for p in $H200_PHASES; do
        case $p in
          variants) phase variants 200 variants ;;
          decode) phase profile-decode 150 decode_profile ;;
          c1) BENCH_TAG=-c1 BENCH_ARGS="--concurrency 1 --repeats 21" phase bench-80m-c1 90 bench llama-80m ;;
          c1nc) BENCH_TAG=-c1-nocompile BENCH_ARGS="--concurrency 1 --repeats 21" \
            phase bench-80m-c1-nocompile 90 bench llama-80m --set execute.compile_decode=never ;;
          c1la32) BENCH_TAG=-c1-lookahead32 BENCH_ARGS="--concurrency 1 --repeats 21" \
            phase bench-80m-c1-lookahead32 90 bench llama-80m --set schedule.decode_lookahead=32 ;;
          c1long) BENCH_TAG=-c1-256 BENCH_ARGS="--concurrency 1 --repeats 7 --max-tokens 256" \
            phase bench-80m-c1-256 90 bench llama-80m ;;
          c1longnc) BENCH_TAG=-c1-256-nocompile BENCH_ARGS="--concurrency 1 --repeats 3 --max-tokens 256" \
            phase bench-80m-c1-256-nocompile 90 bench llama-80m --set execute.compile_decode=never ;;
          bench80nc) BENCH_TAG=-nocompile phase bench-80m-nocompile 150 bench llama-80m --set execute.compile_decode=never ;;
          bench5nc) BENCH_TAG=-nocompile phase bench-5m-nocompile 120 bench llama-5m --set execute.compile_decode=never ;;
          bench80bf16nc) BENCH_TAG=-nocompile phase bench-80m-bf16-nocompile 150 bench llama-80m-bf16 \
            --set execute.compile_decode=never ;;
          bench80) phase bench-80m 150 bench llama-80m ;;
          bench5) phase bench-5m 120 bench llama-5m ;;
          bench80bf16) phase bench-80m-bf16 150 bench llama-80m-bf16 ;;
          parity) phase parity 150 parity ;;
          firstreq80) phase first-request-80m 100 first_request llama-80m ;;
          firstreqbf16) phase first-request-80m-bf16 150 first_request llama-80m-bf16 ;;
          paritydiag) phase parity-diag 240 parity_diag ;;
          paritynotf32) phase parity-notf32 120 parity -notf32 MLX_ENABLE_TF32=0 llama-5m llama-80m ;;
          offload) phase offload 150 offload_bench ;;
          worker) phase worker 60 worker_stats ;;
          profile) phase profile 200 profile ;;
          proto80) phase proto-bench-80m 150 proto_bench llama-80m ;;
          proto5) phase proto-bench-5m 120 proto_bench llama-5m ;;
          protobf16) phase proto-bench-80m-bf16 120 proto_bench llama-80m-bf16 ;;
          protoparity) phase proto-parity 100 proto_parity ;;
          switch) phase switch 200 switch_variants ;;
          sw80) phase bench-80m-switch 120 proto_bench llama-80m -switch PROTO_SWITCH=0.0005 ;;
          swov80) phase bench-80m-switch-overlap 120 proto_bench llama-80m -switch-overlap PROTO_SWITCH=0.0005 PROTO_OVERLAP=1 ;;
          sw5) phase bench-5m-switch 100 proto_bench llama-5m -switch PROTO_SWITCH=0.0005 ;;
          *) say "unknown phase $p" ;;
        esac
      done
    else
      phase env 90 env_report
      phase models 120 build_models
      phase bench-80m 200 bench llama-80m
      phase bench-5m 150 bench llama-5m
      phase bench-80m-bf16 150 bench llama-80m-bf16
      phase parity 150 parity
      phase parity-notf32 120 parity -notf32 MLX_ENABLE_TF32=0 llama-5m llama-80m
      phase worker 60 worker_stats
      phase profile 200 profile
      phase pytest 200 pytest_parity
    fi
    say "done in $SECONDS s"
    pack
    ;;
  *) echo "usage: $0 all|setup WHEEL_DIR..." >&2; exit 2 ;;
esac
exit 0

# The profiler: profile() above writes it to $T/h200_profile.py and runs it.
: <<'PROFILE_PY'
"""Where unikern's step time goes, against mlx-lm, on one model (written by tools/h200_run.sh).

1. forward microbench: one decode step (B rows, ~CTX tokens of context) through mlx-lm's
   dense KVCache and through unikern's paged pool (BatchLayout + PagedLayerCache), split
   into host layout build, graph build and eval; both synced per step and pipelined.
2. engine split: unikern at concurrency C, time inside ModelRunner.run (model thread)
   against wall time; the rest is scheduling, messages and the event loop.
3. cProfile of the model thread inside ModelRunner.run, and of the event-loop thread.
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import sys
import time


def top(profile: cProfile.Profile, n: int = 25) -> str:
    s = io.StringIO()
    pstats.Stats(profile, stream=s).sort_stats("tottime").print_stats(n)
    return s.getvalue()


def forward_bench(path: str, batches: list[int], ctx: int, steps: int) -> list[dict]:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from unikern.stages.kv.pool import KVPool
    from unikern.stages.execute.model import ModelGeometry
    from unikern.stages.execute.paged_cache import BatchLayout, PagedLayerCache

    model, _ = load(path)
    geo = ModelGeometry(model)
    out = []
    for B in batches:
        row = {"batch": B, "context": ctx}
        # dense mlx-lm cache, B equal-length rows
        cache = make_prompt_cache(model)
        prompt = mx.random.randint(10, 1000, (B, ctx)).astype(mx.int32)
        mx.eval(model(prompt, cache=cache))
        tok = mx.ones((B, 1), dtype=mx.int32)
        for _ in range(3):
            tok = mx.argmax(model(tok, cache=cache)[:, -1, :], axis=-1)[:, None]
            mx.eval(tok)
        ts = []
        for _ in range(steps):
            t0 = time.perf_counter()
            tok = mx.argmax(model(tok, cache=cache)[:, -1, :], axis=-1)[:, None]
            mx.eval(tok)
            ts.append(time.perf_counter() - t0)
        row["dense_sync_ms"] = 1e3 * statistics.median(ts)
        t0 = time.perf_counter()
        for _ in range(steps):  # pipelined like mlx-lm's generate_step
            tok = mx.argmax(model(tok, cache=cache)[:, -1, :], axis=-1)[:, None]
            mx.async_eval(tok)
        mx.eval(tok)
        row["dense_async_ms"] = 1e3 * (time.perf_counter() - t0) / steps
        del cache
        # paged pool
        bs = 256
        blocks_per_row = -(-(ctx + 3 * steps + 8) // bs)
        pool = KVPool(num_layers=geo.num_layers, num_kv_heads=geo.num_kv_heads, head_dim=geo.head_dim,
                      dtype=geo.dtype, block_size=bs, kernel_block_size=16,
                      num_blocks=2 + B * blocks_per_row, slab_blocks=2 + B * blocks_per_row)
        pool.ensure_capacity(2 + B * blocks_per_row)
        tables = [tuple(2 + i * blocks_per_row + j for j in range(blocks_per_row)) for i in range(B)]
        # one non-consecutive table so B == 1 also takes the general gather path? no: keep the
        # engine's real paths (B == 1 on consecutive blocks takes the slice fast path)
        pos = ctx
        tok = mx.ones((B, 1), dtype=mx.int32)

        def step(tok, pos, split=None):
            t0 = time.perf_counter()
            layout = BatchLayout.build(pool, [(tables[i], pos, 1) for i in range(B)])
            caches = [PagedLayerCache(pool, j, layout) for j in range(geo.num_layers)]
            t1 = time.perf_counter()
            tok = mx.argmax(model(tok, cache=caches)[:, -1, :], axis=-1)[:, None]
            t2 = time.perf_counter()
            if split is not None:
                mx.eval(tok, pool.keys, pool.values)
                t3 = time.perf_counter()
                split.append((t1 - t0, t2 - t1, t3 - t2))
            return tok

        for _ in range(3):
            tok = step(tok, pos, [])
            pos += 1
        split: list = []
        for _ in range(steps):
            tok = step(tok, pos, split)
            pos += 1
        row["paged_layout_ms"] = 1e3 * statistics.median(s[0] for s in split)
        row["paged_graph_ms"] = 1e3 * statistics.median(s[1] for s in split)
        row["paged_eval_ms"] = 1e3 * statistics.median(s[2] for s in split)
        row["paged_sync_ms"] = 1e3 * statistics.median(sum(s) for s in split)
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = step(tok, pos)
            mx.async_eval(tok)
            pos += 1
        mx.eval(tok, pool.keys, pool.values)
        row["paged_async_ms"] = 1e3 * (time.perf_counter() - t0) / steps
        # graph build cost of the dense model alone (no eval), for scale
        print(f"  forward B={B:>3}: dense sync {row['dense_sync_ms']:.2f} ms, async {row['dense_async_ms']:.2f} ms | "
              f"paged sync {row['paged_sync_ms']:.2f} ms (layout {row['paged_layout_ms']:.2f}, graph "
              f"{row['paged_graph_ms']:.2f}, eval {row['paged_eval_ms']:.2f}), async {row['paged_async_ms']:.2f} ms",
              flush=True)
        out.append(row)
        del pool
    return out


def patch_overlap() -> None:
    """PROTOTYPE, not in the repo: on StepDone, plan and send the next step *before* the
    sampled tokens fan out, so the event loop's per-token work overlaps the GPU's step."""
    from unikern import messages as m
    from unikern.stages.schedule import stage as sch

    if getattr(sch.ScheduleStage, "_overlap_patched", False):
        return
    original = sch.ScheduleStage.handle

    async def handle(self, ctx, message):
        if not isinstance(message, m.StepDone):
            return await original(self, ctx, message)
        step = self.in_flight.popleft() if self.in_flight else None  # (a deque since session 12)
        if step is None or step.step_id != message.step_id:
            raise RuntimeError(f"step {message.step_id} came back, but {step and step.step_id} was in flight")
        outcome = self.scheduler.on_step_done(step, message.sampled)
        if not self.in_flight and self.scheduler.has_work():
            nxt = self.scheduler.schedule()
            if nxt is not None:
                self.in_flight.append(nxt)
                await ctx.send(nxt)
        for token in outcome.tokens:
            await ctx.send(token)
        for finished in outcome.finished:
            await ctx.send(finished)

    sch.ScheduleStage.handle = handle
    sch.ScheduleStage._overlap_patched = True
    sch.ScheduleStage._original_handle = original


def unpatch_overlap() -> None:
    from unikern.stages.schedule import stage as sch

    if getattr(sch.ScheduleStage, "_overlap_patched", False):
        sch.ScheduleStage.handle = sch.ScheduleStage._original_handle
        sch.ScheduleStage._overlap_patched = False


def patch_lookahead(n: int) -> None:
    """PROTOTYPE: every Engine built from here on gets schedule.decode_lookahead = n."""
    import unikern

    original = unikern.Engine.from_pipeline.__func__

    def from_pipeline(cls, pipeline="generate", *, model=None, overrides=None):
        o = {k: dict(v) for k, v in (overrides or {}).items()}
        o.setdefault("schedule", {})["decode_lookahead"] = n
        return original(cls, pipeline, model=model, overrides=o)

    unikern.Engine.from_pipeline = classmethod(from_pipeline)


def engine_split(path: str, concurrency: int, max_tokens: int, profile: bool, kv_budget: int,
                 lookahead: int = 8, overlap: bool = False, switch: float = 0.005) -> dict:
    import anyio

    import unikern
    from unikern.stages.execute import runner as mr

    acc = {"calls": 0, "steps": 0, "tokens": 0, "runner_s": 0.0, "lookahead_calls": 0}
    original = mr.ModelRunner.run

    def run(self, step, seeds):
        t0 = time.perf_counter()
        result = original(self, step, seeds)
        acc["runner_s"] += time.perf_counter() - t0
        acc["calls"] += 1
        acc["steps"] += step.num_steps
        acc["lookahead_calls"] += step.num_steps > 1
        acc["tokens"] += sum(len(v) for v in result.values())
        return result

    mr.ModelRunner.run = run
    if overlap:
        patch_overlap()
    previous_switch = sys.getswitchinterval()
    sys.setswitchinterval(switch)  # the GIL hand-over interval (CPython's default: 5 ms)
    real_mx = mr.mx

    class TimedMX:  # model_runner's own mx.eval / mx.async_eval, timed (the model's calls are not)
        def __getattr__(self, name):
            return getattr(real_mx, name)

        def eval(self, *a):
            t = time.perf_counter()
            real_mx.eval(*a)
            acc["eval_s"] += time.perf_counter() - t

        def async_eval(self, *a):
            t = time.perf_counter()
            real_mx.async_eval(*a)
            acc["async_eval_s"] += time.perf_counter() - t

    acc["eval_s"] = 0.0
    acc["async_eval_s"] = 0.0
    mr.mx = TimedMX()
    import random

    rng = random.Random(concurrency)
    overrides = {"schedule": {"max_num_seqs": max(concurrency, 64), "decode_lookahead": lookahead},
                 "kv": {"kv_budget_bytes": kv_budget}}
    prof = cProfile.Profile() if profile else None  # on 3.12 it sees every thread
    try:
        async def main():
            async with unikern.Engine.from_pipeline("generate", model=path, overrides=overrides) as engine:
                vocab = 1000
                async def go(c, tokens):
                    batch = [[rng.randrange(10, vocab) for _ in range(rng.randint(16, 128))] for _ in range(c)]
                    async def one(p):
                        await engine.complete(prompt_tokens=p, max_tokens=tokens)
                    async with anyio.create_task_group() as tg:
                        for p in batch:
                            tg.start_soon(one, p)
                await go(2, 8)  # warm-up
                for k in acc:
                    acc[k] = 0 if isinstance(acc[k], int) else 0.0
                if prof is not None:
                    prof.enable()
                t0 = time.perf_counter()
                await go(concurrency, max_tokens)
                wall = time.perf_counter() - t0
                if prof is not None:
                    prof.disable()
                return wall

        wall = anyio.run(main)
    finally:
        mr.ModelRunner.run = original
        mr.mx = real_mx
        unpatch_overlap()
        sys.setswitchinterval(previous_switch)
    res = dict(acc, concurrency=concurrency, lookahead=lookahead, overlap=overlap, switch_interval=switch,
               wall_s=wall, profiled=profile,
               tok_s=acc["tokens"] / wall if wall else 0.0,
               runner_fraction=acc["runner_s"] / wall if wall else 0.0,
               ms_per_step=1e3 * acc["runner_s"] / max(1, acc["steps"]),
               wall_ms_per_step=1e3 * wall / max(1, acc["steps"]))
    if profile:
        res["top_tottime"] = top(prof, 45)
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(35)
        res["top_cumulative"] = s.getvalue()
    print(f"  engine c={concurrency:>3} lookahead {lookahead:>2}{' overlap' if overlap else ''}{f' switch {1e3 * switch:g}ms' if switch != 0.005 else ''} {'(cProfile on)' if profile else '':>14}: {res['tok_s']:.0f} tok/s, "
          f"{res['steps']} steps in {res['calls']} runner calls ({res['lookahead_calls']} lookahead), "
          f"runner {res['ms_per_step']:.2f} ms/step vs wall {res['wall_ms_per_step']:.2f} ms/step "
          f"({100 * res['runner_fraction']:.0f}% of wall on the model thread; in mx.eval "
          f"{1e3 * res['eval_s'] / max(1, res['steps']):.2f} ms/step, in mx.async_eval "
          f"{1e3 * res['async_eval_s'] / max(1, res['steps']):.2f} ms/step)", flush=True)
    return res


def mlx_lm_split(path: str, max_tokens: int) -> dict:
    import mlx.core as mx
    from mlx_lm import load, stream_generate

    model, tok = load(path)
    prompt = mx.array(list(range(10, 74)))
    for _ in stream_generate(model, tok, prompt, max_tokens=8):
        pass
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    n = sum(1 for _ in stream_generate(model, tok, prompt, max_tokens=max_tokens))
    prof.disable()
    wall = time.perf_counter() - t0
    print(f"  mlx-lm stream_generate (cProfile on): {n / wall:.0f} tok/s", flush=True)
    return {"tokens": n, "wall_s": wall, "top": top(prof, 15)}


def main() -> None:
    if sys.argv[1] == "proto-bench":  # tools/bench.py with the prototypes patched in
        import os
        import runpy

        if os.environ.get("PROTO_OVERLAP") == "1":
            patch_overlap()
        if os.environ.get("PROTO_LOOKAHEAD"):
            patch_lookahead(int(os.environ["PROTO_LOOKAHEAD"]))
        if os.environ.get("PROTO_SWITCH"):
            sys.setswitchinterval(float(os.environ["PROTO_SWITCH"]))
        bench = sys.argv[2]
        sys.argv = [bench, *sys.argv[3:]]
        runpy.run_path(bench, run_name="__main__")
        return
    if sys.argv[1] == "variants":  # engine split for the prototypes, no profiler
        path, out = sys.argv[2], sys.argv[3]
        kv_budget = int(sys.argv[4]) if len(sys.argv) > 4 else 8 << 30
        print(f"variants {path}", flush=True)
        rows = [engine_split(path, c, 64, False, kv_budget, la, ov)
                for c in (1, 64) for ov in (False, True) for la in (8, 32)]
        rows += [engine_split(path, c, 64, False, kv_budget, la, ov)
                 for c in (1, 64) for ov in (False, True) for la in (8, 32)]  # twice: the spread
        with open(out, "w") as f:
            json.dump({"model": path, "engine": rows}, f, indent=2)
        return
    if sys.argv[1] == "switch":  # the GIL hand-over interval, with and without the overlap prototype
        path, out = sys.argv[2], sys.argv[3]
        kv_budget = int(sys.argv[4]) if len(sys.argv) > 4 else 8 << 30
        print(f"switch {path}", flush=True)
        rows = [engine_split(path, c, 64, False, kv_budget, 8, ov, sw)
                for _ in range(3) for c in (64, 1) for ov in (False, True) for sw in (0.005, 0.0005)]
        with open(out, "w") as f:
            json.dump({"model": path, "engine": rows}, f, indent=2)
        return
    path, out = sys.argv[1], sys.argv[2]
    kv_budget = int(sys.argv[3]) if len(sys.argv) > 3 else 8 << 30
    res = {"model": path}
    print(f"profile {path}", flush=True)
    res["forward"] = forward_bench(path, [1, 16, 64], ctx=96, steps=int(__import__("os").environ.get("PROF_STEPS", 30)))
    res["engine"] = [engine_split(path, c, 64, False, kv_budget, la) for c in (1, 64) for la in (8, 32)]
    res["mlx_lm_stream_profiled"] = mlx_lm_split(path, 64)
    res["engine_profiled"] = [engine_split(path, c, 64, True, kv_budget) for c in (1, 64)]
    with open(out, "w") as f:
        json.dump(res, f, indent=2)
    for r in res["engine_profiled"]:
        print(f"--- all threads, c={r['concurrency']}, by tottime ---\n" + r["top_tottime"])


if __name__ == "__main__":
    main()
PROFILE_PY
