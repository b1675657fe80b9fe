// Host-side conversions between float and the storage dtypes (no CUDA headers): for callers that prepare or
// read bf16/fp16/fp8 tensors on the host, the CPU backend and the tests.
// bf16 and fp16 stores round to nearest even, as the CUDA intrinsics __float2bfloat16_rn/__float2half_rn; e4m3
// stores round to nearest even and saturate to +-448, as cvt.rn.satfinite.e4m3x2.f32.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "gdnkit/types.h"

namespace gdnkit::host {

inline float bf16_to_float(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: renormalize
      exp = 127 - 15 + 1;
      while (!(man & 0x400u)) { man <<= 1; --exp; }
      u = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_fp16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t au = u & 0x7fffffffu;
  if (au > 0x7f800000u) return uint16_t(sign | 0x7e00u);  // NaN
  if (au >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // overflow (>= 65520) -> inf
  if (au < 0x38800000u) {  // subnormal or zero in fp16: value = m * 2^-24, round half to even
    float af;
    std::memcpy(&af, &au, 4);
    return uint16_t(sign | uint16_t(std::nearbyint(af * 16777216.0f)));
  }
  uint32_t r = au + 0xfffu + ((au >> 13) & 1u);  // round to nearest even on the 13 dropped bits
  return uint16_t(sign | uint16_t((r - (112u << 23)) >> 13));
}

inline float e4m3_to_float(uint8_t b) {
  const int exp = (b >> 3) & 0xf, man = b & 7;
  const float sign = b & 0x80 ? -1.0f : 1.0f;
  if ((b & 0x7f) == 0x7f) return std::nanf("");
  if (exp == 0) return sign * std::ldexp(float(man), -9);
  return sign * std::ldexp(float(8 + man), exp - 10);
}

inline uint8_t float_to_e4m3(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  const uint32_t au = u & 0x7fffffffu;
  if (au > 0x7f800000u) return uint8_t(sign | 0x7fu);  // NaN
  float af;
  std::memcpy(&af, &au, 4);
  if (af < 0.015625f) return uint8_t(sign | uint8_t(std::nearbyint(af * 512.0f)));  // subnormal: m * 2^-9
  const uint32_t r = au + 0x7ffffu + ((au >> 20) & 1u);  // round to nearest even on the 20 dropped bits
  const uint32_t code = (((r >> 23) - 120u) << 3) | ((r >> 20) & 7u);
  return uint8_t(sign | (code > 0x7eu ? 0x7eu : code));  // saturate to 448 (infinities too)
}

inline float e8m0_to_float(uint8_t e) { return e == 0xff ? std::nanf("") : std::ldexp(1.0f, int(e) - 127); }

// One block of n floats to e4m3 with its E8M0 scale (types.h kFp8Block). The scale is 2^s with s = e - 7, e the
// exponent of amax rounded to e4m3's 4 significant bits, so that the block's largest element lands on a code in
// [128, 240]: nothing saturates, and quantizing a quantized block again gives the same bytes. Each element is
// x 2^-s rounded to nearest even. A block holding NaN or an infinity gets the NaN scale (it reads back as NaN).
inline uint8_t quantize_e4m3_block(const float* x, int n, uint8_t* q) {
  float amax = 0.0f;
  bool finite = true;
  for (int i = 0; i < n; ++i) {
    finite = finite && std::isfinite(x[i]);
    amax = std::fmax(amax, std::fabs(x[i]));
  }
  if (!finite) {
    for (int i = 0; i < n; ++i) q[i] = 0x7f;
    return 0xff;
  }
  uint32_t u;
  std::memcpy(&u, &amax, 4);
  const int e = int((u + 0x7ffffu + ((u >> 20) & 1u)) >> 23) - 127;  // amax's exponent after rounding its mantissa
  const int s = e - 7 < -127 ? -127 : e - 7;
  for (int i = 0; i < n; ++i) q[i] = float_to_e4m3(std::ldexp(x[i], -s));
  return uint8_t(s + 127);
}

// Read element i of a buffer of the given float dtype as double (not float8_e4m3: its elements need their block's
// scale; the CPU backend reads such states whole).
inline double load(const void* base, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat32: return static_cast<const float*>(base)[i];
    case DType::kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kFloat16: return fp16_to_float(static_cast<const uint16_t*>(base)[i]);
    default: throw Error(ErrorCode::kInvalidArgument, "host::load: not a float dtype");
  }
}

// Store x (rounded to float first, then to the dtype) at element i.
inline void store(void* base, DType dtype, int64_t i, double x) {
  const float f = static_cast<float>(x);
  switch (dtype) {
    case DType::kFloat32: static_cast<float*>(base)[i] = f; return;
    case DType::kBFloat16: static_cast<uint16_t*>(base)[i] = float_to_bf16(f); return;
    case DType::kFloat16: static_cast<uint16_t*>(base)[i] = float_to_fp16(f); return;
    default: throw Error(ErrorCode::kInvalidArgument, "host::store: not a float dtype");
  }
}

}  // namespace gdnkit::host
