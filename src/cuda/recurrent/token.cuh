// Per-token inputs shared by the recurrent kernels (warp_kernel.cuh, vlast_decode.cuh, chain_mma.cuh): the
// gate inputs of a token and their math (docs/semantics.md "The recurrence"), and decode's L2 prefetch of a token's
// inputs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/arch/dtype.cuh"
#include "gdnkit/params.h"

namespace gdnkit::cuda::recurrent {

// The raw gate inputs of token `tok` and value head hv: (a, b) of the fused form, or (g, beta), as the
// bits of their dtypes. Kept as bits until gate_log_values, so that a kernel can issue the loads long
// before their use without a conversion waiting on them right behind the load.
struct GateBits {
  uint32_t a, b;
};
__device__ __forceinline__ GateBits token_gate_bits(const Gating& gt, int64_t tok, int hv) {
  const bool fused = gt.mode == GateMode::kFused;
  const InView& x = fused ? gt.a : gt.g;
  const InView& y = fused ? gt.b : gt.beta;
  return {load_bits_dyn(x.data, x.dtype, tok * x.token_stride + hv * x.head_stride),
          load_bits_dyn(y.data, y.dtype, tok * y.token_stride + hv * y.head_stride)};
}

// The per-head parameters of the fused gating (A_log, dt_bias), for kernels that load them early.
struct HeadGates {
  float A_log, dt_bias;
};
__device__ __forceinline__ HeadGates head_gates(const Gating& gt, int hv) {
  if (gt.mode != GateMode::kFused) return {0.0f, 0.0f};
  return {gt.A_log[hv], gt.dt_bias != nullptr ? gt.dt_bias[hv] : 0.0f};
}

// The log-space decay g and beta from the raw inputs. kFast: the SFU forms (dtype.cuh, fused_decay_fast).
template <bool kFast = false>
__device__ __forceinline__ void gate_log_values(const Gating& gt, const HeadGates& hg, GateBits x, float& g,
                                                float& beta) {
  if (gt.mode == GateMode::kFused) {
    const float a = bits_to_float(x.a, gt.a.dtype), bb = bits_to_float(x.b, gt.b.dtype);
    g = kFast ? fused_decay_fast(hg.A_log, a, hg.dt_bias) : fused_decay(hg.A_log, a, hg.dt_bias);
    beta = kFast ? sigmoid_fast(bb) : sigmoid(bb);
  } else {
    g = bits_to_float(x.a, gt.g.dtype);
    beta = bits_to_float(x.b, gt.beta.dtype);
  }
}

// A chain's gates, lane l holding token t0 + l's for the 32 tokens from t0: computed once a token, taken by shuffle
// (the fp8 and V-last chain kernels).
struct LaneGates {
  float decay = 1.0f, beta = 0.0f;
  __device__ __forceinline__ void load(const Gating& gt, const HeadGates& hg, int64_t tok0, int t0, int len, int hv,
                                       int lane) {
    if (t0 + lane < len) {
      float gl;
      gate_log_values(gt, hg, token_gate_bits(gt, tok0 + t0 + lane, hv), gl, beta);
      decay = expf(gl);
    }
  }
};

// One token's q/k factors: rk = 1 / ||k|| and rq = scale / ||q|| (eps inside the root; 1 and scale without the L2
// norm), kq_n = k . q of the normalized vectors. The decode kernels scale their sums by these instead of normalizing
// k and q first.
struct QkNorms {
  float rk, rq, kq_n;
};
// From k.k, q.q and k.q summed over the head.
__device__ __forceinline__ QkNorms qk_factors(const HeadConfig& heads, int K, float kk, float qq, float kq) {
  const float scale = heads.scale > 0.0f ? heads.scale : 1.0f / sqrtf(float(K));
  const float rk = heads.use_qk_l2norm ? rsqrtf(kk + 1e-6f) : 1.0f;
  const float rq = (heads.use_qk_l2norm ? rsqrtf(qq + 1e-6f) : 1.0f) * scale;
  return {rk, rq, kq * rk * rq};
}
// From a lane's partial sums, reduced over the warp here.
__device__ __forceinline__ QkNorms qk_norms(const HeadConfig& heads, int K, float kk, float qq, float kq) {
  return qk_factors(heads, K, warp_sum(kk), warp_sum(qq), warp_sum(kq));
}

// Decode's token inputs into L2 (before griddepcontrol.wait): the q and k rows of head hq, the warp's
// v_elems values of v and the two gate inputs of token b. Lanes take one cache line each.
template <class TInput>
__device__ __forceinline__ void prefetch_token_inputs(const CommitParams& p, int64_t tok, int hq, int hv, int v0, int K,
                                                      int v_elems, int lane) {
  constexpr int kE = int(sizeof(TInput));
  int first = 0;  // the first lane of the next span
  const auto span = [&](const void* base, int64_t elem_off, int elem_size, int bytes) {
    const int i = lane - first;  // lines start, start + 128, ..., and the one holding the last byte
    if (i >= 0 && i <= bytes / 128)
      prefetch_l2_line(static_cast<const char*>(base) + elem_off * elem_size + (i * 128 < bytes ? i * 128 : bytes - 1));
    first += bytes / 128 + 1;
  };
  const auto gate = [&](const InView& x) {
    const int size = x.dtype == DType::kFloat32 ? 4 : 2;
    span(x.data, tok * x.token_stride + hv * x.head_stride, size, size);
  };
  span(p.k.data, tok * p.k.token_stride + int64_t(hq) * p.k.head_stride, kE, K * kE);
  span(p.q.data, tok * p.q.token_stride + int64_t(hq) * p.q.head_stride, kE, K * kE);
  span(p.v.data, tok * p.v.token_stride + int64_t(hv) * p.v.head_stride + v0, kE, v_elems * kE);
  const bool fused = p.gating.mode == GateMode::kFused;
  gate(fused ? p.gating.a : p.gating.g);
  gate(fused ? p.gating.b : p.gating.beta);
}

}  // namespace gdnkit::cuda::recurrent
