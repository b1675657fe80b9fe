// Which prefill sequences take the short-sequence path (the recurrent kernels' kPrefill op) and which the
// chunked kernels: one predicate for both sides and for the host's count (prefill/heuristics.cpp), so that
// every sequence is run by exactly one of them. Plain C++ outside nvcc: the CPU suite tests the heuristics.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define GDNKIT_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define GDNKIT_HOST_DEVICE inline
#endif

namespace gdnkit::cuda {

// A well-formed span of at most max_len tokens (0 included). A bad span (out of order, past total_tokens)
// is never short: the chunked kernels skip it and count it, as the CPU reference does.
GDNKIT_HOST_DEVICE bool short_prefill_sequence(int64_t start, int64_t end, int64_t total_tokens, int64_t max_len) {
  return max_len > 0 && start >= 0 && start <= end && end <= total_tokens && end - start <= max_len;
}

}  // namespace gdnkit::cuda
