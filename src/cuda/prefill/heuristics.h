// How a CUDA prefill call runs: which sequences take the short-sequence path, the state pass's value tile
// and head split, its wgmma build, who forms M, and whether the pass launches behind the chunk prep with
// programmatic dependent launch. Pure host code (no CUDA headers): a function of the params, the device's SM
// count and the overrides, tested in the CPU suite. docs/design/prefill.md explains each rule.
#pragma once

#include <cstdint>

#include "cuda/host/overrides.h"
#include "gdnkit/params.h"

namespace gdnkit::cuda::chunked_prefill {

constexpr int kChunk = 64;  // tokens per chunk (the WY block)

// Workspace chunk slots. Chunk c of sequence n lives in slot floor(cu[n]/64) + n + c: unique for
// non-decreasing cu_seqlens (floor(cu[n]/64) + n is strictly increasing and a sequence with
// ceil(len/64) chunks never reaches the next sequence's first slot), and < T_total/64 + N + 1, so the
// host sizes it without reading cu_seqlens, and the chunk prep maps slot -> (n, c) from cu_seqlens (chunk_of_slot).
inline int64_t num_chunk_slots(const PrefillParams& p) { return p.total_tokens / kChunk + p.num_seqs + 1; }

// Workspace regions start 256 bytes apart.
inline size_t workspace_round_up(size_t x) { return (x + 255) / 256 * 256; }

// The value "tiles" of the state pass. The head pass (state_pass_head_kernel) has one CTA per (sequence,
// value head) (or two: the head split) over all V columns, on wgmma where the CTA owns a multiple of 64
// value columns (kVTileHead), else on warp mma.sync (kVTileHeadWarp). The positive tiles (16, 32, 64) run
// the tiled pass (state_pass_kernel), for the calls the head pass cannot take.
constexpr int kVTileHead = -1, kVTileHeadWarp = -2;
inline bool is_head_tile(int vtile) { return vtile == kVTileHead || vtile == kVTileHeadWarp; }

// The chunk prep's dynamic shared memory (chunk_prep.cuh: the raw k (and q, with M) rows of 16-bit operands, wgmma's
// swizzled layout; once consumed, the fp32 solve of kSolveLd-float rows and the parked accumulators of k k^T (and q
// k^T), kPrepTiles tiles of 32 float4 each), and the CTAs per SM it runs on sm_90, which the kernel also asks of ptxas
// as its register budget: as many as the shared memory allows (228 KB per SM, 1 KB reserved per CTA, up to 2 KB of
// static arrays), but with M at K = 128 four, at 128 registers (five, at 96, spilled the solve and took 7-18% longer:
// prefill.md "Kernel 1").
constexpr int kSolveLd = 72;  // fp32 A / T rows in shared memory (solve.cuh's solve_at: skewed, no bank conflicts)
constexpr int kPrepTiles = 20;
constexpr int64_t prep_smem_bytes(int K, bool with_m) {
  const int64_t rows = int64_t(with_m ? 2 : 1) * kChunk * K * 2 + 1024;  // + slack to align the swizzled rows
  const int64_t solve = int64_t(kChunk) * kSolveLd * 4 + int64_t(with_m ? 2 : 1) * kPrepTiles * 32 * 16;
  return rows > solve ? rows : solve;
}
constexpr int kPrepCtasWithM = 4;
constexpr int prep_ctas_per_sm(int K, bool with_m) {
  const int by_smem = int(228 * 1024 / (prep_smem_bytes(K, with_m) + 3 * 1024));
  return with_m && K == 128 && by_smem > kPrepCtasWithM ? kPrepCtasWithM : by_smem;
}

// Kernels of one call: bit 0 the chunk prep, bit 1 the state pass (both: the op; one alone: timing).
constexpr int kStagePrep = 1, kStageStatePass = 2, kStagesAll = 3;

struct PrefillChoice {
  int short_len = 0;          // sequences of at most short_len tokens take the short-sequence path (0: none)
  bool only_short = false;    // the host copy of cu_seqlens shows only such sequences: nothing else runs
  int vtile = kVTileHead;     // the state pass's value tile
  int head_split = 1;         // head pass CTAs per (sequence, value head)
  bool wgmma_pass = false;    // the head pass's wgmma build (TMA loads)
  bool m_warpgroup = false;   // a third warpgroup forms M and the factor rows beside two state warpgroups
  bool m_in_pass = false;     // the chunk prep leaves M to the state pass (its state or third warpgroup)
  // ... that third warpgroup forms the chunk prep but M (k k^T, A, T', the factors; the state warpgroups form M) in
  // each stage: the gates alone run before the pass (gate_prep_kernel), no chunk prep kernel
  bool fused_prep = false;
  bool early_state_pass = false;  // the state pass launches with PDL behind the chunk prep
  // ... and waits for each chunk's flag (the chunk prep counts its q/k heads) instead of the prep's grid: the head
  // pass's builds with a producer (the prep warpgroup's, or the producer warp's), whole sequences
  bool chunk_flags = false;
  // The prep warpgroup's build as persistent CTAs, one per SM, each taking (sequence, value head) items from a counter
  // in turn, the producer loading the next item's state and chunks while the current one runs (whole sequences)
  bool persistent_pass = false;
  int pass_ctas = 0;  // ... its grid: one CTA per SM (the override: fewer), at most one per item
  // The head pass (persistent, or one CTA per item in more than one wave) takes the sequences longest first (by
  // length class, item_order.h) where their lengths may differ in class
  bool longest_first = false;
  int stages = kStagesAll;
  // > 0: the context-parallel path (context_parallel.cuh) with sequences cut into segments of this many tokens
  int64_t cp_segment_len = 0;
  // ... where each cut sequence's first segment runs its final pass (o, checkpoints) in the local pass's grid, beside
  // the other segments' local states and transitions, instead of after the scan (choose_cp_first_final)
  bool cp_first_final = false;
  int cp_scan_cols = 8;  // value columns per CTA of its scan (cp_scan_cols)
  // chunk prep CTAs per (chunk slot, q/k head), each a share of the GVA group's value heads (choose_prep_parts)
  int prep_parts = 1;
};

// One entry of the context-parallel path's segment table (built on the device from cu_seqlens): tokens
// [start, start + len) of sequence seq, its segment index of count, starting at the sequence's chunk first_chunk;
// state: the segment's index in the per-segment state buffers (segments of cut sequences only, else -1).
// seq < 0: an unused entry.
struct CpSegment {
  int64_t start, len;
  int32_t seq, index, count, first_chunk, state;
};

// Context parallelism (docs/design/prefill.md "Context parallelism"): the shortest segment the heuristic picks for
// prompts of many segments, the shorter one for a prompt of a few thousand tokens at few heads (the workspace reserves
// states for those), and the most (segment, value head) pairs a call holds per-segment states for (the bound).
constexpr int64_t kCpMinSegment = 1024;
constexpr int64_t kCpShortSegment = 768;
constexpr int64_t kCpMaxSegmentHeads = 512;
// The path is built for this call: the head pass's wgmma build with K = V in {64, 128}.
bool cp_supported(const PrefillParams& p);
// Entries of the segment table for segments of seg_len tokens: every sequence takes max(1, ceil(len / seg_len)),
// at most N + T / seg_len in all.
int64_t cp_max_segments(const PrefillParams& p, int64_t seg_len);
// Segments of cut sequences (those that hold per-segment states): a sequence of len > seg_len tokens takes
// ceil(len / seg_len) <= 2 floor(len / seg_len), so at most 2 floor(T / seg_len) in all, whatever the batch's
// short sequences (at least 1: the buffers' size).
int64_t cp_max_states(const PrefillParams& p, int64_t seg_len);
// Cut sequences, each of at least two of those states: the scan's grid.
constexpr int64_t cp_max_cuts(int64_t states) { return states / 2 > 0 ? states / 2 : 1; }
// The segment length (0: the path does not run). Auto, with 8 or more segments a wave (few value heads): about one CTA
// per SM for the batch's segments and heads, where the longest sequence gets at least eight segments, or six where both
// passes then fit one wave, and kCpShortSegment for a prompt of 6 to 9 of those beside sequences of at most one, both
// passes in one wave (measured at 8 value heads); with 4 to 7 (from 16384 tokens): the longest prompt in one wave of
// segments (one more with its first segment's final pass beside the local pass, where every other sequence still fits
// one of those), every other sequence within one segment. An override forces it.
int64_t choose_cp_segment_len(const PrefillParams& p, int num_sms, const Overrides& o);
// Whether a cut sequence's first segment runs its final pass beside the local pass (seg_len > 0): where 4 to 7
// segments make a wave and the local pass would otherwise take a second wave, which that segment's final pass fills.
bool choose_cp_first_final(const PrefillParams& p, int num_sms, int64_t seg_len, const Overrides& o);
// Value columns per CTA of the context-parallel scan: 32 where the value heads alone give about half the SMs CTAs of
// 32 columns (fewer CTAs, each reading its P once for more columns), else 8.
int cp_scan_cols(const PrefillParams& p, int num_sms, const Overrides& o);
// The path's workspace for a table of `segments` entries and `states` states, each part 256-byte aligned: the table,
// the entry of each state and of each cut sequence's first segment (int32; `cuts` of them, by default
// cp_max_cuts(states)), then three regions of fp32 states (one per cut segment and value head). Byte offsets from
// the region's start.
struct CpLayout {
  size_t state_entry, cut_first, states, state_bytes, total;
};
CpLayout cp_layout(const PrefillParams& p, int64_t segments, int64_t states, int64_t cuts = -1);
// Workspace bytes of the path, sized for the shortest segments any choice makes, so that a buffer sized for a call
// serves every smaller one.
size_t cp_workspace_bytes(const PrefillParams& p, const Overrides& o);

// A prefill split over ranks (split_prefill_begin / _end) runs on the context-parallel passes: built for the calls
// they take, without their bound on tokens (a rank may hold none of them).
bool split_supported(const PrefillParams& p);
// Segments of a split call's pieces: about one CTA per SM for the rank's tokens and heads (an override forces the
// length; 0 there: each piece in one segment). Every piece holds per-segment states, so the workspace holds
// cp_max_segments of them.
int64_t split_segment_len(const PrefillParams& p, int num_sms, const Overrides& o);
// The choice for a split call (context-parallel passes, no short path; the scan 32 columns a CTA beside a V-last
// float8_e4m3 pool); throws kNotImplemented where split_supported is false.
PrefillChoice choose_split(const PrefillParams& p, int num_sms, const Overrides& o);
// Workspace bytes of a split call: the chunk prep's factors and the per-segment states of every piece.
size_t split_cp_workspace_bytes(const PrefillParams& p, int num_sms, const Overrides& o);

// Value tiles the state pass is built for, per head dim K (the head tiles also need head_pass_ok).
bool vtile_supported(int K, int vtile);
bool head_split_supported(int V, int split);
// The head pass can run this call: K <= 128, V in {64, 128}, q/k/v/o 16-bit of one dtype with 16-byte
// aligned rows (they are copied to shared memory as they are).
bool head_pass_ok(const PrefillParams& p);
// q, k and v allow 16-byte loads of 8 contiguous elements.
bool qkv_vectorized(const PrefillParams& p);
// The pool's head slices (and a float8_e4m3 pool's block scales) allow bulk copies (Plan::state_bulk): 16-byte
// aligned base and slot stride, and K-last, or V-last with a head on one CTA (head_split 1: its columns are whole rows).
bool state_bulk_copies(const PrefillParams& p, int head_split);
// The same for the checkpoint buffer (Plan::checkpoint_bulk).
bool checkpoint_bulk_copies(const PrefillParams& p, int head_split);
// The short-sequence path is built for this call: the head pass's conditions, K = V in {64, 128}, 16-byte
// aligned state slots, and a grid of N rows.
bool short_path_supported(const PrefillParams& p);
// The layout the passes lay the call's states out in: the pool's, or without a pool the checkpoints'
// (api/validate.cpp).
StateLayout states_layout(const PrefillParams& p);
// float8_e4m3 states the passes read and write in place: on the head pass (head_pass_ok) in either layout, or K-last on
// the tiled pass at K >= 128.
bool fp8_states_in_place(const PrefillParams& p);
// The call runs on K-last fp32 copies of its states (staged_states.cu): a float8_e4m3 pool or checkpoint buffer that
// fp8_states_in_place does not take (off the head pass: V-last, or K-last at K = 64).
bool states_staged(const PrefillParams& p);
// The call the passes run in its place: the pool N slots of K-last fp32 (slot n sequence n's), the checkpoints one
// entry every C tokens of the batch (sequence n's entry j at floor(cu_seqlens[n] / C) + j: T_total / C + 1 of them);
// the index and buffer pointers stay p's (staged_states.cu sets them).
PrefillParams staged_shape(const PrefillParams& p);
// The call the passes run: staged_shape(p) where states_staged(p), else p.
PrefillParams pass_params(const PrefillParams& p);
// The TMA maps of the wgmma build can be made: tokens, and coordinates below 2^31.
bool head_tensor_maps_ok(const PrefillParams& p);
// The wgmma build with `cols` value columns per CTA forms M itself (two warpgroups each form half of it
// beside their own products); with one warpgroup per CTA M stays in the workspace.
constexpr bool head_pass_forms_m(bool wgmma, int cols) { return wgmma && cols == 128; }
// ... and (without the prep warpgroup, which has a producer warpgroup) a producer warp issues the loads and o stores of
// its one state warpgroup: 64 columns per CTA, K = 128 (at K = 64 ptxas spills the chunk loop with it), whole sequences.
constexpr bool head_pass_load_warp(bool wgmma, bool m_warpgroup, int K, int cols, bool context_parallel) {
  return wgmma && !m_warpgroup && cols == 64 && K == 128 && !context_parallel;
}

// The longest sequence the short-sequence path takes by default, per layout, input and pool dtype.
int short_len_default(const PrefillParams& p);
// Whether the host's copy of cu_seqlens has the sequences the chunked kernels take (those longer than short_len) in
// non-increasing length class (item_order.h), every one in one class included; false without it.
bool longest_first_already(const PrefillParams& p, int short_len);
// Sequences of at most len tokens, by the host copy of cu_seqlens (which must be given).
int32_t count_short(const PrefillParams& p, int len);
int choose_short_len(const PrefillParams& p, const Overrides& o, int num_sms);
int choose_vtile(const PrefillParams& p, int num_sms);
int choose_head_split(const PrefillParams& p, int num_sms);
// Chunk prep CTAs per (chunk slot, q/k head): 1, or where one CTA per q/k head leaves the GPU's CTA slots mostly empty
// (few heads, short calls), the largest divisor of the GVA group HV / H that still fits the grid in one wave, each CTA
// taking that share of the group's value heads (its k k^T and q k^T formed by every share). with_m: the prep forms M.
int choose_prep_parts(const PrefillParams& p, int num_sms, bool with_m, const Overrides& o);

// The whole choice for a call; throws gdnkit::Error (kInvalidArgument) when the overrides force a tile or
// split the call cannot take.
PrefillChoice choose_prefill(const PrefillParams& p, int num_sms, const Overrides& o);

}  // namespace gdnkit::cuda::chunked_prefill
