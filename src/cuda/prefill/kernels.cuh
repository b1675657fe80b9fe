// CUDA chunked prefill (docs/semantics.md "prefill"), two kernels per call (one where the state pass's prep warpgroup forms
// everything, kAuxAll, prep_warpgroup.cuh):
//
//  1. chunk_prep_kernel  one CTA per (chunk slot, q/k head): everything that depends on one chunk only.
//     q, k rows, their norms, k k^T and q k^T once per q/k head, then per value head of its GVA group:
//       gates g, beta (fused or given), gcum = within-chunk cumulative sum of g,
//       A[i][j] = beta_i exp(gcum_i - gcum_j) (k^_i . k^_j) for j < i     (k^ = L2-normalized k)
//       T' = (I + A)^{-1} diag(beta)          (blocked: 8 x 8 substitutions, the rest on tensor cores, solve.cuh)
//       M[i][j] = mask_{j<=i} exp(gcum_i - gcum_j) q^_i . k^_j                (intra-chunk attention)
//     writes T', M (operand dtype; for the wgmma head pass as causal images, wgmma.cuh) and the per-token
//     factors (FactorRow, fp32) to the workspace.
//  2. a state pass, sequential over the chunks of one sequence: state_pass_head_kernel
//     (state_pass_head.cuh: one CTA per sequence and value head, the fast path) or state_pass_kernel
//     below (one value tile S[:, v0:v0+VT] of one head per CTA: fp32 inputs, K or V = 256, unaligned views).
//     Per chunk, with D = diag(exp(gcum)):
//       X     = v - D k^ S                           (64 x VT)
//       v_new = T' X                                 (= u - w S of the WY form: u = T beta v,
//                                                      w = T beta D k^, folded so w is never stored)
//       o     = D q^ S + M v_new
//       S     = exp(g_last) S + k^T diag(exp(g_last - gcum)) v_new
//     S lives in registers (fp32 mma accumulators).
// All products run on tensor cores: mma.sync m16n8k16 (the head pass: wgmma m64nNk16 wherever a CTA owns
// whole warpgroups), Op operands (bf16 for bf16 inputs, fp16 for fp16/fp32 inputs), fp32 accumulation. The L2 norms and the scale are per-token factors applied to
// mma results (rows of q/k stay raw in shared memory). Design and measurements: docs/prefill-design.md.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <string>

#include "cuda/host/check.h"
#include "cuda/prefill/io.cuh"
#include "cuda/prefill/mma.cuh"
#include "cuda/prefill/plan.h"
#include "cuda/prefill/solve.cuh"
#include "cuda/prefill/state_pass_head.cuh"
#include "gdnkit/params.h"

namespace gdnkit::cuda::chunked_prefill {

// ---------------------------------------------------------------------------------------------
// Kernel 1: per (chunk, q/k head) WY preparation of the HV/H value heads of its GVA group.
// ---------------------------------------------------------------------------------------------
// The k k^T and q k^T accumulators a thread keeps for all value heads of the group: warp w holds
// the 2(w+1) n8-tiles of its rows' lower blocks, 20 tiles of 32 float4 (one per lane) per product.
constexpr int kPrepTiles = 20;
__device__ __forceinline__ int prep_tile(int warp, int nt, int lane) { return (warp * (warp + 1) + nt) * 32 + lane; }

// Dynamic shared memory of kernel 1: raw k and q rows; once they are consumed, their bytes hold the
// fp32 solve (A, then T in place) and the accumulators of both products (of k k^T alone without kM).
template <int K, class Op, bool kM>
constexpr size_t prep_smem_bytes() {
  constexpr size_t rows = size_t(kM ? 2 : 1) * kChunk * (K + 8) * sizeof(Op);           // k (and q) rows
  constexpr size_t solve = size_t(kChunk) * kSolveLd * 4;                               // A / T
  constexpr size_t stash = size_t(kM ? 2 : 1) * kPrepTiles * 32 * sizeof(float4);      // k k^T, q k^T
  return rows > solve + stash ? rows : solve + stash;
}

// The CTAs per SM that this shared memory allows on sm_90 (228 KB per SM, 1 KB reserved per CTA, 2 KB for the static
// arrays: 1.8 KB with M, 1.5 KB without), asked of ptxas as the register budget: left to itself it settled for 96
// registers at K=128 but spilled to get there.
template <int K, class Op, bool kM>
constexpr int prep_ctas_per_sm() {
  return int(size_t(228) * 1024 / (prep_smem_bytes<K, Op, kM>() + 3 * 1024));
}

// One CTA per (chunk slot, q/k head hk): q and k rows, their norms, G = k k^T and q k^T (kM) are computed
// once; the gates, gcum, M, A, the solve and the workspace writes then run per value head
// h = hk * HV/H + j of the GVA group (the same operations as one CTA per value head would run).
// Without kM (the wgmma head pass forms M from the chunk's rows and takes the q norms there, in its state warpgroups
// or in its prep warpgroup) q is not read, q k^T and M are skipped, kDecayRq is e^gcum alone, and M's per-token terms
// (kLog2Gcum, kInvNormK) are written with the other factors, or alone beside a prep warpgroup (Plan::m_warpgroup), which
// forms the others.
template <int K, class Op, bool kM>
__global__ void __launch_bounds__(kThreads, prep_ctas_per_sm<K, Op, kM>())
    chunk_prep_kernel(const PrefillParams p, const Plan plan) {
  constexpr int LDK = K + 8;  // +16 bytes per row: ldmatrix rows hit distinct banks
  constexpr int LDA = kSolveLd;  // fp32 A rows (solve.cuh)
  extern __shared__ __align__(16) unsigned char smem[];
  // gcum and beta per value head, double-buffered by head parity: warp 0 writes the next head's
  // while the other warps still store this head's T' and gcum.
  __shared__ __align__(16) float s_gc[2][kChunk];
  __shared__ __align__(16) float s_beta[2][kChunk];
  __shared__ __align__(16) float s_rk[kChunk];
  __shared__ __align__(16) float s_rq[kM ? kChunk : 1];
  // Fused gating: A_log and dt_bias of the group's first kHeadParams value heads (the rest read at use; the models
  // of docs/benchmarks.md have 2-4 value heads per q/k head).
  constexpr int kHeadParams = 32;
  __shared__ float s_head[2][kHeadParams];
  Op* Ks = reinterpret_cast<Op*>(smem);  // [64][LDK] raw k rows
  Op* Qs = Ks + kChunk * LDK;            // [64][LDK] raw q rows (kM only)
  // After Ks, Qs are consumed:
  float* Af = reinterpret_cast<float*>(smem);              // [64][LDA] A, lower blocks
  float4* Gacc = reinterpret_cast<float4*>(Af + kChunk * LDA);  // k k^T accumulators (prep_tile)
  float4* Macc = Gacc + kPrepTiles * 32;                   // q k^T accumulators

  // The head state pass may launch once every CTA of this grid has started (it waits for the grid's end
  // before reading the workspace): its first CTAs then take the SMs the last wave frees.
  asm volatile("griddepcontrol.launch_dependents;");
  const int slot = blockIdx.x, hk = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int HV = p.heads.num_v_heads, group = HV / p.heads.num_qk_heads;
  const int h0 = hk * group, h1 = h0 + group;  // the value heads of the group
  // T' and M for the wgmma head pass as causal images (wgmma.cuh; always so without kM), else row-major 64 x 64
  const bool image = !kM || plan.wgmma_pass;

  // slot -> (sequence n, chunk c): n = the last sequence with floor(cu[n]/64) + n <= slot.
  int lo = 0, hi = p.num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (load_cu(p, mid) / kChunk + mid <= slot)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int n = lo;
  const int64_t start = load_cu(p, n), end = load_cu(p, n + 1);
  if (start < 0 || end < start || end > p.total_tokens) return;  // bad sequence: kernel 2 counts it
  if (short_prefill_sequence(start, end, p.total_tokens, plan.short_len)) return;  // the short path's
  const int64_t c = slot - (start / kChunk + n);
  if (c < 0 || c * kChunk >= end - start) return;  // a slot no chunk maps to
  const int64_t t0 = start + c * kChunk;
  const int L = int(min(int64_t(kChunk), end - t0));

  GateLoads gates;  // warp 0: the next value head's gate inputs
  if (warp == 0) gates = load_gates(p, h0, t0, L, lane);
  const bool fused = p.gating.mode == GateMode::kFused;  // A_log and dt_bias are then present (validate.cpp)
  if (fused && tid < group && tid < kHeadParams) {
    s_head[0][tid] = p.gating.A_log[h0 + tid];
    s_head[1][tid] = p.gating.dt_bias[h0 + tid];
  }
  // Value head h's (A_log, dt_bias); zeros for given gates, which do not use them.
  const auto head_params = [&](int h) {
    if (!fused) return make_float2(0.0f, 0.0f);
    if (h - h0 < kHeadParams) return make_float2(s_head[0][h - h0], s_head[1][h - h0]);
    return make_float2(p.gating.A_log[h], p.gating.dt_bias[h]);
  };
  // k's norms come from G's diagonal below (G_ii = |k_i|^2 of the operand rows), not from a pass over the rows.
  load_rows_with_norm<K, Op, false>(Ks, nullptr, p.k, hk, t0, L, false, 1.0f, plan.qkv_vec);
  // q's rows and norms serve only M (kM).
  if constexpr (kM)
    load_rows_with_norm<K, Op>(Qs, s_rq, p.q, hk, t0, L, p.heads.use_qk_l2norm, plan.scale, plan.qkv_vec);
  __syncthreads();

  // G = k k^T and Mq = q k^T, lower 16x16 blocks only: warp w owns rows 16w..16w+15, columns
  // 0..16w+15 (the two products share the k fragments). Every value head of the group reuses them:
  // each thread parks its own accumulators in shared memory (no barrier needed to read them back),
  // as 64 more live registers through the solve took the kernel from 90 to 168 registers.
  {
    float acc[8][4], accm[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][e] = accm[i][e] = 0.0f;
    // Built once per warp index (a compile-time W): the warp's block count is then a constant, so ptxas can issue
    // the next fragments' loads ahead of the products instead of behind a per-block branch; then k's norms.
    const auto products = [&](auto wc) {
      constexpr int W = decltype(wc)::value;
#pragma unroll 1
      for (int kk = 0; kk < K; kk += 16) {
        uint32_t a[4], aq[4];
        ldmatrix_x4(a, a_frag_ptr<LDK>(Ks, W * 16, kk, lane));
        if constexpr (kM) ldmatrix_x4(aq, a_frag_ptr<LDK>(Qs, W * 16, kk, lane));
#pragma unroll
        for (int np = 0; np <= W; ++np) {
          uint32_t b[4];
          ldmatrix_x4(b, bn_frag_ptr<LDK>(Ks, np * 16, kk, lane));
          mma<Op>(acc[2 * np], a, b[0], b[1]);
          mma<Op>(acc[2 * np + 1], a, b[2], b[3]);
          if constexpr (kM) {
            mma<Op>(accm[2 * np], aq, b[0], b[1]);
            mma<Op>(accm[2 * np + 1], aq, b[2], b[3]);
          }
        }
      }
      // rk_i = 1 / |k_i| from G_ii (fp32 sums of the exact products of the operand rows: what a pass over the
      // rows would sum, in another order). Row 16 W + d of the warp's diagonal block sits in tile 2 W + d / 8,
      // element 2 (d / 8) + d % 2 of the lane with r = d % 8 and (lane & 3) = r / 2: lanes 0, 4, 9, 13, 18, 22,
      // 27, 31 hold two each (rows r and r + 8). Rows past L are zero: rk = 1 / sqrt(eps) there.
      const int r = lane >> 2;
      if ((lane >> 3) == (lane & 3)) {
        const bool norm = p.heads.use_qk_l2norm;
        const float d0 = r & 1 ? acc[2 * W][1] : acc[2 * W][0], d1 = r & 1 ? acc[2 * W + 1][3] : acc[2 * W + 1][2];
        s_rk[W * 16 + r] = norm ? rsqrtf(d0 + 1e-6f) : 1.0f;
        s_rk[W * 16 + r + 8] = norm ? rsqrtf(d1 + 1e-6f) : 1.0f;
      }
    };
    switch (warp) {
      case 0: products(std::integral_constant<int, 0>{}); break;
      case 1: products(std::integral_constant<int, 1>{}); break;
      case 2: products(std::integral_constant<int, 2>{}); break;
      default: products(std::integral_constant<int, 3>{}); break;
    }
    // Warp 0, whose rows have the fewest products, turns the first head's gate loads into gcum and beta
    // here rather than before the barrier above (the other warps waited for it there; nothing reads them
    // before the M / A pass).
    if (warp == 0) store_gates(p, gates, head_params(h0), L, lane, s_gc[h0 & 1], s_beta[h0 & 1]);
    __syncthreads();  // Ks (and Qs) are dead from here on: the accumulators, A and T reuse their bytes
    // The accumulators parked with rk_j already applied (column j's factor, the same for every value head).
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      if (nt < 2 * (warp + 1)) {
        const float2 kj = *reinterpret_cast<const float2*>(&s_rk[nt * 8 + (lane & 3) * 2]);
        Gacc[prep_tile(warp, nt, lane)] =
            make_float4(acc[nt][0] * kj.x, acc[nt][1] * kj.y, acc[nt][2] * kj.x, acc[nt][3] * kj.y);
        if constexpr (kM)
          Macc[prep_tile(warp, nt, lane)] =
              make_float4(accm[nt][0] * kj.x, accm[nt][1] * kj.y, accm[nt][2] * kj.x, accm[nt][3] * kj.y);
      }
    }
    // T's blocks above the diagonal are zero and stay so (nothing below writes them), so that T' is stored
    // without a column mask: warp w zeroes the 3 - w blocks right of its diagonal block.
#pragma unroll
    for (int jb = 1; jb < 4; ++jb) {
      if (jb > warp) {
        float* blk = Af + warp * 16 * LDA + jb * 16;
#pragma unroll
        for (int x = 0; x < 2; ++x) {
          const int e = lane + 32 * x;  // 64 float4 per 16 x 16 block
          *reinterpret_cast<float4*>(blk + (e >> 2) * LDA + (e & 3) * 4) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
      }
    }
  }

  for (int h = h0; h < h1; ++h) {
    const float* gc = s_gc[h & 1];  // final: stored before the last barrier
    const float* beta = s_beta[h & 1];
    if (warp == 0 && h + 1 < h1) gates = load_gates(p, h + 1, t0, L, lane);  // stored after this head's solve

    // M[i][j] = mask_{j<=i} exp(gcum_i - gcum_j) rq_i rk_j (q_i . k_j), the intra-chunk attention of
    // the output (rq includes the scale); upper blocks are written as 0.
    // A[i][j] = beta_i rk_i rk_j exp(gcum_i - gcum_j) G[i][j] for j < i (strictly lower), else 0.
    // rk_j is in the parked accumulators. Without M, A's row factor beta_i rk_i rides in the exponent
    // (log2, -inf for beta_i = 0): one ex2 and one multiply per element; with M, both share exp(gcum_i - gcum_j)
    // (its argument is <= 0 wherever it is used).
    const int64_t ws = int64_t(slot) * HV + h;
    {
      constexpr float kLog2e = 1.4426950408889634f;
      const int r = lane >> 2, q2 = (lane & 3) * 2;
      [[maybe_unused]] Op* mout = nullptr;  // M's rows in the workspace (kM; no M region otherwise)
      if constexpr (kM) mout = static_cast<Op*>(plan.ws_masked_qk) + ws * (kChunk * kChunk);
      float gi[2], fq[2], fa[2];  // per row i = 16 warp + r + 8 half
      // M's causal image (image): element (i, 8 nt + q2) at m_rows.at[half] + ((nt ^ m_rows.swz) << 3)
      [[maybe_unused]] const ImageRows m_rows = kM ? image_rows(warp, lane) : ImageRows{};
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = warp * 16 + r + half * 8;
        gi[half] = gc[i] * kLog2e;
        fa[half] = beta[i] * s_rk[i];
        // beta in [0, 1] (docs/semantics.md): beta_i = 0 gives -inf, and A's row 0. (As the exponents <= 0 below, this takes
        // in-spec gates: a negative given beta would make the row NaN here, where the path with M would not.)
        if constexpr (kM)
          fq[half] = s_rq[i];
        else
          gi[half] += __log2f(fa[half]);
      }
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int j = nt * 8 + q2;
        float m[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (nt < 2 * (warp + 1)) {
          const float4 m4 = kM ? Macc[prep_tile(warp, nt, lane)] : float4{}, g4 = Gacc[prep_tile(warp, nt, lane)];
          const float macc[4] = {m4.x, m4.y, m4.z, m4.w}, gacc[4] = {g4.x, g4.y, g4.z, g4.w};
          const float2 gj = *reinterpret_cast<const float2*>(&gc[j]);
          // The tiles left of the warp's diagonal block (nt < 2 warp) lie wholly below the diagonal: no mask. The
          // two of the diagonal block select their elements (j <= i for M, j < i for A) rather than branch per
          // element; above the diagonal the exponent may be positive (inf), which the select drops.
          const bool diag = nt >= 2 * warp;
          float a[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int i = warp * 16 + r + (e >> 1) * 8, jj = j + (e & 1);
            const float d = exp2_approx(gi[e >> 1] - (e & 1 ? gj.y : gj.x) * kLog2e);
            if constexpr (kM) {
              m[e] = diag && jj > i ? 0.0f : macc[e] * fq[e >> 1] * d;
              a[e] = diag && jj >= i ? 0.0f : gacc[e] * fa[e >> 1] * d;
            } else {
              a[e] = diag && jj >= i ? 0.0f : gacc[e] * d;
            }
          }
          const int i0 = warp * 16 + r;
          *reinterpret_cast<float2*>(&Af[i0 * LDA + j]) = make_float2(a[0], a[1]);
          *reinterpret_cast<float2*>(&Af[(i0 + 8) * LDA + j]) = make_float2(a[2], a[3]);
        }
        if constexpr (kM) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const uint32_t pair = pack2<Op>(m[2 * half], m[2 * half + 1]);
            if (!image)
              *reinterpret_cast<uint32_t*>(mout + (warp * 16 + r + half * 8) * kChunk + j) = pair;
            else if (warp >= 2 || nt < 4)  // the image has no upper-right quarter
              *reinterpret_cast<uint32_t*>(mout + m_rows.at[half] + ((nt ^ m_rows.swz) << 3)) = pair;
          }
        }
      }
    }
    __syncthreads();

    // T = (I + A)^{-1} and T' = T diag(beta) to the workspace (solve.cuh)
    invert_and_store_t<Op, 0>(Af, beta, L, static_cast<Op*>(plan.ws_tprime) + ws * (kChunk * kChunk), image, warp, lane,
                              [] { __syncthreads(); });
    // The state pass reuses gcum and the norms (rq includes the scale), per value head.
    // (Beside a prep warpgroup forming M, kLog2Gcum and kInvNormK alone: it forms the others from them.)
    if (tid < kChunk)
      store_token_factors<kM>(plan.ws_factors + ws * (kFactorRows<!kM> * kChunk), gc, s_rk, s_rq, L, tid,
                              plan.m_warpgroup);
    if (warp == 0 && h + 1 < h1)
      store_gates(p, gates, head_params(h + 1), L, lane, s_gc[(h + 1) & 1], s_beta[(h + 1) & 1]);
    __syncthreads();  // the next head's gcum and beta are final; T is read, the next A may replace it
  }
}

// ---------------------------------------------------------------------------------------------
// Kernel 2: per (sequence, value head, value tile) sequential state pass.
// ---------------------------------------------------------------------------------------------
template <int K, int VT, class Op>
struct StateSmem {
  static constexpr int LDK = K + 8, LDV = VT + 8, LDT = kChunk + 8;
  Op ks[kChunk * LDK];  // raw k rows of the chunk
  Op qs[kChunk * LDK];  // raw q rows
  Op sb[K * LDV];       // S (Op copy), [k][v]
  Op ts[kChunk * LDT];  // T' of the chunk
  Op ms[kChunk * LDT];  // M of the chunk (masked decayed q k^T)
  Op vs[kChunk * LDV];  // v, then X in place
  Op vn[kChunk * LDV];  // v_new
  Op vd[kChunk * LDV];  // v_new_j rk_j exp(g_last - gcum_j): the state-update operand
  float ek[kChunk], eq[kChunk], dd[kChunk], eg;  // token factors (FactorRow)
};

// One thread's share of a chunk's inputs (uint4 = 8 operands): q and k rows, the v tile, T', M,
// and the per-token scalars.
template <int K, int VT>
struct ChunkRegs {
  static constexpr int kRow = kChunk * K / 8 / kThreads;     // per q (and per k)
  static constexpr int kV = kChunk * VT / 8 / kThreads;      // v tile
  static constexpr int kT = kChunk * kChunk / 8 / kThreads;  // T' (and M)
  uint4 k[kRow], q[kRow], v[kV], t[kT], m[kT];
  float ek = 0.0f, eq = 0.0f, dd = 0.0f, eg = 0.0f;  // token factors (FactorRow)
};

// kPrefetch: the loads of chunk c+1 are issued right after chunk c reached shared memory, so their
// latency hides behind chunk c's math (costs ~100 registers: only for the narrow value tile).
template <int K, int VT, class Op>
__global__ void __launch_bounds__(kThreads) state_pass_kernel(const PrefillParams p, const Plan plan) {
  constexpr bool kPrefetch = VT == 16 && K <= 128;
  using Smem = StateSmem<K, VT, Op>;
  constexpr int LDK = Smem::LDK, LDV = Smem::LDV, LDT = Smem::LDT;
  constexpr int MT = K / 64;  // m16 tiles of S rows per warp (warp w owns rows w*K/4 .. +K/4)
  constexpr int NT = VT / 8;  // n8 tiles of S columns
  static_assert(NT % 2 == 0, "value tiles are whole 16-column ldmatrix blocks");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);

  // Flat grid, value tile fastest, then head: the CTAs that share a chunk's q/k rows (the value tiles
  // of one head, the heads of one GVA group) run together and find them in L2.
  const int HV = p.heads.num_v_heads, V = p.heads.head_dim_v, tiles = V / VT;
  const int vt = int(blockIdx.x % unsigned(tiles)), h = int(blockIdx.x / unsigned(tiles) % unsigned(HV));
  const int n = int(blockIdx.x / unsigned(tiles * HV)), v0 = vt * VT;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int r = lane >> 2, q2 = (lane & 3) * 2;
  const int hk = h / (HV / p.heads.num_qk_heads);
  SeqSlots sq;
  if (!begin_sequence<kThreads>(p, plan, n, h, v0, VT, h == 0 && vt == 0, sq)) return;
  const int64_t start = sq.start, len = sq.len;
  const int islot = sq.islot, fslot = sq.fslot, cslot = sq.cslot;

  // S tile in registers: element (k, v) of fragment [mt][nt][e] is
  //   k = warp*K/4 + mt*16 + r + (e/2)*8,  v = v0 + nt*8 + q2 + (e%2).
  const int krow0 = warp * (K / 4);
  float s[MT][NT][4];
  const int64_t ibase = int64_t(islot) * p.state.slot_stride;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int k = krow0 + mt * 16 + r + (e >> 1) * 8, v = v0 + nt * 8 + q2 + (e & 1);
        s[mt][nt][e] = islot >= 0 ? load_state_elem(p.state.data, p.state.dtype,
                                                    ibase + state_offset(p.state.layout, h, k, v, K, V))
                                  : 0.0f;
      }
  auto write_sb = [&]() {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int k = krow0 + mt * 16 + r + half * 8;
          *reinterpret_cast<uint32_t*>(&sm.sb[k * LDV + nt * 8 + q2]) =
              pack2<Op>(s[mt][nt][2 * half], s[mt][nt][2 * half + 1]);
        }
  };
  auto store_s = [&](void* base, DType dt, int64_t offset) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int k = krow0 + mt * 16 + r + (e >> 1) * 8, v = v0 + nt * 8 + q2 + (e & 1);
          store_state_elem(base, dt, offset + state_offset(p.state.layout, h, k, v, K, V), s[mt][nt][e]);
        }
  };

  const int64_t nchunks = (len + kChunk - 1) / kChunk;
  const int64_t slot0 = start / kChunk + n;
  const int64_t C = p.checkpoint_interval;

  // Chunk inputs pass through registers: global -> ChunkRegs -> shared memory.
  using Regs = ChunkRegs<K, VT>;
  auto fetch = [&](Regs& f, int64_t c) {
    const int64_t t0 = start + c * kChunk;
    const int L = int(min(int64_t(kChunk), len - c * kChunk));
    const int64_t ws = (slot0 + c) * HV + h;
#pragma unroll
    for (int u = 0; u < Regs::kV; ++u) {
      const int it = tid + u * kThreads, row = it / (VT / 8), cv = it % (VT / 8);
      f.v[u] = row < L ? load8<Op>(p.v.data, p.v.dtype,
                                   (t0 + row) * p.v.token_stride + h * p.v.head_stride + v0 + cv * 8, plan.qkv_vec)
                       : make_uint4(0, 0, 0, 0);
    }
    const uint4* tsrc = reinterpret_cast<const uint4*>(static_cast<const Op*>(plan.ws_tprime) + ws * (kChunk * kChunk));
    const uint4* msrc = reinterpret_cast<const uint4*>(static_cast<const Op*>(plan.ws_masked_qk) + ws * (kChunk * kChunk));
#pragma unroll
    for (int u = 0; u < Regs::kT; ++u) {
      f.t[u] = __ldg(tsrc + tid + u * kThreads);
      f.m[u] = __ldg(msrc + tid + u * kThreads);
    }
    if (tid < kChunk) {
      const float* src = plan.ws_factors + ws * (kFactorRows<false> * kChunk);
      f.ek = src[kDecayRk * kChunk + tid];
      f.eq = src[kDecayRq * kChunk + tid];
      f.dd = src[kTailDecayRk * kChunk + tid];
      f.eg = src[kChunkDecay * kChunk + tid];
    }
#pragma unroll
    for (int u = 0; u < Regs::kRow; ++u) {
      const int it = tid + u * kThreads, row = it / (K / 8), cv = it % (K / 8);
      const int64_t tk = (t0 + row) * p.k.token_stride + hk * p.k.head_stride + cv * 8;
      const int64_t tq = (t0 + row) * p.q.token_stride + hk * p.q.head_stride + cv * 8;
      f.k[u] = row < L ? load8<Op>(p.k.data, p.k.dtype, tk, plan.qkv_vec) : make_uint4(0, 0, 0, 0);
      f.q[u] = row < L ? load8<Op>(p.q.data, p.q.dtype, tq, plan.qkv_vec) : make_uint4(0, 0, 0, 0);
    }
  };
  auto commit = [&](const Regs& f) {
#pragma unroll
    for (int u = 0; u < Regs::kV; ++u) {
      const int it = tid + u * kThreads, row = it / (VT / 8), cv = it % (VT / 8);
      *reinterpret_cast<uint4*>(&sm.vs[row * LDV + cv * 8]) = f.v[u];
    }
#pragma unroll
    for (int u = 0; u < Regs::kT; ++u) {
      const int it = tid + u * kThreads;
      *reinterpret_cast<uint4*>(&sm.ts[(it >> 3) * LDT + (it & 7) * 8]) = f.t[u];
      *reinterpret_cast<uint4*>(&sm.ms[(it >> 3) * LDT + (it & 7) * 8]) = f.m[u];
    }
    if (tid < kChunk) {
      sm.ek[tid] = f.ek;
      sm.eq[tid] = f.eq;
      sm.dd[tid] = f.dd;
      if (tid == 0) sm.eg = f.eg;
    }
#pragma unroll
    for (int u = 0; u < Regs::kRow; ++u) {
      const int it = tid + u * kThreads, row = it / (K / 8), cv = it % (K / 8);
      *reinterpret_cast<uint4*>(&sm.ks[row * LDK + cv * 8]) = f.k[u];
      *reinterpret_cast<uint4*>(&sm.qs[row * LDK + cv * 8]) = f.q[u];
    }
  };
  Regs f;
  if (kPrefetch && nchunks > 0) fetch(f, 0);

  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t t0 = start + c * kChunk;
    const int L = int(min(int64_t(kChunk), len - c * kChunk));

    // ---- the chunk's inputs to shared memory (with kPrefetch, fetched while the previous chunk
    // computed)
    if constexpr (!kPrefetch) fetch(f, c);
    commit(f);
    if (c == 0) write_sb();  // after the first chunk's loads were issued: the state load overlaps them
    __syncthreads();
    if constexpr (kPrefetch) {
      if (c + 1 < nchunks) fetch(f, c + 1);
    }

    const int i0 = warp * 16 + r, i1 = i0 + 8;  // this thread's two token rows in the warp's m16 tile
    // ---- P = k S, O = q S for the warp's 16 tokens; X = v - D rk P (in place); O *= D rq
    float o[NT][4];
    {
      float pk[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) pk[nt][e] = o[nt][e] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < K; kk += 16) {
        uint32_t ak[4], aq[4];
        ldmatrix_x4(ak, a_frag_ptr<LDK>(sm.ks, warp * 16, kk, lane));
        ldmatrix_x4(aq, a_frag_ptr<LDK>(sm.qs, warp * 16, kk, lane));
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, bk_frag_ptr<LDV>(sm.sb, kk, np * 16, lane));
          mma<Op>(pk[2 * np], ak, b[0], b[1]);
          mma<Op>(pk[2 * np + 1], ak, b[2], b[3]);
          mma<Op>(o[2 * np], aq, b[0], b[1]);
          mma<Op>(o[2 * np + 1], aq, b[2], b[3]);
        }
      }
      const float ek0 = sm.ek[i0], ek1 = sm.ek[i1];
      const float eq0 = sm.eq[i0], eq1 = sm.eq[i1];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int col = nt * 8 + q2;
        uint32_t* x0 = reinterpret_cast<uint32_t*>(&sm.vs[i0 * LDV + col]);
        uint32_t* x1 = reinterpret_cast<uint32_t*>(&sm.vs[i1 * LDV + col]);
        const float2 v0f = unpack2<Op>(*x0), v1f = unpack2<Op>(*x1);
        *x0 = pack2<Op>(v0f.x - ek0 * pk[nt][0], v0f.y - ek0 * pk[nt][1]);
        *x1 = pack2<Op>(v1f.x - ek1 * pk[nt][2], v1f.y - ek1 * pk[nt][3]);
        o[nt][0] *= eq0;
        o[nt][1] *= eq0;
        o[nt][2] *= eq1;
        o[nt][3] *= eq1;
      }
    }
    __syncthreads();

    // ---- v_new = T' X (T' lower triangular: k-tiles 0..warp); also the decayed copy for the update
    {
      float vn[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) vn[nt][0] = vn[nt][1] = vn[nt][2] = vn[nt][3] = 0.0f;
      causal_rows_mma<Op, LDT, LDV>(vn, sm.ts, sm.vs, warp, lane);
      const float dd0 = sm.dd[i0], dd1 = sm.dd[i1];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int col = nt * 8 + q2;
        *reinterpret_cast<uint32_t*>(&sm.vn[i0 * LDV + col]) = pack2<Op>(vn[nt][0], vn[nt][1]);
        *reinterpret_cast<uint32_t*>(&sm.vn[i1 * LDV + col]) = pack2<Op>(vn[nt][2], vn[nt][3]);
        *reinterpret_cast<uint32_t*>(&sm.vd[i0 * LDV + col]) = pack2<Op>(vn[nt][0] * dd0, vn[nt][1] * dd0);
        *reinterpret_cast<uint32_t*>(&sm.vd[i1 * LDV + col]) = pack2<Op>(vn[nt][2] * dd1, vn[nt][3] * dd1);
      }
    }
    __syncthreads();

    // ---- o += M v_new, store the valid rows
    causal_rows_mma<Op, LDT, LDV>(o, sm.ms, sm.vn, warp, lane);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int col = v0 + nt * 8 + q2;
      if (i0 < L)
        store_pair(p.o.data, p.o.dtype, (t0 + i0) * p.o.token_stride + h * p.o.head_stride + col, o[nt][0], o[nt][1],
                   plan.o_pair);
      if (i1 < L)
        store_pair(p.o.data, p.o.dtype, (t0 + i1) * p.o.token_stride + h * p.o.head_stride + col, o[nt][2], o[nt][3],
                   plan.o_pair);
    }

    // ---- S = exp(g_last) S + k^T vd   (A = k^T via transposed ldmatrix of the raw k rows)
    const float eg = sm.eg;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] *= eg;
#pragma unroll
    for (int kt = 0; kt < 4; ++kt) {
      if (kt * 16 < L) {
        uint32_t b[NT / 2][4];
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) ldmatrix_x4_trans(b[np], bk_frag_ptr<LDV>(sm.vd, kt * 16, np * 16, lane));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          uint32_t a[4];
          ldmatrix_x4_trans(a, at_frag_ptr<LDK>(sm.ks, kt * 16, krow0 + mt * 16, lane));
#pragma unroll
          for (int np = 0; np < NT / 2; ++np) {
            mma<Op>(s[mt][2 * np], a, b[np][0], b[np][1]);
            mma<Op>(s[mt][2 * np + 1], a, b[np][2], b[np][3]);
          }
        }
      }
    }
    write_sb();  // every warp passed the last read of sb (before the previous barrier)

    // ---- checkpoint: entry j holds the state after token (j+1)*C, for j < min(steps, len / C)
    if (cslot >= 0) {
      const int64_t done = (c + 1) * kChunk;
      if (done % C == 0 && done <= len && done / C - 1 < p.checkpoints.num_steps) {
        const int64_t j = done / C - 1;
        store_s(p.checkpoints.data, p.checkpoints.dtype,
                int64_t(cslot) * p.checkpoints.slot_stride + j * (int64_t(HV) * K * V));
      }
    }
    __syncthreads();  // the next chunk overwrites ks, qs, vs, ts, ms, vn, vd, gc
  }

  if (fslot >= 0) store_s(p.state.data, p.state.dtype, int64_t(fslot) * p.state.slot_stride);
}

// ---------------------------------------------------------------------------------------------
// Launcher for one head dim K (instantiated in prefill_k<K>.cu).
// ---------------------------------------------------------------------------------------------
template <int K, int VT, class Op>
void launch_state_pass(const PrefillParams& p, const Plan& plan, cudaStream_t stream) {
  const size_t smem = sizeof(StateSmem<K, VT, Op>);
  static const cudaError_t attr =
      cudaFuncSetAttribute(state_pass_kernel<K, VT, Op>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  GDNKIT_CUDA_CHECK(attr);
  const unsigned grid = unsigned(p.num_seqs) * unsigned(p.heads.num_v_heads) * unsigned(p.heads.head_dim_v / VT);
  state_pass_kernel<K, VT, Op><<<grid, kThreads, smem, stream>>>(p, plan);
  GDNKIT_CUDA_CHECK_LAUNCH();
}

// The chunk prep, with M (kM) or without (the head pass forms it: Plan::m_in_pass).
template <int K, class Op, bool kM>
void launch_chunk_prep(const PrefillParams& p, const Plan& plan, cudaStream_t stream) {
  const dim3 grid(unsigned(plan.num_slots), unsigned(p.heads.num_qk_heads));  // a CTA per GVA group
  constexpr size_t smem = prep_smem_bytes<K, Op, kM>();
  const auto kernel = chunk_prep_kernel<K, Op, kM>;
  static const cudaError_t attr = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  GDNKIT_CUDA_CHECK(attr);
  kernel<<<grid, kThreads, smem, stream>>>(p, plan);
  GDNKIT_CUDA_CHECK_LAUNCH();
}

template <int K, class Op>
void launch_op(const PrefillParams& p, const Plan& plan, int vtile, cudaStream_t stream, int stages) {
  const bool prep = (stages & kStagePrep) && plan.num_slots > 0 && p.total_tokens > 0;
  if (prep) {
    if (plan.m_in_pass)
      launch_chunk_prep<K, Op, false>(p, plan, stream);
    else
      launch_chunk_prep<K, Op, true>(p, plan, stream);
  }
  if (!(stages & kStageStatePass)) return;
  if constexpr (K <= 128) {
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
