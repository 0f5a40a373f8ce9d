"""Compile unikern's CUDA kernels for an H200 (sm_90) with NVRTC on a machine without a
GPU, so a kernel source changed since the last GPU run is known to build before device
time is spent on it.

Each kernel of stages/execute/cuda/ is launched as the engine launches it (paged
attention whole, split and merged, at several positions in flight; the 4-bit GEMV and
tensor-core kernels and the bfloat16 tensor-core kernel; the residual add and norm; a
decoder block's GEMV kernels and its one-kernel step; the pool writes and RoPE) with
`mx.fast.cuda_kernel` replaced by a stand-in that records the call. The recorded source
(the kernel's .cu text, as its module fills it in) is wrapped as the engine builds it
(unikern.platform.cuda_build: an `extern "C"` function whose parameters are the inputs,
the outputs and the shapes the text reads; template arguments as constants in its body;
MLX's own wrapping for a text that reads strides) over a small prelude standing in for
MLX's device header, and compiled.

    pip install nvidia-cuda-nvrtc nvidia-cuda-runtime   # NVRTC and CUDA's headers
    python -m tools.device.nvrtc_check [--arch sm_90] [--ptxas]
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass

from unikern.platform.cuda_build import compile_source, find_nvrtc, reads, wrap, wrap_precompiled  # noqa: F401


@dataclass(frozen=True)
class Build:
    """One kernel build as the engine asked MLX for it: the kernel's name (carrying its
    source's digest, platform/kernel_cache.py), source and header, its inputs (name,
    dtype, ndim), outputs (name, dtype), template arguments and threads per block."""

    name: str
    source: str
    header: str
    inputs: tuple[tuple[str, str, int], ...]
    outputs: tuple[tuple[str, str], ...]
    template: tuple[tuple[str, object], ...]
    threads: int

    @property
    def label(self) -> str:
        return self.name + "".join(f"_{k}{v}" for k, v in self.template)

    def wrapped(self) -> str:
        """The source as MLX's CUDA backend builds a custom kernel around it."""
        return wrap(self.name, self.source, self.header, list(self.inputs), list(self.outputs), list(self.template))

    def launched(self) -> str:
        """The source as the engine builds it (platform/kernel_cache.Kernel): unikern's
        own `extern "C"` wrapping, MLX's where the text reads an input's strides."""
        if any(reads(self.source, arg, "strides") for arg, _, _ in self.inputs):
            return self.wrapped()
        return wrap_precompiled(self.name, self.source, self.header, list(self.inputs), list(self.outputs),
                                list(self.template))[0]


def registers(log: str) -> int | None:
    """The registers per thread in ptxas' verbose log."""
    found = re.search(r"Used (\d+) registers", log)
    return int(found.group(1)) if found else None


def record_launches() -> list[Build]:
    """Every kernel build the engine's paths launch here, in launch order."""
    import mlx.core as mx
    import mlx.nn as nn

    from unikern.platform import kernel_cache
    from unikern.stages.execute.cuda import (
        bf16_mma,
        block_gemv,
        block_kernel,
        paged_attention,
        pool_write,
        q4_gemv,
        q4_mma,
        residual_norm,
        step_layout,
    )
    from unikern.stages.execute.cuda import rows as row_kernel

    builds: list[Build] = []

    def fake_cuda_kernel(*, name, input_names, output_names, source, header="", **_):
        def launch(*, inputs, template, threadgroup, output_shapes, output_dtypes, **__):
            def dtype(d: mx.Dtype) -> str:
                return str(d).removeprefix("mlx.core.")

            builds.append(Build(
                name, source, header,
                tuple((n, dtype(a.dtype), a.ndim) for n, a in zip(input_names, inputs, strict=True)),
                tuple((n, dtype(d)) for n, d in zip(output_names, output_dtypes, strict=True)),
                tuple((k, dtype(v) if isinstance(v, mx.Dtype) else v) for k, v in template),
                threadgroup[0]))
            return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes, strict=True)]
        return launch

    saved = (mx.fast.cuda_kernel, paged_attention.POSITIONS_IN_FLIGHT, q4_gemv.GEMV_WIDE_LOADS, q4_mma.MMA_SHAPE,
             q4_gemv.GEMV_MAGIC_NIBBLES, q4_gemv.GEMV_SUMS, q4_gemv.ONE_ROW_MANY_N)
    mx.fast.cuda_kernel = fake_cuda_kernel
    kernel_cache.cuda_kernel.cache_clear()
    try:
        for dtype in (mx.bfloat16, mx.float32):
            for D, H, Hk in ((64, 32, 8), (128, 32, 8)):  # the 1B and 8B shapes
                q = mx.zeros((1, H, 1, D), dtype=dtype)
                pool = mx.zeros((Hk, 64, D), dtype=dtype)
                for width in (8, 4096):  # whole, then split (partials and merge)
                    for in_flight in (2, 4, 8):
                        paged_attention.POSITIONS_IN_FLIGHT = in_flight
                        kernel_cache.cuda_kernel.cache_clear()
                        paged_attention.decode(q, pool, pool, mx.zeros((1, width), dtype=mx.int32), mx.array([8]),
                                               D**-0.5, use_kernel=True)
                # the decode step's keys and values written into the pool in place
                new = mx.zeros((3, Hk, 1, D), dtype=dtype)
                pool_write.write(new, new, pool, pool, mx.zeros((3,), dtype=mx.int32))
                # and a prompt chunk's, packed
                chunk = mx.zeros((2, Hk, 5, D), dtype=dtype)
                pool_write.write(chunk, chunk, pool, pool, mx.zeros((10,), dtype=mx.int32))
                # a step of more rows' q/k/v rotated and written by one kernel (blocks.OPS_ROPE_WRITE)
                for trad in (False, True):
                    pool_write.rope_write(mx.zeros((64, (H + 2 * Hk) * D), dtype=dtype),
                                               mx.zeros((64,), dtype=mx.int32), mx.zeros((D // 2,), dtype=mx.float32),
                                               H, D, trad, (pool, pool, mx.zeros((64,), dtype=mx.int32)))
            # the embedding's rows, the last positions' and the pool's slots (rows.py)
            row_kernel.take(mx.zeros((64, 2048), dtype=dtype), mx.zeros((3, 7), dtype=mx.uint32))
            if dtype == mx.bfloat16:  # (int32 and bool arrays only: once)
                # a 4-bit embedding's packed weights and a table at int32 indices
                row_kernel.take(mx.zeros((64, 256), dtype=mx.uint32), mx.zeros((5,), dtype=mx.int32))
                # a decode window step's offsets, slots and mask (layouts.window_layout)
                step_layout.step_layout(mx.zeros((5,), dtype=mx.int32), mx.array(1, dtype=mx.int32),
                                        mx.zeros((32, 5), dtype=mx.int32), mx.zeros((3, 48), dtype=mx.int32))
            for hidden in (2048, 4096):
                norm = nn.RMSNorm(hidden)
                norm.weight = norm.weight.astype(dtype)
                x = mx.zeros((3, hidden), dtype=dtype)
                residual_norm.add_rms_norm(x, x, norm, use_kernel=True)
            # a decoder block's four GEMV kernels (block_gemv.py) at the 1B and 8B shapes
            for hidden, H, Hk, D, inter in ((2048, 32, 8, 64, 8192), (4096, 32, 8, 128, 14336)):
                for rows in (1, 3):  # ROWS 1 and 4
                    x = mx.zeros((rows, hidden), dtype=dtype)
                    norm = (mx.zeros((hidden,), dtype=dtype), 1e-5)
                    qkv = mx.zeros(((H + 2 * Hk) * D, hidden), dtype=dtype)
                    block_gemv.gemv(x, qkv, block_gemv.ROPE, bias=qkv[:, 0], norm=norm, pos=mx.zeros((rows,), dtype=mx.int32),
                                freq_pi=mx.zeros((D // 2,), dtype=mx.float32), head_dim=D, rope_pairs=(H + Hk) * D // 2,
                                q_features=H * D)
                    pool = mx.zeros((Hk, 64, D), dtype=dtype)  # k and v into the pool in place
                    block_gemv.gemv(x, qkv, block_gemv.ROPE, norm=norm, pos=mx.zeros((rows,), dtype=mx.int32),
                                freq_pi=mx.zeros((D // 2,), dtype=mx.float32), head_dim=D, rope_pairs=(H + Hk) * D // 2,
                                q_features=H * D, pool=(pool, pool, mx.zeros((rows,), dtype=mx.int32)))
                    block_gemv.gemv(mx.zeros((rows, H * D), dtype=dtype), mx.zeros((hidden, H * D), dtype=dtype),
                                block_gemv.RESIDUAL, res=x)
                    block_gemv.gemv(x, mx.zeros((2 * inter, hidden), dtype=dtype), block_gemv.SWIGLU, norm=norm)
                    block_gemv.gemv(mx.zeros((rows, inter), dtype=dtype), mx.zeros((hidden, inter), dtype=dtype),
                                block_gemv.RESIDUAL, res=x)
                    # KERNEL_NORM 2: the residual kernel hands the sums of squares, the next takes them
                    counter, ss = block_gemv.counter(), mx.zeros((rows,), dtype=mx.float32)
                    block_gemv.gemv(mx.zeros((rows, inter), dtype=dtype), mx.zeros((hidden, inter), dtype=dtype),
                                block_gemv.RESIDUAL, res=x, hand_ss=counter)
                    block_gemv.gemv(x, mx.zeros((2 * inter, hidden), dtype=dtype), block_gemv.SWIGLU, norm=norm, ss=ss)
            # a decoder block's one-row step as one kernel (block_kernel.py), 1B shape, with q/k/v's bias and without
            hidden, H, Hk, D, inter = 2048, 32, 8, 64, 8192
            paged_attention.POSITIONS_IN_FLIGHT = saved[1]
            if dtype == mx.float32:  # (the 1B shape's row in float32 is more shared memory than a kernel has)
                inter = 4096
            attn_split, preload, grid = block_kernel.ATTN_SPLIT, block_kernel.PRELOAD, block_kernel.GRID_BLOCKS
            block_kernel.GRID_BLOCKS = 132  # (an H200's SMs: no driver to ask here)
            assert block_kernel.fits(hidden, inter, H, Hk, D, dtype, 128)
            qkv, pool = mx.zeros(((H + 2 * Hk) * D, hidden), dtype=dtype), mx.zeros((Hk, 64, D), dtype=dtype)
            one = mx.zeros((1,), dtype=mx.int32)
            for bias, block_kernel.ATTN_SPLIT, block_kernel.PRELOAD in ((None, 0, 0), (qkv[:, 0], 0, 0), (None, 1, 0),
                                                                          (None, 1, 1)):
                block_kernel.block_step(
                    mx.zeros((1, 1, hidden), dtype=dtype), qkv, bias, (mx.zeros((hidden,), dtype=dtype), 1e-5),
                    mx.zeros((hidden, H * D), dtype=dtype), (mx.zeros((hidden,), dtype=dtype), 1e-5),
                    mx.zeros((2 * inter, hidden), dtype=dtype), mx.zeros((hidden, inter), dtype=dtype), one,
                    mx.zeros((D // 2,), dtype=mx.float32), H, Hk, D, False, D**-0.5, (pool, pool, one),
                    mx.zeros((1, 128), dtype=mx.int32), one, block_kernel.barrier(Hk))
            block_kernel.ATTN_SPLIT, block_kernel.PRELOAD, block_kernel.GRID_BLOCKS = attn_split, preload, grid
        w, scales, biases = mx.quantize(mx.zeros((64, 4096), dtype=mx.bfloat16), group_size=64, bits=4)
        # the defaults, the nibbles made floats by their bits (GEMV_MAGIC_NIBBLES), the
        # per-word sums (GEMV_SUMS), then the 4-byte loads and narrow blocks (GEMV_WIDE_LOADS
        # off, MMA_SHAPE "narrow")
        for wide, magic, sums in ((True, False, False), (True, True, False), (True, False, True),
                                  (False, False, False)):
            q4_gemv.GEMV_WIDE_LOADS, q4_mma.MMA_SHAPE = wide, "wide" if wide else "narrow"
            q4_gemv.GEMV_MAGIC_NIBBLES, q4_gemv.GEMV_SUMS = magic, sums
            kernel_cache.cuda_kernel.cache_clear()
            for rows in (1, 9, 64):
                x = mx.zeros((rows, 4096), dtype=mx.bfloat16)
                q4_gemv.gemv(x, w, scales, biases, 64)
                q4_gemv.gemv(x, w, scales, biases, 64, res=mx.zeros((rows, 64), dtype=mx.bfloat16))
                for split in (False, True):
                    q4_mma.mma(x, w, scales, biases, 64, split=split)
                bf16_mma.matmul(x, mx.zeros((64, 4096), dtype=mx.bfloat16))  # (execute.dense_mma)
        # the rest with the default loads and summing
        q4_gemv.GEMV_WIDE_LOADS, q4_mma.MMA_SHAPE, q4_gemv.GEMV_MAGIC_NIBBLES, q4_gemv.GEMV_SUMS = saved[2:6]
        # one-row steps' own block shapes (q4_gemv.one_row_shape): many features (the
        # threshold lowered to this weight's 64; plain and SwiGLU) and a wide K (down's 14,336)
        q4_gemv.ONE_ROW_MANY_N = 64
        one = mx.zeros((1, 4096), dtype=mx.bfloat16)
        q4_gemv.gemv(one, w, scales, biases, 64)
        gate_up = nn.QuantizedLinear(4096, 64, bias=False, group_size=64, bits=4)
        gate_up.set_dtype(mx.bfloat16)
        q4_gemv.gemv_swiglu(one, gate_up)
        wide = mx.quantize(mx.zeros((64, 14336), dtype=mx.bfloat16), group_size=64, bits=4)
        q4_gemv.gemv(mx.zeros((1, 14336), dtype=mx.bfloat16), *wide, 64, res=mx.zeros((1, 64), dtype=mx.bfloat16))
        q4_gemv.ONE_ROW_MANY_N = saved[6]
        # the 8B shape's 4-bit q/k/v with RoPE (quantized.GEMV_ROPE), returned or into the
        # pool, and the gate/up GEMV's SwiGLU (GEMV_SWIGLU)
        qkv = nn.QuantizedLinear(4096, 48 * 128, bias=False, group_size=64, bits=4)
        qkv.set_dtype(mx.bfloat16)
        for rows in (1, 3):
            x, pos = mx.zeros((rows, 4096), dtype=mx.bfloat16), mx.zeros((rows,), dtype=mx.int32)
            freq_pi, pool = mx.zeros((64,), dtype=mx.float32), mx.zeros((8, 64, 128), dtype=mx.bfloat16)
            for target in (None, (pool, pool, pos)):
                q4_gemv.gemv_rope(x, qkv, pos, freq_pi, 32 * 128, 128, False, target)
            q4_gemv.gemv_swiglu(x, qkv)  # (the gate/up kernel: the same build for any N)
    finally:  # the stand-in and its kernels go: a test process goes on with the real ones
        (mx.fast.cuda_kernel, paged_attention.POSITIONS_IN_FLIGHT, q4_gemv.GEMV_WIDE_LOADS, q4_mma.MMA_SHAPE,
         q4_gemv.GEMV_MAGIC_NIBBLES, q4_gemv.GEMV_SUMS, q4_gemv.ONE_ROW_MANY_N) = saved
        kernel_cache.cuda_kernel.cache_clear()
    return builds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--ptxas", action="store_true", help="print each build's registers, stack and shared memory")
    args = parser.parse_args()
    try:
        nvrtc, include = find_nvrtc()
    except FileNotFoundError as exc:
        raise SystemExit(str(exc)) from None
    seen: set[str] = set()
    failed = 0
    for build in record_launches():
        source, label = build.launched(), build.label
        if source in seen:
            continue
        seen.add(source)
        ok, log, _ = compile_source(nvrtc, include, "unikern", source, args.arch, args.ptxas)
        usage = ""
        if ok and args.ptxas:  # ptxas' lines: "... N bytes stack frame ...", "Used N registers, ..."
            usage = " | " + "; ".join(re.findall(r"\d+ bytes stack frame[^\n]*|Used \d+ registers[^\n]*", log))
        print(f"{'ok  ' if ok else 'FAIL'} {label}{usage}", flush=True)
        if not ok:
            failed += 1
            print(log[-3000:])
    print(f"{len(seen) - failed} of {len(seen)} kernel builds compiled for {args.arch}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
