// Warp-level tensor-core primitives shared by the prefill and recurrent kernels: ldmatrix/stmatrix and
// mma.sync m16n8k16 (bf16 or fp16 operands -- the "Op" type -- with fp32 accumulation), and packing.
// Fragment layouts follow the PTX ISA:
//   A (16x16, row-major):  a[0]=A[r][c..c+1] a[1]=A[r+8][c..] a[2]=A[r][c+8..] a[3]=A[r+8][c+8..]
//   B (16x8, "col-major"): b[0]=B[c..c+1][n] b[1]=B[c+8..c+9][n]
//   C (16x8):              c[0..1]=C[r][2q..2q+1]  c[2..3]=C[r+8][2q..2q+1]
// with r = lane/4, q = lane%4, c = 2q, n = lane/4.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace gdnkit::cuda {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes of shared memory in one ld.shared.v4 (a uint4 read through a reference can be split into four
// 32-bit loads by the compiler).
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

// Four 8x8 bf16 matrices; lane l supplies the row address of matrix l/8, row l%8 (a shared-memory
// address, or a pointer).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) { ldmatrix_x4(r, smem_addr(p)); }
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) { ldmatrix_x4_trans(r, smem_addr(p)); }
// The inverse of ldmatrix_x4: lane l's fragments of four 8x8 matrices, row l%8 of matrix l/8 at the
// address lane l supplies.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "r"(r[0]), "r"(r[1]),
               "r"(r[2]), "r"(r[3])
               : "memory");
}
// The inverse of ldmatrix_x4_trans: lane l's fragments of four 8x8 matrices are stored transposed, row
// l%8 of matrix l/8 at the address lane l supplies.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// c += a * b  (m16n8k16, Op x Op -> fp32)
template <class Op>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<Op, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// c += a * b  (m16n8k8, tf32 x tf32 -> fp32): a[0]=A[r][q] a[1]=A[r+8][q] a[2]=A[r][q+4] a[3]=A[r+8][q+4],
// b0=B[q][n] b1=B[q+4][n] (q = lane%4). Operands are fp32 bit patterns; the tensor cores read their top 19
// bits (sign, exponent, 10 mantissa bits).
__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c += a * b  (m16n8k4, tf32 x tf32 -> fp32): a[0]=A[r][q] a[1]=A[r+8][q], b=B[q][n].
__device__ __forceinline__ void mma_tf32_k4(float (&c)[4], const uint32_t (&a)[2], uint32_t b) {
  asm volatile(
      "mma.sync.aligned.m16n8k4.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(b));
}

// Two floats rounded to a packed Op pair (lo in the low half).
template <class Op>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<Op, __half>) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) { return pack2<__nv_bfloat16>(lo, hi); }

template <class Op>
__device__ __forceinline__ float2 unpack2(uint32_t u) {
  if constexpr (std::is_same_v<Op, __half>) {
    return __half22float2(*reinterpret_cast<const __half2*>(&u));
  } else {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u));
  }
}

// x, y as two packed Op pairs, hi = Op(x) and lo = Op(x - hi): x = hi.x + lo.x to about twice Op's bits.
template <class Op>
__device__ __forceinline__ void split2(float x, float y, uint32_t& hi, uint32_t& lo) {
  hi = pack2<Op>(x, y);
  const float2 h = unpack2<Op>(hi);
  lo = pack2<Op>(x - h.x, y - h.y);
}

template <class Op>
__device__ __forceinline__ Op to_op(float x) {
  if constexpr (std::is_same_v<Op, __half>)
    return __float2half_rn(x);
  else
    return __float2bfloat16_rn(x);
}

// 2^x, one MUFU instruction (relative error ~2^-22; results below 2^-126 flush to 0).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace gdnkit::cuda
