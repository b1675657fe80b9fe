// How the 128 threads of a recurrent CTA share one (sequence, value head, v-block) tile of the state.
//
// A CTA owns kBV consecutive columns v of S (S in R^{K x V}) and all K rows k. Each thread holds
// s[run][chunk][j] in fp32 registers: kRuns runs, each of kChunks 16-byte chunks of kVec elements.
// Chunks are what memory moves; a warp's chunk instruction always covers whole 128-byte lines (or
// 64-byte runs), so no sector is fetched or written half.
//
//   K-last ([V, K], row v of S^T is a contiguous k-vector): a run is 16 k of one v, spread over the
//     row: chunk c of lane l (of the kLanesPerV = K/16 lanes that share v) holds
//     k = c * kVec * kLanesPerV + l * kVec + j. The dot products over k reduce across those lanes
//     with shuffles (no shared memory); a warp covers 32/kLanesPerV values of v per pass.
//   V-last ([K, V], v contiguous): a run is one k row of kVec consecutive v (one chunk). kThreadsV
//     threads cover the kBV columns; the other 128/kThreadsV threads split k, so the dot products
//     reduce across lanes (shuffles), then across the 4 warps (shared memory).
// bf16 and fp32 tiles have the same geometry (bf16 CTAs move half the bytes, but more of them fit
// an SM: bigger bf16 tiles measured slower).
#pragma once

#include <cstdint>

#include "gdnkit/types.h"

namespace gdnkit::cuda::recurrent {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;

// CTAs per SM the register budget aims at (__launch_bounds__): more resident CTAs keep more state
// loads in flight. Measured on an H100 (decode, qwen3-next heads, B = 32..512): fp32 tiles of 32
// values per thread run best at 6 (80 registers; 7 spills and is slower), bf16 ones at 7.
template <class TS>
constexpr int min_blocks(int values_per_thread) {
  return values_per_thread <= 32 ? (sizeof(TS) == 2 ? 7 : 6) : 3;
}

template <StateLayout kLayout, class TS, int K, int V>
struct TileMap;

template <class TS, int K, int V>
struct TileMap<StateLayout::kKLast, TS, K, V> {
  static constexpr int kVec = 16 / int(sizeof(TS));       // elements per 16-byte chunk
  static constexpr int kChunks = 16 / kVec;               // a run is 16 k: 4 chunks fp32, 2 bf16
  static constexpr int kLanesPerV = K / 16;               // 4, 8, 16
  static constexpr int kVPerWarp = 32 / kLanesPerV;       // v rows one warp covers per pass
  static constexpr int kVPerPass = kVPerWarp * kWarps;    // ... the whole CTA
  static constexpr int kRuns = K >= 128 ? 2 : 1;         // v rows per thread
  static constexpr int kBV = kVPerPass * kRuns;
  static_assert(V % kBV == 0, "V must be a multiple of the v-block");
  static constexpr int kMinBlocks = min_blocks<TS>(kRuns * kChunks * kVec);

  __device__ static int v_of_run(int tid, int r) {
    return r * kVPerPass + (tid / 32) * kVPerWarp + (tid % 32) / kLanesPerV;
  }
  __device__ static int k_of(int tid, int c, int j) { return c * kVec * kLanesPerV + (tid % kLanesPerV) * kVec + j; }
  // Element offset of chunk c of run r inside one head's [V, K] block, v-block origin vb.
  __device__ static int64_t chunk_offset(int tid, int vb, int r, int c) {
    return int64_t(vb + v_of_run(tid, r)) * K + k_of(tid, c, 0);
  }
  __device__ static bool writes_output(int tid) { return tid % kLanesPerV == 0; }  // one lane per v
};

template <class TS, int K, int V>
struct TileMap<StateLayout::kVLast, TS, K, V> {
  static constexpr int kVec = 16 / int(sizeof(TS));       // v per run: 4 (fp32) or 8 (bf16)
  static constexpr int kChunks = 1;
  static constexpr int kBV = 32;
  static constexpr int kThreadsV = kBV / kVec;            // 8 (4 for bf16 with K = 256)
  static constexpr int kThreadsK = kThreads / kThreadsV;
  static constexpr int kRuns = K / kThreadsK;             // k rows per thread
  static_assert(V % kBV == 0 && K % kThreadsK == 0, "tile does not divide the head");
  static constexpr int kMinBlocks = min_blocks<TS>(kRuns * kChunks * kVec);

  __device__ static int tv(int tid) { return tid % kThreadsV; }
  __device__ static int tk(int tid) { return tid / kThreadsV; }
  __device__ static int k_of_run(int tid, int r) { return tk(tid) * kRuns + r; }
  __device__ static int64_t chunk_offset(int tid, int vb, int r, int /*c*/) {
    return int64_t(k_of_run(tid, r)) * V + vb + tv(tid) * kVec;
  }
  __device__ static bool writes_output(int tid) { return tid < kThreadsV; }
};

}  // namespace gdnkit::cuda::recurrent
