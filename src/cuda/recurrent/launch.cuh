// Host side of every recurrent kernel launch: the CTAs the device holds of a kernel (the heuristics'
// residency), and the launch itself with programmatic dependent launch and the prefetch-mode flag.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/host/check.h"
#include "cuda/recurrent/heuristics.h"
#include "gdnkit/types.h"

namespace gdnkit::cuda::recurrent {

// CTAs of `kernel` (with `threads` threads) the whole GPU holds at once.
inline int64_t resident_ctas(const void* kernel, int threads) {
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0) != cudaSuccess) {
    cudaGetLastError();
    per_sm = 0;
  }
  return int64_t(per_sm) * device_sms();
}

inline int64_t grid_ctas(dim3 grid) { return int64_t(grid.x) * grid.y * grid.z; }

// Launches kernel<<<grid, threads>>>(args..., prefetch) with programmatic dependent launch.
template <class... Params, class... Args>
void launch_recurrent(void (*kernel)(Params...), dim3 grid, int threads, bool prefetch, Stream stream,
                      const Args&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(unsigned(threads));
  cfg.stream = stream;
  cudaLaunchAttribute pdl;
  set_programmatic_launch(cfg, pdl, true);
  GDNKIT_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args..., prefetch));
}

// The fp8 decode launchers' common part: nothing for an empty batch, B within the grid's y limit, then
// launch(TInput*{}) with q, k, v and o's element type (validated to share k's dtype).
template <class Params, class F>
void for_decode_inputs(const Params& p, F&& launch) {
  constexpr int64_t kMaxGridY = 65535;  // CUDA's limit on gridDim.y: one row per sequence
  if (p.batch <= 0 || p.heads.num_v_heads <= 0) return;
  if (p.batch > kMaxGridY)
    throw Error(ErrorCode::kNotImplemented,
                "cuda recurrent: B = " + std::to_string(p.batch) + " exceeds the grid (B <= 65535)");
  switch (p.k.dtype) {
    case DType::kFloat32: return launch(static_cast<float*>(nullptr));
    case DType::kBFloat16: return launch(static_cast<__nv_bfloat16*>(nullptr));
    case DType::kFloat16: return launch(static_cast<__half*>(nullptr));
    default:
      throw Error(ErrorCode::kInvalidArgument,
                  std::string("k: expected dtype float32, bfloat16 or float16, got ") + dtype_name(p.k.dtype));
  }
}

}  // namespace gdnkit::cuda::recurrent
