// The persistent head pass's order of sequences (Plan::pass_order; item_order.h): one CTA sorts the sequence indices
// by length class, longest first, stable within a class, before the chunk prep runs, so that the pass, which takes
// (sequence, value head) items from a counter in this order, finds it written when it starts.
#pragma once

#include <cstdint>

#include "cuda/host/check.h"
#include "cuda/prefill/io.cuh"
#include "cuda/prefill/item_order.h"
#include "cuda/prefill/plan.h"
#include "gdnkit/params.h"

namespace gdnkit::cuda::chunked_prefill {

constexpr int kOrderThreads = 1024;

// A counting sort over the classes: their sizes, the start of each (the longest class first), then tiles of
// kOrderThreads sequences, each thread's place in its class from its warp's ballot and the warps before it.
__global__ void __launch_bounds__(kOrderThreads) pass_order_kernel(const PrefillParams p, const Plan plan) {
  __shared__ uint32_t start[kLengthClasses];
  __shared__ uint32_t warp_count[kOrderThreads / 32][kLengthClasses];
  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int N = p.num_seqs;
  const auto class_of = [&](int n) { return length_class(load_cu(p, n), load_cu(p, n + 1)); };
  if (tid < kLengthClasses) start[tid] = 0;
  __syncthreads();
  for (int n = tid; n < N; n += kOrderThreads) atomicAdd(&start[class_of(n)], 1u);
  __syncthreads();
  if (tid == 0) {
    uint32_t at = 0;
    for (int c = kLengthClasses - 1; c >= 0; --c) {
      const uint32_t size = start[c];
      start[c] = at;
      at += size;
    }
  }
  __syncthreads();
  for (int n0 = 0; n0 < N; n0 += kOrderThreads) {
    const int n = n0 + tid;
    const int c = n < N ? class_of(n) : -1;
    uint32_t rank = 0;
#pragma unroll 4
    for (int k = 0; k < kLengthClasses; ++k) {
      const unsigned m = __ballot_sync(0xffffffffu, c == k);
      if (lane == 0) warp_count[warp][k] = uint32_t(__popc(m));
      if (c == k) rank = uint32_t(__popc(m & ((1u << lane) - 1u)));
    }
    __syncthreads();
    if (c >= 0) {
      uint32_t at = start[c] + rank;
      for (int w = 0; w < warp; ++w) at += warp_count[w][c];
      plan.pass_order[at] = n;
    }
    __syncthreads();
    if (tid < kLengthClasses) {
      uint32_t size = 0;
      for (int w = 0; w < kOrderThreads / 32; ++w) size += warp_count[w][tid];
      start[tid] += size;
    }
    __syncthreads();
  }
}

inline void launch_pass_order(const PrefillParams& p, const Plan& plan, cudaStream_t stream) {
  pass_order_kernel<<<1, kOrderThreads, 0, stream>>>(p, plan);
  GDNKIT_CUDA_CHECK_LAUNCH();
}

}  // namespace gdnkit::cuda::chunked_prefill
