// Where a warp's share of one value head's state sits in its lanes, for both pool layouts
// (docs/design/decode.md "The warp kernel").
//
// A warp owns kRows consecutive columns v0 .. v0+kRows-1 of S (S in R^{K x V}, column v = the k-vector
// S[:, v]) and all K rows k. Lane l holds s[i][j] = S[k_of(l, j)][v0 + i] in fp32 registers (bf16 pairs on
// the wide tile: StateRegs), for all i < kRows columns and j < kKPerLane = K/32 rows: kRows * K / 32 values
// (32 at K = 128, 256; 16 at K = 64 and on the narrow tile at K = 128, 64 on the wide tile).
// Each k sits in exactly one lane, so every dot product over k (and the q/k norms) is a per-lane sum
// plus a warp reduction.
//
//   K-last ([V][K], column v contiguous in k): a lane's K/32 k of each column are runs of kVec contiguous k,
//     k = (j / kVec) * 32 * kVec + l * kVec + j % kVec, so one run instruction of the warp covers
//     32 * kVec contiguous elements of a column (whole lines).
//   V-last ([K][V], row k contiguous in v): lane l holds rows k = l + 32 j. A warp's columns are only
//     kRows * sizeof(state) bytes of each row (32 bytes fp32, 16 bf16), and partial-line stores run far
//     below the copy ceiling. So the CTA's warps (128-byte row pieces: 32 fp32 or 64 bf16 columns) load
//     the state together: cp.async of whole row pieces into shared memory, one barrier, then each warp
//     reads its values from there (padded rows: no bank conflicts). Stores take the same way back
//     (registers -> shared memory -> whole row pieces).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/arch/dtype.cuh"
#include "cuda/arch/fp8.cuh"
#include "gdnkit/types.h"

namespace gdnkit::cuda::recurrent {

// Columns per warp (K-last only; V-last tiles are kRegular):
//   kRegular  8 (4 at K = 256);
//   kNarrow   4 at every K: twice the warps on the same state, each with half the loads and arithmetic;
//   kWide     16 at K <= 128, 16-bit pools, decode: half the warps, each with twice the loads (a warp then moves
//             the 4 KB per call that an fp32 warp of the regular tile moves), the values held as 16-bit pairs
//             (StateRegs: 32 registers for 64 values), so that more grids fit the GPU at once and run in
//             prefetch mode (heuristics.cpp chooses the width);
//   kSolo     the regular tile's columns in CTAs of one warp (fp32-state decode on grids past prefetch mode: a warp's
//             slot is taken again as soon as it ends, not when its CTA's slowest warp does);
//   kWideSolo the wide tile in CTAs of one warp (16-bit-state decode on grids past the wide tile's prefetch mode).
enum class TileWidth : int { kRegular, kNarrow, kWide, kSolo, kWideSolo };

// A lane's state values in registers: fp32 [kRows][kKPerLane], or 16-bit pairs (k_of(l, j), k_of(l, j + 1)), j even,
// as they sit in a K-last pool (TPacked bf16 or fp16: the wide tile, decode of a 16-bit pool; one token, so rounding
// the updated value in registers is the rounding the store does, bit for bit).
template <int kRows, int kKPerLane, class TPacked>
struct StateRegs {
  float v[kRows][kKPerLane];
  __device__ __forceinline__ float get(int i, int j) const { return v[i][j]; }
  __device__ __forceinline__ void set2(int i, int j, float a, float b) { v[i][j] = a, v[i][j + 1] = b; }
  __device__ __forceinline__ void opaque() {}
  // S = 0 (prefill of a sequence without an initial slot).
  __device__ __forceinline__ void set_zero() {
#pragma unroll
    for (int i = 0; i < kRows; ++i)
#pragma unroll
      for (int j = 0; j < kKPerLane; j += 2) set2(i, j, 0.0f, 0.0f);
  }
};
// The 16-bit pairs of StateRegs<..., bf16 / fp16>: the lower k in the low half, as in memory.
template <int kRows, int kKPerLane>
struct PackedStateRegs {
  static_assert(kKPerLane % 2 == 0, "16-bit pairs");
  uint32_t v[kRows][kKPerLane / 2];
  // S = 0 (zero bits are 0 in both dtypes).
  __device__ __forceinline__ void set_zero() {
#pragma unroll
    for (int i = 0; i < kRows; ++i)
#pragma unroll
      for (int j = 0; j < kKPerLane / 2; ++j) v[i][j] = 0u;
  }
  // Hides the pairs from the compiler, so that a get() after this one unpacks again rather than keeping the
  // earlier get()'s fp32 values alive (64 more registers).
  __device__ __forceinline__ void opaque() {
#pragma unroll
    for (int i = 0; i < kRows; ++i)
#pragma unroll
      for (int j = 0; j < kKPerLane / 2; ++j) asm volatile("" : "+r"(v[i][j]));
  }
};
template <int kRows, int kKPerLane>
struct StateRegs<kRows, kKPerLane, __nv_bfloat16> : PackedStateRegs<kRows, kKPerLane> {
  using PackedStateRegs<kRows, kKPerLane>::v;
  __device__ __forceinline__ float get(int i, int j) const {
    const uint32_t u = v[i][j / 2];
    return __uint_as_float(j % 2 ? u & 0xffff0000u : u << 16);
  }
  __device__ __forceinline__ void set2(int i, int j, float a, float b) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(v[i][j / 2]) : "f"(b), "f"(a));  // b: the high half
  }
};
template <int kRows, int kKPerLane>
struct StateRegs<kRows, kKPerLane, __half> : PackedStateRegs<kRows, kKPerLane> {
  using PackedStateRegs<kRows, kKPerLane>::v;
  __device__ __forceinline__ float get(int i, int j) const {
    const uint32_t u = v[i][j / 2];
    return __half2float(__ushort_as_half(static_cast<unsigned short>(j % 2 ? u >> 16 : u & 0xffffu)));
  }
  __device__ __forceinline__ void set2(int i, int j, float a, float b) {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(v[i][j / 2]) : "f"(b), "f"(a));  // b: the high half
  }
};

template <StateLayout kLayout, class TState, int K, int V, TileWidth kWidth = TileWidth::kRegular>
struct WarpTile;

template <class TState, int K, int V, TileWidth kWidth>
struct WarpTile<StateLayout::kKLast, TState, K, V, kWidth> {
  static constexpr bool kWideCols = kWidth == TileWidth::kWide || kWidth == TileWidth::kWideSolo;
  static_assert(!kWideCols || K <= 128, "the wide tile is built for K <= 128 only");
  static constexpr int kRows = kWideCols                      ? 16
                               : kWidth == TileWidth::kNarrow ? 4
                               : K <= 128                     ? 8
                                                              : 4;  // columns per warp
  static constexpr int kKPerLane = K / 32;
  // k per run: 16 bytes, or all of a lane's k when they are fewer.
  static constexpr int kVec = kKPerLane * int(sizeof(TState)) > 16 ? 16 / int(sizeof(TState)) : kKPerLane;
  // Warps per CTA: neighbouring columns of one head, one contiguous range of the pool (4 beat 2 and 1 on small
  // grids; kSolo: 1, docs/design/decode.md "CTAs and grid").
  static constexpr int kCtaWarps = kWidth == TileWidth::kSolo || kWidth == TileWidth::kWideSolo ? 1 : 4;
  static_assert(K % 32 == 0 && kKPerLane % kVec == 0 && V % (kRows * kCtaWarps) == 0,
                "tile does not divide the head");
  // The wide tile holds 16-bit pools' values as loaded (StateRegs): 32 registers for its 64 values a lane.
  static constexpr bool kPacked = kWideCols;
  static_assert(!kPacked || (sizeof(TState) == 2 && kVec % 2 == 0), "the wide tile is for 16-bit pools");
  using Regs = StateRegs<kRows, kKPerLane, std::conditional_t<kPacked, TState, void>>;
  struct Stage {};  // loads go straight to registers

  __device__ static int k_of(int lane, int j) { return (j / kVec) * 32 * kVec + lane * kVec + j % kVec; }
  // Element offset of the warp's columns inside one head's [V][K] block.
  __device__ static int64_t origin(int v0) { return int64_t(v0) * K; }

  // L2 prefetch of what load() will read: the warp's columns are one contiguous run.
  __device__ static void prefetch(const TState* tile, int lane) {
    if (lane == 0) prefetch_l2(tile, unsigned(kRows * K * sizeof(TState)));
  }
  // s <- the pool state at `tile` (head block + origin). Every warp of the CTA calls it together.
  __device__ static void load(const TState* tile, Regs& s, int lane, Stage&) {
#pragma unroll
    for (int i = 0; i < kRows; ++i)
#pragma unroll
      for (int j = 0; j < kKPerLane; j += kVec) {
        if constexpr (kPacked) {
          RawVec<TState, kVec> raw;
          raw.load(tile + i * K + k_of(lane, j));
          static_assert(sizeof(raw) == kVec / 2 * 4, "kVec / 2 words");
          __builtin_memcpy(&s.v[i][j / 2], &raw, sizeof(raw));
        } else {
          load_vec<TState, kVec>(tile + i * K + k_of(lane, j), &s.v[i][j]);
        }
      }
  }
  // Any storage dtype E (pool or intermediate cache).
  template <class E>
  __device__ static void store(E* tile, const Regs& s, int lane, Stage&) {
#pragma unroll
    for (int i = 0; i < kRows; ++i)
#pragma unroll
      for (int j = 0; j < kKPerLane; j += kVec) {
        if constexpr (kPacked && std::is_same_v<E, TState>) {  // the pairs as they are
          RawVec<TState, kVec> raw;
          __builtin_memcpy(&raw, &s.v[i][j / 2], sizeof(raw));
          *reinterpret_cast<RawVec<TState, kVec>*>(tile + i * K + k_of(lane, j)) = raw;
        } else if constexpr (kPacked) {
          float run[kVec];
#pragma unroll
          for (int x = 0; x < kVec; ++x) run[x] = s.get(i, j + x);
          store_vec<E, kVec>(tile + i * K + k_of(lane, j), run);
        } else {
          store_vec<E, kVec>(tile + i * K + k_of(lane, j), &s.v[i][j]);
        }
      }
  }
  // float8_e4m3 (verify's intermediate cache, fp8 pools; docs/semantics.md): a lane's run of kVec k of a column is
  // its share of a 32-element block held by 32 / kVec neighbouring lanes. Per run, the blocks' largest magnitudes of
  // all kRows columns are reduced together (a transposed butterfly: each lane ends with one column's), so a lane
  // forms one scale and writes one scale byte, and each column takes its scale from that lane. `scales` holds the
  // blocks of the warp's first column, K / 32 per column.
  static constexpr bool kStoresE4m3 = !kPacked && (kVec == 2 || kVec == 4 || kVec == 8);
  __device__ static void store_e4m3(uint8_t* tile, uint8_t* scales, const Regs& s, int lane, Stage&) {
    static_assert(kStoresE4m3, "fp32 registers, runs of 2, 4 or 8 k");
    constexpr int kLanesPerBlock = kFp8Block / kVec, kLanesPerCol = kLanesPerBlock / kRows;
    static_assert(kRows <= kLanesPerBlock, "a column's block maximum in one lane after the butterfly");
    const int group = lane & ~(kLanesPerBlock - 1);
#pragma unroll
    for (int j = 0; j < kKPerLane; j += kVec) {
      float m[kRows];
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        m[i] = fabsf(s.v[i][j]);
#pragma unroll
        for (int x = 1; x < kVec; ++x) m[i] = max_abs_nan(m[i], s.v[i][j + x]);
      }
      const auto larger = [](float a, float b) { return max_abs_nan(a, b); };
      const int mine = transpose_group_reduce<kRows, kLanesPerBlock>(m, lane, larger);
      const Fp8Scale own = e4m3_block_scale(__float_as_uint(m[0]));
      const int k = k_of(lane, j);
      if (lane % kLanesPerCol == 0) scales[mine * (K / kFp8Block) + k / kFp8Block] = uint8_t(own.byte);
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const float f = __shfl_sync(0xffffffffu, e4m3_factor(own), group + i * kLanesPerCol);
        const float* x = &s.v[i][j];
        uint8_t* at = tile + i * K + k;
        if constexpr (kVec == 2) {
          *reinterpret_cast<uint16_t*>(at) = uint16_t(e4m3x4_by_factor(x[0], x[1], 0.0f, 0.0f, f));
        } else if constexpr (kVec == 4) {
          *reinterpret_cast<uint32_t*>(at) = e4m3x4_by_factor(x[0], x[1], x[2], x[3], f);
        } else {
          *reinterpret_cast<uint2*>(at) =
              make_uint2(e4m3x4_by_factor(x[0], x[1], x[2], x[3], f), e4m3x4_by_factor(x[4], x[5], x[6], x[7], f));
        }
      }
    }
  }
  // s <- a float8_e4m3 tile (a pool of TState uint8_t): each run's bytes times its block's scale, exact in fp32;
  // `scales` as in store_e4m3. Every load is issued before any use.
  __device__ static void load_e4m3(const uint8_t* tile, const uint8_t* scales, Regs& s, int lane, Stage&) {
    static_assert(kStoresE4m3 && std::is_same_v<TState, uint8_t>, "float8_e4m3 pools: runs of 2, 4 or 8 bytes");
    using Run = std::conditional_t<kVec == 2, uint16_t, std::conditional_t<kVec == 4, uint32_t, uint2>>;
    Run raw[kRows][kKPerLane / kVec];
    uint8_t sbyte[kRows][kKPerLane / kVec];
#pragma unroll
    for (int i = 0; i < kRows; ++i)
#pragma unroll
      for (int j = 0; j < kKPerLane; j += kVec) {
        const int k = k_of(lane, j);
        raw[i][j / kVec] = *reinterpret_cast<const Run*>(tile + i * K + k);
        sbyte[i][j / kVec] = scales[i * (K / kFp8Block) + k / kFp8Block];
      }
#pragma unroll
    for (int i = 0; i < kRows; ++i)
#pragma unroll
      for (int j = 0; j < kKPerLane; j += kVec) {
        const float sc = e8m0_scale(sbyte[i][j / kVec]);
        uint32_t w[(kVec + 3) / 4];
        if constexpr (kVec == 8) {
          w[0] = raw[i][j / kVec].x, w[1] = raw[i][j / kVec].y;
        } else {
          w[0] = uint32_t(raw[i][j / kVec]);
        }
#pragma unroll
        for (int x = 0; x < kVec; x += 2) {
          const float2 f = e4m3x2_to_float2(w[x / 4] >> (8 * (x % 4)), sc);
          s.v[i][j + x] = f.x, s.v[i][j + x + 1] = f.y;
        }
      }
  }
};

template <class TState, int K, int V, TileWidth kWidth>
struct WarpTile<StateLayout::kVLast, TState, K, V, kWidth> {
  static_assert(kWidth == TileWidth::kRegular, "V-last tiles are whole 128-byte row pieces per CTA");
  static constexpr int kRows = K <= 128 ? 8 : 4;
  static constexpr int kKPerLane = K / 32;
  static constexpr int kVec = 1;  // k per run: a lane's k are 32 apart
  // Columns per CTA: 128-byte row pieces (32 fp32, 64 bf16: 4 or 8 warps); at K = 256 (correct, not the
  // fast path) 32 columns, so that the stage stays within 48 KB of static shared memory; float8_e4m3 pools 32
  // columns (one scale block of each row: the verify and commit kernels are bound by their instructions, not by
  // the partial lines).
  static constexpr bool kFp8Pool = sizeof(TState) == 1;
  static constexpr int kCtaCols = K <= 128 && !kFp8Pool ? 128 / int(sizeof(TState)) : 32;
  static constexpr int kCtaWarps = kCtaCols / kRows;
  static_assert(K % 32 == 0 && V % kCtaCols == 0, "tile does not divide the head");
  static constexpr bool kPacked = false;
  using Regs = StateRegs<kRows, kKPerLane, void>;
  // float8_e4m3 pools and caches (store_e4m3, load_e4m3): a row's 32-column scale block spans kWarpsPerBlock warps
  // of the CTA, whose largest magnitudes meet in shared memory.
  static constexpr bool kStoresE4m3 = kCtaCols % kFp8Block == 0;
  static constexpr int kWarpsPerBlock = kFp8Block / kRows;
  // The stage: one fp32 row piece of kCtaCols per k, padded by 16 bytes so that the lanes' reads and
  // writes of 16-byte runs (rows lane + 32 j) fall in distinct bank groups. Loads stage the raw state
  // dtype at the start of each row; stores stage fp32 (e4m3 bytes: store_e4m3). m: each warp's largest magnitude of
  // each row (store_e4m3).
  static constexpr int kPitch = kCtaCols + 4;
  struct Stage {
    __align__(16) float e[K][kPitch];
    float m[K][kCtaWarps];
  };

  __device__ static int k_of(int lane, int j) { return lane + 32 * j; }
  __device__ static int64_t origin(int v0) { return v0; }

  // L2 prefetch of what load() will read: the CTA's row pieces, one row per thread.
  __device__ static void prefetch(const TState* tile, int) {
    const TState* cta = tile - int(threadIdx.x) / 32 * kRows;
    for (int r = int(threadIdx.x); r < K; r += kCtaWarps * 32)
      prefetch_l2(cta + int64_t(r) * V, unsigned(kCtaCols * sizeof(TState)));
  }
  // The CTA's row pieces (kCtaCols values of each row from `cta`, its first column) into the stage by cp.async, raw
  // at the start of each stage row. Every warp calls it (barriers inside).
  template <class T>
  __device__ static void stage_rows(const T* cta, Stage& st) {
    constexpr int kChunk = 16 / int(sizeof(T)), kChunksPerRow = kCtaCols / kChunk;
    __syncthreads();  // every warp is done with the stage's previous contents
#pragma unroll 4
    for (int c = int(threadIdx.x); c < K * kChunksPerRow; c += kCtaWarps * 32) {
      const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * kChunk;
      const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(reinterpret_cast<T*>(&st.e[r][0]) + col));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(cta + int64_t(r) * V + col) : "memory");
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
  }
  // Every warp of the CTA calls load and store together (barriers inside).
  __device__ static void load(const TState* tile, Regs& regs, int lane, Stage& st) {
    float(&s)[kRows][kKPerLane] = regs.v;
    const int warp = int(threadIdx.x) / 32;
    stage_rows(tile - warp * kRows, st);  // the CTA's first column: its warps take consecutive column blocks
#pragma unroll
    for (int j = 0; j < kKPerLane; ++j) {
      float run[kRows];
      load_vec<TState, kRows>(reinterpret_cast<const TState*>(&st.e[k_of(lane, j)][0]) + warp * kRows, run);
#pragma unroll
      for (int i = 0; i < kRows; ++i) s[i][j] = run[i];
    }
  }
  template <class E>
  __device__ static void store(E* tile, const Regs& regs, int lane, Stage& st) {
    const float(&s)[kRows][kKPerLane] = regs.v;
    constexpr int kChunk = 16 / int(sizeof(E)), kChunksPerRow = kCtaCols / kChunk;
    const int warp = int(threadIdx.x) / 32;
    E* cta = tile - warp * kRows;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kKPerLane; ++j)
#pragma unroll
      for (int i = 0; i < kRows; i += 4)
        *reinterpret_cast<float4*>(&st.e[k_of(lane, j)][warp * kRows + i]) =
            make_float4(s[i][j], s[i + 1][j], s[i + 2][j], s[i + 3][j]);
    __syncthreads();
#pragma unroll 2
    for (int c = int(threadIdx.x); c < K * kChunksPerRow; c += kCtaWarps * 32) {
      const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * kChunk;
      float run[kChunk];
      load_vec<float, kChunk>(&st.e[r][col], run);
      store_vec<E, kChunk>(cta + int64_t(r) * V + col, run);
    }
  }
  // s <- a float8_e4m3 tile (a pool of TState uint8_t): the CTA's 32-byte row pieces staged by cp.async, each lane's
  // kRows bytes of a row times the row's block scale. `scales` holds the scale of row 0's block of the warp's
  // columns; row k's is V / 32 further on.
  __device__ static void load_e4m3(const uint8_t* tile, const uint8_t* scales, Regs& regs, int lane, Stage& st) {
    static_assert(kFp8Pool && kCtaCols == kFp8Block, "float8_e4m3 pools: one scale block of each row a CTA");
    float(&s)[kRows][kKPerLane] = regs.v;
    const int warp = int(threadIdx.x) / 32;
    uint32_t sbyte[kKPerLane];
#pragma unroll
    for (int j = 0; j < kKPerLane; ++j) sbyte[j] = scales[int64_t(k_of(lane, j)) * (V / kFp8Block)];
    stage_rows(tile - warp * kRows, st);
#pragma unroll
    for (int j = 0; j < kKPerLane; ++j) {
      const uint8_t* run = reinterpret_cast<const uint8_t*>(&st.e[k_of(lane, j)][0]) + warp * kRows;
      uint32_t w[kRows / 4];
#pragma unroll
      for (int x = 0; x < kRows / 4; ++x) w[x] = reinterpret_cast<const uint32_t*>(run)[x];
      const float sc = e8m0_scale(sbyte[j]);
#pragma unroll
      for (int i = 0; i < kRows; i += 2) {
        const float2 f = e4m3x2_to_float2(w[i / 4] >> (8 * (i % 4)), sc);
        s[i][j] = f.x, s[i + 1][j] = f.y;
      }
    }
  }
  // The warp's columns to float8_e4m3 bytes at `tile` (a pool or an intermediate cache in this layout), the blocks'
  // scales at `scales` (as in load_e4m3): each warp's largest magnitude of each of its rows meets the other warps' of
  // the block in shared memory (one barrier), every warp of the block forms the same scale, the first writes it, and
  // the bytes leave as whole row pieces from the stage.
  __device__ static void store_e4m3(uint8_t* tile, uint8_t* scales, const Regs& regs, int lane, Stage& st) {
    static_assert(kStoresE4m3, "whole scale blocks a CTA");
    const float(&s)[kRows][kKPerLane] = regs.v;
    constexpr int kChunksPerRow = kCtaCols / 16;
    const int warp = int(threadIdx.x) / 32, block0 = warp / kWarpsPerBlock * kWarpsPerBlock;
    uint8_t* cta = tile - warp * kRows;
    __syncthreads();  // every warp is done with the stage's previous contents
#pragma unroll
    for (int j = 0; j < kKPerLane; ++j) {
      float m = fabsf(s[0][j]);
#pragma unroll
      for (int i = 1; i < kRows; ++i) m = max_abs_nan(m, s[i][j]);
      st.m[k_of(lane, j)][warp] = m;
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kKPerLane; ++j) {
      const int k = k_of(lane, j);
      float m = st.m[k][block0];
#pragma unroll
      for (int w = 1; w < kWarpsPerBlock; ++w) m = max_abs_nan(m, st.m[k][block0 + w]);
      const Fp8Scale sc = e4m3_block_scale(__float_as_uint(m));
      if (warp == block0) scales[int64_t(k) * (V / kFp8Block)] = uint8_t(sc.byte);
      uint32_t* run = reinterpret_cast<uint32_t*>(reinterpret_cast<uint8_t*>(&st.e[k][0]) + warp * kRows);
#pragma unroll
      for (int i = 0; i < kRows; i += 4) run[i / 4] = e4m3x4(s[i][j], s[i + 1][j], s[i + 2][j], s[i + 3][j], sc);
    }
    __syncthreads();
#pragma unroll 2
    for (int c = int(threadIdx.x); c < K * kChunksPerRow; c += kCtaWarps * 32) {
      const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * 16;
      *reinterpret_cast<uint4*>(cta + int64_t(r) * V + col) =
          *reinterpret_cast<const uint4*>(reinterpret_cast<const uint8_t*>(&st.e[r][0]) + col);
    }
  }
};

}  // namespace gdnkit::cuda::recurrent
