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

// The largest grid launched in prefetch mode: 1 / share of the CTAs the GPU holds. At share 2, this grid
// and the next of its size fit the GPU together, so the next kernel's CTAs are resident, and prefetching,
// while this one runs; larger grids start their later waves after the previous kernel finished, where the
// index load before the wait would only add latency. Measured per kernel on the H100 (qwen3-next heads,
// decode, B = 1..16): the warp kernel at share 2 (8 for bf16 K-last decode: prefetching grids of B = 2 and
// 4 took 6% and 10% longer than not), V-last decode at share 1 (its grids of fp32 B = 4 and bf16 B = 8,
// one wave, 7% and 15% faster in prefetch mode; the next larger ones slower), bf16 K-last decode's wide tile at
// share 1 (B = 2..12, warp_kernel.cuh): at share 1 the next grid fits beside this one only in part, the rest
// of its CTAs becoming resident as this one's leave.
inline int prefetch_limit(const void* kernel, int threads, int share) { return resident_ctas(kernel, threads) / share; }

// Whether a grid launches in prefetch mode: at most prefetch_ctas CTAs (prefetch_limit), unless
// GDNKIT_PREFETCH=0.
inline bool prefetch_mode(dim3 grid, int prefetch_ctas) {
  return state_prefetch_enabled() && int64_t(grid.x) * grid.y * grid.z <= prefetch_ctas;
}

// Launches kernel<<<grid, threads>>>(args..., prefetch), in prefetch mode when prefetch_mode(grid, prefetch_ctas).
template <class... Params, class... Args>
void launch_recurrent(void (*kernel)(Params...), dim3 grid, int threads, int prefetch_ctas, Stream stream,
                      const Args&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(unsigned(threads));
  cfg.stream = stream;
  cudaLaunchAttribute pdl;
  set_programmatic_launch(cfg, pdl, true);
  const bool prefetch = prefetch_mode(grid, prefetch_ctas);
  GDNKIT_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args..., prefetch));
}

}  // namespace gdnkit::cuda::recurrent
