#!/usr/bin/env bash
# Two H200s of one host (nvidia-h200-x2, NCCL): tools/device/h200_gpu.sh's two-GPU steps,
# tests/test_distributed.py over NCCL (nccl-tests) and the 8B-shape bf16 model at 64
# concurrent requests on one GPU against tensor parallelism over two (bench-tp-8b,
# tools/bench/bench_tp.py). The wheels travel as for h200_gpu.sh (tools/device/README.md):
#   run(carry=[".whl/p0"]):  mkdir -p /tmp/w0 && cp -r .whl/p0/. /tmp/w0/
#   run(carry=[".whl/p1"]), within 30 s:  OUT=$OUT bash tools/device/h200_x2.sh /tmp/w0 .whl/p1
# X2_STEPS picks among nccl-tests and bench-tp-8b (default: both); any of h200_gpu.sh's
# one-GPU steps may be added. Results: $OUT/gpu-results.tgz and $OUT/gpu/.
export GPU_STEPS=${X2_STEPS:-"nccl-tests bench-tp-8b"}
exec bash "$(dirname "$0")/h200_gpu.sh" "$@"
