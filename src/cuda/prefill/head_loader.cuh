// The head state pass's loader: chunk c's inputs into a stage (docs/design/prefill.md "Inputs by TMA, three
// stages"). The wgmma build: TMA tiles of the k, q, v rows and bulk copies of the workspace's causal images and
// factor rows, issued by thread 0 and counted on the stage's mbarrier. The mma.sync build: 16-byte cp.async pieces
// from every state thread, rows past the sequence zero-filled, one commit group per chunk.
#pragma once

#include <cstdint>

#include "cuda/arch/dtype.cuh"
#include "cuda/arch/tma.cuh"
#include "cuda/arch/wgmma.cuh"
#include "cuda/prefill/causal_image.cuh"
#include "cuda/prefill/head_stage.cuh"
#include "cuda/prefill/plan.h"
#include "gdnkit/params.h"

namespace gdnkit::cuda::chunked_prefill {

// Parts of a chunk's inputs: kInputs (the k, q, v rows), kWorkspace (what the chunk prep wrote: T', M unless the
// pass forms it, the factors), or both. Chunk 0's inputs go out before griddepcontrol.wait, its workspace part after
// it (both arrive on one mbarrier / in one cp.async group).
constexpr int kInputs = 1, kWorkspace = 2, kBoth = 3;

// Until `count` (a chunk slot's chunk prep CTAs that finished: Plan::chunk_ready) reaches `target`; the acquire
// orders the prep's writes before this thread's bulk copies of them (after the proxy fence).
__device__ __forceinline__ void wait_chunk_ready(const uint32_t* count, uint32_t target) {
  uint32_t n;
  while (true) {
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(n) : "l"(count) : "memory");
    if (n >= target) break;
    __nanosleep(64);
  }
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// The wgmma build's loads of one chunk into a stage, counted on its mbarrier: HeadLoader's (a sequence's chunks) and
// the persistent producer's (issue_item_chunk: an item's chunks from its token, heads and slot alone).
template <class S>  // HeadPass
struct ChunkTma {
  using Op = typename S::Op;
  static constexpr int K = S::K;
  static constexpr uint32_t kVBytes = uint32_t(S::kCols * kChunk * 2);
  static constexpr bool kReadsM = !S::kMInPass && !S::kMWarpgroup && S::kOutputs;  // M from the workspace
  // Both parts' bytes (with a prep warpgroup: the rows, T' and the factor rows kLog2Gcum, kInvNormK; it forms the
  // rest; without o: no q rows and no M; the fused prep: the rows and the gate rows kLog2Gcum, kBeta alone).
  static constexpr uint32_t kBytes =
      uint32_t(((S::kOutputs ? 2 : 1) * K * kChunk) * 2) + kVBytes +
      uint32_t((S::kFusedPrep ? 0 : S::kMWarpgroup || S::kMInPass || !S::kOutputs ? 1 : 2) * kCausalImageElems * 2 +
               (S::kMWarpgroup ? 2 : S::kFRows) * kChunk * 4);

  // The k (and q) rows of tokens tk .. tk + 63 of q/k head hk; where load_v, the v columns from v0 of value head h.
  template <class Stage>
  static __device__ __forceinline__ void rows(const HeadTensorMaps& maps, Stage& b, uint64_t* bar, int tk, int hk,
                                              int h, int v0, bool load_v) {
#pragma unroll
    for (int i = 0; i < K / 64; ++i) {
      tma_load_3d(&b.ks[i * 64 * kChunk], &maps.k, 64 * i, hk, tk, bar);
      if constexpr (S::kOutputs) tma_load_3d(&b.qs[i * 64 * kChunk], &maps.q, 64 * i, hk, tk, bar);
    }
    if (load_v) {
#pragma unroll
      for (int i = 0; i < S::kCols / 64; ++i) tma_load_3d(&b.vs[i * 64 * kChunk], &maps.v, v0 + 64 * i, h, tk, bar);
    }
  }

  // A workspace entry: its T' (t) and M (m, where neither the pass nor its prep warpgroup forms it) causal images,
  // one bulk copy each, and its factor rows (f: the entry's kFRows rows; beside a prep warpgroup kLog2Gcum and
  // kInvNormK alone).
  template <class Stage>
  static __device__ __forceinline__ void workspace(Stage& b, uint64_t* bar, const Op* t, const Op* m, const float* f) {
    if constexpr (!S::kFusedPrep) bulk_load(b.ts, t, kCausalImageElems * 2, bar);
    if constexpr (kReadsM) bulk_load(b.ms, m, kCausalImageElems * 2, bar);
    if constexpr (S::kMWarpgroup)
      bulk_load(b.sc + kLog2Gcum * kChunk, f + kLog2Gcum * kChunk, 2 * kChunk * 4, bar);
    else
      bulk_load(b.sc, f, S::kFRows * kChunk * 4, bar);
  }
};

template <class S>  // HeadPass
struct HeadLoader {
  using Op = typename S::Op;
  static constexpr int K = S::K, kCols = S::kCols, kThr = S::kThr, kStages = S::kStages, kFRows = S::kFRows;
  // The mma.sync build's pieces: 16 bytes each, a thread's are rows row0 + u * step of fixed columns.
  static constexpr int KP = K / 8, VP = kCols / 8;              // 16-byte pieces per row
  static constexpr int kStepK = kThr / KP, kStepV = kThr / VP;  // rows between a thread's pieces
  // The builds whose producer may wait for each chunk's count (Plan::chunk_ready): beside a producer, whole sequences.
  static constexpr bool kChunkFlags = S::kProducer && S::kCpMode == 0;

  const PrefillParams& p;
  const Plan& plan;
  const HeadTensorMaps& maps;
  uint64_t* bars;  // the wgmma build: the TMA completion of each stage
  int tid, hk, h, v0, HV;
  int64_t start, len;
  int rk0, ck, rv0, cvv;
  // The mma.sync build's source pointers, formed once and advanced by whole chunks (64 tokens; HV workspace
  // entries); k_zero .. v_zero: token 0, a valid source for the zero fills.
  const Op *k_zero, *q_zero, *v_zero, *k_src, *q_src, *v_src, *t_src, *m_src;
  const float* f_src;
  // The wgmma build's T' and M as causal images (kCausalImageElems of each entry's 64 x 64).
  const Op *t_img, *m_img;
  // The context-parallel transition CTA reads v as zero: its v tiles are not loaded.
  bool load_v;
  // Beside a producer, Plan::chunk_ready from the sequence's first chunk slot: chunk c's workspace part waits for its
  // count to reach the prep's CTAs per slot (null: the pass waited for the prep's grid).
  const uint32_t* ready;

  __device__ __forceinline__ HeadLoader(const PrefillParams& p_, const Plan& plan_, const HeadTensorMaps& maps_,
                                        const HeadCoords& at, int64_t start_, int64_t len_, int64_t slot0,
                                        uint64_t* bars_, bool load_v_ = true)
      : p(p_), plan(plan_), maps(maps_), bars(bars_), load_v(load_v_) {
    tid = at.tid, hk = at.hk, h = at.h, v0 = at.v0, HV = at.HV;
    start = start_, len = len_;
    rk0 = tid / KP, ck = tid % KP, rv0 = tid / VP, cvv = tid % VP;
    k_zero = static_cast<const Op*>(p.k.data) + hk * p.k.head_stride;
    q_zero = static_cast<const Op*>(p.q.data) + hk * p.q.head_stride;
    v_zero = static_cast<const Op*>(p.v.data) + h * p.v.head_stride;
    k_src = k_zero + (start + rk0) * p.k.token_stride + ck * 8;
    q_src = q_zero + (start + rk0) * p.q.token_stride + ck * 8;
    v_src = v_zero + (start + rv0) * p.v.token_stride + v0 + cvv * 8;
    const int64_t ws0 = slot0 * HV + h;
    t_src = static_cast<const Op*>(plan.ws_tprime) + ws0 * (kChunk * kChunk) + tid * 8;
    m_src = S::kWgmma ? nullptr : static_cast<const Op*>(plan.ws_masked_qk) + ws0 * (kChunk * kChunk) + tid * 8;
    f_src = plan.ws_factors + ws0 * (kFRows * kChunk);
    t_img = static_cast<const Op*>(plan.ws_tprime) + ws0 * (kChunk * kChunk);
    m_img = S::kMInPass ? nullptr : static_cast<const Op*>(plan.ws_masked_qk) + ws0 * (kChunk * kChunk);
    ready = kChunkFlags && plan.chunk_ready != nullptr ? plan.chunk_ready + slot0 : nullptr;
  }

  // Chunk c's `parts` into stage b.
  template <class Stage>
  __device__ __forceinline__ void issue(int64_t c, Stage& b, int parts) const {
    if constexpr (S::kWgmma) {
      if (tid == 0) issue_tma(c, b, parts);
    } else {
      if (parts & kInputs) issue_rows(c, b);
      if (parts & kWorkspace) issue_workspace(c, b);
    }
  }

 private:
  template <class Stage>
  __device__ __forceinline__ void issue_tma(int64_t c, Stage& b, int parts) const {
    using Tma = ChunkTma<S>;
    uint64_t* bar = &bars[c % kStages];
    if (parts & kInputs) {
      fence_proxy_async();  // this stage's generic reads (two chunks ago) before the async writes
      mbarrier_arrive_expect_tx(bar, load_v ? Tma::kBytes : Tma::kBytes - Tma::kVBytes);
      Tma::rows(maps, b, bar, int(start + c * kChunk), hk, h, v0, load_v);
    }
    if (parts & kWorkspace) {
      if constexpr (kChunkFlags)
        if (ready != nullptr) wait_chunk_ready(ready + c, uint32_t(p.heads.num_qk_heads * plan.prep_parts));
      const int64_t wc = c * HV * (kChunk * kChunk);  // the chunk's entry: HV entries a chunk slot
      Tma::workspace(b, bar, t_img + wc, Tma::kReadsM ? m_img + wc : nullptr, f_src + c * HV * (kFRows * kChunk));
    }
  }

  template <class Stage>
  __device__ __forceinline__ void issue_rows(int64_t c, Stage& b) const {
    constexpr int LDK = S::LDK, LDV = S::LDV;
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

  template <class Stage>
  __device__ __forceinline__ void issue_workspace(int64_t c, Stage& b) const {
    constexpr int LDT = S::LDT;
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

}  // namespace gdnkit::cuda::chunked_prefill
