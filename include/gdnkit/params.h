// gdnkit op parameters: one plain struct per op, shared by host dispatch and device kernels.
// Shapes use the spec's names (docs/semantics.md): H q/k heads, HV value heads, K, V head dims,
// B batch, T draft tokens, N prefill sequences, P pool slots.
// All index tensors are int32 and live where the backend computes (host for CPU, device for CUDA).
#pragma once

#include "gdnkit/types.h"

namespace gdnkit {

struct HeadConfig {
  int32_t num_qk_heads = 0;  // H
  int32_t num_v_heads = 0;   // HV, HV % H == 0; value head h reads q/k head h / (HV / H)
  int32_t head_dim_k = 128;  // K in {64, 128, 256}
  int32_t head_dim_v = 128;  // V in {64, 128, 256}
  float scale = 0.0f;        // <= 0 means 1/sqrt(K)
  bool use_qk_l2norm = true;  // q, k <- x / sqrt(sum(x^2) + 1e-6) before scaling q
};

// Gates: per token and value head. Views are [T_total, HV].
struct Gating {
  GateMode mode = GateMode::kFused;
  InView g;                        // kGiven: log-space decay, fp32
  InView beta;                     // kGiven: in [0,1]; fp32, bf16 or fp16
  InView a;                        // kFused: raw decay projection; fp32, bf16 or fp16
  InView b;                        // kFused: raw beta projection;  fp32, bf16 or fp16
  const float* A_log = nullptr;    // kFused: [HV] fp32
  const float* dt_bias = nullptr;  // kFused: [HV] fp32
};

// decode: one token per sequence. Token i of the batch belongs to sequence i.
struct DecodeParams {
  HeadConfig heads;
  int32_t batch = 0;                        // B
  InView q;                                 // [B, H, K]    bf16 / fp16 / fp32
  InView k;                                 // [B, H, K]    same dtype as q
  InView v;                                 // [B, HV, V]   same dtype as q
  OutView o;                                // [B, HV, V]   dtype of v
  Gating gating;                            // [B, HV]
  StatePool state;                          // [P, HV, ...] updated in place
  const int32_t* state_indices = nullptr;   // [B] slot per sequence; < 0: padding (o = 0, no state I/O)
  int32_t* error_flag = nullptr;            // may be nullptr; += 1 for each slot >= P (skipped, o = 0)
};

// verify: T draft tokens per sequence scored at once (speculative decoding / MTP).
// Tokens are [B*T, ...] (sequence b owns rows b*T .. b*T+T-1) when cu_seqlens is nullptr, else packed
// by cu_seqlens [B+1] with every length <= T (varlen).
struct VerifyParams : DecodeParams {
  int32_t num_draft_tokens = 0;               // T (T_max when varlen)
  const int32_t* cu_seqlens = nullptr;        // [B+1] may be nullptr (fixed T)
  const int32_t* parent = nullptr;            // [B, T] may be nullptr (chain); parent[b][t] < t, -1 = pool state
  StateCache intermediate;                    // [Q, T, HV, <layout>]; data may be nullptr
  const int32_t* intermediate_indices = nullptr;  // [B] slot in intermediate; < 0: not stored
  bool update_state = false;                  // chain only: pool[slot] = state after the last token
};

// commit: after verification, accepted[b] (0..T) tokens of sequence b were kept.
//   kCache:     pool[slot] = intermediate[islot, last kept token]   (accepted = 0: unchanged)
//   kRecompute: replay the kept tokens from pool[slot] (reads k, v, gates of those tokens only; q and o
//               are not used) and store the result in pool[slot].
// The token views, state, indices and intermediate are those of the verify call.
struct CommitParams : VerifyParams {
  CommitSource source = CommitSource::kCache;
  const int32_t* accepted = nullptr;       // [B] number of kept tokens, 0..T
  const int32_t* accepted_path = nullptr;  // [B, T] trees: kept token indices in order; nullptr: chain 0..accepted-1
};

// prefill: N sequences packed by cu_seqlens, chunked (chunk 64).
struct PrefillParams {
  HeadConfig heads;
  int32_t num_seqs = 0;                    // N
  int64_t total_tokens = 0;                // T_total = cu_seqlens[N]
  InView q;                                // [T_total, H, K]
  InView k;                                // [T_total, H, K]
  InView v;                                // [T_total, HV, V]
  OutView o;                               // [T_total, HV, V]
  Gating gating;                           // [T_total, HV]
  const void* cu_seqlens = nullptr;        // [N+1] int32 or int64, non-decreasing, cu_seqlens[0] = 0
  DType cu_seqlens_dtype = DType::kInt32;
  const int64_t* cu_seqlens_host = nullptr;  // optional host copy [N+1]: validated before launch when given
  StatePool state;
  const int32_t* initial_indices = nullptr;  // [N] may be nullptr; slot to start from, < 0: S = 0
  const int32_t* final_indices = nullptr;    // [N] may be nullptr; slot to store the final state, < 0: not stored
  // Checkpoints for prefix caching: entry j of sequence n's checkpoint slot holds the state after token
  // (j+1)*C of that sequence, for j < min(checkpoints.num_steps, len_n / C).
  StateCache checkpoints;                    // [Q, S, HV, <layout>]; data may be nullptr
  int32_t checkpoint_interval = 0;           // C, a multiple of 64; 0: no checkpoints
  const int32_t* checkpoint_indices = nullptr;  // [N] slot in checkpoints; < 0: not stored
  int32_t* error_flag = nullptr;             // may be nullptr; += 1 per out-of-range slot / bad sequence
  PrefillAlgorithm cpu_algorithm = PrefillAlgorithm::kAuto;  // CPU backend only
  // CUDA backend scratch memory; size from prefill_workspace_bytes(). nullptr: the library uses a buffer
  // it owns per device (allocated on first use, so make one eager call before CUDA-graph capture), shared
  // by every call on that device: calls on different streams that may overlap need their own workspace.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// prefill split over ranks (context parallelism across GPUs; docs/semantics.md "Split prefill"): rank r of
// num_ranks holds one contiguous piece of every sequence (possibly empty), and the pieces of sequence n on ranks
// 0, 1, ..., num_ranks - 1, in that order, make the sequence. Every rank calls split_prefill_begin, the ranks
// all-gather the exchange in place (rank r wrote block r), then every rank calls split_prefill_end with the same
// params; gdnkit/nccl.h runs the three over NCCL.
struct SplitPrefillParams {
  // This rank's pieces, packed by local.cu_seqlens ([N+1], the same N on every rank), and this rank's pool and
  // buffers. initial_indices are read on rank 0 only; final_indices written on the last rank (on every rank with
  // final_on_every_rank); each rank stores the checkpoints whose token falls in its piece.
  PrefillParams local;
  int32_t rank = 0;
  int32_t num_ranks = 1;
  bool final_on_every_rank = false;
  // [N] tokens of sequence n held by lower ranks, where the backend computes: required with checkpoints on ranks other
  // than 0 (a piece that holds one must start at a multiple of 64 tokens), else may be nullptr (all 0).
  const int64_t* piece_offsets = nullptr;
  const int64_t* piece_offsets_host = nullptr;  // optional host copy [N]: validated before launch when given
  // [num_ranks, split_prefill_exchange_elems(local)] fp32, 16-byte aligned: begin writes block `rank`, end reads all.
  float* exchange = nullptr;
};

// layout: convert a pool between K-last and V-last. dst.data == src.data is allowed when K == V.
struct LayoutParams {
  int32_t num_v_heads = 0;  // HV
  int32_t head_dim_k = 128;  // K
  int32_t head_dim_v = 128;  // V
  StatePool src;
  StatePool dst;  // opposite layout, same dtype and num_slots
};

}  // namespace gdnkit
