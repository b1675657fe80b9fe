// The head state pass's state stores: S^T of a state thread's fragment (head_chunk.cuh) written to checkpoint entries
// and the final slot (docs/design/prefill.md "States, checkpoints, bad sequences"); the kernel reads the initial
// slot through head_state_offset. K-last keeps a lane's elements (k, k+1) of one value row adjacent: one 2-element
// access each where the buffer allows it (Plan::state_pairs / checkpoint_pairs), else one element at a time.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/arch/fp8.cuh"
#include "cuda/arch/tma.cuh"
#include "cuda/arch/wgmma.cuh"
#include "cuda/prefill/checkpoint_clock.h"
#include "cuda/prefill/head_stage.cuh"
#include "cuda/prefill/io.cuh"
#include "cuda/prefill/plan.h"
#include "gdnkit/params.h"

namespace gdnkit::cuda::chunked_prefill {

// Element offset in a state slot of this thread's s[j][e] = S[k][v], k = 8j + q2 + (e & 1), v = vw + r + 8 (e >> 1).
template <class S>
__device__ __forceinline__ int64_t head_state_offset(const HeadCoords& at, int j, int e) {
  return state_offset(S::kLayout, at.h, 8 * j + at.q2 + (e & 1), at.vw + at.r + 8 * (e >> 1), S::K, S::V);
}

// S to the slot at `offset` of a state buffer (the pool or the checkpoints) of dtype dt.
template <class S>
__device__ __forceinline__ void store_head_state(const float (&s)[S::KT][4], const HeadCoords& at, void* base,
                                                 DType dt, int64_t offset, bool pairs) {
#pragma unroll
  for (int j = 0; j < S::KT; ++j)
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      if (pairs) {
        store_state_pair(base, dt, offset + head_state_offset<S>(at, j, e), s[j][e], s[j][e + 1]);
      } else {
        store_state_elem(base, dt, offset + head_state_offset<S>(at, j, e), s[j][e]);
        store_state_elem(base, dt, offset + head_state_offset<S>(at, j, e + 1), s[j][e + 1]);
      }
    }
}

// S to a float8_e4m3 K-last head (its K x V bytes at `head`, its block scales at `scales`; docs/semantics.md
// "float8_e4m3 states"), value rows from row0 on (row0 > 0: a warpgroup's rows alone, in a buffer of its own). The
// 32-element block b of column v (k = 32 b .. 32 b + 31) is this thread's tiles j = 4 b .. 4 b + 3 (k pairs q2, q2 + 1)
// in the 4 lanes of its row r: two shuffles for its amax.
template <class S>
__device__ __forceinline__ void store_head_state_e4m3(const float (&s)[S::KT][4], const HeadCoords& at, uint8_t* head,
                                                      uint8_t* scales, int row0 = 0) {
  constexpr int K = S::K, kBlocks = K / kFp8Block;
  static_assert(S::KT == 4 * kBlocks, "four n8 tiles of k per block");
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int v = at.vw + at.r + 8 * hh - row0;
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) {
      uint32_t m = 0;
#pragma unroll
      for (int jj = 0; jj < 4; ++jj)
        m = max(m, max(abs_bits(s[4 * b + jj][2 * hh]), abs_bits(s[4 * b + jj][2 * hh + 1])));
      m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = max(m, __shfl_xor_sync(0xffffffffu, m, 2));
      const Fp8Scale sc = e4m3_block_scale(m);
#pragma unroll
      for (int jj = 0; jj < 4; ++jj)
        *reinterpret_cast<uint16_t*>(head + int64_t(v) * K + 8 * (4 * b + jj) + at.q2) =
            uint16_t(e4m3x2(s[4 * b + jj][2 * hh], s[4 * b + jj][2 * hh + 1], sc));
      if (at.q2 == 0) scales[v * kBlocks + b] = uint8_t(sc.byte);
    }
  }
}

// S <- a float8_e4m3 K-last head (its bytes at `head`, its block scales at `scales`): a lane's k pair (q2, q2 + 1) of
// tile j is two adjacent bytes of column v, in block j / 4.
template <class S>
__device__ __forceinline__ void load_head_state_e4m3(float (&s)[S::KT][4], const HeadCoords& at, const uint8_t* head,
                                                     const uint8_t* scales) {
  constexpr int K = S::K, kBlocks = K / kFp8Block;
  uint32_t raw[S::KT][2], sbyte[S::KT / 4][2];  // every load issued before any use
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int v = at.vw + at.r + 8 * hh;
#pragma unroll
    for (int j = 0; j < S::KT; ++j)
      raw[j][hh] = *reinterpret_cast<const uint16_t*>(head + int64_t(v) * K + 8 * j + at.q2);
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) sbyte[b][hh] = scales[v * kBlocks + b];
  }
#pragma unroll
  for (int hh = 0; hh < 2; ++hh)
#pragma unroll
    for (int j = 0; j < S::KT; ++j) {
      const float2 f = e4m3x2_to_float2(raw[j][hh], e8m0_scale(sbyte[j / 4][hh]));
      s[j][2 * hh] = f.x, s[j][2 * hh + 1] = f.y;
    }
}

// S to a float8_e4m3 V-last head (its K x V bytes at `head`, its block scales at `scales`; docs/semantics.md
// "float8_e4m3 states"). Block b of row k is columns 32 b .. 32 b + 31, the value rows of state warps 2 i and 2 i + 1:
// a warp's largest magnitude of each k over its 16 rows is a lane's two and three shuffles (the 8 lanes of its q2),
// and the pair's two halves meet in shared memory on the pair's named barrier. Every state warp of the CTA calls it.
template <class S>
__device__ __forceinline__ void store_head_state_vlast_e4m3(const float (&s)[S::KT][4], const HeadCoords& at,
                                                            uint8_t* head, uint8_t* scales) {
  constexpr int K = S::K, V = S::V;
  static_assert(S::kWarps % 2 == 0 && S::kWarps <= 8, "warp pairs on kVLastPairBarrier .. kVLastPairBarrier + 3");
  __shared__ uint2 halves[S::kWarps][K / 2];  // each warp's maxima of k pairs (2 i, 2 i + 1)
  uint32_t m[S::KT][2];
#pragma unroll
  for (int j = 0; j < S::KT; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      uint32_t x = max(abs_bits(s[j][e]), abs_bits(s[j][e + 2]));  // rows r and r + 8
      x = max(x, __shfl_xor_sync(0xffffffffu, x, 4));
      x = max(x, __shfl_xor_sync(0xffffffffu, x, 8));
      m[j][e] = max(x, __shfl_xor_sync(0xffffffffu, x, 16));
    }
  if (at.r == 0)
#pragma unroll
    for (int j = 0; j < S::KT; ++j) halves[at.warp][4 * j + at.q2 / 2] = make_uint2(m[j][0], m[j][1]);
  const int bar = kVLastPairBarrier + at.warp / 2;
  named_barrier_sync(bar, 64);
#pragma unroll
  for (int j = 0; j < S::KT; ++j) {
    const uint2 o = halves[at.warp ^ 1][4 * j + at.q2 / 2];
    m[j][0] = max(m[j][0], o.x);
    m[j][1] = max(m[j][1], o.y);
  }
  named_barrier_sync(bar, 64);  // both read the other's half: halves is free for the next store
  const bool scale_lane = at.r == 0 && at.warp % 2 == 0;
#pragma unroll
  for (int j = 0; j < S::KT; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int k = 8 * j + at.q2 + e;
      const Fp8Scale sc = e4m3_block_scale(m[j][e]);
      const uint32_t b = e4m3x2(s[j][e], s[j][e + 2], sc);
      uint8_t* const row = head + k * V + at.vw + at.r;
      row[0] = uint8_t(b);
      row[8] = uint8_t(b >> 8);
      if (scale_lane) scales[k * (V / kFp8Block) + at.vw / kFp8Block] = uint8_t(sc.byte);
    }
}

// S <- a float8_e4m3 V-last head (its bytes at `head`, its block scales at `scales`): element (k, v) is byte k V + v,
// its scale that of block k V / 32 + v / 32 (a warp's 16 columns lie in one block).
template <class S>
__device__ __forceinline__ void load_head_state_vlast_e4m3(float (&s)[S::KT][4], const HeadCoords& at,
                                                           const uint8_t* head, const uint8_t* scales) {
  constexpr int V = S::V;
#pragma unroll
  for (int j = 0; j < S::KT; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int k = 8 * j + at.q2 + e;
      const uint8_t* const row = head + k * V + at.vw + at.r;
      const float scale = e8m0_scale(scales[k * (V / kFp8Block) + at.vw / kFp8Block]);
      s[j][e] = e4m3_to_float(row[0], scale);
      s[j][e + 2] = e4m3_to_float(row[8], scale);
    }
}

// A float8_e4m3 head in the build's layout: S to it, S from it.
template <class S>
__device__ __forceinline__ void store_head_e4m3(const float (&s)[S::KT][4], const HeadCoords& at, uint8_t* head,
                                                uint8_t* scales) {
  if constexpr (S::kLayout == StateLayout::kVLast)
    store_head_state_vlast_e4m3<S>(s, at, head, scales);
  else
    store_head_state_e4m3<S>(s, at, head, scales);
}
template <class S>
__device__ __forceinline__ void load_head_e4m3(float (&s)[S::KT][4], const HeadCoords& at, const uint8_t* head,
                                               const uint8_t* scales) {
  if constexpr (S::kLayout == StateLayout::kVLast)
    load_head_state_vlast_e4m3<S>(s, at, head, scales);
  else
    load_head_state_e4m3<S>(s, at, head, scales);
}

// S <- `slice`, a copy of the head's K x V slot slice of dtype dt in shared memory (float8_e4m3: its block scales
// right after it), the bulk copy the producer warpgroup issues where Plan::state_bulk holds (V-last: a CTA's columns
// are the head's).
template <class S>
__device__ __forceinline__ void load_head_state_slice(float (&s)[S::KT][4], const HeadCoords& at, const void* slice,
                                                      DType dt) {
  if (dt == DType::kFloat8E4M3) {
    const uint8_t* const bytes = static_cast<const uint8_t*>(slice);
    return load_head_e4m3<S>(s, at, bytes, bytes + S::K * S::V);
  }
  if constexpr (S::kLayout == StateLayout::kVLast) {
#pragma unroll
    for (int j = 0; j < S::KT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        s[j][e] = load_state_elem(slice, dt, int64_t(8 * j + at.q2 + (e & 1)) * S::V + at.vw + at.r + 8 * (e >> 1));
    return;
  }
#pragma unroll
  for (int j = 0; j < S::KT; ++j)
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      const float2 x = load_state_pair(slice, dt, int64_t(at.vw + at.r + 4 * e) * S::K + 8 * j + at.q2);
      s[j][e] = x.x;
      s[j][e + 1] = x.y;
    }
}

// S of this thread's state warpgroup (its 64 value rows) to `rows`, the first of them in a K-last buffer of dtype dt
// (64 K contiguous elements, 16-byte aligned; float8_e4m3: their block scales at `row_scales`, 2 K contiguous bytes),
// through `buf` (shared memory that no thread reads any more, then the scales') and bulk copies: the thread's K / 4
// stores would wait in the memory queues behind the other CTAs' streams, the bulk copy does not. Rows go in rounds of
// kRoundRows, each round's copy read before the next one writes. Meets the warpgroup's 128 threads on named barrier
// `bar`; on return the copies have read buf (its issuer waited; the others know once they meet it again).
template <class S, int kRoundRows>
__device__ __forceinline__ void store_head_rows_rounds(const float (&s)[S::KT][4], const HeadCoords& at, void* buf,
                                                       void* rows, uint8_t* row_scales, DType dt, int bar) {
  static_assert(64 % kRoundRows == 0 && kRoundRows % 16 == 0, "rounds of whole warps' rows");
  const int row = (at.warp % 4) * 16 + at.r;  // the thread's value rows row, row + 8 of the warpgroup's 64
  const bool e4m3 = dt == DType::kFloat8E4M3;
  const uint32_t row_bytes = uint32_t(S::K * dtype_bytes(dt));
#pragma unroll
  for (int r0 = 0; r0 < 64; r0 += kRoundRows) {
    if (r0 > 0) named_barrier_sync(bar, kThreads);  // the previous round's copy has read buf
    if (e4m3) {
      store_head_state_e4m3<S>(s, at, static_cast<uint8_t*>(buf), static_cast<uint8_t*>(buf) + 64 * row_bytes,
                               at.vw + at.r - row);  // from its first row (one round)
    } else if (row >= r0 && row < r0 + kRoundRows) {
#pragma unroll
      for (int j = 0; j < S::KT; ++j)
#pragma unroll
        for (int e = 0; e < 4; e += 2)
          store_state_pair(buf, dt, int64_t(row - r0 + 4 * e) * S::K + 8 * j + at.q2, s[j][e], s[j][e + 1]);
    }
    fence_proxy_async();  // the rows are read by the bulk copy
    named_barrier_sync(bar, kThreads);
    if (at.tid % kThreads == 0) {
      bulk_store(static_cast<char*>(rows) + r0 * row_bytes, buf, uint32_t(kRoundRows) * row_bytes);
      if (e4m3) bulk_store(row_scales, static_cast<uint8_t*>(buf) + 64 * row_bytes, uint32_t(64 * S::K / kFp8Block));
      bulk_commit_group();
      bulk_wait_group_read<0>();  // buf is free again (and the CTA's shared memory may go)
    }
  }
}
// S of the CTA's state warps, every column of the head (V-last rows whole: Plan::state_bulk), to the V-last head at
// `head` (dtype dt; float8_e4m3: its block scales at `scales`) through `buf` (kBufBytes of shared memory that no thread
// reads any more) by bulk copies of whole rows, in rounds of the rows buf holds. Meets the state threads on named
// barrier `bar`; on return the copies have read buf (its issuer waited; the others know once they meet it again).
template <class S, uint32_t kBufBytes>
__device__ __forceinline__ void store_head_vlast_bulk(const float (&s)[S::KT][4], const HeadCoords& at, void* buf,
                                                      void* head, uint8_t* scales, DType dt, int bar) {
  constexpr int K = S::K, V = S::V;
  static_assert(kBufBytes >= uint32_t(K * V + K * V / kFp8Block), "a float8_e4m3 head and its scales in one round");
  if (dt == DType::kFloat8E4M3) {
    uint8_t* const bytes = static_cast<uint8_t*>(buf);
    store_head_state_vlast_e4m3<S>(s, at, bytes, bytes + K * V);
    fence_proxy_async();  // the rows are read by the bulk copy
    named_barrier_sync(bar, S::kThr);
    if (at.tid == 0) {
      bulk_store(head, bytes, uint32_t(K * V));
      bulk_store(scales, bytes + K * V, uint32_t(K * V / kFp8Block));
      bulk_commit_group();
      bulk_wait_group_read<0>();
    }
    return;
  }
  const int es = int(dtype_bytes(dt)), rows = min(K, int(kBufBytes / uint32_t(V * es)));
  for (int k0 = 0; k0 < K; k0 += rows) {
    if (k0 > 0) named_barrier_sync(bar, S::kThr);  // the previous round's copy has read buf
#pragma unroll
    for (int j = 0; j < S::KT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int k = 8 * j + at.q2 + (e & 1) - k0;
        if (k >= 0 && k < rows) store_state_elem(buf, dt, k * V + at.vw + at.r + 8 * (e >> 1), s[j][e]);
      }
    fence_proxy_async();
    named_barrier_sync(bar, S::kThr);
    if (at.tid == 0) {
      bulk_store(static_cast<char*>(head) + k0 * V * es, buf, uint32_t(rows * V * es));
      bulk_commit_group();
      bulk_wait_group_read<0>();
    }
  }
}

// The same through kBufBytes of shared memory: one round where the rows fit (16-bit and float8_e4m3 states in a 64 x
// K 16-bit buffer), else two (fp32).
template <class S, uint32_t kBufBytes>
__device__ __forceinline__ void store_head_rows_bulk(const float (&s)[S::KT][4], const HeadCoords& at, void* buf,
                                                     void* rows, uint8_t* row_scales, DType dt, int bar) {
  static_assert(kBufBytes >= 64u * S::K * 2, "a round holds 64 value rows of a 16-bit state (32 of fp32)");
  if (kBufBytes < 64u * S::K * 4 && dt == DType::kFloat32)
    store_head_rows_rounds<S, 32>(s, at, buf, rows, row_scales, dt, bar);
  else
    store_head_rows_rounds<S, 64>(s, at, buf, rows, row_scales, dt, bar);
}

// The checkpoints of a run of chunks from chunk `first` of its sequence (checkpoint_clock.h). A split call's piece of
// sequence `piece` (else -1) starts Plan::split_offsets[piece] tokens into its sequence.
__device__ __forceinline__ CheckpointClock head_checkpoint_clock(const PrefillParams& p, const Plan& plan,
                                                                 const SeqSlots& sq, int64_t first, int piece) {
  if (sq.cslot < 0) return CheckpointClock{};
  const int64_t offset = piece >= 0 && plan.cp_split && plan.split_offsets ? plan.split_offsets[piece] : 0;
  return checkpoint_clock(first, offset, sq.len, p.checkpoints.num_steps, p.checkpoint_interval);
}

// Element (float8_e4m3: byte) offset of checkpoint entry j of the sequence's slot, and of its block scales.
template <class S>
__device__ __forceinline__ int64_t head_checkpoint_entry(const PrefillParams& p, const SeqSlots& sq, int HV,
                                                         int64_t j) {
  return int64_t(sq.cslot) * p.checkpoints.slot_stride + j * (int64_t(HV) * S::K * S::V);
}
template <class S>
__device__ __forceinline__ uint8_t* head_checkpoint_scales(const PrefillParams& p, const SeqSlots& sq, int HV,
                                                           int64_t j) {
  return p.checkpoints.scales + (int64_t(sq.cslot) * p.checkpoints.num_steps + j) * (int64_t(HV) * S::K * S::V /
                                                                                     kFp8Block);
}

// S to checkpoint entry j, K / 4 stores a thread.
template <class S>
__device__ __forceinline__ void store_head_checkpoint(const float (&s)[S::KT][4], const PrefillParams& p,
                                                      const Plan& plan, const HeadCoords& at, const SeqSlots& sq,
                                                      int64_t j) {
  const int64_t entry = head_checkpoint_entry<S>(p, sq, at.HV, j);
  if (p.checkpoints.dtype == DType::kFloat8E4M3) {
    store_head_e4m3<S>(s, at, static_cast<uint8_t*>(p.checkpoints.data) + entry + int64_t(at.h) * S::K * S::V,
                       head_checkpoint_scales<S>(p, sq, at.HV, j) + int64_t(at.h) * (S::K * S::V / kFp8Block));
  } else {
    store_head_state<S>(s, at, p.checkpoints.data, p.checkpoints.dtype, entry, plan.checkpoint_pairs);
  }
}

// The wgmma build: S of head at.h to the state at element offset `offset` of `base` (dtype dt; float8_e4m3: the slot's
// block scales at `scales`) by bulk copies through the k and q rows of stage b, the chunk's that every state thread has
// just finished (the builds issue its next loads only after the copies read it: beside a producer the caller releases
// the stage after this). The state warpgroups meet first. K-last: two take the k rows (warpgroup 0) and the q rows
// (1), in rounds; one takes both. V-last (a CTA's columns are the head's): the rows of the head through both.
template <class S>
__device__ __forceinline__ void store_head_state_through(const float (&s)[S::KT][4], const HeadCoords& at,
                                                         typename S::Stage& b, void* base, uint8_t* scales, DType dt,
                                                         int64_t offset) {
  constexpr bool kTwo = S::kWarps == 8;
  constexpr uint32_t kBufBytes = kTwo ? sizeof(b.ks) : sizeof(b.ks) + sizeof(b.qs);
  const int wg = at.tid / kThreads;
  named_barrier_sync(kTwo ? kCheckpointBarrier : kOStoreBarrier, S::kThr);
  if constexpr (S::kLayout == StateLayout::kVLast) {
    static_assert(offsetof(typename S::Stage, qs) == offsetof(typename S::Stage, ks) + sizeof(b.ks),
                  "the q rows right after the k rows");
    const int64_t head = int64_t(at.h) * S::K * S::V;
    store_head_vlast_bulk<S, sizeof(b.ks) + sizeof(b.qs)>(
        s, at, b.ks, static_cast<char*>(base) + (offset + head) * dtype_bytes(dt),
        scales != nullptr ? scales + head / kFp8Block : nullptr, dt, kTwo ? kCheckpointBarrier : kOStoreBarrier);
    return;
  }
  const int64_t first = int64_t(at.h) * S::K * S::V + int64_t(at.v0 + 64 * wg) * S::K;  // the warpgroup's rows
  store_head_rows_bulk<S, kBufBytes>(s, at, kTwo && wg == 1 ? b.qs : b.ks,
                                     static_cast<char*>(base) + (offset + first) * dtype_bytes(dt),
                                     scales != nullptr ? scales + first / kFp8Block : nullptr, dt, kOStoreBarrier + wg);
}

// ... to checkpoint entry j (Plan::checkpoint_bulk).
template <class S>
__device__ __forceinline__ void store_head_checkpoint_bulk(const float (&s)[S::KT][4], const PrefillParams& p,
                                                           const HeadCoords& at, const SeqSlots& sq, int64_t j,
                                                           typename S::Stage& b) {
  const DType dt = p.checkpoints.dtype;
  store_head_state_through<S>(s, at, b, p.checkpoints.data,
                              dt == DType::kFloat8E4M3 ? head_checkpoint_scales<S>(p, sq, at.HV, j) : nullptr, dt,
                              head_checkpoint_entry<S>(p, sq, at.HV, j));
}

// S from the initial slot sq.islot by this thread's own loads (paired where Plan::state_pairs; zero without a slot).
template <class S>
__device__ __forceinline__ void load_head_state_regs(float (&s)[S::KT][4], const PrefillParams& p, const Plan& plan,
                                                     const HeadCoords& at, const SeqSlots& sq) {
  constexpr int K = S::K, V = S::V;
  if (sq.islot >= 0 && p.state.dtype == DType::kFloat8E4M3) {
    const uint8_t* const slot = static_cast<const uint8_t*>(p.state.data) + int64_t(sq.islot) * p.state.slot_stride;
    load_head_e4m3<S>(s, at, slot + int64_t(at.h) * K * V,
                      p.state.scales + (int64_t(sq.islot) * at.HV + at.h) * (K * V / kFp8Block));
    return;
  }
  const int64_t base = int64_t(sq.islot) * p.state.slot_stride;
#pragma unroll
  for (int j = 0; j < S::KT; ++j)
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      float2 x = make_float2(0.0f, 0.0f);
      if (sq.islot >= 0 && plan.state_pairs) {
        x = load_state_pair(p.state.data, p.state.dtype, base + head_state_offset<S>(at, j, e));
      } else if (sq.islot >= 0) {
        x.x = load_state_elem(p.state.data, p.state.dtype, base + head_state_offset<S>(at, j, e));
        x.y = load_state_elem(p.state.data, p.state.dtype, base + head_state_offset<S>(at, j, e + 1));
      }
      s[j][e] = x.x;
      s[j][e + 1] = x.y;
    }
}

// S to the final slot `fslot` by this thread's own stores.
template <class S>
__device__ __forceinline__ void store_head_state_regs(const float (&s)[S::KT][4], const PrefillParams& p,
                                                      const Plan& plan, const HeadCoords& at, int fslot) {
  constexpr int K = S::K, V = S::V;
  const int64_t offset = int64_t(fslot) * p.state.slot_stride, head = int64_t(at.h) * K * V;
  if (p.state.dtype == DType::kFloat8E4M3)
    store_head_e4m3<S>(s, at, static_cast<uint8_t*>(p.state.data) + offset + head,
                       p.state.scales + int64_t(fslot) * at.HV * (K * V / kFp8Block) + head / kFp8Block);
  else
    store_head_state<S>(s, at, p.state.data, p.state.dtype, offset, plan.state_pairs);
}

}  // namespace gdnkit::cuda::chunked_prefill
