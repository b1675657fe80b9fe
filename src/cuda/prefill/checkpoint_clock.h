// Which chunks of a prefill run store checkpoints (docs/design/prefill.md "States, checkpoints, bad sequences"):
// entry j of a sequence's checkpoint slot holds its state after token (j + 1) C, for j < steps. Worked out once per
// run, so that the head pass's chunk loop only compares. Plain C++ outside nvcc: the CPU suite checks it against that
// rule chunk by chunk.
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(__CUDACC__)
#define GDNKIT_CLOCK_HD __host__ __device__ __forceinline__
#else
#define GDNKIT_CLOCK_HD inline
#endif

namespace gdnkit::cuda::chunked_prefill {

// A run of a sequence's chunks from chunk `first` (of 64 tokens) stores entry `step` after its chunk `next`, then every
// `every` chunks, up to its chunk `last`.
struct CheckpointClock {
  int32_t next = -1, last = -2, step = 0, every = 1;
  // The entry due after chunk c of the run, or -1; called for every chunk in order.
  GDNKIT_CLOCK_HD int64_t tick(int64_t c) {
    if (c != next) return -1;
    const int64_t j = c <= last ? step : -1;
    next += every, ++step;
    return j;
  }
};

// The clock of a run from chunk `first` of a sequence of `len` tokens whose tokens start `offset` tokens into it (a
// split call's piece; none stored where that is negative or not a multiple of 64), for a checkpoint every C tokens (a
// multiple of 64; 0: none) and `steps` entries.
GDNKIT_CLOCK_HD CheckpointClock checkpoint_clock(int64_t first, int64_t offset, int64_t len, int64_t steps,
                                                 int64_t C) {
  constexpr int64_t kChunkTokens = 64;
  CheckpointClock k;
  if (C <= 0 || offset < 0 || offset % kChunkTokens != 0) return k;
  const int64_t every = C / kChunkTokens, before = offset / kChunkTokens;  // chunks between entries; before the run
  const int64_t t = before + first + 1;                                   // the sequence's chunks after the first one
  const int64_t t1 = (t + every - 1) / every * every;                     // ... after its first checkpoint
  const int64_t last = std::min(len / kChunkTokens, steps * every - before) - 1;  // full chunks, entries
  k.next = int32_t(t1 - before - 1 - first);
  k.last = int32_t(std::max(last - first, int64_t(-2)));
  k.step = int32_t(t1 / every - 1);
  k.every = int32_t(every);
  return k;
}

}  // namespace gdnkit::cuda::chunked_prefill
