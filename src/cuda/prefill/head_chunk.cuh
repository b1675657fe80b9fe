// The head state pass's per-chunk math: what a state warp does with one chunk in its stage (the products listed in
// state_pass_head.cuh; docs/design/prefill.md "Kernel 2: the head state pass"). Every product's A operand is the
// previous one's accumulator repacked in registers, so the warps never wait for each other inside a chunk.
//
// Fragments: S^T in registers, s[j][e] = S[k][v] with k = 8j + q2 + (e & 1), v = vw + r + 8 (e >> 1). The chunk's
// C fragments are 16 value rows x 64 token columns: element [nt][e] is value vw + r + 8 (e >> 1), token
// 8 nt + q2 + (e & 1). The mma.sync build skips token tiles past the chunk's length (zero rows).
#pragma once

#include <cstdint>

#include "cuda/arch/mma_sync.cuh"
#include "cuda/arch/wgmma.cuh"
#include "cuda/prefill/causal_image.cuh"
#include "cuda/prefill/head_loader.cuh"
#include "cuda/prefill/head_stage.cuh"
#include "cuda/prefill/io.cuh"
#include "cuda/prefill/mma.cuh"
#include "cuda/prefill/plan.h"
#include "gdnkit/params.h"

namespace gdnkit::cuda::chunked_prefill {

// v_new^T (or o^T) += A B^T over a chunk-causal B (B[n][k] = 0 for k > n: T' or M), in token halves: tokens
// 0..31 need k-steps 0, 1 (K-major descriptor `lo` of rows 0..31), tokens 32..63 all four (`hi`, rows 32..63):
// 6 of 8 n32 products. Not one n48/n64 k-step over tokens 16 KS .. 63: its accumulator tiles 2 KS .. 7 are not an
// aligned register block, and ptxas then serializes the wgmmas. The halves' descriptors: causal_image_descs or
// full_causal_descs (causal_image.cuh).
template <class Op, int KS = 0>
__device__ __forceinline__ void causal_cols_wgmma(float (&acc)[8][4], const uint32_t (&a)[4][4], uint64_t lo,
                                                  uint64_t hi) {
  if constexpr (KS < 2) wgmma_rs<Op, 32, 0, false>(acc, a[KS], desc_add(lo, KS * 32));
  wgmma_rs<Op, 32, 4, false>(acc, a[KS], desc_add(hi, KS * 32));
  if constexpr (KS < 3) causal_cols_wgmma<Op, KS + 1>(acc, a, lo, hi);
}

// S *= e^{g_last}, before a chunk's update.
template <int KT>
__device__ __forceinline__ void decay_state(float (&s)[KT][4], float eg) {
#pragma unroll
  for (int j = 0; j < KT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] *= eg;
}

template <int NT>
__device__ __forceinline__ void zero_acc(float (&acc)[NT][4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = 0.0f;
}

// One state thread's chunk math, for one build of the pass (S: HeadPass).
template <class S>
struct HeadStateWarps {
  using Op = typename S::Op;
  using Stage = typename S::Stage;
  static constexpr int K = S::K, KT = S::KT, kStages = S::kStages, kMCols = S::kMCols, LDK = S::LDK, LDT = S::LDT;
  static constexpr bool kWgmma = S::kWgmma, kMInPass = S::kMInPass, kOutputs = S::kOutputs, kFormsM = S::kFormsM;
  static constexpr uint32_t kVRow16 = S::kVRow16;
  // wgmma: a 64-column block of the k / q rows is 64 rows of 128 bytes
  static constexpr uint32_t kBlock = kChunk * 128;

  const PrefillParams& p;
  const Plan& plan;
  const HeadCoords& at;
  // kMInPass: the chunk's rq (scale / ||q||, or the scale), written after the chunk's first barrier, read after the
  // second (one buffer: every read of chunk c precedes the next chunk's first barrier). Beside the fused prep: the
  // producer's norms of every stage (FusedPrepSmem: rk[kStages][kChunk], then rq[kStages][kChunk]), which M reads.
  float* s_rq;
  // o: lane l stores 16-byte piece l & 1 of the warp's columns of rows l / 2 + 16 u of each chunk, staged in its
  // v columns at o_staged (+ 16 rows per u).
  Op* o_lane;
  int o_staged;
  // The wgmma build's share of M: warpgroup g forms token columns mj0 .. mj0 + kMCols - 1 of every row; warp w of
  // it holds rows mrow, mrow + 8, and stores (stmatrix) rows mst_row of columns mst_col + 16 np.
  int mj0, mrow, mst_row, mst_col;
  // Per-lane byte offsets inside a stage of the fragment rows each ldmatrix / stmatrix reads or writes (per chunk
  // only constants are added: they fold into the instructions' immediates).
  uint32_t off_k;   // B = rows [n][k] (k, q, T', M): bn_frag_ptr
  uint32_t off_t;
  uint32_t off_kt;  // B = k rows as [k][n]: bk_frag_ptr
  uint32_t off_v;   // v^T and o: matrix m = lane/8 of a token-tile pair is (token tile m/2, value half m%2)
  // The context-parallel local pass's transition CTA: v taken as zero (its state starts from the identity).
  bool zero_v;
  // The wgmma build: o of a full chunk leaves by a TMA store of each warpgroup's staged 64 columns (token start + 64 c).
  const CUtensorMap* o_map;
  int64_t start;
  // kProducer: per warpgroup and stage, the mbarrier on which its 128 threads hand a full chunk's staged o to the
  // producer, which stores it (the persistent build hands over every chunk, a partial one's empty)
  uint64_t* o_bars;
  // The persistent pass: the ring position of chunk 0 (chunk c's stage is (ring0 + c) % kStages), and whether the CTA
  // ran chunks before this item (the warpgroups' P/Q turns run on across items: warpgroup 1 hands every chunk's turn
  // on, and warpgroup 0 takes the last one when the CTA ends)
  uint32_t ring0 = 0;
  bool ran_before = false;

  __device__ __forceinline__ HeadStateWarps(const PrefillParams& p_, const Plan& plan_, const HeadCoords& at_,
                                            int64_t start_, float* s_rq_, const CUtensorMap* o_map_,
                                            bool zero_v_ = false, uint64_t* o_bars_ = nullptr)
      : p(p_), plan(plan_), at(at_), s_rq(s_rq_), zero_v(zero_v_), o_map(o_map_), start(start_), o_bars(o_bars_) {
    const int lane = at.lane, warp = at.warp;
    o_lane = static_cast<Op*>(p.o.data) + (start_ + (lane >> 1)) * p.o.token_stride + at.h * p.o.head_stride + at.vw +
             (lane & 1) * 8;
    o_staged = S::v_offset(lane >> 1, at.lw + (lane & 1) * 8);
    mj0 = (warp / 4) * kMCols, mrow = (warp % 4) * 16 + at.r;
    mst_row = (warp % 4) * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, mst_col = mj0 + (lane >> 4) * 8;
    const int frag_row = ((lane >> 4) << 3) + (lane & 7), frag_col = ((lane >> 3) & 1) * 8;
    off_k = uint32_t(frag_row * LDK + frag_col) * 2;
    off_t = uint32_t(frag_row * LDT + frag_col) * 2;
    off_kt = uint32_t((lane & 15) * LDK + (lane >> 4) * 8) * 2;
    off_v = uint32_t(S::v_offset(((lane >> 4) << 3) + (lane & 7), at.lw + ((lane >> 3) & 1) * 8)) * 2;
  }

  // Chunk c (L tokens) in stage b; issues chunk c + kStages - 1's inputs once its first products are under way
  // (beside a producer, kProducer, the producer issues them; beside a prep warpgroup the state warpgroups take turns
  // at P/Q).
  // Built twice: for a full chunk without any length test (one branch-free block that ptxas schedules across the
  // products), and for the last, partial one. c, L, nchunks and stage by reference: the caller's loop variables.
  template <bool kFull>
  __device__ __forceinline__ void chunk(Stage& b, float (&s)[KT][4], const int64_t& c, const int& L,
                                        const int64_t& nchunks, const HeadLoader<S>& loader,
                                        Stage* const& stage) const {
    const uint32_t ks_b = smem_addr(b.ks) + off_k, qs_b = smem_addr(b.qs) + off_k, kt_b = smem_addr(b.ks) + off_kt;
    const uint32_t ts_b = smem_addr(b.ts) + off_t, ms_b = smem_addr(b.ms) + off_t, vs_b = smem_addr(b.vs) + off_v;
    // K-major descriptors of the k and q rows, and of the k rows read transposed (MN-major)
    [[maybe_unused]] const uint64_t dk = sw128_desc(smem_addr(b.ks), 16, 1024),
                                    dq = sw128_desc(smem_addr(b.qs), 16, 1024),
                                    dkt = sw128_desc(smem_addr(b.ks), kBlock, 1024);

    float pk[8][4], qo[8][4];
    [[maybe_unused]] float mk[kMCols / 8][4];
    [[maybe_unused]] const int wg = at.warp / 4;
    if constexpr (S::kMWarpgroup) {
      if (wg == 1) named_barrier_sync(kPqTurnBarrier + 1, 2 * kThreads);
      else if (ran_before || c > 0) named_barrier_sync(kPqTurnBarrier, 2 * kThreads);
    }
    pq_products<kFull>(b, s, pk, qo, mk, ks_b, qs_b, dk, dq, L);

    // The inputs of chunk c + kStages - 1 (into the stage chunk c - 1 used: every warp is past it): issued here, so
    // that the P/Q products above start right after the barrier (kProducer: by the producer).
    if constexpr (!S::kProducer)
      if (c + kStages - 1 < nchunks) loader.issue(c + kStages - 1, stage[(c + kStages - 1) % kStages], kBoth);
    if constexpr (kFormsM && kMInPass) q_norms(b);
    if constexpr (kWgmma) {
      wgmma_wait<int(kOutputs) + int(kFormsM && !S::kFusedPrep)>();  // P^T (Q^T and q k^T may still run)
      wgmma_pin(pk);
    }
    if constexpr (S::kMWarpgroup) {
      if (wg == 0) named_barrier_arrive(kPqTurnBarrier + 1, 2 * kThreads);
      else if (S::kPersistent || c + 1 < nchunks) named_barrier_arrive(kPqTurnBarrier, 2 * kThreads);
    }

    // ---- X^T = v^T - P^T diag(ek), packed as the A operand of the next product (k-step = 16 tokens)
    uint32_t xa[4][4];
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      uint32_t vv[4];  // v^T of token tiles 2np, 2np+1 (value rows r, r + 8)
      ldmatrix_x4_trans(vv, vs_b + np * kVRow16);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int nt = 2 * np + half;
        const float2 ek = factor(b, kDecayRk, nt);
        float2 va = unpack2<Op>(vv[2 * half]), vb = unpack2<Op>(vv[2 * half + 1]);
        if constexpr (S::kCpMode == 1)
          if (zero_v) va = vb = make_float2(0.0f, 0.0f);
        xa[np][2 * half] = pack2<Op>(va.x - ek.x * pk[nt][0], va.y - ek.y * pk[nt][1]);
        xa[np][2 * half + 1] = pack2<Op>(vb.x - ek.x * pk[nt][2], vb.y - ek.y * pk[nt][3]);
      }
    }

    // ---- v_new^T = X^T T'^T   (T' lower triangular: token tile pair np needs k-steps 0..np)
    float vn[8][4];
    zero_acc(vn);
    if constexpr (kWgmma) {
      // beside the fused prep M's q k^T is issued here, ahead of v_new's product, once Q^T completed: its
      // accumulators live beside S^T's A fragments (Q^T's operand) leave the state warpgroups short of registers
      if constexpr (kFormsM && S::kFusedPrep) {
        wgmma_wait<0>();  // Q^T
        wgmma_pin(qo);
        zero_acc(mk);
        m_product(mk, dk, dq);
      }
      wgmma_pin(vn);
      wgmma_fence();
      const CausalDescs dt = causal_image_descs(b.ts);
      causal_cols_wgmma<Op>(vn, xa, dt.lo, dt.hi);
      wgmma_commit();
    }
    if constexpr (kFormsM) form_m(b, mk, c);
    if constexpr (kWgmma) {
      wgmma_wait<0>();  // v_new^T (and Q^T)
      wgmma_pin(vn);
      if constexpr (kOutputs) wgmma_pin(qo);
    } else {
      causal_cols_mma<Op, LDT, kFull>(vn, xa, ts_b, L);
    }

    uint32_t na[4][4], da[4][4];
    new_value_operands(b, vn, na, da);

    // ---- o^T = Q^T diag(eq) + v_new^T M^T   (M lower triangular; kMInPass: (Q^T diag(e^gcum) + v_new^T M'^T)
    // diag(rq))
    if constexpr (kOutputs) {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const float2 eq = factor(b, kDecayRq, nt);
        qo[nt][0] *= eq.x;
        qo[nt][1] *= eq.y;
        qo[nt][2] *= eq.x;
        qo[nt][3] *= eq.y;
      }
    }
    const float eg = b.sc[kChunkDecay * kChunk];
    if constexpr (kWgmma) {
      o_and_update_wgmma(b, s, qo, na, da, eg, dkt);
    } else if constexpr (kOutputs) {
      causal_cols_mma<Op, LDT, kFull>(qo, na, ms_b, L);
    }

    if constexpr (kOutputs) store_o<kFull>(b, qo, vs_b, c, L);

    if constexpr (kWgmma) {
      wgmma_wait<0>();  // S^T
      wgmma_pin(s);
    } else {
      update_state_mma<kFull>(s, da, kt_b, eg, L);
    }
  }

 private:
  // Token factors of this thread's token columns 8 nt + q2 + {0, 1} (FactorRow).
  __device__ __forceinline__ float2 factor(const Stage& b, int row, int nt) const {
    return *reinterpret_cast<const float2*>(&b.sc[row * kChunk + nt * 8 + at.q2]);
  }

  // ---- P^T = S^T k^T and Q^T = S^T q^T (kFormsM: and this warpgroup's q k^T for M); the wgmma build issues them
  // asynchronously, as two commit groups (and a third), so that X starts while Q still runs (without o: P^T alone).
  template <bool kFull>
  __device__ __forceinline__ void pq_products(const Stage& b, float (&s)[KT][4], float (&pk)[8][4], float (&qo)[8][4],
                                              float (&mk)[kMCols / 8][4], uint32_t ks_b, uint32_t qs_b, uint64_t dk,
                                              uint64_t dq, int L) const {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) pk[nt][e] = qo[nt][e] = 0.0f;
    if constexpr (kFormsM && !S::kFusedPrep) zero_acc(mk);
    if constexpr (kWgmma) {
      uint32_t sa[K / 16][4];  // S^T as A fragments, held until both products complete
#pragma unroll
      for (int kk = 0; kk < K / 16; ++kk) c_to_a<Op>(s[2 * kk], s[2 * kk + 1], sa[kk]);
      wgmma_pin(pk);  // the zeros are written before the fence
      if constexpr (kOutputs) wgmma_pin(qo);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < K / 16; ++kk)
        wgmma_rs<Op, kChunk, 0, false>(pk, sa[kk], desc_add(dk, (kk / 4) * kBlock + (kk % 4) * 32));
      wgmma_commit();
      if constexpr (kOutputs) {
#pragma unroll
        for (int kk = 0; kk < K / 16; ++kk)
          wgmma_rs<Op, kChunk, 0, false>(qo, sa[kk], desc_add(dq, (kk / 4) * kBlock + (kk % 4) * 32));
        wgmma_commit();
      }
      if constexpr (kFormsM && !S::kFusedPrep) m_product(mk, dk, dq);
    } else {
#pragma unroll
      for (int kk = 0; kk < K / 16; ++kk) {
        uint32_t a[4];
        c_to_a<Op>(s[2 * kk], s[2 * kk + 1], a);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          if (!kFull && np * 16 >= L) continue;
          uint32_t bk[4], bq[4];
          ldmatrix_x4(bk, ks_b + uint32_t(np * 16 * LDK + kk * 16) * 2);
          ldmatrix_x4(bq, qs_b + uint32_t(np * 16 * LDK + kk * 16) * 2);
          mma<Op>(pk[2 * np], a, bk[0], bk[1]);
          mma<Op>(pk[2 * np + 1], a, bk[2], bk[3]);
          mma<Op>(qo[2 * np], a, bq[0], bq[1]);
          mma<Op>(qo[2 * np + 1], a, bq[2], bq[3]);
        }
      }
    }
  }

  // M's q k^T: tokens i (rows, A = q rows) x this warpgroup's token columns mj0 .. mj0 + 31 (B = k rows), both
  // operands in shared memory, as a commit group of its own
  __device__ __forceinline__ void m_product(float (&mk)[kMCols / 8][4], uint64_t dk, uint64_t dq) const {
    wgmma_pin(mk);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
      const uint32_t koff = (kk / 4) * kBlock + (kk % 4) * 32;
      wgmma_ss<Op, kMCols, 0>(mk, desc_add(dq, koff), desc_add(dk, koff + uint32_t(mj0) * 128));
    }
    wgmma_commit();
  }

  // kMInPass: rq of token tid / 4 from a quarter of its q row per lane (rows past a partial chunk are zero), while
  // the products run (docs/design/prefill.md "M formed in the pass").
  __device__ __forceinline__ void q_norms(const Stage& b) const {
    const int t = at.tid >> 2, c0 = (at.tid & 3) * (K / 4);
    float ss = 0.0f;
#pragma unroll
    for (int u = 0; u < K / 32; ++u) ss += sumsq8<Op>(lds128(smem_addr(&b.qs[sw128_offset<kChunk>(t, c0 + 8 * u)])));
    ss += __shfl_xor_sync(0xffffffffu, ss, 1);
    ss += __shfl_xor_sync(0xffffffffu, ss, 2);
    if ((at.tid & 3) == 0) s_rq[t] = (p.heads.use_qk_l2norm ? rsqrtf(ss + 1e-6f) : 1.0f) * plan.scale;
  }

  // ---- kMInPass: M'[i][j] = mask_{j<=i} exp2(gc_i - gc_j) rk_j (q_i . k_j) (M without rq_i, which o's rows get
  // at the end) from the chunk prep's factors; beside the fused prep M itself (rq_i, rk_j from the producer's norms
  // of the stage). Stored to the stage's M rows while v_new's product runs (o's product reads them once both
  // warpgroups stored theirs).
  __device__ __forceinline__ void form_m(Stage& b, float (&mk)[kMCols / 8][4], int64_t c) const {
    wgmma_wait<1>();  // Q^T and q k^T (v_new^T may still run)
    wgmma_pin(mk);
    const float* const rks = S::kFusedPrep ? s_rq + (c % kStages) * kChunk : &b.sc[kInvNormK * kChunk];
    float gi[2], fi[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      gi[half] = b.sc[kLog2Gcum * kChunk + mrow + 8 * half];
      fi[half] = S::kFusedPrep ? s_rq[(kStages + c % kStages) * kChunk + mrow + 8 * half] : 1.0f;
    }
    // Beside the fused prep, where the warp's 16 rows span less than 2^64 of decay: exp2(gi - gj) as a row factor
    // exp2(gi - g0) (<= 1) times a column factor exp2(g0 - gj) (< 2^64 for j <= i), g0 the warp's first row's, so
    // that an element takes two multiplies and no exponential. (The two loops written out: as one template of the
    // factored flag, ptxas spills twice as much in the state warpgroups.)
    const int i0 = mrow - at.r;
    const float g0 = b.sc[kLog2Gcum * kChunk + i0];
    if (S::kFusedPrep && g0 - b.sc[kLog2Gcum * kChunk + i0 + 15] < 64.0f) {
      const float fr[2] = {fi[0] * exp2_approx(gi[0] - g0), fi[1] * exp2_approx(gi[1] - g0)};
#pragma unroll
      for (int nt = 0; nt < kMCols / 8; ++nt) {
        const int j = mj0 + nt * 8 + at.q2;
        const float2 gj = *reinterpret_cast<const float2*>(&b.sc[kLog2Gcum * kChunk + j]);
        const float2 kj = *reinterpret_cast<const float2*>(&rks[j]);
        const float fc[2] = {kj.x * exp2_approx(g0 - gj.x), kj.y * exp2_approx(g0 - gj.y)};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = mrow + 8 * (e >> 1), jj = j + (e & 1);
          mk[nt][e] = jj <= i ? mk[nt][e] * fr[e >> 1] * fc[e & 1] : 0.0f;
        }
      }
    } else {
#pragma unroll
      for (int nt = 0; nt < kMCols / 8; ++nt) {
        const int j = mj0 + nt * 8 + at.q2;
        const float2 gj = *reinterpret_cast<const float2*>(&b.sc[kLog2Gcum * kChunk + j]);
        const float2 kj = *reinterpret_cast<const float2*>(&rks[j]);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = mrow + 8 * (e >> 1), jj = j + (e & 1);
          const float d = exp2_approx(gi[e >> 1] - (e & 1 ? gj.y : gj.x)) * (e & 1 ? kj.y : kj.x);
          mk[nt][e] = jj <= i ? mk[nt][e] * (S::kFusedPrep ? d * fi[e >> 1] : d) : 0.0f;
        }
      }
    }
#pragma unroll
    for (int np = 0; np < kMCols / 16; ++np) {
      uint32_t frag[4];
      c_to_a<Op>(mk[2 * np], mk[2 * np + 1], frag);
      stmatrix_x4(smem_addr(b.ms) + 2 * uint32_t(sw128_offset<kChunk>(mst_row, mst_col + 16 * np)), frag);
    }
    fence_proxy_async();  // M is read by the tensor cores
  }

  // ---- A operands: v_new (for o) and vd = v_new diag(dd) (for S; dd is 0 past the chunk)
  __device__ __forceinline__ void new_value_operands(const Stage& b, const float (&vn)[8][4], uint32_t (&na)[4][4],
                                                     uint32_t (&da)[4][4]) const {
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      c_to_a<Op>(vn[2 * ks], vn[2 * ks + 1], na[ks]);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int nt = 2 * ks + half;
        const float2 dd = factor(b, kTailDecayRk, nt);
        da[ks][2 * half] = pack2<Op>(vn[nt][0] * dd.x, vn[nt][1] * dd.y);
        da[ks][2 * half + 1] = pack2<Op>(vn[nt][2] * dd.x, vn[nt][3] * dd.y);
      }
    }
  }

  // The wgmma build: o's product, then S^T = e^{g_last} S^T + vd^T k (B = k rows [token][k]: MN-major) issued right
  // behind it, so that o's store overlaps the update; o^T complete on return, S^T still running (without o: the
  // update alone).
  __device__ __forceinline__ void o_and_update_wgmma(const Stage& b, float (&s)[KT][4], float (&qo)[8][4],
                                                     const uint32_t (&na)[4][4], const uint32_t (&da)[4][4], float eg,
                                                     uint64_t dkt) const {
    if constexpr (kFormsM && kMInPass) __syncthreads();  // every warpgroup's share of M is stored
    else if constexpr (kFormsM) named_barrier_sync(kMFormedBarrier, 2 * kThreads);
    if constexpr (kOutputs) {
      wgmma_pin(qo);
      wgmma_fence();
      const CausalDescs dm = kFormsM ? full_causal_descs(b.ms) : causal_image_descs(b.ms);
      causal_cols_wgmma<Op>(qo, na, dm.lo, dm.hi);
      wgmma_commit();
    }
    decay_state(s, eg);
    wgmma_pin(s);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) wgmma_rs<Op, K, 0, true>(s, da[ks], desc_add(dkt, ks * 2048));
    wgmma_commit();
    if constexpr (!kOutputs) return;
    [[maybe_unused]] float2 rqv[kMInPass ? 8 : 1];  // o's row factors, read while o's product runs
    if constexpr (kMInPass) {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) rqv[nt] = *reinterpret_cast<const float2*>(&s_rq[nt * 8 + at.q2]);
    }
    wgmma_wait<1>();  // o^T
    wgmma_pin(qo);
    if constexpr (kMInPass) {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const float2 rq = rqv[nt];
        qo[nt][0] *= rq.x;
        qo[nt][1] *= rq.y;
        qo[nt][2] *= rq.x;
        qo[nt][3] *= rq.y;
      }
    }
  }

  // ---- o: staged transposed (stmatrix) in this warp's v columns, read above, then stored: a full chunk of the wgmma
  // build as its warpgroup's 64 columns by one TMA store (the staged rows are the v tile's box, swizzle and all),
  // otherwise as 32-byte row pieces from each lane. The TMA store's thread waits for it to have read the stage
  // before the stage is loaded again (state_pass_head.cuh); kProducer: the warpgroup hands the staged rows to the
  // producer (o_bars), which stores them and waits for that read itself.
  template <bool kFull>
  __device__ __forceinline__ void store_o(const Stage& b, const float (&qo)[8][4], uint32_t vs_b, int64_t c,
                                          int L) const {
    __syncwarp();
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      uint32_t frag[4];  // the C -> A packing is also stmatrix's fragment order
      c_to_a<Op>(qo[2 * np], qo[2 * np + 1], frag);
      stmatrix_x4_trans(vs_b + np * kVRow16, frag);
    }
    if constexpr (kWgmma && kFull) {
      const int wg = at.warp / 4;
      fence_proxy_async();  // the staged rows are read by the TMA unit
      if constexpr (S::kProducer) {
        mbarrier_arrive(&o_bars[wg * kStages + (ring0 + uint32_t(c)) % kStages]);
        return;
      }
      named_barrier_sync(kOStoreBarrier + wg, 128);
      if (at.tid % 128 == 0) {
        tma_store_3d(o_map, at.v0 + 64 * wg, at.h, int(start + c * kChunk), &b.vs[wg * 64 * kChunk]);
        bulk_commit_group();
      }
      return;
    }
    __syncwarp();
    Op* const oc = o_lane + c * kChunk * p.o.token_stride;
#pragma unroll
    for (int u = 0; u < 2 * kChunk / 32; ++u) {
      if (kFull || (at.lane >> 1) + 16 * u < L)
        *reinterpret_cast<uint4*>(oc + 16 * u * p.o.token_stride) =
            *reinterpret_cast<const uint4*>(&b.vs[o_staged + u * int(kVRow16 / 2)]);
    }
    // the persistent pass's producer waits on every ring position's o hand-over, storing the full chunks'
    if constexpr (S::kPersistent) mbarrier_arrive(&o_bars[at.warp / 4 * kStages + (ring0 + uint32_t(c)) % kStages]);
  }

  // ---- the mma.sync build: S^T = e^{g_last} S^T + vd^T k   (B = k rows [token][k]: .trans)
  template <bool kFull>
  __device__ __forceinline__ void update_state_mma(float (&s)[KT][4], const uint32_t (&da)[4][4], uint32_t kt_b,
                                                   float eg, int L) const {
    decay_state(s, eg);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      if (!kFull && ks * 16 >= L) continue;
#pragma unroll
      for (int np = 0; np < K / 16; ++np) {
        uint32_t bk[4];
        ldmatrix_x4_trans(bk, kt_b + uint32_t(ks * 16 * LDK + np * 16) * 2);
        mma<Op>(s[2 * np], da[ks], bk[0], bk[1]);
        mma<Op>(s[2 * np + 1], da[ks], bk[2], bk[3]);
      }
    }
  }
};

}  // namespace gdnkit::cuda::chunked_prefill
