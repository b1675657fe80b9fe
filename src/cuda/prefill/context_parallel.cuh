// Context-parallel prefill (docs/design/prefill.md "Context parallelism"): a long sequence cut into segments of
// Plan::cp_segment_len tokens that run at the same time. Over a segment the recurrence is affine in its initial
// state, S_end = P S_in + L (P: K x K, the product of the segment's per-token transitions), so
//
//   1. the segment table (cp_segment_table_kernel): each sequence's segments, from cu_seqlens on the device;
//   2. the local pass (state_pass_head_kernel, kCpMode = 1): per segment and value head one CTA runs the segment
//      from zero and stores L (the first segment of a sequence from its initial state: its true final state), and
//      one more runs it on the identity with v = 0 and stores P; neither writes o;
//   3. the scan (cp_scan_kernel): S_in of segment i + 1 = P_i S_in(i) + L_i in fp32, segment by segment; it stores
//      every segment's true initial state and the sequence's final state;
//   4. the final pass (state_pass_head_kernel, kCpMode = 2): every segment from its true initial state, writing o
//      and the checkpoints that fall inside it. A sequence of one segment runs here alone, as without segments.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/host/check.h"
#include "cuda/prefill/io.cuh"
#include "cuda/prefill/plan.h"
#include "cuda/prefill/short_sequence.h"
#include "gdnkit/params.h"

namespace gdnkit::cuda::chunked_prefill {

constexpr int kCpTableThreads = 1024;

// Segments of sequence n: one for a bad span or a sequence of the short path (the final pass skips and counts
// it as without segments), else max(1, ceil(len / seg_len)).
__device__ __forceinline__ int64_t cp_segment_count(const PrefillParams& p, const Plan& plan, int64_t n, bool split,
                                                    int64_t& start, int64_t& len) {
  start = load_cu(p, n);
  const int64_t end = load_cu(p, n + 1);
  len = 0;
  if (start < 0 || end < start || end > p.total_tokens) return 1;
  if (short_prefill_sequence(start, end, p.total_tokens, plan.short_len)) return 1;
  len = end - start;
  return split && len > plan.cp_segment_len ? (len + plan.cp_segment_len - 1) / plan.cp_segment_len : 1;
}

// Inclusive sum over the CTA (kCpTableThreads threads); `total` gets the CTA's sum.
__device__ __forceinline__ int64_t cp_block_scan(int64_t x, int64_t* warp_sums, int64_t& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int64_t y = __shfl_up_sync(0xffffffffu, x, d);
    if (lane >= d) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int64_t w = warp_sums[lane];
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int64_t y = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += y;
    }
    warp_sums[lane] = w;
  }
  __syncthreads();
  total = warp_sums[31];
  const int64_t before = warp > 0 ? warp_sums[warp - 1] : 0;
  __syncthreads();  // warp_sums is reused by the next call
  return x + before;
}

// One CTA: the segments of every sequence in order (a sequence's segments adjacent), then unused entries. Where a
// malformed cu_seqlens would need more entries than the table holds, no sequence is cut. (A template: one
// definition however many translation units include it.)
template <int kThreadsPerCta = kCpTableThreads>
__global__ void __launch_bounds__(kThreadsPerCta) cp_segment_table_kernel(const PrefillParams p, const Plan plan) {
  static_assert(kThreadsPerCta == kCpTableThreads, "cp_block_scan sums over kCpTableThreads threads");
  __shared__ int64_t warp_sums[32];
  const int N = p.num_seqs, tid = threadIdx.x;
  int64_t needed = 0;
  for (int64_t base = 0; base < N; base += kCpTableThreads) {
    int64_t start, len, total;
    const int64_t count = base + tid < N ? cp_segment_count(p, plan, base + tid, true, start, len) : 0;
    cp_block_scan(count, warp_sums, total);
    needed += total;
  }
  const bool split = needed <= plan.cp_max_segments;
  int64_t at = 0;
  for (int64_t base = 0; base < N; base += kCpTableThreads) {
    const int64_t n = base + tid;
    int64_t start = 0, len = 0, total;
    const int64_t count = n < N ? cp_segment_count(p, plan, n, split, start, len) : 0;
    const int64_t first = at + cp_block_scan(count, warp_sums, total) - count;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t off = i * plan.cp_segment_len;
      CpSegment s;
      s.start = start + (count > 1 ? off : 0);
      s.len = count > 1 ? min(plan.cp_segment_len, len - off) : len;
      s.seq = int32_t(n), s.index = int32_t(i), s.count = int32_t(count), s.first_chunk = int32_t(off / kChunk);
      plan.cp_segments[first + i] = s;
    }
    at += total;
  }
  for (int64_t g = at + tid; g < plan.cp_max_segments; g += kCpTableThreads) {
    CpSegment s{};
    s.seq = -1;
    plan.cp_segments[g] = s;
  }
}

// The scan over the segments of one sequence (its first segment's entry: blockIdx.x), value head blockIdx.y, value
// columns 8 blockIdx.z .. + 7; thread k owns row k of those columns. Reads the sequence's initial state (before
// writing the final one: they may be the same slot), writes every segment's true initial state and the final state.
// A sequence with a bad slot is left to the final pass, which skips and counts it.
template <int K>
__global__ void __launch_bounds__(K) cp_scan_kernel(const PrefillParams p, const Plan plan) {
  constexpr int kCols = 8;
  const CpSegment first = plan.cp_segments[blockIdx.x];
  if (first.seq < 0 || first.index != 0 || first.count < 2) return;
  const int n = first.seq, h = blockIdx.y, v0 = blockIdx.z * kCols, k = threadIdx.x;
  const int HV = p.heads.num_v_heads, V = p.heads.head_dim_v;
  const int islot = p.initial_indices ? p.initial_indices[n] : -1;
  const int fslot = p.final_indices ? p.final_indices[n] : -1;
  const int cslot = (p.checkpoint_interval > 0 && p.checkpoint_indices) ? p.checkpoint_indices[n] : -1;
  if (islot >= p.state.num_slots || fslot >= p.state.num_slots || cslot >= p.checkpoints.num_slots) return;
  const int64_t per_segment = int64_t(HV) * K * V;
  const StateLayout layout = p.state.layout;
  __shared__ __align__(16) float cols[K][kCols];  // read as float4

  float s[kCols];
  {
    float* init = plan.cp_initial + int64_t(blockIdx.x) * per_segment;
    const float* local = plan.cp_local + int64_t(blockIdx.x) * per_segment;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int64_t off = state_offset(layout, h, k, v0 + c, K, V);
      init[off] = islot >= 0 ? load_state_elem(p.state.data, p.state.dtype, int64_t(islot) * p.state.slot_stride + off)
                             : 0.0f;
      s[c] = local[off];
    }
  }
  for (int i = 1; i < first.count; ++i) {
    const int64_t g = int64_t(blockIdx.x) + i;
    float* init = plan.cp_initial + g * per_segment;
    const float* local = plan.cp_local + g * per_segment;
    const float* P = plan.cp_transition + g * per_segment;
    float acc[kCols];
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int64_t off = state_offset(layout, h, k, v0 + c, K, V);
      init[off] = s[c];
      cols[k][c] = s[c];
      acc[c] = local[off];
    }
    __syncthreads();
#pragma unroll 4
    for (int j = 0; j < K; ++j) {
      const float pkj = P[state_offset(layout, h, k, j, K, K)];
      const float4 a = *reinterpret_cast<const float4*>(&cols[j][0]);
      const float4 b = *reinterpret_cast<const float4*>(&cols[j][4]);
      acc[0] = fmaf(pkj, a.x, acc[0]), acc[1] = fmaf(pkj, a.y, acc[1]);
      acc[2] = fmaf(pkj, a.z, acc[2]), acc[3] = fmaf(pkj, a.w, acc[3]);
      acc[4] = fmaf(pkj, b.x, acc[4]), acc[5] = fmaf(pkj, b.y, acc[5]);
      acc[6] = fmaf(pkj, b.z, acc[6]), acc[7] = fmaf(pkj, b.w, acc[7]);
    }
    __syncthreads();
#pragma unroll
    for (int c = 0; c < kCols; ++c) s[c] = acc[c];
  }
  if (fslot >= 0)
#pragma unroll
    for (int c = 0; c < kCols; ++c)
      store_state_elem(p.state.data, p.state.dtype,
                       int64_t(fslot) * p.state.slot_stride + state_offset(layout, h, k, v0 + c, K, V), s[c]);
}

inline void launch_cp_segment_table(const PrefillParams& p, const Plan& plan, cudaStream_t stream) {
  cp_segment_table_kernel<><<<1, kCpTableThreads, 0, stream>>>(p, plan);
  GDNKIT_CUDA_CHECK_LAUNCH();
}

template <int K>
void launch_cp_scan(const PrefillParams& p, const Plan& plan, cudaStream_t stream) {
  const dim3 grid(unsigned(plan.cp_max_segments), unsigned(p.heads.num_v_heads), unsigned(p.heads.head_dim_v / 8));
  cp_scan_kernel<K><<<grid, K, 0, stream>>>(p, plan);
  GDNKIT_CUDA_CHECK_LAUNCH();
}

}  // namespace gdnkit::cuda::chunked_prefill
