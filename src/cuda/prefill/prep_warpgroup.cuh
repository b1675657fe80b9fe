// The head pass's prep warpgroup (state_pass_head_kernel's kAux): beside the two state warpgroups of a (sequence,
// value head) CTA, a third warpgroup turns each chunk's staged rows into what the state warpgroups would otherwise
// read from the chunk prep's workspace, in the chunk's own shared-memory stage, a chunk or two ahead of them (the
// stages are filled two chunks ahead), so that its work leaves their sequential chain. Two modes:
//   kAuxM (kSolve false): after the chunk prep kernel without M (T' and the factor rows kLog2Gcum, kInvNormK arrive with the
//     rows by TMA), it forms M with rq (q k^T on wgmma, rq from the rows' sums of squares on the FMA pipe) and the
//     factor rows kDecayRk, kDecayRq, kTailDecayRk, kChunkDecay;
//   kAuxAll (kSolve true): everything, no chunk prep kernel (the math of chunk_prep_kernel, kernels.cuh): k k^T,
//     the norms, gates and gcum, A, T' by solve.cuh's invert_and_store_t, M and the factor rows.
// Per chunk: wait for the state warps' release of the stage's previous chunk and for the stage's TMA; past a partial
// chunk's end zero the k, q, v rows (the tiles hold the next tokens there); form its part; then one arrival per thread
// on the stage's `done` mbarrier, after a proxy fence (the tensor cores read T' and M). Design and measurements: docs/prefill-design.md "The prep warpgroup".
// Registers: the kernel is launched for 384 threads (168 each); this warpgroup gives back to kPrepRegs, the
// state warpgroups take kStateRegs (setmaxnreg).
#pragma once

#include <cstdint>

#include "cuda/prefill/io.cuh"
#include "cuda/prefill/mma.cuh"
#include "cuda/prefill/plan.h"
#include "cuda/prefill/solve.cuh"
#include "cuda/arch/tma.cuh"
#include "cuda/arch/wgmma.cuh"
#include "gdnkit/params.h"

namespace gdnkit::cuda::chunked_prefill {

// The CTA launches with 168 registers per thread (384 threads: 64512), the pool the warpgroups trade within.
constexpr int kPrepRegs = 80, kStateRegs = 208;  // 128 x 80 + 256 x 208 = 63488
static_assert(kThreads * kPrepRegs + 2 * kThreads * kStateRegs <= 3 * kThreads * 168, "the CTA's registers");

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
// Barrier `id` (1..15) of `threads` threads (whole warps).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

// Named barriers: 0 is __syncthreads; the state warpgroups meet on 1, the prep warpgroup on 2.
constexpr int kStateBarrier = 1, kPrepBarrier = 2;

// Past a partial chunk's end (L < 64 tokens) the staged k, q, v tiles hold the next tokens' rows (or TMA's zeros past
// the tensor): zeroed here by threads first, first + stride, ..., so that the products run unmasked. The caller
// orders the zeros before the tensor cores' reads (a proxy fence, then a barrier).
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

// The prep warpgroup's own shared memory (after the stages).
struct PrepSmem {
  float a[kChunk * kSolveLd];  // A, then T in place (solve.cuh)
  float gc[kChunk], beta[kChunk], rk[kChunk], rq[kChunk];
};

// The four elements of this lane in C tile nt of a warp's 16 rows of a masked, decayed 64 x 64 product (A or M):
// element e is row i = 16 warp + r + 8 (e >> 1), column jj = j + (e & 1), and comes out as
// acc[e] * f[e >> 1] * exp2(gi[e >> 1] - gj * scale) * kj, or 0 in the diagonal tiles (diag) where jj > i, or also
// where jj == i unless kKeepDiag (A is strictly lower, M includes its diagonal).
template <bool kKeepDiag>
__device__ __forceinline__ void decayed_tile(const float (&acc)[4], const float (&gi)[2], const float (&f)[2], float2 gj,
                                             float2 kj, float scale, bool diag, int i0, int j, float (&out)[4]) {
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int i = i0 + (e >> 1) * 8, jj = j + (e & 1);
    const float d = exp2_approx(gi[e >> 1] - (e & 1 ? gj.y : gj.x) * scale) * (e & 1 ? kj.y : kj.x);
    out[e] = diag && (kKeepDiag ? jj > i : jj >= i) ? 0.0f : acc[e] * f[e >> 1] * d;
  }
}

// The chunks of one sequence (start, len) of value head h, prepared into their stages: chunk c's is
// stage[c % kStages] (HeadStageWg: ks, qs, vs as the TMA tiles land), its TMA completes on full[c % kStages] and
// this warpgroup's 128 threads arrive on done[c % kStages] (phase parity c / kStages). From chunk kStages on it also
// waits on done[kStages + c % kStages] (parity c / kStages - 1): every state thread is done with the stage's previous
// chunk.
// kSolve: it fills ts (T'), ms (M) and the four factor rows of sc. Else M alone: T' and the factor rows kLog2Gcum, kInvNormK of
// the chunk prep kernel arrive with the rows by TMA; this warpgroup fills ms (M with rq) and forms the rows kDecayRk, kDecayRq
// (with rq), kTailDecayRk, kChunkDecay from kLog2Gcum and kInvNormK (the state warpgroups then read what the chunk prep with M would have
// written).
template <int K, class Op, int kStages, bool kSolve, class Stage>
__device__ __forceinline__ void prep_warpgroup(const PrefillParams& p, const Plan& plan, PrepSmem& ps, Stage* stage,
                                               uint64_t* full, uint64_t* done, int h, int64_t start, int64_t len) {
  static_assert(K % 64 == 0, "the k, q rows in 64-column blocks");
  // This thread's index in the warpgroup, read again (volatile) where it is used in a chunk: formed once, the
  // offsets derived from it stayed live across the chunk loop and ptxas spilled them.
  const auto thread_index = [] {
    int t;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
    return t - 2 * kThreads;
  };
  int at = thread_index(), warp = at >> 5, lane = at & 31;
  const int64_t nchunks = (len + kChunk - 1) / kChunk;
  const bool fused = p.gating.mode == GateMode::kFused;
  const float2 hp = fused ? make_float2(p.gating.A_log[h], p.gating.dt_bias[h]) : make_float2(0.0f, 0.0f);
  const bool norm = p.heads.use_qk_l2norm;
  auto sync = [] { named_barrier_sync(kPrepBarrier, kThreads); };
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr uint32_t kBlock = kChunk * 128;  // a 64-column block of the k / q rows

  // T's blocks above the diagonal stay zero (the solve writes only the lower ones): warp w zeroes the 3 - w
  // blocks right of its diagonal block once.
  for (int jb = kSolve ? warp + 1 : 4; jb < 4; ++jb) {
    float* blk = ps.a + warp * 16 * kSolveLd + jb * 16;
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      const int e = lane + 32 * x;
      *reinterpret_cast<float4*>(blk + (e >> 2) * kSolveLd + (e & 3) * 4) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  }

  GateLoads gates;  // warp 0: the next chunk's gate inputs
  if (kSolve && warp == 0 && nchunks > 0) gates = load_gates(p, h, start, int(min(int64_t(kChunk), len)), lane);
  for (int64_t c = 0; c < nchunks; ++c) {
    Stage& b = stage[c % kStages];
    at = thread_index(), warp = at >> 5, lane = at & 31;
    const int r = lane >> 2, q2 = (lane & 3) * 2;
    const int L = int(min(int64_t(kChunk), len - c * kChunk));
    if (c >= kStages) mbarrier_wait(&done[kStages + c % kStages], uint32_t(c / kStages - 1) & 1);
    mbarrier_wait(&full[c % kStages], uint32_t(c / kStages) & 1);
    __syncwarp();  // every lane's reads of the previous chunk's rq before this chunk's writes
    if (L < kChunk) {
      zero_rows_past<K, Op>(b, L, at, kThreads);
      fence_proxy_async();  // the zeros are read by the tensor cores
      sync();
    }
    const uint64_t dk = sw128_desc(smem_addr(b.ks), 16, 1024), dq = sw128_desc(smem_addr(b.qs), 16, 1024);

    // acc = A B^T (64 x 64, fp32) for A, B the k or q rows (descriptors da, db), asynchronous
    float acc[8][4];
    const auto issue_product = [&](uint64_t da, uint64_t db) {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] = 0.0f;
      wgmma_pin(acc);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < K / 16; ++kk) {
        const uint32_t koff = (kk / 4) * kBlock + (kk % 4) * 32;
        wgmma_ss<Op, 32, 0>(acc, desc_add(da, koff), desc_add(db, koff));
        wgmma_ss<Op, 32, 4>(acc, desc_add(da, koff), desc_add(db, koff + 32 * 128));
      }
      wgmma_commit();
    };
    // ---- G = k k^T; without the solve, q k^T for M at once
    if constexpr (kSolve)
      issue_product(dk, dk);
    else
      issue_product(dq, dk);

    // ---- meanwhile: the norms of this warp's 16 rows, and warp 0's gates and gcum.
    if constexpr (kSolve) {
      // From the diagonal blocks of k k^T and q q^T (the B fragments of a row block's own product are its A
      // fragment's halves).
      float dkk[2][4] = {}, dqq[2][4] = {};
      const int row = warp * 16 + (lane & 15);
#pragma unroll
      for (int kk = 0; kk < K / 16; ++kk) {
        const int off = sw128_offset<kChunk>(row, kk * 16 + (lane >> 4) * 8);
        uint32_t fq[4], fk[4];
        ldmatrix_x4(fq, &b.qs[off]);
        mma<Op>(dqq[0], fq, fq[0], fq[2]);
        mma<Op>(dqq[1], fq, fq[1], fq[3]);
        ldmatrix_x4(fk, &b.ks[off]);
        mma<Op>(dkk[0], fk, fk[0], fk[2]);
        mma<Op>(dkk[1], fk, fk[1], fk[3]);
      }
      // Row 16 w + d: element d % 2 (rows 0..7) or 2 + d % 2 (rows 8..15) of the lane with r = d % 8,
      // (lane & 3) = r / 2.
      if ((lane >> 3) == (lane & 3)) {
        const int i = warp * 16 + r;
        const float x0 = r & 1 ? dqq[0][1] : dqq[0][0], x1 = r & 1 ? dqq[1][3] : dqq[1][2];
        ps.rq[i] = (norm ? rsqrtf(x0 + 1e-6f) : 1.0f) * plan.scale;
        ps.rq[i + 8] = (norm ? rsqrtf(x1 + 1e-6f) : 1.0f) * plan.scale;
        const float k0 = r & 1 ? dkk[0][1] : dkk[0][0], k1 = r & 1 ? dkk[1][3] : dkk[1][2];
        ps.rk[i] = norm ? rsqrtf(k0 + 1e-6f) : 1.0f;
        ps.rk[i + 8] = norm ? rsqrtf(k1 + 1e-6f) : 1.0f;
      }
    } else {
      // rq alone, on the FMA pipe: half a q row per thread (rows 16 w .. 16 w + 15 in warp w). By mma.sync, as
      // above, these products queued behind the state warpgroups' wgmma and held up M (ncu: a third of this
      // warpgroup's stall samples, the state warpgroups waiting for it at a fifth of theirs).
      const int row = at >> 1, c0 = (at & 1) * (K / 2);
      float ss[2] = {0.0f, 0.0f};  // two chains
#pragma unroll
      for (int u = 0; u < K / 16; ++u)
        ss[u & 1] += sumsq8<Op>(lds128(smem_addr(&b.qs[sw128_offset<kChunk>(row, c0 + 8 * u)])));
      float x = ss[0] + ss[1];
      x += __shfl_xor_sync(0xffffffffu, x, 1);
      if (!(at & 1)) ps.rq[row] = (norm ? rsqrtf(x + 1e-6f) : 1.0f) * plan.scale;
    }
    if constexpr (!kSolve) {
      __syncwarp();  // the warp's rq (its own rows are all M's pass reads)
      // The state warpgroups' factor rows of this warp's 16 tokens from the chunk prep's kLog2Gcum (gcum log2 e) and kInvNormK
      // (store_token_factors' with rq)
      if (lane < 16) {
        const int t = warp * 16 + lane;
        const float gc2 = b.sc[kLog2Gcum * kChunk + t], rk = b.sc[kInvNormK * kChunk + t], gl2 = b.sc[kLog2Gcum * kChunk + kChunk - 1];
        const float d = exp2f(gc2);
        b.sc[kDecayRk * kChunk + t] = d * rk;
        b.sc[kDecayRq * kChunk + t] = d * ps.rq[t];
        b.sc[kTailDecayRk * kChunk + t] = t < L ? rk * exp2f(gl2 - gc2) : 0.0f;
        b.sc[kChunkDecay * kChunk + t] = exp2f(gl2);
      }
    }
    if (kSolve && warp == 0) {
      store_gates(p, gates, hp, L, lane, ps.gc, ps.beta);
      if (c + 1 < nchunks)
        gates = load_gates(p, h, start + (c + 1) * kChunk, int(min(int64_t(kChunk), len - (c + 1) * kChunk)), lane);
    }
    if constexpr (kSolve) sync();  // the norms, gcum and beta of the chunk

    // ---- A[i][j] = beta_i rk_i rk_j exp(gcum_i - gcum_j) G[i][j], j < i (the row factor in the exponent as a log2:
    // beta in [0, 1], see the chunk prep); this warp's row block, the blocks left of the diagonal and the diagonal
    // one (the blocks above it stay zero)
    float gi[2];
    if constexpr (kSolve) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = warp * 16 + r + half * 8;
      gi[half] = ps.gc[i] * kLog2e + __log2f(ps.beta[i] * ps.rk[i]);
    }
    wgmma_wait<0>();
    wgmma_pin(acc);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      if (nt >= 2 * (warp + 1)) continue;
      const int j = nt * 8 + q2;
      const float2 gj = *reinterpret_cast<const float2*>(&ps.gc[j]);
      const float2 kj = *reinterpret_cast<const float2*>(&ps.rk[j]);
      const int i0 = warp * 16 + r;
      float a[4];
      decayed_tile<false>(acc[nt], gi, {1.0f, 1.0f}, gj, kj, kLog2e, nt >= 2 * warp, i0, j, a);
      *reinterpret_cast<float2*>(&ps.a[i0 * kSolveLd + j]) = make_float2(a[0], a[1]);
      *reinterpret_cast<float2*>(&ps.a[(i0 + 8) * kSolveLd + j]) = make_float2(a[2], a[3]);
    }

    issue_product(dq, dk);  // q k^T for M
    }

    // ---- M[i][j] = mask_{j<=i} exp(gcum_i - gcum_j) rq_i rk_j (q_i . k_j), to the stage as its causal image. gcum
    // (times log2 e) and rk: this warpgroup's, or without the solve the chunk prep's factor rows kLog2Gcum, kInvNormK.
    const float* const gcs = kSolve ? ps.gc : &b.sc[kLog2Gcum * kChunk];
    const float* const rks = kSolve ? ps.rk : &b.sc[kInvNormK * kChunk];
    constexpr float kGcScale = kSolve ? kLog2e : 1.0f;
    float fq[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = warp * 16 + r + half * 8;
      gi[half] = gcs[i] * kGcScale;
      fq[half] = ps.rq[i];
    }
    const ImageRows m_rows = image_rows(warp, lane);
    wgmma_wait<0>();
    wgmma_pin(acc);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      if (warp < 2 && nt >= 4) continue;  // the image has no upper-right quarter
      const int j = nt * 8 + q2;
      const float2 gj = *reinterpret_cast<const float2*>(&gcs[j]);
      const float2 kj = *reinterpret_cast<const float2*>(&rks[j]);
      float m[4];
      decayed_tile<true>(acc[nt], gi, fq, gj, kj, kGcScale, nt >= 2 * warp, warp * 16 + r, j, m);
#pragma unroll
      for (int half = 0; half < 2; ++half)
        *reinterpret_cast<uint32_t*>(&b.ms[m_rows.at[half] + ((nt ^ m_rows.swz) << 3)]) =
            pack2<Op>(m[2 * half], m[2 * half + 1]);
    }
    if constexpr (kSolve) {
      __syncwarp();  // this warp's rows of A are written (the solve's substitution reads its own diagonal block)
      // ---- T = (I + A)^{-1}, T' = T diag(beta) to the stage (causal image), then the token factors
      invert_and_store_t<Op, 2 * kThreads>(ps.a, ps.beta, L, b.ts, true, warp, lane, sync);
      if (at < kChunk) store_token_factors<true>(b.sc, ps.gc, ps.rk, ps.rq, L, at);
    }
    fence_proxy_async();  // T' and M are read by the tensor cores
    mbarrier_arrive(&done[c % kStages]);
    // every warp is done with this chunk's A / T, norms and gates before the next chunk's
    if constexpr (kSolve) sync();
  }
}

}  // namespace gdnkit::cuda::chunked_prefill
