// Verify of chains without an intermediate cache, commit by recompute and short prefill on tensor cores: the
// chunked (WY) form of the recurrence (docs/semantics.md) with chunks of 8 tokens, for K-last pools and bf16
// q/k/v (docs/design/decode.md "Chains on tensor cores"). The warp kernel (warp_kernel.cuh) spends 3-4 fp32
// instructions per state value and token plus a butterfly per token, so a multi-token chain on it is
// compute-bound; here a call reads each state once, and the per-token work on the state is mma.sync
// (cuda/arch/mma_sync.cuh).
//
// A warp owns (sequence, value head, 8 columns of S) like the warp kernel; a CTA is 4 warps of one head.
// The warp's columns (contiguous in the pool) sit in shared memory in fp32, arriving by cp.async beside
// the chunk's k/q rows, so no registers wait on them. Lane l reads column v0 + l/4 at k = 16 j + 2 (l%4)
// + {0, 1} and + 8: the B operand of two m16n8k8 tf32 steps per k-step j (chunk_products), and the C
// fragment of S^T (columns x K, n-tiles of 8) for the update (chunk_update).
//
// Every input a chunk needs (its gates as raw bits, its v pair, A_log and dt_bias) is loaded before the
// state's copies and converted only where used: a conversion right behind its load would stall the warp
// there, before the state's cp.async goes out (docs/design/decode.md "Inputs held as loaded").
//
// Per chunk of n <= 8 tokens (Γ_t = exp(sum of g up to t) from the chunk's start; k, q raw bf16 rows,
// their norms rk, rq applied to the sums), one named part each:
//   chunk_products      [k; q] (16 x K) times S (K x 8) in tf32, S = hi + lo (hi: S's top 19 bits, exact;
//                       lo = S - hi, read to 11 bits): ~2^-20 relative, within the state's 1e-5 tolerance;
//                       k, q are exact in tf32. P[t][c] = k_t . S[:, c], Qs[t][c] = q_t . S[:, c];
//                       [k; q] times [k; q]^T on bf16 (exact products): k_t . k_i, q_t . k_i, q_t . q_t
//   chunk_scalars       the norms and the log-decay sums over each span the lane's fragment needs
//   chunk_coefficients, forward_substitution
//                       u_t = beta_t (v_t - Γ_t rk_t P[t]) - sum_{i<t} beta_t (Γ_t/Γ_i) rk_t rk_i (k_t . k_i) u_i
//                       (one column per lane, through a small per-warp scratch)
//   store_chunk_output  o_t = Γ_t rq_t Qs[t] + sum_{i<=t} (Γ_t/Γ_i) rq_t rk_i (q_t . k_i) u_i
//   chunk_update        S^T <- Γ_n S^T + U'^T k with U'[i] = (Γ_n/Γ_i) rk_i u_i split into 2 bf16 terms
//                       (one m16n8k16 per n-tile: the terms sit in the k-dimension, the k rows twice), back
//                       into the shared columns
//   store_columns       the last chunk's state from the shared columns to the pool, whole 16-byte pieces
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/arch/dtype.cuh"
#include "cuda/arch/mma_sync.cuh"
#include "cuda/recurrent/row.cuh"
#include "cuda/recurrent/token.cuh"
#include "cuda/recurrent/warp_tile.cuh"
#include "gdnkit/params.h"

namespace gdnkit::cuda::recurrent {

constexpr int kChainCols = 8;   // columns of S per warp
constexpr int kChainWarps = 4;  // warps per CTA: neighbouring column blocks of one head
constexpr int kChainChunk = 8;  // tokens per chunk

// Per warp: a chunk's coefficients and columns, in shared memory.
struct ChainScratch {
  float a[kChainChunk][kChainChunk];   // substitution coefficients (row t, token i < t)
  float bq[kChainChunk][kChainChunk];  // output coefficients (row t, token i <= t)
  float u[kChainChunk][kChainChunk];   // u (token, column); before the substitution its right-hand side
};

// A chunk's inputs as loaded: raw bits, converted where used, so that no conversion waits on a load here.
struct ChunkInputs {
  int nc;            // tokens in the chunk
  int64_t tok_lane;  // lane t < nc: token c0 + t's index
  GateBits g;        // lane t < nc: its raw gate inputs
  uint32_t v2;       // v of this lane's row and column pair (bf16 pair)
};

// Issues a chunk's inputs before they are needed (the first chunk's before the state loads): its k (and q)
// rows by cp.async into `rows`, zero past the chunk's tokens; lane t < nc: token c0 + t's index and raw gate
// inputs; v of this lane's row and column pair. Reads the kernel's locals by reference.
template <int K, bool kRecompute, class TokenOf>
struct ChainInputIssuer {
  static constexpr int kN = kChainChunk, kPitch = K + 8;
  const RecurrentParams& p;
  const int& n;  // tokens to apply
  const int& lane;
  const int& r;  // fragment row: the token whose v this lane loads
  const int& hq;
  const int& hv;
  const __nv_bfloat16* const& vcol;  // v of token 0 at this lane's column pair
  const TokenOf& token_of;
  __nv_bfloat16 (&rows)[2][kN][kPitch];

  __device__ ChunkInputs operator()(int c0) const {
    using bf16 = __nv_bfloat16;
    constexpr unsigned kAll = 0xffffffffu;
    ChunkInputs in;
    in.nc = min(kN, n - c0);
    in.tok_lane = token_of(c0 + min(lane, in.nc - 1));
    constexpr int kPieces = K / 8, kStaged = (kRecompute ? 1 : 2) * kN * kPieces, kThreads = kChainWarps * 32;
    // A trip count the same in every thread: the shuffle below is then a plain one, not a collective's slow path.
#pragma unroll
    for (int it = 0; it < (kStaged + kThreads - 1) / kThreads; ++it) {
      const int i = int(threadIdx.x) + it * kThreads;
      const int row = i / kPieces % (2 * kN), piece = i % kPieces, j = row % kN;
      const InView& x = row < kN ? p.k : p.q;
      const int64_t tok = __shfl_sync(kAll, in.tok_lane, j);
      if (kStaged % kThreads == 0 || i < kStaged)
        cp_async16(&rows[row / kN][j][piece * 8],
                   static_cast<const bf16*>(x.data) + tok * x.token_stride + int64_t(hq) * x.head_stride + piece * 8,
                   j < in.nc);
    }
    in.g = GateBits{0u, 0u};
    if (lane < in.nc) in.g = token_gate_bits(p.gating, in.tok_lane, hv);
    const int64_t tok_r = __shfl_sync(kAll, in.tok_lane, r);
    in.v2 = 0u;
    if (r < in.nc) in.v2 = *reinterpret_cast<const uint32_t*>(vcol + tok_r * p.v.token_stride);
    return in;
  }
};

// The chunk's products: pq = [k; q] S on tf32 (S = hi + lo), kk = [k; q] k^T, qq = [k; q] q^T on bf16. For
// tokens i = c2, c2 + 1: pq = P[r][i] (0, 1), Qs[r][i] (2, 3); kk = k_r . k_i (0, 1), q_r . k_i (2, 3);
// qq = q_r . q_i (2, 3).
// The bf16 A fragment of k-step j (ldmatrix) feeds two tf32 k-steps: tf32 index q of the first is k = 16 j
// + c2 (low halves), q + 4 is 16 j + c2 + 1 (high halves); the second takes k + 8. Their B operands are then
// this lane's state pairs at k = 16 j + c2 and 16 j + 8 + c2. The tf32 products accumulate in two chains
// (one per half h), summed after: half the dependent latency.
template <int K, bool kRecompute, class Pair>
__device__ __forceinline__ void chunk_products(const __nv_bfloat16 (&rows)[2][kChainChunk][K + 8], const Pair& pair,
                                               int lane, int c2, float (&pq)[4], float (&kk)[4], float (&qq)[4]) {
  using bf16 = __nv_bfloat16;
  constexpr int kSteps = K / 16;
  float pq2[2][4] = {};
#pragma unroll
  for (int e = 0; e < 4; ++e) kk[e] = 0.0f, qq[e] = 0.0f;
  const bf16* arow = &rows[kRecompute ? 0 : (lane >> 3) & 1][lane & 7][(lane >> 4) * 8];  // replay: k twice
#pragma unroll
  for (int j = 0; j < kSteps; ++j) {
    uint32_t a[4];
    ldmatrix_x4(a, arow + 16 * j);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t at[4] = {a[2 * h] << 16, a[2 * h + 1] << 16, a[2 * h] & 0xffff0000u, a[2 * h + 1] & 0xffff0000u};
      const float2 x = pair(16 * j + 8 * h + c2);
      const uint32_t hi0 = __float_as_uint(x.x) & 0xffffe000u, hi1 = __float_as_uint(x.y) & 0xffffe000u;
      mma_tf32(pq2[h], at, __float_as_uint(x.x - __uint_as_float(hi0)), __float_as_uint(x.y - __uint_as_float(hi1)));
      mma_tf32(pq2[h], at, hi0, hi1);
    }
    mma<bf16>(kk, a, a[0], a[2]);                   // B = k^T: column i is token i's k row
    if (!kRecompute) mma<bf16>(qq, a, a[1], a[3]);  // B = q^T
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) pq[e] = pq2[0][e] + pq2[1][e];
}

// Per-token scalars of a chunk as the lane's fragment needs them: of its row's token r (log-decay sum lg
// through r, beta, rk, rq), of its column tokens c2, c2 + 1 (rk), and the log-decays between them and from
// them to the chunk's end. Each is a sum of its own tokens' g (all of one sign), never a difference of prefix
// sums: after a gate near a reset (g ~ -160) such a difference would carry the big sum's rounding (~1e-5).
struct ChunkScalars {
  float lg_r, beta_r, rk_r, rq_r, rk_i0, rk_i1, lg_end;
  float lg_r_i0, lg_r_i1, lg_end_i0, lg_end_i1;  // g summed over (i, r] and (i, end] for i = c2, c2 + 1
};
// Lane t < 8 first forms token t's norms (from the diagonals of kk and qq), then every lane gathers what its
// fragment needs and sums the log-decays of its spans.
__device__ __forceinline__ ChunkScalars chunk_scalars(const float (&kk)[4], const float (&qq)[4], float glog,
                                                      float beta, int lane, int r, int c2, bool norm, float scale) {
  constexpr unsigned kAll = 0xffffffffu;
  constexpr int kN = kChainChunk;
  const int diag = (lane & 7) * 4 + (lane & 7) / 2;  // the lane holding entry (t, t), t = lane % 8
  const float kkd = __shfl_sync(kAll, r & 1 ? kk[1] : kk[0], diag);
  const float qqd = __shfl_sync(kAll, r & 1 ? qq[3] : qq[2], diag);
  const float rk = norm ? rsqrtf(kkd + 1e-6f) : 1.0f;
  const float rq = (norm ? rsqrtf(qqd + 1e-6f) : 1.0f) * scale;
  ChunkScalars cs{};
#pragma unroll
  for (int j = 0; j < kN; ++j) {  // tokens past nc have g = 0
    const float g = __shfl_sync(kAll, glog, j);
    cs.lg_r += j <= r ? g : 0.0f;
    cs.lg_end += g;
    cs.lg_r_i0 += j > c2 && j <= r ? g : 0.0f;
    cs.lg_r_i1 += j > c2 + 1 && j <= r ? g : 0.0f;
    cs.lg_end_i0 += j > c2 ? g : 0.0f;
    cs.lg_end_i1 += j > c2 + 1 ? g : 0.0f;
  }
  cs.beta_r = __shfl_sync(kAll, beta, r);
  cs.rk_r = __shfl_sync(kAll, rk, r), cs.rq_r = __shfl_sync(kAll, rq, r);
  cs.rk_i0 = __shfl_sync(kAll, rk, c2), cs.rk_i1 = __shfl_sync(kAll, rk, c2 + 1);
  return cs;
}

// The chunk's coefficients into the scratch, u before the substitution, and the state's share of o (pq[2],
// pq[3]) scaled. Lane (r, c2): token r against tokens c2, c2 + 1.
__device__ __forceinline__ void chunk_coefficients(ChainScratch& sc, int r, int c2, const ChunkScalars& cs,
                                                   const float (&kk)[4], float (&pq)[4], float2 vv) {
  const float e0 = __expf(cs.lg_r_i0), e1 = __expf(cs.lg_r_i1), er = __expf(cs.lg_r);
  const float ka = cs.beta_r * cs.rk_r, kb = cs.rq_r;
  sc.a[r][c2] = c2 < r ? ka * e0 * cs.rk_i0 * kk[0] : 0.0f;
  sc.a[r][c2 + 1] = c2 + 1 < r ? ka * e1 * cs.rk_i1 * kk[1] : 0.0f;
  sc.bq[r][c2] = c2 <= r ? kb * e0 * cs.rk_i0 * kk[2] : 0.0f;
  sc.bq[r][c2 + 1] = c2 + 1 <= r ? kb * e1 * cs.rk_i1 * kk[3] : 0.0f;
  sc.u[r][c2] = cs.beta_r * vv.x - ka * er * pq[0];
  sc.u[r][c2 + 1] = cs.beta_r * vv.y - ka * er * pq[1];
  pq[2] *= er * cs.rq_r, pq[3] *= er * cs.rq_r;  // the state's share of o
}

// Forward substitution of the chunk's u (sc.u holds the right-hand sides), column lane % 8 in registers (the
// four lane groups do the same), then in place into the scratch.
__device__ __forceinline__ void forward_substitution(ChainScratch& sc, int lane) {
  constexpr int kN = kChainChunk;
  const int col = lane & 7;
  float u[kN];
#pragma unroll
  for (int t = 0; t < kN; ++t) {
    float acc = sc.u[t][col];
#pragma unroll
    for (int i = 0; i < t; ++i) acc = fmaf(-sc.a[t][i], u[i], acc);
    u[t] = acc;
  }
  __syncwarp();
  if (lane < kN)
#pragma unroll
    for (int t = 0; t < kN; ++t) sc.u[t][col] = u[t];
}

// o of token r, columns c2, c2 + 1: the state's share (y0, y1) plus the chunk's tokens' (sc.bq, sc.u).
__device__ __forceinline__ __nv_bfloat162 chunk_output(const ChainScratch& sc, int r, int c2, float y0, float y1) {
#pragma unroll
  for (int i = 0; i < kChainChunk; ++i) {
    const float2 ui = *reinterpret_cast<const float2*>(&sc.u[i][c2]);
    y0 = fmaf(sc.bq[r][i], ui.x, y0);
    y1 = fmaf(sc.bq[r][i], ui.y, y1);
  }
  return __floats2bfloat162_rn(y0, y1);
}

// S^T <- Γ_n S^T + U'^T k with U'[i] = (Γ_n/Γ_i) rk_i u_i as two bf16 terms (one m16n8k16 per n-tile: the
// terms sit in the k-dimension, the k rows twice), back into the shared columns.
template <int K, class Pair>
__device__ __forceinline__ void chunk_update(const ChainScratch& sc, const __nv_bfloat16 (&rows)[2][kChainChunk][K + 8],
                                             const Pair& pair, int lane, int r, int c2, const ChunkScalars& cs) {
  using bf16 = __nv_bfloat16;
  const float x0 = __expf(cs.lg_end_i0) * cs.rk_i0 * sc.u[c2][r];
  const float x1 = __expf(cs.lg_end_i1) * cs.rk_i1 * sc.u[c2 + 1][r];
  uint32_t ua[4];
  split2<bf16>(x0, x1, ua[0], ua[2]);
  ua[1] = ua[3] = 0u;  // rows 8-15: no columns
  const float decay = __expf(cs.lg_end);
#pragma unroll 1
  for (int jj = 0; jj < K / 32; ++jj) {
    uint32_t kt[4];  // n-tiles 4 jj .. 4 jj + 3 of the k rows, transposed
    ldmatrix_x4_trans(kt, &rows[0][lane & 7][8 * (4 * jj + (lane >> 3))]);
#pragma unroll
    for (int m = 0; m < 4; ++m) {  // n-tile 4 jj + m: this lane's pair at k = 8 (4 jj + m) + c2
      float2& e = pair(8 * (4 * jj + m) + c2);
      float c[4] = {decay * e.x, decay * e.y, 0.0f, 0.0f};
      mma<bf16>(c, ua, kt[m], kt[m]);
      e = make_float2(c[0], c[1]);
    }
  }
}

// The warp's columns from the shared state (fp32) to memory in the pool's dtype as whole 16-byte pieces, lane l
// taking pieces l, l + 32, ...: each store instruction writes one contiguous range, where the accumulators' own layout
// would write half of each 32-byte sector (16-bit pools). Rolled: unrolled, ptxas hoists the reads and spills.
template <class TState, int K>
__device__ __forceinline__ void store_columns(const float (&st)[kChainCols][K + 8], TState* cols, int lane) {
  constexpr int kE = 16 / int(sizeof(TState)), kRowPieces = K / kE, kPieces = kChainCols * kRowPieces;
  static_assert(kPieces % 32 == 0, "whole pieces a lane");
#pragma unroll 1
  for (int i = 0; i < kPieces / 32; ++i) {
    const int piece = lane + 32 * i, col = piece / kRowPieces, k = piece % kRowPieces * kE;
    float v[kE];
#pragma unroll
    for (int q = 0; q < kE; q += 4) *reinterpret_cast<float4*>(&v[q]) = *reinterpret_cast<const float4*>(&st[col][k + q]);
    store_vec<TState, kE>(cols + col * K + k, v);
  }
}

// o of token r < nc, columns c2, c2 + 1: the state's share (pq[2], pq[3]) plus the chunk's tokens' (sc.bq, sc.u).
template <class OutPair, class TokenOf>
__device__ __forceinline__ void store_chunk_output(const ChainScratch& sc, int r, int c2, const float (&pq)[4], int nc,
                                                   int c0, const OutPair& out_pair, const TokenOf& token_of) {
  float y0 = pq[2], y1 = pq[3];
#pragma unroll
  for (int i = 0; i < kChainChunk; ++i) {
    const float2 ui = *reinterpret_cast<const float2*>(&sc.u[i][c2]);
    y0 = fmaf(sc.bq[r][i], ui.x, y0);
    y1 = fmaf(sc.bq[r][i], ui.y, y1);
  }
  if (r < nc) *out_pair(token_of(c0 + r)) = __floats2bfloat162_rn(y0, y1);
}

// Resident warps per SM the kernel is built for: 64 registers (a few bytes spilled at K = 128, runs as fast
// as 24 warps without spills). The update loop stays rolled: unrolled, ptxas hoists the state pairs and
// spills (docs/design/decode.md "Chains on tensor cores").
constexpr int kChainMinWarps = 32;
template <class TState, int K, int V, RecurrentOp kOp>
__global__ void __launch_bounds__(kChainWarps * 32, kChainMinWarps / kChainWarps)
    chain_mma_kernel(const RecurrentParams p, const bool write_state, const bool prefetch) {
  static_assert(kOp != RecurrentOp::kDecode && K % 32 == 0 && V % (kChainCols * kChainWarps) == 0,
                "chain kernel tile");
  constexpr bool kRecompute = kOp == RecurrentOp::kRecompute, kPrefill = kOp == RecurrentOp::kPrefill;
  constexpr int kPitch = K + 8;  // 16-byte row shift: ldmatrix rows hit distinct banks
  constexpr int kColCtas = V / (kChainCols * kChainWarps);
  constexpr int kN = kChainChunk;
  constexpr int64_t kHeadElems = int64_t(K) * V;
  using bf16 = __nv_bfloat16;
  __shared__ __align__(16) bf16 rows[2][kN][kPitch];  // the chunk's k (0) and q (1) rows
  __shared__ ChainScratch scratch[kChainWarps];
  // Each warp's state columns in fp32, rows of K padded by 8 floats: the fragment reads (column r, k pair
  // 2 (l%4)) of a half-warp hit distinct banks.
  __shared__ __align__(16) float state[kChainWarps][kChainCols][K + 8];

  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
  const int r = lane / 4, c2 = (lane % 4) * 2;  // fragment row (token; column of S) and column pair
  const int b = int(blockIdx.y), hv = int(blockIdx.x / unsigned(kColCtas));
  const int v0 = (int(blockIdx.x % unsigned(kColCtas)) * kChainWarps + warp) * kChainCols;
  const int hq = qk_head(p, hv);
  const int T = p.num_draft_tokens;
  const bool counts_errors = hv == 0 && v0 == 0 && lane == 0 && p.error_flag != nullptr;
  TState* const head_block = static_cast<TState*>(p.state.data) + int64_t(hv) * kHeadElems + int64_t(v0) * K;

  // Programmatic dependent launch and prefetch mode: as the warp kernel (warp_kernel.cuh).
  if (prefetch && (!kPrefill || p.state_indices != nullptr)) {  // prefill: initial slots may be absent
    const int early_slot = __ldcg(p.state_indices + b);
    if (early_slot >= 0 && early_slot < p.state.num_slots)
      WarpTile<StateLayout::kKLast, TState, K, V>::prefetch(head_block + int64_t(early_slot) * p.state.slot_stride,
                                                            lane);
  }
  pdl_wait_and_launch_dependents();

  const RowLoads row = load_row<kOp>(p, b);
  const int slot = row.slot;
  int64_t tok0;
  int len;
  if (!row_tokens<kOp>(p, row, b, T, tok0, len)) {  // a row the kernel cannot place: counted, nothing written
    if (counts_errors && !kPrefill) atomicAdd(p.error_flag, 1);  // prefill: a sequence of the chunked kernels
    return;
  }
  if (kRecompute && slot < 0) return;  // padding row: commit leaves it alone
  int n_replay, cache_slot;
  const bool bad = row_is_bad<kOp>(p, row, b, T, len, n_replay, cache_slot);
  const auto out_pair = [&](int64_t tok) {
    return reinterpret_cast<__nv_bfloat162*>(static_cast<bf16*>(p.o.data) + tok * p.o.token_stride +
                                             int64_t(hv) * p.o.head_stride + v0 + c2);
  };
  // Padding row (prefill: no initial slot means S = 0), or one the kernel must not touch: o = 0, no state
  // traffic.
  if (bad || (slot < 0 && !kPrefill)) {
    if (bad && counts_errors) atomicAdd(p.error_flag, 1);
    if (!kRecompute && lane < kChainCols / 2)
      for (int t = 0; t < len; ++t) *out_pair(tok0 + t) = __floats2bfloat162_rn(0.0f, 0.0f);
    return;
  }
  const int n = kRecompute ? n_replay : len;
  if (n == 0 && !kPrefill) return;  // nothing to apply: the pool state stays
  // Where the final state goes: the pool slot read (prefill: the final slot, if any).
  const bool store_final = kPrefill ? row.final_slot >= 0 : (kRecompute || write_state);
  TState* const out_tile = head_block + int64_t(kPrefill ? row.final_slot : slot) * p.state.slot_stride;

  const auto token_of = [&](int j) -> int64_t {
    return tok0 + (kRecompute && p.accepted_path != nullptr ? p.accepted_path[int64_t(b) * T + j] : j);
  };
  const float scale = p.heads.scale > 0.0f ? p.heads.scale : 1.0f / sqrtf(float(K));
  const bool norm = p.heads.use_qk_l2norm;
  const bf16* const vcol = static_cast<const bf16*>(p.v.data) + int64_t(hv) * p.v.head_stride + v0 + c2;
  ChainScratch& warp_scratch = scratch[warp];

  const ChainInputIssuer<K, kRecompute, decltype(token_of)> issue_inputs{p, n, lane, r, hq, hv, vcol, token_of, rows};
  const HeadGates head_params = head_gates(p.gating, hv);
  ChunkInputs in = issue_inputs(0);

  // The warp's state columns (contiguous in a K-last pool) into `state`: by cp.async for fp32 pools
  // (no registers held while they travel), through registers (converted) for bf16.
  TState* const tile = head_block + int64_t(slot) * p.state.slot_stride;
  float(&st)[kChainCols][K + 8] = state[warp];
  {
    constexpr int kE = 16 / int(sizeof(TState)), kPieces = kChainCols * K / kE;  // 16-byte pieces
    static_assert(kPieces % 32 == 0, "whole pieces per lane");
    if (kPrefill && slot < 0) {  // prefill from S = 0
#pragma unroll
      for (int i = lane; i < kPieces; i += 32)
        for (int h = 0; h < kE; h += 4) *reinterpret_cast<float4*>(&st[i * kE / K][i * kE % K + h]) = float4{};
    } else if constexpr (std::is_same_v<TState, float>) {
#pragma unroll
      for (int i = lane; i < kPieces; i += 32) cp_async16(&st[i * kE / K][i * kE % K], tile + i * kE, true);
    } else {
      float x[kPieces / 32][kE];
#pragma unroll
      for (int i = 0; i < kPieces / 32; ++i) load_vec<TState, kE>(tile + (lane + 32 * i) * kE, x[i]);
#pragma unroll
      for (int i = 0; i < kPieces / 32; ++i) {
        const int e = (lane + 32 * i) * kE;
#pragma unroll
        for (int h = 0; h < kE; h += 4)
          *reinterpret_cast<float4*>(&st[e / K][e % K + h]) =
              make_float4(x[i][h], x[i][h + 1], x[i][h + 2], x[i][h + 3]);
      }
    }
  }
  // S[k .. k+1][v0 + r] (this lane's column).
  const auto pair = [&](int k) -> float2& { return *reinterpret_cast<float2*>(&st[r][k]); };
  if (kPrefill && n == 0) {  // an empty sequence: its final state is its initial state
    cp_async_wait_all();
    __syncwarp();
    if (store_final)
#pragma unroll 4
      for (int k = 2 * (lane % 4); k < K; k += 8) store_vec<TState, 2>(out_tile + r * K + k, &pair(k).x);
    return;
  }

#pragma unroll 1
  for (int c0 = 0; c0 < n; c0 += kN) {
    const int nc = in.nc;
    float glog = 0.0f, beta = 0.0f;
    if (lane < nc) gate_log_values(p.gating, head_params, in.g, glog, beta);
    const float2 vv = unpack2<bf16>(in.v2);
    cp_async_wait_all();
    __syncthreads();

    float pq[4], kk[4], qq[4];
    chunk_products<K, kRecompute>(rows, pair, lane, c2, pq, kk, qq);
    const ChunkScalars cs = chunk_scalars(kk, qq, glog, beta, lane, r, c2, norm, scale);
    chunk_coefficients(warp_scratch, r, c2, cs, kk, pq, vv);  // u before the substitution
    __syncwarp();
    forward_substitution(warp_scratch, lane);
    __syncwarp();
    if constexpr (!kRecompute) store_chunk_output(warp_scratch, r, c2, pq, nc, c0, out_pair, token_of);
    const bool last = c0 + kN >= n;  // S^T <- Γ_n S^T + U'^T k, the last chunk's then out to the pool
    if (store_final || !last) chunk_update<K>(warp_scratch, rows, pair, lane, r, c2, cs);
    if (store_final && last) {
      __syncwarp();
      store_columns<TState, K>(st, out_tile, lane);
    }
    if (c0 + kN < n) {
      __syncthreads();  // every warp is done with this chunk's rows
      in = issue_inputs(c0 + kN);
    }
  }
}

}  // namespace gdnkit::cuda::recurrent
