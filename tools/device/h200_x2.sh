#!/usr/bin/env bash
# Issue 18 on two H200s of one host (nvidia-h200-x2, NCCL): tools/h200_gpu.sh's two-GPU
# steps (tests/test_distributed.py over NCCL; the 8B-shape bf16 model at 64 concurrent
# requests on 1 GPU against tensor parallelism over 2, tools/bench_tp.py). Wheels as there:
#   run(carry=[".whl/p0"]):  mkdir -p /tmp/w0 && cp -r .whl/p0/. /tmp/w0/
#   run(carry=[".whl/p1"]), within 30 s:  OUT=$OUT bash tools/h200_x2.sh /tmp/w0 .whl/p1
# X2_STEPS picks among pytest-nccl, models-8b and bench-tp-8b (default: all three); any of
# h200_gpu.sh's one-GPU steps may be added. Results: $OUT/gpu-results.tgz and $OUT/gpu/.
export GPU_STEPS=${X2_STEPS:-"pytest-nccl models-8b bench-tp-8b"}
exec bash "$(dirname "$0")/h200_gpu.sh" "$@"
