// The head pass's order of sequences (Plan::pass_order; item_order.h): one CTA sorts the sequence indices by length
// class, longest first, stable within a class, before the chunk prep runs, so that the pass (its items from a counter
// in this order, or its CTAs of one per item reading their sequence through it) finds it written when it starts.
#pragma once

#include <cstdint>

#include "cuda/host/check.h"
#include "cuda/prefill/io.cuh"
#include "cuda/prefill/item_order.h"
#include "cuda/prefill/plan.h"
#include "gdnkit/params.h"

namespace gdnkit::cuda::chunked_prefill {

constexpr int kOrderThreads = 1024, kOrderWarps = kOrderThreads / 32;

// A counting sort over the classes: their sizes (each warp's lanes of one class add once), the start of each (the
// longest class first), then tiles of kOrderThreads sequences, each thread's place in its class from the lanes of its
// warp in that class before it and the warps before its own (a scan over the warps, one thread a class).
__global__ void __launch_bounds__(kOrderThreads) pass_order_kernel(const PrefillParams p, int32_t* order) {
  __shared__ uint32_t start[kLengthClasses];
  __shared__ uint32_t before[kOrderWarps][kLengthClasses];  // per tile: lanes of class k in warp w, then the warps < w
  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int N = p.num_seqs;
  const uint32_t lanes_below = (1u << lane) - 1u;
  const auto class_of = [&](int n) { return n < N ? length_class(load_cu(p, n), load_cu(p, n + 1)) : -1; };
  if (tid < kLengthClasses) start[tid] = 0;
  __syncthreads();
  for (int n0 = 0; n0 < N; n0 += kOrderThreads) {
    const int c = class_of(n0 + tid);
    const unsigned peers = __match_any_sync(0xffffffffu, c);
    if (c >= 0 && (peers & lanes_below) == 0) atomicAdd(&start[c], uint32_t(__popc(peers)));
  }
  __syncthreads();
  if (tid == 0) {
    uint32_t at = 0;
    for (int k = kLengthClasses - 1; k >= 0; --k) {
      const uint32_t size = start[k];
      start[k] = at;
      at += size;
    }
  }
  __syncthreads();
  for (int n0 = 0; n0 < N; n0 += kOrderThreads) {
    const int n = n0 + tid, c = class_of(n);
    const unsigned peers = __match_any_sync(0xffffffffu, c);
    before[warp][lane] = 0;  // kLengthClasses == 32: a lane a class
    __syncwarp();
    if (c >= 0 && (peers & lanes_below) == 0) before[warp][c] = uint32_t(__popc(peers));
    __syncthreads();
    if (tid < kLengthClasses) {  // exclusive over the warps, then the class's start moves past the tile
      uint32_t sum = 0;
      for (int w = 0; w < kOrderWarps; ++w) {
        const uint32_t count = before[w][tid];
        before[w][tid] = start[tid] + sum;
        sum += count;
      }
      start[tid] += sum;
    }
    __syncthreads();
    if (c >= 0) order[before[warp][c] + uint32_t(__popc(peers & lanes_below))] = n;
    __syncthreads();
  }
}

inline void launch_pass_order(const PrefillParams& p, int32_t* order, cudaStream_t stream) {
  static_assert(kLengthClasses == 32, "a lane a class");
  pass_order_kernel<<<1, kOrderThreads, 0, stream>>>(p, order);
  GDNKIT_CUDA_CHECK_LAUNCH();
}

}  // namespace gdnkit::cuda::chunked_prefill
