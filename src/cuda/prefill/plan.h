// Host <-> device contract of the CUDA chunked prefill: the derived sizes and workspace pointers the
// kernels read besides PrefillParams, and the per-head-dim launchers (one translation unit each).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/prefill/heuristics.h"
#include "gdnkit/params.h"

namespace gdnkit::cuda {
// The short-sequence path of prefill: the sequences of at most max_len tokens on the recurrent kernels
// (RecurrentOp::kPrefill: one state read, one write, the tokens on the way), the others left to the chunked
// kernels. Defined in recurrent/dispatch.cu; prefill/heuristics.h decides where it runs.
void prefill_short(const PrefillParams& p, int max_len, Stream stream);
}  // namespace gdnkit::cuda

namespace gdnkit::cuda::chunked_prefill {

constexpr int kThreads = 128;  // 4 warps per CTA in both kernels

// Per chunk and value head, the state passes scale rows of their products by these per-token factors,
// precomputed by the chunk prep (with gcum the within-chunk cumulative log decay, flat past the chunk's
// end, g_last = gcum[63], rk = 1/||k||, rq = scale/||q||; without the L2 norm rk = 1, rq = scale):
//   kDecayRk: e^gcum rk     kDecayRq: e^gcum rq     kTailDecayRk: rk e^(g_last - gcum), 0 past the chunk     kChunkDecay: e^g_last
// and, only where the state pass forms M itself (Plan::m_in_pass), M's per-token terms:
//   kLog2Gcum: gcum log2(e) (M's decay is exp2(kLog2Gcum_i - kLog2Gcum_j))     kInvNormK: rk
// There the chunk prep does not read q at all: the state pass takes rq from the chunk's q rows it holds
// and scales o's rows by it, so kDecayRq is e^gcum alone and M is formed without rq. Beside a prep warpgroup for M
// (Plan::m_warpgroup, m_in_pass set too) the chunk prep writes kLog2Gcum and kInvNormK alone (the block keeps its 6 rows),
// and the warpgroup forms kDecayRk, kDecayRq (with rq), kTailDecayRk and kChunkDecay in the stage.
// Beside a prep warpgroup that forms the prep but M (Plan::fused_prep) the gate kernel writes kLog2Gcum and, in
// kInvNormK's place, kBeta: the gates' beta (the warpgroup takes the norms from the staged rows).
enum FactorRow {
  kDecayRk = 0, kDecayRq = 1, kTailDecayRk = 2, kChunkDecay = 3, kLog2Gcum = 4, kInvNormK = 5, kBeta = 5
};
// Rows of a (chunk, head) block of factors: 6 where the state pass forms M (kMInPass), else 4.
template <bool kMInPass>
constexpr int kFactorRows = kMInPass ? 6 : 4;
constexpr int kFactorRowsMax = kFactorRows<true>;

struct Plan {
  int64_t num_slots = 0;
  // Per chunk and value head, 64 x 64 operand-dtype entries, row-major, or for the wgmma pass the causal image
  // (causal_image.cuh causal_image_offset: the first 6 KB of each 8 KB entry):
  void* ws_tprime = nullptr;        // [num_slots, HV, 64, 64]: T' = (I + A)^{-1} diag(beta)
  void* ws_masked_qk = nullptr;        // [num_slots, HV, 64, 64]: M, the masked decayed q k^T (unless m_in_pass)
  float* ws_factors = nullptr;       // [num_slots, HV, kFactorRows<m_in_pass>, 64] fp32: the per-token factors of the chunk
  float scale = 0.0f;          // q scale (resolved default)
  bool qkv_vec = false;        // q, k, v allow 16-byte loads of 8 contiguous elements
  bool o_pair = false;         // o allows 2-element stores
  bool fp16_operands = false;  // tensor-core operands fp16 (fp16 / fp32 inputs) instead of bf16
  int32_t head_split = 1;      // head state pass: CTAs per (sequence, value head)
  // The state pass is the head pass's wgmma build (PrefillChoice::wgmma_pass).
  bool wgmma_pass = false;
  // ... with CTAs of two warpgroups (head_pass_forms_m), which form M from the chunk's q and k rows on the
  // tensor cores, and the q norms: the chunk prep then reads no q and writes no M (kLog2Gcum, kInvNormK instead).
  bool m_in_pass = false;
  // ... with a third warpgroup beside the two state warpgroups (prep_warpgroup.cuh; K a multiple of 64) that forms
  // M, rq and the factor rows in each chunk's stage (the chunk prep kernel runs without M: m_in_pass is set too).
  bool m_warpgroup = false;
  // ... forming the chunk prep but M in each stage, the state warpgroups M (gate_prep_kernel writes the gates alone;
  // no chunk prep kernel, no T' or M in the workspace)
  bool fused_prep = false;
  bool early_state_pass = false;  // the state pass launches with PDL behind the chunk prep (or the gate kernel)
  // Chunk prep CTAs per (chunk slot, q/k head) (PrefillChoice::prep_parts): CTA (slot H + hk) prep_parts + part takes
  // the part-th share of the GVA group's value heads, HV / H / prep_parts of them
  int32_t prep_parts = 1;
  // PrefillChoice::chunk_flags: per chunk slot the chunk prep's CTAs that finished (H prep_parts of them; zeroed
  // before it), on which the pass's producer waits chunk by chunk instead of the prep's grid; else null
  uint32_t* chunk_ready = nullptr;
  // PrefillChoice::persistent_pass: the items the head pass's CTAs took so far (zeroed before the prep), and its grid
  // (PrefillChoice::pass_ctas)
  uint32_t* pass_ticket = nullptr;
  int32_t pass_ctas = 0;
  // PrefillChoice::longest_first: the sequence indices in the order the head pass takes them (item_order.cuh: the
  // persistent pass's items, or the CTAs of one per item in launch order), after the item counter; else null
  int32_t* pass_order = nullptr;
  bool state_pairs = false;     // K-last pool aligned to 2 elements (base, slot stride): paired state I/O
  // A pool with 16-byte aligned slots (and block scales), K-last or V-last with whole rows a CTA
  // (heuristics.h state_bulk_copies): the wgmma build's final states (beside a prep warpgroup the initial ones too)
  // move by bulk copies through shared memory (state_pass_head.cuh)
  bool state_bulk = false;
  bool checkpoint_pairs = false;  // the same for the checkpoint buffer
  bool checkpoint_bulk = false;
  // Sequences of at most short_len tokens (prefill/short_sequence.h) run on the short-sequence path
  // instead: both kernels skip them. 0: the chunked kernels run every sequence.
  int32_t short_len = 0;
  // Context parallelism (context_parallel.cuh; cp_segment_len > 0): the segment table of cp_max_segments entries and,
  // per segment of a cut sequence (CpSegment::state < cp_max_states) and value head, fp32 states in the pool's
  // layout: the segment's state from zero (the first segment of a sequence: from its initial state), its transition
  // P (K x K: S_end = P S_in + local) and its true initial state.
  int64_t cp_segment_len = 0;
  // Each cut sequence's first segment runs its final pass in the local pass's grid (PrefillChoice::cp_first_final);
  // without a split the last segment of a cut sequence has neither local state nor transition in any case.
  bool cp_first_final = false;
  int32_t cp_scan_cols = 8;  // value columns per CTA of the scan: 8 or 32 (cp_scan_cols)
  int32_t cp_max_segments = 0;
  int32_t cp_max_states = 0;
  int32_t cp_max_cuts = 0;
  CpSegment* cp_segments = nullptr;
  int32_t* cp_state_entry = nullptr;  // [cp_max_states]: the table entry of each state (-1: unused)
  int32_t* cp_cut_first = nullptr;    // [cp_max_cuts]: the first entry of each cut sequence, in order (-1: unused)
  float* cp_local = nullptr;
  float* cp_transition = nullptr;
  float* cp_initial = nullptr;
  // A prefill split over ranks (split_prefill_begin / _end; context_parallel.cuh): every piece's segments hold
  // states, the first one's from zero with its transition too; the scan's compose and fold roles meet the other
  // ranks' pieces through the exchange, where each piece's summary is its state from zero (or from the initial state
  // on rank 0) in the pool's layout, then its transition P: [ranks, N, HV K (V + K)] fp32.
  bool cp_split = false;
  int32_t split_rank = 0, split_ranks = 1;
  bool split_final = false;                 // this rank stores the final states
  const int64_t* split_offsets = nullptr;   // [N] tokens of sequence n on lower ranks (checkpoint positions), may be null
  float* split_exchange = nullptr;
};

// The TMA descriptors of a head pass launch of the wgmma build (a __grid_constant__ kernel parameter): k
// and q as [tokens, q/k heads, K], v as [tokens, value heads, V] (boxes of 64 tokens x 64 columns),
// 128-byte swizzled. T' and M come from the workspace by plain bulk copies (the prep's causal images).
struct HeadTensorMaps {
  CUtensorMap k, q, v, o;  // o: the output of full chunks, stored from the stage's v tiles (head_chunk.cuh)
};
HeadTensorMaps make_head_tensor_maps(const PrefillParams& p, const Plan& plan);

// Workspace bytes for T', M, the token factors, the chunks' counts, the persistent pass's counter, the head pass's
// order (each region 256-byte aligned; prefill_workspace_bytes): M's region also where the pass forms M, so that the
// size grows with total_tokens and num_seqs alone.
size_t workspace_bytes(const PrefillParams& p);
// The plan's workspace pointers (ws_tprime, ws_masked_qk: null where the pass forms M, ws_factors, chunk_ready where
// chunk_flags, pass_ticket where ticket, pass_order where order) in `base`.
void carve_workspace(const PrefillParams& p, void* base, Plan& plan, bool chunk_flags, bool ticket, bool order);

// Launch the kernels for head dim K with value tile `vtile` (defined in prefill_k<K>.cu).
template <int K>
void launch(const PrefillParams& p, const Plan& plan, int vtile, cudaStream_t stream, int stages);
// The sequence indices of p (its cu_seqlens on the device) in the order the head pass takes them, longest class first
// (item_order.cuh), into p.num_seqs words at `order`; the kernel the call launches, callable by tests.
void order_longest_first(const PrefillParams& p, int32_t* order, cudaStream_t stream);
// A split call's half (prefill_k64.cu and prefill_k128.cu): begin (true) or end.
template <int K>
void launch_split(const PrefillParams& p, const Plan& plan, bool begin, cudaStream_t stream);

}  // namespace gdnkit::cuda::chunked_prefill
