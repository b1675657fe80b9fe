// One token of the warp kernel (warp_kernel.cuh): its loads, then its step on the warp's state registers.
// The math is docs/design/decode.md "The per-token math"; which values each lane holds is warp_tile.cuh's.
//
// Per column v of the warp, with q and k as loaded and their norms applied to the sums:
//   d_k = S[:, v] . k      d_q = S[:, v] . q          (before the decay, reduced together)
//   u_v = beta * (v_v - exp(g) * rk * d_k)
//   o_v = exp(g) * rq * d_q + kq_n * u_v             (= S_new[:, v] . q of the normalized q)
//   S_new[:, v] = exp(g) * S[:, v] + k * (rk * u_v)  (rounded to the storage dtype at a store)
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/arch/dtype.cuh"
#include "cuda/recurrent/row.cuh"
#include "cuda/recurrent/token.cuh"
#include "cuda/recurrent/warp_tile.cuh"
#include "gdnkit/params.h"

namespace gdnkit::cuda::recurrent {

// The token step of one warp of warp_recurrent_kernel: load_token (a token's loads), apply (its math on the
// state), and what they read that does not change from token to token (the warp's heads and columns, the
// row's first token, the scale, the gates).
template <StateLayout kLayout, class TState, class TInput, int K, int V, RecurrentOp kOp, TileWidth kWidth>
struct WarpStep {
  using Tile = WarpTile<kLayout, TState, K, V, kWidth>;
  using Regs = typename Tile::Regs;
  static constexpr int kRows = Tile::kRows, kKPerLane = Tile::kKPerLane, kVec = Tile::kVec;
  static constexpr bool kDecode = kOp == RecurrentOp::kDecode, kRecompute = kOp == RecurrentOp::kRecompute;
  // Dot products per token: d_k of each column, and d_q unless replaying; each lands in kLanesPerSum lanes.
  static constexpr int kSums = kRecompute ? kRows : 2 * kRows, kLanesPerSum = 32 / kSums;
  static_assert(kRecompute || kRows * kLanesPerSum == 16, "d_q of column i sits 16 lanes above its d_k");
  // fp32-state decode loads its token inputs as volatile loads, so that ptxas does not sink them under the
  // slot checks, which wait for the index (docs/design/decode.md "Inputs held as loaded").
  static constexpr bool kPinnedInputs = kDecode && sizeof(TState) == 4;

  // One token's inputs as loaded, converted only in apply(): no conversion waits on them before the
  // state loads go out.
  struct Token {
    int x;  // local token index (o row)
    RawVec<TInput, kVec> k[kKPerLane / kVec], q[kKPerLane / kVec];  // this lane's k entries, runs of kVec
    TInput v_lane;  // v of the column whose sums this lane ends with (see apply)
    GateBits gate;  // decode: the raw gate inputs
  };

  // The row's values the step reads, by reference to the kernel's locals (as a lambda would capture them).
  const RecurrentParams& p;
  const int& lane;
  const int& hv;        // value head
  const int& hq;        // q/k head (GVA)
  const int& v0;        // the warp's first column
  const int64_t& tok0;  // the row's first token
  const float& scale;
  const HeadGates& decode_head_gates;  // decode: A_log, dt_bias, loaded beside the token's inputs
  // Multi-token ops: the gates of token `lane`, computed once per token rather than in every lane.
  const float& lane_decay;
  const float& lane_beta;
  Regs& s;  // the state (warp_tile.cuh)

  // The warp's columns of o at token `tok`.
  __device__ TInput* out_row(int64_t tok) const {
    return static_cast<TInput*>(p.o.data) + tok * p.o.token_stride + int64_t(hv) * p.o.head_stride + v0;
  }

  // The raw gate inputs of local token x (a, b of the fused form, or g, beta).
  __device__ GateBits gate_inputs(int x) const { return token_gate_bits(p.gating, tok0 + x, hv); }
  // The gates from the raw inputs: decay = exp(g), beta.
  __device__ void gate_math(GateBits x, float& decay, float& beta) const {
    float g;
    gate_log_values(p.gating, kDecode ? decode_head_gates : head_gates(p.gating, hv), x, g, beta);
    decay = expf(g);
  }

  // Local token x's loads.
  __device__ Token load_token(int x) const {
    const int64_t tok = tok0 + x;
    const TInput* kp = static_cast<const TInput*>(p.k.data) + tok * p.k.token_stride + int64_t(hq) * p.k.head_stride;
    const TInput* qp = static_cast<const TInput*>(p.q.data) + tok * p.q.token_stride + int64_t(hq) * p.q.head_stride;
    const TInput* vp =
        static_cast<const TInput*>(p.v.data) + tok * p.v.token_stride + int64_t(hv) * p.v.head_stride + v0;
    Token token;
    token.x = x;
#pragma unroll
    for (int j = 0; j < kKPerLane; j += kVec) {
      if (kPinnedInputs) {
        token.k[j / kVec].load_pinned(kp + Tile::k_of(lane, j));
        token.q[j / kVec].load_pinned(qp + Tile::k_of(lane, j));
      } else {
        token.k[j / kVec].load(kp + Tile::k_of(lane, j));
        if (!kRecompute) token.q[j / kVec].load(qp + Tile::k_of(lane, j));
      }
    }
    if (kPinnedInputs) {
      RawVec<TInput, 1> v;
      v.load_pinned(vp + (lane / kLanesPerSum) % kRows);
      token.v_lane = v.element(0);
    } else {
      token.v_lane = vp[(lane / kLanesPerSum) % kRows];
    }
    if (kDecode) token.gate = gate_inputs(x);
    return token;
  }

  // The token's step on the state s; writes its o when asked (verify's replayed ancestors do not).
  __device__ void apply(const Token& token, bool write_o) const {
    float k[kKPerLane], q[kKPerLane];
#pragma unroll
    for (int j = 0; j < kKPerLane; j += kVec) {
      token.k[j / kVec].to_floats(&k[j]);
      if (!kRecompute) token.q[j / kVec].to_floats(&q[j]);
    }
    // The norms scale the sums, not the vectors, so their reductions run beside the dot products'.
    float kk = 0.0f, qq = 0.0f, kq = 0.0f;
#pragma unroll
    for (int j = 0; j < kKPerLane; ++j) {
      kk = fmaf(k[j], k[j], kk);
      if (!kRecompute) qq = fmaf(q[j], q[j], qq), kq = fmaf(k[j], q[j], kq);
    }
    kk = warp_sum(kk);
    if (!kRecompute) qq = warp_sum(qq), kq = warp_sum(kq);
    // rsqrtf (MUFU.RSQ, ~1 ulp): far fewer instructions than an IEEE square root and divide.
    const float rk = p.heads.use_qk_l2norm ? rsqrtf(kk + 1e-6f) : 1.0f;
    const float rq = (p.heads.use_qk_l2norm ? rsqrtf(qq + 1e-6f) : 1.0f) * scale;
    const float kq_n = kq * rk * rq;
    float decay, beta;
    if (kDecode) {
      gate_math(token.gate, decay, beta);
    } else if (token.x < 32) {
      decay = __shfl_sync(0xffffffffu, lane_decay, token.x);
      beta = __shfl_sync(0xffffffffu, lane_beta, token.x);
    } else {  // tree tokens past 32
      gate_math(gate_inputs(token.x), decay, beta);
    }

    // The kSums dot products of the warp's columns (d_k of column i at i, d_q at kRows + i), reduced
    // together: lane l ends with sum number l / kLanesPerSum. Each column's (d_k, d_q) pair is folded at
    // once (the reduction's first step, across lanes l and l ^ 16: the lower half keeps d_k), so only
    // kRows partial sums are live at a time.
    float sums[kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      float dk = 0.0f, dq = 0.0f;
#pragma unroll
      for (int j = 0; j < kKPerLane; ++j) {
        dk = fmaf(s.get(i, j), k[j], dk);
        if (!kRecompute) dq = fmaf(s.get(i, j), q[j], dq);
      }
      if (kRecompute) {
        sums[i] = dk;
      } else {
        const bool upper = (lane & 16) != 0;
        sums[i] = (upper ? dq : dk) + __shfl_xor_sync(0xffffffffu, upper ? dk : dq, 16);
      }
    }
    const int sum_index = kRecompute ? transpose_group_sum<kRows, 32>(sums, lane)
                                     : (lane & 16 ? kRows : 0) + transpose_group_sum<kRows, 16>(sums, lane);
    // Lanes holding a d_k: u of that column (v_lane is that column's v).
    const float u_mine = beta * (to_float(token.v_lane) - decay * (sums[0] * rk));
    if (!kRecompute && write_o) {
      // Lanes holding a d_q take u from the lane holding the same column's d_k (kRows * kLanesPerSum = 16
      // lanes below) and one lane per column writes o.
      const float u_col = __shfl_xor_sync(0xffffffffu, u_mine, 16);
      if (sum_index >= kRows && lane % kLanesPerSum == 0)
        out_row(tok0 + token.x)[sum_index - kRows] = from_float<TInput>(fmaf(kq_n, u_col, decay * (sums[0] * rq)));
    }
    const float uk_mine = u_mine * rk;
    s.opaque();  // packed 16-bit state: unpacked again for the update (StateRegs)
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const float uk = __shfl_sync(0xffffffffu, uk_mine, i * kLanesPerSum);
#pragma unroll
      for (int j = 0; j < kKPerLane; j += 2)
        s.set2(i, j, fmaf(k[j], uk, decay * s.get(i, j)), fmaf(k[j + 1], uk, decay * s.get(i, j + 1)));
    }
  }

  // Loads, then math: the tree's tokens, whose next token is not known ahead.
  __device__ void load_and_apply(int x, bool write_o) const {
    const Token token = load_token(x);
    apply(token, write_o);
  }
};

}  // namespace gdnkit::cuda::recurrent
