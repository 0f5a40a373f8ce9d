"""Runs the body of an `mx.fast.cuda_kernel` on the CPU: compiled as C++, each CUDA
thread of a block a fiber on one OS thread (tests/cuda_emulation_runtime.cpp), warp
shuffles through a per-warp exchange buffer and barrier, `__syncthreads` through a block
barrier, blocks one after another; a barrier some thread never reaches stops the program
with a message. Slow, float32 only, but it executes the kernel's own source, so a wrong
index or softmax merge shows up on a machine without a GPU (tests/test_paged_attention.py).
The CUDA built-ins are stood in for by tests/cuda_emulation.h; a kernel's own header (its
helpers written in CUDA) has a C++ stand-in beside the kernel, as its module's
EMULATED_HEADER (stages/execute/cuda/*_emulation.h), handed to `run_kernel` or
`emulated_cuda_kernels`."""

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

# every program includes the built-ins' header first (precompiled once per test process)
# and links the fiber runtime (compiled once per test process): the program itself holds
# only the kernel and its inputs' reads, so it compiles in a fraction of a second
_HERE = Path(__file__).parent
_HEADER = "cuda_emulation.h"
_RUNTIME = "cuda_emulation_runtime.cpp"
_FLAGS = ["-O1", "-std=c++20"]


@functools.cache
def available() -> bool:
    """A C++20 compiler with std::atomic_ref and ucontext (g++ 10 or later on glibc) to build
    the emulation with."""
    if shutil.which("g++") is None:
        return False
    probe = subprocess.run(["g++", "-std=c++20", "-fsyntax-only", "-x", "c++", "-"],
                           input="#include <atomic>\n#include <ucontext.h>\nusing A = std::atomic_ref<unsigned>;\n",
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
    params, shapes, reads, globals_ = [], [], [], []
    for name, a in inputs.items():
        ctype = {np.float32: "float", np.int32: "int", np.uint32: "unsigned"}[a.dtype.type]
        params.append(f"const {ctype}* {name}")
        dims = ", ".join(map(str, a.shape))
        shapes.append(f"static const int {name}_shape[] = {{{dims}}};")
        if a.ndim:  # (the arrays go over contiguous: strides in elements of that layout)
            strides = ", ".join(str(s // a.itemsize) for s in np.ascontiguousarray(a).strides)
            shapes.append(f"static const long {name}_strides[] = {{{strides}}};")
        reads.append(f"{name}_data = static_cast<{ctype}*>(read_input({a.size * 4}));")
        globals_.append(f"static {ctype}* {name}_data;")
    constant_lines = "".join(f"constexpr int {k} = {v};\n" for k, v in constants.items())
    shapes_out = outputs or {"out": output_shape}
    initial = initial or {}
    for name, shape in shapes_out.items():
        size = int(np.prod(shape)) * 4
        globals_.append(f"static float* {name}_data;")
        reads.append(f"{name}_data = static_cast<float*>({f'read_input({size})' if name in initial else f'zeros({size})'});")
    call_args = ", ".join(f"{name}_data" for name in [*inputs, *shapes_out])
    out_params = "".join(f", T* {name}" for name in shapes_out)
    written = [n for n in dict.fromkeys(written_inputs(source)) if n in inputs]
    writes = [f"fwrite({name}_data, 4, {int(np.prod(shape))}, stdout);" for name, shape in shapes_out.items()]
    writes += [f"fwrite({name}_data, 4, {inputs[name].size}, stdout);" for name in written]
    newline = "\n"
    code = f"""#include "{_HEADER}"
{header}
typedef float T;
{constant_lines}
{newline.join(shapes)}
static void kernel({", ".join(params)}{out_params}) {{
{source}
}}
{newline.join(globals_)}
int main() {{
    {newline.join(reads)}
    if (int failed = run_blocks(+[] {{ kernel({call_args}); }}, {blocks}, {threads})) return failed;
    {newline.join(writes)}
}}
"""
    data = b"".join(np.ascontiguousarray(a).tobytes() for a in inputs.values())
    data += b"".join(np.ascontiguousarray(initial[n], dtype=np.float32).tobytes() for n in shapes_out if n in initial)
    done = subprocess.run([_built(code)], input=data, capture_output=True)
    if done.returncode:
        raise RuntimeError(f"the emulated kernel failed ({done.returncode}): {done.stderr.decode()[-3000:]}")
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
    """A directory for this process' programs: the built-ins' header precompiled beside a
    copy of it (without the .gch, where g++ cannot write one, the programs parse the
    header), and the fiber runtime's object file."""
    path = Path(tempfile.mkdtemp(prefix="cuda-emulation-"))
    atexit.register(shutil.rmtree, path, True)
    shutil.copy(_HERE / _HEADER, path / _HEADER)
    subprocess.run(["g++", *_FLAGS, "-x", "c++-header", "-o", f"{path / _HEADER}.gch", str(path / _HEADER)],
                   capture_output=True)
    _compile(["-c", "-o", str(path / "runtime.o"), str(_HERE / _RUNTIME)], path, "the emulation's runtime")
    return str(path)


def _compile(args: list[str], build_dir: Path, what: str) -> None:
    built = subprocess.run(["g++", *_FLAGS, "-I", str(build_dir), *args], capture_output=True, text=True)
    if built.returncode:
        raise RuntimeError(f"{what} did not compile:\n{built.stderr[-3000:]}")


@functools.cache
def _built(code: str) -> str:
    """The program for `code`, compiled once per test process (a model's layers launch
    the same kernel builds again and again)."""
    build_dir = Path(_build_dir())
    exe = build_dir / f"kernel-{hashlib.sha256(code.encode()).hexdigest()[:16]}"
    src = exe.with_suffix(".cpp")
    src.write_text(code)
    _compile(["-o", str(exe), str(src), str(build_dir / "runtime.o")], build_dir, "the emulation of a kernel")
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


def evaluated(array) -> bool:
    """Whether MLX has computed `array`: reading it from a thread with no stream of its own
    succeeds only for an evaluated array (an unevaluated one would need the thread's
    stream to compute it on)."""
    import threading

    result: list[bool] = []

    def read() -> None:
        try:
            np.array(array)
            result.append(True)
        except RuntimeError:
            result.append(False)

    reader = threading.Thread(target=read)
    reader.start()
    reader.join()
    return result[0]


class LazyWrites:
    """The pool write kernel (cuda/pool_write.py) emulated as MLX runs it on a GPU: the
    real kernel writes the pool arrays in place, which MLX does not see, so it runs only
    when something evaluated takes its marker. The emulation runs a kernel at its launch;
    this takes the pool's contents before each launch and, at `settle()` (after a step),
    puts them back for every launch whose marker MLX never evaluated: the writes a GPU
    would never have made. Installed as pool_write's `cuda_kernel`; the emulated row
    kernel must stay off (its launch reads its inputs, evaluating the forward itself)."""

    def __init__(self, launched: list[str] | None = None) -> None:
        self._build = emulated_cuda_kernels(launched)
        self._pending: list[tuple] = []

    def __call__(self, base: str, input_names: tuple[str, ...], source: str, header: str = "",
                 outputs: tuple[str, ...] = ("out",), contiguous: bool = True):
        import mlx.core as mx

        launch = self._build(base, input_names, source, header, outputs, contiguous)

        def run(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            named = dict(zip(input_names, inputs, strict=True))
            pools = [named[n] for n in written_inputs(source)]
            mx.eval(pools)
            before = [np.array(p).copy() for p in pools]
            marker = launch(inputs, template, grid, threadgroup, output_shapes, output_dtypes)[0] + 0  # lazy
            self._pending.append((marker, pools, before))
            return [marker]

        return run

    def settle(self) -> int:
        """Take back, newest first, the writes whose marker was never evaluated; how many."""
        lost = 0
        for marker, pools, before in reversed(self._pending):
            if not evaluated(marker):
                for pool, old in zip(pools, before, strict=True):
                    np.array(pool, copy=False)[...] = old
                lost += 1
        self._pending.clear()
        return lost
