#!/usr/bin/env bash
# Builds what the GPU machine (Python 3.12, no network) needs for tools/device/h200_gpu.sh, in
# parts that fit one `run` call each (64 MiB per call, the tracked tree included):
#   .whl/p0  MLX's CUDA wheel, first part, and the small wheels unikern needs there
#   .whl/p1  its second part with the SHA256, mlx and mlx-lm
#   .whl/lc  llama.cpp's source (tools/device/pack_llama_cpp.sh)
#   .whl/srv the wheels `unikern serve` needs that the image lacks (starlette, uvicorn, sse-starlette, llguidance)
#   .whl/tf  the transformers release pip resolves today (h200_gpu.sh's step startup-tf)
# Add /.whl/ to .git/info/exclude. Usage: tools/device/pack_h200_bundle.sh [OUT=.whl]
set -euo pipefail
out=${1:-.whl}
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
# the shared folder beside the repository holds the MLX CUDA bundler
bundler=${MLX_CUDA_BUNDLE:-$here/../../../shared/tools/mlx-cuda-bundle.sh}
bash "$bundler" "$tmp/raw" > /dev/null
parts=$(cd "$tmp/raw" && ls -d mlx_cuda_13-*.whl.parts)
mkdir -p "$out/p0/$parts" "$out/p1/$parts" "$out/srv" "$out/tf"
cp "$tmp/raw/$parts/part.00" "$out/p0/$parts/"
cp "$tmp/raw/$parts/part.01" "$tmp/raw/$parts/SHA256" "$out/p1/$parts/"
cp "$tmp/raw"/mlx-*.whl "$tmp/raw"/mlx_lm-*.whl "$out/p1/"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$out/p0" msgspec zstandard structlog trio outcome sniffio anyio sortedcontainers
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$out/srv" starlette uvicorn sse-starlette llguidance
python3 -m pip download -q --no-deps --only-binary=:all: -d "$out/tf" transformers
bash "$here/pack_llama_cpp.sh" "$out/lc" > /dev/null
du -sh "$out"/p0 "$out"/p1 "$out"/srv "$out"/lc "$out"/tf
