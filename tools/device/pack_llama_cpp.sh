#!/usr/bin/env bash
# Packs the llama.cpp source that llama-cpp-python's sdist vendors into one small tarball
# for the GPU machine (no network there; tools/device/h200_gpu.sh builds llama-bench,
# llama-batched-bench, llama-quantize and llama-server from it, with CUDA for sm_90): without
# docs, models, media, tests, examples, the web UI's sources (its CMake files stay: the
# server builds with no UI embedded) and the other backends (about 6 MB).
#
#   tools/device/pack_llama_cpp.sh OUT_DIR [LLAMA_CPP_PYTHON_VERSION]   # writes OUT_DIR/llama.cpp.tgz
set -euo pipefail
out=${1:?usage: pack_llama_cpp.sh OUT_DIR [VERSION]}; version=${2:-0.3.36}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --no-binary=:all: -d "$tmp" "llama-cpp-python==$version"
tar -xzf "$tmp"/llama_cpp_python-"$version".tar.gz -C "$tmp"
skip=(docs models media tests examples pocs benches ci tools/ui/src tools/ui/tests tools/ui/package-lock.json tools/server/public tools/server/webui)
for backend in cann hexagon hip metal musa opencl openvino sycl virtgpu vulkan webgpu zdnn zendnn et; do
  skip+=("ggml/src/ggml-$backend")
done
mkdir -p "$out"
tar -czf "$out/llama.cpp.tgz" "${skip[@]/#/--exclude=llama.cpp/}" -C "$tmp/llama_cpp_python-$version/vendor" llama.cpp
ls -l "$out/llama.cpp.tgz"
