// Kernel 2, head variant: the state pass of one (sequence, value head) per CTA (or, the persistent build, per item
// of a CTA that takes them in turn: head_pass_persistent_cta), V/16 warps, each warp owning 16 value columns of S for
// the whole K dimension (docs/design/prefill.md "Kernel 2: the head state pass").
// Same math as state_pass_kernel (state_pass_tiled.cuh), laid out so that every per-chunk product stays in the
// warp's registers:
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
//   itself, kMInPass; beside a prep warpgroup each state thread waits on the stage's mbarrier instead).
//   They arrive by cp.async into a double-buffered stage while the current chunk computes (TMA in the
//   wgmma build, two chunks ahead into three stages).
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
//     With a prep warpgroup (kMWarpgroup: a third warpgroup, prep_warpgroup.cuh) the two state warpgroups form
//     neither M nor rq: the prep warpgroup fills each stage with M and the factor rows (after the chunk prep
//     kernel without M) and hands it over by an mbarrier per stage; a fourth, the producer warpgroup, issues
//     every stage's loads and stores each full chunk's o, so that no state warpgroup issues a TMA. The two
//     state warpgroups run apart, taking turns at their P/Q products (head_chunk.cuh). With the fused prep
//     (kFusedPrep, opt-in) the prep warpgroup forms the chunk prep but M after a gate kernel, the producer's last
//     two warps the q and k norms, and the state warpgroups M (as without a prep warpgroup, meeting on a named
//     barrier of their own once both halves are stored).
//
// The kernel is built from named parts: head_stage.cuh (the build's shape, the stages, the CTA's coordinates),
// head_loader.cuh (the loader: TMA or cp.async into the stages), head_chunk.cuh (the state warps' per-chunk math),
// head_state_io.cuh (the epilogue: checkpoints and the final state) and prep_warpgroup.cuh (the prep warpgroup).
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/arch/tma.cuh"
#include "cuda/host/check.h"
#include "cuda/prefill/context_parallel.cuh"
#include "cuda/prefill/head_chunk.cuh"
#include "cuda/prefill/head_loader.cuh"
#include "cuda/prefill/head_stage.cuh"
#include "cuda/prefill/head_state_io.cuh"
#include "cuda/prefill/io.cuh"
#include "cuda/prefill/plan.h"
#include "cuda/prefill/prep_warpgroup.cuh"
#include "gdnkit/params.h"

namespace gdnkit::cuda::chunked_prefill {

template <int K, int kCols, class Op, bool kWgmma, bool kMWarpgroup = false, bool kFusedPrep = false>
constexpr size_t head_smem_bytes() {
  return kHeadStages<kWgmma> * sizeof(HeadStageOf<K, kCols, Op, kWgmma>) +
         (kFusedPrep ? sizeof(FusedPrepSmem) : kMWarpgroup ? sizeof(PrepSmem) : 0) +
         (kWgmma ? 1024 : 0);  // + alignment slack
}

// bars: the wgmma build's TMA completion of each stage. prep_bars (kProducer): [0, kStages) the prep warpgroup's
// completion of each stage (kMWarpgroup); [kStages, 2 kStages) the state warps' release of a stage (each state thread
// arrives after its last access to a chunk's stage), on which the producer waits before it loads the stage again and
// the prep warpgroup before it writes there; [2 kStages, 4 kStages) state warpgroup g's o of a full chunk staged in
// the stage's v rows (2 kStages + g kStages + stage), which the producer stores (the persistent build: every ring
// position hands over, only a full chunk's o is stored). The producer loads a stage again only after its o stores
// have read it. kFusedPrep: [4 kStages, 5 kStages) the producer's norms of the stage's chunk
// (producer_norms, 64 arrivals). Then (kStateIn) the initial state's bulk copy into the last stage, and every state
// thread's read of it (Plan::state_bulk; kMWarpgroup).
template <class S>
__device__ __forceinline__ void init_stage_barriers(int tid, uint64_t* bars, uint64_t* prep_bars) {
  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < S::kStages; ++i) {
      mbarrier_init(&bars[i], 1);
      if constexpr (S::kProducer) {
        if constexpr (S::kMWarpgroup) mbarrier_init(&prep_bars[i], kThreads);
        mbarrier_init(&prep_bars[S::kStages + i], S::kThr);
        // a state warpgroup's o of a full chunk staged in the stage's v rows (warpgroup g: 2 kStages + g kStages + i)
#pragma unroll
        for (int g = 0; g < S::kWarps / 4; ++g) mbarrier_init(&prep_bars[(2 + g) * S::kStages + i], kThreads);
        if constexpr (S::kFusedPrep) mbarrier_init(&prep_bars[4 * S::kStages + i], 64);
      }
    }
    if constexpr (S::kMWarpgroup) {
      mbarrier_init(&prep_bars[S::kStateIn], 1);
      mbarrier_init(&prep_bars[S::kStateIn + 1], S::kThr);
    }
    fence_mbarrier_init();
  }
  __syncthreads();
}

// Until chunk c's inputs are in stage b (with a prep warpgroup: the rows, zeroed past a partial chunk's end, T', M
// (beside the fused prep: the norms, M being the state warpgroups') and the factors) and, without one, every state
// warp is done with chunk c - 1's stage.
template <class S>
__device__ __forceinline__ void wait_for_stage(typename S::Stage& b, int64_t c, int L, int tid, uint64_t* bars,
                                               uint64_t* prep_bars) {
  constexpr int kStages = S::kStages;
  if constexpr (S::kMWarpgroup) {
    mbarrier_wait(&prep_bars[c % kStages], uint32_t(c / kStages) & 1);
  } else if constexpr (S::kWgmma) {
    mbarrier_wait(&bars[c % kStages], uint32_t(c / kStages) & 1);
    if (L < kChunk) {
      zero_rows_past<S::K, typename S::Op>(b, L, tid, S::kThr);
      fence_proxy_async();  // the zeros are read by the tensor cores
      if constexpr (S::kLoadWarp) named_barrier_sync(kZeroRowsBarrier, S::kThr);
    }
  } else {
    cp_async_wait_all();
  }
  // beside a producer no state thread loads a stage: the state warps meet only where they zeroed rows (above), and
  // beside a prep warpgroup they run apart, taking turns at their P/Q products (head_chunk.cuh)
  if constexpr (!S::kProducer) __syncthreads();
}

// One CTA of the head pass, build S (state_pass_head_kernel). kFirstFinal: the final pass's build (S::kCpMode 2) in
// the local pass's grid, for the first segment of a cut sequence (Plan::cp_first_final): from the sequence's initial
// slot, writing o and the checkpoints inside the segment, and its end state to cp_local for the scan.
template <class S, bool kFirstFinal = false>
__device__ __forceinline__ void head_pass_cta(const PrefillParams& p, const Plan& plan, const HeadTensorMaps& maps) {
  constexpr int K = S::K, V = S::V, kCpMode = S::kCpMode;
  constexpr bool kWgmma = S::kWgmma, kMWarpgroup = S::kMWarpgroup, kFusedPrep = S::kFusedPrep;
  static_assert(!kFirstFinal || kCpMode == 2, "the first segment's final pass");
  using Op = typename S::Op;
  using Stage = typename S::Stage;
  constexpr int kStages = S::kStages;
  static_assert(!kMWarpgroup || sizeof(Stage) >= size_t(K) * V * 4, "a stage holds an fp32 slot slice");
  static_assert(!kWgmma || sizeof(Stage::ks) + sizeof(Stage::qs) >= size_t(64) * K * 4,
                "a stage's k and q rows hold a state warpgroup's 64 fp32 value rows");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Stage* stage = reinterpret_cast<Stage*>(smem_raw + (kWgmma ? (1024 - (smem_addr(smem_raw) & 1023)) & 1023 : 0));

  HeadCoords at = head_coords<S::kSplit, S::kCols>(p);
  // whole sequences longest first (Plan::pass_order): the CTAs of a long prompt launch in the first wave
  if constexpr (kCpMode == 0)
    if (plan.pass_order != nullptr) at.n = plan.pass_order[at.n];
  SeqSlots sq;
  CpSegment seg{};
  bool run;
  [[maybe_unused]] const bool transition = kCpMode == 1 && blockIdx.y == 1;
  if constexpr (kCpMode != 0) {
    // The local pass runs the segments of cut sequences but the last (whose final pass stores the final state), and
    // the transition of every one but the first (in a split call: every segment, both); the final pass every entry
    // but, where Plan::cp_first_final, a cut sequence's first segment (it ran in the local pass's grid), and counts a
    // bad sequence once (its first segment's CTA of head 0).
    const int entry = kCpMode == 1 || kFirstFinal ? plan.cp_state_entry[at.n] : at.n;
    if (entry >= 0) seg = plan.cp_segments[entry];
    const bool last = !plan.cp_split && seg.index == seg.count - 1;
    run = entry >= 0 && seg.seq >= 0 &&
          (kCpMode == 2 ? kFirstFinal || !(plan.cp_first_final && seg.state >= 0 && seg.index == 0)
                        : seg.state >= 0 && !last && (!transition || seg.index > 0 || plan.cp_split));
    run = run && begin_sequence<S::kCtaThreads>(p, plan, seg.seq, at.h, at.v0, S::kCols,
                                                kCpMode == 2 && seg.index == 0 && at.h == 0, sq);
  } else {
    run = begin_sequence<S::kCtaThreads>(p, plan, at.n, at.h, at.v0, S::kCols, at.h == 0 && at.split == 0, sq);
  }
  if (!run) {
    // A CTA leaves here (a sequence the recurrent kernels or nobody takes) only after the prep's grid
    // completed, as every other CTA does: so that this grid never completes before the prep, whatever the
    // stream's next launch assumes about a programmatic dependent's completion.
    asm volatile("griddepcontrol.wait;" ::: "memory");
    return;
  }
  // The tokens this CTA runs and the workspace slot of their first chunk: the sequence's, or its segment's.
  const int64_t start = kCpMode != 0 ? seg.start : sq.start, len = kCpMode != 0 ? seg.len : sq.len;
  const int64_t slot0 = kCpMode != 0 ? sq.start / kChunk + seg.seq + seg.first_chunk : sq.start / kChunk + at.n;
  __shared__ uint64_t bars[kStages];
  // kMWarpgroup: [0, kStages) the prep's, [kStages, 2 kStages) the release, [2 kStages, 4 kStages) o staged (below);
  // kFusedPrep: [4 kStages, 5 kStages) the norms; then the initial state's copy and its read (S::kStateIn)
  __shared__ uint64_t prep_bars[kMWarpgroup ? S::kStateIn + 2 : S::kLoadWarp ? 4 * kStages : 1];
  __shared__ __align__(16) float s_rq[S::kMInPass ? kChunk : 1];
  // Beside a producer warpgroup, the initial slot comes by one bulk copy into the last stage (before that stage's
  // chunk) instead of K / 4 paired loads a thread, which wait behind the other CTAs' streams.
  [[maybe_unused]] const bool bulk_in = kMWarpgroup && kCpMode == 0 && plan.state_bulk && sq.islot >= 0;
  if constexpr (kMWarpgroup) {
    // The prep and producer warpgroups leave here; the state warps go on with more registers.
    init_stage_barriers<S>(at.tid, bars, prep_bars);
    // The warpgroup index as a warp-uniform value (a shuffle of lane 0's), so that ptxas allocates each role's
    // registers by its setmaxnreg.
    const int wg = __shfl_sync(0xffffffffu, at.tid / kThreads, 0);
    if (wg == S::kWarps / 4) {
      setmaxnreg_dec<kPrepRegs>();
      if constexpr (kFusedPrep) {
        FusedPrepSmem& ps = *reinterpret_cast<FusedPrepSmem*>(stage + kStages);
        fused_prep_warpgroup<K, Op, kStages>(ps, stage, bars, prep_bars, &prep_bars[4 * kStages], len);
      } else {
        PrepSmem& ps = *reinterpret_cast<PrepSmem*>(stage + kStages);
        // one instance each way, so that no test of the norm sits in the chunk loop
        if (!S::kOutputs || p.heads.use_qk_l2norm)
          prep_warpgroup<K, Op, kStages, S::kOutputs, true>(plan, ps, stage, bars, prep_bars, len);
        else
          prep_warpgroup<K, Op, kStages, S::kOutputs, false>(plan, ps, stage, bars, prep_bars, len);
      }
      return;
    }
    if (wg == S::kWarps / 4 + 1) {
      setmaxnreg_dec<kProducerRegs>();
      HeadCoords pa = at;
      pa.tid = at.tid - S::kThr - kThreads;  // the warpgroup's first thread issues every stage's loads
      if constexpr (kFusedPrep) {
        if (pa.tid >= 64) {  // the last two warps: the norms
          FusedPrepSmem& ps = *reinterpret_cast<FusedPrepSmem*>(stage + kStages);
          producer_norms<K, Op, kStages>(p, plan, ps, stage, bars, &prep_bars[4 * kStages], len, pa.tid - 64);
          return;
        }
      }
      const HeadLoader<S> loader(p, plan, maps, pa, start, len, slot0, bars, !transition);
      InitialStateCopy in = bulk_in ? initial_state_copy<K, V>(p, sq.islot, at.h) : InitialStateCopy{};
      in.bars = &prep_bars[S::kStateIn];
      producer_warpgroup<kStages, S::kOutputs, 2>(loader, stage, prep_bars, len, pa.tid == 0, &maps.o, pa.v0, pa.h,
                                                  start, in);
      return;
    }
    setmaxnreg_inc<kStateRegs>();
  }
  if constexpr (S::kLoadWarp) {  // the producer warp leaves here
    init_stage_barriers<S>(at.tid, bars, prep_bars);
    if (at.tid >= S::kThr) {
      HeadCoords pa = at;
      pa.tid = at.tid - S::kThr;  // its first thread issues every stage's loads and o stores
      const HeadLoader<S> loader(p, plan, maps, pa, start, len, slot0, bars);
      producer_warpgroup<kStages, S::kOutputs, 1>(loader, stage, prep_bars, len, pa.tid == 0, &maps.o, pa.v0, pa.h,
                                                  start, InitialStateCopy{});
      return;
    }
  }

  // S^T in registers (head_chunk.cuh), from the initial slot (pairs where Plan::state_pairs: head_state_io.cuh), or
  // under context parallelism from zero, the identity or the segment's true initial state (Plan::cp_initial)
  float s[S::KT][4];
  const int64_t cp_offset = int64_t(seg.state) * at.HV * K * V;  // a cut segment's states in the cp_* buffers
  if (kCpMode == 1 && (transition || seg.index > 0 || plan.cp_split)) {
#pragma unroll
    for (int j = 0; j < S::KT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        s[j][e] = transition && 8 * j + at.q2 + (e & 1) == at.vw + at.r + 8 * (e >> 1) ? 1.0f : 0.0f;
  } else if (kCpMode == 2 && seg.state >= 0 && !kFirstFinal) {
#pragma unroll
    for (int j = 0; j < S::KT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = plan.cp_initial[cp_offset + head_state_offset<S>(at, j, e)];
  } else if (bulk_in) {
    mbarrier_wait(&prep_bars[S::kStateIn], 0);
    load_head_state_slice<S>(s, at, &stage[kStages - 1], p.state.dtype);
    mbarrier_arrive(&prep_bars[S::kStateIn + 1]);  // the producer may load the stage's chunk
  } else {
    load_head_state_regs<S>(s, p, plan, at, sq);
  }

  const int64_t nchunks = (len + kChunk - 1) / kChunk;
  // the checkpoints this run stores (the local pass stores none)
  CheckpointClock clock;
  if constexpr (kCpMode != 1)
    clock = head_checkpoint_clock(p, plan, sq, kCpMode == 2 ? seg.first_chunk : 0, kCpMode == 2 ? seg.seq : -1);
  // Checkpoints by bulk copies (Plan::checkpoint_bulk) in the wgmma builds of one state warpgroup or beside a prep
  // warpgroup; the other two-warpgroup build (only by the override) keeps per-thread stores: ptxas spills its loop
  // with the bulk path. V-last rows are whole only where the CTA holds every column.
  constexpr bool kCheckpointBulk =
      kWgmma && (kMWarpgroup || S::kWarps == 4) && (S::kLayout == StateLayout::kKLast || S::kCols == V);
  const HeadLoader<S> loader(p, plan, maps, at, start, len, slot0, bars, !transition);
  // beside the fused prep, M's norms are the producer's (FusedPrepSmem: rk of every stage, then rq)
  float* const m_norms = kFusedPrep ? reinterpret_cast<FusedPrepSmem*>(stage + kStages)->rk[0] : s_rq;
  const HeadStateWarps<S> warps(p, plan, at, start, m_norms, &maps.o, transition,
                                S::kProducer ? &prep_bars[2 * kStages] : nullptr);  // the o hand-over

  if constexpr (kWgmma && !S::kProducer) init_stage_barriers<S>(at.tid, bars, prep_bars);
  // Launched right behind the chunk prep with programmatic dependent launch (launch_state_pass_head), the
  // CTAs that find a free SM while the prep's last CTAs finish got here early: the state loads above read
  // the pool and cu_seqlens, which the prep does not write (and what ran before the prep finished before
  // it started). The workspace is read only after the prep's grid completed. Without PDL a no-op.
  if (!S::kProducer && nchunks > 0) loader.issue(0, stage[0], kInputs);
  // (beside a producer with Plan::chunk_ready, the producer waits for each chunk's count instead, and the state warps
  // for the prep's grid at their end)
  const bool chunk_flags = HeadLoader<S>::kChunkFlags && plan.chunk_ready != nullptr;
  if (!chunk_flags) asm volatile("griddepcontrol.wait;" ::: "memory");
  if constexpr (!S::kProducer) {
    if (nchunks > 0) loader.issue(0, stage[0], kWorkspace);
#pragma unroll
    for (int i = 1; i < kStages - 1; ++i)
      if (i < nchunks) loader.issue(i, stage[i], kBoth);
  }
  for (int64_t c = 0; c < nchunks; ++c) {
    Stage& b = stage[c % kStages];
    const int L = int(min(int64_t(kChunk), len - c * kChunk));
    // chunk c - 1's o store has read its stage, which chunk c loads again (head_chunk.cuh store_o); with a producer
    // warpgroup the producer stores o and waits for that itself
    if constexpr (kWgmma && S::kOutputs && !S::kProducer)
      if (at.tid % 128 == 0) bulk_wait_group_read<0>();
    wait_for_stage<S>(b, c, L, at.tid, bars, prep_bars);
    if (L == kChunk)
      warps.template chunk<true>(b, s, c, L, nchunks, loader, stage);
    else
      warps.template chunk<false>(b, s, c, L, nchunks, loader, stage);
    const int64_t ck = kCpMode == 1 ? -1 : clock.tick(c);  // the checkpoint entry due after this chunk
    const bool ck_bulk = kCheckpointBulk && ck >= 0 && plan.checkpoint_bulk;
    if constexpr (kCheckpointBulk)
      if (ck_bulk) store_head_checkpoint_bulk<S>(s, p, at, sq, ck, b);
    if constexpr (S::kProducer) mbarrier_arrive(&prep_bars[kStages + c % kStages]);  // this thread is done with b
    if (ck >= 0 && !ck_bulk) store_head_checkpoint<S>(s, p, plan, at, sq, ck);
  }

  if constexpr (kWgmma && S::kOutputs && !S::kProducer)
    if (at.tid % 128 == 0) bulk_wait_group<0>();  // the o stores complete before the CTA's shared memory goes
  // this grid never completes before the prep's (whatever the stream's next launch assumes about PDL)
  if (chunk_flags) asm volatile("griddepcontrol.wait;" ::: "memory");

  // The state at `offset` of a buffer of dtype dt in the pool's layout (float8_e4m3: the slot's block scales at
  // `scales`). The wgmma build, K-last: each state warpgroup's 64 value rows by bulk copies (head_state_io.cuh
  // store_head_rows_bulk) through the k, q rows of a stage that no thread reads any more: beside a producer warpgroup,
  // warpgroup g's is the stage of chunk nchunks - kStages + g (not the last chunk's, which the other warpgroup may
  // still read), once every state thread released that chunk; without one (no loads left) stage g, once the state
  // warps met. V-last (the CTA's columns are the head's): the head's rows through stage 0, once the state warps met
  // (no loads are left, and the producer's o stores read the v rows).
  constexpr StateLayout layout = S::kLayout;
  const auto store_state = [&](void* base, uint8_t* scales, DType dt, int64_t offset, bool pairs,
                               [[maybe_unused]] bool bulk) {
    const int64_t head = int64_t(at.h) * K * V;
    if constexpr (kWgmma) {
      if constexpr (layout == StateLayout::kVLast) {
        if constexpr (S::kCols == V)
          if (bulk) return store_head_state_through<S>(s, at, stage[0], base, scales, dt, offset);
      } else if (bulk) {
        const int wg = at.tid / kThreads;
        const int64_t first = head + int64_t(at.v0 + 64 * wg) * K;
        Stage* buf = &stage[wg];
        if constexpr (kMWarpgroup) {
          const int64_t last = nchunks - kStages + wg;
          buf = &stage[(last % kStages + kStages) % kStages];
          if (last >= 0) mbarrier_wait(&prep_bars[kStages + last % kStages], uint32_t(last / kStages) & 1);
        } else {
          named_barrier_sync(S::kWarps == 8 ? kCheckpointBarrier : kOStoreBarrier, S::kThr);
        }
        store_head_rows_bulk<S, sizeof(buf->ks) + sizeof(buf->qs)>(
            s, at, buf->ks, static_cast<char*>(base) + (offset + first) * dtype_bytes(dt),
            scales ? scales + first / kFp8Block : nullptr, dt, kOStoreBarrier + wg);
        return;
      }
    }
    if (dt == DType::kFloat8E4M3)
      store_head_e4m3<S>(s, at, static_cast<uint8_t*>(base) + offset + head, scales + head / kFp8Block);
    else
      store_head_state<S>(s, at, base, dt, offset, pairs);
  };
  constexpr bool klast = layout == StateLayout::kKLast;
  if constexpr (kCpMode == 1 || kFirstFinal) {  // the segment's local state or transition, fp32, for the scan
    float* dst = transition ? plan.cp_transition : plan.cp_local;
    store_state(dst, nullptr, DType::kFloat32, cp_offset, klast, klast || S::kCols == V);
  } else if (sq.fslot >= 0 && (kCpMode == 0 || cp_stores_final(plan, at.n))) {
    uint8_t* const scales = p.state.dtype == DType::kFloat8E4M3
                                ? p.state.scales + int64_t(sq.fslot) * at.HV * (K * V / kFp8Block)
                                : nullptr;
    store_state(p.state.data, scales, p.state.dtype, int64_t(sq.fslot) * p.state.slot_stride, plan.state_pairs,
                  plan.state_bulk);
  }
}

// One CTA of the persistent head pass (S::kPersistent, Plan::pass_ticket): the prep warpgroup's build over the items
// the producer takes in turn (prep_warpgroup.cuh producer_persistent), the stages' ring positions running on across
// items, so that the next item's initial state and first chunks load while the current one runs. Each item's final
// state leaves through its last chunk's stage before the stage is released (Plan::state_bulk), else by the state
// threads' own stores after it.
template <class S>
__device__ __forceinline__ void head_pass_persistent_cta(const PrefillParams& p, const Plan& plan,
                                                         const HeadTensorMaps& maps) {
  static_assert(S::kPersistent, "the persistent build");
  using Op = typename S::Op;
  using Stage = typename S::Stage;
  constexpr int kStages = S::kStages;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Stage* stage = reinterpret_cast<Stage*>(smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023));
  __shared__ uint64_t bars[kStages];
  __shared__ uint64_t prep_bars[S::kStateIn + 2];  // [0, kStages) the prep's, [kStages, 2 kStages) the release, then o
  __shared__ ItemRing ring;
  HeadCoords at = head_coords<1, S::kCols>(p);
  if (at.tid == 0) {
#pragma unroll
    for (int i = 0; i < kItemSlots; ++i) {
      mbarrier_init(&ring.full[i], 1);
      mbarrier_init(&ring.free[i], kItemReaders);
    }
  }
  init_stage_barriers<S>(at.tid, bars, prep_bars);
  const int wg = __shfl_sync(0xffffffffu, at.tid / kThreads, 0);
  if (wg == S::kWarps / 4) {  // the prep warpgroup
    setmaxnreg_dec<kPrepRegs>();
    PrepSmem& ps = *reinterpret_cast<PrepSmem*>(stage + kStages);
    uint32_t r = 0;
    for (uint32_t k = 0;; ++k) {
      const HeadItem it = take_item(ring, k);
      if (it.n < 0) break;
      if (item_state_bulk(plan, it)) {  // the initial state's position: nothing to form
        if (r >= kStages) mbarrier_wait(&prep_bars[kStages + r % kStages], (r / kStages - 1) & 1);
        mbarrier_arrive(&prep_bars[r % kStages]);
        ++r;
      }
      if (p.heads.use_qk_l2norm)
        prep_warpgroup<S::K, Op, kStages, true, true>(plan, ps, stage, bars, prep_bars, it.sq.len, r);
      else
        prep_warpgroup<S::K, Op, kStages, true, false>(plan, ps, stage, bars, prep_bars, it.sq.len, r);
      r += uint32_t((it.sq.len + kChunk - 1) / kChunk);
    }
    return;
  }
  if (wg == S::kWarps / 4 + 1) {  // the producer warpgroup: its first thread
    setmaxnreg_dec<kProducerRegs>();
    if (at.tid != S::kThr + kThreads) return;
    producer_persistent<S>(p, plan, maps, stage, bars, prep_bars, ring);
    return;
  }
  setmaxnreg_inc<kStateRegs>();

  uint32_t r = 0;
  bool ran = false;  // chunks before this item
  for (uint32_t k = 0;; ++k) {
    const HeadItem it = take_item(ring, k);
    if (it.n < 0) break;
    HeadCoords a = at;
    a.n = it.n;
    a.h = it.h;
    a.hk = it.h / (a.HV / p.heads.num_qk_heads);
    float s[S::KT][4];
    if (item_state_bulk(plan, it)) {
      const uint32_t st = r % kStages;
      mbarrier_wait(&bars[st], (r / kStages) & 1);
      // the prep warpgroup's pass over this position too: it waited for position r - kStages's release, so this
      // position's release cannot complete first (and alias that phase's parity)
      mbarrier_wait(&prep_bars[st], (r / kStages) & 1);
      load_head_state_slice<S>(s, a, &stage[st], p.state.dtype);
      mbarrier_arrive(&prep_bars[kStages + st]);                   // released
      mbarrier_arrive(&prep_bars[(2 + wg) * kStages + st]);  // no o
      ++r;
    } else {
      load_head_state_regs<S>(s, p, plan, a, it.sq);
    }
    const int64_t len = it.sq.len, nchunks = (len + kChunk - 1) / kChunk;
    CheckpointClock clock = head_checkpoint_clock(p, plan, it.sq, 0, -1);
    const HeadLoader<S> loader(p, plan, maps, a, it.sq.start, len, it.sq.start / kChunk + it.n, bars);
    HeadStateWarps<S> warps(p, plan, a, it.sq.start, nullptr, &maps.o, false, &prep_bars[2 * kStages]);
    warps.ring0 = r;
    warps.ran_before = ran;
    const bool final_through = plan.state_bulk && it.sq.fslot >= 0;
    // the full chunks in one loop and a partial last chunk after it (one chunk body in the loop)
    const int64_t nfull = len / kChunk;
    const auto run_chunk = [&](auto full, int64_t c) {
      const uint32_t rc = r + uint32_t(c);
      Stage& b = stage[rc % kStages];
      mbarrier_wait(&prep_bars[rc % kStages], (rc / kStages) & 1);
      warps.template chunk<decltype(full)::value>(b, s, c, full ? kChunk : int(len - c * kChunk), nchunks, loader,
                                                   stage);
      const int64_t ck = full ? clock.tick(c) : -1;  // checkpoints follow full chunks only
      const bool ck_bulk = ck >= 0 && plan.checkpoint_bulk;
      if (ck_bulk) store_head_checkpoint_bulk<S>(s, p, a, it.sq, ck, b);
      if (final_through && c == nchunks - 1) {
        const int64_t slot = it.sq.fslot;
        store_head_state_through<S>(
            s, a, b, p.state.data,
            p.state.dtype == DType::kFloat8E4M3 ? p.state.scales + slot * a.HV * (S::K * S::V / kFp8Block) : nullptr,
            p.state.dtype, slot * p.state.slot_stride);
      }
      mbarrier_arrive(&prep_bars[kStages + rc % kStages]);  // this thread is done with b
      if (ck >= 0 && !ck_bulk) store_head_checkpoint<S>(s, p, plan, a, it.sq, ck);
    };
    for (int64_t c = 0; c < nfull; ++c) run_chunk(std::true_type{}, c);
    if (nfull < nchunks) run_chunk(std::false_type{}, nfull);
    r += uint32_t(nchunks);
    ran = ran || nchunks > 0;
    if (it.sq.fslot >= 0 && !(final_through && nchunks > 0)) store_head_state_regs<S>(s, p, plan, a, it.sq.fslot);
  }
  // warpgroup 1's turn after the CTA's last chunk (head_chunk.cuh)
  if (wg == 0 && ran) named_barrier_sync(kPqTurnBarrier, 2 * kThreads);
  // this grid never completes before the prep's (whatever the stream's next launch assumes about PDL)
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

// kSplit CTAs share one (sequence, value head), V / kSplit columns each (more SMs for few heads).
// kMWarpgroup (the wgmma build with two state warpgroups): a third warpgroup forms M in each chunk's stage
// (prep_warpgroup.cuh), after the chunk prep kernel without M; a fourth issues the loads and stores o.
// kCpMode (context_parallel.cuh): the grid's rows are the segment table's entries instead of the sequences (the
// local pass (1): the cut segments' states, two CTAs per state and value head; blockIdx.y: 0 the segment from zero,
// 1 its transition; the first segment's y = 0 CTA runs its final pass there where Plan::cp_first_final).
// kFusedPrep (with kMWarpgroup, whole sequences): the prep warpgroup forms the chunk prep but M (fused_prep_warpgroup)
// after the gate kernel, with the norms from the producer's last two warps; the state warpgroups form M.
// kPersistent: one CTA per SM over the items (head_pass_persistent_cta). kLayout: the states' (HeadPass).
template <int K, int V, int kSplit, class Op, bool kWgmma, bool kMWarpgroup, int kCpMode, bool kFusedPrep,
          bool kPersistent, StateLayout kLayout>
__global__ void __launch_bounds__(
    HeadPass<K, V, kSplit, Op, kWgmma, kMWarpgroup, kCpMode, kFusedPrep, kPersistent, kLayout>::kCtaThreads, 1)
    state_pass_head_kernel(const PrefillParams p, const Plan plan, const __grid_constant__ HeadTensorMaps maps) {
  using S = HeadPass<K, V, kSplit, Op, kWgmma, kMWarpgroup, kCpMode, kFusedPrep, kPersistent, kLayout>;
  if constexpr (kPersistent) {
    return head_pass_persistent_cta<S>(p, plan, maps);
  } else if constexpr (kCpMode == 1) {
    using Final = HeadPass<K, V, kSplit, Op, kWgmma, kMWarpgroup, 2, kFusedPrep, false, kLayout>;
    static_assert(Final::kCtaThreads == S::kCtaThreads && sizeof(typename Final::Stage) == sizeof(typename S::Stage),
                  "the local pass's grid runs the final pass's build in the same CTA shape");
    if (plan.cp_first_final && blockIdx.y == 0) {
      const int entry = plan.cp_state_entry[blockIdx.x / unsigned(kSplit * p.heads.num_v_heads)];
      if (entry >= 0 && plan.cp_segments[entry].index == 0) return head_pass_cta<Final, true>(p, plan, maps);
    }
  }
  head_pass_cta<S>(p, plan, maps);
}

// after_prep: the chunk prep (or the fused prep's gate kernel) is the previous kernel of the stream (launch_op), so
// the pass may launch early, with programmatic dependent launch, and wait for the prep inside. L: the states' layout.
template <StateLayout L, int K, int V, int kSplit, class Op, bool kWgmma, bool kMWarpgroup = false, int kCpMode = 0,
          bool kFusedPrep = false, bool kPersistent = false>
void launch_state_pass_head(const PrefillParams& p, const Plan& plan, bool after_prep, cudaStream_t stream) {
  constexpr size_t smem = head_smem_bytes<K, V / kSplit, Op, kWgmma, kMWarpgroup, kFusedPrep>();
  using S = HeadPass<K, V, kSplit, Op, kWgmma, kMWarpgroup, kCpMode, kFusedPrep, kPersistent, L>;
  const auto kernel =
      state_pass_head_kernel<K, V, kSplit, Op, kWgmma, kMWarpgroup, kCpMode, kFusedPrep, kPersistent, L>;
  allow_dynamic_smem<
      state_pass_head_kernel<K, V, kSplit, Op, kWgmma, kMWarpgroup, kCpMode, kFusedPrep, kPersistent, L>>(smem);
  const HeadTensorMaps maps = kWgmma ? make_head_tensor_maps(p, plan) : HeadTensorMaps{};
  cudaLaunchConfig_t cfg = {};
  const unsigned rows = kCpMode == 1   ? unsigned(plan.cp_max_states)
                        : kCpMode == 2 ? unsigned(plan.cp_max_segments)
                                       : unsigned(p.num_seqs);
  const unsigned items = rows * unsigned(p.heads.num_v_heads) * kSplit;
  cfg.gridDim = dim3(kPersistent ? unsigned(plan.pass_ctas) : items, kCpMode == 1 ? 2 : 1);
  cfg.blockDim = dim3(S::kCtaThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute pdl;
  set_programmatic_launch(cfg, pdl, after_prep);
  GDNKIT_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p, plan, maps));
}

// The context-parallel passes and scan (context_parallel.cuh) on the wgmma build, K = V, one CTA per segment and
// value head (with the prep warpgroup where the plan says so).
template <StateLayout L, int K, class Op, bool kMWarpgroup>
void launch_cp_build(const PrefillParams& p, const Plan& plan, bool after_prep, cudaStream_t stream) {
  launch_state_pass_head<L, K, K, 1, Op, true, kMWarpgroup, 1>(p, plan, after_prep, stream);
  launch_cp_scan<K>(p, plan, stream);
  launch_state_pass_head<L, K, K, 1, Op, true, kMWarpgroup, 2>(p, plan, false, stream);
}
// A split call's halves (split_prefill_begin / _end) on the same passes: the local pass and the piece summaries, then
// after the exchange the fold and the final pass. A rank without tokens runs the scans alone.
template <StateLayout L, int K, class Op, bool kMWarpgroup>
void launch_split_build(const PrefillParams& p, const Plan& plan, bool begin, bool after_prep, cudaStream_t stream) {
  const bool tokens = p.total_tokens > 0;
  if (begin) {
    if (tokens) launch_state_pass_head<L, K, K, 1, Op, true, kMWarpgroup, 1>(p, plan, after_prep, stream);
    launch_cp_scan<K, ScanRole::kCompose>(p, plan, stream);
  } else {
    launch_cp_scan<K, ScanRole::kFold>(p, plan, stream);
    if (tokens) launch_state_pass_head<L, K, K, 1, Op, true, kMWarpgroup, 2>(p, plan, false, stream);
  }
}
// f(std::integral_constant<StateLayout, L>()) for the states' layout L: each build holds one layout's state I/O.
template <class F>
void with_states_layout(const PrefillParams& p, F&& f) {
  if (p.state.layout == StateLayout::kVLast) return f(std::integral_constant<StateLayout, StateLayout::kVLast>());
  f(std::integral_constant<StateLayout, StateLayout::kKLast>());
}
template <int K, class Op>
void launch_split_passes(const PrefillParams& p, const Plan& plan, bool begin, bool after_prep, cudaStream_t stream) {
  with_states_layout(p, [&](auto layout) {
    constexpr StateLayout L = decltype(layout)::value;
    if constexpr (K == 128)
      if (plan.m_warpgroup) return launch_split_build<L, K, Op, true>(p, plan, begin, after_prep, stream);
    launch_split_build<L, K, Op, false>(p, plan, begin, after_prep, stream);
  });
}
template <int K, class Op>
void launch_cp_passes(const PrefillParams& p, const Plan& plan, bool after_prep, cudaStream_t stream) {
  with_states_layout(p, [&](auto layout) {
    constexpr StateLayout L = decltype(layout)::value;
    if constexpr (K == 128)
      if (plan.m_warpgroup) return launch_cp_build<L, K, Op, true>(p, plan, after_prep, stream);
    launch_cp_build<L, K, Op, false>(p, plan, after_prep, stream);
  });
}

// The wgmma build where the plan says so (Plan::wgmma_pass: the CTA owns whole warpgroups and the TMA
// coordinates fit), with the prep warpgroup where Plan::m_warpgroup says so, else the mma.sync build.
template <StateLayout L, int K, int V, class Op>
void launch_state_pass_head_of(const PrefillParams& p, const Plan& plan, bool after_prep, cudaStream_t stream) {
  if (plan.head_split == 2) {
    if constexpr (V / 2 % 64 == 0)
      if (plan.wgmma_pass) return launch_state_pass_head<L, K, V, 2, Op, true>(p, plan, after_prep, stream);
    launch_state_pass_head<L, K, V, 2, Op, false>(p, plan, after_prep, stream);
  } else {
    if constexpr (V == 128 && K % 64 == 0) {
      if (plan.fused_prep)
        return launch_state_pass_head<L, K, V, 1, Op, true, true, 0, true>(p, plan, after_prep, stream);
      if (plan.m_warpgroup && plan.pass_ticket != nullptr)
        return launch_state_pass_head<L, K, V, 1, Op, true, true, 0, false, true>(p, plan, after_prep, stream);
      if (plan.m_warpgroup) return launch_state_pass_head<L, K, V, 1, Op, true, true>(p, plan, after_prep, stream);
    }
    if (plan.wgmma_pass) return launch_state_pass_head<L, K, V, 1, Op, true>(p, plan, after_prep, stream);
    launch_state_pass_head<L, K, V, 1, Op, false>(p, plan, after_prep, stream);
  }
}
template <int K, int V, class Op>
void launch_state_pass_head(const PrefillParams& p, const Plan& plan, bool after_prep, cudaStream_t stream) {
  with_states_layout(p, [&](auto layout) {
    launch_state_pass_head_of<decltype(layout)::value, K, V, Op>(p, plan, after_prep, stream);
  });
}

}  // namespace gdnkit::cuda::chunked_prefill
