// Warpgroup-level tensor-core primitives (sm_90a wgmma): m64nNk16 with the A operand in registers
// (wgmma_rs) or in shared memory (wgmma_ss) and B read by the tensor cores from shared memory in the
// 128-byte swizzled layout, fp32 accumulation.
//
// Register fragments: warp w of the warpgroup holds rows 16w .. 16w+15 of A and of the accumulator, in
// exactly the layouts of mma.sync m16n8k16 (mma_sync.cuh): A as c_to_a packs it, the accumulator as N/8
// consecutive n8 C tiles. So a warp's mma.sync fragments become a warpgroup's wgmma fragments as they are.
//
// Shared memory (PTX ISA "Shared Memory Matrix Layout", 128B swizzle): a matrix of 16-bit elements is
// stored as blocks of 64 columns, each block rows x 128 bytes with row r's 16-byte pieces permuted by
// piece ^ (r % 8) (sw128_offset), blocks 1024-byte aligned. The same bytes serve two operand forms:
//   K-major B (B[k][n] = X[n][k], rows of X are the N index): SBO = 1024 (8 rows), a k-step of 16
//     columns adds 32 bytes inside a block, the next block is the next 64 columns;
//   MN-major B (B[k][n] = X[k][n], rows are the K index, transposed read): LBO = the block size (next 64
//     columns of N), SBO = 1024 (next 8 rows of K), a k-step of 16 rows adds 2048 bytes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace gdnkit::cuda {

// Element offset of (row, col) in a 128B-swizzled matrix of `rows` rows (see the header).
template <int kRows>
__device__ __forceinline__ int sw128_offset(int row, int col) {
  return ((col >> 6) * kRows + row) * 64 + ((((col >> 3) & 7) ^ (row & 7)) << 3) + (col & 7);
}

// Matrix descriptor of a 128B-swizzled operand at shared address `addr` (byte offsets lbo, sbo).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(lbo >> 4) << 16) | (uint64_t(sbo >> 4) << 32) | (1ull << 62);
}
// ... of a 64B-swizzled one (rows of 64 bytes, row r's 16-byte pieces permuted by piece ^ ((r / 2) % 4), blocks
// of 8 rows 512 bytes apart and 512-byte aligned): layout type 2 instead of 1.
__device__ __forceinline__ uint64_t sw64_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(lbo >> 4) << 16) | (uint64_t(sbo >> 4) << 32) | (2ull << 62);
}

// The descriptor of the operand `bytes` further on (16-byte aligned) from the one of `desc`: its address
// field is shared address / 16 in 14 bits, and shared addresses stay below 2^18 (228 KB), so the sum never
// carries out of the field. One add instead of forming each descriptor from its address.
__device__ __forceinline__ uint64_t desc_add(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Pins accumulator registers at this point of the program (the compiler may not move their reads or
// writes across it): after wgmma_wait, before the values are used, and before the wgmma that reads them.
template <int NT>
__device__ __forceinline__ void wgmma_pin(float (&d)[NT][4]) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}
// Generic-proxy writes to shared memory (cp.async, st.shared) visible to the tensor cores' reads.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

#define GDNKIT_D4(j) "+f"(d[J0 + j][0]), "+f"(d[J0 + j][1]), "+f"(d[J0 + j][2]), "+f"(d[J0 + j][3])
#define GDNKIT_WGMMA_N32(TYPE)                                                                       \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                                 \
               "wgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE "." TYPE " "                               \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "   \
               "{%16, %17, %18, %19}, %20, p, 1, 1, %21;\n}\n"                    \
               : GDNKIT_D4(0), GDNKIT_D4(1), GDNKIT_D4(2), GDNKIT_D4(3)                                                         \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(int(kTransB)))
// The same products with A from shared memory too (K-major, by descriptor; no transposes).
#define GDNKIT_WGMMA_SS_N32(TYPE)                                                                    \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                              \
               "wgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE "." TYPE " "                            \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "                  \
               "%16, %17, p, 1, 1, 0, 0;\n}\n"                                                           \
               : GDNKIT_D4(0), GDNKIT_D4(1), GDNKIT_D4(2), GDNKIT_D4(3)                                  \
               : "l"(desc_a), "l"(desc_b))
#define GDNKIT_WGMMA_SS_N64(TYPE)                                                                    \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                              \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " "                            \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, " \
               "%32, %33, p, 1, 1, 0, 0;\n}\n"                                                           \
               : GDNKIT_D4(0), GDNKIT_D4(1), GDNKIT_D4(2), GDNKIT_D4(3), GDNKIT_D4(4), GDNKIT_D4(5), GDNKIT_D4(6), GDNKIT_D4(7) \
               : "l"(desc_a), "l"(desc_b))
#define GDNKIT_WGMMA_N64(TYPE)                                                                       \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                                 \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " "                               \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "   \
               "{%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"                    \
               : GDNKIT_D4(0), GDNKIT_D4(1), GDNKIT_D4(2), GDNKIT_D4(3), GDNKIT_D4(4), GDNKIT_D4(5), GDNKIT_D4(6), GDNKIT_D4(7)                                                         \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(int(kTransB)))
#define GDNKIT_WGMMA_N128(TYPE)                                                                       \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                                 \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " "                               \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "   \
               "{%64, %65, %66, %67}, %68, p, 1, 1, %69;\n}\n"                    \
               : GDNKIT_D4(0), GDNKIT_D4(1), GDNKIT_D4(2), GDNKIT_D4(3), GDNKIT_D4(4), GDNKIT_D4(5), GDNKIT_D4(6), GDNKIT_D4(7), GDNKIT_D4(8), GDNKIT_D4(9), GDNKIT_D4(10), GDNKIT_D4(11), GDNKIT_D4(12), GDNKIT_D4(13), GDNKIT_D4(14), GDNKIT_D4(15)                                                         \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(int(kTransB)))


// d[J0 .. J0 + N/8 - 1] += A B: A (64 x 16, this thread's fragment a), B (16 x N) by descriptor,
// transposed (MN-major) when kTransB. Asynchronous: the caller fences, commits and waits.
template <class Op, int N, int J0, bool kTransB, int NT>
__device__ __forceinline__ void wgmma_rs(float (&d)[NT][4], const uint32_t (&a)[4], uint64_t desc) {
  static_assert(J0 + N / 8 <= NT, "accumulator tiles out of range");
  constexpr bool kHalf = std::is_same_v<Op, __half>;
  if constexpr (N == 32) {
    if constexpr (kHalf) GDNKIT_WGMMA_N32("f16"); else GDNKIT_WGMMA_N32("bf16");
  } else if constexpr (N == 64) {
    if constexpr (kHalf) GDNKIT_WGMMA_N64("f16"); else GDNKIT_WGMMA_N64("bf16");
  } else {
    static_assert(N == 128, "wgmma_rs: N in {32, 64, 128}");
    if constexpr (kHalf) GDNKIT_WGMMA_N128("f16"); else GDNKIT_WGMMA_N128("bf16");
  }
}

// d[J0 .. J0 + N/8 - 1] += A B: A (64 x 16) and B (16 x N) both K-major in shared memory, by descriptor.
template <class Op, int N, int J0, int NT>
__device__ __forceinline__ void wgmma_ss(float (&d)[NT][4], uint64_t desc_a, uint64_t desc_b) {
  static_assert(J0 + N / 8 <= NT, "accumulator tiles out of range");
  constexpr bool kHalf = std::is_same_v<Op, __half>;
  if constexpr (N == 32) {
    if constexpr (kHalf) GDNKIT_WGMMA_SS_N32("f16"); else GDNKIT_WGMMA_SS_N32("bf16");
  } else {
    static_assert(N == 64, "wgmma_ss: N in {32, 64}");
    if constexpr (kHalf) GDNKIT_WGMMA_SS_N64("f16"); else GDNKIT_WGMMA_SS_N64("bf16");
  }
}

#undef GDNKIT_D4
#undef GDNKIT_WGMMA_SS_N32
#undef GDNKIT_WGMMA_SS_N64
#undef GDNKIT_WGMMA_N32
#undef GDNKIT_WGMMA_N64
#undef GDNKIT_WGMMA_N128

}  // namespace gdnkit::cuda
