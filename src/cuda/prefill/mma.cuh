// The prefill kernels' block products on tensor cores, over the mma.sync primitives and fragment layouts
// of cuda/arch/mma_sync.cuh and the wgmma ones of cuda/arch/wgmma.cuh.
#pragma once

#include "cuda/arch/mma_sync.cuh"
#include "cuda/arch/wgmma.cuh"
#include "cuda/prefill/heuristics.h"

namespace gdnkit::cuda::chunked_prefill {

// C fragments of a 16x16 block (two n8 tiles) as the A fragment of the same block.
__device__ __forceinline__ void c_to_a_half(const float (&c)[2][4], uint32_t (&a)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = pack2<__half>(c[i >> 1][(i & 1) * 2], c[i >> 1][(i & 1) * 2 + 1]);
}
// Address of lane's row for an A fragment (16x16 at (row0, col0)) of a row-major bf16 tile
// with `ld` elements per row: matrices (rows 0-7, 8-15) x (cols 0-7, 8-15).
template <int LD, class T>
__device__ __forceinline__ const T* a_frag_ptr(const T* tile, int row0, int col0, int lane) {
  return tile + (row0 + (lane & 15)) * LD + col0 + (lane >> 4) * 8;
}
// A fragment of A = X^T where X (16 kdim-rows x 16 m-cols at (k0, m0)) is stored row-major: use .trans.
template <int LD, class T>
__device__ __forceinline__ const T* at_frag_ptr(const T* tile, int k0, int m0, int lane) {
  return tile + (k0 + ((lane >> 4) << 3) + (lane & 7)) * LD + m0 + ((lane >> 3) & 1) * 8;
}
// B fragments of two n-tiles (n0..n0+15) for B stored as [n][k] (k contiguous): non-trans ldmatrix.
// r[0],r[1]: n-tile n0; r[2],r[3]: n-tile n0+8.
template <int LD, class T>
__device__ __forceinline__ const T* bn_frag_ptr(const T* tile, int n0, int k0, int lane) {
  return tile + (n0 + ((lane >> 4) << 3) + (lane & 7)) * LD + k0 + ((lane >> 3) & 1) * 8;
}
// B fragments of two n-tiles for B stored as [k][n] (n contiguous): .trans ldmatrix.
template <int LD, class T>
__device__ __forceinline__ const T* bk_frag_ptr(const T* tile, int k0, int n0, int lane) {
  return tile + (k0 + (lane & 15)) * LD + n0 + (lane >> 4) * 8;
}

// acc (16 token rows of this warp x NT*8 columns) += A[warp rows][0:64] B[0:64][cols] for a chunk-causal
// A (lower triangular in 16 x 16 tiles: k-tiles 0..warp only): A row-major [64][LDA] (T' or M), B
// row-major [64][LDB] over the value columns (X or v_new).
template <class Op, int LDA, int LDB, int NT, class T>
__device__ __forceinline__ void causal_rows_mma(float (&acc)[NT][4], const T* a, const T* b, int warp, int lane) {
#pragma unroll
  for (int kt = 0; kt < 4; ++kt) {
    if (kt > warp) continue;
    uint32_t af[4];
    ldmatrix_x4(af, a_frag_ptr<LDA>(a, warp * 16, kt * 16, lane));
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t bf[4];
      ldmatrix_x4_trans(bf, bk_frag_ptr<LDB>(b, kt * 16, np * 16, lane));
      mma<Op>(acc[2 * np], af, bf[0], bf[1]);
      mma<Op>(acc[2 * np + 1], af, bf[2], bf[3]);
    }
  }
}

// The A fragment of a 16x16 block from the C fragments of its two n8 tiles (the layouts agree), in Op.
template <class Op>
__device__ __forceinline__ void c_to_a(const float (&c0)[4], const float (&c1)[4], uint32_t (&a)[4]) {
  a[0] = pack2<Op>(c0[0], c0[1]);
  a[1] = pack2<Op>(c0[2], c0[3]);
  a[2] = pack2<Op>(c1[0], c1[1]);
  a[3] = pack2<Op>(c1[2], c1[3]);
}

// acc (16 rows x 64 token columns: 8 n8 tiles) += A B^T for A = 16 x 64 given as four k-step fragments
// and B a chunk-causal 64 x 64 matrix (B[n][k] = 0 for k > n) stored as rows [n][k] with LD elements per
// row, read by ldmatrix from `base` (this lane's bn_frag_ptr offset in shared memory): token-tile pair np
// needs k-steps 0..np. Unless kFull, tile pairs at or past the chunk's length L are skipped.
template <class Op, int LD, bool kFull>
__device__ __forceinline__ void causal_cols_mma(float (&acc)[8][4], const uint32_t (&a)[4][4], uint32_t base, int L) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
#pragma unroll
    for (int np = ks; np < 4; ++np) {
      if (!kFull && np * 16 >= L) continue;
      uint32_t b[4];
      ldmatrix_x4(b, base + uint32_t(np * 16 * LD + ks * 16) * 2);
      mma<Op>(acc[2 * np], a[ks], b[0], b[1]);
      mma<Op>(acc[2 * np + 1], a[ks], b[2], b[3]);
    }
}

// acc = q k^T (64 x 64, fp32) of a chunk's rows (descriptors dq, dk: 128B-swizzled, sw128_offset<kChunk>), and with
// kTwo acc2 = q2 k^T beside it, asynchronous (one committed group; both accumulators zeroed before the first issue, so
// that ptxas waits for neither product before the other); k k^T with dq = dk.
template <int K, class Op, bool kTwo>
__device__ __forceinline__ void issue_qk_products(float (&acc)[8][4], uint64_t dq, float (&acc2)[8][4], uint64_t dq2,
                                                  uint64_t dk) {
  constexpr uint32_t kBlock = kChunk * 128;  // a 64-column block of the k / q rows
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      acc[nt][e] = 0.0f;
      if constexpr (kTwo) acc2[nt][e] = 0.0f;
    }
  wgmma_pin(acc);
  if constexpr (kTwo) wgmma_pin(acc2);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    const uint32_t koff = (kk / 4) * kBlock + (kk % 4) * 32;
    wgmma_ss<Op, 64, 0>(acc, desc_add(dq, koff), desc_add(dk, koff));
    if constexpr (kTwo) wgmma_ss<Op, 64, 0>(acc2, desc_add(dq2, koff), desc_add(dk, koff));
  }
  wgmma_commit();
}
template <int K, class Op>
__device__ __forceinline__ void issue_qk_product(float (&acc)[8][4], uint64_t dq, uint64_t dk) {
  issue_qk_products<K, Op, false>(acc, dq, acc, 0, dk);
}

}  // namespace gdnkit::cuda::chunked_prefill
