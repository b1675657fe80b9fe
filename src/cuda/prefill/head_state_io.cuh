// The head state pass's state stores: S^T of a state thread's fragment (head_chunk.cuh) written to checkpoint entries
// and the final slot (docs/design/prefill.md "States, checkpoints, bad sequences"); the kernel reads the initial
// slot through head_state_offset. K-last keeps a lane's elements (k, k+1) of one value row adjacent: one 2-element
// access each where the buffer allows it (Plan::state_pairs / checkpoint_pairs), else one element at a time.
#pragma once

#include <cstdint>

#include "cuda/prefill/head_stage.cuh"
#include "cuda/prefill/io.cuh"
#include "cuda/prefill/plan.h"
#include "gdnkit/params.h"

namespace gdnkit::cuda::chunked_prefill {

// Element offset in a state slot of this thread's s[j][e] = S[k][v], k = 8j + q2 + (e & 1), v = vw + r + 8 (e >> 1).
template <class S>
__device__ __forceinline__ int64_t head_state_offset(const PrefillParams& p, const HeadCoords& at, int j, int e) {
  return state_offset(p.state.layout, at.h, 8 * j + at.q2 + (e & 1), at.vw + at.r + 8 * (e >> 1), S::K, S::V);
}

// S to the slot at `offset` of a state buffer (the pool or the checkpoints) of dtype dt.
template <class S>
__device__ __forceinline__ void store_head_state(const float (&s)[S::KT][4], const PrefillParams& p,
                                                 const HeadCoords& at, void* base, DType dt, int64_t offset,
                                                 bool pairs) {
#pragma unroll
  for (int j = 0; j < S::KT; ++j)
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      if (pairs) {
        store_state_pair(base, dt, offset + head_state_offset<S>(p, at, j, e), s[j][e], s[j][e + 1]);
      } else {
        store_state_elem(base, dt, offset + head_state_offset<S>(p, at, j, e), s[j][e]);
        store_state_elem(base, dt, offset + head_state_offset<S>(p, at, j, e + 1), s[j][e + 1]);
      }
    }
}

// After chunk c: checkpoint entry j holds the state after token (j+1)*C, for j < min(steps, len / C).
template <class S>
__device__ __forceinline__ void store_head_checkpoint(const float (&s)[S::KT][4], const PrefillParams& p,
                                                      const Plan& plan, const HeadCoords& at, const SeqSlots& sq,
                                                      int64_t c, int64_t C) {
  if (sq.cslot >= 0) {
    const int64_t done = (c + 1) * kChunk;
    if (done % C == 0 && done <= sq.len && done / C - 1 < p.checkpoints.num_steps) {
      const int64_t j = done / C - 1;
      store_head_state<S>(s, p, at, p.checkpoints.data, p.checkpoints.dtype,
                          int64_t(sq.cslot) * p.checkpoints.slot_stride + j * (int64_t(at.HV) * S::K * S::V),
                          plan.checkpoint_pairs);
    }
  }
}

}  // namespace gdnkit::cuda::chunked_prefill
