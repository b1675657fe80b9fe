// Kernel 1, the chunk prep: per (chunk, q/k head) WY preparation of the HV/H value heads of its GVA group, in one CTA or
// in a few, each a share of the heads (docs/design/prefill.md "Kernel 1: the chunk prep"). One CTA of 4 warps, warp w
// owning token rows 16w .. 16w + 15: the gram products k k^T (and q k^T) once, then per value head the gates, M and A
// in one pass, the solve T = (I + A)^{-1} (solve.cuh), and T', M and the factor rows to the workspace.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/prefill/causal_image.cuh"
#include "cuda/prefill/io.cuh"
#include "cuda/prefill/mma.cuh"
#include "cuda/prefill/plan.h"
#include "cuda/prefill/solve.cuh"
#include "gdnkit/params.h"

namespace gdnkit::cuda::chunked_prefill {

// The k k^T and q k^T accumulators a thread keeps for all value heads of the group: warp w holds
// the 2(w+1) n8-tiles of its rows' lower blocks, kPrepTiles = 20 tiles of 32 float4 (one per lane) per product.
static_assert(kPrepTiles == 2 + 4 + 6 + 8, "the four warps' lower-block tiles");
__device__ __forceinline__ int prep_tile(int warp, int nt, int lane) { return (warp * (warp + 1) + nt) * 32 + lane; }

// Fused gating: A_log and dt_bias of the first kHeadParams value heads of the CTA's share of the group in shared memory
// (the rest read at use; the models of docs/benchmarks.md have 2-4 value heads per q/k head).
constexpr int kHeadParams = 32;

// slot -> (sequence n, chunk c): n = the last sequence with floor(cu[n]/64) + n <= slot. False for a slot that
// the kernel leaves alone: a bad sequence (kernel 2 counts it), a short one (the short path's), or no chunk.
// Else chunk c's first token t0 and its length L. Warp-collective: a bisection over the heads of 32-sequence blocks
// (none up to 32 sequences), then one load of the block's cu_seqlens a lane and a ballot: one dependent load up to 32
// sequences (a bisection: log2(N) + 1), ceil(log2(N / 32)) + 1 past that.
__device__ __forceinline__ bool chunk_of_slot(const PrefillParams& p, const Plan& plan, int slot, int64_t& t0,
                                              int& L) {
  const int N = p.num_seqs, lane = int(threadIdx.x) & 31;
  int lo = 0, hi = (N - 1) >> 5;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (load_cu(p, int64_t(mid) << 5) / kChunk + (mid << 5) <= slot)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int base = lo << 5, i = base + lane;
  const int64_t cu = i <= N ? load_cu(p, i) : 0;
  const unsigned le = __ballot_sync(0xffffffffu, i < N && cu / kChunk + i <= slot);
  const int n = le ? base + 31 - __clz(int(le)) : base;
  const int64_t start = __shfl_sync(0xffffffffu, cu, n - base);
  const int64_t end = n - base < 31 ? __shfl_sync(0xffffffffu, cu, n - base + 1) : load_cu(p, n + 1);
  if (start < 0 || end < start || end > p.total_tokens) return false;
  if (short_prefill_sequence(start, end, p.total_tokens, plan.short_len)) return false;
  const int64_t c = slot - (start / kChunk + n);
  if (c < 0 || c * kChunk >= end - start) return false;
  t0 = start + c * kChunk;
  L = int(min(int64_t(kChunk), end - t0));
  return true;
}

// G = k k^T and (kM) Mq = q k^T on wgmma from the swizzled rows, all 64 x 64 (the upper blocks too: the tensor cores
// are idle here, and the four warps' shares come out equal, where a warp's lower blocks alone on mma.sync made warp 3's
// four times warp 0's, each warp loading its B fragments by ldmatrix), then rk of this warp's rows. Warp w holds rows
// 16 w .. 16 w + 15 in the mma.sync C layout of 8 n8 tiles (wgmma.cuh).
template <int K, class Op, bool kM>
__device__ __forceinline__ void gram_products(const PrefillParams& p, const Op* Ks, const Op* Qs, float* s_rk,
                                              int warp, int lane, float (&acc)[8][4], float (&accm)[8][4]) {
  const uint64_t dk = sw128_desc(smem_addr(Ks), 16, 1024);
  issue_qk_products<K, Op, kM>(acc, dk, accm, kM ? sw128_desc(smem_addr(Qs), 16, 1024) : 0, dk);
  wgmma_wait<0>();
  wgmma_pin(acc);
  if constexpr (kM) wgmma_pin(accm);
  // rk_i = 1 / |k_i| from G_ii (fp32 sums of the exact products of the operand rows: what a pass over the
  // rows would sum, in another order). Row 16 w + d of the warp's diagonal block sits in tile 2 w + d / 8,
  // element 2 (d / 8) + d % 2 of the lane with r = d % 8 and (lane & 3) = r / 2: lanes 0, 4, 9, 13, 18, 22,
  // 27, 31 hold two each (rows r and r + 8). Rows past L are zero: rk = 1 / sqrt(eps) there.
  const int r = lane >> 2;
  if ((lane >> 3) == (lane & 3)) {
    float d0 = 0.0f, d1 = 0.0f;
#pragma unroll
    for (int w = 0; w < 4; ++w)  // constant tile indices: no local-memory indexing
      if (w == warp) {
        d0 = r & 1 ? acc[2 * w][1] : acc[2 * w][0];
        d1 = r & 1 ? acc[2 * w + 1][3] : acc[2 * w + 1][2];
      }
    const bool norm = p.heads.use_qk_l2norm;
    s_rk[warp * 16 + r] = norm ? rsqrtf(d0 + 1e-6f) : 1.0f;
    s_rk[warp * 16 + r + 8] = norm ? rsqrtf(d1 + 1e-6f) : 1.0f;
  }
}

// Each thread parks its own accumulators in shared memory (no barrier needed to read them back), with rk_j already
// applied (column j's factor, the same for every value head), so that they hold no registers through the solves.
template <bool kM>
__device__ __forceinline__ void park_gram(const float (&acc)[8][4], const float (&accm)[8][4], const float* s_rk,
                                          float4* Gacc, float4* Macc, int warp, int lane) {
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
}

// One value head's M and A from the parked accumulators (rk_j in them), in one pass:
// M[i][j] = mask_{j<=i} exp(gcum_i - gcum_j) rq_i rk_j (q_i . k_j), the intra-chunk attention of the output (rq
// includes the scale), to the workspace at mout (kM; upper blocks written as 0; the causal image where `image`);
// A[i][j] = beta_i rk_i rk_j exp(gcum_i - gcum_j) G[i][j] for j < i (strictly lower), else 0, to Af's blocks on and
// below the diagonal (those above it are the solve's scratch).
// Without M, A's row factor beta_i rk_i rides in the exponent (log2, -inf for beta_i = 0): one ex2 and one multiply
// per element; with M, both share exp(gcum_i - gcum_j) (its argument is <= 0 wherever it is used).
template <bool kM, class Op>
__device__ __forceinline__ void masked_decay_pass(const float* gc, const float* beta, const float* s_rk,
                                                  const float* s_rq, const float4* Gacc, const float4* Macc, float* Af,
                                                  [[maybe_unused]] Op* mout, bool image, int warp, int lane) {
  constexpr float kLog2e = 1.4426950408889634f;
  const int r = lane >> 2, q2 = (lane & 3) * 2;
  float gi[2], fq[2], fa[2];  // per row i = 16 warp + r + 8 half
  // M's causal image (image): element (i, 8 nt + q2) at m_rows.at[half] + ((nt ^ m_rows.swz) << 3)
  [[maybe_unused]] const ImageRows m_rows = kM ? image_rows(warp, lane) : ImageRows{};
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int i = warp * 16 + r + half * 8;
    gi[half] = gc[i] * kLog2e;
    fa[half] = beta[i] * s_rk[i];
    // beta in [0, 1] (docs/semantics.md): beta_i = 0 gives -inf, and A's row 0. (As the exponents <= 0 below, this
    // takes in-spec gates: a negative given beta would make the row NaN here, where the path with M would not.)
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
      *reinterpret_cast<float2*>(&Af[solve_at(warp * 16, r, j)]) = make_float2(a[0], a[1]);
      *reinterpret_cast<float2*>(&Af[solve_at(warp * 16, r + 8, j)]) = make_float2(a[2], a[3]);
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

// One CTA per (chunk slot, q/k head hk) (or Plan::prep_parts of them, each a share of the group's value heads),
// slot-major (CTA (slot H + hk) parts + part: a slot's chunks are finished together, early slots first): q and k rows,
// their norms, G = k k^T and q k^T (kM) are computed once per CTA; the gates, gcum, M, A, the solve and the workspace
// writes then run per value head of its share of the GVA group (the same operations as one CTA per value head would
// run). With Plan::chunk_ready the CTA then counts itself into its slot's count, on which the head pass's producer
// waits.
// Without kM (the wgmma head pass forms M from the chunk's rows and takes the q norms there, in its state warpgroups
// or in its prep warpgroup) q is not read, q k^T and M are skipped, kDecayRq is e^gcum alone, and M's per-token terms
// (kLog2Gcum, kInvNormK) are written with the other factors, or alone beside a prep warpgroup (Plan::m_warpgroup),
// which forms the others.
template <int K, class Op, bool kM>
__global__ void __launch_bounds__(kThreads, prep_ctas_per_sm(K, kM))
    chunk_prep_kernel(const PrefillParams p, const Plan plan) {
  constexpr int LDA = kSolveLd;  // fp32 A rows (solve.cuh)
  extern __shared__ __align__(16) unsigned char smem[];
  // gcum and beta per value head, double-buffered by head parity: warp 0 writes the next head's
  // while the other warps still store this head's T' and gcum.
  __shared__ __align__(16) float s_gc[2][kChunk];
  __shared__ __align__(16) float s_beta[2][kChunk];
  __shared__ __align__(16) float s_rk[kChunk];
  __shared__ __align__(16) float s_rq[kM ? kChunk : 1];
  __shared__ float s_head[2][kHeadParams];
  // raw k (and, kM, q) rows, 128B-swizzled wgmma operands on a 1024-byte boundary (prep_smem_bytes has the slack)
  Op* Ks = reinterpret_cast<Op*>(smem + ((1024 - (smem_addr(smem) & 1023)) & 1023));
  Op* Qs = Ks + kChunk * K;
  // After Ks, Qs are consumed:
  float* Af = reinterpret_cast<float*>(smem);              // [64][LDA] A, lower blocks
  float4* Gacc = reinterpret_cast<float4*>(Af + kChunk * LDA);  // k k^T accumulators (prep_tile)
  float4* Macc = Gacc + kPrepTiles * 32;                   // q k^T accumulators

  // The head state pass may launch once every CTA of this grid has started (it waits for the grid's end
  // before reading the workspace): its first CTAs then take the SMs the last wave frees.
  asm volatile("griddepcontrol.launch_dependents;");
  const int H = p.heads.num_qk_heads, parts = plan.prep_parts;
  const int slot = int(blockIdx.x) / (H * parts), hk = int(blockIdx.x) / parts % H, part = int(blockIdx.x) % parts;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int HV = p.heads.num_v_heads, share = HV / H / parts;
  const int h0 = hk * (HV / H) + part * share, h1 = h0 + share;  // this CTA's value heads of the group
  // T' and M for the wgmma head pass as causal images (causal_image.cuh; always so without kM), else row-major
  const bool image = !kM || plan.wgmma_pass;

  int64_t t0;
  int L;
  if (!chunk_of_slot(p, plan, slot, t0, L)) return;

  GateLoads gates;  // warp 0: the next value head's gate inputs
  if (warp == 0) gates = load_gates(p, h0, t0, L, lane);
  const bool fused = p.gating.mode == GateMode::kFused;  // A_log and dt_bias are then present (api/validate.cpp)
  if (fused && tid < share && tid < kHeadParams) {
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
  fence_proxy_async();  // the rows' shared stores, before the tensor cores read them
  __syncthreads();

  // G = k k^T and Mq = q k^T, reused by every value head of the group.
  {
    float acc[8][4], accm[8][4];
    gram_products<K, Op, kM>(p, Ks, Qs, s_rk, warp, lane, acc, accm);
    // Warp 0 turns the first head's gate loads into gcum and beta here rather than before the barrier above (the
    // other warps would wait for it there; nothing reads them before the M / A pass).
    if (warp == 0) store_gates(p, gates, head_params(h0), L, lane, s_gc[h0 & 1], s_beta[h0 & 1]);
    __syncthreads();  // Ks (and Qs) are dead from here on: the accumulators, A and T reuse their bytes
    park_gram<kM>(acc, accm, s_rk, Gacc, Macc, warp, lane);
  }

  for (int h = h0; h < h1; ++h) {
    const float* gc = s_gc[h & 1];  // final: stored before the last barrier
    const float* beta = s_beta[h & 1];
    if (warp == 0 && h + 1 < h1) gates = load_gates(p, h + 1, t0, L, lane);  // stored after this head's solve

    const int64_t ws = int64_t(slot) * HV + h;
    {
      [[maybe_unused]] Op* mout = nullptr;  // M's rows in the workspace (kM; no M region otherwise)
      if constexpr (kM) mout = static_cast<Op*>(plan.ws_masked_qk) + ws * (kChunk * kChunk);
      masked_decay_pass<kM, Op>(gc, beta, s_rk, s_rq, Gacc, Macc, Af, mout, image, warp, lane);
    }
    // The solve's first phase reads this warp's rows of A alone (and writes W' where no warp's A goes); it meets the
    // other warps before its second.
    __syncwarp();

    // T = (I + A)^{-1} and T' = T diag(beta) to the workspace (solve.cuh)
    invert_and_store_t<Op>(Af, beta, L, static_cast<Op*>(plan.ws_tprime) + ws * (kChunk * kChunk), image, warp, lane);
    // The state pass reuses gcum and the norms (rq includes the scale), per value head.
    // (Beside a prep warpgroup forming M, kLog2Gcum and kInvNormK alone: it forms the others from them.)
    if (tid < kChunk)
      store_token_factors<kM>(plan.ws_factors + ws * (kFactorRows<!kM> * kChunk), gc, s_rk, s_rq, L, tid,
                              plan.m_warpgroup);
    if (warp == 0 && h + 1 < h1)
      store_gates(p, gates, head_params(h + 1), L, lane, s_gc[(h + 1) & 1], s_beta[(h + 1) & 1]);
    __syncthreads();  // the next head's gcum and beta are final; T is read, the next A may replace it
  }
  if (plan.chunk_ready != nullptr) {
    __threadfence();  // this thread's T', M and factor rows, before the count
    __syncthreads();
    if (tid == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(plan.chunk_ready + slot) : "memory");
  }
}

// The gates alone, where the head pass's prep warpgroup forms the rest of the prep (Plan::fused_prep): per chunk slot
// and value head, gcum (times log2 e) and beta of its tokens to the factor rows kLog2Gcum and kBeta (gcum flat and
// beta 0 past the chunk's end). One warp per value head, kWarps per CTA (blockIdx.y: value heads kWarps y and on).
template <int kWarps>
__global__ void __launch_bounds__(kWarps * 32) gate_prep_kernel(const PrefillParams p, const Plan plan) {
  // the head pass may launch now; it reads these rows after the grid completed (griddepcontrol.wait)
  asm volatile("griddepcontrol.launch_dependents;");
  __shared__ __align__(16) float s_gc[kWarps][kChunk];
  __shared__ __align__(16) float s_beta[kWarps][kChunk];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int slot = blockIdx.x, h = blockIdx.y * kWarps + warp, HV = p.heads.num_v_heads;
  int64_t t0;
  int L;
  if (h >= HV || !chunk_of_slot(p, plan, slot, t0, L)) return;
  const bool fused = p.gating.mode == GateMode::kFused;  // A_log and dt_bias are then present (api/validate.cpp)
  const float2 hp = fused ? make_float2(p.gating.A_log[h], p.gating.dt_bias[h]) : make_float2(0.0f, 0.0f);
  store_gates(p, load_gates(p, h, t0, L, lane), hp, L, lane, s_gc[warp], s_beta[warp]);
  __syncwarp();
  float* const f = plan.ws_factors + (int64_t(slot) * HV + h) * (kFactorRowsMax * kChunk);
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int t = lane + 32 * u;
    f[kLog2Gcum * kChunk + t] = s_gc[warp][t] * 1.4426950408889634f;
    f[kBeta * kChunk + t] = s_beta[warp][t];
  }
}

}  // namespace gdnkit::cuda::chunked_prefill
