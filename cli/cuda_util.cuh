// What the CLI's CUDA benchmark needs beyond the public API: checked runtime calls and element conversions
// for its own fill and check kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "gdnkit/types.h"

namespace gdnkit::bench {

[[noreturn]] inline void throw_cuda(cudaError_t err, const char* what, const char* file, int line) {
  throw Error(ErrorCode::kCudaError, std::string(what) + " failed: " + cudaGetErrorName(err) + " (" +
                                         cudaGetErrorString(err) + ") at " + file + ":" + std::to_string(line));
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <class T>
__device__ __forceinline__ T from_float(float x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(x);
  else if constexpr (std::is_same_v<T, __half>) return __float2half_rn(x);
  else return x;
}

}  // namespace gdnkit::bench

#define BENCH_CUDA_CHECK(call)                                                                          \
  do {                                                                                                  \
    cudaError_t bench_err_ = (call);                                                                    \
    if (bench_err_ != cudaSuccess) ::gdnkit::bench::throw_cuda(bench_err_, #call, __FILE__, __LINE__); \
  } while (0)
#define BENCH_CUDA_CHECK_LAUNCH() BENCH_CUDA_CHECK(cudaGetLastError())
