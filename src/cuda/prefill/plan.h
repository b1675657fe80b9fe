// Host <-> device contract of the CUDA chunked prefill: the derived sizes and workspace pointers the
// kernels read besides PrefillParams, and the per-head-dim launchers (one translation unit each).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "gdnkit/params.h"

namespace gdnkit::cuda {
// The short-sequence path of prefill: the sequences of at most max_len tokens on the recurrent kernels
// (WarpOp::kPrefill: one state read, one write, the tokens on the way), the others left to the chunked
// kernels. prefill_short (cuda/recurrent.cu) launches it; prefill_short_supported (cuda/prefill.cu): the
// call's dims (K = V <= 128), dtypes (16-bit q/k/v/o) and alignments (16-byte rows and slots) are ones it
// is built for.
bool prefill_short_supported(const PrefillParams& p);
void prefill_short(const PrefillParams& p, int max_len, Stream stream);
}  // namespace gdnkit::cuda

namespace gdnkit::cuda::chunked_prefill {

constexpr int kChunk = 64;     // tokens per chunk (the WY block)
// The head pass's prep warpgroup (Plan::aux_prep): none, M alone, or the whole chunk prep.
constexpr int kAuxNone = 0, kAuxM = 1, kAuxAll = 2;
constexpr int kThreads = 128;  // 4 warps per CTA in both kernels

// Workspace chunk slots. Chunk c of sequence n lives in slot floor(cu[n]/64) + n + c: unique for
// non-decreasing cu_seqlens (floor(cu[n]/64) + n is strictly increasing and a sequence with
// ceil(len/64) chunks never reaches the next sequence's first slot), and < T_total/64 + N + 1, so the
// host sizes it without reading cu_seqlens, and kernel 1 maps slot -> (n, c) by a binary search.
inline int64_t num_chunk_slots(const PrefillParams& p) { return p.total_tokens / kChunk + p.num_seqs + 1; }

// Per chunk and value head, the state passes scale rows of their products by these per-token factors,
// precomputed by the chunk prep (with gcum the within-chunk cumulative log decay, flat past the chunk's
// end, g_last = gcum[63], rk = 1/||k||, rq = scale/||q||; without the L2 norm rk = 1, rq = scale):
//   kEk: e^gcum rk     kEq: e^gcum rq     kDd: rk e^(g_last - gcum), 0 past the chunk     kEg: e^g_last
// and, only where the state pass forms M itself (Plan::m_in_pass), M's per-token terms:
//   kGc: gcum log2(e) (M's decay is exp2(kGc_i - kGc_j))     kRk: rk
// There the chunk prep does not read q at all: the state pass takes rq from the chunk's q rows it holds
// and scales o's rows by it, so kEq is e^gcum alone and M is formed without rq. Beside a prep warpgroup for M
// (Plan::aux_prep == kAuxM, m_in_pass set too) the chunk prep writes kGc and kRk alone (the block keeps its 6 rows),
// and the warpgroup forms kEk, kEq (with rq), kDd and kEg in the stage.
enum FactorRow { kEk = 0, kEq = 1, kDd = 2, kEg = 3, kGc = 4, kRk = 5 };
// Rows of a (chunk, head) block of factors: 6 where the state pass forms M (kMInPass), else 4.
template <bool kMInPass>
constexpr int kFactorRows = kMInPass ? 6 : 4;
constexpr int kFactorRowsMax = kFactorRows<true>;

struct Plan {
  int64_t num_slots = 0;
  // Per chunk and value head, 64 x 64 operand-dtype entries, row-major, or for the wgmma pass the causal image
  // (wgmma.cuh causal_image_offset: the first 6 KB of each 8 KB entry):
  void* ws_t = nullptr;        // [num_slots, HV, 64, 64]: T' = (I + A)^{-1} diag(beta)
  void* ws_m = nullptr;        // [num_slots, HV, 64, 64]: M, the masked decayed q k^T (unless m_in_pass)
  float* ws_f = nullptr;       // [num_slots, HV, kFactorRows<m_in_pass>, 64] fp32: the per-token factors of the chunk
  float scale = 0.0f;          // q scale (resolved default)
  bool qkv_vec = false;        // q, k, v allow 16-byte loads of 8 contiguous elements
  bool o_pair = false;         // o allows 2-element stores
  bool fp16_operands = false;  // tensor-core operands fp16 (fp16 / fp32 inputs) instead of bf16
  int32_t head_split = 1;      // head state pass: CTAs per (sequence, value head)
  // The state pass is the head pass's wgmma build (head_pass_wgmma).
  bool wgmma_pass = false;
  // ... with CTAs of two warpgroups (head_pass_forms_m), which form M from the chunk's q and k rows on the
  // tensor cores, and the q norms: the chunk prep then reads no q and writes no M (kGc, kRk instead).
  bool m_in_pass = false;
  // ... with a third warpgroup that prepares each chunk in its stage (prep_warpgroup.cuh; two state warpgroups, K a
  // multiple of 64; choose_aux_prep): kAuxM forms M there (the chunk prep kernel runs without M, as for m_in_pass,
  // which is then set), kAuxAll everything (no chunk prep kernel, no workspace).
  int32_t aux_prep = 0;
  bool state_pairs = false;     // K-last pool aligned to 2 elements (base, slot stride): paired state I/O
  bool checkpoint_pairs = false;  // the same for the checkpoint buffer
  int32_t num_sms = 132;
  // Sequences of at most short_len tokens (cuda/common/sequence.cuh) run on the short-sequence path
  // instead: both kernels skip them. 0: the chunked kernels run every sequence.
  int32_t short_len = 0;
};

// The TMA descriptors of a head pass launch of the wgmma build (a __grid_constant__ kernel parameter): k
// and q as [tokens, q/k heads, K], v as [tokens, value heads, V] (boxes of 64 tokens x 64 columns),
// 128-byte swizzled. T' and M come from the workspace by plain bulk copies (the prep's causal images).
struct HeadTensorMaps {
  CUtensorMap k, q, v;
};
// Whether the TMA maps can be made (tokens, and tokens below 2^31), and the maps.
bool head_tensor_maps_ok(const PrefillParams& p, const Plan& plan);
// Whether the state pass of value tile `vtile` runs the head pass's wgmma build: kVTileHead, a CTA owning
// whole warpgroups (V / head_split a multiple of 64) and the TMA maps possible (Plan::wgmma_pass).
bool head_pass_wgmma(const PrefillParams& p, const Plan& plan, int vtile);
// Whether the wgmma build with `cols` value columns per CTA forms M itself (else the chunk prep writes it
// to the workspace): with two warpgroups per CTA, each forms half of it beside its own products. Measured
// (H100, qwen3-next): the pass moves 8 of its 65 KB per chunk less, 8x8192 1.47 -> 1.35 ms, 8x1024 0.228 ->
// 0.208; but the mask, scaling and barrier lengthen each chunk's chain, so where the chain is the limit
// (one warpgroup per CTA, the column split for few sequences) M stays in the workspace (1x32768 1.06 ->
// 1.24 ms when formed there).
constexpr bool head_pass_forms_m(bool wgmma, int cols) { return wgmma && cols == 128; }
HeadTensorMaps make_head_tensor_maps(const PrefillParams& p, const Plan& plan);

// The state pass of a call: the value tile (0: choose_vtile) returned, and in the plan the chunk slots, the
// head split (0: choose_head_split), wgmma_pass, aux_prep (`aux`: choose_aux_prep) and m_in_pass.
int plan_state_pass(const PrefillParams& p, Plan& plan, int num_sms, int vtile, int head_split, int aux = -1);
// Whether the head pass can have a prep warpgroup (Plan::aux_prep): its wgmma build with two state warpgroups
// (head split 1, V = 128) and K a multiple of 64.
bool aux_prep_possible(const PrefillParams& p, const Plan& plan);
// Where possible, `aux` (kAuxNone, kAuxM, kAuxAll) is taken; -1: GDNKIT_PREFILL_AUX (0, 1, 2; read once per
// process, for A/B timing), else the measured default (kAuxM from a mean of 4 chunks per sequence).
int choose_aux_prep(const PrefillParams& p, const Plan& plan, int aux);
// Workspace bytes for T', M and the token factors (each 256-byte aligned; prefill_workspace_bytes): M's
// region also where the pass forms M, so that the size grows with total_tokens and num_seqs alone.
size_t workspace_bytes(const PrefillParams& p);
// The plan's workspace pointers (ws_t, ws_m: null where the pass forms M, ws_f) in `base` (plan_state_pass
// first).
void carve_workspace(const PrefillParams& p, void* base, Plan& plan);

// The value "tiles" of the head state pass (state_pass_head_kernel): one CTA per (sequence, value
// head) over all V columns. kVTileHead builds its products on warpgroup wgmma where the CTA owns a
// multiple of 64 value columns (else as kVTileHeadWarp), kVTileHeadWarp on warp mma.sync. The positive
// tiles (16, 32, 64) run state_pass_kernel.
constexpr int kVTileHead = -1, kVTileHeadWarp = -2;
inline bool is_head_tile(int vtile) { return vtile == kVTileHead || vtile == kVTileHeadWarp; }

// Value tiles the state pass is built for, per head dim K (the head tiles also need head_pass_ok).
bool vtile_supported(int K, int vtile);
// Whether the head state pass can run this call: K <= 128, V in {64, 128}, q/k/v/o 16-bit of one
// dtype with 16-byte aligned rows (they are copied to shared memory as they are).
bool head_pass_ok(const PrefillParams& p);
// Kernels of one call: bit 0 the chunk prep, bit 1 the state pass (both: the op; one alone: timing).
constexpr int kStagePrep = 1, kStageStatePass = 2, kStagesAll = 3;
// Launch the kernels for head dim K with value tile `vtile` (defined in prefill_k<K>.cu).
template <int K>
void launch(const PrefillParams& p, const Plan& plan, int vtile, cudaStream_t stream, int stages);

// Test/tuning entry: prefill with an explicit value tile (0: the heuristic) and, for the head state
// pass, an explicit column split (1, or 2 with V / 2 >= 32; 0: the heuristic); same semantics
// as cuda::prefill when stages == kStagesAll. Used by the GPU tests and timing to compare tilings.
// short_len: the longest sequence the short-sequence path takes (0: none; < 0: choose_short_len).
void prefill_with_vtile(const PrefillParams& p, cudaStream_t stream, int vtile, int stages = kStagesAll,
                        int head_split = 0, int short_len = -1, int aux = -1);

// The library's choice of max_len for a call (0: the chunked kernels take every sequence):
// GDNKIT_PREFILL_SHORT=<n> overrides the measured default (0 turns the path off). With a host copy of
// cu_seqlens, 0 when no sequence is short; without one, 0 unless the mean length is at most max_len.
int choose_short_len(const PrefillParams& p);
int choose_vtile(const PrefillParams& p, int num_sms);
// The head pass's CTAs per (sequence, value head): 2 when that still gives at most one CTA per SM (a
// sequential chain per CTA gains nothing from sharing an SM), else 1.
int choose_head_split(const PrefillParams& p, int num_sms);
bool head_split_supported(int V, int split);

}  // namespace gdnkit::cuda::chunked_prefill
