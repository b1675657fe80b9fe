// Decode (one token per sequence) on K-last pools with warp-independent CTAs: each warp owns one
// (sequence b, value head hv) and kRows consecutive rows v0 .. v0+kRows-1 of the K-last state
// ([V][K]: row v is the contiguous k-vector S[:, v]). No shared memory, no __syncthreads: a warp's
// state loads go out as soon as its slot index (loaded with q, k, v and the gates) arrives, while
// other warps of the SM compute.
//
// One token (SPEC.md "The recurrence"), q and k normalized (and q scaled) in registers, per row v:
//   d_k = S[:, v] . k      d_q = S[:, v] . q        (before the decay, reduced together)
//   u_v = beta * (v_v - exp(g) * d_k)
//   o_v = exp(g) * d_q + (k . q) * u_v            (= S_new[:, v] . q)
//   S_new[:, v] = exp(g) * S[:, v] + k * u_v      (rounded to the state dtype at the store)
//
// Lane mapping of a row: lane l holds K/32 elements as kChunks chunks of kVec contiguous k,
// k = c * 32 * kVec + l * kVec + j, so each chunk instruction of the warp covers 32 * kVec
// contiguous elements (whole 128-byte lines, or a whole 128/256-byte row for K = 64). q and k use the
// same mapping, so the dot products are per-lane FMAs plus one warp reduction.
//
// NOTES: tile choice (one place: DecodeTile).
// - kRows = 8 (4 for K = 256): every lane holds 32 fp32 state values (K/32 per row x kRows), which keeps
//   the kernel near 64 registers, so 32 warps fit an SM, each with kRows * K * sizeof(state) bytes of
//   state loads in flight (4 KB fp32 at K = 128: 128 KB per SM, several times what HBM latency needs).
//   More rows per warp amortize q/k/gates and the norms over more state but cost registers.
// - kWarps = 2: CTAs of 64 threads; 16 per SM fill the 32 warps (the SM holds at most 32 CTAs), and a
//   small CTA keeps the last wave short (a CTA is 2 x kRows rows of one head: 8 KB fp32 at K = 128).
//   Warps of a CTA take neighbouring row blocks of the same head, so a CTA reads one contiguous range.
// - ptxas (CUDA 13.0, sm_90a): 64 registers at K = 128, 48 at K = 64, 72 at K = 256, no spills. Each
//   lane r stores o[v0 + r] inside the row loop: keeping o in a register for one store after the loop
//   (a select per row) cost 8-32 bytes of spills at 64 registers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/check.h"
#include "cuda/common/dtype.cuh"
#include "gdnkit/params.h"

namespace gdnkit::cuda::recurrent {

// The tile, per K: the one place to change it (see the NOTES above).
template <int K>
struct DecodeTile {
  static constexpr int kRows = K <= 128 ? 8 : 4;  // state rows per warp: 32 fp32 values per lane (K = 64: 16)
  static constexpr int kWarps = 2;                // warps per CTA
  // __launch_bounds__ target in warps per SM: 32 -> 64 registers. K = 256 also holds 2 x 8 q/k values
  // per lane and spills at 64 (ptxas, sm_90a), so 28 there (72 registers).
  static constexpr int kMinWarpsPerSM = K <= 128 ? 32 : 28;
};

template <class TS, class TI, int K, int V>
void launch_decode_warp(const DecodeParams& p, Stream stream);

#ifdef GDNKIT_DECODE_WARP_DEFINE_KERNELS

// Where a lane's elements of one k-vector (a state row, q or k) sit.
template <class TS, int K>
struct WarpRowMap {
  static constexpr int kPer = K / 32;  // elements per lane: 2, 4, 8
  // Chunks at most 16 bytes of state, so a chunk instruction of the warp reads whole lines.
  static constexpr int kVec = kPer * int(sizeof(TS)) > 16 ? 16 / int(sizeof(TS)) : kPer;
  static constexpr int kChunks = kPer / kVec;
  static_assert(K % 32 == 0 && kPer % kVec == 0, "K must be a multiple of 32");
  __device__ static int k_of(int lane, int c) { return c * 32 * kVec + lane * kVec; }
};

// N contiguous elements, N * sizeof(T) in {4, 8, 16, 32} bytes, aligned to min(16, that) bytes: the pool
// slots, q/k/v/o rows and their strides are 16-byte aligned (validated) and a chunk offset is a
// multiple of its size. dtype.cuh's vectors cover 8-byte multiples; the 4-byte case is bf16/fp16 at K = 64.
template <class T, int N>
__device__ __forceinline__ void load_run(const T* __restrict__ p, float (&out)[N]) {
  if constexpr (N * sizeof(T) % 8 == 0) {
    load_vec<T, N>(p, out);
  } else {
    static_assert(N * sizeof(T) == 4, "runs are 4 bytes or whole 8-byte words");
    const uint32_t raw = *reinterpret_cast<const uint32_t*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int j = 0; j < N; ++j) out[j] = to_float(e[j]);
  }
}

template <class T, int N>
__device__ __forceinline__ void store_run(T* __restrict__ p, const float (&in)[N]) {
  if constexpr (N * sizeof(T) % 8 == 0) {
    store_vec<T, N>(p, in);
  } else {
    static_assert(N * sizeof(T) == 4, "runs are 4 bytes or whole 8-byte words");
    uint32_t raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int j = 0; j < N; ++j) e[j] = from_float<T>(in[j]);
    *reinterpret_cast<uint32_t*>(p) = raw;
  }
}

template <class TS, class TI, int K, int V, int kRows, int kWarps>
__global__ void __launch_bounds__(kWarps * 32, DecodeTile<K>::kMinWarpsPerSM / kWarps) decode_warp_kernel(const DecodeParams p) {
  using Map = WarpRowMap<TS, K>;
  constexpr int kVec = Map::kVec, kChunks = Map::kChunks;
  constexpr int kRowBlocks = V / kRows;  // row blocks per head
  static_assert(V % kRows == 0 && kRows <= 32, "kRows must divide V (one lane per row for v and o)");
  constexpr int64_t kHeadElems = int64_t(K) * V;

  const int lane = threadIdx.x % 32;
  // Warp w -> (b, hv, row block), row block fastest: the warps of a CTA read neighbouring rows.
  // The launcher checks that B * HV * kRowBlocks fits int32.
  const unsigned w = blockIdx.x * unsigned(kWarps) + threadIdx.x / 32;
  const unsigned HV = unsigned(p.heads.num_v_heads);
  if (w >= unsigned(p.batch) * HV * kRowBlocks) return;  // the last CTA's spare warp (whole warp)
  const int v0 = int(w % kRowBlocks) * kRows;
  const unsigned bh = w / kRowBlocks;
  const int hv = int(bh % HV), b = int(bh / HV);
  const int hq = hv / (int(HV) / p.heads.num_qk_heads);  // GVA
  const int64_t tok = b;                                  // decode: token b is sequence b's

  const int slot = p.state_indices[b];  // first: the state loads wait on it

  // Token data does not depend on the slot: issued before the slot arrives.
  const TI* qp = static_cast<const TI*>(p.q.data) + tok * p.q.token_stride + int64_t(hq) * p.q.head_stride;
  const TI* kp = static_cast<const TI*>(p.k.data) + tok * p.k.token_stride + int64_t(hq) * p.k.head_stride;
  const TI* vp = static_cast<const TI*>(p.v.data) + tok * p.v.token_stride + int64_t(hv) * p.v.head_stride + v0;
  float q[kChunks][kVec], k[kChunks][kVec];
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    load_run<TI, kVec>(qp + Map::k_of(lane, c), q[c]);
    load_run<TI, kVec>(kp + Map::k_of(lane, c), k[c]);
  }
  const float v_lane = lane < kRows ? to_float(vp[lane]) : 0.0f;  // lane r holds v[v0 + r]
  const Gating& gt = p.gating;
  float g, beta;
  if (gt.mode == GateMode::kFused) {
    const float a = load_dyn(gt.a.data, gt.a.dtype, tok * gt.a.token_stride + hv * gt.a.head_stride);
    const float bb = load_dyn(gt.b.data, gt.b.dtype, tok * gt.b.token_stride + hv * gt.b.head_stride);
    g = fused_decay(gt.A_log[hv], a, gt.dt_bias != nullptr ? gt.dt_bias[hv] : 0.0f);
    beta = sigmoid(bb);
  } else {
    g = load_dyn(gt.g.data, gt.g.dtype, tok * gt.g.token_stride + hv * gt.g.head_stride);
    beta = load_dyn(gt.beta.data, gt.beta.dtype, tok * gt.beta.token_stride + hv * gt.beta.head_stride);
  }

  const auto out = [&] {
    return static_cast<TI*>(p.o.data) + tok * p.o.token_stride + int64_t(hv) * p.o.head_stride + v0;
  };
  if (slot < 0 || slot >= p.state.num_slots) {  // padding row, or a slot past the pool: o = 0, no state I/O
    // A sequence's bad slot is counted once: by lane 0 of the warp owning rows 0.. of head 0.
    if (slot >= 0 && hv == 0 && v0 == 0 && lane == 0 && p.error_flag != nullptr) atomicAdd(p.error_flag, 1);
    if (lane < kRows) out()[lane] = from_float<TI>(0.0f);
    return;
  }

  // ---- the state rows: all loads issued before any use -----------------------------------------
  TS* const rows = static_cast<TS*>(p.state.data) + int64_t(slot) * p.state.slot_stride + int64_t(hv) * kHeadElems +
                   int64_t(v0) * K;
  float s[kRows][kChunks][kVec];  // s[r][c][j] = S[k_of(lane, c) + j][v0 + r]
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int c = 0; c < kChunks; ++c) load_run<TS, kVec>(rows + r * K + Map::k_of(lane, c), s[r][c]);

  // ---- q, k: L2 norms (eps inside the root), scale; k . q of the normalized vectors ---------------
  float kk = 0.0f, qq = 0.0f, kq = 0.0f;
#pragma unroll
  for (int c = 0; c < kChunks; ++c)
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      kk = fmaf(k[c][j], k[c][j], kk);
      qq = fmaf(q[c][j], q[c][j], qq);
      kq = fmaf(k[c][j], q[c][j], kq);
    }
  kk = warp_sum(kk);
  qq = warp_sum(qq);
  kq = warp_sum(kq);
  const float scale = p.heads.scale > 0.0f ? p.heads.scale : 1.0f / sqrtf(float(K));
  const float rk = p.heads.use_qk_l2norm ? 1.0f / sqrtf(kk + 1e-6f) : 1.0f;
  const float rq = (p.heads.use_qk_l2norm ? 1.0f / sqrtf(qq + 1e-6f) : 1.0f) * scale;
  const float kq_n = kq * rk * rq;
#pragma unroll
  for (int c = 0; c < kChunks; ++c)
#pragma unroll
    for (int j = 0; j < kVec; ++j) k[c][j] *= rk, q[c][j] *= rq;
  const float decay = expf(g);

  // ---- per row: dot products, output, update, store ------------------------------------------------
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    float dk = 0.0f, dq = 0.0f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c)
#pragma unroll
      for (int j = 0; j < kVec; ++j) dk = fmaf(s[r][c][j], k[c][j], dk), dq = fmaf(s[r][c][j], q[c][j], dq);
    dk = warp_sum(dk);
    dq = warp_sum(dq);
    const float u = beta * (__shfl_sync(0xffffffffu, v_lane, r) - decay * dk);
    const float o_r = fmaf(kq_n, u, decay * dq);
    if (lane == r) out()[r] = from_float<TI>(o_r);
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) s[r][c][j] = fmaf(k[c][j], u, decay * s[r][c][j]);
      store_run<TS, kVec>(rows + r * K + Map::k_of(lane, c), s[r][c]);
    }
  }
}

template <class TS, class TI, int K, int V>
void launch_decode_warp(const DecodeParams& p, Stream stream) {
  constexpr int kRows = DecodeTile<K>::kRows, kWarps = DecodeTile<K>::kWarps;
  if (p.batch <= 0 || p.heads.num_v_heads <= 0) return;
  const int64_t warps = int64_t(p.batch) * p.heads.num_v_heads * (V / kRows);
  if (warps > int64_t(INT32_MAX))
    throw Error(ErrorCode::kNotImplemented, "cuda decode: B*HV*V/" + std::to_string(kRows) + " = " +
                                                std::to_string(warps) + " warps do not fit a 32-bit index");
  const unsigned ctas = unsigned((warps + kWarps - 1) / kWarps);
  decode_warp_kernel<TS, TI, K, V, kRows, kWarps><<<ctas, kWarps * 32, 0, stream>>>(p);
  GDNKIT_CUDA_CHECK_LAUNCH();
}

// Explicit instantiations: one translation unit per state dtype, all input dtypes and dims.
#define GDNKIT_DECODE_WARP_INSTANTIATE_DIMS(TS, TI)                                   \
  template void launch_decode_warp<TS, TI, 64, 64>(const DecodeParams&, Stream);     \
  template void launch_decode_warp<TS, TI, 128, 128>(const DecodeParams&, Stream);   \
  template void launch_decode_warp<TS, TI, 256, 256>(const DecodeParams&, Stream);
#define GDNKIT_DECODE_WARP_INSTANTIATE(TS)                 \
  GDNKIT_DECODE_WARP_INSTANTIATE_DIMS(TS, float)           \
  GDNKIT_DECODE_WARP_INSTANTIATE_DIMS(TS, __nv_bfloat16)   \
  GDNKIT_DECODE_WARP_INSTANTIATE_DIMS(TS, __half)

#endif  // GDNKIT_DECODE_WARP_DEFINE_KERNELS

}  // namespace gdnkit::cuda::recurrent
