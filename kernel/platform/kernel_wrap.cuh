// The text platform/cuda_build.py makes a complete CUDA source of a kernel body with: a
// prelude standing in for what MLX's device header gives unikern's kernel texts, then
// the function around the body, as MLX's CUDA backend writes it (section mlx) or as
// unikern builds it for mx.fast.precompiled_cuda_kernel (section extern). @NAME@,
// @PARAMS@, @CONSTANTS@ and @BODY@ are filled in; each section starts at a line of its name
// after two slashes and "==".
//== prelude
#include <cuda_bf16.h>
#include <cuda_fp16.h>
typedef int int32_t;
typedef unsigned int uint32_t;
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
struct Shape { int v[10]; __device__ int operator[](int i) const { return v[i]; } };
struct Strides { long long v[10]; __device__ long long operator[](int i) const { return v[i]; } };
//== mlx
namespace unikern_check {
__global__ void @NAME@(
    @PARAMS@) {
@CONSTANTS@
@BODY@
}
}
//== extern
extern "C" __global__ void @NAME@(
    @PARAMS@) {
@CONSTANTS@
@BODY@
}
