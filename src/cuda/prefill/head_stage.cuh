// The head state pass's shape and shared-memory stages (docs/design/prefill.md "Kernel 2: the head state pass"):
// HeadPass, the compile-time constants of one build; HeadStage / HeadStageWg, one chunk's inputs in shared memory;
// HeadCoords, where a thread's CTA and warp sit.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/arch/wgmma.cuh"
#include "cuda/prefill/plan.h"

namespace gdnkit::cuda::chunked_prefill {

// One chunk's inputs in shared memory, the mma.sync build (kHeadStages of them: the current chunk and the next).
template <int K, int kCols, class Op>
struct HeadStage {
  static constexpr int LDK = K + 8, LDV = kCols + 8, LDT = kChunk + 8;  // +16 bytes: conflict-free ldmatrix
  Op ks[kChunk * LDK];   // k rows (raw)
  Op qs[kChunk * LDK];   // q rows (raw)
  Op vs[kChunk * LDV];   // v rows (the CTA's columns); a warp's 16 columns then stage its o rows
  Op ts[kChunk * LDT];   // T'
  Op ms[kChunk * LDT];   // M
  float sc[kFactorRows<false> * kChunk];  // the chunk's token factors (FactorRow)
};

// The wgmma build's stage, as the TMA tiles land: k, q (the wgmma B operands) and v in 128B-swizzled blocks of
// 64 columns (sw128_offset; 1024-byte aligned); T' and M as causal images (causal_image.cuh), M 64 x 64
// 128B-swizzled when formed in the pass.
template <int K, int kCols, class Op>
struct alignas(1024) HeadStageWg {
  Op ks[kChunk * K];
  Op qs[kChunk * K];
  Op ts[kChunk * kChunk];
  Op ms[kChunk * kChunk];
  Op vs[kChunk * kCols];
  float sc[kFactorRows<head_pass_forms_m(true, kCols)> * kChunk];
};

template <int K, int kCols, class Op, bool kWgmma>
using HeadStageOf = std::conditional_t<kWgmma, HeadStageWg<K, kCols, Op>, HeadStage<K, kCols, Op>>;
// Stages in flight: the wgmma build's TMA loads run two chunks ahead (three stages, 197 KB at K = V = 128),
// the cp.async build's one chunk ahead (its padded stages: two).
template <bool kWgmma>
constexpr int kHeadStages = kWgmma ? 3 : 2;

// Barrier `id` (1..15) of `threads` threads (whole warps).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Arrives on barrier `id` without waiting (the other side of a named_barrier_sync).
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// The kMWarpgroup build's state warpgroups take turns at their P/Q products: warpgroup 1 issues chunk c's after
// warpgroup 0's P of chunk c completed, warpgroup 0 chunk c + 1's after warpgroup 1's P of chunk c.
constexpr int kPqTurnBarrier = 5;  // + the warpgroup that waits

// Named barriers: 0 is __syncthreads; the prep warpgroup meets on 2, state warpgroup g before its o store on
// kOStoreBarrier + g; beside a producer warpgroup the state warpgroups take their P/Q turns on kPqTurnBarrier + g;
// two state warpgroups meet on kCheckpointBarrier before they store a state through a stage (head_state_io.cuh);
// beside a producer warp the state warpgroup meets on kZeroRowsBarrier once it zeroed a partial chunk's rows.
constexpr int kPrepBarrier = 2, kOStoreBarrier = 3, kCheckpointBarrier = 7, kZeroRowsBarrier = 8;
// Beside the fused prep the two state warpgroups meet on kMFormedBarrier once both stored their halves of M.
constexpr int kMFormedBarrier = 9;
// The state warps 2 i, 2 i + 1 (value rows 32 i .. 32 i + 31 of the CTA) meet on kVLastPairBarrier + i to exchange
// their halves of float8_e4m3 V-last scale blocks (head_state_io.cuh store_head_state_vlast_e4m3): 10 .. 13.
constexpr int kVLastPairBarrier = 10;

// One build of the head pass: kSplit CTAs per (sequence, value head), V / kSplit value columns each; kWgmma the
// wgmma build; kMWarpgroup a prep and a producer warpgroup beside two state warpgroups (prep_warpgroup.cuh); kCpMode
// 0 whole sequences, 1 the context-parallel local pass, 2 its final pass (context_parallel.cuh); kFusedPrep the prep
// warpgroup forms the chunk prep but M, which the state warpgroups form (Plan::fused_prep); kPersistent one CTA per SM
// taking (sequence, value head) items in turn (Plan::pass_ticket; state_pass_head.cuh head_pass_persistent_cta);
// kLayout the layout of the pool, the checkpoints and the context-parallel states (head_state_io.cuh).
template <int K_, int V_, int kSplit_, class Op_, bool kWgmma_, bool kMWarpgroup_, int kCpMode_, bool kFusedPrep_,
          bool kPersistent_, StateLayout kLayout_>
struct HeadPass {
  static constexpr int K = K_, V = V_, kSplit = kSplit_, kCpMode = kCpMode_;
  static constexpr StateLayout kLayout = kLayout_;
  using Op = Op_;
  static constexpr bool kWgmma = kWgmma_, kMWarpgroup = kMWarpgroup_, kFusedPrep = kFusedPrep_;
  static constexpr bool kPersistent = kPersistent_;
  static_assert(!kFusedPrep || (kMWarpgroup && kCpMode == 0), "the fused prep: the prep warpgroup, whole sequences");
  static_assert(!kPersistent || (kMWarpgroup && kCpMode == 0 && !kFusedPrep),
                "the persistent pass: the prep warpgroup forming M, whole sequences");
  static constexpr int kCols = V / kSplit, kWarps = kCols / 16, kThr = kWarps * 32;  // the state warps
  static constexpr int KT = K / 8;  // n8 tiles of S^T (the K dimension)
  // A producer warp beside the one state warpgroup of the wgmma build (head_pass_load_warp) issues its loads and o
  // stores, so that the state warps never wait for a TMA issue; kProducer: a producer warp or warpgroup (kMWarpgroup).
  static constexpr bool kLoadWarp = head_pass_load_warp(kWgmma, kMWarpgroup, K, kCols, kCpMode != 0);
  static constexpr bool kProducer = kMWarpgroup || kLoadWarp;
  // The CTA's threads: the state warps, then the prep and producer warpgroups, or the producer warp.
  static constexpr int kCtaThreads = kThr + (kMWarpgroup ? 2 * 128 : kLoadWarp ? 32 : 0);
  static_assert(!kWgmma || kCols % 64 == 0, "the wgmma build needs whole warpgroups of 64 value columns");
  static_assert(!kMWarpgroup || (kWgmma && kCols == 128), "the prep warpgroup: beside two state warpgroups");
  // M formed by the state warpgroups, not read from the stage (with a prep warpgroup forming M, that warpgroup forms
  // it; beside the fused prep they do: kFormsM)
  static constexpr bool kMInPass = !kMWarpgroup && head_pass_forms_m(kWgmma, kCols);
  // The pass writes o: every build but the context-parallel local pass, which keeps only the segment's end state and
  // so reads no q and forms neither M nor o (kFormsM: the state warpgroups form M in this build; beside the fused
  // prep too, with the norms the producer formed, so that the prep warpgroup's chunk is shorter).
  static constexpr bool kOutputs = kCpMode != 1;
  static constexpr bool kFormsM = (kMInPass || kFusedPrep) && kOutputs;
  // the chunk prep's factor rows in the workspace (6: without M, where the pass forms M)
  static constexpr int kFRows = kFactorRows<kMInPass || kMWarpgroup>;
  using Stage = HeadStageOf<K, kCols, Op, kWgmma>;
  static constexpr int kStages = kHeadStages<kWgmma>;
  // The mma.sync build's padded k / q, v and T' / M rows.
  static constexpr int LDK = HeadStage<K, kCols, Op>::LDK, LDV = HeadStage<K, kCols, Op>::LDV,
                       LDT = HeadStage<K, kCols, Op>::LDT;
  // Rows 16 apart in the v (then o) buffer of a stage are kVRow16 bytes apart.
  static constexpr uint32_t kVRow16 = kWgmma ? 16 * 128 : 16 * LDV * 2;
  // M in the pass: each of the two warpgroups forms kMCols of its token columns.
  static constexpr int kMCols = 32;
  static_assert(!kFormsM || kWarps == 8, "M in the pass: two warpgroups, half of M's columns each");
  static_assert(!kMInPass || kThr == 4 * kChunk, "M in the pass: four lanes per token for rq");

  // The prep warpgroup's barriers (state_pass_head.cuh init_stage_barriers): the initial state's copy and its read
  // come after the stages' (4 or, with the fused prep, 5 per stage).
  static constexpr int kStateIn = (kFusedPrep ? 5 : 4) * kStages;

  // Element offset of (row, col) in the v (then o) buffer of a stage.
  static __device__ __forceinline__ int v_offset(int row, int col) {
    if constexpr (kWgmma) return sw128_offset<kChunk>(row, col);
    else return row * LDV + col;
  }
};

// Where a thread sits: its CTA's (sequence n, value head h, column split) over a flat grid, column split
// fastest, then head (the CTAs that share q/k rows run together), and its warp's 16 value columns.
struct HeadCoords {
  int HV, split, h, n;
  int tid, warp, lane, r, q2;
  int hk;
  int v0;  // the CTA's value columns v0 .. v0 + kCols - 1
  int vw;  // this warp's value columns vw .. vw + 15 (head columns)
  int lw;  // ... and in the CTA's v / o tile
};
template <int kSplit, int kCols>
__device__ __forceinline__ HeadCoords head_coords(const PrefillParams& p) {
  HeadCoords x;
  x.HV = p.heads.num_v_heads;
  x.split = int(blockIdx.x % unsigned(kSplit));
  x.h = int(blockIdx.x / unsigned(kSplit) % unsigned(x.HV));
  x.n = int(blockIdx.x / unsigned(kSplit * x.HV));
  x.tid = threadIdx.x;
  x.warp = x.tid >> 5;
  x.lane = x.tid & 31;
  x.r = x.lane >> 2;
  x.q2 = (x.lane & 3) * 2;
  x.hk = x.h / (x.HV / p.heads.num_qk_heads);
  x.v0 = x.split * kCols;
  x.vw = x.v0 + x.warp * 16;
  x.lw = x.warp * 16;
  return x;
}

// Past a partial chunk's end (L < 64 tokens) the staged k, q, v tiles of the wgmma build hold the next tokens' rows
// (or TMA's zeros past the tensor): zeroed here by threads first, first + stride, ..., so that the products run
// unmasked. The caller orders the zeros before the tensor cores' reads (a proxy fence, then a barrier).
template <int K, class Op, class Stage>
__device__ __forceinline__ void zero_rows_past(Stage& b, int L, int first, int stride) {
  constexpr int kCols = int(sizeof(b.vs) / sizeof(b.vs[0])) / kChunk;
  constexpr int kRowPieces = (2 * K + kCols) / 8;  // 16-byte pieces of a token's k, q, v rows
  for (int it = first; it < (kChunk - L) * kRowPieces; it += stride) {
    const int row = L + it / kRowPieces, piece = it % kRowPieces, col = piece % (K / 8) * 8;
    Op* buf = piece < K / 8 ? b.ks : piece < K / 4 ? b.qs : b.vs;
    const int c8 = piece < K / 4 ? col : (piece - K / 4) * 8;
    *reinterpret_cast<uint4*>(&buf[sw128_offset<kChunk>(row, c8)]) = make_uint4(0, 0, 0, 0);
  }
}

}  // namespace gdnkit::cuda::chunked_prefill
