// Which prefill sequences take the short-sequence path (the recurrent kernels' kPrefill op, launched by
// cuda::prefill_short in recurrent.cu) and which the chunked kernels (cuda/prefill/): one predicate both
// sides and the host's count (prefill.cu) use, so that every sequence is run by exactly one of them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace gdnkit::cuda {

// A well-formed span of at most max_len tokens (0 included). A bad span (out of order, past total_tokens)
// is never short: the chunked kernels skip it and count it, as the CPU reference does.
__host__ __device__ __forceinline__ bool short_prefill_sequence(int64_t start, int64_t end, int64_t total_tokens,
                                                                int64_t max_len) {
  return max_len > 0 && start >= 0 && start <= end && end <= total_tokens && end - start <= max_len;
}

}  // namespace gdnkit::cuda
