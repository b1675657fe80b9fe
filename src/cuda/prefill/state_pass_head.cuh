// Kernel 2, head variant: the state pass of one (sequence, value head) per CTA, V/16 warps, each warp
// owning 16 value columns of S for the whole K dimension. Same math as state_pass_kernel
// (kernels.cuh), laid out so that every per-chunk product stays in the warp's registers:
//
//   the warp keeps S^T (16 value rows x K) as mma accumulators. Each product of the chunk has a
//   16-row A operand that is an accumulator of the previous one (packed to Op, no shared memory):
//     P^T, Q^T = S^T k^T, S^T q^T          A = S^T          B = k, q rows   (16 x 64 x K)
//     X^T      = v^T - P^T D rk            (v^T via ldmatrix.trans)
//     v_new^T  = X^T T'^T                  A = X^T          B = T' rows     (causal)
//     o^T      = Q^T D rq + v_new^T M^T    A = v_new^T      B = M rows      (causal)
//     S^T      = e^{g_last} S^T + vd^T k   A = vd^T         B = k rows, .trans
//   so the warps never wait for each other inside a chunk: the CTA meets once per chunk, when the
//   next chunk's inputs (q, k, v rows, T', M, scalars) have landed (and once more where the CTA forms M
//   itself, kMInPass below). They arrive by cp.async into a double-buffered stage while the current chunk
//   computes (TMA in the wgmma build, two chunks ahead into three stages).
//
// Used when q, k, v, o are 16-bit in the operand dtype (bf16, or fp16) with 16-byte aligned rows, K
// <= 128 and V in {64, 128} (K = 128: 64 accumulator registers of S per thread). The q/k rows are
// loaded once per chunk for all V columns (state_pass_kernel loads them once per value tile).
//
// Two builds of the products (template parameter kWgmma):
//   kWgmma = false: each warp issues mma.sync m16n8k16 with B fragments by ldmatrix from padded rows;
//   kWgmma = true:  each group of 4 warps (64 value columns) issues wgmma m64nNk16 (wgmma.cuh): the same
//     A fragments from registers, B read by the tensor cores from 128B-swizzled k, q, T', M rows,
//     asynchronously (the P and Q products overlap the X step, o's product overlaps the S update's).
//     The chunk's inputs arrive by TMA (tma.cuh: one thread issues the tiles, an mbarrier per stage
//     counts their bytes). Needs a multiple of 64 value columns per CTA. Past a partial chunk's end the
//     k, q, v rows are zeroed in shared memory, so the full products run there too.
//     With two warpgroups per CTA (kMInPass, head_pass_forms_m) it forms M itself, and the chunk prep
//     writes none: q k^T with both operands in shared memory, issued with P and Q (each warpgroup half of
//     M's token columns), then masked and scaled by the prep's kLog2Gcum / kInvNormK factors while v_new's
//     product runs, and stored by stmatrix into the stage's M rows, where o's product reads them after one
//     CTA barrier. It also takes the q norms from the staged q rows while P and Q run (the prep then reads
//     no q) and scales o's token rows by them at the end: o_i = rq_i (e^gcum_i q_i S + sum_j M'_ij v_new_j),
//     with M' = M / rq_i. With one warpgroup, M comes from the workspace by TMA like T'.
//     With a prep warpgroup (kAux: a third warpgroup, prep_warpgroup.cuh) the two state warpgroups form neither M
//     nor rq: the prep warpgroup fills each stage with M and the factor rows (kAuxM; after the chunk prep kernel)
//     or with everything the chunk prep would write (kAuxAll; no chunk prep kernel), and hands it over by an
//     mbarrier per stage; the state warpgroups meet on a named barrier of their 256 threads.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "cuda/prefill/io.cuh"
#include "cuda/prefill/mma.cuh"
#include "cuda/prefill/plan.h"
#include "cuda/prefill/prep_warpgroup.cuh"
#include "cuda/arch/tma.cuh"
#include "cuda/arch/wgmma.cuh"
#include "gdnkit/params.h"

namespace gdnkit::cuda::chunked_prefill {

// One chunk's inputs in shared memory (kHeadStages of them: the current chunk and the next ones).
template <int K, int kCols, class Op>
struct HeadStage {
  static constexpr int LDK = K + 8, LDV = kCols + 8, LDT = kChunk + 8;  // +16 bytes: conflict-free ldmatrix
  Op ks[kChunk * LDK];   // k rows (raw)
  Op qs[kChunk * LDK];   // q rows (raw)
  Op vs[kChunk * LDV];   // v rows (the CTA's columns); a warp's 16 columns then stage its o rows
  Op ts[kChunk * LDT];   // T'
  Op ms[kChunk * LDT];   // M
  float sc[kFactorRows<false> * kChunk];  // the chunk's token factors (FactorRow)
};

// The wgmma build's stage, as the TMA tiles land: k, q (the wgmma B operands) and v in 128B-swizzled blocks of
// 64 columns (sw128_offset; 1024-byte aligned); T' and M as the prep's causal images (causal_image_offset), M
// 64 x 64 128B-swizzled when formed in the pass.
template <int K, int kCols, class Op>
struct alignas(1024) HeadStageWg {
  Op ks[kChunk * K];
  Op qs[kChunk * K];
  Op ts[kChunk * kChunk];
  Op ms[kChunk * kChunk];
  Op vs[kChunk * kCols];
  float sc[kFactorRows<head_pass_forms_m(true, kCols)> * kChunk];
};

template <int K, int kCols, class Op, bool kWgmma>
using HeadStageOf = std::conditional_t<kWgmma, HeadStageWg<K, kCols, Op>, HeadStage<K, kCols, Op>>;
// Stages in flight: the wgmma build's TMA loads run two chunks ahead (three stages, 197 KB at K = V = 128),
// the cp.async build's one chunk ahead (its padded stages: two).
template <bool kWgmma>
constexpr int kHeadStages = kWgmma ? 3 : 2;
template <int K, int kCols, class Op, bool kWgmma, bool kFused = false>
constexpr size_t head_smem_bytes() {
  return kHeadStages<kWgmma> * sizeof(HeadStageOf<K, kCols, Op, kWgmma>) + (kFused ? sizeof(PrepSmem) : 0) +
         (kWgmma ? 1024 : 0);  // + alignment slack
}

// v_new^T (or o^T) += A B^T over a chunk-causal B (B[n][k] = 0 for k > n: T' or M), in token halves: tokens
// 0..31 need k-steps 0, 1 (K-major descriptor `lo` of rows 0..31), tokens 32..63 all four (`hi`, rows 32..63):
// 6 of 8 n32 products; an n48/n64 k-step over tokens 16 KS .. 63 made ptxas serialize the wgmmas, as the
// accumulator tiles 2 KS .. 7 are not an aligned register block. The halves' descriptors: causal_image_descs
// (the workspace's causal image) or full_causal_descs (M formed in the pass, 64 x 64 128B-swizzled).
template <class Op, int KS = 0>
__device__ __forceinline__ void causal_cols_wgmma(float (&acc)[8][4], const uint32_t (&a)[4][4], uint64_t lo,
                                                  uint64_t hi) {
  if constexpr (KS < 2) wgmma_rs<Op, 32, 0, false>(acc, a[KS], desc_add(lo, KS * 32));
  wgmma_rs<Op, 32, 4, false>(acc, a[KS], desc_add(hi, KS * 32));
  if constexpr (KS < 3) causal_cols_wgmma<Op, KS + 1>(acc, a, lo, hi);
}
struct CausalDescs {
  uint64_t lo, hi;
};
__device__ __forceinline__ CausalDescs causal_image_descs(const void* image) {
  const uint32_t at = smem_addr(image);
  return {sw64_desc(at, 16, 512), sw128_desc(at + 2 * kCausalImageLow, 16, 1024)};
}
__device__ __forceinline__ CausalDescs full_causal_descs(const void* x) {
  const uint64_t d = sw128_desc(smem_addr(x), 16, 1024);
  return {d, desc_add(d, 32 * 128)};
}

// The head pass's threads: V / kSplit / 16 warps of state columns, and with a prep warpgroup (kAux) its 128.
template <int V, int kSplit, int kAux>
constexpr int head_pass_threads() {
  return V / kSplit / 16 * 32 + (kAux != kAuxNone ? kThreads : 0);
}

// kSplit CTAs share one (sequence, value head), V / kSplit columns each (more SMs for few heads).
// kAux (the wgmma build with two state warpgroups): a third warpgroup prepares each chunk in its stage
// (prep_warpgroup.cuh): M (kAuxM, after the chunk prep kernel without M), or everything (kAuxAll, no chunk prep).
template <int K, int V, int kSplit, class Op, bool kWgmma, int kAux>
__global__ void __launch_bounds__(head_pass_threads<V, kSplit, kAux>(), 1)
    state_pass_head_kernel(const PrefillParams p, const Plan plan, const __grid_constant__ HeadTensorMaps maps) {
  constexpr int kCols = V / kSplit, kWarps = kCols / 16, kThr = kWarps * 32;  // the state warps
  constexpr int KT = K / 8;  // n8 tiles of S^T (the K dimension)
  static_assert(!kWgmma || kCols % 64 == 0, "the wgmma build needs whole warpgroups of 64 value columns");
  constexpr bool kFused = kAux != kAuxNone;  // a prep warpgroup beside the state warpgroups
  static_assert(!kFused || (kWgmma && kCols == 128), "the prep warpgroup: beside two state warpgroups");
  // M formed by the state warpgroups, not read from the stage (kFused: the prep warpgroup forms it)
  constexpr bool kMInPass = !kFused && head_pass_forms_m(kWgmma, kCols);
  // the chunk prep's factor rows in the workspace (6: without M, for kMInPass or the prep warpgroup's M)
  constexpr int kFRows = kFactorRows<kMInPass || kAux == kAuxM>;
  using Stage = HeadStageOf<K, kCols, Op, kWgmma>;
  constexpr int kStages = kHeadStages<kWgmma>;
  constexpr int LDV = HeadStage<K, kCols, Op>::LDV;  // the warp build's padded v rows
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Stage* stage = reinterpret_cast<Stage*>(smem_raw + (kWgmma ? (1024 - (smem_addr(smem_raw) & 1023)) & 1023 : 0));

  // Flat grid, column split fastest, then head: the CTAs that share q/k rows run together.
  const int HV = p.heads.num_v_heads;
  const int split = int(blockIdx.x % unsigned(kSplit)), h = int(blockIdx.x / unsigned(kSplit) % unsigned(HV));
  const int n = int(blockIdx.x / unsigned(kSplit * HV));
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int r = lane >> 2, q2 = (lane & 3) * 2;
  const int hk = h / (HV / p.heads.num_qk_heads);
  const int v0 = split * kCols;    // the CTA's value columns v0 .. v0 + kCols - 1
  const int vw = v0 + warp * 16;   // this warp's value columns vw .. vw + 15 (head columns)
  const int lw = warp * 16;        // ... and in the CTA's v / o tile

  SeqSlots sq;
  if (!begin_sequence<head_pass_threads<V, kSplit, kAux>()>(p, plan, n, h, v0, kCols, h == 0 && split == 0, sq)) {
    // A CTA leaves here (a sequence the recurrent kernels or nobody takes) only after the prep's grid
    // completed, as every other CTA does: so that this grid never completes before the prep, whatever the
    // stream's next launch assumes about a programmatic dependent's completion.
    asm volatile("griddepcontrol.wait;" ::: "memory");
    return;
  }
  const int64_t start = sq.start, len = sq.len;
  __shared__ uint64_t bars[kStages];  // wgmma build: the TMA completion of each stage
  // kFused: [0, kStages) the prep warpgroup's completion of each stage; [kStages, 2 kStages) the state warps' release
  // of a stage (each state thread arrives after its last access to a chunk's stage). The next TMA into the stage
  // already implies the release (it is issued after the state warps' next barrier); the prep warpgroup waits on it
  // too so that its writes are ordered after every state thread's reads by each thread's own arrival (racecheck
  // reported hazards where that order ran through the state warps' named barrier, one thread's TMA issue and the
  // phase that the TMA's bytes complete).
  __shared__ uint64_t prep_bars[kFused ? 2 * kStages : 1];
  auto init_bars = [&] {
    if (tid == 0) {
#pragma unroll
      for (int i = 0; i < kStages; ++i) {
        mbarrier_init(&bars[i], 1);
        if constexpr (kFused) {
          mbarrier_init(&prep_bars[i], kThreads);
          mbarrier_init(&prep_bars[kStages + i], kThr);
        }
      }
      fence_mbarrier_init();
    }
    __syncthreads();
  };
  if constexpr (kFused) {
    // The prep warpgroup leaves here; the state warps go on with more registers.
    init_bars();
    // The warpgroup index as a warp-uniform value (a shuffle of lane 0's), so that ptxas allocates each role's
    // registers by its setmaxnreg.
    const int wg = __shfl_sync(0xffffffffu, tid / kThreads, 0);
    if (wg == kWarps / 4) {
      setmaxnreg_dec<kPrepRegs>();
      PrepSmem& ps = *reinterpret_cast<PrepSmem*>(stage + kStages);
      prep_warpgroup<K, Op, kStages, kAux == kAuxAll>(p, plan, ps, stage, bars, prep_bars, h, start, len);
      return;
    }
    setmaxnreg_inc<kStateRegs>();
  }

  // S^T in registers: s[j][e] = S[k][v] with k = 8j + q2 + (e & 1), v = vw + r + 8 (e >> 1).
  float s[KT][4];
  auto s_offset = [&](int j, int e) {
    return state_offset(p.state.layout, h, 8 * j + q2 + (e & 1), vw + r + 8 * (e >> 1), K, V);
  };
  // K-last keeps a lane's elements (k, k+1) of one value row adjacent: one 2-element access each where
  // the buffer allows it (Plan::state_pairs / checkpoint_pairs), else one element at a time.
  {
    const int64_t base = int64_t(sq.islot) * p.state.slot_stride;
#pragma unroll
    for (int j = 0; j < KT; ++j)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        float2 x = make_float2(0.0f, 0.0f);
        if (sq.islot >= 0 && plan.state_pairs) {
          x = load_state_pair(p.state.data, p.state.dtype, base + s_offset(j, e));
        } else if (sq.islot >= 0) {
          x.x = load_state_elem(p.state.data, p.state.dtype, base + s_offset(j, e));
          x.y = load_state_elem(p.state.data, p.state.dtype, base + s_offset(j, e + 1));
        }
        s[j][e] = x.x;
        s[j][e + 1] = x.y;
      }
  }
  auto decay_state = [&](float eg) {  // S *= e^{g_last}, before a chunk's update
#pragma unroll
    for (int j = 0; j < KT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] *= eg;
  };
  auto store_s = [&](void* base, DType dt, int64_t offset, bool pairs) {
#pragma unroll
    for (int j = 0; j < KT; ++j)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        if (pairs) {
          store_state_pair(base, dt, offset + s_offset(j, e), s[j][e], s[j][e + 1]);
        } else {
          store_state_elem(base, dt, offset + s_offset(j, e), s[j][e]);
          store_state_elem(base, dt, offset + s_offset(j, e + 1), s[j][e + 1]);
        }
      }
  };

  const int64_t nchunks = (len + kChunk - 1) / kChunk;
  const int64_t slot0 = start / kChunk + n;
  const int64_t C = p.checkpoint_interval;

  // Chunk c's inputs into stage b. The wgmma build: TMA tiles issued by thread 0 (see the header). The
  // warp build: 16-byte cp.async pieces, rows past the sequence zero-filled; a thread's pieces are rows
  // row0 + u * step of fixed columns, its source pointers formed once here and advanced by whole chunks
  // (64 tokens; HV workspace entries).
  constexpr int KP = K / 8, VP = kCols / 8;                    // 16-byte pieces per row
  constexpr int kStepK = kThr / KP, kStepV = kThr / VP;        // rows between a thread's pieces
  const int rk0 = tid / KP, ck = tid % KP, rv0 = tid / VP, cvv = tid % VP;
  const Op* k_zero = static_cast<const Op*>(p.k.data) + hk * p.k.head_stride;  // token 0: valid for zero fills
  const Op* q_zero = static_cast<const Op*>(p.q.data) + hk * p.q.head_stride;
  const Op* v_zero = static_cast<const Op*>(p.v.data) + h * p.v.head_stride;
  const Op* k_src = k_zero + (start + rk0) * p.k.token_stride + ck * 8;
  const Op* q_src = q_zero + (start + rk0) * p.q.token_stride + ck * 8;
  const Op* v_src = v_zero + (start + rv0) * p.v.token_stride + v0 + cvv * 8;
  const int64_t ws0 = slot0 * HV + h;
  const Op* t_src = static_cast<const Op*>(plan.ws_tprime) + ws0 * (kChunk * kChunk) + tid * 8;
  const Op* m_src = kWgmma ? nullptr : static_cast<const Op*>(plan.ws_masked_qk) + ws0 * (kChunk * kChunk) + tid * 8;
  const float* f_src = plan.ws_factors + ws0 * (kFRows * kChunk);
  // The wgmma build's T' and M as the prep's causal images (kCausalImageElems of each entry's 64 x 64)
  [[maybe_unused]] const Op* t_img = static_cast<const Op*>(plan.ws_tprime) + ws0 * (kChunk * kChunk);
  [[maybe_unused]] const Op* m_img = kMInPass ? nullptr : static_cast<const Op*>(plan.ws_masked_qk) + ws0 * (kChunk * kChunk);
  // The warp build's padded k / q and T' / M rows.
  constexpr int LDK = HeadStage<K, kCols, Op>::LDK, LDT = HeadStage<K, kCols, Op>::LDT;
  // Element offset of (row, col) in the v (then o) buffer of a stage; rows 16 apart are kVRow16 bytes apart.
  auto v_offset = [](int row, int col) {
    if constexpr (kWgmma) return sw128_offset<kChunk>(row, col);
    else return row * LDV + col;
  };
  constexpr uint32_t kVRow16 = kWgmma ? 16 * 128 : 16 * LDV * 2;
  // o: lane l stores 16-byte piece l & 1 of the warp's columns of rows l / 2 + 16 u of each chunk, staged in
  // its v columns at o_staged (+ 16 rows per u).
  Op* const o_lane = static_cast<Op*>(p.o.data) + (start + (lane >> 1)) * p.o.token_stride + h * p.o.head_stride + vw +
                     (lane & 1) * 8;
  const int o_staged = v_offset(lane >> 1, lw + (lane & 1) * 8);
  // The wgmma build's share of M: warpgroup g forms token columns mj0 .. mj0 + kMCols - 1 of every row;
  // warp w of it holds rows mrow, mrow + 8, and stores (stmatrix) rows mst_row of columns mst_col + 16 np.
  static_assert(!kMInPass || kWarps == 8, "M in the pass: two warpgroups, half of M's columns each");
  constexpr int kMCols = 32;
  const int mj0 = (warp / 4) * kMCols, mrow = (warp % 4) * 16 + r;
  const int mst_row = (warp % 4) * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, mst_col = mj0 + (lane >> 4) * 8;
  // kMInPass: the chunk's rq (scale / ||q||, or the scale), written after the chunk's first barrier, read
  // after the second (one buffer: every read of chunk c precedes the next chunk's first barrier)
  __shared__ __align__(16) float s_rq[kMInPass ? kChunk : 1];
  // parts: kInputs (the k, q, v rows), kWorkspace (T', M unless kMInPass, the factors: the chunk prep's), or
  // both. Chunk 0's inputs go out before griddepcontrol.wait, its workspace part after it (both arrive on one
  // mbarrier / in one cp.async group).
  constexpr int kInputs = 1, kWorkspace = 2, kBoth = 3;
  auto issue = [&](int64_t c, Stage& b, int parts) {
    if constexpr (kWgmma) {
      if (tid == 0) {
        uint64_t* bar = &bars[c % kStages];
        if (parts & kInputs) {
          // both parts' bytes (kAuxAll: the rows alone; kAuxM: the rows, T' and the factor rows kLog2Gcum, kInvNormK; the prep
          // warpgroup forms the rest)
          constexpr uint32_t kBytes =
              uint32_t((2 * K + kCols) * kChunk * 2) +
              (kAux == kAuxAll ? 0u
                               : uint32_t((kFused || kMInPass ? 1 : 2) * kCausalImageElems * 2 +
                                          (kAux == kAuxM ? 2 : kFRows) * kChunk * 4));
          fence_proxy_async();  // this stage's generic reads (two chunks ago) before the async writes
          mbarrier_arrive_expect_tx(bar, kBytes);
          const int tk = int(start + c * kChunk);
#pragma unroll
          for (int i = 0; i < K / 64; ++i) {
            tma_load_3d(&b.ks[i * 64 * kChunk], &maps.k, 64 * i, hk, tk, bar);
            tma_load_3d(&b.qs[i * 64 * kChunk], &maps.q, 64 * i, hk, tk, bar);
          }
#pragma unroll
          for (int i = 0; i < kCols / 64; ++i) tma_load_3d(&b.vs[i * 64 * kChunk], &maps.v, v0 + 64 * i, h, tk, bar);
        }
        if (kAux != kAuxAll && (parts & kWorkspace)) {
          const int64_t wc = c * HV * (kChunk * kChunk);  // the chunk's causal images: one bulk copy each
          bulk_load(b.ts, t_img + wc, kCausalImageElems * 2, bar);
          if constexpr (!kMInPass && !kFused) bulk_load(b.ms, m_img + wc, kCausalImageElems * 2, bar);
          if constexpr (kAux == kAuxM)
            bulk_load(b.sc + kLog2Gcum * kChunk, f_src + c * HV * (kFRows * kChunk) + kLog2Gcum * kChunk, 2 * kChunk * 4, bar);
          else
            bulk_load(b.sc, f_src + c * HV * (kFRows * kChunk), kFRows * kChunk * 4, bar);
        }
      }
    } else if (parts & kInputs) {
      const int L = int(min(int64_t(kChunk), len - c * kChunk));
      const Op* kc = k_src + c * kChunk * p.k.token_stride;
      const Op* qc = q_src + c * kChunk * p.q.token_stride;
      const Op* vc = v_src + c * kChunk * p.v.token_stride;
#pragma unroll
      for (int u = 0; u < kChunk / kStepK; ++u) {
        const int row = rk0 + u * kStepK;
        const bool ok = row < L;
        const int dst = row * LDK + ck * 8;
        cp_async16(&b.ks[dst], ok ? kc + int64_t(u * kStepK) * p.k.token_stride : k_zero, ok);
        cp_async16(&b.qs[dst], ok ? qc + int64_t(u * kStepK) * p.q.token_stride : q_zero, ok);
      }
#pragma unroll
      for (int u = 0; u < kChunk / kStepV; ++u) {
        const int row = rv0 + u * kStepV;
        const bool ok = row < L;
        cp_async16(&b.vs[row * LDV + cvv * 8], ok ? vc + int64_t(u * kStepV) * p.v.token_stride : v_zero, ok);
      }
    }
    if constexpr (!kWgmma) {
      if (!(parts & kWorkspace)) return;
      const int64_t wc = c * HV;  // workspace entries per chunk
      const Op* tc = t_src + wc * (kChunk * kChunk);
      const Op* mc = m_src + wc * (kChunk * kChunk);
#pragma unroll
      for (int u = 0; u < kChunk * kChunk / 8 / kThr; ++u) {
        const int it = tid + u * kThr, row = it >> 3, cv = it & 7;
        const int dst = row * LDT + cv * 8;
        cp_async16(&b.ts[dst], tc + u * kThr * 8, true);
        cp_async16(&b.ms[dst], mc + u * kThr * 8, true);
      }
      const float* fc = f_src + wc * (kFRows * kChunk);
      for (int it = tid; it < kFRows * kChunk / 4; it += kThr) cp_async16(&b.sc[it * 4], fc + it * 4, true);
      cp_async_commit();
    }
  };

  // Per-lane byte offsets inside a stage of the fragment rows each ldmatrix / stmatrix reads or writes
  // (per chunk only constants are added: they fold into the instructions' immediates).
  const int frag_row = ((lane >> 4) << 3) + (lane & 7), frag_col = ((lane >> 3) & 1) * 8;
  const uint32_t off_k = uint32_t(frag_row * LDK + frag_col) * 2;  // B = rows [n][k] (k, q, T', M): bn_frag_ptr
  const uint32_t off_t = uint32_t(frag_row * LDT + frag_col) * 2;
  const uint32_t off_kt = uint32_t((lane & 15) * LDK + (lane >> 4) * 8) * 2;  // B = k rows as [k][n]: bk_frag_ptr
  // v^T and o: matrix m = lane/8 of a token-tile pair is (token tile m/2, value half m%2)
  const uint32_t off_v = uint32_t(v_offset(((lane >> 4) << 3) + (lane & 7), lw + ((lane >> 3) & 1) * 8)) * 2;

  if constexpr (kWgmma && !kFused) init_bars();
  // Launched right behind the chunk prep with programmatic dependent launch (launch_state_pass_head), the
  // CTAs that find a free SM while the prep's last CTAs finish got here early: the state loads above read
  // the pool and cu_seqlens, which the prep does not write (and what ran before the prep finished before
  // it started). The workspace is read only after the prep's grid completed. Without PDL a no-op.
  if (nchunks > 0) issue(0, stage[0], kInputs);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (nchunks > 0) issue(0, stage[0], kWorkspace);
#pragma unroll
  for (int i = 1; i < kStages - 1; ++i)
    if (i < nchunks) issue(i, stage[i], kBoth);
  for (int64_t c = 0; c < nchunks; ++c) {
    Stage& b = stage[c % kStages];
    const int L = int(min(int64_t(kChunk), len - c * kChunk));
    if constexpr (kFused) {
      // the rows, zeroed past a partial chunk's end, T', M and the factors: the prep warpgroup's
      mbarrier_wait(&prep_bars[c % kStages], uint32_t(c / kStages) & 1);
    } else if constexpr (kWgmma) {
      mbarrier_wait(&bars[c % kStages], uint32_t(c / kStages) & 1);
      if (L < kChunk) {
        zero_rows_past<K, Op>(b, L, tid, kThr);
        fence_proxy_async();  // the zeros are read by the tensor cores
      }
    } else {
      cp_async_wait_all();
    }
    // chunk c's inputs are visible; every state warp is done with chunk c - 1's stage
    if constexpr (kFused)
      named_barrier_sync(kStateBarrier, kThr);
    else
      __syncthreads();
    // The chunk's products, built twice: for a full chunk without any length test (one branch-free
    // block that ptxas schedules across the products), and for the last, partial one.
    auto chunk = [&](auto full) {
      constexpr bool kFull = decltype(full)::value;
      const uint32_t ks_b = smem_addr(b.ks) + off_k, qs_b = smem_addr(b.qs) + off_k, kt_b = smem_addr(b.ks) + off_kt;
      const uint32_t ts_b = smem_addr(b.ts) + off_t, ms_b = smem_addr(b.ms) + off_t, vs_b = smem_addr(b.vs) + off_v;
      // wgmma: a 64-column block of the k / q rows is 64 rows of 128 bytes
      [[maybe_unused]] constexpr uint32_t kBlock = kChunk * 128;
      // K-major descriptors of the k and q rows, and of the k rows read transposed (MN-major)
      [[maybe_unused]] const uint64_t dk = sw128_desc(smem_addr(b.ks), 16, 1024),
                                      dq = sw128_desc(smem_addr(b.qs), 16, 1024),
                                      dkt = sw128_desc(smem_addr(b.ks), kBlock, 1024);
      // Token factors of this thread's token columns 8 nt + q2 + {0, 1} (FactorRow).
      auto factor = [&](int row, int nt) {
        return *reinterpret_cast<const float2*>(&b.sc[row * kChunk + nt * 8 + q2]);
      };
      // C fragments below are 16 value rows x 64 token columns: element [nt][e] is value vw + r + 8 (e >> 1),
      // token 8 nt + q2 + (e & 1). The warp build skips token tiles past the chunk's length (zero rows).

      // ---- P^T = S^T k^T and Q^T = S^T q^T
      float pk[8][4], qo[8][4];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) pk[nt][e] = qo[nt][e] = 0.0f;
      [[maybe_unused]] float mk[kMCols / 8][4];  // kMInPass: q k^T, then M (token columns mj0 .. mj0 + 31)
      if constexpr (kMInPass) {
#pragma unroll
        for (int nt = 0; nt < kMCols / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) mk[nt][e] = 0.0f;
      }
      if constexpr (kWgmma) {
        uint32_t sa[K / 16][4];  // S^T as A fragments, held until both products complete
#pragma unroll
        for (int kk = 0; kk < K / 16; ++kk) c_to_a<Op>(s[2 * kk], s[2 * kk + 1], sa[kk]);
        wgmma_pin(pk);  // the zeros are written before the fence
        wgmma_pin(qo);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < K / 16; ++kk)
          wgmma_rs<Op, kChunk, 0, false>(pk, sa[kk], desc_add(dk, (kk / 4) * kBlock + (kk % 4) * 32));
        wgmma_commit();
#pragma unroll
        for (int kk = 0; kk < K / 16; ++kk)
          wgmma_rs<Op, kChunk, 0, false>(qo, sa[kk], desc_add(dq, (kk / 4) * kBlock + (kk % 4) * 32));
        wgmma_commit();
        if constexpr (kMInPass) {
          // M's q k^T: tokens i (rows, A = q rows) x this warpgroup's token columns mj0 .. mj0 + 31 (B = k
          // rows), both operands in shared memory
          wgmma_pin(mk);
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < K / 16; ++kk) {
            const uint32_t koff = (kk / 4) * kBlock + (kk % 4) * 32;
            wgmma_ss<Op, kMCols, 0>(mk, desc_add(dq, koff), desc_add(dk, koff + uint32_t(mj0) * 128));
          }
          wgmma_commit();
        }
      } else {
#pragma unroll
        for (int kk = 0; kk < K / 16; ++kk) {
          uint32_t a[4];
          c_to_a<Op>(s[2 * kk], s[2 * kk + 1], a);
#pragma unroll
          for (int np = 0; np < 4; ++np) {
            if (!kFull && np * 16 >= L) continue;
            uint32_t bk[4], bq[4];
            ldmatrix_x4(bk, ks_b + uint32_t(np * 16 * LDK + kk * 16) * 2);
            ldmatrix_x4(bq, qs_b + uint32_t(np * 16 * LDK + kk * 16) * 2);
            mma<Op>(pk[2 * np], a, bk[0], bk[1]);
            mma<Op>(pk[2 * np + 1], a, bk[2], bk[3]);
            mma<Op>(qo[2 * np], a, bq[0], bq[1]);
            mma<Op>(qo[2 * np + 1], a, bq[2], bq[3]);
          }
        }
      }

      // The inputs of chunk c + kStages - 1 (into the stage chunk c - 1 used: every warp is past it): issued
      // here, the P/Q products above start right after the barrier.
      if (c + kStages - 1 < nchunks) issue(c + kStages - 1, stage[(c + kStages - 1) % kStages], kBoth);
      if constexpr (kMInPass) {
        // rq of token tid / 4 from a quarter of its q row per lane (rows past a partial chunk are zero), while
        // the products run. Measured against forming it behind v_new's issue (8x8192 1.5% slower) or forming
        // the next chunk's while S's update runs (5% slower: ptxas then made q k^T wait for P and Q).
        static_assert(kThr == 4 * kChunk, "four lanes per token");
        const int t = tid >> 2, c0 = (tid & 3) * (K / 4);
        float ss = 0.0f;
#pragma unroll
        for (int u = 0; u < K / 32; ++u)
          ss += sumsq8<Op>(lds128(smem_addr(&b.qs[sw128_offset<kChunk>(t, c0 + 8 * u)])));
        ss += __shfl_xor_sync(0xffffffffu, ss, 1);
        ss += __shfl_xor_sync(0xffffffffu, ss, 2);
        if ((tid & 3) == 0) s_rq[t] = (p.heads.use_qk_l2norm ? rsqrtf(ss + 1e-6f) : 1.0f) * plan.scale;
      }
      if constexpr (kWgmma) {
        wgmma_wait<kMInPass ? 2 : 1>();  // P^T (Q^T and q k^T may still run)
        wgmma_pin(pk);
      }

      // ---- X^T = v^T - P^T diag(ek), packed as the A operand of the next product (k-step = 16 tokens)
      uint32_t xa[4][4];
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t vv[4];  // v^T of token tiles 2np, 2np+1 (value rows r, r + 8)
        ldmatrix_x4_trans(vv, vs_b + np * kVRow16);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int nt = 2 * np + half;
          const float2 ek = factor(kDecayRk, nt);
          const float2 va = unpack2<Op>(vv[2 * half]), vb = unpack2<Op>(vv[2 * half + 1]);
          xa[np][2 * half] = pack2<Op>(va.x - ek.x * pk[nt][0], va.y - ek.y * pk[nt][1]);
          xa[np][2 * half + 1] = pack2<Op>(vb.x - ek.x * pk[nt][2], vb.y - ek.y * pk[nt][3]);
        }
      }

      // ---- v_new^T = X^T T'^T   (T' lower triangular: token tile pair np needs k-steps 0..np)
      float vn[8][4];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) vn[nt][e] = 0.0f;
      if constexpr (kWgmma) {
        wgmma_pin(vn);
        wgmma_fence();
        const CausalDescs dt = causal_image_descs(b.ts);
        causal_cols_wgmma<Op>(vn, xa, dt.lo, dt.hi);
        wgmma_commit();
      }
      if constexpr (kMInPass) {
        // ---- M'[i][j] = mask_{j<=i} exp2(gc_i - gc_j) rk_j (q_i . k_j) (M without rq_i, which o's rows get
        // at the end) from the chunk prep's factors, stored to the stage's M rows while v_new's product runs
        // (o's product reads them after a CTA barrier)
        wgmma_wait<1>();  // Q^T and q k^T (v_new^T may still run)
        wgmma_pin(mk);
        float gi[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) gi[half] = b.sc[kLog2Gcum * kChunk + mrow + 8 * half];
#pragma unroll
        for (int nt = 0; nt < kMCols / 8; ++nt) {
          const int j = mj0 + nt * 8 + q2;
          const float2 gj = *reinterpret_cast<const float2*>(&b.sc[kLog2Gcum * kChunk + j]);
          const float2 kj = *reinterpret_cast<const float2*>(&b.sc[kInvNormK * kChunk + j]);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int i = mrow + 8 * (e >> 1), jj = j + (e & 1);
            const float d = exp2_approx(gi[e >> 1] - (e & 1 ? gj.y : gj.x)) * (e & 1 ? kj.y : kj.x);
            mk[nt][e] = jj <= i ? mk[nt][e] * d : 0.0f;
          }
        }
#pragma unroll
        for (int np = 0; np < kMCols / 16; ++np) {
          uint32_t frag[4];
          c_to_a<Op>(mk[2 * np], mk[2 * np + 1], frag);
          stmatrix_x4(smem_addr(b.ms) + 2 * uint32_t(sw128_offset<kChunk>(mst_row, mst_col + 16 * np)), frag);
        }
        fence_proxy_async();  // M is read by the tensor cores
      }
      if constexpr (kWgmma) {
        wgmma_wait<0>();  // v_new^T (and Q^T)
        wgmma_pin(vn);
        wgmma_pin(qo);
      } else {
        causal_cols_mma<Op, LDT, kFull>(vn, xa, ts_b, L);
      }

      // ---- A operands: v_new (for o) and vd = v_new diag(dd) (for S; dd is 0 past the chunk)
      uint32_t na[4][4], da[4][4];
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        c_to_a<Op>(vn[2 * ks], vn[2 * ks + 1], na[ks]);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int nt = 2 * ks + half;
          const float2 dd = factor(kTailDecayRk, nt);
          da[ks][2 * half] = pack2<Op>(vn[nt][0] * dd.x, vn[nt][1] * dd.y);
          da[ks][2 * half + 1] = pack2<Op>(vn[nt][2] * dd.x, vn[nt][3] * dd.y);
        }
      }

      // ---- o^T = Q^T diag(eq) + v_new^T M^T   (M lower triangular; kMInPass: (Q^T diag(e^gcum) + v_new^T M'^T)
      // diag(rq))
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const float2 eq = factor(kDecayRq, nt);
        qo[nt][0] *= eq.x;
        qo[nt][1] *= eq.y;
        qo[nt][2] *= eq.x;
        qo[nt][3] *= eq.y;
      }
      const float eg = b.sc[kChunkDecay * kChunk];
      if constexpr (kWgmma) {
        if constexpr (kMInPass) __syncthreads();  // every warpgroup's share of M is stored
        wgmma_pin(qo);
        wgmma_fence();
        const CausalDescs dm = kMInPass ? full_causal_descs(b.ms) : causal_image_descs(b.ms);
        causal_cols_wgmma<Op>(qo, na, dm.lo, dm.hi);
        wgmma_commit();
        // ---- S^T = e^{g_last} S^T + vd^T k   (B = k rows [token][k]: MN-major), overlapping o's store
        decay_state(eg);
        wgmma_pin(s);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) wgmma_rs<Op, K, 0, true>(s, da[ks], desc_add(dkt, ks * 2048));
        wgmma_commit();
        [[maybe_unused]] float2 rqv[kMInPass ? 8 : 1];  // o's row factors, read while o's product runs
        if constexpr (kMInPass) {
#pragma unroll
          for (int nt = 0; nt < 8; ++nt) rqv[nt] = *reinterpret_cast<const float2*>(&s_rq[nt * 8 + q2]);
        }
        wgmma_wait<1>();  // o^T
        wgmma_pin(qo);
        if constexpr (kMInPass) {
#pragma unroll
          for (int nt = 0; nt < 8; ++nt) {
            const float2 rq = rqv[nt];
            qo[nt][0] *= rq.x;
            qo[nt][1] *= rq.y;
            qo[nt][2] *= rq.x;
            qo[nt][3] *= rq.y;
          }
        }
      } else {
        causal_cols_mma<Op, LDT, kFull>(qo, na, ms_b, L);
      }

      // ---- o: staged transposed (stmatrix) in this warp's v columns, read above, then stored as 32-byte
      // row pieces
      __syncwarp();
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t frag[4];  // the C -> A packing is also stmatrix's fragment order
        c_to_a<Op>(qo[2 * np], qo[2 * np + 1], frag);
        stmatrix_x4_trans(vs_b + np * kVRow16, frag);
      }
      __syncwarp();
      {
        Op* const oc = o_lane + c * kChunk * p.o.token_stride;
#pragma unroll
        for (int u = 0; u < 2 * kChunk / 32; ++u) {
          if (kFull || (lane >> 1) + 16 * u < L)
            *reinterpret_cast<uint4*>(oc + 16 * u * p.o.token_stride) =
                *reinterpret_cast<const uint4*>(&b.vs[o_staged + u * int(kVRow16 / 2)]);
        }
      }

      if constexpr (kWgmma) {
        wgmma_wait<0>();  // S^T
        wgmma_pin(s);
      } else {
        // ---- S^T = e^{g_last} S^T + vd^T k   (B = k rows [token][k]: .trans)
        decay_state(eg);
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
          if (!kFull && ks * 16 >= L) continue;
#pragma unroll
          for (int np = 0; np < K / 16; ++np) {
            uint32_t bk[4];
            ldmatrix_x4_trans(bk, kt_b + uint32_t(ks * 16 * LDK + np * 16) * 2);
            mma<Op>(s[2 * np], da[ks], bk[0], bk[1]);
            mma<Op>(s[2 * np + 1], da[ks], bk[2], bk[3]);
          }
        }
      }
    };
    if (L == kChunk)
      chunk(std::true_type{});
    else
      chunk(std::false_type{});
    if constexpr (kFused) mbarrier_arrive(&prep_bars[kStages + c % kStages]);  // this thread is done with stage b

    // ---- checkpoint: entry j holds the state after token (j+1)*C, for j < min(steps, len / C)
    if (sq.cslot >= 0) {
      const int64_t done = (c + 1) * kChunk;
      if (done % C == 0 && done <= len && done / C - 1 < p.checkpoints.num_steps) {
        const int64_t j = done / C - 1;
        store_s(p.checkpoints.data, p.checkpoints.dtype,
                int64_t(sq.cslot) * p.checkpoints.slot_stride + j * (int64_t(HV) * K * V), plan.checkpoint_pairs);
      }
    }
  }

  if (sq.fslot >= 0) store_s(p.state.data, p.state.dtype, int64_t(sq.fslot) * p.state.slot_stride, plan.state_pairs);
}

// after_prep: the chunk prep is the previous kernel of the stream (launch_op), so the pass may launch
// early, with programmatic dependent launch, and wait for the prep inside.
template <int K, int V, int kSplit, class Op, bool kWgmma, int kAux = kAuxNone>
void launch_state_pass_head(const PrefillParams& p, const Plan& plan, bool after_prep, cudaStream_t stream) {
  constexpr size_t smem = head_smem_bytes<K, V / kSplit, Op, kWgmma, kAux != kAuxNone>();
  const auto kernel = state_pass_head_kernel<K, V, kSplit, Op, kWgmma, kAux>;
  static const cudaError_t attr = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  GDNKIT_CUDA_CHECK(attr);
  const HeadTensorMaps maps = kWgmma ? make_head_tensor_maps(p, plan) : HeadTensorMaps{};
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(p.num_seqs) * unsigned(p.heads.num_v_heads) * kSplit);
  cfg.blockDim = dim3(head_pass_threads<V, kSplit, kAux>());
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute pdl;
  set_programmatic_launch(cfg, pdl, after_prep);
  GDNKIT_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p, plan, maps));
}

// The wgmma build where the plan says so (Plan::wgmma_pass: the CTA owns whole warpgroups and the TMA
// coordinates fit), with the prep warpgroup where Plan::m_warpgroup says so, else the mma.sync build.
template <int K, int V, class Op>
void launch_state_pass_head(const PrefillParams& p, const Plan& plan, bool after_prep, cudaStream_t stream) {
  if (plan.head_split == 2) {
    if constexpr (V / 2 % 64 == 0)
      if (plan.wgmma_pass) return launch_state_pass_head<K, V, 2, Op, true>(p, plan, after_prep, stream);
    launch_state_pass_head<K, V, 2, Op, false>(p, plan, after_prep, stream);
  } else {
    if constexpr (V == 128 && K % 64 == 0) {
      if (plan.m_warpgroup) return launch_state_pass_head<K, V, 1, Op, true, kAuxM>(p, plan, after_prep, stream);
    }
    if (plan.wgmma_pass) return launch_state_pass_head<K, V, 1, Op, true>(p, plan, after_prep, stream);
    launch_state_pass_head<K, V, 1, Op, false>(p, plan, after_prep, stream);
  }
}

}  // namespace gdnkit::cuda::chunked_prefill
