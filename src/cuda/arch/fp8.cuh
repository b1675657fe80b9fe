// float8_e4m3 states on the device (docs/semantics.md "float8_e4m3 states"): E8M0 block scales and e4m3 packing,
// the rounding of host_dtype.h quantize_e4m3_block, so that the same fp32 values store the same bytes.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "gdnkit/types.h"

namespace gdnkit::cuda {

// 2^(e - 127) of an E8M0 byte (255: NaN; 0: the subnormal 2^-127).
// Selects on the bits, not branches (which ptxas made of the conditional form, 5-8 instructions more per use).
__device__ __forceinline__ float e8m0_scale(uint32_t e) {
  const uint32_t bits = (e << 23) | (e == 255u ? 0x007fffffu : 0u);
  return __uint_as_float(e == 0u ? 0x00400000u : bits);
}

// The smallest factor w a block kept as w x (the factored updates of fp8 decode and the fp8 chain kernel) keeps: below
// it the elements take w (x w, w = 1), so that x = S / w, its sums and the update's (rk u / w) k stay far from overflow.
constexpr float kMinBlockFactor = 0x1p-64f;
// The largest factor the V-last chain kernel keeps (above it, decays above 1 from given gates, the elements take w
// too), so that 1 / w stays a normal number.
constexpr float kMaxBlockFactor = 0x1p64f;

// 1 / x to about 1 ulp (rcp.approx.ftz: a subnormal x counts as 0, its reciprocal infinite).
__device__ __forceinline__ float rcp_approx_ftz(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// |x| as bits: their max over a block orders NaN and infinities above every finite value.
__device__ __forceinline__ uint32_t abs_bits(float x) { return __float_as_uint(x) & 0x7fffffffu; }

// A block's scale from its largest magnitude as bits: the E8M0 byte (s + 127, s = e - 7 with e the exponent of amax
// after rounding its mantissa to 3 bits; 255 for a block holding NaN or an infinity) and 2^-s.
struct Fp8Scale {
  uint32_t byte;
  float inv;
};
__device__ __forceinline__ Fp8Scale e4m3_block_scale(uint32_t amax_bits) {
  if (amax_bits >= 0x7f800000u) return {255u, 0.0f};
  const int e = int((amax_bits + 0x7ffffu + ((amax_bits >> 20) & 1u)) >> 23) - 127;
  const int s = max(e - 7, -127);  // <= 121 for finite amax
  return {uint32_t(s + 127), __uint_as_float(uint32_t(127 - s) << 23)};
}

// The larger magnitude of a and b, NaN if either is NaN (max.NaN): over a block, the same order as the bits of
// abs_bits (NaN and infinities above every finite value), so e4m3_block_scale(__float_as_uint(...)) is the same.
__device__ __forceinline__ float max_abs_nan(float a, float b) {
  float m;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(m) : "f"(fabsf(a)), "f"(fabsf(b)));
  return m;
}

// The largest magnitude of N values (max_abs_nan), by a pairwise tree: log2 N dependent steps, not N.
template <int N>
__device__ __forceinline__ float max_abs_nan_tree(const float* x) {
  if constexpr (N == 2) {
    return max_abs_nan(x[0], x[1]);
  } else {
    float h[N / 2];
#pragma unroll
    for (int j = 0; j < N / 2; ++j) h[j] = max_abs_nan(x[j], x[j + N / 2]);
    return max_abs_nan_tree<N / 2>(h);
  }
}
__device__ __forceinline__ float max_abs_nan16(const float (&x)[16]) { return max_abs_nan_tree<16>(x); }

// Four values times f as e4m3 bytes, the first in the low byte: no branch, a NaN f (the NaN scale's) gives the NaN
// codes.
__device__ __forceinline__ uint32_t e4m3x4_by_factor(float a, float b, float c, float d, float f) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a * f, b * f), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c * f, d * f), __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}
// The factor of the NaN scale for e4m3x4_by_factor.
__device__ __forceinline__ float e4m3_nan_factor() { return __uint_as_float(0x7fffffffu); }
// The factor of a scale for e4m3x4_by_factor: 2^-s, NaN for the NaN scale.
__device__ __forceinline__ float e4m3_factor(const Fp8Scale& sc) {
  return sc.byte == 255u ? e4m3_nan_factor() : sc.inv;
}

// Four values x 2^-s as e4m3 bytes, the first in the low byte (all NaN codes under the NaN scale).
__device__ __forceinline__ uint32_t e4m3x4(float a, float b, float c, float d, const Fp8Scale& sc) {
  if (sc.byte == 255u) return 0x7f7f7f7fu;
  return e4m3x4_by_factor(a, b, c, d, sc.inv);
}
// Two values, the first in the low byte.
__device__ __forceinline__ uint32_t e4m3x2(float a, float b, const Fp8Scale& sc) {
  if (sc.byte == 255u) return 0x7f7fu;
  return __nv_cvt_float2_to_fp8x2(make_float2(a * sc.inv, b * sc.inv), __NV_SATFINITE, __NV_E4M3);
}

// One value x 2^-s as an e4m3 byte (the NaN code under the NaN scale).
__device__ __forceinline__ uint32_t e4m3x1(float a, const Fp8Scale& sc) {
  if (sc.byte == 255u) return 0x7fu;
  return __nv_cvt_float_to_fp8(a * sc.inv, __NV_SATFINITE, __NV_E4M3);
}

// An e4m3 byte times scale, as fp32.
__device__ __forceinline__ float e4m3_to_float(uint32_t byte, float scale) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(byte & 0xffu), __NV_E4M3))) * scale;
}

// The two e4m3 bytes of the low half of w (w >> 16 for the high half) as fp32, unscaled.
__device__ __forceinline__ float2 e4m3x2_to_float2(uint32_t w) {
  const __half2_raw pair = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(w & 0xffffu), __NV_E4M3);
  return __half22float2(__half2(pair));
}
// The same times scale.
__device__ __forceinline__ float2 e4m3x2_to_float2(uint32_t w, float scale) {
  const float2 f = e4m3x2_to_float2(w);
  return make_float2(f.x * scale, f.y * scale);
}

// 16 e4m3 bytes (one uint4) as fp32, unscaled: the block's power of two is applied to the sums and to the decay
// instead (the same values in the normal range), once per column rather than once per element.
__device__ __forceinline__ void unpack_e4m3x16(const uint4& raw, float (&x)[16]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float2 f = e4m3x2_to_float2(w[i] >> (16 * h));
      x[4 * i + 2 * h] = f.x, x[4 * i + 2 * h + 1] = f.y;
    }
}

// The scale of a block kept as w x whose largest |x| is m: from w max(m, 2^-120), so that w 2^-s stays finite where x
// is zero or tiny beside w (a block of zero codes under a large scale then takes the scale w 2^-127, not the smallest;
// any nonzero code is at least 2^-9, so no other block's scale changes).
__device__ __forceinline__ Fp8Scale e4m3_factored_scale(float w, float m) {
  return e4m3_block_scale(__float_as_uint(max_abs_nan(w * m, w * 0x1p-120f)));
}

// A 32-element block held by 32 / N lanes (l, l ^ kPartner, l ^ 2 kPartner, ...), N values x w each (w > 0, the same
// on every lane of the block), to e4m3 words, the first value in the low byte of words[0], and its E8M0 scale byte:
// the scale by e4m3_factored_scale, each element through x (w 2^-s), the NaN scale's factor NaN (every element its
// NaN code).
template <int N, int kPartner>
__device__ __forceinline__ void quantize_e4m3_factored(const float (&x)[N], float w, uint32_t (&words)[N / 4],
                                                       uint32_t& scale_byte) {
  float m = max_abs_nan_tree<N>(x);
#pragma unroll
  for (int off = kPartner; off < kPartner * (kFp8Block / N); off *= 2)
    m = max_abs_nan(m, __shfl_xor_sync(0xffffffffu, m, off));
  const Fp8Scale sc = e4m3_factored_scale(w, m);
  scale_byte = sc.byte;
  const float f = sc.byte == 255u ? e4m3_nan_factor() : w * sc.inv;
#pragma unroll
  for (int i = 0; i < N / 4; ++i) words[i] = e4m3x4_by_factor(x[4 * i], x[4 * i + 1], x[4 * i + 2], x[4 * i + 3], f);
}

template <int kPartner, bool kFactored = false>
__device__ __forceinline__ uint4 quantize_e4m3x16(const float (&x)[16], uint32_t& scale_byte, float w = 1.0f) {
  if constexpr (kFactored) {
    uint32_t out[4];
    quantize_e4m3_factored<16, kPartner>(x, w, out, scale_byte);
    return make_uint4(out[0], out[1], out[2], out[3]);
  } else {
    const float own = max_abs_nan16(x);
    const float m = max_abs_nan(own, __shfl_xor_sync(0xffffffffu, own, kPartner));
    const Fp8Scale sc = e4m3_block_scale(__float_as_uint(m));
    scale_byte = sc.byte;
    uint32_t out[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = e4m3x4(x[4 * i], x[4 * i + 1], x[4 * i + 2], x[4 * i + 3], sc);
    return make_uint4(out[0], out[1], out[2], out[3]);
  }
}

// kRuns 32-element blocks, each held by a lane pair (l, l ^ kPartner) as 16 values times w > 0 (the same on both
// lanes), as quantize_e4m3x16<kPartner, true> quantizes each, and rescaled in place: x becomes x w 2^-s, the values
// the bytes round, and w becomes 2^s (under the NaN scale: x w and w = 1, the bytes all NaN codes; the scale by
// e4m3_factored_scale). Phase by phase over the runs, so that their dependent chains overlap (the fp8 chain kernels'
// cache stores).
template <int kRuns, int kPartner>
__device__ __forceinline__ void quantize_e4m3_runs_rescale(float (&x)[kRuns][16], float (&w)[kRuns],
                                                           uint4 (&bytes)[kRuns], uint32_t (&scale_byte)[kRuns]) {
  float m[kRuns];
#pragma unroll
  for (int i = 0; i < kRuns; ++i) m[i] = max_abs_nan16(x[i]);
#pragma unroll
  for (int i = 0; i < kRuns; ++i) m[i] = max_abs_nan(m[i], __shfl_xor_sync(0xffffffffu, m[i], kPartner));
#pragma unroll
  for (int i = 0; i < kRuns; ++i) {
    const Fp8Scale sc = e4m3_factored_scale(w[i], m[i]);
    scale_byte[i] = sc.byte;
    const bool nan = sc.byte == 255u;
    const float f = nan ? w[i] : w[i] * sc.inv;
    w[i] = nan ? 1.0f : e8m0_scale(sc.byte);
    uint32_t out[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
#pragma unroll
      for (int e = 0; e < 4; ++e) x[i][4 * q + e] *= f;
      const uint32_t b = e4m3x4_by_factor(x[i][4 * q], x[i][4 * q + 1], x[i][4 * q + 2], x[i][4 * q + 3], 1.0f);
      out[q] = nan ? 0x7f7f7f7fu : b;
    }
    bytes[i] = make_uint4(out[0], out[1], out[2], out[3]);
  }
}

}  // namespace gdnkit::cuda
