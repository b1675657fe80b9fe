// What every recurrent kernel (warp_kernel.cuh, chain_mma.cuh, vlast_decode.cuh, mma_decode.cuh) shares: the
// parameters, programmatic dependent launch, and about a row (one sequence of the batch) its slots, its tokens
// and its checks in the CPU reference's order (docs/design/decode.md "The warp kernel", "Rows").
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/arch/dtype.cuh"
#include "cuda/prefill/short_sequence.h"
#include "cuda/recurrent/heuristics.h"
#include "gdnkit/params.h"

namespace gdnkit::cuda::recurrent {

// What the kernels read: the op's parameters, and for kPrefill what a prefill call adds to a chain.
// Prefill rows: state_indices = the initial slots (nullptr: every row starts from zero), num_draft_tokens
// = the longest sequence this path takes, cu_seqlens unused (the prefill's own, int32 or int64, below).
struct RecurrentParams : CommitParams {
  const int32_t* final_indices = nullptr;       // kPrefill: slot to store the final state, < 0 / nullptr: none
  const void* seq_cu = nullptr;                 // kPrefill: cu_seqlens [B + 1]
  bool seq_cu64 = false;                        //   int64 (else int32)
  int64_t total_tokens = 0;                     // kPrefill: T_total
  const int32_t* checkpoint_indices = nullptr;  // kPrefill: only checked against checkpoint_slots (a short
  int64_t checkpoint_slots = 0;                 //   sequence stores no checkpoint); nullptr: no checkpoints
  // GVA: value head hv reads q/k head hv / group, group = HV / H. gva_magic = ceil(2^32 / group) when
  // 1 < group and HV < 2^16 (then the quotient is one multiply-high, exact for hv, group < 2^16), else 0
  // (group 1: hv; otherwise a division, which would cost decode a sizeable share of its instructions).
  // set_gva (dispatch.cu) fills them.
  int32_t gva_group = 0;
  uint32_t gva_magic = 0;
};

// The launcher of every recurrent op (launcher.cuh; instantiated per layout and state dtype in launch_*.cu).
template <StateLayout kLayout, class TState, class TInput, int K, int V, RecurrentOp kOp>
void launch_recurrent_op(const RecurrentParams& p, bool write_state, Stream stream);

// Programmatic dependent launch (docs/design/decode.md "Launch"): waits for the previous kernel of the
// stream (every read whose value is used comes after), then lets the next kernel launch, so that the next
// one may start once every CTA of this one is past its wait: at most one kernel ahead.
__device__ __forceinline__ void pdl_wait_and_launch_dependents() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;");
}

// The q/k head of value head hv.
__device__ __forceinline__ int qk_head(const RecurrentParams& p, int hv) {
  if (p.gva_group == 1) return hv;
  if (p.gva_magic != 0) return int(__umulhi(unsigned(hv), p.gva_magic));
  return hv / (p.heads.num_v_heads / p.heads.num_qk_heads);
}

// The values of row b that place it, loaded together (all issued before the first is used): its pool
// slot, its cu_seqlens span and, for replay, its kept count; for prefill its final and checkpoint slots.
struct RowLoads {
  int slot;                         // state_indices[b] (prefill: the initial slot, -1 without)
  int64_t span_begin, span_end;     // cu_seqlens[b], cu_seqlens[b + 1] (0, 0 without cu_seqlens)
  int accepted;                     // replay: accepted[b]
  int final_slot, checkpoint_slot;  // prefill: final and checkpoint slots (-1: none)
};
// pin_slot (decode): the slot index as a volatile load, which ptxas issues ahead of the state loads after it.
template <RecurrentOp kOp>
__device__ __forceinline__ RowLoads load_row(const RecurrentParams& p, int b, bool pin_slot = false) {
  if constexpr (kOp == RecurrentOp::kPrefill) {
    RowLoads r{p.state_indices != nullptr ? p.state_indices[b] : -1, 0, 0, 0, -1, -1};
    if (p.seq_cu64) {
      r.span_begin = static_cast<const int64_t*>(p.seq_cu)[b];
      r.span_end = static_cast<const int64_t*>(p.seq_cu)[b + 1];
    } else {
      r.span_begin = static_cast<const int32_t*>(p.seq_cu)[b];
      r.span_end = static_cast<const int32_t*>(p.seq_cu)[b + 1];
    }
    if (p.final_indices != nullptr) r.final_slot = p.final_indices[b];
    if (p.checkpoint_indices != nullptr) r.checkpoint_slot = p.checkpoint_indices[b];
    return r;
  }
  RowLoads r{0, 0, 0, 0, -1, -1};
  if (kOp == RecurrentOp::kDecode && pin_slot) {
    uint32_t w;
    ld_volatile(reinterpret_cast<const uint32_t*>(p.state_indices + b), w);
    r.slot = int(w);
  } else {
    r.slot = p.state_indices[b];
  }
  if (kOp != RecurrentOp::kDecode && p.cu_seqlens != nullptr)
    r.span_begin = p.cu_seqlens[b], r.span_end = p.cu_seqlens[b + 1];
  if constexpr (kOp == RecurrentOp::kRecompute) r.accepted = p.accepted[b];
  return r;
}

// Row b's first token and length: T tokens at b * T, or cu_seqlens' span (decode passes T = 1 and no
// cu_seqlens). False for a row the kernels cannot place (a length outside 0..T, a span outside the B*T
// token rows): counted, nothing written. Prefill: false for every sequence the chunked kernels take (not short, or a bad span, which
// they count): the kernel leaves it alone.
template <RecurrentOp kOp>
__device__ __forceinline__ bool row_tokens(const RecurrentParams& p, const RowLoads& rl, int b, int T, int64_t& tok0,
                                           int& len) {
  if constexpr (kOp == RecurrentOp::kPrefill) {
    tok0 = rl.span_begin;
    len = int(rl.span_end - rl.span_begin);
    return short_prefill_sequence(rl.span_begin, rl.span_end, p.total_tokens, T);
  }
  tok0 = int64_t(b) * T;
  len = T;
  if (p.cu_seqlens != nullptr) {
    tok0 = rl.span_begin, len = int(rl.span_end - rl.span_begin);
    // The views hold at most B*T rows: a span before row 0 or past them cannot be placed either.
    if (kOp != RecurrentOp::kDecode && (tok0 < 0 || rl.span_end > int64_t(p.batch) * T)) return false;
  }
  return len >= 0 && len <= T;
}

// Whether row b's first n kept tokens (accepted_path, or 0..n-1 without it) lie in its len tokens and each continues
// from the one before (on a tree its parent, on a chain token x from x - 1; the first from the pool state, -1).
__device__ __forceinline__ bool path_is_valid(const CommitParams& p, int b, int T, int len, int n) {
  if (p.accepted_path == nullptr) return true;
  const int32_t* path = p.accepted_path + int64_t(b) * T;
  int prev = -1;
  for (int j = 0; j < n; ++j) {
    const int x = path[j];
    if (x < 0 || x >= len) return false;
    if ((p.parent != nullptr ? p.parent[int64_t(b) * T + x] : x - 1) != prev) return false;
    prev = x;
  }
  return true;
}

// Whether row b (len tokens placed, pool slot rl.slot) must be skipped and counted: a slot past the pool,
// and for verify a cache slot past the buffer or a parent out of range, for replay a kept count past the
// row's tokens or a path that is not one (path_is_valid), for prefill a final or checkpoint slot past its
// buffer. Sets n_replay (replay: the kept count) and cache_slot (verify: the row's intermediate cache slot,
// -1 without a cache).
template <RecurrentOp kOp>
__device__ __forceinline__ bool row_is_bad(const RecurrentParams& p, const RowLoads& rl, int b, int T, int len,
                                           int& n_replay, int& cache_slot) {
  bool bad = rl.slot >= p.state.num_slots;
  n_replay = 0, cache_slot = -1;
  if constexpr (kOp == RecurrentOp::kPrefill) {
    bad = bad || rl.final_slot >= p.state.num_slots ||
          (p.checkpoint_indices != nullptr && rl.checkpoint_slot >= p.checkpoint_slots);
  } else if constexpr (kOp == RecurrentOp::kRecompute) {
    n_replay = rl.accepted;
    bad = bad || n_replay < 0 || n_replay > len;
    bad = bad || !path_is_valid(p, b, T, len, n_replay);
  } else if constexpr (kOp == RecurrentOp::kVerify) {
    if (p.intermediate.data != nullptr && p.intermediate_indices != nullptr) {
      cache_slot = p.intermediate_indices[b];
      bad = bad || cache_slot >= p.intermediate.num_slots;
    }
    for (int t = 0; t < len && !bad && p.parent != nullptr; ++t) {
      const int x = p.parent[int64_t(b) * T + t];
      bad = x < -1 || x >= t;
    }
  }
  return bad;
}

// Verify's row prologue for kernels of kCols columns a warp at v0 (fp8_chain.cuh, fp8_chain_mma.cuh, vlast_chain.cuh):
// the row's tokens (tok0, len), slot and cache slot (-1: none). False where the kernel must not run the row: one it
// cannot place or must not touch (counted by counts_errors), or a padding row; o = 0 for the warp's columns of its
// placed tokens.
struct VerifyRow {
  RowLoads row;
  int64_t tok0;
  int len, cache_slot;
};
template <class TInput, int kCols>
__device__ __forceinline__ bool verify_row(const RecurrentParams& p, int b, int hv, int v0, int lane,
                                           bool counts_errors, VerifyRow& r) {
  constexpr RecurrentOp kOp = RecurrentOp::kVerify;
  const int T = p.num_draft_tokens;
  r.row = load_row<kOp>(p, b);
  if (!row_tokens<kOp>(p, r.row, b, T, r.tok0, r.len)) {
    if (counts_errors) atomicAdd(p.error_flag, 1);
    return false;
  }
  int n_replay;
  const bool bad = row_is_bad<kOp>(p, r.row, b, T, r.len, n_replay, r.cache_slot);
  if (bad || r.row.slot < 0) {  // padding row, or one the kernel must not touch: o = 0, no state traffic
    if (bad && counts_errors) atomicAdd(p.error_flag, 1);
    if (lane < kCols)
      for (int t = 0; t < r.len; ++t)
        static_cast<TInput*>(p.o.data)[(r.tok0 + t) * p.o.token_stride + int64_t(hv) * p.o.head_stride + v0 + lane] =
            from_float<TInput>(0.0f);
    return false;
  }
  return true;
}

}  // namespace gdnkit::cuda::recurrent
