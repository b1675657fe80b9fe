// Context-parallel prefill (docs/design/prefill.md "Context parallelism"): a long sequence cut into segments of
// Plan::cp_segment_len tokens that run at the same time. Over a segment the recurrence is affine in its initial
// state, S_end = P S_in + L (P: K x K, the product of the segment's per-token transitions), so
//
//   1. the segment table (cp_segment_table_kernel): each sequence's segments, from cu_seqlens on the device;
//   2. the local pass (state_pass_head_kernel, kCpMode = 1): per segment of a cut sequence but the last and value
//      head (its grid over the states, Plan::cp_state_entry) one CTA runs the segment from zero and stores L (the
//      first segment of a sequence from its initial state: its true end state), and one more, but for the first
//      segment, runs it on the identity with v = 0 and stores P; neither writes o. Where Plan::cp_first_final the first
//      segment's CTA runs its final pass instead (o, checkpoints, and its end state as L);
//   3. the scan (cp_scan_kernel): S_in of segment i + 1 = P_i S_in(i) + L_i in fp32, segment by segment; it stores
//      every segment's true initial state;
//   4. the final pass (state_pass_head_kernel, kCpMode = 2): every segment from its true initial state (but a first
//      segment that ran in the local pass's grid), writing o and the checkpoints that fall inside it; a cut
//      sequence's last segment stores the final state. A sequence of one segment runs here alone, as without
//      segments.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/split.h"
#include "cuda/arch/fp8.cuh"
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

// One CTA: the segments of every sequence in order (a sequence's segments adjacent), then unused entries; the
// segments of cut sequences (in a split call every piece, Plan::cp_split) numbered in the same order for the state
// buffers. Where a malformed cu_seqlens would
// need more entries or states than the workspace holds, no sequence is cut. (A template: one definition however
// many translation units include it.)
template <int kThreadsPerCta = kCpTableThreads>
__global__ void __launch_bounds__(kThreadsPerCta) cp_segment_table_kernel(const PrefillParams p, const Plan plan) {
  static_assert(kThreadsPerCta == kCpTableThreads, "cp_block_scan sums over kCpTableThreads threads");
  __shared__ int64_t warp_sums[32];
  const int N = p.num_seqs, tid = threadIdx.x;
  int64_t needed = 0, needed_states = 0;
  for (int64_t base = 0; base < N; base += kCpTableThreads) {
    int64_t start, len, total, total_states;
    const int64_t count = base + tid < N ? cp_segment_count(p, plan, base + tid, true, start, len) : 0;
    cp_block_scan(count, warp_sums, total);
    cp_block_scan(count > 1 || plan.cp_split ? count : 0, warp_sums, total_states);
    needed += total;
    needed_states += total_states;
  }
  const bool split = needed <= plan.cp_max_segments && needed_states <= plan.cp_max_states;
  int64_t at = 0, at_states = 0, at_cuts = 0;
  for (int64_t base = 0; base < N; base += kCpTableThreads) {
    const int64_t n = base + tid;
    int64_t start = 0, len = 0, total, total_states, total_cuts;
    const int64_t count = n < N ? cp_segment_count(p, plan, n, split, start, len) : 0;
    const int64_t first = at + cp_block_scan(count, warp_sums, total) - count;
    const int64_t cut = count > 1 || plan.cp_split ? count : 0;  // a split call's pieces: every one
    const int64_t first_state = at_states + cp_block_scan(cut, warp_sums, total_states) - cut;
    const int64_t ordinal = at_cuts + cp_block_scan(cut > 0 ? 1 : 0, warp_sums, total_cuts) - (cut > 0 ? 1 : 0);
    if (cut > 0) plan.cp_cut_first[ordinal] = int32_t(first);
    for (int64_t i = 0; i < count; ++i) {
      const int64_t off = i * plan.cp_segment_len;
      CpSegment s;
      s.start = start + (count > 1 ? off : 0);
      s.len = count > 1 ? min(plan.cp_segment_len, len - off) : len;
      s.seq = int32_t(n), s.index = int32_t(i), s.count = int32_t(count), s.first_chunk = int32_t(off / kChunk);
      s.state = cut > 0 ? int32_t(first_state + i) : -1;
      plan.cp_segments[first + i] = s;
      if (cut > 0) plan.cp_state_entry[first_state + i] = int32_t(first + i);
    }
    at += total;
    at_states += total_states;
    at_cuts += total_cuts;
  }
  for (int64_t g = at_states + tid; g < plan.cp_max_states; g += kCpTableThreads) plan.cp_state_entry[g] = -1;
  for (int64_t g = at_cuts + tid; g < plan.cp_max_cuts; g += kCpTableThreads) plan.cp_cut_first[g] = -1;
  for (int64_t g = at + tid; g < plan.cp_max_segments; g += kCpTableThreads) {
    CpSegment s{};
    s.seq = s.state = -1;
    plan.cp_segments[g] = s;
  }
}

// The scan over the segments of one cut sequence (Plan::cp_cut_first[blockIdx.x] its first entry), value head
// blockIdx.y, value columns kScanCols blockIdx.z .. + kScanCols - 1: S_in of segment i + 1 = P_i S_in(i) + L_i. Thread
// k < K owns row k of those columns; the sum over j in P_i S_in(i) is split into kScanSplit ranges, one per group of K
// threads, which meet in shared memory (the chain of steps is the kernel's time). Each step's P arrives in shared
// memory by cp.async while the step before runs, as rows of the pool's layout kScanLd = K + 4 floats apart
// (conflict-free reads in either layout). Three roles:
//   kSegments: the single-GPU path. Reads the sequence's initial state (the first segment's true initial state) and
//     writes every segment's (the last segment's final pass stores the final state). A sequence with a bad slot is
//     left to the final pass, which skips and counts it.
//   kCompose: a split call's piece summary (Plan::cp_split): from [S_0 | I] (S_0 the initial state on rank 0, else
//     zero) through every segment of the piece, into this rank's block of the exchange: the piece's state and its
//     transition (blockIdx.z past V / kScanCols: the transition's columns). A bad piece sends the identity's
//     summary [0 | I], an empty one [S_0 | I].
//   kFold: after the exchange, from S_0 through the lower ranks' summaries (the piece's true initial state), this
//     piece's segments (writing each one's true initial state for the final pass) and, where this rank stores the
//     final state, the higher ranks' summaries.
enum class ScanRole { kSegments, kCompose, kFold };
constexpr int kScanCols = 8, kScanSplit = 4;
template <int K>
constexpr int kScanLd = K + 4;
template <int K>
constexpr size_t cp_scan_smem_bytes() {
  return size_t(2 * K * kScanLd<K>) * sizeof(float);
}

// Whether the final pass's CTA of table entry `entry` stores its sequence's final state: a sequence of one segment, or
// the last segment of a cut one (in a split call the fold stores it). Read from the table where the CTA stores, so
// that nothing of the entry stays in registers across the chunk loop for it.
__device__ __forceinline__ bool cp_stores_final(const Plan& plan, int entry) {
  const CpSegment* s = plan.cp_segments + entry;
  int state, index, count;
  asm volatile("ld.global.s32 %0, [%1];" : "=r"(state) : "l"(&s->state));
  asm volatile("ld.global.s32 %0, [%1];" : "=r"(index) : "l"(&s->index));
  asm volatile("ld.global.s32 %0, [%1];" : "=r"(count) : "l"(&s->count));
  return state < 0 || (!plan.cp_split && index == count - 1);
}

// A split piece runs (its span and slots are good): the final pass runs it, else it skips and counts it.
__device__ __forceinline__ bool split_piece_ok(const PrefillParams& p, int n, int islot, int fslot, int cslot) {
  const int64_t start = load_cu(p, n), end = load_cu(p, n + 1);
  return start >= 0 && end >= start && end <= p.total_tokens && islot < p.state.num_slots &&
         fslot < p.state.num_slots && cslot < p.checkpoints.num_slots;
}

template <int K, ScanRole kRole>
__global__ void __launch_bounds__(K* kScanSplit) cp_scan_kernel(const PrefillParams p, const Plan plan) {
  constexpr int kCols = kScanCols, LD = kScanLd<K>, kRange = K / kScanSplit;
  const int entry = plan.cp_cut_first[blockIdx.x];
  if (entry < 0) return;
  const CpSegment first = plan.cp_segments[entry];
  const int n = first.seq, h = blockIdx.y, tid = threadIdx.x;
  const int k = tid % K, part = tid / K;  // row k, the sum's range part (warp-uniform: K is a multiple of 32)
  const int HV = p.heads.num_v_heads, V = p.heads.head_dim_v;
  const bool p_cols = kRole == ScanRole::kCompose && int(blockIdx.z) * kCols >= V;  // the transition's columns
  const int v0 = p_cols ? int(blockIdx.z) * kCols - V : int(blockIdx.z) * kCols;
  const int islot = p.initial_indices ? p.initial_indices[n] : -1;
  const int fslot = p.final_indices ? p.final_indices[n] : -1;
  const int cslot = (p.checkpoint_interval > 0 && p.checkpoint_indices) ? p.checkpoint_indices[n] : -1;
  bool ok = islot < p.state.num_slots && fslot < p.state.num_slots && cslot < p.checkpoints.num_slots;
  bool empty = false;  // a split call's empty piece: the identity (a rank without tokens runs no local pass)
  if constexpr (kRole == ScanRole::kSegments) {
    if (!ok) return;
  } else {
    ok = split_piece_ok(p, n, islot, fslot, cslot);
    empty = load_cu(p, n + 1) == load_cu(p, n);
  }
  const int64_t per_segment = int64_t(HV) * K * V;
  const int64_t summary = int64_t(HV) * K * (V + K);  // one piece's in the exchange: its state, then its P
  const StateLayout layout = p.state.layout;
  const int rank = plan.split_rank;
  // The chain: the piece's own segments (first.state + i), and in the fold the other ranks' summaries around them.
  const int own = kRole == ScanRole::kSegments || (ok && !empty) ? first.count : 0;
  const int before = kRole == ScanRole::kFold ? rank : 0;
  const int after = kRole == ScanRole::kFold && plan.split_final ? plan.split_ranks - 1 - rank : 0;
  // kSegments leaves out the last segment's step: that segment's final pass stores the sequence's final state.
  const int steps = before + own + after - (kRole == ScanRole::kSegments ? 1 : 0);
  // step i's P (this head's K x K block, contiguous in either layout) and L (nullptr: zero)
  const auto source = [&](int i, const float*& P, const float*& L) {
    if (i >= before && i < before + own) {
      const int64_t at = (int64_t(first.state) + i - before) * per_segment;
      P = plan.cp_transition + at + int64_t(h) * K * K;
      L = p_cols ? nullptr : plan.cp_local + at;
    } else {
      const int j = i < before ? i : i - own + 1;  // the rank of this summary
      const float* b = plan.split_exchange + (int64_t(j) * p.num_seqs + n) * summary;
      P = b + per_segment + int64_t(h) * K * K;
      L = b;
    }
  };
  extern __shared__ __align__(16) float p_smem[];             // two buffers of P, K rows of LD
  __shared__ __align__(16) float cols[K][kCols];              // S_in(i), read as float4
  __shared__ float partial[kScanSplit - 1][kCols][K];         // the other ranges' sums

  const auto fetch_p = [&](int i) {  // into buffer i & 1
    const float *src, *unused;
    source(i, src, unused);
    float* dst = p_smem + (i & 1) * K * LD;
    for (int u = tid; u < K * K / 4; u += K * kScanSplit)
      cp_async16(dst + (4 * u / K) * LD + 4 * u % K, src + 4 * u, true);
    cp_async_commit();
  };
  const auto load_local = [&](int i, float (&x)[kCols]) {
    const float *unused, *local;
    source(i, unused, local);
#pragma unroll
    for (int c = 0; c < kCols; ++c) x[c] = local ? local[state_offset(layout, h, k, v0 + c, K, V)] : 0.0f;
  };
  // The sequence's initial state on the rank that reads it (rank 0 of a split call), else zero; the identity in a
  // summary's transition columns.
  const auto initial = [&](int c) -> float {
    if (p_cols) return k == v0 + c ? 1.0f : 0.0f;
    if (islot < 0 || !ok || (kRole != ScanRole::kSegments && rank != 0)) return 0.0f;
    const int64_t off = state_offset(layout, h, k, v0 + c, K, V);
    if (p.state.dtype == DType::kFloat8E4M3)  // K-last (api/dispatch.cpp refuses the rest)
      return e4m3_to_float(static_cast<const uint8_t*>(p.state.data)[int64_t(islot) * p.state.slot_stride + off],
                           e8m0_scale(p.state.scales[(int64_t(islot) * per_segment + off) / kFp8Block]));
    return load_state_elem(p.state.data, p.state.dtype, int64_t(islot) * p.state.slot_stride + off);
  };
  // The true initial state of own segment i (the final pass starts there).
  const auto record = [&](int i, const float (&x)[kCols]) {
    if (kRole == ScanRole::kCompose || i < before || i >= before + own) return;
    float* init = plan.cp_initial + (int64_t(first.state) + i - before) * per_segment;
#pragma unroll
    for (int c = 0; c < kCols; ++c) init[state_offset(layout, h, k, v0 + c, K, V)] = x[c];
  };

  // kSegments: the first segment ran from the initial state, so its local state is already S_in of the second.
  const int i0 = kRole == ScanRole::kSegments ? 1 : 0;
  if (i0 < steps) fetch_p(i0);
  float s[kCols] = {}, local[kCols] = {};  // part 0's
  if (part == 0) {
#pragma unroll
    for (int c = 0; c < kCols; ++c) s[c] = initial(c);
    if constexpr (kRole == ScanRole::kSegments) {
      record(0, s);
      load_local(0, s);
    }
    if (i0 < steps) load_local(i0, local);
  }
  for (int i = i0; i < steps; ++i) {
    const bool more = i + 1 < steps;
    if (more) fetch_p(i + 1);  // into the buffer step i - 1 read (every thread passed its last barrier)
    float next[kCols] = {};
    if (part == 0) {
      if (more) load_local(i + 1, next);
      record(i, s);
#pragma unroll
      for (int c = 0; c < kCols; ++c) cols[k][c] = s[c];
    }
    if (more)
      cp_async_wait_group<1>();
    else
      cp_async_wait_group<0>();
    __syncthreads();  // P_i and the columns
    const float* P = p_smem + (i & 1) * K * LD;
    float acc[kCols] = {};
    const auto fma_row = [&](int j, float pkj) {
      const float4 a = *reinterpret_cast<const float4*>(&cols[j][0]);
      const float4 b = *reinterpret_cast<const float4*>(&cols[j][4]);
      acc[0] = fmaf(pkj, a.x, acc[0]), acc[1] = fmaf(pkj, a.y, acc[1]);
      acc[2] = fmaf(pkj, a.z, acc[2]), acc[3] = fmaf(pkj, a.w, acc[3]);
      acc[4] = fmaf(pkj, b.x, acc[4]), acc[5] = fmaf(pkj, b.y, acc[5]);
      acc[6] = fmaf(pkj, b.z, acc[6]), acc[7] = fmaf(pkj, b.w, acc[7]);
    };
    const int j0 = part * kRange;
    if (layout == StateLayout::kKLast) {  // P[k][j] at row j
#pragma unroll 8
      for (int j = j0; j < j0 + kRange; ++j) fma_row(j, P[j * LD + k]);
    } else {  // P[k][j] at row k
#pragma unroll 2
      for (int j = j0; j < j0 + kRange; j += 4) {
        const float4 pk = *reinterpret_cast<const float4*>(&P[k * LD + j]);
        fma_row(j, pk.x), fma_row(j + 1, pk.y), fma_row(j + 2, pk.z), fma_row(j + 3, pk.w);
      }
    }
    if (part > 0)
#pragma unroll
      for (int c = 0; c < kCols; ++c) partial[part - 1][c][k] = acc[c];
    __syncthreads();  // the columns and this P are read, the partial sums written
    if (part == 0) {
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        float x = local[c] + acc[c];
#pragma unroll
        for (int q = 0; q < kScanSplit - 1; ++q) x += partial[q][c][k];
        s[c] = x;
        local[c] = next[c];
      }
    }
  }
  if (part != 0) return;
  if constexpr (kRole == ScanRole::kSegments) {
    record(steps, s);  // the last segment's
    return;
  }
  if constexpr (kRole == ScanRole::kCompose) {
    float* dst = plan.split_exchange + (int64_t(rank) * p.num_seqs + n) * summary + (p_cols ? per_segment : 0);
#pragma unroll
    for (int c = 0; c < kCols; ++c) dst[state_offset(layout, h, k, v0 + c, K, V)] = s[c];  // K == V
    return;
  }
  if constexpr (kRole == ScanRole::kFold) {
    // Counted once per sequence: checkpoints of a piece that does not start on a chunk boundary of its sequence
    // (they cannot be stored), and a bad piece on a rank without tokens (no final pass runs there to count it).
    if (blockIdx.y == 0 && blockIdx.z == 0 && k == 0 && p.error_flag != nullptr) {
      const int64_t offset = plan.split_offsets ? plan.split_offsets[n] : 0;
      if (ok && cslot >= 0 &&
          !split_piece_checkpoints_ok(offset, load_cu(p, n + 1) - load_cu(p, n), p.checkpoint_interval,
                                      p.checkpoints.num_steps))
        atomicAdd(p.error_flag, 1);
      if (!ok && p.total_tokens == 0) atomicAdd(p.error_flag, 1);
    }
    if (!ok || !plan.split_final) return;
  }
  if (fslot >= 0 && p.state.dtype == DType::kFloat8E4M3) {
    // K-last: the 32 k of a warp are one block of each column, the warp's max its scale.
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      uint32_t m = abs_bits(s[c]);
#pragma unroll
      for (int x = 1; x < 32; x <<= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, x));
      const Fp8Scale sc = e4m3_block_scale(m);
      const int64_t off = state_offset(layout, h, k, v0 + c, K, V);
      static_cast<uint8_t*>(p.state.data)[int64_t(fslot) * p.state.slot_stride + off] = uint8_t(e4m3x1(s[c], sc));
      if (k % kFp8Block == 0) p.state.scales[(int64_t(fslot) * per_segment + off) / kFp8Block] = uint8_t(sc.byte);
    }
  } else if (fslot >= 0) {
#pragma unroll
    for (int c = 0; c < kCols; ++c)
      store_state_elem(p.state.data, p.state.dtype,
                       int64_t(fslot) * p.state.slot_stride + state_offset(layout, h, k, v0 + c, K, V), s[c]);
  }
}

inline void launch_cp_segment_table(const PrefillParams& p, const Plan& plan, cudaStream_t stream) {
  cp_segment_table_kernel<><<<1, kCpTableThreads, 0, stream>>>(p, plan);
  GDNKIT_CUDA_CHECK_LAUNCH();
}

template <int K, ScanRole kRole = ScanRole::kSegments>
void launch_cp_scan(const PrefillParams& p, const Plan& plan, cudaStream_t stream) {
  constexpr size_t smem = cp_scan_smem_bytes<K>();
  const auto kernel = cp_scan_kernel<K, kRole>;
  allow_dynamic_smem<cp_scan_kernel<K, kRole>>(smem);
  const int cols = p.heads.head_dim_v + (kRole == ScanRole::kCompose ? K : 0);  // a summary's: state and transition
  const dim3 grid(unsigned(plan.cp_max_cuts), unsigned(p.heads.num_v_heads), unsigned(cols / kScanCols));
  kernel<<<grid, K * kScanSplit, smem, stream>>>(p, plan);
  GDNKIT_CUDA_CHECK_LAUNCH();
}

}  // namespace gdnkit::cuda::chunked_prefill
