// How the 128 threads of a recurrent CTA share one (sequence, value head, v-block) tile of the state.
//
// A CTA owns kBV consecutive columns v of S (S in R^{K x V}) and all K rows k. Each thread holds
// kRuns runs of kRun contiguous memory elements in fp32 registers, s[run][e]:
//
//   K-last ([V, K], rows v of S^T are contiguous k-vectors): a run is 16 consecutive k of one v.
//     kLanesPerV = K/16 lanes of a warp cover one v (the dot products over k reduce across those
//     lanes with shuffles, no shared memory); a warp covers 32/kLanesPerV values of v per pass.
//   V-last ([K, V], v contiguous): a run is one k row of kRun consecutive v (16 bytes of state).
//     kThreadsV threads cover the kBV columns; the other 128/kThreadsV threads split k, so the dot
//     products over k reduce across lanes (shuffles) and then across the 4 warps (shared memory).
#pragma once

#include <cstdint>

#include "gdnkit/types.h"

namespace gdnkit::cuda::recurrent {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;

template <StateLayout kLayout, class TS, int K, int V>
struct TileMap;

template <class TS, int K, int V>
struct TileMap<StateLayout::kKLast, TS, K, V> {
  static constexpr int kRun = 16;                        // k per run
  static constexpr int kLanesPerV = K / kRun;            // 4, 8, 16
  static constexpr int kVPerWarp = 32 / kLanesPerV;      // v rows one warp covers per pass
  static constexpr int kVPerPass = kVPerWarp * kWarps;   // ... the whole CTA
  static constexpr int kRuns = K >= 128 ? 2 : 1;         // v rows per thread
  static constexpr int kBV = kVPerPass * kRuns;          // 32, 32, 16
  static_assert(V % kBV == 0, "V must be a multiple of the v-block");

  // Local column (0..kBV) of run r, and the first k of every run of this thread.
  __device__ static int v_of_run(int tid, int r) { return r * kVPerPass + (tid / 32) * kVPerWarp + (tid % 32) / kLanesPerV; }
  __device__ static int k0(int tid) { return (tid % kLanesPerV) * kRun; }
  // Element offset of run r inside one head's [V, K] block, v-block origin vb.
  __device__ static int64_t run_offset(int tid, int vb, int r) { return int64_t(vb + v_of_run(tid, r)) * K + k0(tid); }
  // This thread writes o for its runs' columns (one lane per lane group).
  __device__ static bool writes_output(int tid) { return tid % kLanesPerV == 0; }
};

template <class TS, int K, int V>
struct TileMap<StateLayout::kVLast, TS, K, V> {
  static constexpr int kRun = 16 / int(sizeof(TS));      // v per run: 4 (fp32) or 8 (bf16)
  static constexpr int kBV = 32;
  static constexpr int kThreadsV = kBV / kRun;           // 8 or 4
  static constexpr int kThreadsK = kThreads / kThreadsV;  // 16 or 32
  static constexpr int kRuns = K / kThreadsK;            // k rows per thread
  static_assert(V % kBV == 0 && K % kThreadsK == 0, "tile does not divide the head");

  __device__ static int tv(int tid) { return tid % kThreadsV; }
  __device__ static int tk(int tid) { return tid / kThreadsV; }
  __device__ static int k_of_run(int tid, int r) { return tk(tid) * kRuns + r; }
  __device__ static int64_t run_offset(int tid, int vb, int r) {
    return int64_t(k_of_run(tid, r)) * V + vb + tv(tid) * kRun;
  }
  __device__ static bool writes_output(int tid) { return tid < kThreadsV; }
};

}  // namespace gdnkit::cuda::recurrent
