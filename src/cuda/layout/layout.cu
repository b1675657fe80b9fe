// CUDA pool layout conversion K-last <-> V-last: a tiled transpose of every (slot, head) block.
// Out of place: tile (r, c) of the source [R, C] goes, transposed through shared memory, to tile
// (c, r) of the destination [C, R]. In place (same buffer, K == V): one CTA swaps the tile pair
// (r, c) / (c, r) with r <= c, both read before either is written. Bits are moved, not converted, but for
// float8_e4m3 pools, whose blocks of 32 run along the other axis in the other layout: they are requantized.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "cuda/arch/fp8.cuh"
#include "cuda/backend.h"
#include "cuda/host/check.h"

namespace gdnkit::cuda {
namespace {

constexpr int kTile = 32;
constexpr int kRowsPerPass = 8;  // a CTA is kTile x kRowsPerPass threads

// Work item w of the grid-stride loop -> its slot, head and tile (row tr, column tc of tiles); in place, the tiles of
// the upper triangle (tr <= tc), row by row.
struct TileAt {
  int64_t slot;
  int head, tr, tc;
};
template <bool kInPlace>
__device__ __forceinline__ TileAt tile_at(int64_t w, int heads, int64_t tiles, int tr_n, int tc_n) {
  TileAt at;
  at.slot = w / (heads * tiles);
  at.head = int((w / tiles) % heads);
  int64_t t = w % tiles;
  if (kInPlace) {
    at.tr = 0;
    while (t >= tr_n - at.tr) t -= tr_n - at.tr, ++at.tr;
    at.tc = at.tr + int(t);
  } else {
    at.tr = int(t / tc_n), at.tc = int(t % tc_n);
  }
  return at;
}

// Grid-stride over (slot, head, tile) so any pool size fits the grid; offsets are int64.
template <class E, bool kInPlace>
__global__ void __launch_bounds__(kTile* kRowsPerPass)
    transpose_kernel(const E* src, E* dst, int64_t src_stride, int64_t dst_stride, int64_t slots, int heads,
                     int R, int C) {
  __shared__ E a[kTile][kTile + 1];
  __shared__ E bt[kInPlace ? kTile : 1][kTile + 1];
  const int tr_n = R / kTile, tc_n = C / kTile;
  // In place: the upper-triangular tile pairs (r <= c) only.
  const int64_t tiles = kInPlace ? int64_t(tr_n) * (tr_n + 1) / 2 : int64_t(tr_n) * tc_n;
  const int64_t total = slots * heads * tiles;
  const int x = threadIdx.x, y = threadIdx.y;
  const int64_t head_elems = int64_t(R) * C;
  for (int64_t w = blockIdx.x; w < total; w += gridDim.x) {
    const auto [slot, head, tr, tc] = tile_at<kInPlace>(w, heads, tiles, tr_n, tc_n);
    const E* s = src + slot * src_stride + head * head_elems;
    E* d = dst + slot * dst_stride + head * head_elems;
    // source [R, C] -> destination [C, R]
    for (int i = y; i < kTile; i += kRowsPerPass) {
      a[i][x] = s[int64_t(tr * kTile + i) * C + tc * kTile + x];
      if (kInPlace) bt[i][x] = s[int64_t(tc * kTile + i) * C + tr * kTile + x];
    }
    __syncthreads();
    for (int i = y; i < kTile; i += kRowsPerPass) {
      d[int64_t(tc * kTile + i) * R + tr * kTile + x] = a[x][i];
      if (kInPlace) d[int64_t(tr * kTile + i) * R + tc * kTile + x] = bt[x][i];
    }
    __syncthreads();
  }
}

// float8_e4m3 pools (docs/semantics.md "float8_e4m3 states"): a tile's row of 32 is one scale block in either
// layout (tiles start at multiples of 32), so the tile is dequantized by its source rows' scales (exact in fp32)
// and each transposed row requantized by one warp (threadIdx.y: 32 lanes, the warp's largest magnitude the block's),
// as the host's quantize_e4m3_block: the CPU backend's bytes. Scales: [slot, head, row, column block].
template <bool kInPlace>
__global__ void __launch_bounds__(kTile* kRowsPerPass)
    transpose_e4m3_kernel(const uint8_t* src, uint8_t* dst, const uint8_t* src_scales, uint8_t* dst_scales,
                          int64_t src_stride, int64_t dst_stride, int64_t slots, int heads, int R, int C) {
  static_assert(kTile == kFp8Block, "a tile row is one scale block");
  __shared__ float a[kTile][kTile + 1];
  __shared__ float bt[kInPlace ? kTile : 1][kTile + 1];
  const int tr_n = R / kTile, tc_n = C / kTile;
  const int64_t tiles = kInPlace ? int64_t(tr_n) * (tr_n + 1) / 2 : int64_t(tr_n) * tc_n;
  const int64_t total = slots * heads * tiles;
  const int x = threadIdx.x, y = threadIdx.y;
  const int64_t head_elems = int64_t(R) * C, head_blocks = head_elems / kFp8Block;
  const auto store_row = [&](uint8_t* d, uint8_t* ds, int row, int block, float value) {  // destination [C, R]
    uint32_t m = abs_bits(value);
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, off));
    const Fp8Scale sc = e4m3_block_scale(m);
    d[int64_t(row) * R + block * kTile + x] = uint8_t(e4m3x1(value, sc));
    if (x == 0) ds[int64_t(row) * (R / kTile) + block] = uint8_t(sc.byte);
  };
  for (int64_t w = blockIdx.x; w < total; w += gridDim.x) {
    const auto [slot, head, tr, tc] = tile_at<kInPlace>(w, heads, tiles, tr_n, tc_n);
    const uint8_t* s = src + slot * src_stride + head * head_elems;
    const uint8_t* ss = src_scales + (slot * heads + head) * head_blocks;
    uint8_t* d = dst + slot * dst_stride + head * head_elems;
    uint8_t* ds = dst_scales + (slot * heads + head) * head_blocks;
    for (int i = y; i < kTile; i += kRowsPerPass) {  // source [R, C], scales [R, C / 32]
      const int64_t ra = tr * kTile + i;
      a[i][x] = e4m3_to_float(s[ra * C + tc * kTile + x], e8m0_scale(ss[ra * tc_n + tc]));
      if (kInPlace) {
        const int64_t rb = tc * kTile + i;
        bt[i][x] = e4m3_to_float(s[rb * C + tr * kTile + x], e8m0_scale(ss[rb * tc_n + tr]));
      }
    }
    __syncthreads();
    for (int i = y; i < kTile; i += kRowsPerPass) {
      store_row(d, ds, tc * kTile + i, tr, a[x][i]);
      if (kInPlace) store_row(d, ds, tr * kTile + i, tc, bt[x][i]);
    }
    __syncthreads();
  }
}

constexpr int kCtasPerSm = 16;

template <class E>
void launch_transpose(const LayoutParams& p, bool in_place, Stream stream) {
  // Source rows: K-last [V, K], V-last [K, V].
  const int R = p.src.layout == StateLayout::kKLast ? p.head_dim_v : p.head_dim_k;
  const int C = p.src.layout == StateLayout::kKLast ? p.head_dim_k : p.head_dim_v;
  const int64_t tiles = in_place ? int64_t(R / kTile) * (R / kTile + 1) / 2 : int64_t(R / kTile) * (C / kTile);
  const int64_t total = p.src.num_slots * p.num_v_heads * tiles;
  if (total == 0) return;
  // A grid-stride loop over the tiles: kCtasPerSm CTAs per SM keep every SM busy without a CTA per tile.
  const int64_t max_ctas = int64_t(device_sms()) * kCtasPerSm;
  const unsigned grid = unsigned(total < max_ctas ? total : max_ctas);
  const dim3 block(kTile, kRowsPerPass);
  const E* src = static_cast<const E*>(p.src.data);
  E* dst = static_cast<E*>(p.dst.data);
  if constexpr (std::is_same_v<E, uint8_t>) {  // float8_e4m3: requantized into the other layout's blocks
    if (in_place)
      transpose_e4m3_kernel<true><<<grid, block, 0, stream>>>(src, dst, p.src.scales, p.dst.scales, p.src.slot_stride,
                                                             p.dst.slot_stride, p.src.num_slots, p.num_v_heads, R, C);
    else
      transpose_e4m3_kernel<false><<<grid, block, 0, stream>>>(src, dst, p.src.scales, p.dst.scales,
                                                              p.src.slot_stride, p.dst.slot_stride, p.src.num_slots,
                                                              p.num_v_heads, R, C);
    GDNKIT_CUDA_CHECK_LAUNCH();
    return;
  }
  if (in_place)
    transpose_kernel<E, true><<<grid, block, 0, stream>>>(src, dst, p.src.slot_stride, p.dst.slot_stride,
                                                          p.src.num_slots, p.num_v_heads, R, C);
  else
    transpose_kernel<E, false><<<grid, block, 0, stream>>>(src, dst, p.src.slot_stride, p.dst.slot_stride,
                                                           p.src.num_slots, p.num_v_heads, R, C);
  GDNKIT_CUDA_CHECK_LAUNCH();
}

}  // namespace

void convert_layout(const LayoutParams& p, Stream stream) {
  const bool in_place = p.src.data == p.dst.data;
  if (in_place && (p.head_dim_k != p.head_dim_v || p.src.slot_stride != p.dst.slot_stride))
    throw Error(ErrorCode::kInvalidArgument,
                "dst: in-place layout conversion needs K == V and equal slot strides (K=" +
                    std::to_string(p.head_dim_k) + ", V=" + std::to_string(p.head_dim_v) + ", slot strides " +
                    std::to_string(p.src.slot_stride) + " and " + std::to_string(p.dst.slot_stride) + ")");
  if (p.head_dim_k % kTile != 0 || p.head_dim_v % kTile != 0)
    throw Error(ErrorCode::kNotImplemented, "cuda convert_layout: K and V must be multiples of 32, got K=" +
                                                std::to_string(p.head_dim_k) + ", V=" + std::to_string(p.head_dim_v));
  if (p.src.dtype == DType::kFloat8E4M3) return launch_transpose<uint8_t>(p, in_place, stream);
  switch (dtype_size(p.src.dtype)) {  // bits move unchanged: only the element size matters
    case 4: return launch_transpose<uint32_t>(p, in_place, stream);
    case 2: return launch_transpose<uint16_t>(p, in_place, stream);
    default:
      throw Error(ErrorCode::kInvalidArgument,
                  std::string("src: expected dtype float32, bfloat16 or float16, got ") + dtype_name(p.src.dtype));
  }
}

}  // namespace gdnkit::cuda
