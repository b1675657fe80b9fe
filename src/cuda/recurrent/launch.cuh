// Host side of every recurrent kernel launch: the CTAs the device holds of a kernel (the heuristics'
// residency), and the launch itself with programmatic dependent launch and the prefetch-mode flag.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

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

}  // namespace gdnkit::cuda::recurrent
