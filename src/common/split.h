// A prefill split over ranks as both backends run it: the local params with the initial slots read on rank 0 alone,
// the final slots written on the ranks that store them, and checkpoints only where they are stored.
#pragma once

#include "gdnkit/params.h"

#if defined(__CUDACC__)
#define GDNKIT_SPLIT_HD __host__ __device__ __forceinline__
#else
#define GDNKIT_SPLIT_HD inline
#endif

namespace gdnkit {

inline bool split_stores_final(const SplitPrefillParams& sp) {
  return sp.final_on_every_rank || sp.rank == sp.num_ranks - 1;
}

inline PrefillParams split_local_params(const SplitPrefillParams& sp) {
  PrefillParams p = sp.local;
  if (sp.rank != 0) p.initial_indices = nullptr;
  if (!split_stores_final(sp)) p.final_indices = nullptr;
  if (p.checkpoint_indices == nullptr || p.checkpoints.data == nullptr) p.checkpoint_interval = 0;
  return p;
}

// Sequence n's piece holds a checkpoint: entry j = the first multiple of C past the piece's offset.
GDNKIT_SPLIT_HD bool split_piece_holds_checkpoint(int64_t offset, int64_t len, int64_t C, int64_t steps) {
  const int64_t j = offset / C;
  return C > 0 && (j + 1) * C <= offset + len && j < steps;
}

// The piece's checkpoints can be stored where they fall: its offset is >= 0, and a multiple of 64 (a chunk of the
// sequence) unless it holds none.
GDNKIT_SPLIT_HD bool split_piece_checkpoints_ok(int64_t offset, int64_t len, int64_t C, int64_t steps) {
  return offset >= 0 && (offset % 64 == 0 || !split_piece_holds_checkpoint(offset, len, C, steps));
}

}  // namespace gdnkit
