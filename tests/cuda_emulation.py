"""Runs the body of an `mx.fast.cuda_kernel` on the CPU: compiled as C++ with one OS
thread per CUDA thread of a block (kept from block to block), warp shuffles through a
per-warp exchange buffer and barrier, `__syncthreads` through a block barrier, blocks one
after another. Slow, float32 only, but it executes the kernel's own source, so a wrong
index or softmax merge shows up on a machine without a GPU (tests/test_paged_attention.py).
The CUDA built-ins are stood in for here; a kernel's own header (its helpers written in
CUDA) has a C++ stand-in beside the kernel, as its module's EMULATED_HEADER
(stages/execute/cuda/*_emulation.h), handed to `run_kernel` or `emulated_cuda_kernels`."""

from __future__ import annotations

import atexit
import functools
import hashlib
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

# the standard headers every program includes, compiled once per test process into a
# precompiled header (most of a program's compile time otherwise)
_STD_HEADER = "emulation_std.h"
_STD_INCLUDES = """
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <memory>
#include <thread>
#include <cstring>
#include <vector>
"""
_FLAGS = ["-O1", "-std=c++20", "-pthread"]

_PRELUDE = f"""
#include "{_STD_HEADER}"
""" + r"""
using std::min;
using std::max;
struct dim3 { unsigned x, y, z; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
static thread_local dim3 blockIdx;
static dim3 blockDim;
static dim3 gridDim;
static thread_local dim3 threadIdx;
static std::vector<std::unique_ptr<std::barrier<>>> warp_bars;
static std::unique_ptr<std::barrier<>> block_bar;
static float exchange[64][32];
#define __shared__ static
static float exchange_lanes(float v, int from) {
    const int w = threadIdx.x / 32;
    exchange[w][threadIdx.x % 32] = v;
    warp_bars[w]->arrive_and_wait();
    const float r = exchange[w][from];
    warp_bars[w]->arrive_and_wait();
    return r;
}
static float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static void sincospif(float x, float* s, float* c) { *s = std::sin(M_PI * x); *c = std::cos(M_PI * x); }
static float __shfl_xor_sync(unsigned, float v, int mask) { return exchange_lanes(v, (threadIdx.x % 32) ^ mask); }
static float __shfl_sync(unsigned, float v, int lane) { return exchange_lanes(v, lane); }
static int __shfl_sync(unsigned, int v, int lane) {  // through the float buffer, bit for bit
    float f; std::memcpy(&f, &v, 4); f = exchange_lanes(f, lane); int r; std::memcpy(&r, &f, 4); return r;
}
static void __syncthreads() { block_bar->arrive_and_wait(); }
static void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
static unsigned atomicAdd(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_add(v); }
static unsigned atomicExch(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).exchange(v); }
static float rsqrtf(float v) { return 1.f / std::sqrt(v); }
static void __nanosleep(unsigned) {}
"""


@functools.cache
def available() -> bool:
    """A C++20 compiler with std::barrier (g++ 11 or later) to build the emulation with."""
    if shutil.which("g++") is None:
        return False
    probe = subprocess.run(["g++", "-std=c++20", "-fsyntax-only", "-x", "c++", "-"], input="#include <barrier>\n",
                           capture_output=True, text=True)
    return probe.returncode == 0


def written_inputs(source: str) -> list[str]:
    """The inputs a kernel's source writes in place (through `const_cast<T*>(name)`)."""
    return re.findall(r"const_cast<[^>]*>\(\s*(\w+)\s*\)", source)


def run_kernel(source: str, inputs: dict[str, np.ndarray], constants: dict[str, int], blocks: int, threads: int,
               output_shape: tuple[int, ...], header: str = "",
               outputs: dict[str, tuple[int, ...]] | None = None,
               initial: dict[str, np.ndarray] | None = None) -> np.ndarray | dict[str, np.ndarray]:
    """`source` run over `blocks` blocks of `threads` threads: the inputs (float32, int32
    or uint32 arrays, each with its `<name>_shape`), `constants` as the kernel's
    template parameters (T is float), one float32 output `out` of `output_shape` (or,
    with `outputs`, one per name and shape, returned by name), and `header` (C++
    helpers, e.g. q4_mma.EMULATED_HEADER) before the kernel. Inputs the source writes in
    place (`written_inputs`) are written back into the given numpy arrays, bit for bit.
    `initial`: outputs' contents before the kernel runs (zeros otherwise)."""
    assert threads % 32 == 0 and threads // 32 <= 64
    params, shapes, reads = [], [], []
    for name, a in inputs.items():
        ctype = {np.float32: "float", np.int32: "int", np.uint32: "unsigned"}[a.dtype.type]
        params.append(f"const {ctype}* {name}")
        dims = ", ".join(map(str, a.shape))
        shapes.append(f"static const int {name}_shape[] = {{{dims}}};")
        if a.ndim:  # (the arrays go over contiguous: strides in elements of that layout)
            strides = ", ".join(str(s // a.itemsize) for s in np.ascontiguousarray(a).strides)
            shapes.append(f"static const long {name}_strides[] = {{{strides}}};")
        reads.append(f"std::vector<{ctype}> {name}_data({a.size}); "
                     f"fread({name}_data.data(), 4, {a.size}, stdin);")
    constant_lines = "".join(f"constexpr int {k} = {v};\n" for k, v in constants.items())
    shapes_out = outputs or {"out": output_shape}
    call_args = ", ".join([f"{name}_data.data()" for name in inputs] + [f"{name}.data()" for name in shapes_out])
    out_params = "".join(f", T* {name}" for name in shapes_out)
    initial = initial or {}
    out_vectors = " ".join(f"std::vector<float> {name}({int(np.prod(shape))});" for name, shape in shapes_out.items())
    out_vectors += " ".join(f"fread({name}.data(), 4, {name}.size(), stdin);" for name in shapes_out if name in initial)
    written = [n for n in dict.fromkeys(written_inputs(source)) if n in inputs]
    out_writes = " ".join(f"fwrite({name}.data(), 4, {name}.size(), stdout);" for name in shapes_out)
    out_writes += " ".join(f"fwrite({name}_data.data(), 4, {name}_data.size(), stdout);" for name in written)
    code = f"""{_PRELUDE}
{header}
typedef float T;
{constant_lines}
{chr(10).join(shapes)}
static void kernel({", ".join(params)}{out_params}) {{
{source}
}}
int main() {{
    {chr(10).join(reads)}
    {out_vectors}
    for (int w = 0; w < {threads // 32}; ++w) warp_bars.emplace_back(new std::barrier<>(32));
    block_bar.reset(new std::barrier<>({threads}));
    blockDim.x = {threads};
    gridDim.x = {blocks};
    // one OS thread per CUDA thread of a block, kept for every block in turn (a barrier
    // between blocks: the blocks run one after another, their shared memory reused)
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < {threads}; ++t)
        pool.emplace_back([&, t] {{
            threadIdx.x = t;
            for (unsigned b = 0; b < {blocks}; ++b) {{
                blockIdx.x = b;
                kernel({call_args});
                block_bar->arrive_and_wait();
            }}
        }});
    for (auto& th : pool) th.join();
    {out_writes}
}}
"""
    data = b"".join(np.ascontiguousarray(a).tobytes() for a in inputs.values())
    data += b"".join(np.ascontiguousarray(initial[n], dtype=np.float32).tobytes() for n in shapes_out if n in initial)
    done = subprocess.run([_built(code)], input=data, capture_output=True, check=True)
    flat, results = np.frombuffer(done.stdout, dtype=np.float32), {}
    for name, shape in shapes_out.items():
        size = int(np.prod(shape))
        results[name], flat = flat[:size].reshape(shape), flat[size:]
    for name in written:
        size = inputs[name].size
        inputs[name][...], flat = flat[:size].view(inputs[name].dtype).reshape(inputs[name].shape), flat[size:]
    return results if outputs else results["out"]


@functools.cache
def _build_dir() -> str:
    """A directory for this process' programs, with the standard headers precompiled
    (without the .gch, where g++ cannot write one, the programs include the header)."""
    path = tempfile.mkdtemp(prefix="cuda-emulation-")
    atexit.register(shutil.rmtree, path, True)
    header = Path(path) / _STD_HEADER
    header.write_text(_STD_INCLUDES)
    subprocess.run(["g++", *_FLAGS, "-x", "c++-header", "-o", f"{header}.gch", str(header)], capture_output=True)
    return path


@functools.cache
def _built(code: str) -> str:
    """The program for `code`, compiled once per test process (a model's layers launch
    the same kernel builds again and again)."""
    exe = Path(_build_dir()) / f"kernel-{hashlib.sha256(code.encode()).hexdigest()[:16]}"
    src = exe.with_suffix(".cpp")
    src.write_text(code)
    built = subprocess.run(["g++", *_FLAGS, "-I", _build_dir(), "-o", str(exe), str(src)], capture_output=True,
                           text=True)
    if built.returncode:
        raise RuntimeError(f"the emulation of a kernel did not compile:\n{built.stderr[-3000:]}")
    return str(exe)


def emulated_cuda_kernels(launched: list[str] | None = None, header: str | None = None):
    """A stand-in for unikern's `cuda_kernel(base, input_names, source, header)` whose
    kernels run in this emulation (float32 arrays; the launch's grid, threads, template
    integers and output shape as the caller gives them); each launch's base name is
    appended to `launched`. `header`: the emulation's own version of the kernels' CUDA
    header (e.g. block_gemv.EMULATED_HEADER), in its place."""
    import mlx.core as mx

    own_header = header

    def build(base: str, input_names: tuple[str, ...], source: str, header: str = "", outputs: tuple[str, ...] = ("out",),
              contiguous: bool = True):
        def launch(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            if launched is not None:
                launched.append(base)
            # the inputs the kernel writes in place: views of the MLX arrays' own buffers
            # (MLX's CPU arrays hand numpy writable views), so the writes land in them
            written = set(written_inputs(source))
            for n, a in zip(input_names, inputs, strict=True):
                if n in written:
                    mx.eval(a)
            arrays = {n: np.array(a, copy=n not in written) for n, a in zip(input_names, inputs, strict=True)}
            constants = {k: v for k, v in template if k != "T"}
            shapes = dict(zip(outputs, output_shapes, strict=True))
            # phases FIRST..LAST that meet at grid-wide barriers (cuda/block_kernel.py): one
            # launch per phase, the outputs carried over (the blocks here run one after
            # another, so a block waiting at such a barrier would wait forever), unless
            # the grid is one block (its barriers pass at once)
            out, blocks = None, grid[0] // threadgroup[0]
            phased = "FIRST" in constants and blocks > 1
            for phase in range(constants["FIRST"], constants["LAST"] + 1) if phased else [None]:
                if phased:
                    constants.update(FIRST=phase, LAST=phase)
                out = run_kernel(source, arrays, constants, blocks, threadgroup[0], output_shapes[0],
                                 header if own_header is None else own_header, shapes, out)
            return [mx.array(out[n]).astype(d) for n, d in zip(outputs, output_dtypes, strict=True)]
        return launch

    return build
