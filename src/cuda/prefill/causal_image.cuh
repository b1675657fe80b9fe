// The causal image of a 64 x 64 chunk-causal matrix X (X[i][j] = 0 for j > i: T', M): the layout in which the
// chunk prep writes X to the workspace for the wgmma head pass, and in which that pass copies it to shared memory
// in one piece and reads it as the two B operands of causal_cols_wgmma (docs/design/prefill.md "T' and M as
// causal images"). X's upper-right quarter (rows 0..31, columns 32..63: all zero, never read) is left out:
// rows 0..31, columns 0..31 first, 64B-swizzled (2 KB, SBO 512); then rows 32..63, all 64 columns, 128B-swizzled
// (4 KB, SBO 1024). So T' and M move 6 of their 8 KB per chunk and head.
#pragma once

#include <cstdint>

#include "cuda/arch/mma_sync.cuh"
#include "cuda/arch/wgmma.cuh"

namespace gdnkit::cuda::chunked_prefill {

constexpr int kCausalImageElems = 32 * 32 + 32 * 64;
constexpr int kCausalImageLow = 32 * 32;  // elements before the second part (2 KB: 1024-byte aligned)

// Element offset of X[i][j] in the image.
__device__ __forceinline__ int causal_image_offset(int i, int j) {
  if (i < 32) return i * 32 + ((((j >> 3) & 3) ^ ((i >> 1) & 3)) << 3) + (j & 7);
  return kCausalImageLow + sw128_offset<32>(i - 32, j);
}

// Where a warp's C fragments of X go in the image: rows i = 16 warp + r + 8 half (r = lane / 4), element
// (i, 8 nt + 2 (lane % 4)) at at[half] + ((nt ^ swz) << 3), as the swizzle of row i is (i / 2) % 4 in rows 0..31
// (warps 0, 1: only nt < 4 is in the image) and i % 8 in rows 32..63. Constant offsets per tile, no address
// arithmetic per element.
struct ImageRows {
  int at[2];
  int swz;
};
__device__ __forceinline__ ImageRows image_rows(int warp, int lane) {
  const int r = lane >> 2, q2 = (lane & 3) * 2;
  ImageRows x;
  x.swz = warp < 2 ? (r >> 1) & 3 : r;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int i = warp * 16 + r + half * 8;
    x.at[half] = (warp < 2 ? i * 32 : kCausalImageLow + (i - 32) * 64) + q2;
  }
  return x;
}

// The two K-major descriptors of X's token halves as causal_cols_wgmma reads them: `lo` for rows 0..31
// (k-steps 0, 1), `hi` for rows 32..63 (all four).
struct CausalDescs {
  uint64_t lo, hi;
};
// ... of an image in shared memory.
__device__ __forceinline__ CausalDescs causal_image_descs(const void* image) {
  const uint32_t at = smem_addr(image);
  return {sw64_desc(at, 16, 512), sw128_desc(at + 2 * kCausalImageLow, 16, 1024)};
}
// ... of a whole 64 x 64 X, 128B-swizzled (M formed in the head pass).
__device__ __forceinline__ CausalDescs full_causal_descs(const void* x) {
  const uint64_t d = sw128_desc(smem_addr(x), 16, 1024);
  return {d, desc_add(d, 32 * 128)};
}

}  // namespace gdnkit::cuda::chunked_prefill
