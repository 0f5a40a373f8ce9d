"""unikern's GPU kernels built by unikern itself: the kernel text wrapped as a complete
CUDA source, compiled with NVRTC (through ctypes) into a cubin for this GPU, kept on disk
under a name that digests everything the binary depends on, and launched through
`mx.fast.precompiled_cuda_kernel` (platform/kernel_cache.py).

MLX's CUDA backend compiles a `mx.fast.cuda_kernel` with NVRTC in every process: it
keeps the kernels it generates itself in its cache directory, but not custom ones. On an
H200 that was about 40 s of every warm start of a 1B model (ready in 47-50 s, 7-8 s
once unikern built them; tools/probe/probe_startup.py, tools/bench/first_request.py).

The wrapping is MLX's (a kernel function whose parameters are the inputs, then the
outputs; the template arguments as constants in its body) with two differences: the
function is `extern "C"` (the name MLX looks up), and an input's shape, where the text
reads `<input>_shape`, comes as int parameters after the outputs (the launch passes them
as scalars), made an array of that name at the top of the body. Texts that read an
input's strides keep MLX's compiler: MLX's Python API gives no strides to pass."""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import os
import re
import sys
from pathlib import Path

from unikern.platform import cuda_text


@functools.cache
def _sections() -> dict[str, str]:
    """kernel_wrap.cuh's sections by name (its leading notes dropped)."""
    return cuda_text.sections(cuda_text.read(__package__, "kernel_wrap.cuh"))


def _fill(section: str, name: str, params: list[str], constants: str, header: str, body: str) -> str:
    function = (_sections()[section].replace("@NAME@", name).replace("@PARAMS@", ",\n    ".join(params))
                .replace("@CONSTANTS@", constants.rstrip("\n")).replace("@BODY@", body))
    return f"{_sections()['prelude']}\n{header}\n{function}"


CUDA_TYPES = {"float32": "float", "bfloat16": "__nv_bfloat16", "float16": "__half", "int32": "int32_t",
              "uint32": "uint32_t", "bool": "bool"}

OPTIONS = ("-std=c++17", "-default-device")


def reads(source: str, arg: str, what: str) -> bool:
    """Whether the kernel text reads input `arg`'s `what` ("shape" or "strides")."""
    return re.search(rf"\b{re.escape(arg)}_{what}\b", source) is not None


def _constants(template: list[tuple[str, object]]) -> str:
    lines = []
    for name, value in template:
        if isinstance(value, str):
            lines.append(f"  using {name} = {CUDA_TYPES[value]};\n")
        elif isinstance(value, bool):
            lines.append(f"  constexpr bool {name} = {'true' if value else 'false'};\n")
        else:
            lines.append(f"  constexpr int {name} = {value};\n")
    return "".join(lines)


def wrap(name: str, source: str, header: str, inputs: list[tuple[str, str, int]], outputs: list[tuple[str, str]],
         template: list[tuple[str, object]]) -> str:
    """`source` as MLX's CUDA backend builds a custom kernel around it (its JIT path):
    shapes and strides as by-value structs among the inputs' parameters."""
    params = []
    for arg, dtype, ndim in inputs:
        params.append(f"const {CUDA_TYPES[dtype]}* {arg}")
        if ndim > 0 and f"{arg}_shape" in source:
            params.append(f"const __grid_constant__ Shape {arg}_shape")
        if ndim > 0 and f"{arg}_strides" in source:
            params.append(f"const __grid_constant__ Strides {arg}_strides")
    params += [f"{CUDA_TYPES[dtype]}* {arg}" for arg, dtype in outputs]
    return _fill("mlx", name, params, _constants(template), header, source)


def wrap_precompiled(name: str, source: str, header: str, inputs: list[tuple[str, str, int]],
                     outputs: list[tuple[str, str]], template: list[tuple[str, object]]) -> tuple[str, list[int]]:
    """`source` as a complete `extern "C"` kernel for `mx.fast.precompiled_cuda_kernel`,
    and the indices of the inputs whose shapes the launch passes (as int scalars, in
    that order, each dimension in turn)."""
    params = [f"const {CUDA_TYPES[dtype]}* {arg}" for arg, dtype, _ in inputs]
    params += [f"{CUDA_TYPES[dtype]}* {arg}" for arg, dtype in outputs]
    shaped = [i for i, (arg, _, ndim) in enumerate(inputs) if ndim > 0 and reads(source, arg, "shape")]
    shapes = ""
    for i in shaped:
        arg, _, ndim = inputs[i]
        params += [f"int {arg}_shape_{d}" for d in range(ndim)]
        shapes += f"  const int {arg}_shape[{ndim}] = {{{', '.join(f'{arg}_shape_{d}' for d in range(ndim))}}};\n"
    return _fill("extern", name, params, _constants(template) + shapes, header, source), shaped


def _loaded_nvrtc() -> ctypes.CDLL | None:
    """The NVRTC MLX's CUDA backend already loaded (dlopen of a loaded soname returns it)."""
    for soname in ("libnvrtc.so.13", "libnvrtc.so.12"):
        try:
            return ctypes.CDLL(soname)
        except OSError:
            continue
    return None


def _wheel_nvrtc() -> tuple[str, Path] | None:
    for base in sys.path:
        for lib in sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib", "libnvrtc.so*"))):
            return lib, Path(lib).parent.parent / "include"
    return None


def find_include(hint: Path | None = None) -> str | None:
    """A folder holding CUDA's cuda_bf16.h: MLX's own choice first (CUDA_HOME, CUDA_PATH,
    /usr/local/cuda), then the pip wheels' (nvidia-cuda-runtime)."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    candidates = [Path(r) / "include" for r in roots if r]
    if hint is not None:
        candidates.append(hint)
    for base in sys.path:
        candidates += [Path(p) for p in sorted(glob.glob(os.path.join(base, "nvidia", "*", "include")))]
    return next((str(c) for c in candidates if (c / "cuda_bf16.h").exists()), None)


def find_nvrtc() -> tuple[ctypes.CDLL, str]:
    """libnvrtc and CUDA's include directory (raises FileNotFoundError, saying what to install)."""
    wheel = _wheel_nvrtc()
    lib = _loaded_nvrtc()
    if lib is None and wheel is not None:
        lib = ctypes.CDLL(wheel[0])
    include = find_include(wheel[1] if wheel else None)
    if lib is None or include is None:
        raise FileNotFoundError("NVRTC and CUDA's headers not found: pip install nvidia-cuda-nvrtc nvidia-cuda-runtime "
                                "(or set CUDA_HOME to a CUDA toolkit)")
    return lib, include


def nvrtc_version(nvrtc: ctypes.CDLL) -> str:
    major, minor = ctypes.c_int(), ctypes.c_int()
    nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


def compile_source(nvrtc: ctypes.CDLL, include: str, name: str, source: str, arch: str,
                   ptxas: bool = False, cubin: bool = False) -> tuple[bool, str, bytes | None]:
    """Whether it compiles, NVRTC's log (with ptxas' resource use if `ptxas`) and, with
    `cubin`, the binary for `arch` (e.g. "sm_90"). NVRTC runs without the GIL (ctypes)."""
    prog = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None):
        return False, "nvrtcCreateProgram failed", None
    options = [f"--gpu-architecture={arch}", *OPTIONS, f"-I{include}"]
    options += ["--ptxas-options=--verbose"] if ptxas else []
    array = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
    status = nvrtc.nvrtcCompileProgram(prog, len(options), array)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    binary = None
    if status == 0 and cubin:
        nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        buffer = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetCUBIN(prog, buffer)
        binary = buffer.raw
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return status == 0, log.value.decode(errors="replace"), binary


def digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
