// Verify of chains on K-last float8_e4m3 pools, with a float8_e4m3 intermediate cache or none (docs/design/decode.md
// "fp8 pools"; without a cache the library takes fp8_chain_mma.cuh, this kernel by override). The warp kernel's math
// (warp_step.cuh) on the fp8 decode kernel's lane map (fp8_decode.cuh), with the state kept in fp32 registers across
// the tokens.
//
// A warp owns 16 columns of one value head. Lane l = kLanesPerCol g + c holds, for run i < kRuns, the 16 k
// 16 c .. 16 c + 15 of column v0 + kColsPerLoad i + g (one 16-byte load or store a run; a scale block is a lane pair),
// so a token's fixed work (k and q in fp32, the gates) is shared by 64 values a lane (the warp kernel's regular tile:
// 32). Each run's values are kept as w x with one factor w a run (both lanes of a block hold the same): the decay is
// a multiply of w, the update one FFMA an element, x + (rk u / w) k, and a stored block's scale comes from w max|x|.
// Where the cache takes the token's state, x is rescaled to the block's new scale while it is quantized (the multiply
// the conversion needs anyway) and w becomes that scale, a power of two near the values. Without a store (no cache)
// w takes every decay; a run whose w falls below kMinBlockFactor, or whose update factor is not finite, multiplies x
// by w first (w = 1), as decode, so that x = S / w stays within 2^64 of S.
//
// Per token: k and q in fp32 (32 registers); the norms of kColsPerLoad tokens at once, token t0 + g by column group g;
// the 2 kRuns dot products reduced together over the column's lanes (transpose_group_reduce: lane c < kRuns ends with
// run c's d_k and holds its v, lane c + kRuns with its d_q and writes its o); then the update and the cache's blocks,
// each phase over all runs at once so that their dependent chains overlap. The kernel is bound by its instructions and
// their latencies: 168 registers (12 warps per SM) run it faster than 128 (16 warps, whose phases then serialize).
#pragma once

#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "cuda/arch/dtype.cuh"
#include "cuda/arch/fp8.cuh"
#include "cuda/recurrent/fp8_decode.cuh"
#include "cuda/recurrent/row.cuh"
#include "cuda/recurrent/token.cuh"
#include "gdnkit/params.h"

namespace gdnkit::cuda::recurrent {

template <int K>
struct Fp8ChainTile {
  static constexpr int kLanesPerCol = K / 16;             // 16 e4m3 bytes per lane and column
  static constexpr int kColsPerLoad = 32 / kLanesPerCol;  // columns one warp-wide load covers
  static constexpr int kCols = 16;                        // columns per warp
  static constexpr int kRuns = kCols / kColsPerLoad;      // 16-byte runs per lane (64 values at K = 128)
  static constexpr int kWarps = 4;                        // neighbouring columns of one head per CTA
  static constexpr int kCtaCols = kCols * kWarps;
  static_assert(2 * kRuns == kLanesPerCol, "K in {64, 128}: a column's lanes take its 2 kRuns sums one each");
};

// kCache: the rows' intermediate states go to a float8_e4m3 cache (rows with a cache slot); else no cache.
template <class TInput, int K, int V, bool kCache>
__global__ void __launch_bounds__(Fp8ChainTile<K>::kWarps * 32, 3)
    fp8_chain_kernel(const RecurrentParams p, const bool write_state, const bool prefetch) {
  using Tile = Fp8ChainTile<K>;
  constexpr int kLPC = Tile::kLanesPerCol, kCPL = Tile::kColsPerLoad, kRuns = Tile::kRuns;
  constexpr int kColCtas = V / Tile::kCtaCols;
  constexpr int64_t kHeadElems = int64_t(K) * V, kHeadBlocks = kHeadElems / kFp8Block;
  static_assert(V % Tile::kCtaCols == 0, "fp8 chain: V a multiple of the CTA's columns");
  (void)prefetch;  // every grid runs the same way

  const int lane = int(threadIdx.x) % 32, c = lane % kLPC, g = lane / kLPC;
  const int b = int(blockIdx.y), hv = int(blockIdx.x / unsigned(kColCtas));
  const int v0 = int(blockIdx.x % unsigned(kColCtas)) * Tile::kCtaCols + int(threadIdx.x) / 32 * Tile::kCols;
  const int hq = qk_head(p, hv);  // GVA
  const int num_v_heads = p.heads.num_v_heads;
  const bool counts_errors = hv == 0 && v0 == 0 && lane == 0 && p.error_flag != nullptr;
  pdl_wait_and_launch_dependents();

  // ---- which tokens, which slots (the warp kernel's checks, in the CPU reference's order) --------
  VerifyRow vr;
  if (!verify_row<TInput, Tile::kCols>(p, b, hv, v0, lane, counts_errors, vr)) return;
  const RowLoads& row = vr.row;
  const int64_t tok0 = vr.tok0;
  const int len = vr.len, cache_slot = vr.cache_slot;
  const auto out_row = [&](int t) {
    return static_cast<TInput*>(p.o.data) + (tok0 + t) * p.o.token_stride + int64_t(hv) * p.o.head_stride + v0;
  };

  // ---- the state: x = e4m3 bytes, w = the block's scale ------------------------------------------
  uint8_t* const head = static_cast<uint8_t*>(p.state.data) + int64_t(row.slot) * p.state.slot_stride + hv * kHeadElems;
  uint8_t* const scales = p.state.scales + (int64_t(row.slot) * num_v_heads + hv) * kHeadBlocks;
  float x[kRuns][16], w[kRuns];
  {
    uint4 raw[kRuns];
    uint32_t sbyte[kRuns];
#pragma unroll
    for (int i = 0; i < kRuns; ++i) load_e4m3_run<K>(head, scales, v0 + kCPL * i + g, c, raw[i], sbyte[i]);
#pragma unroll
    for (int i = 0; i < kRuns; ++i) unpack_e4m3x16(raw[i], x[i]), w[i] = e8m0_scale(sbyte[i]);
  }

  const HeadGates hg = head_gates(p.gating, hv);
  LaneGates gates;
  gates.load(p.gating, hg, tok0, 0, len, hv, lane);

  // One token's inputs as loaded: k and q at the lane's 16 k, v of the column whose d_k the lane ends with. A chain's
  // tokens are consecutive rows: the pointers move by a row's stride each token.
  struct Token {
    RawVec<TInput, 16> k, q;
    TInput v;
  };
  const TInput* const k_row0 =
      static_cast<const TInput*>(p.k.data) + tok0 * p.k.token_stride + int64_t(hq) * p.k.head_stride + 16 * c;
  const TInput* const q_row0 =
      static_cast<const TInput*>(p.q.data) + tok0 * p.q.token_stride + int64_t(hq) * p.q.head_stride + 16 * c;
  const TInput* k_ptr = k_row0;
  const TInput* q_ptr = q_row0;
  const TInput* v_ptr = static_cast<const TInput*>(p.v.data) + tok0 * p.v.token_stride +
                        int64_t(hv) * p.v.head_stride + v0 + kCPL * (c % kRuns) + g;
  const auto load_token = [&](bool advance) {  // advance: to the next token (not past the row's last)
    Token tk;
    tk.k.load(k_ptr), tk.q.load(q_ptr), tk.v = *v_ptr;
    if (advance) k_ptr += p.k.token_stride, q_ptr += p.q.token_stride, v_ptr += p.v.token_stride;
    return tk;
  };
  TInput* o_ptr = out_row(0) + kCPL * (c % kRuns) + g;  // lanes c >= kRuns: o of run c - kRuns

  // The row's cache entries: token t's state at entry t < num_steps.
  uint8_t* cache = nullptr;
  uint8_t* cache_scales = nullptr;
  int cached = 0;  // tokens whose state is stored
  if (kCache && cache_slot >= 0) {
    cache = static_cast<uint8_t*>(p.intermediate.data) + int64_t(cache_slot) * p.intermediate.slot_stride +
            hv * kHeadElems;
    cache_scales =
        p.intermediate.scales + (int64_t(cache_slot) * p.intermediate.num_steps * num_v_heads + hv) * kHeadBlocks;
    cached = len < p.intermediate.num_steps ? len : int(p.intermediate.num_steps);
  }

  // The norms of token t0 + g in the lanes of column group g, for the kColsPerLoad tokens from t0: each token's k and
  // q loaded, converted and summed by one group instead of by all of them.
  float group_rk = 1.0f, group_rq = 1.0f, group_kq = 0.0f;
  const auto group_norms = [&](int t0) {
    const int t = t0 + g < len ? t0 + g : len - 1;
    RawVec<TInput, 16> kr, qr;
    kr.load(k_row0 + int64_t(t) * p.k.token_stride), qr.load(q_row0 + int64_t(t) * p.q.token_stride);
    float kf[16], qf[16];
    kr.to_floats(kf), qr.to_floats(qf);
    const QkNorms n = run_norms<kLPC>(p.heads, K, kf, qf);
    group_rk = n.rk, group_rq = n.rq, group_kq = n.kq_n;
  };

  Token cur;
  if (len > 0) cur = load_token(len > 1), group_norms(0);
#pragma unroll 1
  for (int t = 0; t < len; ++t) {
    if (t % kCPL == 0 && t > 0) group_norms(t);
    if (t % 32 == 0 && t > 0) gates.load(p.gating, hg, tok0, t, len, hv, lane);  // chains past 32 tokens
    float kf[16], qf[16];
    cur.k.to_floats(kf), cur.q.to_floats(qf);
    const int from = t % kCPL * kLPC;  // the group holding token t's norms
    const float rk = __shfl_sync(0xffffffffu, group_rk, from), rq = __shfl_sync(0xffffffffu, group_rq, from);
    const float kq_n = __shfl_sync(0xffffffffu, group_kq, from);
    const float decay = __shfl_sync(0xffffffffu, gates.decay, t % 32);
    const float beta = __shfl_sync(0xffffffffu, gates.beta, t % 32);

    // d_k and d_q of every run (w applied per lane: a column's blocks have different w), reduced together.
    float sums[2 * kRuns];
#pragma unroll
    for (int i = 0; i < kRuns; ++i) {
      float dk = 0.0f, dq = 0.0f;
#pragma unroll
      for (int j = 0; j < 16; ++j) dk = fmaf(x[i][j], kf[j], dk), dq = fmaf(x[i][j], qf[j], dq);
      sums[i] = dk * w[i], sums[kRuns + i] = dq * w[i];
    }
    transpose_group_sum<2 * kRuns, kLPC>(sums, lane);  // lane c: sum c (d_k of run c, or d_q of run c - kRuns)
    // The next token's loads, once q is no longer held: they travel while the update and the cache store run.
    const float v_cur = to_float(cur.v);
    cur = load_token(t + 2 < len);  // token t + 1 (past the row's end: its last token again)
    const float u = beta * (v_cur - decay * (sums[0] * rk));  // lanes c < kRuns: u of run c
    const float u_col = __shfl_xor_sync(0xffffffffu, u, kRuns);
    if (c >= kRuns) *o_ptr = from_float<TInput>(fmaf(kq_n, u_col, decay * (sums[0] * rq)));
    o_ptr += p.o.token_stride;
    const float uk_lane = u * rk;

    // Each phase over all runs at once, so that the runs' dependent chains overlap in the warp's instruction stream.
    // w x_new = decay w x + uk k: w *= decay, x += (uk / w) k.
    float uk[kRuns], r[kRuns];
    bool in_range = true;
#pragma unroll
    for (int i = 0; i < kRuns; ++i) {
      uk[i] = __shfl_sync(0xffffffffu, uk_lane, (lane & ~(kLPC - 1)) + i);
      w[i] *= decay;
      r[i] = uk[i] * rcp_approx_ftz(w[i]);
      in_range = in_range && fabsf(r[i]) <= FLT_MAX && w[i] >= kMinBlockFactor;
    }
    if (!in_range) {  // w below kMinBlockFactor (decays since the last store, tiny scales) or r not finite: x *= w
#pragma unroll
      for (int i = 0; i < kRuns; ++i)
        if (!(fabsf(r[i]) <= FLT_MAX && w[i] >= kMinBlockFactor)) {
#pragma unroll
          for (int j = 0; j < 16; ++j) x[i][j] *= w[i];
          w[i] = 1.0f, r[i] = uk[i];
        }
    }
#pragma unroll
    for (int i = 0; i < kRuns; ++i)
#pragma unroll
      for (int j = 0; j < 16; ++j) x[i][j] = fmaf(kf[j], r[i], x[i][j]);
    if (kCache && t < cached) {
      uint4 bytes[kRuns];
      uint32_t scale_bytes[kRuns];
      quantize_e4m3_runs_rescale<kRuns, 1>(x, w, bytes, scale_bytes);
#pragma unroll
      for (int i = 0; i < kRuns; ++i)
        store_e4m3_run<K>(cache, cache_scales, v0 + kCPL * i + g, c, bytes[i], scale_bytes[i]);
      cache += num_v_heads * kHeadElems, cache_scales += num_v_heads * kHeadBlocks;
    }
  }

  if (write_state) {
#pragma unroll
    for (int i = 0; i < kRuns; ++i) {
      uint32_t byte;
      const uint4 bytes = quantize_e4m3x16<1, true>(x[i], byte, w[i]);
      store_e4m3_run<K>(head, scales, v0 + kCPL * i + g, c, bytes, byte);
    }
  }
}

}  // namespace gdnkit::cuda::recurrent
