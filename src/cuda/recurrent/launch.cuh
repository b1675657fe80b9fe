// Host side of every recurrent kernel launch: programmatic dependent launch (unless GDNKIT_PDL=0) and
// the prefetch-mode decision (warp_kernel.cuh explains the mode).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/check.h"
#include "gdnkit/types.h"

namespace gdnkit::cuda::recurrent {

// CTAs of `kernel` (with `threads` threads) the whole GPU holds at once.
inline int resident_ctas(const void* kernel, int threads) {
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0) != cudaSuccess) {
    cudaGetLastError();
    per_sm = 0;
  }
  return per_sm * device_sms();
}

// Launches kernel<<<grid, threads>>>(args..., prefetch). Prefetch mode when this grid and the next of its
// size fit the GPU together (2 * CTAs <= max_ctas, from resident_ctas): then the next kernel's CTAs are
// resident, and prefetching, while this one runs. Larger grids start their later waves after the
// previous kernel finished, where the index load before the wait would only add latency.
template <class... Params, class... Args>
void launch_recurrent(void (*kernel)(Params...), dim3 grid, int threads, int max_ctas, Stream stream,
                      const Args&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(unsigned(threads));
  cfg.stream = stream;
  cudaLaunchAttribute pdl[1];
  pdl[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = pdl;
  cfg.numAttrs = programmatic_launch_enabled() ? 1 : 0;
  const bool prefetch = state_prefetch_enabled() && 2 * int64_t(grid.x) * grid.y * grid.z <= max_ctas;
  GDNKIT_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args..., prefetch));
}

}  // namespace gdnkit::cuda::recurrent
