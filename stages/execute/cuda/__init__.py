"""unikern's own GPU kernels, written for MLX's `mx.fast.cuda_kernel`: one module per
kernel (or family of builds of one kernel) with the code that launches it, its CUDA text
in the .cu files beside it (sources.py reads them; a .cuh file is a kernel's header).

  paged_attention  decode attention read from the paged pool (paged_*.cu)
  pool_write       a decode step's keys and values, or its q/k/v rows rotated, into the pool
  residual_norm    a residual add and the RMS norm of its sum
  block_gemv       the GEMV of a fused decoder block's steps of up to 4 rows
  block_kernel     a decoder block's one-row step as one kernel (block_step.cu)
  q4_gemv          a GEMV for 4-bit affine weights
  q4_mma           a tensor-core kernel for 4-bit affine weights (mma.cu)
  bf16_mma         the same tensor-core kernel for bfloat16 weights
  weight_kernels   the launch the three weight kernels above share

This package imports only unikern.platform, MLX and numpy: the execute stage, the runner
and the model glue (blocks.py, quantized.py, residual.py, dense_mma.py) import from here.
Each kernel runs on the CPU in the tests' emulation (tests/cuda_emulation.py; the C++
stand-ins for the CUDA headers are the *_emulation.h files here) and compiles for sm_90
with NVRTC without a GPU (tools/device/nvrtc_check.py, tests/test_nvrtc.py)."""
