// What every recurrent kernel (warp_kernel.cuh, chain_mma.cuh) shares about a row (one sequence of the
// batch): the op, the row's tokens, and the row's checks in the CPU reference's order.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "gdnkit/params.h"

namespace gdnkit::cuda::recurrent {

enum class WarpOp : int32_t {
  kDecode = 0,  // one token per sequence (token b), o, state written back
  kVerify = 1,  // T tokens (fixed or varlen, chain or tree): o per token, intermediate states when asked
  kReplay = 2,  // commit by recompute: replay the kept tokens (no q, no o) and store the state
};

// The values of row b that place it, loaded together (all issued before the first is used): its pool
// slot, its cu_seqlens span and, for replay, its kept count.
struct RowLoads {
  int slot;      // state_indices[b]
  int cs0, cs1;  // cu_seqlens[b], cu_seqlens[b + 1] (0, 0 without cu_seqlens)
  int accepted;  // replay: accepted[b]
};
template <WarpOp kOp>
__device__ __forceinline__ RowLoads load_row(const CommitParams& p, int b) {
  RowLoads r{p.state_indices[b], 0, 0, 0};
  if (kOp != WarpOp::kDecode && p.cu_seqlens != nullptr) r.cs0 = p.cu_seqlens[b], r.cs1 = p.cu_seqlens[b + 1];
  if constexpr (kOp == WarpOp::kReplay) r.accepted = p.accepted[b];
  return r;
}

// Row b's first token and length: T tokens at b * T, or cu_seqlens' span (decode passes T = 1 and no
// cu_seqlens). False for a row the kernels cannot place (a length outside 0..T): counted, nothing written.
__device__ __forceinline__ bool row_tokens(const CommitParams& p, const RowLoads& rl, int b, int T, int64_t& tok0,
                                           int& len) {
  tok0 = int64_t(b) * T;
  len = T;
  if (p.cu_seqlens != nullptr) tok0 = rl.cs0, len = rl.cs1 - rl.cs0;
  return len >= 0 && len <= T;
}

// Whether row b (len tokens placed, pool slot rl.slot) must be skipped and counted: a slot past the pool,
// and for verify a cache slot past the buffer or a parent out of range, for replay a kept count past the
// row's tokens or a path entry out of range. Sets n_replay (replay: the kept count) and islot (verify:
// the row's cache slot, -1 without a cache).
template <WarpOp kOp>
__device__ __forceinline__ bool row_is_bad(const CommitParams& p, const RowLoads& rl, int b, int T, int len,
                                           int& n_replay, int& islot) {
  bool bad = rl.slot >= p.state.num_slots;
  n_replay = 0, islot = -1;
  if constexpr (kOp == WarpOp::kReplay) {
    n_replay = rl.accepted;
    bad = bad || n_replay < 0 || n_replay > len;
    for (int j = 0; j < n_replay && !bad && p.accepted_path != nullptr; ++j) {
      const int x = p.accepted_path[int64_t(b) * T + j];
      bad = x < 0 || x >= len;
    }
  } else if constexpr (kOp == WarpOp::kVerify) {
    if (p.intermediate.data != nullptr && p.intermediate_indices != nullptr) {
      islot = p.intermediate_indices[b];
      bad = bad || islot >= p.intermediate.num_slots;
    }
    for (int t = 0; t < len && !bad && p.parent != nullptr; ++t) {
      const int x = p.parent[int64_t(b) * T + t];
      bad = x < -1 || x >= t;
    }
  }
  return bad;
}

}  // namespace gdnkit::cuda::recurrent
