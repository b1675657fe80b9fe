// Decode of K-last 16-bit pools (bf16 state with bf16 inputs; fp16 state with fp16 or bf16 inputs): the dot
// products on tensor cores.
//
// The warp kernel (warp_kernel.cuh) forms S^T k and S^T q of a warp's columns as per-lane FMAs plus a
// cross-lane reduction: with bf16 state a decode warp issues ~720 instructions for 2 KB of state, and at small B
// a call is one chain of dependent steps per warp (docs/design/decode.md "Tensor-core decode"). Here the two
// products are one mma.sync m16n8k16 per 16 rows of k: A = 16 columns of S (the warp's columns, as loaded from
// a K-last pool), B = [k q 0 ... 0] (n = 0: k, n = 1: q), accumulated in fp32 (bf16 x bf16 products are exact,
// as in the warp kernel, which converts both to fp32 before its FMAs; only the order of the additions differs).
//
// Lane l = 4 r + c holds columns v0 + r and v0 + r + 8, each as kChunks 16-byte chunks of k: chunk j covers
// k = 32 j + 8 c .. + 7 (a warp's load instruction reads 64 contiguous bytes of each of 8 columns). A dot
// product does not depend on the order of its terms, so mma step t (j = t / 2, half h = t % 2) takes, as the
// fragment's logical k columns (2c, 2c+1) and (2c+8, 2c+9), the lane's words 2h and 2h+1 of chunk j; the B
// fragment of lanes 0-3 (n = 0) and 4-7 (n = 1) holds k and q at exactly those k, so it is the same chunk of
// k or q. The accumulator then gives lane 4 r: S[:, v0+r] . k, . q, S[:, v0+r+8] . k, . q.
// The update is the warp kernel's, per value and in fp32 (S_new = exp(g) S + k (u rk), rounded once to the pool's
// dtype), so the pool's new values equal the warp kernel's up to the u that the sums' order changes.
// fp16 state with bf16 inputs: an mma takes both operands in one type. kTf32: both go to tf32 (fp16's 11 and bf16's
// 8 significant bits fit its 11, and its exponent is fp32's): m16n8k8 steps, each lane's word w of chunk j (two k)
// as the step's logical k columns c and c + 4, in two chains; 96 registers (at 80 ptxas spills and the calls run
// slower), so 20 warps per SM. Otherwise k and q enter the B fragment as fp16 after a power of two 2^-s that brings
// their norm under 1 (bf16's 8 significant bits fit fp16's 11: exact, down to components 2^-15 of the norm), the sums
// scaled back by 2^s, at 24 warps per SM: the heuristics take it where the tf32 grid does not fit twice.
// Everything else (PDL, prefetch mode, padding and out-of-range rows, GVA, norms) follows the warp kernel and
// shares its helpers (row.cuh, token.cuh); the gates use the SFU forms (dtype.cuh, fused_decay_fast: the outputs
// and the state are 16-bit here).
//
// Where it runs (heuristics.cpp chooses): grids that fit the GPU twice over, i.e. in prefetch mode with the next
// call's CTAs resident beside them. There it shortens each warp's dependent chain; on larger grids the time is
// the per-call ramp and drain and the memory system, not the instructions, and the warp kernel's tiles are
// faster (docs/design/decode.md "Tensor-core decode").
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/arch/dtype.cuh"
#include "cuda/arch/mma_sync.cuh"
#include "cuda/recurrent/row.cuh"
#include "cuda/recurrent/token.cuh"
#include "gdnkit/params.h"

namespace gdnkit::cuda::recurrent {

template <int K, int V>
struct MmaDecodeTile {
  static constexpr int kCols = 16;             // columns per warp: the mma's M (8 columns with rows 8-15 zero
                                               // would take twice the CTAs, and run slower)
  static constexpr int kWarps = 4;             // warps per CTA: neighbouring columns of one head
  static constexpr int kCtaCols = kCols * kWarps;
  static constexpr int kChunks = K / 32;       // 16-byte chunks per lane and column
  static constexpr int kSteps = K / 16;        // mma k-steps
  static_assert(K % 32 == 0 && V % kCtaCols == 0, "mma decode: K a multiple of 32, V of 64");
};

__device__ __forceinline__ uint32_t word_of(const uint4& x, int i) {
  return i == 0 ? x.x : i == 1 ? x.y : i == 2 ? x.z : x.w;
}

// The exponent s with 2^-s x below 1 for every component x of a vector whose squared norm is nn (0 for 0; 113 for
// an overflowed norm: components up to bf16's largest stay in fp16's range).
__device__ __forceinline__ int norm_exponent(float nn) {
  const int e = int((__float_as_uint(nn) >> 23) & 0xffu) - 127;  // nn in [2^e, 2^(e+1))
  return e == 128 ? 113 : nn > 0.0f ? (e + 1) / 2 + 1 : 0;
}

// Two packed 16-bit values (the lower in the low half) as fp32; bf16 by a shift and a mask, one instruction each
// (mma_sync.cuh unpack2's __bfloat1622float2 costs this kernel ~140 instructions more).
template <class T>
__device__ __forceinline__ float2 unpack_pair(uint32_t w) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&w));
  }
}

// 24 warps per SM (80 registers, no spills; at 72 registers ptxas spills and the calls run slower); kTf32 20.
template <class TState, class TInput, int K, int V, bool kTf32 = false>
__global__ void __launch_bounds__(MmaDecodeTile<K, V>::kWarps * 32, (kTf32 ? 20 : 24) / MmaDecodeTile<K, V>::kWarps)
    mma_decode_kernel(const RecurrentParams p, const bool prefetch) {
  static_assert(std::is_same_v<TState, TInput> ||
                    (std::is_same_v<TState, __half> && std::is_same_v<TInput, __nv_bfloat16>),
                "mma decode: bf16 state with bf16 inputs, fp16 state with fp16 or bf16 inputs");
  constexpr bool kConvertInputs = !std::is_same_v<TState, TInput>;
  static_assert(!kTf32 || kConvertInputs, "mma decode on tf32: fp16 state with bf16 inputs");
  using Tile = MmaDecodeTile<K, V>;
  constexpr int kCols = Tile::kCols, kChunks = Tile::kChunks, kSteps = Tile::kSteps;
  constexpr int kColCtas = V / Tile::kCtaCols;
  constexpr int64_t kHeadElems = int64_t(K) * V;

  const int lane = int(threadIdx.x) % 32, r = lane / 4, c = lane % 4;
  const int b = int(blockIdx.y), hv = int(blockIdx.x / unsigned(kColCtas));
  const int v0 = int(blockIdx.x % unsigned(kColCtas)) * Tile::kCtaCols + int(threadIdx.x) / 32 * kCols;
  const int hq = qk_head(p, hv);  // GVA
  const bool counter = hv == 0 && v0 == 0 && lane == 0 && p.error_flag != nullptr;
  // The warp's first column, and this lane's first element in it (column r, chunk 0).
  TState* const warp_block = static_cast<TState*>(p.state.data) + int64_t(hv) * kHeadElems + int64_t(v0) * K;
  const int lane_elem = r * K + 8 * c;

  // Before the wait: prefetch mode as in warp_kernel.cuh (the warp's 16 columns are one contiguous run).
  int spec = -1;
  if (prefetch) {
    spec = __ldcg(p.state_indices + b);
    if (spec >= 0 && spec < p.state.num_slots) {
      if (lane == 0) prefetch_l2(warp_block + int64_t(spec) * p.state.slot_stride, unsigned(kCols * K * sizeof(TState)));
    } else {
      spec = -1;
    }
    prefetch_token_inputs<TInput>(p, b, hq, hv, v0, K, kCols, lane);
  }
  pdl_wait_and_launch_dependents();

  const int slot = p.state_indices[b];
  uint4 s[2][kChunks];  // [column r / r + 8][chunk]
  const auto load = [&](int sl) {
    const TState* t = warp_block + int64_t(sl) * p.state.slot_stride + lane_elem;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int j = 0; j < kChunks; ++j) s[h][j] = *reinterpret_cast<const uint4*>(t + h * 8 * K + 32 * j);
  };
  if (spec >= 0) load(spec);  // beside the index; replaced below if the index differs

  // Token b's inputs. For the norms lane l holds k and q at kPer l .. kPer l + kPer - 1 (kPer = K / 32).
  const TInput* kp = static_cast<const TInput*>(p.k.data) + int64_t(b) * p.k.token_stride + int64_t(hq) * p.k.head_stride;
  const TInput* qp = static_cast<const TInput*>(p.q.data) + int64_t(b) * p.q.token_stride + int64_t(hq) * p.q.head_stride;
  const TInput* vp = static_cast<const TInput*>(p.v.data) + int64_t(b) * p.v.token_stride + int64_t(hv) * p.v.head_stride + v0;
  constexpr int kPer = K / 32;
  RawVec<TInput, kPer> kn, qn;
  kn.load(kp + kPer * lane), qn.load(qp + kPer * lane);
  // The B fragment's chunks: k in lanes 0-3, q in lanes 4-7, zero elsewhere.
  uint4 bf[kChunks];
  {
    const TInput* src = r == 0 ? kp : qp;
#pragma unroll
    for (int j = 0; j < kChunks; ++j)
      bf[j] = r < 2 ? *reinterpret_cast<const uint4*>(src + 32 * j + 8 * c) : make_uint4(0u, 0u, 0u, 0u);
  }
  const TInput v_lo = vp[r], v_hi = vp[r + 8];
  const GateBits gate_bits = token_gate_bits(p.gating, b, hv);
  const HeadGates hg = head_gates(p.gating, hv);

  TInput* const o = static_cast<TInput*>(p.o.data) + int64_t(b) * p.o.token_stride + int64_t(hv) * p.o.head_stride + v0;
  const bool bad = slot >= p.state.num_slots;
  if (bad || slot < 0) {  // padding row, or a slot past the pool: o = 0, no state traffic
    if (bad && counter) atomicAdd(p.error_flag, 1);
    if (lane < kCols) o[lane] = from_float<TInput>(0.0f);
    return;
  }
  if (spec != slot) load(slot);

  // q, k: L2 norms (eps inside the root), scale; k . q of the normalized vectors (warp_kernel.cuh).
  float kf[kPer], qf[kPer];
  kn.to_floats(kf), qn.to_floats(qf);
  float kk = 0.0f, qq = 0.0f, kq = 0.0f;
#pragma unroll
  for (int j = 0; j < kPer; ++j) kk = fmaf(kf[j], kf[j], kk), qq = fmaf(qf[j], qf[j], qq), kq = fmaf(kf[j], qf[j], kq);
  kk = warp_sum(kk), qq = warp_sum(qq), kq = warp_sum(kq);
  const auto [rk, rq, kq_n] = qk_factors(p.heads, K, kk, qq, kq);
  float g, beta;
  gate_log_values<true>(p.gating, hg, gate_bits, g, beta);
  const float decay = __expf(g);

  // bf16 k, q into an fp16 B fragment: times 2^-s of their own norm (lanes 0-3 k, 4-7 q), the sums times 2^s.
  float back_k = 1.0f, back_q = 1.0f;
  if constexpr (kConvertInputs && !kTf32) {
    const int sk = norm_exponent(kk), sq = norm_exponent(qq);
    const float down = ldexpf(1.0f, r == 0 ? -sk : -sq);
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      uint32_t w[4] = {bf[j].x, bf[j].y, bf[j].z, bf[j].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = unpack_pair<TInput>(w[i]);
        w[i] = pack2<__half>(f.x * down, f.y * down);
      }
      bf[j] = make_uint4(w[0], w[1], w[2], w[3]);
    }
    back_k = ldexpf(1.0f, sk), back_q = ldexpf(1.0f, sq);
  }

  // S^T [k q]: lane 4 r ends with d = (S[:, v0+r] . k, . q, S[:, v0+r+8] . k, . q).
  float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if constexpr (kTf32) {
    float e[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // the odd steps: two chains of dependent mma
#pragma unroll
    for (int t = 0; t < 2 * kSteps; ++t) {
      const int j = t / 4, w = t % 4;
      const float2 lo = unpack_pair<TState>(word_of(s[0][j], w)), hi = unpack_pair<TState>(word_of(s[1][j], w));
      const float2 kq2 = unpack_pair<TInput>(word_of(bf[j], w));
      const uint32_t a[4] = {__float_as_uint(lo.x), __float_as_uint(hi.x), __float_as_uint(lo.y),
                             __float_as_uint(hi.y)};
      if (t % 2) mma_tf32(e, a, __float_as_uint(kq2.x), __float_as_uint(kq2.y));
      else mma_tf32(d, a, __float_as_uint(kq2.x), __float_as_uint(kq2.y));
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) d[i] += e[i];
  } else {
#pragma unroll
    for (int t = 0; t < kSteps; ++t) {
      const int j = t / 2, w = 2 * (t % 2);
      const uint32_t a[4] = {word_of(s[0][j], w), word_of(s[1][j], w), word_of(s[0][j], w + 1),
                             word_of(s[1][j], w + 1)};
      mma<TState>(d, a, word_of(bf[j], w), word_of(bf[j], w + 1));
    }
  }
  if constexpr (kConvertInputs && !kTf32) d[0] *= back_k, d[2] *= back_k, d[1] *= back_q, d[3] *= back_q;
  const float u_lo = beta * (to_float(v_lo) - decay * (d[0] * rk));
  const float u_hi = beta * (to_float(v_hi) - decay * (d[2] * rk));
  if (c == 0) {
    o[r] = from_float<TInput>(fmaf(kq_n, u_lo, decay * (d[1] * rq)));
    o[r + 8] = from_float<TInput>(fmaf(kq_n, u_hi, decay * (d[3] * rq)));
  }
  const float uk[2] = {__shfl_sync(0xffffffffu, u_lo * rk, lane & ~3), __shfl_sync(0xffffffffu, u_hi * rk, lane & ~3)};

  // S_new = exp(g) S + k (u rk), per value in fp32, rounded once to the pool's dtype. k at this lane's chunks is
  // loaded again (lanes 0-3 just read it: L1) rather than kept from the B fragment, chunk by chunk between the
  // stores: loaded together ahead of the o stores, they would delay them.
  TState* const t = warp_block + int64_t(slot) * p.state.slot_stride + lane_elem;
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const uint4 kcj = *reinterpret_cast<const uint4*>(kp + 32 * j + 8 * c);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint32_t out[4];
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const float2 sv = unpack_pair<TState>(word_of(s[h][j], w)), kv = unpack_pair<TInput>(word_of(kcj, w));
        out[w] = pack2<TState>(fmaf(kv.x, uk[h], decay * sv.x), fmaf(kv.y, uk[h], decay * sv.y));
      }
      *reinterpret_cast<uint4*>(t + h * 8 * K + 32 * j) = make_uint4(out[0], out[1], out[2], out[3]);
    }
  }
}

}  // namespace gdnkit::cuda::recurrent
