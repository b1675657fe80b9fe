// CUDA chunked prefill (docs/semantics.md "prefill"; design: docs/design/prefill.md), two kernels per call:
//
//  1. chunk_prep_kernel (chunk_prep.cuh)  one CTA per (chunk slot, q/k head): everything that depends on one chunk
//     only. q, k rows, their norms, k k^T and q k^T once per q/k head, then per value head of its GVA group:
//       gates g, beta (fused or given), gcum = within-chunk cumulative sum of g,
//       A[i][j] = beta_i exp(gcum_i - gcum_j) (k^_i . k^_j) for j < i     (k^ = L2-normalized k)
//       T' = (I + A)^{-1} diag(beta)          (blocked: 8 x 8 substitutions, the rest on tensor cores, solve.cuh)
//       M[i][j] = mask_{j<=i} exp(gcum_i - gcum_j) q^_i . k^_j                (intra-chunk attention)
//     writes T', M (operand dtype; for the wgmma head pass as causal images, causal_image.cuh) and the per-token
//     factors (FactorRow, fp32) to the workspace. For the fused prep (Plan::fused_prep) gate_prep_kernel runs
//     instead: gcum and beta alone, the head pass's prep warpgroup forming the rest in each chunk's stage.
//  2. a state pass, sequential over the chunks of one sequence: state_pass_head_kernel
//     (state_pass_head.cuh: one CTA per sequence and value head, the fast path) or state_pass_kernel
//     (state_pass_tiled.cuh: one value tile S[:, v0:v0+VT] of one head per CTA: fp32 inputs, K or V = 256,
//     unaligned views). Per chunk, with D = diag(exp(gcum)):
//       X     = v - D k^ S                           (64 x VT)
//       v_new = T' X                                 (= u - w S of the WY form: u = T beta v,
//                                                      w = T beta D k^, folded so w is never stored)
//       o     = D q^ S + M v_new
//       S     = exp(g_last) S + k^T diag(exp(g_last - gcum)) v_new
//     S lives in registers (fp32 mma accumulators).
// All products run on tensor cores: mma.sync m16n8k16 (the head pass: wgmma m64nNk16 wherever a CTA owns
// whole warpgroups), Op operands (bf16 for bf16 inputs, fp16 for fp16/fp32 inputs), fp32 accumulation. The L2
// norms and the scale are per-token factors applied to mma results (rows of q/k stay raw in shared memory).
//
// This header holds the launchers for one head dim K (instantiated in prefill_k<K>.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "cuda/host/check.h"
#include "cuda/prefill/chunk_prep.cuh"
#include "cuda/prefill/plan.h"
#include "cuda/prefill/state_pass_head.cuh"
#include "cuda/prefill/state_pass_tiled.cuh"
#include "gdnkit/params.h"

namespace gdnkit::cuda::chunked_prefill {

template <int K, int VT, class Op>
void launch_state_pass(const PrefillParams& p, const Plan& plan, cudaStream_t stream) {
  const size_t smem = sizeof(StateSmem<K, VT, Op>);
  allow_dynamic_smem<state_pass_kernel<K, VT, Op>>(smem);
  const unsigned grid = unsigned(p.num_seqs) * unsigned(p.heads.num_v_heads) * unsigned(p.heads.head_dim_v / VT);
  state_pass_kernel<K, VT, Op><<<grid, kThreads, smem, stream>>>(p, plan);
  GDNKIT_CUDA_CHECK_LAUNCH();
}

// The chunk prep, with M (kM) or without (the head pass forms it: Plan::m_in_pass).
template <int K, class Op, bool kM>
void launch_chunk_prep(const PrefillParams& p, const Plan& plan, cudaStream_t stream) {
  // prep_parts CTAs per GVA group, slot-major
  const unsigned grid = unsigned(plan.num_slots) * unsigned(p.heads.num_qk_heads) * unsigned(plan.prep_parts);
  static_assert(sizeof(Op) == 2, "16-bit operands (prep_smem_bytes)");
  constexpr size_t smem = size_t(prep_smem_bytes(K, kM));
  const auto kernel = chunk_prep_kernel<K, Op, kM>;
  allow_dynamic_smem<chunk_prep_kernel<K, Op, kM>>(smem);
  kernel<<<grid, kThreads, smem, stream>>>(p, plan);
  GDNKIT_CUDA_CHECK_LAUNCH();
}

// The gates alone (Plan::fused_prep: the head pass's prep warpgroup forms the rest).
inline void launch_gate_prep(const PrefillParams& p, const Plan& plan, cudaStream_t stream) {
  constexpr int kWarps = kThreads / 32;
  const dim3 grid(unsigned(plan.num_slots), unsigned((p.heads.num_v_heads + kWarps - 1) / kWarps));
  gate_prep_kernel<kWarps><<<grid, kThreads, 0, stream>>>(p, plan);
  GDNKIT_CUDA_CHECK_LAUNCH();
}

template <int K, class Op>
void launch_op(const PrefillParams& p, const Plan& plan, int vtile, cudaStream_t stream, int stages) {
  const bool prep = (stages & kStagePrep) && plan.num_slots > 0 && p.total_tokens > 0;
  if (plan.cp_segment_len > 0) launch_cp_segment_table(p, plan, stream);
  // the chunk counts and the persistent pass's item counter (contiguous: prefill.cu carve_workspace), zeroed before
  // both kernels, so that the pass still launches right behind the prep
  if (plan.chunk_ready != nullptr || plan.pass_ticket != nullptr) {
    uint32_t* const first = plan.chunk_ready != nullptr ? plan.chunk_ready : plan.pass_ticket;
    const size_t words = plan.chunk_ready != nullptr ? size_t(plan.num_slots) + (plan.pass_ticket != nullptr) : 1;
    GDNKIT_CUDA_CHECK(cudaMemsetAsync(first, 0, words * sizeof(uint32_t), stream));
  }
  if (prep) {
    if (plan.fused_prep)
      launch_gate_prep(p, plan, stream);
    else if (plan.m_in_pass)
      launch_chunk_prep<K, Op, false>(p, plan, stream);
    else
      launch_chunk_prep<K, Op, true>(p, plan, stream);
  }
  if (!(stages & kStageStatePass)) return;
  if constexpr (K <= 128) {
    if (plan.cp_segment_len > 0)  // K = V in {64, 128} (cp_supported)
      return launch_cp_passes<K, Op>(p, plan, prep && plan.early_state_pass, stream);
    if (is_head_tile(vtile)) {
      const bool early = prep && plan.early_state_pass;  // PDL behind the chunk prep (heuristics.cpp)
      if (p.heads.head_dim_v == 64)
        launch_state_pass_head<K, 64, Op>(p, plan, early, stream);
      else
        launch_state_pass_head<K, 128, Op>(p, plan, early, stream);
      return;
    }
  }
  switch (vtile) {
    case 16:
      launch_state_pass<K, 16, Op>(p, plan, stream);
      break;
    case 32:
      launch_state_pass<K, 32, Op>(p, plan, stream);
      break;
    case 64:
      if constexpr (K <= 128) {
        launch_state_pass<K, 64, Op>(p, plan, stream);
        break;
      }
      [[fallthrough]];
    default:
      throw Error(ErrorCode::kInvalidArgument,
                  "prefill: value tile " + std::to_string(vtile) + " not built for K=" + std::to_string(K));
  }
}

// A split call's half (Plan::cp_split; K = V in {64, 128}): begin runs the segment table, the chunk prep, the local
// pass and the summaries; end the fold and the final pass, on the workspace begin filled.
template <int K, class Op>
void launch_split_op(const PrefillParams& p, const Plan& plan, bool begin, cudaStream_t stream) {
  const bool prep = begin && plan.num_slots > 0 && p.total_tokens > 0;
  if (begin) launch_cp_segment_table(p, plan, stream);
  if (prep) {
    if (plan.m_in_pass)
      launch_chunk_prep<K, Op, false>(p, plan, stream);
    else
      launch_chunk_prep<K, Op, true>(p, plan, stream);
  }
  launch_split_passes<K, Op>(p, plan, begin, prep && plan.early_state_pass, stream);
}
template <int K>
void launch_split(const PrefillParams& p, const Plan& plan, bool begin, cudaStream_t stream) {
  if (plan.fp16_operands)
    launch_split_op<K, __half>(p, plan, begin, stream);
  else
    launch_split_op<K, __nv_bfloat16>(p, plan, begin, stream);
}

// Operands are bf16 for bf16 inputs (exact) and fp16 for fp16 / fp32 inputs (exact for fp16, and
// 3 more mantissa bits than bf16 for fp32, which the fp32-output tolerance needs).
template <int K>
void launch(const PrefillParams& p, const Plan& plan, int vtile, cudaStream_t stream, int stages) {
  if (plan.fp16_operands)
    launch_op<K, __half>(p, plan, vtile, stream, stages);
  else
    launch_op<K, __nv_bfloat16>(p, plan, vtile, stream, stages);
}

}  // namespace gdnkit::cuda::chunked_prefill
