// Device element helpers shared by every CUDA kernel: L2 prefetch and cp.async, fp32 / bf16 / fp16 loads
// and stores with conversion to fp32, 16-byte vector loads of contiguous runs, warp reductions, and the
// gating math (docs/semantics.md "The recurrence"). Accumulation is always fp32; rounding to a storage dtype
// happens only in a store.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "gdnkit/types.h"

namespace gdnkit::cuda {

// ---- L2 prefetch ------------------------------------------------------------------------------
// Brings `bytes` (a multiple of 16, from a 16-byte aligned global address) into L2 with one bulk
// (TMA) request. A hint: nothing is read into registers, so it may run before griddepcontrol.wait on
// data the previous kernel still writes (L2 is the point of coherence; the later loads see its writes).
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}
// One cache line around p, any alignment.
__device__ __forceinline__ void prefetch_l2_line(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// ---- asynchronous copies into shared memory ----------------------------------------------------
// 16-byte copy global -> shared (cp.async, L2 only); !valid writes 16 zero bytes and reads nothing (src
// must still be a valid address).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(dst))),
               "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
// All but the newest kPending commit groups of this thread have landed.
template <int kPending>
__device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// ---- scalar conversions ---------------------------------------------------------------------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

// Element i of a buffer whose dtype is known only at run time (per-head scalars: a, b, beta), as its
// bits (16-bit dtypes in the low half), and those bits as a float.
__device__ __forceinline__ uint32_t load_bits_dyn(const void* p, DType dtype, int64_t i) {
  if (dtype == DType::kBFloat16 || dtype == DType::kFloat16) return static_cast<const uint16_t*>(p)[i];
  return static_cast<const uint32_t*>(p)[i];
}
__device__ __forceinline__ float bits_to_float(uint32_t x, DType dtype) {
  switch (dtype) {
    case DType::kBFloat16: return __uint_as_float(x << 16);
    case DType::kFloat16: return __half2float(__ushort_as_half(static_cast<unsigned short>(x)));
    default: return __uint_as_float(x);
  }
}

// Volatile global loads of one word (RawVec::load_pinned says why).
__device__ __forceinline__ void ld_volatile(const uint4* p, uint4& w) {
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w) : "l"(p));
}
__device__ __forceinline__ void ld_volatile(const uint2* p, uint2& w) {
  asm volatile("ld.volatile.global.v2.u32 {%0, %1}, [%2];" : "=r"(w.x), "=r"(w.y) : "l"(p));
}
__device__ __forceinline__ void ld_volatile(const uint32_t* p, uint32_t& w) {
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(w) : "l"(p));
}
template <class T>  // one 16-bit element (bf16, fp16)
__device__ __forceinline__ void ld_volatile(const T* p, T& w) {
  static_assert(sizeof(T) == 2, "16-bit element");
  unsigned short u;
  asm volatile("ld.volatile.global.u16 %0, [%1];" : "=h"(u) : "l"(p));
  w = __builtin_bit_cast(T, u);
}
// ---- vector loads / stores of N contiguous elements ---------------------------------------------
// Moved as the widest words that divide the run (16, 8, 4 bytes, or one element): N * sizeof(T) in
// {2, 4, 8, 16, 32, ...} bytes. The caller guarantees the run is aligned to min(16, its size) (the
// launchers check pool slots, strides and base pointers; run offsets are multiples of the run size).
template <class T, int N>
struct VecWord {
  static constexpr int kBytes = N * int(sizeof(T));
  using type = std::conditional_t<
      kBytes % 16 == 0, uint4,
      std::conditional_t<kBytes % 8 == 0, uint2, std::conditional_t<kBytes % 4 == 0, uint32_t, T>>>;
  static constexpr int kPer = int(sizeof(type) / sizeof(T));  // elements per word
  static_assert(N % kPer == 0, "the run must be whole words");
};

// N contiguous elements held as loaded (the widest words that divide the run) and converted to fp32
// where used: a kernel can issue a load early without a conversion waiting on it right behind the load.
template <class T, int N>
struct RawVec {
  using W = typename VecWord<T, N>::type;
  static constexpr int kPer = VecWord<T, N>::kPer;  // elements per word
  W w[N / kPer];
  __device__ __forceinline__ void load(const T* __restrict__ p) {
#pragma unroll
    for (int i = 0; i < N / kPer; ++i) w[i] = reinterpret_cast<const W*>(p)[i];
  }
  // The same as volatile loads: ptxas neither drops nor moves them into a branch taken later (it sinks plain
  // loads under the first branch before their use, which may wait on another load).
  __device__ __forceinline__ void load_pinned(const T* p) {
#pragma unroll
    for (int i = 0; i < N / kPer; ++i) ld_volatile(reinterpret_cast<const W*>(p) + i, w[i]);
  }
  // Element i as loaded (its dtype, no conversion).
  __device__ __forceinline__ T element(int i) const { return reinterpret_cast<const T*>(w)[i]; }
  // Hides the words' values from the compiler, so that a conversion after this one is redone from the
  // words rather than the earlier conversion's fp32 values kept alive (twice the registers for 16-bit T).
  __device__ __forceinline__ void opaque() {
    static_assert(sizeof(w) % 4 == 0, "whole 32-bit words");
    uint32_t* u = reinterpret_cast<uint32_t*>(w);
#pragma unroll
    for (int i = 0; i < int(sizeof(w) / 4); ++i) asm volatile("" : "+r"(u[i]));
  }
  __device__ __forceinline__ void to_floats(float* out) const {
    if constexpr (std::is_same_v<T, __nv_bfloat16> && sizeof(W) % 4 == 0) {
      // bf16 pairs by 32-bit word: the low element shifted up, the high one masked (one instruction
      // each; __bfloat162float of the high half compiles to a byte permute and a shift). Bit-exact.
      const uint32_t* u = reinterpret_cast<const uint32_t*>(w);
#pragma unroll
      for (int i = 0; i < N / 2; ++i) {
        out[2 * i] = __uint_as_float(u[i] << 16);
        out[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
      }
    } else {
#pragma unroll
      for (int i = 0; i < N / kPer; ++i) {
        const T* e = reinterpret_cast<const T*>(&w[i]);
#pragma unroll
        for (int j = 0; j < kPer; ++j) out[i * kPer + j] = to_float(e[j]);
      }
    }
  }
};

template <class T, int N>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, float* out) {
  RawVec<T, N> raw;
  raw.load(p);
  raw.to_floats(out);
}

template <class T, int N>
__device__ __forceinline__ void store_vec(T* __restrict__ p, const float* in) {
  using W = typename VecWord<T, N>::type;
  constexpr int kPer = VecWord<T, N>::kPer;
#pragma unroll
  for (int w = 0; w < N / kPer; ++w) {
    W raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int j = 0; j < kPer; ++j) e[j] = from_float<T>(in[w * kPer + j]);
    reinterpret_cast<W*>(p)[w] = raw;
  }
}

// ---- warp reductions --------------------------------------------------------------------------
// Sum over the warp: xor butterflies, every lane ends with the sum.
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// N reductions by `op` (associative, commutative) over aligned groups of kLanes lanes at once (N and kLanes
// powers of two, 2 <= N <= kLanes <= 32), each lane contributing x[0..N-1]: a butterfly that halves the values at
// every step (each lane keeps one half and combines its partner's other half), then plain butterflies: N - 1 +
// log2(kLanes / N) shuffles instead of N * log2(kLanes). Afterwards x[0] of lane l is the group's reduction of
// value (l % kLanes) / (kLanes / N); returns that index.
template <int N, int kLanes = 32, class Op>
__device__ __forceinline__ int transpose_group_reduce(float (&x)[N], int lane, const Op& op) {
  constexpr auto log2 = [](int n) { int r = 0; while (n > 1) n /= 2, ++r; return r; };
  constexpr int kSteps = log2(N), kAll = log2(kLanes);
  static_assert((1 << kSteps) == N && (1 << kAll) == kLanes && N >= 2 && N <= kLanes && kLanes <= 32,
                "N and kLanes must be powers of two, 2 <= N <= kLanes <= 32");
  int index = 0;
#pragma unroll
  for (int step = 0; step < kSteps; ++step) {
    const int half = N >> (step + 1), off = (kLanes / 2) >> step;
    const bool upper = (lane & off) != 0;  // this lane keeps the upper half
#pragma unroll
    for (int m = 0; m < half; ++m) {
      const float send = upper ? x[m] : x[m + half];
      const float keep = upper ? x[m + half] : x[m];
      x[m] = op(keep, __shfl_xor_sync(0xffffffffu, send, off));
    }
    if (upper) index += half;
  }
#pragma unroll
  for (int step = kSteps; step < kAll; ++step)
    x[0] = op(x[0], __shfl_xor_sync(0xffffffffu, x[0], (kLanes / 2) >> step));
  return index;
}
// The same for sums.
template <int N, int kLanes = 32>
__device__ __forceinline__ int transpose_group_sum(float (&x)[N], int lane) {
  return transpose_group_reduce<N, kLanes>(x, lane, [](float a, float b) { return a + b; });
}

// ---- gating (docs/semantics.md "The recurrence") --------------------------------------------------------
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
// g = -exp(A_log) * softplus(a + dt_bias): log-space decay of one token and value head.
__device__ __forceinline__ float fused_decay(float A_log, float a, float dt_bias) {
  return -expf(A_log) * softplus(a + dt_bias);
}
// The same with the SFU's exp2 / log2 / reciprocal (a few ulp; for kernels with 16-bit outputs): a much shorter
// dependent chain for a decode warp than the IEEE forms. softplus(x) for x < -15 (1 + e^x rounds to 1) is 0 instead of
// e^x < 3.1e-7, so g is off by at most 3.1e-7 exp(A_log).
__device__ __forceinline__ float softplus_fast(float x) { return x > 20.0f ? x : __logf(1.0f + __expf(x)); }
__device__ __forceinline__ float sigmoid_fast(float x) { return __frcp_rn(1.0f + __expf(-x)); }
__device__ __forceinline__ float fused_decay_fast(float A_log, float a, float dt_bias) {
  return -__expf(A_log) * softplus_fast(a + dt_bias);
}

}  // namespace gdnkit::cuda
