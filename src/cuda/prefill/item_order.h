// The order in which the head pass takes sequences (Plan::pass_order: the persistent pass's items, or the CTAs of one
// per item in launch order): longest first by length class, a power-of-two class of chunks, so that a long prompt
// starts before the short ones beside it instead of running alone at the end. One definition for the device's
// ordering (item_order.cuh) and the host's test of whether it can change anything (heuristics.cpp). Plain C++ outside
// nvcc.
#pragma once

#include <cstdint>

#include "cuda/prefill/short_sequence.h"  // GDNKIT_HOST_DEVICE

namespace gdnkit::cuda::chunked_prefill {

constexpr int kLengthClasses = 32;  // a class per bit of the chunk count (a warp's lanes)

// 0 for no chunk (an empty or bad span), else 1 + floor(log2(chunks of 64 tokens)).
GDNKIT_HOST_DEVICE int length_class(int64_t start, int64_t end) {
  if (start < 0 || end <= start) return 0;
  uint64_t chunks = uint64_t(end - start + 63) / 64;
  int c = 0;
  while (chunks != 0 && c < kLengthClasses - 1) chunks >>= 1, ++c;
  return c;
}

}  // namespace gdnkit::cuda::chunked_prefill
