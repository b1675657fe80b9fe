// Decode of K-last float8_e4m3 pools (docs/semantics.md "float8_e4m3 states"; docs/design/decode.md "fp8 pools").
//
// A warp owns kCols columns v of one value head (8, 16 or 32: heuristics.cpp fp8_decode_columns; column v =
// S[:, v], K e4m3 bytes, contiguous in a K-last pool).
// Lane l = kLanesPerCol g + c holds, for each of its kLoads columns v0 + kColsPerLoad i + g, the 16 bytes
// k = 16 c .. 16 c + 15: one 16-byte load per column, and each 32-element scale block is the pair of lanes
// (2m, 2m + 1) of a column group. Per column, in fp32 (the warp kernel's math, warp_step.cuh):
//   S = e4m3 x 2^(scale - 127)                      (exact in fp32)
//   d_k = S . k, d_q = S . q                        (per-lane sums of e4m3 x k times the lane's block scale,
//                                                    reduced over the column's lanes; e^g S as (e^g 2^s) e4m3)
//   u = beta (v - e^g rk d_k),  o = e^g rq d_q + kq_n u
//   S_new = e^g S + k (rk u) (32-column warps: as w (e4m3 + r k), w = e^g 2^s, one FFMA an element), then per
//   block: the scale from the block's largest magnitude (its exponent after rounding to 4 significant bits, minus 7:
//   the largest element lands on [128, 240]), each element x 2^-s rounded to nearest even; a block holding NaN or
//   an infinity gets the NaN scale (host_dtype.h quantize_e4m3_block, which the CPU backend stores: the same bytes
//   for the same fp32 values).
// Padding rows, out-of-range slots (counted), GVA, fused or given gates and the L2 norm as in the warp kernel
// (row.cuh, token.cuh); the gates by their SFU forms (token.cuh gate_log_values<true>: a few ulp, far inside
// the e4m3 state's rounding).
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "cuda/arch/dtype.cuh"
#include "cuda/arch/fp8.cuh"
#include "cuda/recurrent/row.cuh"
#include "cuda/recurrent/token.cuh"
#include "gdnkit/params.h"

namespace gdnkit::cuda::recurrent {

template <int K, int kColsPerWarp>
struct Fp8DecodeTile {
  static constexpr int kLanesPerCol = K / 16;             // 16 e4m3 bytes per lane and column
  static constexpr int kColsPerLoad = 32 / kLanesPerCol;  // columns one warp-wide load covers
  static constexpr int kCols = kColsPerWarp;              // columns per warp
  static constexpr int kLoads = kCols / kColsPerLoad;     // 16-byte state loads per lane
  static constexpr int kWarps = 4;                        // neighbouring columns of one head per CTA
  static constexpr int kCtaCols = kCols * kWarps;
  static_assert(K % 32 == 0 && kLanesPerCol >= 2 && kLoads >= 1 && kCols % kColsPerLoad == 0,
                "fp8 decode: K in {64, 128, 256}, whole loads of columns");
};

// The run of lane c of column col in a K-last fp8 pool (its 16 bytes k = 16 c .. 16 c + 15, one 16-byte access) and
// its block's scale byte (lanes 2m and 2m + 1 of a column share block m); head and scales at the head's column 0.
template <int K>
__device__ __forceinline__ void load_e4m3_run(const uint8_t* head, const uint8_t* scales, int col, int c, uint4& raw,
                                              uint32_t& scale) {
  raw = *reinterpret_cast<const uint4*>(head + int64_t(col) * K + 16 * c);
  scale = scales[col * (K / kFp8Block) + c / 2];
}
// The same run stored (the even lane of the pair writes the scale byte).
template <int K>
__device__ __forceinline__ void store_e4m3_run(uint8_t* head, uint8_t* scales, int col, int c, const uint4& bytes,
                                               uint32_t scale) {
  *reinterpret_cast<uint4*>(head + int64_t(col) * K + 16 * c) = bytes;
  if (c % 2 == 0) scales[col * (K / kFp8Block) + c / 2] = uint8_t(scale);
}

// A token's factors (qk_factors) from each lane's 16 k and q of a column, the sums reduced over the column's kLanes
// lanes.
template <int kLanes>
__device__ __forceinline__ QkNorms run_norms(const HeadConfig& heads, int K, const float (&kf)[16],
                                             const float (&qf)[16]) {
  float kk = 0.0f, qq = 0.0f, kq = 0.0f;
#pragma unroll
  for (int j = 0; j < 16; ++j) kk = fmaf(kf[j], kf[j], kk), qq = fmaf(qf[j], qf[j], qq), kq = fmaf(kf[j], qf[j], kq);
#pragma unroll
  for (int off = 1; off < kLanes; off <<= 1) {
    kk += __shfl_xor_sync(0xffffffffu, kk, off);
    qq += __shfl_xor_sync(0xffffffffu, qq, off);
    kq += __shfl_xor_sync(0xffffffffu, kq, off);
  }
  return qk_factors(heads, K, kk, qq, kq);
}

template <class TInput, int K, int V, int kColsPerWarp>
__global__ void __launch_bounds__(Fp8DecodeTile<K, kColsPerWarp>::kWarps * 32)
    fp8_decode_kernel(const RecurrentParams p, const bool prefetch) {
  using Tile = Fp8DecodeTile<K, kColsPerWarp>;
  constexpr int kLPC = Tile::kLanesPerCol, kCPL = Tile::kColsPerLoad, kLoads = Tile::kLoads;
  constexpr int kColCtas = V / Tile::kCtaCols;
  constexpr int64_t kHeadElems = int64_t(K) * V, kHeadBlocks = kHeadElems / kFp8Block;
  static_assert(V % Tile::kCtaCols == 0, "fp8 decode: V a multiple of the CTA's columns");
  // The factored update and quantization in the wide warps (large grids, bound by the schedulers' issue).
  constexpr bool kFactored = kColsPerWarp == 32;

  const int lane = int(threadIdx.x) % 32, c = lane % kLPC, g = lane / kLPC;
  const int b = int(blockIdx.y), hv = int(blockIdx.x / unsigned(kColCtas));
  const int v0 = int(blockIdx.x % unsigned(kColCtas)) * Tile::kCtaCols + int(threadIdx.x) / 32 * Tile::kCols;
  const int hq = qk_head(p, hv);  // GVA
  const bool counter = hv == 0 && v0 == 0 && lane == 0 && p.error_flag != nullptr;
  // Prefetch mode: the next call's state reaches L2 while the previous call runs (a hint; the loads follow the wait).
  if (prefetch) {
    const int spec = __ldcg(p.state_indices + b);
    if (spec >= 0 && spec < p.state.num_slots && lane == 0) {
      prefetch_l2(static_cast<const uint8_t*>(p.state.data) + int64_t(spec) * p.state.slot_stride + hv * kHeadElems +
                      int64_t(v0) * K,
                  unsigned(Tile::kCols * K));
      prefetch_l2_line(p.state.scales + (int64_t(spec) * p.heads.num_v_heads + hv) * kHeadBlocks +
                       v0 * (K / kFp8Block));  // at most 128 bytes
    }
    prefetch_token_inputs<TInput>(p, b, hq, hv, v0, K, Tile::kCols, lane);
  }
  pdl_wait_and_launch_dependents();

  const int slot = p.state_indices[b];
  // Token b's inputs: k and q at this lane's 16 k, v of its columns, the gates.
  const TInput* kp = static_cast<const TInput*>(p.k.data) + int64_t(b) * p.k.token_stride + int64_t(hq) * p.k.head_stride;
  const TInput* qp = static_cast<const TInput*>(p.q.data) + int64_t(b) * p.q.token_stride + int64_t(hq) * p.q.head_stride;
  const TInput* vp = static_cast<const TInput*>(p.v.data) + int64_t(b) * p.v.token_stride + int64_t(hv) * p.v.head_stride + v0;
  TInput* const o = static_cast<TInput*>(p.o.data) + int64_t(b) * p.o.token_stride + int64_t(hv) * p.o.head_stride + v0;
  const bool bad = slot >= p.state.num_slots;
  if (bad || slot < 0) {  // padding row, or a slot past the pool: o = 0, no state traffic
    if (bad && counter) atomicAdd(p.error_flag, 1);
    if (lane < Tile::kCols) o[lane] = from_float<TInput>(0.0f);
    return;
  }
  uint8_t* const head = static_cast<uint8_t*>(p.state.data) + int64_t(slot) * p.state.slot_stride + hv * kHeadElems;
  uint8_t* const scales = p.state.scales + (int64_t(slot) * p.heads.num_v_heads + hv) * kHeadBlocks;
  uint4 raw[kLoads];
  uint32_t sbyte[kLoads];
#pragma unroll
  for (int i = 0; i < kLoads; ++i) load_e4m3_run<K>(head, scales, v0 + kCPL * i + g, c, raw[i], sbyte[i]);
  RawVec<TInput, 16> kr, qr;
  kr.load(kp + 16 * c), qr.load(qp + 16 * c);
  TInput vv[kLoads];
#pragma unroll
  for (int i = 0; i < kLoads; ++i) vv[i] = vp[kCPL * i + g];
  const GateBits gate_bits = token_gate_bits(p.gating, b, hv);
  const HeadGates hg = head_gates(p.gating, hv);

  // Norms over the column group's lanes (each group holds all of k and q). k and q are converted to fp32 once and
  // held across the column loop (32 registers, against 32 conversions per column).
  float kf[16], qf[16];
  kr.to_floats(kf), qr.to_floats(qf);
  const auto [rk, rq, kq_n] = run_norms<kLPC>(p.heads, K, kf, qf);
  float gl, beta;
  gate_log_values<true>(p.gating, hg, gate_bits, gl, beta);
  const float decay = __expf(gl);

  float o_lane = 0.0f;  // kFactored: o of column kCPL c + g, run c's
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    float s[16];
    unpack_e4m3x16(raw[i], s);  // S / scale
    const float sc = e8m0_scale(sbyte[i]);
    float dk = 0.0f, dq = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; ++j) dk = fmaf(s[j], kf[j], dk), dq = fmaf(s[j], qf[j], dq);
    dk *= sc, dq *= sc;  // a column's lanes hold blocks of different scales: each lane's sums scaled first
#pragma unroll
    for (int off = 1; off < kLPC; off <<= 1) {
      dk += __shfl_xor_sync(0xffffffffu, dk, off);
      dq += __shfl_xor_sync(0xffffffffu, dq, off);
    }
    const float u = beta * (to_float(vv[i]) - decay * (dk * rk));
    if constexpr (kFactored) {
      if (c == i) o_lane = fmaf(kq_n, u, decay * (dq * rq));  // stored after the loop, one element a lane
    } else {
      if (c == 0) o[kCPL * i + g] = from_float<TInput>(fmaf(kq_n, u, decay * (dq * rq)));
    }
    const float uk = u * rk, ds = decay * sc;  // decay (S / scale) scale = (decay scale) (S / scale)
    float w = 1.0f;
    if constexpr (kFactored) {
      // S_new = ds (S / scale) + uk k kept as w (S / scale + r k), w = ds and r = uk / ds: one FFMA an element, w
      // applied with the new block's 2^-s. Where ds is below kMinBlockFactor (blocks of tiny scales, a decay near
      // zero) or r is not finite, w = 1 and S / scale is multiplied by ds first.
      float r = uk * rcp_approx_ftz(ds);
      w = ds;
      if (!(fabsf(r) <= FLT_MAX && ds >= kMinBlockFactor)) {
        r = uk, w = 1.0f;
#pragma unroll
        for (int j = 0; j < 16; ++j) s[j] *= ds;
      }
#pragma unroll
      for (int j = 0; j < 16; ++j) s[j] = fmaf(kf[j], r, s[j]);
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j) s[j] = fmaf(kf[j], uk, ds * s[j]);
    }
    uint32_t new_scale;
    const uint4 out = quantize_e4m3x16<1, kFactored>(s, new_scale, w);
    store_e4m3_run<K>(head, scales, v0 + kCPL * i + g, c, out, new_scale);
  }
  if constexpr (kFactored) {
    static_assert(Tile::kLoads <= Tile::kLanesPerCol, "a lane of each column group per run");
    if (c < kLoads) o[kCPL * c + g] = from_float<TInput>(o_lane);
  }
}

// Decode of a K-last float8_e4m3 pool (dispatch.cu); K = V in {64, 128, 256}.
void launch_fp8_decode(const RecurrentParams& p, Stream stream);
// Decode of a V-last float8_e4m3 pool (launch_vlast_fp8.cu, vlast_decode.cuh); K in {64, 128}, V in {128, 256}.
void launch_vlast_fp8_decode(const RecurrentParams& p, Stream stream);

}  // namespace gdnkit::cuda::recurrent
