// Verify of chains without an intermediate cache on K-last float8_e4m3 pools (docs/design/decode.md "fp8 pools"), on
// tensor cores: the state is the B operand of its products and the accumulator of its updates.
//
// A warp owns 16 columns of one value head (the rows of its updates' m16n8 steps). Lane (g, t) = (lane / 4, lane % 4)
// holds columns v0 + g and v0 + g + 8 at k = h K/2 + (K/8) t + j (h = 0, 1; j < K/8), kept as x with S = w x, one
// factor w a warp: x[j] is the C fragment of the update's n-tile j, and its pairs the B fragments of step j of the
// products; lanes t = 0..3 hold contiguous pieces of a column. Per group of up to four tokens:
//   products  P^T = [k_0 .. k_3, q_0 .. q_3] x^T in K/8 steps per 8 columns: the pool's x is e4m3 times a power
//             of two, exact in tf32 (block scales below about 2^-117 give fp32 subnormals, which tf32 steps need not
//             keep), and 16-bit k and q are exact too; after a group's updates x is split into hi + lo (two steps
//             each, ~2^-21 relative). The group's 8 x 8 Gram matrix of the same vectors in K/8 more steps
//             (exact products). P goes through a per-warp scratch to the lanes of its columns.
//   scalars   per column, u and o of the group's tokens from P and the Gram matrix (the WY form, G_t the decay product
//             from the group's start): g_t S_{t-1} k^_t = G_t rk_t w P_t + sum_{i<t} (G_t/G_i) rk_i rk_t
//             (k_i . k_t) u_i, u_t = beta_t (v_t - that), o_t = G_t rq_t w Q_t + sum_{i<=t} (G_t/G_i) rk_i rq_t
//             (k_i . q_t) u_i; every lane of a quad alike.
//   update    only where the state is stored (update_state) or a group follows: per token, x += (rk u / w) k in K/8
//             m16n8k4 steps whose k-dimension holds the coefficient's tf32 hi and lo parts (slots 0 and 1, the others
//             zero) against the token's k (~2^-21 relative); the decay goes into w (w below kMinBlockFactor, or a
//             coefficient not finite: x takes w first and w = 1, as fp8 decode).
//   store     the final state by block: the largest magnitude of a block's runs, the scale from w max|x|, x (w 2^-s)
//             converted.
// A form of this kernel that stores each token's state to an fp8 cache measured slower than fp8_chain.cuh
// (docs/design/decode.md "fp8 pools"), which keeps that case.
#pragma once

#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "cuda/arch/dtype.cuh"
#include "cuda/arch/fp8.cuh"
#include "cuda/arch/mma_sync.cuh"
#include "cuda/recurrent/row.cuh"
#include "cuda/recurrent/token.cuh"
#include "gdnkit/params.h"

namespace gdnkit::cuda::recurrent {

template <int K>
struct Fp8ChainMmaTile {
  static constexpr int kCols = 16;        // columns per warp: the rows of the updates' m16n8 steps
  static constexpr int kWarps = 4;        // neighbouring columns of one head per CTA
  static constexpr int kCtaCols = kCols * kWarps;
  static constexpr int kSteps = K / 8;    // k-steps of the products, n-tiles of the update
  static constexpr int kGroup = 4;        // tokens whose products share one pass over the state
  static_assert(K == 64 || K == 128, "fp8 chain on tensor cores: K in {64, 128}");
};

// A lane's runs of its columns (col0, col0 + 8) as e4m3 blocks, bytes and scales: run h of column col0 + 8r holds
// k = h K/2 + (K/8) t + j as x[j][2r + h]; a block is the runs of 32 / (K/8) neighbouring lanes (K = 128: t, t ^ 1),
// whose first lane writes the scale byte. Lanes t = 0..3 store a run's bytes as one contiguous piece.
template <int K>
__device__ __forceinline__ void store_fp8_rows(uint8_t* head, uint8_t* scales, int col0, int t,
                                               const float (&x)[K / 8][4], float w) {
  constexpr int kRun = K / 8, kLanes = kFp8Block / kRun;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int col = col0 + 8 * r;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float run[kRun];
#pragma unroll
      for (int j = 0; j < kRun; ++j) run[j] = x[j][2 * r + h];
      uint32_t words[kRun / 4], scale_byte;
      quantize_e4m3_factored<kRun, 1>(run, w, words, scale_byte);
      uint8_t* const dst = head + int64_t(col) * K + h * (K / 2) + kRun * t;
      if constexpr (kRun == 16)
        *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
      else
        *reinterpret_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
      if (t % kLanes == 0)
        scales[col * (K / kFp8Block) + (h * (K / 2) + kRun * t) / kFp8Block] = uint8_t(scale_byte);
    }
  }
}

template <class TInput, int K, int V>
__global__ void __launch_bounds__(Fp8ChainMmaTile<K>::kWarps * 32, 3)
    fp8_chain_mma_kernel(const RecurrentParams p, const bool write_state, const bool prefetch) {
  using Tile = Fp8ChainMmaTile<K>;
  constexpr int kSteps = Tile::kSteps, kGroup = Tile::kGroup;
  constexpr int kColCtas = V / Tile::kCtaCols;
  constexpr int64_t kHeadElems = int64_t(K) * V, kHeadBlocks = kHeadElems / kFp8Block;
  constexpr unsigned kAll = 0xffffffffu;
  static_assert(V % Tile::kCtaCols == 0, "fp8 chain: V a multiple of the CTA's columns");
  (void)prefetch;  // every grid runs the same way

  const int lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
  const int b = int(blockIdx.y), hv = int(blockIdx.x / unsigned(kColCtas));
  const int v0 = int(blockIdx.x % unsigned(kColCtas)) * Tile::kCtaCols + int(threadIdx.x) / 32 * Tile::kCols;
  const int col0 = v0 + g;  // this lane's columns: col0 and col0 + 8
  const int hq = qk_head(p, hv);  // GVA
  const int num_v_heads = p.heads.num_v_heads;
  const bool counts_errors = hv == 0 && v0 == 0 && lane == 0 && p.error_flag != nullptr;
  __shared__ __align__(16) float scratch[Tile::kWarps][Tile::kCols][8];  // per warp: a group's P, [column][vector]
  float(&pscr)[Tile::kCols][8] = scratch[threadIdx.x / 32];
  pdl_wait_and_launch_dependents();

  // ---- which tokens, which slots (the warp kernel's checks, in the CPU reference's order) --------
  VerifyRow vr;
  if (!verify_row<TInput, Tile::kCols>(p, b, hv, v0, lane, counts_errors, vr)) return;
  const RowLoads& row = vr.row;
  const int64_t tok0 = vr.tok0;
  const int len = vr.len;
  TInput* const o_row0 = static_cast<TInput*>(p.o.data) + tok0 * p.o.token_stride + int64_t(hv) * p.o.head_stride + v0;

  const TInput* const k_head =
      static_cast<const TInput*>(p.k.data) + tok0 * p.k.token_stride + int64_t(hq) * p.k.head_stride;
  const TInput* const q_head =
      static_cast<const TInput*>(p.q.data) + tok0 * p.q.token_stride + int64_t(hq) * p.q.head_stride;
  const TInput* const v_col = static_cast<const TInput*>(p.v.data) + tok0 * p.v.token_stride +
                              int64_t(hv) * p.v.head_stride + col0;
  // A group's inputs as loaded: lane (g, t)'s vector g (k_g, or q_{g-4}; zero past the group) at k run t, and v of
  // its columns; group 0's issued beside the state's loads, converted where used.
  struct GroupInputs {
    RawVec<TInput, kSteps> vec[2];  // k = h K/2 + kSteps t ..
    TInput v[2][kGroup];
  };
  const auto load_group = [&](int t0) {
    GroupInputs in;
    const int G = min(kGroup, len - t0), tau = g & 3;
    const TInput* const src = (g < 4 ? k_head + int64_t(t0 + tau) * p.k.token_stride
                                     : q_head + int64_t(t0 + tau) * p.q.token_stride) + kSteps * t;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (tau < G) in.vec[h].load(src + h * (K / 2));
      else
#pragma unroll
        for (int i = 0; i < int(sizeof(in.vec[h].w) / sizeof(in.vec[h].w[0])); ++i) in.vec[h].w[i] = {};
    }
#pragma unroll
    for (int i = 0; i < kGroup; ++i)
#pragma unroll
      for (int r = 0; r < 2; ++r)
        in.v[r][i] = i < G ? v_col[int64_t(t0 + i) * p.v.token_stride + 8 * r] : from_float<TInput>(0.0f);
    return in;
  };

  // ---- the state: x = e4m3 times its block's scale (exact), w = 1 ---------------------------------
  // x[j] is the C fragment of the update's n-tile j: column 2t + h of row g (h = 0, 1), then of row g + 8, at
  // k = h K/2 + (K/8) t + j: a lane holds two runs of each column, lanes t = 0..3 a contiguous piece of it, and a
  // lane's pair x[j][2r], x[j][2r + 1] is the B fragment of step j of a product with row g + 8r's column.
  uint8_t* const head = static_cast<uint8_t*>(p.state.data) + int64_t(row.slot) * p.state.slot_stride + hv * kHeadElems;
  uint8_t* const scales = p.state.scales + (int64_t(row.slot) * num_v_heads + hv) * kHeadBlocks;
  float x[kSteps][4];
  float w = 1.0f;
  using RunBytes = std::conditional_t<kSteps == 16, uint4, uint2>;  // a run's kSteps e4m3 bytes
  RunBytes raw[2][2];
  uint32_t sbyte[2][2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int col = col0 + 8 * r;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      raw[r][h] = *reinterpret_cast<const RunBytes*>(head + int64_t(col) * K + h * (K / 2) + kSteps * t);
      sbyte[r][h] = scales[col * (K / kFp8Block) + (h * (K / 2) + kSteps * t) / kFp8Block];
    }
  }
  const GroupInputs first = load_group(0);

  // The gates of token t0 + lane for the 32 tokens from t0, computed once per token and taken by shuffle.
  const HeadGates hg = head_gates(p.gating, hv);
  float lane_decay = 1.0f, lane_beta = 0.0f;
  const auto lane_gates = [&](int t0) {
    lane_decay = 1.0f, lane_beta = 0.0f;
    if (t0 + lane < len) {
      float gl;
      gate_log_values(p.gating, hg, token_gate_bits(p.gating, tok0 + t0 + lane, hv), gl, lane_beta);
      lane_decay = expf(gl);
    }
  };
  lane_gates(0);

#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float sc = e8m0_scale(sbyte[r][h]);
      const uint32_t* const wd = reinterpret_cast<const uint32_t*>(&raw[r][h]);
#pragma unroll
      for (int q = 0; q < kSteps / 4; ++q)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const float2 f = e4m3x2_to_float2(wd[q] >> (16 * hh));
          x[4 * q + 2 * hh][2 * r + h] = f.x * sc, x[4 * q + 2 * hh + 1][2 * r + h] = f.y * sc;
        }
    }

  // Per token: the update's k run (the B fragment of column g of every n-tile: k = (g % 2) K/2 + kSteps (g / 2) + j),
  // and o of column col0 + 8 t (lanes t < 2).
  const TInput* const k_upd = k_head + (g & 1) * (K / 2) + kSteps * (g >> 1);
  TInput* o_ptr = o_row0 + g + 8 * (t & 1);

  const float scale = p.heads.scale > 0.0f ? p.heads.scale : 1.0f / sqrtf(float(K));
  const bool norm = p.heads.use_qk_l2norm;

  // One group of tokens from t0 (its inputs `in`): a lambda called for group 0 (inputs loaded beside the state) and
  // in the loop over the others, so that group 0's inputs are not held across the loop.
  const auto run_group = [&](const int t0, const GroupInputs& in) {
    const int G = min(kGroup, len - t0);
    // x takes the tokens' updates for the final store or the next group
    const bool update = write_state || t0 + kGroup < len;

    // ---- P^T = [k; q] x^T (the group's vectors as A, the columns as B) and the Gram matrix [k; q] [k; q]^T, each in
    // two accumulation chains (half the dependent latency)
    float gram[4];
    float vv[2][kGroup];
    {
      uint32_t vf[2 * kSteps];
      {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float f[kSteps];
          in.vec[h].to_floats(f);
#pragma unroll
          for (int j = 0; j < kSteps; ++j) vf[h * kSteps + j] = __float_as_uint(f[j]);
        }
#pragma unroll
        for (int i = 0; i < kGroup; ++i)
#pragma unroll
          for (int r = 0; r < 2; ++r) vv[r][i] = to_float(in.v[r][i]);
      }
      float pacc[2][2][4] = {};  // [chain][columns v0 .. v0 + 7, v0 + 8 ..]
      float gacc[2][4] = {};
      if (t0 == 0) {  // the pool's values: exact in tf32
#pragma unroll
        for (int j = 0; j < kSteps; ++j) {
          const uint32_t va[4] = {vf[j], 0u, vf[kSteps + j], 0u};  // rows 8-15 empty
          mma_tf32(gacc[j & 1], va, vf[j], vf[kSteps + j]);
#pragma unroll
          for (int r = 0; r < 2; ++r)  // columns v0 + 8r ..
            mma_tf32(pacc[j & 1][r], va, __float_as_uint(x[j][2 * r]), __float_as_uint(x[j][2 * r + 1]));
        }
      } else {  // x = hi + lo
#pragma unroll
        for (int j = 0; j < kSteps; ++j) {
          const uint32_t va[4] = {vf[j], 0u, vf[kSteps + j], 0u};
          mma_tf32(gacc[j & 1], va, vf[j], vf[kSteps + j]);
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const uint32_t hi0 = __float_as_uint(x[j][2 * r]) & 0xffffe000u;
            const uint32_t hi1 = __float_as_uint(x[j][2 * r + 1]) & 0xffffe000u;
            mma_tf32(pacc[j & 1][r], va, __float_as_uint(x[j][2 * r] - __uint_as_float(hi0)),
                     __float_as_uint(x[j][2 * r + 1] - __uint_as_float(hi1)));
            mma_tf32(pacc[j & 1][r], va, hi0, hi1);
          }
        }
      }
      // P^T[vector g][column v0 + 8r + 2t + e] to the warp's scratch as [column][vector]
      __syncwarp();
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int e = 0; e < 2; ++e) pscr[8 * r + 2 * t + e][g] = pacc[0][r][e] + pacc[1][r][e];
#pragma unroll
      for (int e = 0; e < 4; ++e) gram[e] = gacc[0][e] + gacc[1][e];
      __syncwarp();
    }
    // P[r][n] of this lane's columns col0 + 8r (n < 4: k_n, else q_{n-4}) in the scratch, read where used;
    // Gram[m][n] from lane 4 m + n / 2, element n % 2
    const auto gram_of = [&](int m, int n) { return __shfl_sync(kAll, gram[n & 1], 4 * m + (n >> 1)); };

    // ---- the group's scalars (the same in every lane): the norms of k; each token's gates and coefficients where used
    float rk[kGroup];
#pragma unroll
    for (int i = 0; i < kGroup; ++i) rk[i] = norm ? rsqrtf(gram_of(i, i) + 1e-6f) : 1.0f;
    const float w0 = w;  // S = w0 x at the group's start: P's scale

    // ---- the tokens: u and o per column, then the state's update and its store
    float u[2][kGroup];
#pragma unroll
    for (int tau = 0; tau < kGroup; ++tau) {
      if (tau >= G) break;
      const int tk = t0 + tau;
      const float beta = __shfl_sync(kAll, lane_beta, tk % 32), gdt = __shfl_sync(kAll, lane_decay, tk % 32);
      const float rq = (norm ? rsqrtf(gram_of(4 + tau, 4 + tau) + 1e-6f) : 1.0f) * scale;
      float ckk[kGroup], cq[kGroup];  // tokens i < tau (i <= tau): (G_tau / G_i) rk_i rk_tau (k_i . k_tau), ...
      float decay = 1.0f;
#pragma unroll
      for (int i = tau; i >= 0; --i) {
        if (i < tau) ckk[i] = decay * rk[i] * rk[tau] * gram_of(i, tau);
        cq[i] = decay * rk[i] * rq * gram_of(i, 4 + tau);
        decay *= i == tau ? gdt : __shfl_sync(kAll, lane_decay, (t0 + i) % 32);
      }
      const float cp = decay * rk[tau] * w0, cqs = decay * rq * w0;  // decay = G_tau
      float o[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float gk = cp * pscr[g + 8 * r][tau];
#pragma unroll
        for (int i = 0; i < tau; ++i) gk = fmaf(ckk[i], u[r][i], gk);
        u[r][tau] = beta * (vv[r][tau] - gk);
        o[r] = cqs * pscr[g + 8 * r][4 + tau];
#pragma unroll
        for (int i = 0; i <= tau; ++i) o[r] = fmaf(cq[i], u[r][i], o[r]);
      }
      if (t < 2) *o_ptr = from_float<TInput>(t == 0 ? o[0] : o[1]);
      o_ptr += p.o.token_stride;
      if (!update) continue;

      // x += (rk u / w) k, w *= g: m16n8k4 steps whose k-dimension is the coefficient's hi and lo parts (slots 0
      // and 1; slots 2 and 3 zero) against the token's k
      RawVec<TInput, kSteps> kraw;
      kraw.load(k_upd + int64_t(tk) * p.k.token_stride);
      w *= gdt;
      float a[2];
      const float rw = rcp_approx_ftz(w);
      bool in_range = w >= kMinBlockFactor;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        a[r] = u[r][tau] * rk[tau] * rw;
        in_range = in_range && fabsf(a[r]) <= FLT_MAX;
      }
      if (!__all_sync(kAll, in_range)) {  // x takes w: S = x, w = 1
#pragma unroll
        for (int j = 0; j < kSteps; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) x[j][e] *= w;
#pragma unroll
        for (int r = 0; r < 2; ++r) a[r] = u[r][tau] * rk[tau];
        w = 1.0f;
      }
      uint32_t ua[2];  // slot t: A[row g + 8r][t]
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint32_t hi = __float_as_uint(a[r]) & 0xffffe000u;
        const uint32_t lo = __float_as_uint(a[r] - __uint_as_float(hi));
        ua[r] = t == 0 ? hi : (t == 1 ? lo : 0u);
      }
      float kf[kSteps];
      kraw.to_floats(kf);
#pragma unroll
      for (int j = 0; j < kSteps; ++j) mma_tf32_k4(x[j], ua, __float_as_uint(kf[j]));
    }
  };
  if (len > 0) run_group(0, first);
#pragma unroll 1
  for (int t0 = kGroup; t0 < len; t0 += kGroup) {
    if (t0 % 32 == 0) lane_gates(t0);
    run_group(t0, load_group(t0));
  }

  if (write_state) store_fp8_rows<K>(head, scales, col0, t, x, w);
}

}  // namespace gdnkit::cuda::recurrent
