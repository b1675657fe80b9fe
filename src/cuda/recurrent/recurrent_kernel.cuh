// The recurrent kernel behind decode, verify and commit-by-recompute: one CTA per (sequence, value
// head, block of kBV columns v), the state tile in fp32 registers across every token of the sequence
// (one state read, one write, plus the intermediate states verify is asked to store).
//
// One token (SPEC.md "The recurrence"), with the decay folded into the dot products so both are taken
// from the registers in one pass, before the update:
//   S^T k (after decay) = exp(g) * (S^T k)        u_v = beta * (v_v - exp(g) * (S^T k)_v)
//   o_v = (S_new^T q)_v = exp(g) * (S^T q)_v + (k . q) * u_v
//   S_new[k][v] = exp(g) * S[k][v] + k_k * u_v
// q and k (after the optional L2 norm and the scale), v and the gates of the token are staged in shared
// memory once per CTA; every warp recomputes the norms from there (cheaper than another barrier).
//
// Trees (parent given): token t continues from the state after parent[t]. When parent[t] is the token
// the registers hold (a chain inside the tree), that is one step; otherwise the CTA reloads the pool
// state and replays the ancestors of t in index order (a parent precedes its child), recomputing rather
// than reading the intermediate cache, which may be bf16 or absent. Cost O(T * depth) steps, for T <= 64
// draft tokens (the ancestor set is a 64-bit mask).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/check.h"
#include "cuda/common/dtype.cuh"
#include "cuda/recurrent/tile.cuh"
#include "gdnkit/params.h"

namespace gdnkit::cuda::recurrent {

enum class Mode : int32_t {
  kScore = 0,   // decode / verify: o for every token, intermediate states when asked
  kReplay = 1,  // commit by recompute: replay the kept tokens (no q, no o) and store the state
};

// What a launch does beyond the tokens: decode and chain verify with update_state store the final state.
struct Launch {
  Mode mode = Mode::kScore;
  bool write_state = false;
};

template <StateLayout kLayout, class TS, class TI, int K, int V>
void launch_recurrent(const CommitParams& p, Launch what, Stream stream);

#ifdef GDNKIT_RECURRENT_DEFINE_KERNELS

template <StateLayout kLayout, class TS, class TI, int K, int V>
__global__ void __launch_bounds__(kThreads, (TileMap<kLayout, TS, K, V>::kMinBlocks)) recurrent_kernel(const CommitParams p, const Launch what) {
  using Map = TileMap<kLayout, TS, K, V>;
  constexpr bool kKLast = kLayout == StateLayout::kKLast;
  constexpr int kBV = Map::kBV, kRuns = Map::kRuns, kChunks = Map::kChunks, kVec = Map::kVec;
  constexpr int kBlocksV = V / kBV;
  constexpr int64_t kHeadElems = int64_t(K) * V;

  __shared__ __align__(16) float s_q[K];
  __shared__ __align__(16) float s_k[K];
  __shared__ float s_v[kBV];
  __shared__ float s_gate[2];                          // g, beta of the staged token
  __shared__ float s_red[kKLast ? 1 : kWarps][kBV][2];  // V-last: per-warp partial S^T k, S^T q

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int b = blockIdx.x / kBlocksV;
  const int vb = (blockIdx.x % kBlocksV) * kBV;
  const int hv = blockIdx.y;
  const int HV = p.heads.num_v_heads;
  const int hq = hv / (HV / p.heads.num_qk_heads);
  const int T = p.num_draft_tokens;
  const bool replay = what.mode == Mode::kReplay;
  // Errors of a sequence are counted once: by thread 0 of its (head 0, v-block 0) CTA.
  const bool counter = hv == 0 && blockIdx.x % kBlocksV == 0 && tid == 0 && p.error_flag != nullptr;

  // ---- which tokens, which slots (the same checks, in the same order, as the CPU reference) -----
  int64_t tok0;
  int len;
  if (p.cu_seqlens != nullptr) {
    tok0 = p.cu_seqlens[b];
    len = p.cu_seqlens[b + 1] - p.cu_seqlens[b];
  } else {
    tok0 = int64_t(b) * T;
    len = T;
  }
  if (len < 0 || len > T) {  // a row the kernel cannot place: counted, nothing written
    if (counter) atomicAdd(p.error_flag, 1);
    return;
  }
  const int slot = p.state_indices[b];
  if (replay && slot < 0) return;  // padding row: commit leaves it alone
  bool bad = slot >= p.state.num_slots;
  int n_replay = 0, islot = -1;
  if (replay) {
    n_replay = p.accepted[b];
    bad = bad || n_replay < 0 || n_replay > len;
    for (int j = 0; j < n_replay && !bad && p.accepted_path != nullptr; ++j) {
      const int x = p.accepted_path[int64_t(b) * T + j];
      bad = x < 0 || x >= len;
    }
  } else {
    if (p.intermediate.data != nullptr && p.intermediate_indices != nullptr) {
      islot = p.intermediate_indices[b];
      bad = bad || islot >= p.intermediate.num_slots;
    }
    for (int t = 0; t < len && !bad && p.parent != nullptr; ++t) {
      const int x = p.parent[int64_t(b) * T + t];
      bad = x < -1 || x >= t;
    }
  }

  const auto out_ptr = [&](int64_t tok) {
    return static_cast<TI*>(p.o.data) + tok * p.o.token_stride + int64_t(hv) * p.o.head_stride + vb;
  };
  if (bad || slot < 0) {  // padding row, or one the kernel must not touch: o = 0, no state traffic
    if (bad && counter) atomicAdd(p.error_flag, 1);
    if (!replay)
      for (int t = 0; t < len; ++t)
        for (int i = tid; i < kBV; i += kThreads) out_ptr(tok0 + t)[i] = from_float<TI>(0.0f);
    return;
  }
  if (replay && n_replay == 0) return;  // nothing kept: the pool state stays

  // ---- the state tile -------------------------------------------------------------------------
  TS* const head = static_cast<TS*>(p.state.data) + int64_t(slot) * p.state.slot_stride + hv * kHeadElems;
  float s[kRuns][kChunks][kVec];
  const auto load_root = [&] {
#pragma unroll
    for (int r = 0; r < kRuns; ++r)
#pragma unroll
      for (int c = 0; c < kChunks; ++c) load_vec<TS, kVec>(head + Map::chunk_offset(tid, vb, r, c), s[r][c]);
  };
  const auto store_tile = [&](auto* base) {
    using E = std::remove_pointer_t<decltype(base)>;
#pragma unroll
    for (int r = 0; r < kRuns; ++r)
#pragma unroll
      for (int c = 0; c < kChunks; ++c) store_vec<E, kVec>(base + Map::chunk_offset(tid, vb, r, c), s[r][c]);
  };
  load_root();  // issued first: the token staging below overlaps these loads

  const float scale = p.heads.scale > 0.0f ? p.heads.scale : 1.0f / sqrtf(float(K));
  const Gating& gt = p.gating;

  // One token x (local index) of this sequence: stage, dot products, update; o when asked.
  const auto step = [&](int x, bool write_o) {
    const int64_t tok = tok0 + x;
    __syncthreads();  // the previous token's staging and reduction buffers are consumed
    const TI* kp = static_cast<const TI*>(p.k.data) + tok * p.k.token_stride + int64_t(hq) * p.k.head_stride;
    const TI* qp = static_cast<const TI*>(p.q.data) + tok * p.q.token_stride + int64_t(hq) * p.q.head_stride;
    const TI* vp = static_cast<const TI*>(p.v.data) + tok * p.v.token_stride + int64_t(hv) * p.v.head_stride + vb;
    for (int i = tid; i < K; i += kThreads) {
      s_k[i] = to_float(kp[i]);
      s_q[i] = replay ? 0.0f : to_float(qp[i]);
    }
    for (int i = tid; i < kBV; i += kThreads) s_v[i] = to_float(vp[i]);
    if (tid == 0) {
      float g, beta;
      if (gt.mode == GateMode::kFused) {
        const float a = load_dyn(gt.a.data, gt.a.dtype, tok * gt.a.token_stride + hv * gt.a.head_stride);
        const float bb = load_dyn(gt.b.data, gt.b.dtype, tok * gt.b.token_stride + hv * gt.b.head_stride);
        g = fused_decay(gt.A_log[hv], a, gt.dt_bias != nullptr ? gt.dt_bias[hv] : 0.0f);
        beta = sigmoid(bb);
      } else {
        g = load_dyn(gt.g.data, gt.g.dtype, tok * gt.g.token_stride + hv * gt.g.head_stride);
        beta = load_dyn(gt.beta.data, gt.beta.dtype, tok * gt.beta.token_stride + hv * gt.beta.head_stride);
      }
      s_gate[0] = g;
      s_gate[1] = beta;
    }
    __syncthreads();

    // q, k norms and k . q: each warp reduces the staged vectors itself.
    float kk = 0.0f, qq = 0.0f, kq = 0.0f;
#pragma unroll
    for (int i = lane; i < K; i += 32) {
      kk += s_k[i] * s_k[i];
      qq += s_q[i] * s_q[i];
      kq += s_k[i] * s_q[i];
    }
    kk = warp_sum(kk);
    qq = warp_sum(qq);
    kq = warp_sum(kq);
    const float rk = p.heads.use_qk_l2norm ? 1.0f / sqrtf(kk + 1e-6f) : 1.0f;
    const float rq = (p.heads.use_qk_l2norm ? 1.0f / sqrtf(qq + 1e-6f) : 1.0f) * scale;
    const float kq_n = kq * rk * rq;
    const float decay = expf(s_gate[0]), beta = s_gate[1];

    // The norms are applied to the sums, not the vectors: S^T (k rk) = rk (S^T k), and the update
    // k_k u_v with normalized k is raw k_k (rk u_v). The staged raw q, k are read where used and not
    // kept in registers, which bounds how many CTAs (and state loads in flight) an SM holds.
    if constexpr (kKLast) {
      float pk[kRuns], pq[kRuns];
#pragma unroll
      for (int r = 0; r < kRuns; ++r) pk[r] = 0.0f, pq[r] = 0.0f;
#pragma unroll
      for (int c = 0; c < kChunks; ++c)
#pragma unroll
        for (int j = 0; j < kVec; j += 4) {
          const int k = Map::k_of(tid, c, j);
          const float4 k4 = lds4_fresh(&s_k[k]), q4 = lds4_fresh(&s_q[k]);
#pragma unroll
          for (int r = 0; r < kRuns; ++r) {
            pk[r] = fmaf(s[r][c][j], k4.x, pk[r]), pq[r] = fmaf(s[r][c][j], q4.x, pq[r]);
            pk[r] = fmaf(s[r][c][j + 1], k4.y, pk[r]), pq[r] = fmaf(s[r][c][j + 1], q4.y, pq[r]);
            pk[r] = fmaf(s[r][c][j + 2], k4.z, pk[r]), pq[r] = fmaf(s[r][c][j + 2], q4.z, pq[r]);
            pk[r] = fmaf(s[r][c][j + 3], k4.w, pk[r]), pq[r] = fmaf(s[r][c][j + 3], q4.w, pq[r]);
          }
        }
      float uk[kRuns];  // rk * u_v of each run
#pragma unroll
      for (int r = 0; r < kRuns; ++r) {
        const float sk = lane_group_sum<Map::kLanesPerV>(pk[r]) * rk;
        const float sq = lane_group_sum<Map::kLanesPerV>(pq[r]) * rq;
        const int vl = Map::v_of_run(tid, r);
        const float u = beta * (s_v[vl] - decay * sk);
        if (write_o && Map::writes_output(tid)) out_ptr(tok)[vl] = from_float<TI>(decay * sq + kq_n * u);
        uk[r] = u * rk;
      }
#pragma unroll
      for (int c = 0; c < kChunks; ++c)
#pragma unroll
        for (int j = 0; j < kVec; j += 4) {
          const float4 k4 = lds4_fresh(&s_k[Map::k_of(tid, c, j)]);
#pragma unroll
          for (int r = 0; r < kRuns; ++r) {
            s[r][c][j] = fmaf(k4.x, uk[r], decay * s[r][c][j]);
            s[r][c][j + 1] = fmaf(k4.y, uk[r], decay * s[r][c][j + 1]);
            s[r][c][j + 2] = fmaf(k4.z, uk[r], decay * s[r][c][j + 2]);
            s[r][c][j + 3] = fmaf(k4.w, uk[r], decay * s[r][c][j + 3]);
          }
        }
    } else {
      // Runs are along v: this thread's kRuns k rows; dot products per element (= per v), reduced
      // across the lanes with the same columns, then across the warps through shared memory.
      float pk[kVec], pq[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) pk[e] = 0.0f, pq[e] = 0.0f;
#pragma unroll
      for (int r = 0; r < kRuns; ++r) {
        const float kv = lds_fresh(&s_k[Map::k_of_run(tid, r)]), qv = lds_fresh(&s_q[Map::k_of_run(tid, r)]);
#pragma unroll
        for (int e = 0; e < kVec; ++e) pk[e] = fmaf(s[r][0][e], kv, pk[e]), pq[e] = fmaf(s[r][0][e], qv, pq[e]);
      }
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        pk[e] = group_sum<Map::kThreadsV>(pk[e]);
        pq[e] = group_sum<Map::kThreadsV>(pq[e]);
      }
      const int c0 = Map::tv(tid) * kVec;  // first local column of this thread
      if (lane < Map::kThreadsV) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) s_red[warp][c0 + e][0] = pk[e], s_red[warp][c0 + e][1] = pq[e];
      }
      __syncthreads();
      float uk[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        float sk = 0.0f, sq = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) sk += s_red[w][c0 + e][0], sq += s_red[w][c0 + e][1];
        const float u = beta * (s_v[c0 + e] - decay * (sk * rk));
        if (write_o && Map::writes_output(tid)) out_ptr(tok)[c0 + e] = from_float<TI>(decay * (sq * rq) + kq_n * u);
        uk[e] = u * rk;
      }
#pragma unroll
      for (int r = 0; r < kRuns; ++r) {
        const float kv = lds_fresh(&s_k[Map::k_of_run(tid, r)]);
#pragma unroll
        for (int e = 0; e < kVec; ++e) s[r][0][e] = fmaf(kv, uk[e], decay * s[r][0][e]);
      }
    }
  };

  // ---- the tokens -------------------------------------------------------------------------------
  if (replay) {
    for (int j = 0; j < n_replay; ++j) step(p.accepted_path != nullptr ? p.accepted_path[int64_t(b) * T + j] : j, false);
    store_tile(head);
    return;
  }
  int held = -1;  // the token whose state the registers hold; -1: the pool state
  for (int t = 0; t < len; ++t) {
    if (p.parent != nullptr) {
      const int32_t* par = p.parent + int64_t(b) * T;  // checked above: -1 <= par[t] < t
      const int pt = par[t];
      if (pt != held) {
        uint64_t ancestors = 0;
        for (int x = pt; x >= 0; x = par[x]) ancestors |= uint64_t(1) << x;
        load_root();
        while (ancestors != 0) {
          const int x = __ffsll(static_cast<long long>(ancestors)) - 1;
          ancestors &= ancestors - 1;
          step(x, false);
        }
      }
    }
    step(t, true);
    held = t;
    if (islot >= 0 && t < p.intermediate.num_steps) {
      const int64_t off = int64_t(islot) * p.intermediate.slot_stride + (int64_t(t) * HV + hv) * kHeadElems;
      if (p.intermediate.dtype == DType::kFloat32)
        store_tile(static_cast<float*>(p.intermediate.data) + off);
      else
        store_tile(static_cast<__nv_bfloat16*>(p.intermediate.data) + off);
    }
  }
  if (what.write_state && p.parent == nullptr) store_tile(head);
}

template <StateLayout kLayout, class TS, class TI, int K, int V>
void launch_recurrent(const CommitParams& p, Launch what, Stream stream) {
  using Map = TileMap<kLayout, TS, K, V>;
  if (p.batch == 0 || p.heads.num_v_heads == 0) return;
  const dim3 grid(unsigned(p.batch) * (V / Map::kBV), unsigned(p.heads.num_v_heads));
  recurrent_kernel<kLayout, TS, TI, K, V><<<grid, kThreads, 0, stream>>>(p, what);
  GDNKIT_CUDA_CHECK_LAUNCH();
}

// Explicit instantiations: one translation unit per (layout, state dtype), all input dtypes and dims.
#define GDNKIT_RECURRENT_INSTANTIATE_DIMS(L, TS, TI)                                                     \
  template void launch_recurrent<L, TS, TI, 64, 64>(const CommitParams&, Launch, Stream);             \
  template void launch_recurrent<L, TS, TI, 128, 128>(const CommitParams&, Launch, Stream);           \
  template void launch_recurrent<L, TS, TI, 256, 256>(const CommitParams&, Launch, Stream);
#define GDNKIT_RECURRENT_INSTANTIATE(L, TS)                 \
  GDNKIT_RECURRENT_INSTANTIATE_DIMS(L, TS, float)           \
  GDNKIT_RECURRENT_INSTANTIATE_DIMS(L, TS, __nv_bfloat16)   \
  GDNKIT_RECURRENT_INSTANTIATE_DIMS(L, TS, __half)

#endif  // GDNKIT_RECURRENT_DEFINE_KERNELS

}  // namespace gdnkit::cuda::recurrent
