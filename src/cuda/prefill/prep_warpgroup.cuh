// The head pass's prep warpgroup (state_pass_head_kernel's kMWarpgroup; docs/design/prefill.md "The prep
// warpgroup"): beside the two state warpgroups of a (sequence, value head) CTA, a third warpgroup forms each
// chunk's M in the chunk's own shared-memory stage, a chunk or two ahead of them (the stages are filled two chunks
// ahead), so that its work leaves their sequential chain. T' and the factor rows kLog2Gcum, kInvNormK of the chunk
// prep kernel (run without M) arrive with the rows by TMA; this warpgroup forms M with rq (q k^T on wgmma, rq from
// the rows' sums of squares on the FMA pipe) and the factor rows kDecayRk, kDecayRq, kTailDecayRk, kChunkDecay, so
// that the state warpgroups read what the chunk prep with M would have written.
// Per chunk: wait for the state warps' release of the stage's previous chunk and for the stage's TMA; past a partial
// chunk's end zero the k, q, v rows (the tiles hold the next tokens there); form M and the factors; then one arrival
// per thread on the stage's `done` mbarrier, after a proxy fence (the tensor cores read M).
// The fused prep (Plan::fused_prep, opt-in): fused_prep_warpgroup forms the rest of the chunk prep in the stage instead
// (k k^T, A, the solve and T', the factor rows) after the gate kernel, with rk and rq from the producer's last two
// warps (producer_norms); the state warpgroups form M from those norms (head_chunk.cuh form_m).
// The persistent pass (HeadPass::kPersistent): the producer takes (sequence, value head) items from a counter and hands
// them to the other warpgroups (ItemRing), loading each item's initial state and chunks into ring positions that run
// on across items (producer_persistent); this warpgroup passes an initial state's position through and prepares the
// chunks' as above.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/arch/tma.cuh"
#include "cuda/arch/wgmma.cuh"
#include "cuda/prefill/causal_image.cuh"
#include "cuda/prefill/head_loader.cuh"
#include "cuda/prefill/head_stage.cuh"
#include "cuda/prefill/io.cuh"
#include "cuda/prefill/mma.cuh"
#include "cuda/prefill/plan.h"
#include "cuda/prefill/solve.cuh"
#include "gdnkit/params.h"

namespace gdnkit::cuda::chunked_prefill {

// Registers: the CTA launches with 128 per thread (512 threads: 65536), the pool the warpgroups trade within by
// setmaxnreg: the prep warpgroup gives back to kPrepRegs, the producer to kProducerRegs, the state warpgroups take
// kStateRegs.
constexpr int kPrepRegs = 72, kStateRegs = 208, kProducerRegs = 24;  // 128 x (72 + 24) + 256 x 208 = 65536
static_assert(kThreads * (kPrepRegs + kProducerRegs) + 2 * kThreads * kStateRegs <= 4 * kThreads * 128,
              "the CTA's registers");

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// The prep warpgroup's own shared memory (after the stages): the chunk's rq. `reserved` is unused; it keeps rq's
// offset and the CTA's shared memory (head_smem_bytes) as they are.
struct PrepSmem {
  float reserved[71 * kChunk];
  float rq[kChunk];
};

// This thread's index in the prep warpgroup (the CTA's third), read again (volatile) where it is used in a chunk, so
// that the offsets derived from it are not held live across the chunk loop.
__device__ __forceinline__ int prep_thread_index() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t - 2 * kThreads;
}

// The four elements of this lane in C tile nt of a warp's 16 rows of the masked, decayed 64 x 64 M (or, kStrict, A):
// element e is row i = i0 + 8 (e >> 1), column jj = j + (e & 1), and comes out as
// acc[e] * f[e >> 1] * exp2(gi[e >> 1] - gj) * kj, or 0 in the diagonal tiles (diag) where jj > i (kStrict: jj >= i).
template <bool kStrict = false>
__device__ __forceinline__ void masked_decayed_tile(const float (&acc)[4], const float (&gi)[2], const float (&f)[2],
                                                    float2 gj, float2 kj, bool diag, int i0, int j, float (&out)[4]) {
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int i = i0 + (e >> 1) * 8, jj = j + (e & 1);
    const float d = exp2_approx(gi[e >> 1] - (e & 1 ? gj.y : gj.x)) * (e & 1 ? kj.y : kj.x);
    out[e] = diag && (kStrict ? jj >= i : jj > i) ? 0.0f : acc[e] * f[e >> 1] * d;
  }
}

// rq of the chunk's tokens to rq[], on the FMA pipe while q k^T runs (on mma.sync these products would queue behind
// the state warpgroups' wgmma): half a q row per thread, rows 16 w .. 16 w + 15 in warp w, the thread pair of a row
// taking the two 32-column halves of each 64-column block (so that a quarter warp's 16-byte loads, 4 rows of the
// 128-byte swizzle, hit 8 distinct pieces of the banks). Without the L2 norm (kNorm false) the scale alone, the rows
// not read.
template <int K, class Op, bool kNorm, class Stage>
__device__ __forceinline__ void prep_q_norms(const Plan& plan, const Stage& b, int at, float* rq) {
  const int row = at >> 1, c0 = (at & 1) * 32;
  if constexpr (!kNorm) {
    if (!(at & 1)) rq[row] = plan.scale;
    return;
  }
  float ss[2] = {0.0f, 0.0f};  // two chains
#pragma unroll
  for (int u = 0; u < K / 16; ++u)
    ss[u & 1] += sumsq8<Op>(lds128(smem_addr(&b.qs[sw128_offset<kChunk>(row, (u / 4) * 64 + c0 + 8 * (u % 4))])));
  float x = ss[0] + ss[1];
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  if (!(at & 1)) rq[row] = rsqrtf(x + 1e-6f) * plan.scale;
}

// The state warpgroups' factor rows of this warp's 16 tokens, from kLog2Gcum (gcum log2 e) and rk (the chunk prep's
// kInvNormK, or the fused prep's norms), with rq (as store_token_factors writes them with rq; without o, kDecayRq is
// not read).
template <bool kOutputs, class Stage>
__device__ __forceinline__ void prep_factor_rows(Stage& b, const float* rq, const float* rks, int L, int warp,
                                                 int lane) {
  if (lane < 16) {
    const int t = warp * 16 + lane;
    const float gc2 = b.sc[kLog2Gcum * kChunk + t], rk = rks[t],
                gl2 = b.sc[kLog2Gcum * kChunk + kChunk - 1];
    const float d = exp2f(gc2);
    b.sc[kDecayRk * kChunk + t] = d * rk;
    if constexpr (kOutputs) b.sc[kDecayRq * kChunk + t] = d * rq[t];
    b.sc[kTailDecayRk * kChunk + t] = t < L ? rk * exp2f(gl2 - gc2) : 0.0f;
    b.sc[kChunkDecay * kChunk + t] = exp2f(gl2);
  }
}

// M[i][j] = mask_{j<=i} exp(gcum_i - gcum_j) rq_i rk_j (q_i . k_j) from q k^T (acc, once complete), to the stage as
// its causal image; gcum (times log2 e) from the factor row kLog2Gcum, rk from rks (the chunk prep's kInvNormK, or the
// fused prep's norms). gi, fq: the row factors of this thread's rows 16 warp + r + 8 half.
template <class Op, class Stage>
__device__ __forceinline__ void prep_store_m(Stage& b, float (&acc)[8][4], const float* rq, const float* rks,
                                             float (&gi)[2], float (&fq)[2], int warp, int lane, int r, int q2) {
  const float* const gcs = &b.sc[kLog2Gcum * kChunk];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int i = warp * 16 + r + half * 8;
    gi[half] = gcs[i];
    fq[half] = rq[i];
  }
  const ImageRows m_rows = image_rows(warp, lane);
  wgmma_wait<0>();
  wgmma_pin(acc);
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    if (warp < 2 && nt >= 4) continue;  // the image has no upper-right quarter
    const int j = nt * 8 + q2;
    const float2 gj = *reinterpret_cast<const float2*>(&gcs[j]);
    const float2 kj = *reinterpret_cast<const float2*>(&rks[j]);
    float m[4];
    masked_decayed_tile(acc[nt], gi, fq, gj, kj, nt >= 2 * warp, warp * 16 + r, j, m);
#pragma unroll
    for (int half = 0; half < 2; ++half)
      *reinterpret_cast<uint32_t*>(&b.ms[m_rows.at[half] + ((nt ^ m_rows.swz) << 3)]) =
          pack2<Op>(m[2 * half], m[2 * half + 1]);
  }
}

// The chunks of one sequence (len tokens), prepared into their stages: chunk c's is stage[c % kStages]
// (HeadStageWg: ks, qs, vs as the TMA tiles land), its TMA completes on full[c % kStages] and this warpgroup's 128
// threads arrive on done[c % kStages] (phase parity c / kStages). From chunk kStages on it also waits on
// done[kStages + c % kStages] (parity c / kStages - 1): every state thread is done with the stage's previous chunk.
// Without o (kOutputs false: the context-parallel local pass) only the factor rows the state update reads; kNorm:
// q's L2 norm in rq (the call's use_qk_l2norm). The persistent pass: chunk c at ring position r0 + c (its stage, its
// parities).
template <int K, class Op, int kStages, bool kOutputs, bool kNorm, class Stage>
__device__ __forceinline__ void prep_warpgroup(const Plan& plan, PrepSmem& ps, Stage* stage, uint64_t* full,
                                               uint64_t* done, int64_t len, uint32_t r0 = 0) {
  static_assert(K % 64 == 0, "the k, q rows in 64-column blocks");
  int at = prep_thread_index(), warp = at >> 5, lane = at & 31;
  const int64_t nchunks = (len + kChunk - 1) / kChunk;

  for (int64_t c = 0; c < nchunks; ++c) {
    const uint32_t rc = r0 + uint32_t(c);
    Stage& b = stage[rc % kStages];
    at = prep_thread_index(), warp = at >> 5, lane = at & 31;
    [[maybe_unused]] const int r = lane >> 2, q2 = (lane & 3) * 2;
    const int L = int(min(int64_t(kChunk), len - c * kChunk));
    if (rc >= kStages) mbarrier_wait(&done[kStages + rc % kStages], (rc / kStages - 1) & 1);
    mbarrier_wait(&full[rc % kStages], (rc / kStages) & 1);
    __syncwarp();  // every lane's reads of the previous chunk's rq before this chunk's writes
    if (L < kChunk) {
      zero_rows_past<K, Op>(b, L, at, kThreads);
      fence_proxy_async();  // the zeros are read by the tensor cores
      named_barrier_sync(kPrepBarrier, kThreads);
    }
    if constexpr (kOutputs) {
      const uint64_t dk = sw128_desc(smem_addr(b.ks), 16, 1024), dq = sw128_desc(smem_addr(b.qs), 16, 1024);
      float acc[8][4];
      issue_qk_product<K, Op>(acc, dq, dk);
      prep_q_norms<K, Op, kNorm>(plan, b, at, ps.rq);
      __syncwarp();  // the warp's rq (its own rows are all that M's pass reads)
      prep_factor_rows<true>(b, ps.rq, &b.sc[kInvNormK * kChunk], L, warp, lane);
      float gi[2], fq[2];
      prep_store_m<Op>(b, acc, ps.rq, &b.sc[kInvNormK * kChunk], gi, fq, warp, lane, r, q2);
      fence_proxy_async();  // M is read by the tensor cores
    } else {
      prep_factor_rows<false>(b, ps.rq, &b.sc[kInvNormK * kChunk], L, warp, lane);
    }
    mbarrier_arrive(&done[rc % kStages]);
  }
}

// Warp W's rows of A (the fused prep) from k k^T's accumulators to the solve's blocks on and left of its diagonal:
// fp32 on the diagonal block, fp16 left of it (solve_a16); the blocks above the diagonal are the solve's scratch.
// A[i][j] = exp2(gi_i - gcum_j log2 e) rk_j G[i][j], j < i, with gi_i = gcum_i log2 e + log2(beta_i rk_i).
template <int W>
__device__ __forceinline__ void store_a_rows(float* a_s, const float (&acc)[8][4], const float (&gi)[2],
                                             const float* gcs, const float* rks, int r, int q2) {
#pragma unroll
  for (int nt = 0; nt < 2 * (W + 1); ++nt) {
    const int j = nt * 8 + q2;
    float a[4];
    masked_decayed_tile<true>(acc[nt], gi, {1.0f, 1.0f}, *reinterpret_cast<const float2*>(&gcs[j]),
                              *reinterpret_cast<const float2*>(&rks[j]), nt >= 2 * W, W * 16 + r, j, a);
    if (nt >= 2 * W) {
      *reinterpret_cast<float2*>(&a_s[solve_at(W * 16, r, j)]) = make_float2(a[0], a[1]);
      *reinterpret_cast<float2*>(&a_s[solve_at(W * 16, r + 8, j)]) = make_float2(a[2], a[3]);
    } else {  // left of the diagonal block: fp16, the solve's operands as they are
      *reinterpret_cast<uint32_t*>(solve_a16(a_s, W * 16, r, j)) = pack2<__half>(a[0], a[1]);
      *reinterpret_cast<uint32_t*>(solve_a16(a_s, W * 16, r + 8, j)) = pack2<__half>(a[2], a[3]);
    }
  }
}

// The prep warpgroup's shared memory in the fused prep (kFusedPrep): A (its blocks left of the diagonal in fp16; the
// solve's fp16 images of T's blocks in the free blocks above the diagonal, solve.cuh), and per stage the chunk's rk and
// rq, which the producer warpgroup's norm threads form from the staged rows (producer_norms).
struct FusedPrepSmem {
  float a[kChunk * kSolveLd];
  float rk[kHeadStages<true>][kChunk], rq[kHeadStages<true>][kChunk];
};
// the state warpgroups read a stage's rq at rk[0] + (kStages + stage) kChunk (head_chunk.cuh form_m)
static_assert(offsetof(FusedPrepSmem, rq) == offsetof(FusedPrepSmem, rk) + sizeof(FusedPrepSmem::rk),
              "FusedPrepSmem: rq right after rk");

// The fused prep (Plan::fused_prep): the chunk prep of each stage but M, after the gate kernel wrote kLog2Gcum and
// kBeta (they arrive with the rows by TMA) and the producer's norm threads rk and rq (norms[c % kStages], 64 arrivals):
// k k^T on wgmma; A[i][j] = beta_i rk_i rk_j exp(gcum_i - gcum_j) (k_i . k_j), j < i (the row factor in the exponent as
// a log2, as the chunk prep without M) to shared memory; T = (I + A)^-1 solved and T' = T diag(beta) stored to the
// stage's causal image (solve.cuh, on this warpgroup's named barrier); then the factor rows. M is the state
// warpgroups' (they read rk and rq of the stage from ps, which the producer writes again only once they released it).
// The stages and their barriers as in prep_warpgroup.
template <int K, class Op, int kStages, class Stage>
__device__ __forceinline__ void fused_prep_warpgroup(FusedPrepSmem& ps, Stage* stage, uint64_t* full, uint64_t* done,
                                                     uint64_t* norms, int64_t len) {
  static_assert(K % 64 == 0, "the k, q rows in 64-column blocks");
  static_assert(kStages == kHeadStages<true>, "FusedPrepSmem holds the norms of every stage");
  int at = prep_thread_index(), warp = at >> 5, lane = at & 31;
  const int64_t nchunks = (len + kChunk - 1) / kChunk;

  for (int64_t c = 0; c < nchunks; ++c) {
    const int s = int(c % kStages);
    const uint32_t parity = uint32_t(c / kStages) & 1;
    Stage& b = stage[s];
    at = prep_thread_index(), warp = at >> 5, lane = at & 31;
    const int r = lane >> 2, q2 = (lane & 3) * 2;
    const int L = int(min(int64_t(kChunk), len - c * kChunk));
    if (c >= kStages) mbarrier_wait(&done[kStages + s], parity ^ 1);
    mbarrier_wait(&full[s], parity);
    if (L < kChunk) {
      zero_rows_past<K, Op>(b, L, at, kThreads);
      fence_proxy_async();  // the zeros are read by the tensor cores
      named_barrier_sync(kPrepBarrier, kThreads);
    }
    const uint64_t dk = sw128_desc(smem_addr(b.ks), 16, 1024);
    float acc[8][4];
    issue_qk_product<K, Op>(acc, dk, dk);  // G = k k^T
    mbarrier_wait(&norms[s], parity);      // the chunk's rk, rq
    const float* const gcs = &b.sc[kLog2Gcum * kChunk];
    const float* const betas = &b.sc[kBeta * kChunk];
    const float* const rks = ps.rk[s];
    float gi[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = warp * 16 + r + half * 8;
      gi[half] = gcs[i] + __log2f(betas[i] * rks[i]);  // beta_i = 0 (past the chunk too): -inf, A's row 0
    }
    wgmma_wait<0>();
    wgmma_pin(acc);
    named_barrier_sync(kPrepBarrier, kThreads);  // every warp stored the previous chunk's T' (A replaces T)
    switch (warp) {  // a warp's tile count a constant, so that ptxas overlaps the tiles' loads and exponentials
      case 0: store_a_rows<0>(ps.a, acc, gi, gcs, rks, r, q2); break;
      case 1: store_a_rows<1>(ps.a, acc, gi, gcs, rks, r, q2); break;
      case 2: store_a_rows<2>(ps.a, acc, gi, gcs, rks, r, q2); break;
      default: store_a_rows<3>(ps.a, acc, gi, gcs, rks, r, q2); break;
    }
    __syncwarp();  // this warp's rows of A (the solve's first steps read the warp's own blocks)
    invert_and_store_t<Op, kPrepBarrier, 2 * kThreads, true>(ps.a, betas, L, b.ts, true, warp, lane);
    prep_factor_rows<true>(b, ps.rq[s], rks, L, warp, lane);
    fence_proxy_async();  // T' is read by the tensor cores
    mbarrier_arrive(&done[s]);
  }
}

// The fused prep's norms: thread j < 64 of the producer's last two warps forms token j's rk = 1 / |k_j| and
// rq = scale / |q_j| (without the L2 norm 1 and the scale) of every chunk from its staged rows, once they landed, to
// the stage's slot of ps (0 at or past the chunk's end, whose rows the prep warpgroup zeroes meanwhile), then arrives
// on norms[c % kStages]. The prep warpgroup and the state warpgroups (M) read them before the stage is released, and
// the stage's next chunk (whose full[] these threads wait on) is loaded only after that release, so a slot is written
// again only after every read.
template <int K, class Op, int kStages, class Stage>
__device__ __forceinline__ void producer_norms(const PrefillParams& p, const Plan& plan, FusedPrepSmem& ps,
                                               Stage* stage, uint64_t* full, uint64_t* norms, int64_t len, int j) {
  const int64_t nchunks = (len + kChunk - 1) / kChunk;
  for (int64_t c = 0; c < nchunks; ++c) {
    const int s = int(c % kStages);
    const int L = int(min(int64_t(kChunk), len - c * kChunk));
    mbarrier_wait(&full[s], uint32_t(c / kStages) & 1);
    float rk = 0.0f, rq = 0.0f;
    if (j < L && !p.heads.use_qk_l2norm) {
      rk = 1.0f;
      rq = plan.scale;
    } else if (j < L) {
      const Stage& b = stage[s];
      float sk = 0.0f, sq = 0.0f;
#pragma unroll 4
      for (int u = 0; u < K / 8; ++u) {
        sk += sumsq8<Op>(lds128(smem_addr(&b.ks[sw128_offset<kChunk>(j, 8 * u)])));
        sq += sumsq8<Op>(lds128(smem_addr(&b.qs[sw128_offset<kChunk>(j, 8 * u)])));
      }
      rk = rsqrtf(sk + 1e-6f);
      rq = rsqrtf(sq + 1e-6f) * plan.scale;
    }
    ps.rk[s][j] = rk;
    ps.rq[s][j] = rq;
    mbarrier_arrive(&norms[s]);
  }
}

// The initial state's bulk copy (Plan::state_bulk): the head's slot slice at src, `bytes` of it (0: none), then
// (float8_e4m3) its block scales, into the last stage; bars[0] counts the bytes, bars[1] every state thread's read.
struct InitialStateCopy {
  const void* src = nullptr;
  uint32_t bytes = 0;
  const void* scales = nullptr;
  uint32_t scale_bytes = 0;
  uint64_t* bars = nullptr;
};

// Value head h's K x V slice of pool slot `slot` and (float8_e4m3) its block scales (bars left unset).
template <int K, int V>
__device__ __forceinline__ InitialStateCopy initial_state_copy(const PrefillParams& p, int64_t slot, int h) {
  InitialStateCopy in;
  const int64_t es = dtype_bytes(p.state.dtype);
  in.src = static_cast<const char*>(p.state.data) + (slot * p.state.slot_stride + int64_t(h) * K * V) * es;
  in.bytes = uint32_t(K * V * es);
  if (p.state.dtype == DType::kFloat8E4M3) {
    in.scales = p.state.scales + (slot * p.heads.num_v_heads + h) * (K * V / kFp8Block);
    in.scale_bytes = uint32_t(K * V / kFp8Block);
  }
  return in;
}

// Its bulk copies into `dst` (the scales right after the slice), the bytes counted on `bar`.
__device__ __forceinline__ void issue_state_copy(void* dst, const InitialStateCopy& in, uint64_t* bar) {
  mbarrier_arrive_expect_tx(bar, in.bytes + in.scale_bytes);
  bulk_load(dst, in.src, in.bytes, bar);
  if (in.scale_bytes > 0) bulk_load(static_cast<char*>(dst) + in.bytes, in.scales, in.scale_bytes, bar);
}

// The producer warpgroup (kMWarpgroup), or warp (kLoadWarp): its first thread issues every stage's loads, so that no
// warpgroup that computes waits for a TMA issue (each takes about a hundred cycles). Chunk 0's rows go out before the
// chunk prep's grid completed, its workspace part after; chunk n (from kStages - 1 on) into the stage of chunk n -
// kStages once every state thread released it (done[kStages + ...]) and this thread's o stores have read it (below).
// It also stores each full chunk's o, which the kStateWgs state warpgroups stage in their v rows of the stage and hand
// over on done[2 kStages + g kStages + c % kStages] (128 arrivals after a proxy fence), by one TMA store per warpgroup;
// the stage is loaded again only once those stores have read it.
template <int kStages, bool kOutputs, int kStateWgs, class Loader, class Stage>
__device__ __forceinline__ void producer_warpgroup(const Loader& loader, Stage* stage, uint64_t* done, int64_t len,
                                                   bool issuer, const CUtensorMap* o_map, int v0, int h,
                                                   int64_t start, const InitialStateCopy& in) {
  if (!issuer) return;
  const int64_t nchunks = (len + kChunk - 1) / kChunk;
  if (nchunks > 0) loader.issue(0, stage[0], kInputs);
  if (in.bytes > 0) issue_state_copy(&stage[kStages - 1], in, &in.bars[0]);  // not the prep's: before the wait
  if (loader.ready == nullptr) asm volatile("griddepcontrol.wait;" ::: "memory");  // else per chunk (the loader)
  if (nchunks > 0) loader.issue(0, stage[0], kWorkspace);
#pragma unroll
  for (int i = 1; i < kStages - 1; ++i)
    if (i < nchunks) loader.issue(i, stage[i], kBoth);
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t n = c + kStages - 1;  // into the stage of chunk c - 1
    if (n < nchunks) {
      if (c > 0) {
        mbarrier_wait(&done[kStages + (c - 1) % kStages], uint32_t((c - 1) / kStages) & 1);
        if constexpr (kOutputs) bulk_wait_group_read<0>();  // chunk c - 1's o stores have read the stage
      } else if (in.bytes > 0) {
        mbarrier_wait(&in.bars[1], 0);  // every state thread read the initial state from this stage
      }
      loader.issue(n, stage[n % kStages], kBoth);
    }
    if constexpr (kOutputs) {
      if ((c + 1) * kChunk <= len) {  // a partial chunk's o leaves from the state threads
#pragma unroll
        for (int g = 0; g < kStateWgs; ++g) {
          mbarrier_wait(&done[(2 + g) * kStages + c % kStages], uint32_t(c / kStages) & 1);
          tma_store_3d(o_map, v0 + 64 * g, h, int(start + c * kChunk), &stage[c % kStages].vs[g * 64 * kChunk]);
        }
        bulk_commit_group();
      }
    }
  }
  if constexpr (kOutputs) bulk_wait_group<0>();  // the o stores complete before the CTA's shared memory goes
}

// The persistent pass's work items (Plan::pass_ticket): value head h of sequence n with its bounds and slots (n < 0:
// the CTA's run ends). The producer's first thread takes each from the counter and hands it to the prep and state
// warps through kItemSlots entries: it writes entry k % kItemSlots and arrives on full[...]; each of the kItemReaders
// threads arrives on free[...] once it read it (an item may take no ring position: an empty sequence without an
// initial state moved by a bulk copy).
struct HeadItem {
  int n, h;
  SeqSlots sq;
};
constexpr int kItemSlots = 4, kItemReaders = 3 * kThreads;  // the prep warpgroup's threads and the state warpgroups'
struct ItemRing {
  HeadItem item[kItemSlots];
  uint64_t full[kItemSlots], free[kItemSlots];
};

__device__ __forceinline__ HeadItem take_item(ItemRing& ring, uint32_t k) {
  const uint32_t e = k % kItemSlots;
  mbarrier_wait(&ring.full[e], (k / kItemSlots) & 1);
  const HeadItem it = ring.item[e];
  mbarrier_arrive(&ring.free[e]);
  return it;
}

// An item's initial state moves by a bulk copy into a ring position of its own, before its chunks' (Plan::state_bulk).
__device__ __forceinline__ bool item_state_bulk(const Plan& plan, const HeadItem& it) {
  return plan.state_bulk && it.sq.islot >= 0;
}

// Chunk c of an item into stage b, its bytes counted on `bar` (the persistent producer: ChunkTma's loads from the
// item's token, heads and slot alone, so that its 24 registers hold most of the loop: it spills the item's fields,
// 112 bytes, which its wait-dominated loop does not feel): the k, q, v rows of tokens tk .. tk + 63 (q/k head hk,
// value head h), then, once the chunk's count says the prep wrote it (ready, where Plan::chunk_ready) or after
// griddepcontrol.wait (first), T' and the factor rows of workspace entry slot * HV + h.
template <class S, class Stage>
__device__ __forceinline__ void issue_item_chunk(const PrefillParams& p, const Plan& plan, const HeadTensorMaps& maps,
                                                 Stage& b, uint64_t* bar, int tk, int hk, int h, int64_t slot,
                                                 bool first) {
  using Op = typename S::Op;
  using Tma = ChunkTma<S>;
  static_assert(S::kMWarpgroup && S::kOutputs && !S::kFusedPrep, "the persistent pass: beside the prep warpgroup");
  fence_proxy_async();  // this stage's generic reads (its previous position) before the async writes
  mbarrier_arrive_expect_tx(bar, Tma::kBytes);
  Tma::rows(maps, b, bar, tk, hk, h, 0, true);
  if (plan.chunk_ready != nullptr)
    wait_chunk_ready(plan.chunk_ready + slot, uint32_t(p.heads.num_qk_heads * plan.prep_parts));
  else if (first)
    asm volatile("griddepcontrol.wait;" ::: "memory");
  const int64_t entry = slot * p.heads.num_v_heads + h;
  Tma::workspace(b, bar, static_cast<const Op*>(plan.ws_tprime) + entry * (kChunk * kChunk), nullptr,
                 plan.ws_factors + entry * (S::kFRows * kChunk));
}

// The persistent pass's producer (its first thread): items from the counter (ticket t: value head t % HV of sequence
// t / HV, or of that entry of Plan::pass_order: longest first), and for each its ring positions, the
// initial state's (item_state_bulk) and then one per chunk, position r into stage r % kStages (full[...], phase parity
// r / kStages) once every state thread released position r - kStages (done[kStages + ...]) and the o stores read it.
// Every position's o is handed over (done[2 kStages + g kStages + ...], 128 arrivals of state warpgroup g), a full
// chunk's stored from the stage by TMA, two positions after its loads were issued. The next item's ticket is taken
// while the current item's last kStages chunks are issued, so that a CTA holds at most one item it has not started.
template <class S, class Stage>
__device__ __forceinline__ void producer_persistent(const PrefillParams& p, const Plan& plan,
                                                    const HeadTensorMaps& maps, Stage* stage, uint64_t* full,
                                                    uint64_t* done, ItemRing& ring) {
  constexpr int kStages = S::kStages, K = S::K, V = S::V;
  static_assert(kStages == 3, "a position's o is stored two positions after its loads (older, newer below)");
  const int HV = p.heads.num_v_heads;
  const uint32_t items = uint32_t(p.num_seqs) * uint32_t(HV);
  // a position's o: token rows from `token` of value head h, stored from its stage where h >= 0 (a full chunk)
  struct PendingO {
    int h, token;
  } older{-1, 0}, newer{-1, 0};  // positions r - 2 and r - 1 (registers: an indexed array would live in local memory)
  uint32_t r = 0;  // the ring positions issued
  bool first = true;
  const auto store_o = [&](uint32_t q, const PendingO& o) {  // position q's o, once both warpgroups handed it over
    const uint32_t st = q % kStages;
#pragma unroll
    for (int g = 0; g < 2; ++g) mbarrier_wait(&done[(2 + g) * kStages + st], (q / kStages) & 1);
    if (o.h >= 0) {
#pragma unroll
      for (int g = 0; g < 2; ++g) tma_store_3d(&maps.o, 64 * g, o.h, o.token, &stage[st].vs[g * 64 * kChunk]);
      bulk_commit_group();
    }
  };
  const auto claim = [&](uint32_t q) {  // position q's stage is free
    if (q < kStages) return;
    mbarrier_wait(&done[kStages + q % kStages], (q / kStages - 1) & 1);
    bulk_wait_group_read<0>();
  };
  const auto issued = [&](uint32_t q, PendingO o) {
    if (q >= 2) store_o(q - 2, older);
    older = newer;
    newer = o;
  };

  uint32_t next = 0;
  bool have_next = false;
  for (uint32_t k = 0;; ++k) {
    HeadItem it;
    it.n = -1;
    while (true) {
      if (!have_next) next = atomicAdd(plan.pass_ticket, 1u);
      have_next = false;
      if (next >= items) break;
      HeadItem c;
      c.n = plan.pass_order != nullptr ? plan.pass_order[next / uint32_t(HV)] : int(next / uint32_t(HV));
      c.h = int(next % uint32_t(HV));
      if (begin_sequence_by(p, plan, c.n, c.h, 0, V, c.h == 0, c.sq, 0, 1)) {
        it = c;
        break;
      }
    }
    const uint32_t e = k % kItemSlots;
    if (k >= kItemSlots) mbarrier_wait(&ring.free[e], (k / kItemSlots - 1) & 1);
    ring.item[e] = it;
    mbarrier_arrive(&ring.full[e]);
    if (it.n < 0) break;

    if (item_state_bulk(plan, it)) {
      claim(r);
      const uint32_t st = r % kStages;
      fence_proxy_async();  // the stage's generic accesses (its previous position) before the async writes
      issue_state_copy(&stage[st], initial_state_copy<K, V>(p, it.sq.islot, it.h), &full[st]);
      issued(r++, {-1, 0});
    }
    const int hk = it.h / (HV / p.heads.num_qk_heads), len = int(it.sq.len), tk0 = int(it.sq.start);
    const int64_t slot0 = it.sq.start / kChunk + it.n;
    const int nchunks = (len + kChunk - 1) / kChunk;
    for (int c = 0; c < nchunks; ++c) {
      claim(r);
      const uint32_t st = r % kStages;
      issue_item_chunk<S>(p, plan, maps, stage[st], &full[st], tk0 + c * kChunk, hk, it.h, slot0 + c, first);
      first = false;
      if (!have_next && c + kStages >= nchunks) {
        next = atomicAdd(plan.pass_ticket, 1u);
        have_next = true;
      }
      issued(r++, {(c + 1) * kChunk <= len ? it.h : -1, tk0 + c * kChunk});
    }
  }
  if (r >= 2) store_o(r - 2, older);
  if (r >= 1) store_o(r - 1, newer);
  bulk_wait_group<0>();  // the o stores complete before the CTA's shared memory goes
}

}  // namespace gdnkit::cuda::chunked_prefill
