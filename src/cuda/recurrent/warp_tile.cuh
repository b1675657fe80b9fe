// Where a warp's share of one value head's state sits in its lanes, for both pool layouts.
//
// A warp owns kRows consecutive columns v0 .. v0+kRows-1 of S (S in R^{K x V}, column v = the k-vector
// S[:, v]) and all K rows k. Lane l holds s[i][j] = S[k_of(l, j)][v0 + v_of(l, i)] in fp32 registers,
// for i < kVPer columns and j < kKPer rows: kRows * K / 32 values (32 at K = 128, 256; 16 at K = 64).
// Lanes that differ only in their low bits below kVLanes hold different columns and the same rows;
// the others split k. So every dot product over k is a per-lane sum plus group_sum<kVLanes>, and the
// q/k norms reduce the same way (each k sits in exactly one lane of a group).
//
//   K-last ([V][K], column v contiguous in k): every lane holds all kRows columns (kVLanes = 1) and K/32
//     k of each, as runs of kVec contiguous k: k = (j / kVec) * 32 * kVec + l * kVec + j % kVec, so one
//     run instruction of the warp covers 32 * kVec contiguous elements of a column (whole lines).
//   V-last ([K][V], row k contiguous in v): a lane holds kVPer contiguous v of each of its k rows (one
//     run of at most 16 bytes); kVLanes lanes cover the warp's kRows columns of a row, the other
//     32 / kVLanes lanes take rows k = l / kVLanes + (32 / kVLanes) * j. A run instruction of the warp
//     covers 32 / kVLanes rows of kRows * sizeof(state) bytes (32 bytes: one whole sector each, for
//     fp32 at K <= 128; the two warps of a CTA take neighbouring columns, so bf16 rows are 32 bytes per CTA).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/dtype.cuh"
#include "gdnkit/types.h"

namespace gdnkit::cuda::recurrent {

// N contiguous elements, N * sizeof(T) in {4, 8, 16, 32} bytes, aligned to min(16, that) bytes: the pool
// slots, q/k/v/o rows and their strides are 16-byte aligned (validated) and a run's offset is a multiple
// of its size. dtype.cuh's vectors cover 8-byte multiples; the 4-byte case is bf16/fp16 at K = 64.
template <class T, int N>
__device__ __forceinline__ void load_run(const T* __restrict__ p, float* out) {
  if constexpr (N * sizeof(T) % 8 == 0) {
    load_vec<T, N>(p, *reinterpret_cast<float(*)[N]>(out));
  } else {
    static_assert(N * sizeof(T) == 4 || N == 1, "runs are 4 bytes, one element, or whole 8-byte words");
    if constexpr (N == 1) {
      out[0] = to_float(p[0]);
    } else {
      const uint32_t raw = *reinterpret_cast<const uint32_t*>(p);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int j = 0; j < N; ++j) out[j] = to_float(e[j]);
    }
  }
}

template <class T, int N>
__device__ __forceinline__ void store_run(T* __restrict__ p, const float* in) {
  if constexpr (N * sizeof(T) % 8 == 0) {
    store_vec<T, N>(p, *reinterpret_cast<const float(*)[N]>(in));
  } else {
    static_assert(N * sizeof(T) == 4 || N == 1, "runs are 4 bytes, one element, or whole 8-byte words");
    if constexpr (N == 1) {
      p[0] = from_float<T>(in[0]);
    } else {
      uint32_t raw;
      T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int j = 0; j < N; ++j) e[j] = from_float<T>(in[j]);
      *reinterpret_cast<uint32_t*>(p) = raw;
    }
  }
}

template <StateLayout kLayout, class TS, int K, int V>
struct WarpTile;

template <class TS, int K, int V>
struct WarpTile<StateLayout::kKLast, TS, K, V> {
  static constexpr int kRows = K <= 128 ? 8 : 4;  // columns per warp
  static constexpr int kVPer = kRows, kVLanes = 1, kKPer = K / 32;
  static constexpr int kVec = kKPer * int(sizeof(TS)) > 16 ? 16 / int(sizeof(TS)) : kKPer;  // k per run
  static_assert(K % 32 == 0 && kKPer % kVec == 0 && V % kRows == 0, "tile does not divide the head");

  __device__ static int k_of(int lane, int j) { return (j / kVec) * 32 * kVec + lane * kVec + j % kVec; }
  __device__ static int v_of(int /*lane*/, int i) { return i; }
  // Element offset of the warp's columns inside one head's [V][K] block.
  __device__ static int64_t origin(int v0) { return int64_t(v0) * K; }

  // s <- the tile at `tile` (head block + origin), any storage dtype E.
  template <class E>
  __device__ static void load(const E* tile, float (&s)[kVPer][kKPer], int lane) {
#pragma unroll
    for (int i = 0; i < kVPer; ++i)
#pragma unroll
      for (int j = 0; j < kKPer; j += kVec) load_run<E, kVec>(tile + i * K + k_of(lane, j), &s[i][j]);
  }
  template <class E>
  __device__ static void store(E* tile, const float (&s)[kVPer][kKPer], int lane) {
#pragma unroll
    for (int i = 0; i < kVPer; ++i)
#pragma unroll
      for (int j = 0; j < kKPer; j += kVec) store_run<E, kVec>(tile + i * K + k_of(lane, j), &s[i][j]);
  }
  // This lane's k entries of a q or k row (runs of kVec contiguous elements).
  template <class TI>
  __device__ static void load_k_entries(const TI* row, float (&x)[kKPer], int lane) {
#pragma unroll
    for (int j = 0; j < kKPer; j += kVec) load_run<TI, kVec>(row + k_of(lane, j), &x[j]);
  }
};

template <class TS, int K, int V>
struct WarpTile<StateLayout::kVLast, TS, K, V> {
  static constexpr int kRows = K <= 128 ? 8 : 4;
  static constexpr int kVPer = kRows * int(sizeof(TS)) > 16 ? 16 / int(sizeof(TS)) : kRows;  // v per run
  static constexpr int kVLanes = kRows / kVPer;
  static constexpr int kKPer = K * kVLanes / 32;
  static_assert(K % 32 == 0 && kRows % kVPer == 0 && V % kRows == 0, "tile does not divide the head");

  __device__ static int k_of(int lane, int j) { return lane / kVLanes + (32 / kVLanes) * j; }
  __device__ static int v_of(int lane, int i) { return (lane % kVLanes) * kVPer + i; }
  __device__ static int64_t origin(int v0) { return v0; }

  template <class E>
  __device__ static void load(const E* tile, float (&s)[kVPer][kKPer], int lane) {
#pragma unroll
    for (int j = 0; j < kKPer; ++j) {
      float run[kVPer];
      load_run<E, kVPer>(tile + int64_t(k_of(lane, j)) * V + v_of(lane, 0), run);
#pragma unroll
      for (int i = 0; i < kVPer; ++i) s[i][j] = run[i];
    }
  }
  template <class E>
  __device__ static void store(E* tile, const float (&s)[kVPer][kKPer], int lane) {
#pragma unroll
    for (int j = 0; j < kKPer; ++j) {
      float run[kVPer];
#pragma unroll
      for (int i = 0; i < kVPer; ++i) run[i] = s[i][j];
      store_run<E, kVPer>(tile + int64_t(k_of(lane, j)) * V + v_of(lane, 0), run);
    }
  }
  template <class TI>
  __device__ static void load_k_entries(const TI* row, float (&x)[kKPer], int lane) {
#pragma unroll
    for (int j = 0; j < kKPer; ++j) x[j] = to_float(row[k_of(lane, j)]);
  }
};

}  // namespace gdnkit::cuda::recurrent
