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
//      every segment's true initial state that a final pass reads;
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

// The scan over the segments of one cut sequence (Plan::cp_cut_first[cut] its first entry), value head h, value columns
// kCols zb .. + kCols - 1 (all three from the flat blockIdx.x): S_in of segment i + 1 = P_i S_in(i) + L_i. The chain of
// steps is the kernel's time, so a step is short: P_i S_in(i) runs on the tensor cores as three TF32 products per
// operand pair (hi hi + hi lo + lo hi: about fp32's precision), warp w forming rows 16 (w % (K / 16)) .. + 15 over its
// part of the sum over j, the parts meeting in shared memory; S_in and L wait there as the B operand and the addend,
// and each step's P arrives by cp.async while the step before runs (kScanPLd: conflict-free A fragments in either
// layout). Three roles:
//   kSegments: the single-GPU path. Reads the sequence's initial state (the first segment's true initial state) and
//     writes every segment's that a final pass reads: not the first one's where its final pass ran beside the local
//     pass (Plan::cp_first_final), which read the initial slot itself (the last segment's final pass stores the final
//     state). A sequence with a bad slot is left to the final pass, which skips and counts it.
//   kCompose: a split call's piece summary (Plan::cp_split): from [S_0 | I] (S_0 the initial state on rank 0, else
//     zero) through every segment of the piece, into this rank's block of the exchange: the piece's state and its
//     transition (zb past V / kCols: the transition's columns). A bad piece sends the identity's
//     summary [0 | I], an empty one [S_0 | I].
//   kFold: after the exchange, from S_0 through the lower ranks' summaries (the piece's true initial state), this
//     piece's segments (writing each one's true initial state for the final pass) and, where this rank stores the
//     final state, the higher ranks' summaries.
enum class ScanRole { kSegments, kCompose, kFold };
// 16 warps; kCols columns a CTA (8, or 32 where the heads alone give enough CTAs: Plan::cp_scan_cols).
constexpr int kScanThreads = 512;
// Rows of S_in (and of L) in shared memory: the B operand's rows j, j + 4 of a column in different banks.
template <int kCols>
constexpr int kScanColsLd = kCols % 32 == 0 ? kCols + 8 : kCols;
// P's rows in shared memory: K + 8 floats in the K-last layout (P[k][j] at row j), K + 4 in the V-last one (at row
// k), so that the A fragments are conflict-free; the buffers are sized for K + 8.
template <int K>
constexpr int kScanPLd = K + 8;
// One buffer of L in the pool's layout: K-last kCols rows of K + 4 floats, V-last K rows of kScanColsLd.
template <int K, int kCols>
constexpr int kScanLBuf = kCols * (K + 4) > K * kScanColsLd<kCols> ? kCols * (K + 4) : K * kScanColsLd<kCols>;
template <int K, int kCols>
constexpr size_t cp_scan_smem_bytes() {
  constexpr int kParts = kScanThreads / 32 / (K / 16);
  return (size_t(2 * K * kScanPLd<K>) + size_t(K) * kScanColsLd<kCols> * kParts + 2 * size_t(kScanLBuf<K, kCols>)) *
         sizeof(float);
}

// d += a b on the tensor cores, TF32 operands (mma.sync m16n8k8), fp32 accumulation.
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// x as a TF32 value and the rest (x = hi + lo up to 2^-22 |x|; the tensor cores read lo's top bits): the products
// hi hi + hi lo + lo hi carry about fp32's precision. hi is cvt.rna.tf32.f32's for finite x, in two integer operations.
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
  lo = __float_as_uint(x - __uint_as_float(hi));
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

template <int K, int kCols, ScanRole kRole>
__global__ void __launch_bounds__(kScanThreads, 1) cp_scan_kernel(const PrefillParams p, const Plan plan) {
  constexpr int kMTiles = K / 16, kParts = kScanThreads / 32 / kMTiles, kKSteps = K / 8 / kParts;
  constexpr int kNTiles = kCols / 8, LDC = kScanColsLd<kCols>;
  static_assert(K % 16 == 0 && kMTiles * kParts == kScanThreads / 32 && K / 8 % kParts == 0,
                "the warps split the rows in tiles of 16 and the sum over j evenly");
  static_assert(K * kCols / 4 % 32 == 0, "whole warps of quads");
  const int HV = p.heads.num_v_heads, V = p.heads.head_dim_v;
  // One flat grid, the cut slowest: the CTAs of the cut sequences launch first and the unused bound's trail after.
  const int blocks = (V + (kRole == ScanRole::kCompose ? K : 0)) / kCols;
  const int zb = int(blockIdx.x % unsigned(blocks)), h = int(blockIdx.x / unsigned(blocks) % unsigned(HV));
  const int cut = int(blockIdx.x / unsigned(blocks * HV));
  const int entry = plan.cp_cut_first[cut];
  if (entry < 0) return;
  const CpSegment first = plan.cp_segments[entry];
  const int n = first.seq, tid = threadIdx.x;
  // warp: rows 16 mt .. 16 mt + 15 of the product, its part of the sum over j; lane: (g, t) of the mma fragments
  const int warp = tid / 32, mt = warp % kMTiles, part = warp / kMTiles, g = (tid % 32) / 4, t = tid % 4;
  const bool p_cols = kRole == ScanRole::kCompose && zb * kCols >= V;  // the transition's columns
  const int v0 = p_cols ? zb * kCols - V : zb * kCols;
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
  const bool klast = layout == StateLayout::kKLast;
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
  extern __shared__ __align__(16) float scan_smem[];
  float* const p_buf = scan_smem;                   // two buffers of P, K rows of ldp
  float* const cols = p_buf + 2 * K * kScanPLd<K>;  // [K][LDC]: S_in of the step, the products' B operand
  float* const lbuf = cols + K * LDC;               // two buffers of L in the pool's layout: [kCols][K + 4] or [K][LDC]
  float* const partial = lbuf + 2 * kScanLBuf<K, kCols>;  // [kParts - 1][K][LDC]: the other parts' sums
  const int ldp = K + (klast ? 8 : 4);
  const auto l_at = [&](int k, int c) { return klast ? c * (K + 4) + k : k * LDC + c; };  // L's (k, c) in a buffer

  const auto fetch_p = [&](int i) {  // into buffer i & 1
    const float *src, *unused;
    source(i, src, unused);
    // 16 bytes of rows tid / (K / 4) + r kRowsPerPass: a fixed row step a copy, no division
    constexpr int kRowsPerPass = kScanThreads / (K / 4);
    static_assert(kScanThreads % (K / 4) == 0 && K % kRowsPerPass == 0, "whole rows a pass");
    float* dst = p_buf + (i & 1) * K * kScanPLd<K> + (tid / (K / 4)) * ldp + tid % (K / 4) * 4;
    src += 4 * tid;
#pragma unroll
    for (int r = 0; r < K / kRowsPerPass; ++r)
      cp_async16(dst + r * kRowsPerPass * ldp, src + r * kRowsPerPass * K, true);
  };
  // Quad q of the K x kCols block: four elements adjacent in the pool's layout, rows k .. k + 3 of column c (K-last)
  // or columns c .. c + 3 of row k (V-last).
  constexpr int kQuads = K * kCols / 4;
  const auto quad = [&](int q, int& k, int& c) {
    if (klast)
      c = q / (K / 4), k = q % (K / 4) * 4;
    else
      k = q / (kCols / 4), c = q % (kCols / 4) * 4;
  };
  const auto offset = [&](int k, int c) { return state_offset(layout, h, k, v0 + c, K, V); };
  const auto fetch_local = [&](int i) {  // L_i into lbuf buffer i & 1 (zeros where there is none)
    const float *P, *local;
    source(i, P, local);
    float* dst = lbuf + (i & 1) * kScanLBuf<K, kCols>;
    for (int q = tid; q < kQuads; q += kScanThreads) {
      int k, c;
      quad(q, k, c);
      cp_async16(dst + l_at(k, c), local ? local + offset(k, c) : P, local != nullptr);
    }
  };
  const auto cols_at = [&](int k, int c, int e) -> float& { return klast ? cols[(k + e) * LDC + c] : cols[k * LDC + c + e]; };
  // The sequence's initial state on the rank that reads it (rank 0 of a split call), else zero; the identity in a
  // summary's transition columns.
  const auto initial = [&](int k, int c) -> float {
    if (p_cols) return k == v0 + c ? 1.0f : 0.0f;
    if (islot < 0 || !ok || (kRole != ScanRole::kSegments && rank != 0)) return 0.0f;
    const int64_t off = offset(k, c);
    if (p.state.dtype == DType::kFloat8E4M3)  // either layout: 32 elements in memory order a block
      return e4m3_to_float(static_cast<const uint8_t*>(p.state.data)[int64_t(islot) * p.state.slot_stride + off],
                           e8m0_scale(p.state.scales[(int64_t(islot) * per_segment + off) / kFp8Block]));
    return load_state_elem(p.state.data, p.state.dtype, int64_t(islot) * p.state.slot_stride + off);
  };
  // cols (the chain's state) to `dst` in the pool's layout, fp32, four elements a store.
  const auto store_cols = [&](float* dst) {
    for (int q = tid; q < kQuads; q += kScanThreads) {
      int k, c;
      quad(q, k, c);
      *reinterpret_cast<float4*>(dst + offset(k, c)) =
          make_float4(cols_at(k, c, 0), cols_at(k, c, 1), cols_at(k, c, 2), cols_at(k, c, 3));
    }
  };
  // The true initial state of own segment i (the final pass starts there), from cols.
  const auto record = [&](int i) {
    if (kRole == ScanRole::kCompose || i < before || i >= before + own) return;
    store_cols(plan.cp_initial + (int64_t(first.state) + i - before) * per_segment);
  };

  // kSegments: the first segment ran from the initial state, so its local state is already S_in of the second; where
  // its final pass ran beside the local pass (Plan::cp_first_final) nothing reads its S_in, which is then not stored.
  const int i0 = kRole == ScanRole::kSegments ? 1 : 0;
  const bool first_in = kRole != ScanRole::kSegments || !plan.cp_first_final;
  if (first_in) {
    for (int q = tid; q < kQuads; q += kScanThreads) {
      int k, c;
      quad(q, k, c);
#pragma unroll
      for (int e = 0; e < 4; ++e) cols_at(k, c, e) = klast ? initial(k + e, c) : initial(k, c + e);
    }
  }
  if constexpr (kRole == ScanRole::kSegments) {
    if (first_in) record(0);  // (each thread's own elements)
    fetch_local(0);
    cp_async_commit();
    cp_async_wait_group<0>();
    for (int q = tid; q < kQuads; q += kScanThreads) {  // cols = L_0, each thread its own elements
      int k, c;
      quad(q, k, c);
#pragma unroll
      for (int e = 0; e < 4; ++e) cols_at(k, c, e) = lbuf[klast ? l_at(k + e, c) : l_at(k, c + e)];
    }
  }
  if (i0 < steps) {
    fetch_p(i0);
    fetch_local(i0);
    cp_async_commit();
  }
  for (int i = i0; i < steps; ++i) {
    cp_async_wait_group<0>();
    __syncthreads();  // P_i, S_in(i) and L_i
    if (i + 1 < steps) {  // into the buffers step i - 1 read, while this step runs
      fetch_p(i + 1);
      fetch_local(i + 1);
      cp_async_commit();
    }
    record(i);
    // P_i S_in(i) on the tensor cores: warp (mt, part) forms rows 16 mt .. + 15 over its kKSteps steps of j.
    const float* P = p_buf + (i & 1) * K * kScanPLd<K>;
    float acc[kNTiles][4] = {};
    const int m0 = 16 * mt;
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      const int j0 = 8 * (part * kKSteps + ks);
      float a[4];
      if (klast) {  // P[k][j] at row j
        a[0] = P[(j0 + t) * ldp + m0 + g], a[1] = P[(j0 + t) * ldp + m0 + g + 8];
        a[2] = P[(j0 + t + 4) * ldp + m0 + g], a[3] = P[(j0 + t + 4) * ldp + m0 + g + 8];
      } else {  // at row k
        a[0] = P[(m0 + g) * ldp + j0 + t], a[1] = P[(m0 + g + 8) * ldp + j0 + t];
        a[2] = P[(m0 + g) * ldp + j0 + t + 4], a[3] = P[(m0 + g + 8) * ldp + j0 + t + 4];
      }
      uint32_t ah[4], al[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) split_tf32(a[r], ah[r], al[r]);
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        uint32_t bh0, bl0, bh1, bl1;
        split_tf32(cols[(j0 + t) * LDC + 8 * nt + g], bh0, bl0);
        split_tf32(cols[(j0 + t + 4) * LDC + 8 * nt + g], bh1, bl1);
        mma_tf32(acc[nt], al, bh0, bh1);
        mma_tf32(acc[nt], ah, bl0, bl1);
        mma_tf32(acc[nt], ah, bh0, bh1);
      }
    }
    // accumulator (r, r + 1) of tile nt: row m0 + g + 8 (r / 2), columns 8 nt + 2 t, + 1
    if (part > 0)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int r = 0; r < 4; r += 2)
          *reinterpret_cast<float2*>(&partial[(part - 1) * K * LDC + (m0 + g + 4 * r) * LDC + 8 * nt + 2 * t]) =
              make_float2(acc[nt][r], acc[nt][r + 1]);
    __syncthreads();  // the partial sums; every warp is done with S_in(i) and P_i
    if (part == 0) {  // S_in(i + 1) = P_i S_in(i) + L_i
      const float* l = lbuf + (i & 1) * kScanLBuf<K, kCols>;
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int r = 0; r < 4; r += 2) {
          const int row = m0 + g + 4 * r, col = 8 * nt + 2 * t, at = row * LDC + col;
          float2 x = make_float2(acc[nt][r] + l[l_at(row, col)], acc[nt][r + 1] + l[l_at(row, col + 1)]);
#pragma unroll
          for (int q = 0; q < kParts - 1; ++q) {
            const float2 y = *reinterpret_cast<const float2*>(&partial[q * K * LDC + at]);
            x.x += y.x, x.y += y.y;
          }
          *reinterpret_cast<float2*>(&cols[at]) = x;
        }
    }
  }
  __syncthreads();  // cols: the chain's end
  if constexpr (kRole == ScanRole::kSegments) {
    record(steps);  // the last segment's
    return;
  }
  if constexpr (kRole == ScanRole::kCompose) {
    store_cols(plan.split_exchange + (int64_t(rank) * p.num_seqs + n) * summary + (p_cols ? per_segment : 0));
    return;
  }
  if constexpr (kRole == ScanRole::kFold) {
    // Counted once per sequence: checkpoints of a piece that does not start on a chunk boundary of its sequence
    // (they cannot be stored), and a bad piece on a rank without tokens (no final pass runs there to count it).
    if (h == 0 && zb == 0 && tid == 0 && p.error_flag != nullptr) {
      const int64_t offset = plan.split_offsets ? plan.split_offsets[n] : 0;
      if (ok && cslot >= 0 &&
          !split_piece_checkpoints_ok(offset, load_cu(p, n + 1) - load_cu(p, n), p.checkpoint_interval,
                                      p.checkpoints.num_steps))
        atomicAdd(p.error_flag, 1);
      if (!ok && p.total_tokens == 0) atomicAdd(p.error_flag, 1);
    }
    if (!ok || !plan.split_final || fslot < 0) return;
    const int64_t base = int64_t(fslot) * p.state.slot_stride;
    for (int q = tid; q < kQuads; q += kScanThreads) {  // (warp-uniform trip count: kQuads is a multiple of 32)
      int k, c;
      quad(q, k, c);
      const int64_t off = offset(k, c);
      if (p.state.dtype == DType::kFloat8E4M3) {
        // The 8 lanes of quads k .. k + 31 of a column (K-last), or of a row's 32 columns (V-last, where the scan takes
        // 32 columns a CTA: cp_scan_cols), hold one block, their max its scale.
        uint32_t m = 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) m = max(m, abs_bits(cols_at(k, c, e)));
#pragma unroll
        for (int b = 1; b < 8; b <<= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, b));
        const Fp8Scale sc = e4m3_block_scale(m);
        uint8_t* const out = static_cast<uint8_t*>(p.state.data) + base + off;
#pragma unroll
        for (int e = 0; e < 4; ++e) out[e] = uint8_t(e4m3x1(cols_at(k, c, e), sc));
        if ((klast ? k : c) % kFp8Block == 0)
          p.state.scales[(int64_t(fslot) * per_segment + off) / kFp8Block] = uint8_t(sc.byte);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          store_state_elem(p.state.data, p.state.dtype, base + off + e, cols_at(k, c, e));
      }
    }
  }
}

inline void launch_cp_segment_table(const PrefillParams& p, const Plan& plan, cudaStream_t stream) {
  cp_segment_table_kernel<><<<1, kCpTableThreads, 0, stream>>>(p, plan);
  GDNKIT_CUDA_CHECK_LAUNCH();
}

template <int K, int kCols, ScanRole kRole>
void launch_cp_scan_cols(const PrefillParams& p, const Plan& plan, cudaStream_t stream) {
  constexpr size_t smem = cp_scan_smem_bytes<K, kCols>();
  allow_dynamic_smem<cp_scan_kernel<K, kCols, kRole>>(smem);
  const int cols = p.heads.head_dim_v + (kRole == ScanRole::kCompose ? K : 0);  // a summary's: state and transition
  const int64_t grid = int64_t(plan.cp_max_cuts) * p.heads.num_v_heads * (cols / kCols);
  if (grid > INT32_MAX)  // (terabytes of workspace before this)
    throw Error(ErrorCode::kNotImplemented, "prefill: " + std::to_string(grid) + " context-parallel scan CTAs");
  cp_scan_kernel<K, kCols, kRole><<<unsigned(grid), kScanThreads, smem, stream>>>(p, plan);
  GDNKIT_CUDA_CHECK_LAUNCH();
}
template <int K, ScanRole kRole = ScanRole::kSegments>
void launch_cp_scan(const PrefillParams& p, const Plan& plan, cudaStream_t stream) {
  if (plan.cp_scan_cols == 32) return launch_cp_scan_cols<K, 32, kRole>(p, plan, stream);
  launch_cp_scan_cols<K, 8, kRole>(p, plan, stream);
}

}  // namespace gdnkit::cuda::chunked_prefill
