// Decode for V-last pools ([K][V] per head, rows k contiguous in v) without a shared-memory stage
// (docs/design/decode.md "V-last decode").
//
// The warp kernel (warp_kernel.cuh) gives each warp 8 columns and every row, which in V-last are 32-byte
// pieces of each row: it stages them through shared memory to move whole 128-byte lines. Here a CTA owns
// one 128-byte piece of every row (kCols = 32 fp32, 64 bf16 or 128 fp8 columns) and its warps split the rows:
//   lane l: column group cg = l / 4 (kVec = 16 bytes of columns: 4 fp32, 8 bf16 or 16 fp8), row phase ro = l % 4;
//   warp w: rows w * 32 + 4 i + ro, i < 8;
// so each load or store instruction of a warp covers 4 whole lines, straight from and to registers, and
// a lane holds its 8 rows as loaded (32 registers: 32 fp32 or 64 bf16 values), converted to fp32 where
// used: a bf16 warp moves 4 KB like an fp32 one. The sums over k (S^T k and S^T q of the CTA's
// columns) are reduced over the 4 lanes of a column group (a halving butterfly) and then over the warps
// through shared memory: one barrier. Every lane then has u of its columns; warp 0 writes o.
// kGroups = 4 (fp8 where the grid is small: twice the CTAs, each half the bytes) halves the CTA's piece to 64 bytes
// a row: 4 column groups of 8 row phases (ro = l % 8, rows w * 32 + 8 i + ro, i < 4), the sums over 8 lanes.
// The math and rounding per value are the warp kernel's (norms scale the sums, rsqrtf, fp32 state).
// float8_e4m3 pools (TState = uint8_t): a lane's 16 bytes of a row are half of a 32-column scale block, whose other
// half is lane l ^ kPhases's (the next column group); the block's power of two scales the row's k and q entries for the sums and the decay for
// the update (fp8_decode.cuh's exact rewrites), and the new block is quantized over the two lanes
// (docs/semantics.md "float8_e4m3 states"). In line pieces the update reads each row piece again (from L1) rather than
// holding the bytes across the CTA's sums and barrier.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/arch/dtype.cuh"
#include "cuda/arch/fp8.cuh"
#include "cuda/recurrent/row.cuh"
#include "cuda/recurrent/token.cuh"
#include "gdnkit/params.h"

namespace gdnkit::cuda::recurrent {

// kGroups: column groups per CTA (8: a 128-byte line of each row; 4: half of one, fp8 only).
template <class TState, int K, int kGroups = 8>
struct VLastRows {
  static_assert(kGroups == 8 || (kGroups == 4 && sizeof(TState) == 1), "half-line pieces: fp8 pools only");
  static constexpr int kVec = 16 / int(sizeof(TState));  // columns per lane and row: 16 bytes
  static constexpr int kCols = kGroups * kVec;           // columns per CTA: a 128- or 64-byte piece of each row
  static constexpr int kPhases = 32 / kGroups;           // row phases: lanes of a column group
  static constexpr int kRowsPerWarp = 32;
  static constexpr int kRowsPerLane = kRowsPerWarp / kPhases;  // 8 (kGroups 8: 32 registers as loaded) or 4
  static constexpr int kWarps = K / kRowsPerWarp;
  static_assert(K % kRowsPerWarp == 0 && kWarps >= 1 && kWarps <= 4, "V-last decode: K = 64 or 128");
  // fp8 line pieces read each row again for the update: held across the CTA's sums they took 168 registers (12 warps
  // per SM, with spill), read again at most 128 (16 warps)
  static constexpr bool kRowsReadAgain = sizeof(TState) == 1 && kGroups == 8;
  // resident CTAs per SM: 24, 20 or 16 warps for fp32, bf16 or fp8 state (vlast_decode_kernel)
  static constexpr int kCtasPerSm = (sizeof(TState) == 4 ? 24 : sizeof(TState) == 2 ? 20 : 16) / kWarps;
};

// 16 bytes read again from global memory (L1): an asm load, so that the compiler keeps no earlier read of them alive.
__device__ __forceinline__ uint4 load_again(const void* p) {
  uint4 r;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

// N values over aligned groups of kLanes consecutive lanes (N >= kLanes, powers of two; dtype.cuh's
// transpose_group_sum covers N <= kLanes, and one function for both makes ptxas branch here): halving
// butterflies, log2(kLanes) steps of N/2, N/4, ... shuffles. Afterwards x[0 .. N/kLanes - 1] of lane l
// are the group sums of values index .. index + N/kLanes - 1; returns index.
template <int N, int kLanes>
__device__ __forceinline__ int transpose_group_sums(float (&x)[N], int lane) {
  static_assert(N >= kLanes && kLanes >= 2 && (N & (N - 1)) == 0 && (kLanes & (kLanes - 1)) == 0, "powers of two");
  int index = 0, n = N;
#pragma unroll
  for (int off = kLanes / 2; off >= 1; off /= 2) {
    n /= 2;
    const bool upper = (lane & off) != 0;  // this lane keeps the upper half
#pragma unroll
    for (int m = 0; m < N / 2; ++m) {
      if (m >= n) break;
      const float send = upper ? x[m] : x[m + n];
      const float keep = upper ? x[m + n] : x[m];
      x[m] = keep + __shfl_xor_sync(0xffffffffu, send, off);
    }
    if (upper) index += n;
  }
  return index;
}

// The CTA's sums of its columns through shared memory (V-last decode and chains): this lane's kMine sums after
// transpose_group_sums (`first`: the index of the first; index e: S^T k of column cg kVec + e, or S^T q of column
// cg kVec + e - kVec) to the warp's rows of part ([S^T k, S^T q][warp][column]).
template <int kVec, int kMine, int kWarps, int kCols>
__device__ __forceinline__ void store_partial_sums(float (&part)[2][kWarps][kCols], const float* x, int first, int w,
                                                   int cg) {
#pragma unroll
  for (int m = 0; m < kMine; ++m) {
    const int e = first + m;
    part[e / kVec][w][cg * kVec + e % kVec] = x[m];
  }
}
// After the CTA's barrier: u of this lane's kVec columns from the warps' S^T k, and (writes_o) o of them from their
// S^T q, column c's by store_o(c, value).
template <int kVec, int kWarps, int kCols, class StoreO>
__device__ __forceinline__ void column_u_and_o(const float (&part)[2][kWarps][kCols], int cg, bool writes_o,
                                               const float* v, float beta, float decay, float rk, float rq, float kq_n,
                                               float* u, StoreO store_o) {
#pragma unroll
  for (int c = 0; c < kVec; ++c) {
    float dk = 0.0f;
#pragma unroll
    for (int ww = 0; ww < kWarps; ++ww) dk += part[0][ww][cg * kVec + c];
    u[c] = beta * (v[c] - decay * (dk * rk));
  }
  if (writes_o) {
#pragma unroll
    for (int c = 0; c < kVec; ++c) {
      float dq = 0.0f;
#pragma unroll
      for (int ww = 0; ww < kWarps; ++ww) dq += part[1][ww][cg * kVec + c];
      store_o(c, fmaf(kq_n, u[c], decay * (dq * rq)));
    }
  }
}

// Resident warps per SM: fp32 state 24 (80 registers; at 64 ptxas spills and decode runs slower), bf16
// state 20 (96 registers: A_log and dt_bias load early; at 80 ptxas spills), fp8 state 16 (at most 128 registers: line
// pieces read each row again for the update, holding them took 168; half-line pieces at 96 spill). docs/design/decode.md
// "V-last decode".
template <class TState, class TInput, int K, int V, int kGroups = 8>
__global__ void __launch_bounds__(VLastRows<TState, K, kGroups>::kWarps * 32, VLastRows<TState, K, kGroups>::kCtasPerSm)
    vlast_decode_kernel(const RecurrentParams p, const bool prefetch) {
  using R = VLastRows<TState, K, kGroups>;
  constexpr int kVec = R::kVec, kCols = R::kCols, kRowsPerLane = R::kRowsPerLane, kWarps = R::kWarps;
  constexpr int kPhases = R::kPhases;
  constexpr bool kFp8 = sizeof(TState) == 1;
  static_assert(!kFp8 || kVec == kFp8Block / 2, "V-last fp8: a lane's row piece is half a scale block");
  constexpr int kColCtas = V / kCols;
  constexpr int64_t kHeadElems = int64_t(K) * V;
  __shared__ __align__(16) float partial[2][kWarps][kCols];  // per warp: S^T k, S^T q of the CTA's columns

  const int lane = int(threadIdx.x) % 32, w = int(threadIdx.x) / 32;
  const int cg = lane / kPhases, ro = lane % kPhases;
  const int b = int(blockIdx.y), hv = int(blockIdx.x / unsigned(kColCtas));
  const int c0 = int(blockIdx.x % unsigned(kColCtas)) * kCols;  // the CTA's first column
  const int col = c0 + cg * kVec;                                // this lane's first column
  const int row0 = w * R::kRowsPerWarp + ro;                     // this lane's rows: row0 + kPhases i
  const int hq = qk_head(p, hv);  // GVA
  const bool counter = hv == 0 && c0 == 0 && threadIdx.x == 0 && p.error_flag != nullptr;
  TState* const head = static_cast<TState*>(p.state.data) + int64_t(hv) * kHeadElems;  // + slot * slot_stride

  // Before the wait: prefetch mode as in warp_kernel.cuh (one row's piece per thread; fp8: and the head's scale
  // bytes, K V / 32 of them, a line per thread).
  int spec = -1;
  if (prefetch) {
    spec = __ldcg(p.state_indices + b);
    if (spec >= 0 && spec < p.state.num_slots) {
      for (int r = int(threadIdx.x); r < K; r += kWarps * 32)
        prefetch_l2(head + int64_t(spec) * p.state.slot_stride + int64_t(r) * V + c0, unsigned(kCols * sizeof(TState)));
      if constexpr (kFp8) {
        constexpr int kScaleLines = (K * (V / kFp8Block) + 127) / 128;
        if (int(threadIdx.x) < kScaleLines)
          prefetch_l2_line(p.state.scales + (int64_t(spec) * p.heads.num_v_heads + hv) * (kHeadElems / kFp8Block) +
                           128 * int(threadIdx.x));
      }
    } else {
      spec = -1;
    }
    if (w == 0) prefetch_token_inputs<TInput>(p, b, hq, hv, c0, K, kCols, lane);
  }
  pdl_wait_and_launch_dependents();

  const int slot = p.state_indices[b];
  // The lane's rows as loaded (bf16: two values a register), converted to fp32 where used; fp8: their blocks' scale
  // bytes beside them.
  RawVec<TState, kVec> s[kRowsPerLane];
  [[maybe_unused]] uint32_t sbyte[kFp8 ? kRowsPerLane : 1];
  constexpr int64_t kHeadBlocks = kHeadElems / kFp8Block;
  const auto load = [&](int sl) {
    const TState* t = head + int64_t(sl) * p.state.slot_stride + int64_t(row0) * V + col;
#pragma unroll
    for (int i = 0; i < kRowsPerLane; ++i) s[i].load(t + int64_t(kPhases * i) * V);
    if constexpr (kFp8) {
      const uint8_t* sc = p.state.scales + (int64_t(sl) * p.heads.num_v_heads + hv) * kHeadBlocks +
                          int64_t(row0) * (V / kFp8Block) + col / kFp8Block;
#pragma unroll
      for (int i = 0; i < kRowsPerLane; ++i) sbyte[i] = sc[kPhases * i * (V / kFp8Block)];
    }
  };
  if (spec >= 0) load(spec);  // beside the index; replaced below if the index differs

  // Token b: the q/k norms and k . q (each warp over all K entries), the gates, then the k and q entries
  // of this lane's rows and v of its columns. Reduced as they arrive, so that only what the step needs
  // stays live beside the state.
  const TInput* kp = static_cast<const TInput*>(p.k.data) + int64_t(b) * p.k.token_stride + int64_t(hq) * p.k.head_stride;
  const TInput* qp = static_cast<const TInput*>(p.q.data) + int64_t(b) * p.q.token_stride + int64_t(hq) * p.q.head_stride;
  const TInput* vp = static_cast<const TInput*>(p.v.data) + int64_t(b) * p.v.token_stride + int64_t(hv) * p.v.head_stride;
  // The gate inputs go out with k and q, not after their reductions; with bf16 state A_log and dt_bias too
  // (with fp32 state that spills at 80 registers, so fp32 loads them at the math).
  constexpr bool kEarlyHeadGates = sizeof(TState) == 2;
  const GateBits gate_bits = token_gate_bits(p.gating, b, hv);
  HeadGates hg{0.0f, 0.0f};
  if constexpr (kEarlyHeadGates) hg = head_gates(p.gating, hv);
  TInput kl[K / 32], ql[K / 32];
#pragma unroll
  for (int j = 0; j < K / 32; ++j) kl[j] = kp[lane + 32 * j], ql[j] = qp[lane + 32 * j];
  // The state's loads wait for the norms (issued earlier, the state would be live across the reductions and
  // spill). Outside prefetch mode its lines are asked of L2 here, once the index arrives (each thread one
  // row's 128-byte piece), so the loads below find them in L2 or on their way. Prefetch mode skips the block
  // as a whole: a condition on `slot` there would make the norms wait for the index.
  static_assert(kWarps * 32 == K, "one row per thread");
  if (!prefetch) {
    if (slot >= 0 && slot < p.state.num_slots)
      prefetch_l2_line(head + int64_t(slot) * p.state.slot_stride + int64_t(threadIdx.x) * V + c0);
  }
  float kk = 0.0f, qq = 0.0f, kq = 0.0f;
#pragma unroll
  for (int j = 0; j < K / 32; ++j) {
    const float kn = to_float(kl[j]), qn = to_float(ql[j]);
    kk = fmaf(kn, kn, kk), qq = fmaf(qn, qn, qq), kq = fmaf(kn, qn, kq);
  }
  const auto [rk, rq, kq_n] = qk_norms(p.heads, K, kk, qq, kq);
  float g, beta;
  if constexpr (!kEarlyHeadGates) hg = head_gates(p.gating, hv);
  gate_log_values(p.gating, hg, gate_bits, g, beta);
  const float decay = expf(g);
  float kr[kRowsPerLane], qr[kRowsPerLane], v[kVec];
#pragma unroll
  for (int i = 0; i < kRowsPerLane; ++i)
    kr[i] = to_float(kp[row0 + kPhases * i]), qr[i] = to_float(qp[row0 + kPhases * i]);
#pragma unroll
  for (int c = 0; c < kVec; ++c) v[c] = to_float(vp[col + c]);

  TInput* const o = static_cast<TInput*>(p.o.data) + int64_t(b) * p.o.token_stride + int64_t(hv) * p.o.head_stride;
  const bool bad = slot >= p.state.num_slots;
  if (bad || slot < 0) {  // padding row, or a slot past the pool: o = 0, no state traffic
    if (bad && counter) atomicAdd(p.error_flag, 1);
    // fp8 at K = 64: two columns a thread
    for (int c = int(threadIdx.x); c < kCols; c += kWarps * 32) o[c0 + c] = from_float<TInput>(0.0f);
    return;
  }
  if (spec != slot) load(slot);

  // This lane's share of S^T k (x[c]) and S^T q (x[kVec + c]) over its rows, then over its column group.
  float x[2 * kVec] = {};
#pragma unroll
  for (int i = 0; i < kRowsPerLane; ++i) {
    float si[kVec];
    float ki = kr[i], qi = qr[i];
    if constexpr (kFp8) {
      unpack_e4m3x16(s[i].w[0], si);  // S / scale: the scale rides on the row's k and q entries
      const float sc = e8m0_scale(sbyte[i]);
      ki *= sc, qi *= sc;
    } else {
      s[i].to_floats(si);
    }
#pragma unroll
    for (int c = 0; c < kVec; ++c) x[c] = fmaf(si[c], ki, x[c]), x[kVec + c] = fmaf(si[c], qi, x[kVec + c]);
  }
  constexpr int kMine = 2 * kVec / kPhases;  // sums this lane holds after the butterfly
  const int first = transpose_group_sums<2 * kVec, kPhases>(x, lane);
  store_partial_sums<kVec, kMine>(partial, x, first, w, cg);
  __syncthreads();

  float u[kVec];
  column_u_and_o<kVec>(partial, cg, w == 0 && ro == 0, v, beta, decay, rk, rq, kq_n, u,
                       [&](int c, float value) { o[col + c] = from_float<TInput>(value); });
  TState* const t = head + int64_t(slot) * p.state.slot_stride + int64_t(row0) * V + col;
#pragma unroll
  for (int i = 0; i < kRowsPerLane; ++i) {
    float si[kVec];
    // converted again here: the fp32 values of the sums above are not kept alive
    if constexpr (!R::kRowsReadAgain) s[i].opaque();
    if constexpr (kFp8) {
      if constexpr (R::kRowsReadAgain) unpack_e4m3x16(load_again(t + int64_t(kPhases * i) * V), si);
      else unpack_e4m3x16(s[i].w[0], si);
      const float ds = decay * e8m0_scale(sbyte[i]);  // decay (S / scale) scale = (decay scale) (S / scale)
#pragma unroll
      for (int c = 0; c < kVec; ++c) si[c] = fmaf(kr[i], u[c] * rk, ds * si[c]);
      uint32_t new_scale;
      *reinterpret_cast<uint4*>(t + int64_t(kPhases * i) * V) = quantize_e4m3x16<kPhases>(si, new_scale);
      if (cg % 2 == 0)
        p.state.scales[(int64_t(slot) * p.heads.num_v_heads + hv) * kHeadBlocks +
                       int64_t(row0 + kPhases * i) * (V / kFp8Block) + col / kFp8Block] = uint8_t(new_scale);
    } else {
      s[i].to_floats(si);
#pragma unroll
      for (int c = 0; c < kVec; ++c) si[c] = fmaf(kr[i], u[c] * rk, decay * si[c]);
      store_vec<TState, kVec>(t + int64_t(kPhases * i) * V, si);
    }
  }
}

}  // namespace gdnkit::cuda::recurrent
