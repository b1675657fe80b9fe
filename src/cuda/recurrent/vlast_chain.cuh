// Verify of chains on V-last pools (fp32, bf16, fp16, float8_e4m3), with an intermediate cache or none
// (docs/design/decode.md "Verify of chains on V-last pools"). V-last decode's CTAs (vlast_decode.cuh) with the state
// kept in fp32 registers across the tokens, as the K-last fp8 chain kernel (fp8_chain.cuh) keeps its columns.
//
// A CTA owns kCols columns of one value head (64 of fp8, bf16 or fp16, 32 of fp32: VLastChainRows below) and K / 32
// warps split the rows: lane l holds the kVec columns col = c0 + kVec cg of rows 32 w + ro + kPhases i (cg = l /
// kPhases, ro = l % kPhases), one 16-byte load a row (fp8: half of a 32-column scale block, whose other half is lane
// l ^ kPhases's). Each row's values are kept as w x with one factor w a row (fp8: the same in both lanes of a block):
// the decay multiplies w, the update is one FFMA an element, x + (rk k_i / w) u, a stored row is w x (fp8: the block's
// scale from w max|x|), and a row whose w leaves [kMinBlockFactor, kMaxBlockFactor], or whose update factor is not
// finite, multiplies x by w first (fp8_chain.cuh's exact rewrites). Per token: the sums over k (S^T k, S^T q of the
// CTA's columns) over the lane's rows, then over the kPhases lanes of its column group (a halving butterfly), then
// over the warps through shared memory, double-buffered by the token's parity: one barrier a token. The next token's
// k, q and v entries are loaded while the update and the cache store run.
#pragma once

#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "cuda/arch/dtype.cuh"
#include "cuda/arch/fp8.cuh"
#include "cuda/recurrent/row.cuh"
#include "cuda/recurrent/token.cuh"
#include "cuda/recurrent/vlast_decode.cuh"
#include "gdnkit/params.h"

namespace gdnkit::cuda::recurrent {

// A lane's rows of 16 bytes: 4 of 16 fp8 columns (CTAs of 64 columns, half-line pieces), 8 of 8 bf16 / fp16 columns
// (64) or of 4 fp32 columns (32): 64 values a lane (fp32: 32).
template <class TState, int K>
using VLastChainRows = VLastRows<TState, K, sizeof(TState) == 1 ? 4 : 8>;

// 168 registers at K = 128 (fp32 state: 128): 12 warps per SM (16).
template <class TState, class TCache, class TInput, int K, int V, bool kCache>
__global__ void __launch_bounds__(K, (sizeof(TState) == 4 ? 512 : 384) / K)
    vlast_chain_kernel(const RecurrentParams p, const bool write_state, const bool prefetch) {
  using R = VLastChainRows<TState, K>;
  constexpr int kVec = R::kVec, kCols = R::kCols, kRows = R::kRowsPerLane, kWarps = R::kWarps, kPhases = R::kPhases;
  constexpr bool kFp8 = sizeof(TState) == 1;
  static_assert(!kFp8 || (kVec == kFp8Block / 2 && std::is_same_v<TCache, uint8_t>),
                "fp8: half a scale block a lane and row, an fp8 cache");
  static_assert(kFp8 || !std::is_same_v<TCache, uint8_t>, "an fp8 cache with fp8 states");
  static_assert(V % kCols == 0, "V-last chain: V a multiple of the CTA's columns");
  constexpr int kColCtas = V / kCols;
  constexpr int64_t kHeadElems = int64_t(K) * V, kHeadBlocks = kHeadElems / kFp8Block;
  __shared__ __align__(16) float partial[2][2][kWarps][kCols];  // [token parity][S^T k, S^T q][warp][column]
  (void)prefetch;  // every grid runs the same way

  const int lane = int(threadIdx.x) % 32, w = int(threadIdx.x) / 32;
  const int cg = lane / kPhases, ro = lane % kPhases;
  const int b = int(blockIdx.y), hv = int(blockIdx.x / unsigned(kColCtas));
  const int c0 = int(blockIdx.x % unsigned(kColCtas)) * kCols;  // the CTA's first column
  const int col = c0 + cg * kVec;                                // this lane's first column
  const int row0 = w * R::kRowsPerWarp + ro;                     // this lane's rows: row0 + kPhases i
  const int hq = qk_head(p, hv);  // GVA
  const int num_v_heads = p.heads.num_v_heads;
  const bool counts_errors = hv == 0 && c0 == 0 && threadIdx.x == 0 && p.error_flag != nullptr;
  pdl_wait_and_launch_dependents();

  // ---- which tokens, which slots (each warp zeroes o of 32 of the CTA's columns for a row it must not run) -------
  VerifyRow vr;
  if (!verify_row<TInput, 32>(p, b, hv, c0 + (kCols == 64 ? 32 * (w % 2) : 0), lane, counts_errors, vr)) return;
  const int64_t tok0 = vr.tok0;
  const int len = vr.len;

  // ---- the state: x as loaded (fp8: the e4m3 values), w = 1 (fp8: the block's scale) ------------------------------
  TState* const head =
      static_cast<TState*>(p.state.data) + int64_t(vr.row.slot) * p.state.slot_stride + hv * kHeadElems;
  [[maybe_unused]] uint8_t* const scales =
      kFp8 ? p.state.scales + (int64_t(vr.row.slot) * num_v_heads + hv) * kHeadBlocks : nullptr;
  const auto at = [&](int i) { return int64_t(row0 + kPhases * i) * V + col; };  // row i's piece, in elements
  float x[kRows][kVec], wr[kRows];
  {
    RawVec<TState, kVec> raw[kRows];
    [[maybe_unused]] uint32_t sbyte[kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      raw[i].load(head + at(i));
      if constexpr (kFp8) sbyte[i] = scales[at(i) / kFp8Block];
    }
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      if constexpr (kFp8) {
        unpack_e4m3x16(raw[i].w[0], x[i]), wr[i] = e8m0_scale(sbyte[i]);
      } else {
        raw[i].to_floats(x[i]), wr[i] = 1.0f;
      }
    }
  }

  const HeadGates hg = head_gates(p.gating, hv);
  LaneGates gates;
  gates.load(p.gating, hg, tok0, 0, len, hv, lane);

  // One token's inputs as loaded: the k and q entries of the head for the norms (K / 32 a lane), those of this lane's
  // rows, and v of its columns. A chain's tokens are consecutive rows: the pointers move by a row's stride each token.
  struct Token {
    TInput kn[K / 32], qn[K / 32], kr[kRows], qr[kRows], v[kVec];
  };
  const TInput* k_ptr = static_cast<const TInput*>(p.k.data) + tok0 * p.k.token_stride + int64_t(hq) * p.k.head_stride;
  const TInput* q_ptr = static_cast<const TInput*>(p.q.data) + tok0 * p.q.token_stride + int64_t(hq) * p.q.head_stride;
  const TInput* v_ptr =
      static_cast<const TInput*>(p.v.data) + tok0 * p.v.token_stride + int64_t(hv) * p.v.head_stride + col;
  const auto load_token = [&](bool advance) {  // advance: to the next token (not past the row's last)
    Token tk;
#pragma unroll
    for (int j = 0; j < K / 32; ++j) tk.kn[j] = k_ptr[lane + 32 * j], tk.qn[j] = q_ptr[lane + 32 * j];
#pragma unroll
    for (int i = 0; i < kRows; ++i) tk.kr[i] = k_ptr[row0 + kPhases * i], tk.qr[i] = q_ptr[row0 + kPhases * i];
#pragma unroll
    for (int c = 0; c < kVec; ++c) tk.v[c] = v_ptr[c];
    if (advance) k_ptr += p.k.token_stride, q_ptr += p.q.token_stride, v_ptr += p.v.token_stride;
    return tk;
  };
  TInput* o_ptr = static_cast<TInput*>(p.o.data) + tok0 * p.o.token_stride + int64_t(hv) * p.o.head_stride + col;

  // The row's cache entries: token t's state at entry t < num_steps.
  TCache* cache = nullptr;
  [[maybe_unused]] uint8_t* cache_scales = nullptr;
  int cached = 0;  // tokens whose state is stored
  if (kCache && vr.cache_slot >= 0) {
    cache = static_cast<TCache*>(p.intermediate.data) + int64_t(vr.cache_slot) * p.intermediate.slot_stride +
            hv * kHeadElems;
    if constexpr (kFp8)
      cache_scales =
          p.intermediate.scales + (int64_t(vr.cache_slot) * p.intermediate.num_steps * num_v_heads + hv) * kHeadBlocks;
    cached = len < p.intermediate.num_steps ? len : int(p.intermediate.num_steps);
  }

  Token cur;
  if (len > 0) cur = load_token(len > 1);
#pragma unroll 1
  for (int t = 0; t < len; ++t) {
    if (t % 32 == 0 && t > 0) gates.load(p.gating, hg, tok0, t, len, hv, lane);  // chains past 32 tokens
    float kk = 0.0f, qq = 0.0f, kq = 0.0f;
#pragma unroll
    for (int j = 0; j < K / 32; ++j) {
      const float kn = to_float(cur.kn[j]), qn = to_float(cur.qn[j]);
      kk = fmaf(kn, kn, kk), qq = fmaf(qn, qn, qq), kq = fmaf(kn, qn, kq);
    }
    const auto [rk, rq, kq_n] = qk_norms(p.heads, K, kk, qq, kq);
    const float decay = __shfl_sync(0xffffffffu, gates.decay, t % 32);
    const float beta = __shfl_sync(0xffffffffu, gates.beta, t % 32);

    // This lane's share of S^T k (s[c]) and S^T q (s[kVec + c]) over its rows (w applied per row: a lane's rows
    // have different blocks), then over its column group, then over the warps.
    float s[2 * kVec] = {}, kw[kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      kw[i] = to_float(cur.kr[i]);
      const float ki = kw[i] * wr[i], qi = to_float(cur.qr[i]) * wr[i];
#pragma unroll
      for (int c = 0; c < kVec; ++c) s[c] = fmaf(x[i][c], ki, s[c]), s[kVec + c] = fmaf(x[i][c], qi, s[kVec + c]);
    }
    float v[kVec];
#pragma unroll
    for (int c = 0; c < kVec; ++c) v[c] = to_float(cur.v[c]);
    // The next token's loads, once this one's are converted: they travel while the sums, the update and the cache
    // store run.
    cur = load_token(t + 2 < len);  // token t + 1 (past the row's end: its last token again)
    constexpr int kMine = 2 * kVec / kPhases;  // sums this lane holds after the butterfly
    const int first = transpose_group_sums<2 * kVec, kPhases>(s, lane);
    float(&part)[2][kWarps][kCols] = partial[t & 1];
    store_partial_sums<kVec, kMine>(part, s, first, w, cg);
    __syncthreads();

    float u[kVec];
    column_u_and_o<kVec>(part, cg, w == 0 && ro == 0, v, beta, decay, rk, rq, kq_n, u,
                         [&](int c, float value) { o_ptr[c] = from_float<TInput>(value); });
    o_ptr += p.o.token_stride;

    // w x_new = decay w x + (rk k_i) u: w *= decay, x += (rk k_i / w) u; where w falls below kMinBlockFactor or the
    // factor is not finite, x *= w first (w = 1).
    float r[kRows];
    bool in_range = true;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      wr[i] *= decay;
      r[i] = kw[i] * rk * rcp_approx_ftz(wr[i]);
      in_range = in_range && fabsf(r[i]) <= FLT_MAX && wr[i] >= kMinBlockFactor && wr[i] <= kMaxBlockFactor;
    }
    if (!in_range) {
#pragma unroll
      for (int i = 0; i < kRows; ++i)
        if (!(fabsf(r[i]) <= FLT_MAX && wr[i] >= kMinBlockFactor && wr[i] <= kMaxBlockFactor)) {
#pragma unroll
          for (int c = 0; c < kVec; ++c) x[i][c] *= wr[i];
          r[i] = kw[i] * rk, wr[i] = 1.0f;
        }
    }
#pragma unroll
    for (int i = 0; i < kRows; ++i)
#pragma unroll
      for (int c = 0; c < kVec; ++c) x[i][c] = fmaf(r[i], u[c], x[i][c]);
    if (kCache && t < cached) {
      if constexpr (kFp8) {
        uint4 bytes[kRows];
        uint32_t scale_bytes[kRows];
        quantize_e4m3_runs_rescale<kRows, kPhases>(x, wr, bytes, scale_bytes);
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
          *reinterpret_cast<uint4*>(cache + at(i)) = bytes[i];
          if (cg % 2 == 0) cache_scales[at(i) / kFp8Block] = uint8_t(scale_bytes[i]);
        }
        cache_scales += num_v_heads * kHeadBlocks;
      } else {
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
          float y[kVec];
#pragma unroll
          for (int c = 0; c < kVec; ++c) y[c] = wr[i] * x[i][c];
          store_vec<TCache, kVec>(cache + at(i), y);
        }
      }
      cache += num_v_heads * kHeadElems;
    }
  }

  if (write_state) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      if constexpr (kFp8) {
        uint32_t byte;
        *reinterpret_cast<uint4*>(head + at(i)) = quantize_e4m3x16<kPhases, true>(x[i], byte, wr[i]);
        if (cg % 2 == 0) scales[at(i) / kFp8Block] = uint8_t(byte);
      } else {
        float y[kVec];
#pragma unroll
        for (int c = 0; c < kVec; ++c) y[c] = wr[i] * x[i][c];
        store_vec<TState, kVec>(head + at(i), y);
      }
    }
  }
}

}  // namespace gdnkit::cuda::recurrent
