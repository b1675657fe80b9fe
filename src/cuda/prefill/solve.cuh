// The chunk prep's per-(chunk, value head) pieces (chunk_prep.cuh: one CTA of 4 warps per chunk and q/k head,
// warp w owning token rows 16w .. 16w + 15; docs/design/prefill.md "Kernel 1: the chunk prep"; the solve also in the
// head pass's fused prep warpgroup, prep_warpgroup.cuh):
//   the gate inputs of a value head loaded by warp 0 as raw bits, then gcum and beta (store_gates);
//   the per-token factor rows (store_token_factors);
//   T = (I + A)^{-1} of the strictly lower A (in shared memory; T in fp32 over it) and T' = T diag(beta) stored in
//   the operand dtype (invert_and_store_t; the fused prep's by doubling, doubling_levels, T' from the accumulators).
#pragma once

#include <cstdint>

#include "cuda/prefill/causal_image.cuh"
#include "cuda/prefill/io.cuh"
#include "cuda/prefill/mma.cuh"
#include "cuda/prefill/plan.h"
#include "gdnkit/params.h"

namespace gdnkit::cuda::chunked_prefill {

// Raw gate inputs of one value head for warp 0's two tokens (lane, lane + 32): fused a, b (x, y), or given g,
// beta, held as loaded (bits of their dtypes) and converted in store_gates. Loads only, no math and no
// conversion: the next head's are issued before this head's M, A and solve, so their latency hides behind them
// (and the first head's do not hold up warp 0's share of the k rows behind a conversion).
struct GateLoads {
  uint32_t x[2] = {0u, 0u}, y[2] = {0u, 0u};
};

__device__ __forceinline__ GateLoads load_gates(const PrefillParams& p, int h, int64_t t0, int L, int lane) {
  const Gating& G = p.gating;
  const bool fused = G.mode == GateMode::kFused;
  GateLoads in;
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    if (lane + 32 * u >= L) continue;
    const int64_t t = t0 + lane + 32 * u;
    const InView& x = fused ? G.a : G.g;
    const InView& y = fused ? G.b : G.beta;
    in.x[u] = load_bits_dyn(x.data, x.dtype, t * x.token_stride + h * x.head_stride);
    in.y[u] = load_bits_dyn(y.data, y.dtype, t * y.token_stride + h * y.head_stride);
  }
  return in;
}

// Warp 0: the gates of tokens lane and lane + 32 from their loads, and gcum by a warp scan of each
// half (the upper half adds the lower half's total). Padding tokens get g = 0 (gcum stays flat, so
// gcum[63] is g_last) and beta = 0.
// hp: the head's (A_log, dt_bias) (fused gating; the chunk prep reads them from shared memory, so that they hold no
// register across its solve).
__device__ __forceinline__ void store_gates(const PrefillParams& p, const GateLoads& in, float2 hp, int L, int lane,
                                            float* gc, float* beta) {
  float x[2];
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    float g = 0.0f, b = 0.0f;
    if (lane + 32 * u < L) {
      const Gating& G = p.gating;
      if (G.mode == GateMode::kFused) {
        g = fused_decay(hp.x, bits_to_float(in.x[u], G.a.dtype), hp.y);
        b = sigmoid(bits_to_float(in.y[u], G.b.dtype));
      } else {
        g = bits_to_float(in.x[u], G.g.dtype);
        b = bits_to_float(in.y[u], G.beta.dtype);
      }
    }
    x[u] = g;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const float y = __shfl_up_sync(0xffffffffu, x[u], off);
      if (lane >= off) x[u] += y;
    }
    beta[lane + 32 * u] = b;
  }
  gc[lane] = x[0];
  gc[lane + 32] = x[1] + __shfl_sync(0xffffffffu, x[0], 31);
}

// The per-token factors (FactorRow) of token t < 64 of one (chunk, value head) to f, from gcum, rk and (kWithRq) rq
// in shared memory. Without kWithRq (M is formed in the state pass, which applies rq itself) kDecayRq is e^gcum alone
// and M's terms kLog2Gcum, kInvNormK follow; with m_terms_only those two alone (the head pass's prep warpgroup forms
// the others).
template <bool kWithRq>
__device__ __forceinline__ void store_token_factors(float* f, const float* gc, const float* rk, const float* rq, int L,
                                                    int t, bool m_terms_only = false) {
  if (!kWithRq && m_terms_only) {
    f[kLog2Gcum * kChunk + t] = gc[t] * 1.4426950408889634f;
    f[kInvNormK * kChunk + t] = rk[t];
    return;
  }
  const float d = expf(gc[t]), g_last = gc[kChunk - 1];
  f[kDecayRk * kChunk + t] = d * rk[t];
  f[kDecayRq * kChunk + t] = kWithRq ? d * rq[t] : d;
  f[kTailDecayRk * kChunk + t] = t < L ? rk[t] * expf(g_last - gc[t]) : 0.0f;
  f[kChunkDecay * kChunk + t] = expf(g_last);
  if constexpr (!kWithRq) {
    f[kLog2Gcum * kChunk + t] = gc[t] * 1.4426950408889634f;
    f[kInvNormK * kChunk + t] = rk[t];
  }
}

// Element (i0 + di, j) of the solve's fp32 A / T ([64][kSolveLd], Af below), for i0 a multiple of 8: rows 72 floats
// (8 banks) apart, those with bit 2 set starting 8 floats into theirs (their 64 floats end at the row's end), so
// that a warp's row-fragment pairs (rows r, columns 2q) and its column reads (rows 2q, column r) both hit 32 distinct
// banks. The skew comes from di alone and the column adds to it: a lane's offsets are one base plus constants.
__device__ __forceinline__ int solve_at(int i0, int di, int j) {
  return (i0 + di) * kSolveLd + ((di & 4) << 1) + j;
}

// The solve's 16x16 fp32 blocks as fp16 mma operands (11 significant bits per operand, |x| < 65504; T' leaves the prep
// rounded to the 16-bit operand dtype, so these roundings are of the order of that last one: prefill.md "Precision").
// The block at (i0, j0) of Af, both multiples of 16, as an A fragment.
__device__ __forceinline__ void load_a_half(const float* Af, int i0, int j0, int lane, uint32_t (&a)[4]) {
  const int r = lane >> 2, c = (lane & 3) * 2;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = *reinterpret_cast<const float2*>(Af + solve_at(i0, r + (i & 1) * 8, j0 + (i >> 1) * 8 + c));
    a[i] = pack2<__half>(v.x, v.y);
  }
}
// The A fragment of X^T for the block X at (i0, j0) of Af.
__device__ __forceinline__ void load_a_half_trans(const float* Af, int i0, int j0, int lane, uint32_t (&a)[4]) {
  const int r = lane >> 2, c = (lane & 3) * 2;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int i1 = i0 + (i >> 1) * 8, j = j0 + (i & 1) * 8 + r;  // X^T's (r, c) of this register is X's (c, r)
    a[i] = pack2<__half>(Af[solve_at(i1, c, j)], Af[solve_at(i1, c + 1, j)]);
  }
}
// acc (16x16, two n8 tiles) += A B for A given as fragments and B the block at (i0, j0) of Af ([k][n]).
__device__ __forceinline__ void block_mma_half(float (&acc)[2][4], const uint32_t (&a)[4], const float* Af, int i0,
                                               int j0, int lane) {
  const int n = lane >> 2, c = (lane & 3) * 2;
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    uint32_t b[2];
#pragma unroll
    for (int h = 0; h < 2; ++h)
      b[h] = pack2<__half>(Af[solve_at(i0 + h * 8, c, j0 + t * 8 + n)],
                           Af[solve_at(i0 + h * 8, c + 1, j0 + t * 8 + n)]);
    mma<__half>(acc[t], a, b[0], b[1]);
  }
}

// A's blocks left of the diagonal in fp16 (the fused prep's doubling solve: they are only ever fp16 operands, the B
// fragments of T_rs A_sm): element (i0 + di, j) of such a block (i0, j0 multiples of 16) in the first 32 bytes of its
// fp32 row's 64, 16 bytes further on in rows with bit 2 set, so that the eight 16-byte rows of each 8 x 8 ldmatrix
// matrix fall on distinct banks (with solve_at's skew: words 0, 8, 16, 24, then 12, 20, 28, 4).
__device__ __forceinline__ __half* solve_a16(float* Af, int i0, int di, int j) {
  return reinterpret_cast<__half*>(Af + solve_at(i0, di, j & ~15)) + ((di & 4) << 1) + (j & 15);
}
// block_mma_half for B the fp16 block at (i0, j0) (solve_a16), its B fragments by one ldmatrix.trans (lanes 8 m ..
// 8 m + 7: rows 8 (m % 2) .. of n-tile m / 2).
__device__ __forceinline__ void block_mma_a16(float (&acc)[2][4], const uint32_t (&a)[4], float* Af, int i0, int j0,
                                              int lane) {
  uint32_t b[4];
  ldmatrix_x4_trans(b, solve_a16(Af, i0, ((lane >> 3) & 1) * 8 + (lane & 7), j0 + (lane >> 4) * 8));
  mma<__half>(acc[0], a, b[0], b[1]);
  mma<__half>(acc[1], a, b[2], b[3]);
}

// The doubling solve's (kDoubling) fp16 images of T's blocks, 16 x 16 row-major in the blocks above A's diagonal (the
// solve's scratch, solve_a16's layout): n = 0..3 T_nn, 4 T_10, 5 T_32, in blocks (0, 1), (0, 2), (0, 3), (1, 2), (1,
// 3), (2, 3). This lane's ldmatrix / stmatrix row address (x4: an A fragment, or with .trans both n-tiles' B
// fragments).
__device__ __forceinline__ uint32_t t_image(float* Af, int n, int lane) {
  const int kb = n < 3 ? 0 : n < 5 ? 1 : 2, ib = n < 3 ? n + 1 : n < 5 ? n - 1 : 3;
  return smem_addr(solve_a16(Af, kb * 16, ((lane >> 3) & 1) * 8 + (lane & 7), ib * 16 + (lane >> 4) * 8));
}

// Where lane keeps half `nh` (8 bytes: words 2 nh, 2 nh + 1 of solve_b_words) of a 16x16 block's B fragments in the
// block (kb, ib) above A's diagonal of Af, the solve's scratch: half nh in rows 4 nh .. 4 nh + 3, lanes 0-7, 8-15,
// 16-23, 24-31 in rows 0, 2, 1, 3 of those, 8 bytes apart, so that each half-warp's 8-byte access covers 32 banks.
__device__ __forceinline__ uint2* solve_b_slot(float* Af, int kb, int ib, int nh, int lane) {
  return reinterpret_cast<uint2*>(Af + solve_at(kb * 16, 4 * nh + ((lane >> 3) & 1) * 2 + (lane >> 4),
                                                ib * 16 + (lane & 7) * 2));
}

// The B fragments of W^T for the 16x16 block W given as C fragments (two n8 tiles), as fp16: words 0, 1 for the
// n8 tile of W's rows 0..7, words 2, 3 for rows 8..15 (the C layout of W holds W^T's B layout, lane for lane).
__device__ __forceinline__ uint4 solve_b_words(const float (&w)[2][4]) {
  return make_uint4(pack2<__half>(w[0][0], w[0][1]), pack2<__half>(w[1][0], w[1][1]), pack2<__half>(w[0][2], w[0][3]),
                    pack2<__half>(w[1][2], w[1][3]));
}

// The solve's barrier of its 4 warps: the chunk prep's CTA (kBarrier 0) or the prep warpgroup's named barrier.
template <int kBarrier>
__device__ __forceinline__ void solve_sync() {
  if constexpr (kBarrier == 0)
    __syncthreads();
  else
    asm volatile("bar.sync %0, %1;\n" ::"n"(kBarrier), "n"(kThreads) : "memory");
}

// This lane's stmatrix row address of the 16 x 16 block (ib, jb) of the causal image `out`.
template <class Op>
__device__ __forceinline__ uint32_t t_image_block(Op* out, int ib, int jb, int lane) {
  return smem_addr(out + causal_image_offset(ib * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, jb * 16 + (lane >> 4) * 8));
}
// Block (ib, jb) of T' = T diag(beta) (c: T's 16 x 16 block as C fragments of two n8 tiles, fp32) to the causal image
// `out` by one stmatrix, rows at or past L zero.
template <class Op>
__device__ __forceinline__ void store_t_image_block(Op* out, const float (&c)[2][4], int ib, int jb, const float* beta,
                                                    int L, int lane) {
  const int r = lane >> 2, q2 = (lane & 3) * 2;
  uint32_t f[4];
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    const float2 bv = *reinterpret_cast<const float2*>(&beta[jb * 16 + 8 * t + q2]);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const bool live = ib * 16 + r + 8 * h < L;
      f[2 * t + h] = pack2<Op>(live ? c[t][2 * h] * bv.x : 0.0f, live ? c[t][2 * h + 1] * bv.y : 0.0f);
    }
  }
  stmatrix_x4(t_image_block(out, ib, jb, lane), f);
}

// The doubling solve's levels (invert_and_store_t with kDoubling), after every warp's T_ii and its image (t_a: this
// warp's T_ii as an fp16 A fragment): the 32 x 32 diagonal blocks' lower-left blocks T_10 = -(T_11 A_10) T_00 on warp 1
// and T_32 = -(T_33 A_32) T_22 on warp 3; then warp w forms block (2 + w / 2, w % 2) of the lower-left quarter
// T_[23][01] = -T_[23] A_[23][01] T_[01] as -sum_m Q_rm T_mc with Q_rm = sum_s T_rs A_sm, forming the Q it needs
// itself. Products on fp16 operands (A by solve_a16, T by its images), fp32 accumulation; each block of T goes from
// the accumulators to T' in the causal image `out` (store_t_image_block) and, where a later level reads it, to its
// fp16 image. No block of T is written over A, so the levels meet once.
template <class Op, int kBarrier>
__device__ __forceinline__ void doubling_levels(float* Af, const uint32_t (&t_a)[4], int warp, int lane,
                                                const float* beta, int L, Op* out) {
  if (warp & 1) {  // level 32: T_hi,lo with hi = warp
    const int lo = warp - 1;
    float q[2][4] = {}, c[2][4] = {};
    block_mma_a16(q, t_a, Af, warp * 16, lo * 16, lane);  // T_hi A_hi,lo
    uint32_t qa[4], tb[4];
    c_to_a_half(q, qa);
    ldmatrix_x4_trans(tb, t_image(Af, lo, lane));  // T_lo as B
    mma<__half>(c[0], qa, tb[0], tb[1]);
    mma<__half>(c[1], qa, tb[2], tb[3]);
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) c[t][e] = -c[t][e];
    uint32_t ta[4];
    c_to_a_half(c, ta);
    stmatrix_x4(t_image(Af, warp == 1 ? 4 : 5, lane), ta);
    store_t_image_block<Op>(out, c, warp, lo, beta, L, lane);
  }
  solve_sync<kBarrier>();  // T_10, T_32 and their images
  const int rr = 2 + (warp >> 1), cc = warp & 1;
  uint32_t t2[4], t3[4];  // T_r2 (T_22 or T_32) and T_33
  ldmatrix_x4(t2, t_image(Af, rr == 2 ? 2 : 5, lane));
  if (rr == 3) ldmatrix_x4(t3, t_image(Af, 3, lane));
  float res[2][4] = {};
#pragma unroll
  for (int m = 0; m < 2; ++m) {
    if (m < cc) continue;
    float q[2][4] = {};
    block_mma_a16(q, t2, Af, 32, m * 16, lane);             // T_r2 A_2m
    if (rr == 3) block_mma_a16(q, t3, Af, 48, m * 16, lane);  // + T_33 A_3m
    uint32_t qa[4], tb[4];
    c_to_a_half(q, qa);
    ldmatrix_x4_trans(tb, t_image(Af, m == 0 ? 0 : cc == 0 ? 4 : 1, lane));  // T_mc: T_00, T_10 or T_11
    mma<__half>(res[0], qa, tb[0], tb[1]);
    mma<__half>(res[1], qa, tb[2], tb[3]);
  }
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) res[t][e] = -res[t][e];
  store_t_image_block<Op>(out, res, rr, cc, beta, L, lane);
}

// T = (I + A)^{-1} of Af ([64][kSolveLd] fp32: A's blocks on and below the diagonal as the caller wrote them, strictly
// lower, with kDoubling fp16 left of the diagonal; the blocks above the diagonal are free space), then T' = T
// diag(beta) to `out` in the operand dtype: the wgmma head pass's causal image (image) or row-major 64 x 64. Rows at or
// past L are written as zero. Called by 4 warps (kThreads threads): the chunk prep's CTA, meeting on __syncthreads
// (kBarrier 0), or the head pass's prep warpgroup, threads kTid0 .. kTid0 + 127 meeting on named barrier kBarrier. On
// return this thread's part of T' is stored; Af may be overwritten after the next barrier of the 4 warps. kDoubling
// (the fused prep): A's blocks left of the diagonal are fp16 (solve_a16), after the diagonal blocks T is formed by
// doubling (doubling_levels) instead of phase 1's W' and phase 2, and each block of T' leaves for the causal image
// (`image` is not read) from the warp that formed it, so that no barrier waits for a pass over T in shared memory.
template <class Op, int kBarrier = 0, int kTid0 = 0, bool kDoubling = false>
__device__ __forceinline__ void invert_and_store_t(float* Af, const float* beta, int L, Op* out, bool image, int warp,
                                                   int lane) {
  float* const Tf = Af;
  // T = (I + A)^{-1}, blocked by 16, in three phases with a barrier between each two:
  //   1. warp i: its diagonal block T_ii = (I + A_ii)^{-1} (fp32, over A_ii) by its 8 x 8 halves, [[X1, 0], [Y, X2]]
  //      with X1 = (I + A11)^{-1}, X2 = (I + A22)^{-1} by forward substitution (one column per lane) and
  //      Y = -X2 A21 X1 by two mma (the A fragment of a 16 x 16 block holds its quarters apart); then
  //      W'_ik = -T_ii A_ik for k < i, kept as the B fragments of W'_ik^T in the free block (k, i).
  //   2. warp j walks down block column j of T as block row j of T^T:
  //      T_ij^T = sum_{k=j}^{i-1} T_kj^T W'_ik^T for i > j, each T_kj^T the A operand from the warp's own
  //      accumulators (T_jj^T from shared memory), every W'_ik^T 16 bytes a lane; T_ij over A_ij.
  //   3. T (fp32 over A) to T' = T diag(beta) in the output's layout.
  // So the warps meet twice, and phase 2's B operands are fp16 fragments formed once, not fp32 blocks converted for
  // each product. The block products run on tensor cores with fp16 operands and fp32 accumulation (mma.cuh). A's
  // rows at or past L are zero (beta_i = 0 there), so T's are e_i^T, and T' rows there are 0 whatever is selected;
  // they are selected away all the same. With kDoubling, phase 1 stops at T_ii (to T' from the warp's fp32 X1, X2 and
  // accumulators Y), doubling_levels replaces its W', phase 2 and phase 3, and the warps meet twice.
  const int b0 = warp * 16;
  {
    // X1 (lanes 0..7) and X2 (lanes 8..15) column by column; lanes 16..31 repeat lanes 0..15
    const int col = lane & 7, d = lane & 8;
    float x[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      float acc0 = i == col ? 1.0f : 0.0f, acc1 = 0.0f;  // two chains: the sum is latency-bound
#pragma unroll
      for (int j = 0; j < i; ++j) {
        const float aij = Af[solve_at(b0, d + i, b0 + d + j)];
        if (j & 1)
          acc1 = fmaf(-aij, x[j], acc1);
        else
          acc0 = fmaf(-aij, x[j], acc0);
      }
      x[i] = acc0 + acc1;
    }
    __syncwarp();  // every lane has read A11 and A22
    if (lane < 16) {
#pragma unroll
      for (int i = 0; i < 8; ++i) Tf[solve_at(b0, d + i, b0 + d + col)] = x[i];
    }
    __syncwarp();  // X1 and X2 are in shared memory
  }
  {
    // The block [[X1, 0], [A21, X2]] as an A fragment (quarters X1, A21, 0, X2) and its first 8 columns as a B
    // fragment (rows 0..7: X1, rows 8..15: A21).
    uint32_t t_a[4], bx[2];
    load_a_half(Af, b0, b0, lane, t_a);
    const int r = lane >> 2, q2 = (lane & 3) * 2;
    bx[0] = pack2<__half>(Af[solve_at(b0, q2, b0 + r)], Af[solve_at(b0, q2 + 1, b0 + r)]);
    bx[1] = pack2<__half>(Af[solve_at(b0 + 8, q2, b0 + r)], Af[solve_at(b0 + 8, q2 + 1, b0 + r)]);
    // rows 8..15 of [[0, 0], [0, -X2]] [[X1], [A21]] = -X2 A21, then of [[0, 0], [-X2 A21, 0]] [[X1], [A21]] = Y
    float w[4] = {}, y[4] = {};
    const uint32_t neg_x2[4] = {0u, 0u, 0u, t_a[3] ^ 0x80008000u};  // the sign bits of both fp16 halves
    mma<__half>(w, neg_x2, bx[0], bx[1]);
    const uint32_t w_lower_left[4] = {0u, pack2<__half>(w[2], w[3]), 0u, 0u};
    mma<__half>(y, w_lower_left, bx[0], bx[1]);
    if constexpr (kDoubling) {
      t_a[1] = pack2<__half>(y[2], y[3]);  // T_ii's lower-left quarter
      stmatrix_x4(t_image(Af, warp, lane), t_a);  // T_ii's fp16 image
      // T_ii to T' in fp32: X1 and X2 as the substitution stored them, Y from the accumulator
      const float2 x1 = *reinterpret_cast<const float2*>(Tf + solve_at(b0, r, b0 + q2));
      const float2 x2 = *reinterpret_cast<const float2*>(Tf + solve_at(b0, 8 + r, b0 + 8 + q2));
      const float tii[2][4] = {{x1.x, x1.y, y[2], y[3]}, {0.0f, 0.0f, x2.x, x2.y}};
      store_t_image_block<Op>(out, tii, warp, warp, beta, L, lane);
      if (!(warp & 1)) stmatrix_x4(t_image_block(out, warp, warp + 1, lane), {0u, 0u, 0u, 0u});  // (0, 1), (2, 3)
      __syncwarp();
      solve_sync<kBarrier>();  // every T_ii and its image
      doubling_levels<Op, kBarrier>(Af, t_a, warp, lane, beta, L, out);
      return;
    } else {
      __syncwarp();  // every lane has read A21
      *reinterpret_cast<float2*>(Tf + solve_at(b0 + 8, r, b0 + q2)) = make_float2(y[2], y[3]);
      t_a[1] = pack2<__half>(y[2], y[3]);  // T_ii's lower-left quarter
      // -T_ii as the A operand: W'_ik = -T_ii A_ik.
#pragma unroll
      for (int i = 0; i < 4; ++i) t_a[i] ^= 0x80008000u;
#pragma unroll
      for (int k = 0; k < 3; ++k) {
        if (k >= warp) continue;
        float wk[2][4] = {};
        block_mma_half(wk, t_a, Af, b0, k * 16, lane);
        const uint4 words = solve_b_words(wk);
        *solve_b_slot(Af, k, warp, 0, lane) = make_uint2(words.x, words.y);
        *solve_b_slot(Af, k, warp, 1, lane) = make_uint2(words.z, words.w);
      }
    }
  }
  if constexpr (!kDoubling) {
    solve_sync<kBarrier>();  // every W' is in shared memory, every A_ik read
    // Block row `warp` of T^T, block by block: T_ij^T = sum_k T_kj^T W'_ik^T, the T_kj^T as A fragments (af[k]),
    // each block stored transposed over A_ij once complete. One accumulator at a time (the chunk prep's 72
    // registers).
    int t;  // the lane read again (volatile), so that the offsets are not hoisted out of the caller's loops
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
    const int ln = t & 31, r = ln >> 2, q2 = (ln & 3) * 2;
    uint32_t af[3][4];
#pragma unroll
    for (int i = 1; i < 4; ++i) {
      if (i - 1 == warp) load_a_half_trans(Tf, b0, b0, ln, af[i - 1]);  // T_jj^T
      if (i <= warp) continue;
      float c[2][4] = {};
#pragma unroll
      for (int k = 0; k < i; ++k) {
        if (k < warp) continue;
#pragma unroll
        for (int nh = 0; nh < 2; ++nh) {  // as two 8-byte halves (prefill.md, "Kernel 1" step 3)
          const uint2 b = *solve_b_slot(Af, k, i, nh, ln);
          mma<__half>(c[nh], af[k], b.x, b.y);
        }
      }
      if (i < 3) c_to_a_half(c, af[i]);
      // c[nh][e] is T^T's (b0 + r + 8 (e / 2), 16 i + 8 nh + q2 + e % 2), stored as T's: 32 distinct banks a store
#pragma unroll
      for (int nh = 0; nh < 2; ++nh)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          Tf[solve_at(i * 16 + 8 * nh, q2 + (e & 1), b0 + 8 * (e >> 1) + r)] = c[nh][e];
    }
  }
  solve_sync<kBarrier>();  // T is in shared memory
  // Column scaling by beta: T' = T diag(beta), so v_new = T' (v - D k^ S) (see the header).
  {
    // Element pair (i, c) at `from`, c even, scaled by beta's pair bv, to `to` in one access. T's upper triangle is
    // zero in T_ii (the substitution's zeros, and A_ii's upper-right quarter as the caller wrote it) and selected away
    // in the blocks above the diagonal (i / 16 < c / 16: the solve's scratch); rows past L are selected away too.
    auto put = [&](int from, int i, int c, float2 bv, Op* to) {
      const float2 tv = *reinterpret_cast<const float2*>(&Tf[from]);
      const bool live = i < L && (c >> 4) <= (i >> 4);
      *reinterpret_cast<uint32_t*>(to) = pack2<Op>(live ? tv.x * bv.x : 0.0f, live ? tv.y * bv.y : 0.0f);
    };
    if (image) {
      // Rows 0..31 (16 pairs each): a thread's rows il + 8u, its column fixed, so its image offset steps by
      // 256 (the 64B swizzle of row i is (i / 2) % 4). Rows 32..63 (32 pairs each): rows ih + 4u, the 128B
      // swizzle i % 8 = (ih % 8) ^ 4 (u % 2) (ih % 8 < 4 with 128 threads): the offset of an odd u flips
      // the piece's bit 2 (element offset bit 5) of the even u's, and steps by 256. Unrolled from base pointers
      // (T's rows il + 8u share il's swizzle, rows ih + 4u with u even ih's, with u odd the other), every store and
      // shared load takes a constant offset (no address arithmetic per pair).
      static_assert(kThreads == 128, "the image's per-thread rows");
      // The thread index read again here (volatile), so that these offsets are not hoisted out of the head loop
      // to hold registers across the solve.
      int t;
      asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
      t -= kTid0;
      const int il = t >> 4, cl = (t & 15) * 2, ih = 32 + (t >> 5), ch = (t & 31) * 2;
      const int offh = causal_image_offset(ih, ch);
      Op* const outl = out + causal_image_offset(il, cl);
      Op* const outh = out + offh;
      Op* const outh_odd = out + (offh ^ 32) + 256;
      const float2 bl = *reinterpret_cast<const float2*>(&beta[cl]);
      const float2 bh = *reinterpret_cast<const float2*>(&beta[ch]);
      const int tl = solve_at(0, il, cl), th = solve_at(32, t >> 5, ch), th_odd = solve_at(32, (t >> 5) + 4, ch);
#pragma unroll
      for (int u = 0; u < 4; ++u) put(tl + 8 * u * kSolveLd, il + 8 * u, cl, bl, outl + 256 * u);
#pragma unroll
      for (int u = 0; u < 8; u += 2) {
        put(th + 4 * u * kSolveLd, ih + 4 * u, ch, bh, outh + 256 * u);
        put(th_odd + 4 * u * kSolveLd, ih + 4 * u + 4, ch, bh, outh_odd + 256 * u);
      }
    } else {
      for (int e = int(threadIdx.x) - kTid0; e < kChunk * kChunk / 2; e += kThreads) {
        const int c = (e & 31) * 2;
        put(solve_at(0, e >> 5, c), e >> 5, c, *reinterpret_cast<const float2*>(&beta[c]), out + 2 * e);
      }
    }
  }
}

}  // namespace gdnkit::cuda::chunked_prefill
