// Staged states (staged_states.h): a head's K x V block copied between the caller's buffer (any layout and state dtype,
// float8_e4m3 with its block scales) and a K-last fp32 copy, through 32 x 32 tiles in shared memory, so that reads and
// writes run along each side's contiguous axis and a destination block of 32 is one warp's row of the tile.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda/arch/dtype.cuh"
#include "cuda/arch/fp8.cuh"
#include "cuda/backend.h"
#include "cuda/host/check.h"
#include "cuda/prefill/heuristics.h"
#include "cuda/prefill/io.cuh"
#include "cuda/prefill/staged_states.h"

namespace gdnkit::cuda::chunked_prefill {
namespace {

constexpr int kTile = 32;      // a tile row is one float8_e4m3 block
constexpr int kTileRows = 8;   // a CTA is kTile x kTileRows threads
constexpr int kCtasPerSm = 8;  // the grid: CTAs per SM, walking the items


// One head's K x V block: element (k, v) at `elems` + its layout offset; float8_e4m3: the block scale of element i at
// scales[i / 32].
struct HeadBlock {
  void* elems;
  uint8_t* scales;
  DType dtype;
  StateLayout layout;
};

// Element i (< K V: 32-bit offsets inside the head) of a head of element type E as fp32, and back (rounded to nearest
// even; float8_e4m3 by 32-element blocks, lane x of the warp holding element i of one: the block's scale from lane 0,
// as the host's quantize_e4m3_block rounds).
template <class E>
__device__ __forceinline__ float load_elem(const HeadBlock& b, int i) {
  const E e = static_cast<const E*>(b.elems)[i];
  if constexpr (std::is_same_v<E, uint8_t>) return e4m3_to_float(e, e8m0_scale(b.scales[i / kFp8Block]));
  else return to_float(e);
}
template <class E>
__device__ __forceinline__ void store_elem(const HeadBlock& b, int i, float x) {
  if constexpr (std::is_same_v<E, uint8_t>) {
    const Fp8Scale sc = e4m3_block_scale(__reduce_max_sync(0xffffffffu, abs_bits(x)));
    static_cast<uint8_t*>(b.elems)[i] = uint8_t(e4m3x1(x, sc));
    if (threadIdx.x == 0) b.scales[i / kFp8Block] = uint8_t(sc.byte);
  } else {
    static_cast<E*>(b.elems)[i] = from_float<E>(x);
  }
}

// The element (k0 + tk, v0 + tv) of the tile that row r of thread (x, y) takes: lanes along the side's contiguous axis.
struct TileAt {
  int tk, tv, offset;
};
__device__ __forceinline__ TileAt tile_at(StateLayout layout, int r, int k0, int v0, int K, int V) {
  const int x = threadIdx.x, i = threadIdx.y + r * kTileRows;
  const bool klast = layout == StateLayout::kKLast;
  const int tk = klast ? x : i, tv = klast ? i : x;
  return {tk, tv, klast ? (v0 + tv) * K + k0 + tk : (k0 + tk) * V + v0 + tv};
}

template <class E>
__device__ __forceinline__ void load_tile(const HeadBlock& b, int k0, int v0, int K, int V,
                                          float (&t)[kTile][kTile + 1]) {
  float x[kTile / kTileRows];
#pragma unroll
  for (int r = 0; r < kTile / kTileRows; ++r) x[r] = load_elem<E>(b, tile_at(b.layout, r, k0, v0, K, V).offset);
#pragma unroll
  for (int r = 0; r < kTile / kTileRows; ++r) {  // every load in flight before the first store
    const TileAt at = tile_at(b.layout, r, k0, v0, K, V);
    t[at.tk][at.tv] = x[r];
  }
}
template <class E>
__device__ __forceinline__ void store_tile(const HeadBlock& b, int k0, int v0, int K, int V,
                                           const float (&t)[kTile][kTile + 1]) {
#pragma unroll
  for (int r = 0; r < kTile / kTileRows; ++r) {
    const TileAt at = tile_at(b.layout, r, k0, v0, K, V);
    store_elem<E>(b, at.offset, t[at.tk][at.tv]);
  }
}

// One item's tile to copy (on: there is one).
struct TileCopy {
  HeadBlock src, dst;
  bool on = false;
};
constexpr int kPair = 2;  // items a CTA copies at once: both tiles' loads in flight before the first barrier

// Tile `tile` (tiles (k0, v0) of 32 x 32, V / 32 a row) of each item's src -> dst (both K x V) by the CTA, through
// t[i][k][v].
__device__ void copy_tiles(const TileCopy (&c)[kPair], int K, int V, int tile,
                           float (&t)[kPair][kTile][kTile + 1]) {
  const int k0 = (tile / (V / kTile)) * kTile, v0 = (tile % (V / kTile)) * kTile;
#pragma unroll
  for (int i = 0; i < kPair; ++i) {
    if (!c[i].on) continue;
    switch (c[i].src.dtype) {
      case DType::kFloat8E4M3: load_tile<uint8_t>(c[i].src, k0, v0, K, V, t[i]); break;
      case DType::kBFloat16: load_tile<__nv_bfloat16>(c[i].src, k0, v0, K, V, t[i]); break;
      case DType::kFloat16: load_tile<__half>(c[i].src, k0, v0, K, V, t[i]); break;
      default: load_tile<float>(c[i].src, k0, v0, K, V, t[i]);
    }
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kPair; ++i) {
    if (!c[i].on) continue;
    switch (c[i].dst.dtype) {
      case DType::kFloat8E4M3: store_tile<uint8_t>(c[i].dst, k0, v0, K, V, t[i]); break;
      case DType::kBFloat16: store_tile<__nv_bfloat16>(c[i].dst, k0, v0, K, V, t[i]); break;
      case DType::kFloat16: store_tile<__half>(c[i].dst, k0, v0, K, V, t[i]); break;
      default: store_tile<float>(c[i].dst, k0, v0, K, V, t[i]);
    }
  }
  __syncthreads();
}

// Sequence n of the caller's call: its span and slots, and whether the passes skip it (a bad span, or a slot past its
// buffer: nothing of it is stored).
struct StagedSeq {
  int64_t start, len;
  int32_t islot, fslot, cslot;
  bool skipped;
};
__device__ __forceinline__ StagedSeq staged_seq(const PrefillParams& p, bool checkpoints, int64_t n) {
  StagedSeq s;
  s.start = load_cu(p, n);
  s.len = load_cu(p, n + 1) - s.start;
  s.islot = p.initial_indices != nullptr ? p.initial_indices[n] : -1;
  s.fslot = p.final_indices != nullptr ? p.final_indices[n] : -1;
  s.cslot = checkpoints ? p.checkpoint_indices[n] : -1;
  s.skipped = s.start < 0 || s.len < 0 || s.start + s.len > p.total_tokens || s.islot >= p.state.num_slots ||
              s.fslot >= p.state.num_slots || (checkpoints && s.cslot >= p.checkpoints.num_slots);
  return s;
}

__device__ __forceinline__ HeadBlock pool_head(const StatePool& pool, int HV, int64_t slot, int h, int K, int V) {
  const int64_t head = int64_t(K) * V;
  return {static_cast<char*>(pool.data) + (slot * pool.slot_stride + h * head) * dtype_bytes(pool.dtype),
          pool.scales != nullptr ? pool.scales + (slot * HV + h) * (head / kFp8Block) : nullptr, pool.dtype,
          pool.layout};
}
__device__ __forceinline__ HeadBlock checkpoint_head(const StateCache& c, int HV, int64_t slot, int64_t j, int h, int K,
                                                     int V) {
  const int64_t head = int64_t(K) * V;
  return {static_cast<char*>(c.data) + (slot * c.slot_stride + (j * HV + h) * head) * dtype_bytes(c.dtype),
          c.scales != nullptr ? c.scales + ((slot * c.num_steps + j) * HV + h) * (head / kFp8Block) : nullptr,
          c.dtype, c.layout};
}

// w / d and w % d, in 32 bits where w fits (64-bit division is a call of about a hundred instructions).
__device__ __forceinline__ int64_t div_rem(int64_t w, int d, int& rem) {
  if (w <= INT32_MAX) {
    rem = int(w) % d;
    return int(w) / d;
  }
  rem = int(w % d);
  return w / d;
}

// Item w = (sequence, value head) of the copy in: the staged call's slots and the owner of each staged checkpoint entry
// the sequence stores (by the first tile of its head 0), and the initial state's copy. A skipped sequence's initial
// slot becomes N, past the staged pool, so that the passes skip and count it as they would have.
__device__ __forceinline__ TileCopy stage_in_item(const PrefillParams& p, const PrefillParams& s, int32_t* slots,
                                                  int32_t* owners, bool checkpoints, int64_t w, int tile) {
  const int HV = p.heads.num_v_heads, K = p.heads.head_dim_k, V = p.heads.head_dim_v;
  TileCopy c;
  if (w >= int64_t(p.num_seqs) * HV) return c;
  int h;
  const int64_t n = div_rem(w, HV, h);
  const StagedSeq q = staged_seq(p, checkpoints, n);
  if (h == 0 && tile == 0) {
    const int tid = threadIdx.y * kTile + threadIdx.x;
    const bool stores = checkpoints && !q.skipped && q.cslot >= 0;
    const int64_t C = p.checkpoint_interval, base = stores ? q.start / C : 0;
    if (tid == 0) {
      slots[n] = q.skipped ? p.num_seqs : q.islot < 0 ? -1 : int32_t(n);  // s.initial_indices
      slots[p.num_seqs + n] = q.skipped || q.fslot < 0 ? -1 : int32_t(n);  // s.final_indices
      if (checkpoints) slots[2 * int64_t(p.num_seqs) + n] = stores ? int32_t(base) : -1;  // s.checkpoint_indices
    }
    const int64_t stored = stores ? min(q.len / C, p.checkpoints.num_steps) : 0;
    for (int64_t j = tid; j < stored; j += kTile * kTileRows) owners[base + j] = int32_t(n);
  }
  if (!q.skipped && q.islot >= 0)
    c = {pool_head(p.state, HV, q.islot, h, K, V), pool_head(s.state, HV, n, h, K, V), true};
  return c;
}

// Per tile (blockIdx.y), the items of the copy in, kPair at a time.
__global__ void __launch_bounds__(kTile* kTileRows)
    stage_in_kernel(const PrefillParams p, const PrefillParams s, int32_t* slots, int32_t* owners, bool checkpoints) {
  __shared__ float t[kPair][kTile][kTile + 1];
  const int tile = int(blockIdx.y);
  const int64_t items = int64_t(p.num_seqs) * p.heads.num_v_heads;
  for (int64_t w = blockIdx.x; w < items; w += kPair * int64_t(gridDim.x)) {
    TileCopy c[kPair];
#pragma unroll
    for (int i = 0; i < kPair; ++i) c[i] = stage_in_item(p, s, slots, owners, checkpoints, w + i * gridDim.x, tile);
    copy_tiles(c, p.heads.head_dim_k, p.heads.head_dim_v, tile, t);
  }
}

// Item w = (i, value head) of the copy out: i < N sequence i's final state, then the staged checkpoint entries e =
// i - N, each of its owner n (stage_in_item; none: -1) as entry j = e - floor(cu_seqlens[n] / C).
__device__ __forceinline__ TileCopy stage_out_item(const PrefillParams& p, const PrefillParams& s,
                                                   const int32_t* owners, bool checkpoints, int64_t entries,
                                                   int64_t w) {
  const int HV = p.heads.num_v_heads, K = p.heads.head_dim_k, V = p.heads.head_dim_v;
  TileCopy c;
  if (w >= (int64_t(p.num_seqs) + entries) * HV) return c;
  int h;
  const int64_t i = div_rem(w, HV, h);
  if (i < p.num_seqs) {
    const StagedSeq q = staged_seq(p, checkpoints, i);
    if (!q.skipped && q.fslot >= 0)
      c = {pool_head(s.state, HV, i, h, K, V), pool_head(p.state, HV, q.fslot, h, K, V), true};
    return c;
  }
  const int64_t e = i - p.num_seqs, C = p.checkpoint_interval, n = owners[e];
  if (n < 0) return c;
  const StagedSeq q = staged_seq(p, checkpoints, n);
  const int64_t j = e - q.start / C;
  return {checkpoint_head(s.checkpoints, HV, e, 0, h, K, V), checkpoint_head(p.checkpoints, HV, q.cslot, j, h, K, V),
          true};
}

// Per tile (blockIdx.y), the items of the copy out, kPair at a time.
__global__ void __launch_bounds__(kTile* kTileRows)
    stage_out_kernel(const PrefillParams p, const PrefillParams s, const int32_t* owners, bool checkpoints,
                     int64_t entries) {
  __shared__ float t[kPair][kTile][kTile + 1];
  const int tile = int(blockIdx.y);
  const int64_t items = (int64_t(p.num_seqs) + entries) * p.heads.num_v_heads;
  for (int64_t w = blockIdx.x; w < items; w += kPair * int64_t(gridDim.x)) {
    TileCopy c[kPair];
#pragma unroll
    for (int i = 0; i < kPair; ++i) c[i] = stage_out_item(p, s, owners, checkpoints, entries, w + i * gridDim.x);
    copy_tiles(c, p.heads.head_dim_k, p.heads.head_dim_v, tile, t);
  }
}

bool checkpoints_stored(const PrefillParams& p) {
  return p.checkpoint_interval > 0 && p.checkpoints.data != nullptr && p.checkpoint_indices != nullptr;
}
size_t head_state_bytes(const PrefillParams& p) {
  return size_t(p.heads.num_v_heads) * p.heads.head_dim_k * p.heads.head_dim_v * sizeof(float);
}
size_t pool_copy_bytes(const PrefillParams& p) {  // none without a pool: no slot of the staged call names one
  if (p.state.data == nullptr) return 0;
  return workspace_round_up(size_t(std::max(p.num_seqs, 0)) * head_state_bytes(p));
}
size_t checkpoint_copy_bytes(const PrefillParams& p) {
  if (!checkpoints_stored(p)) return 0;
  return workspace_round_up(size_t(staged_shape(p).checkpoints.num_slots) * head_state_bytes(p));
}
size_t slots_bytes(const PrefillParams& p) {  // initial, final and checkpoint slots of the staged call
  return workspace_round_up(size_t(3) * std::max(p.num_seqs, 0) * sizeof(int32_t));
}
int64_t staged_entries(const PrefillParams& p) {  // the staged checkpoint entries a call can write
  return checkpoints_stored(p) ? std::max<int64_t>(p.total_tokens, 0) / p.checkpoint_interval : 0;
}
size_t owners_bytes(const PrefillParams& p) { return workspace_round_up(size_t(staged_entries(p)) * sizeof(int32_t)); }
// The grid: a tile of the heads each blockIdx.y, their (sequence, entry, value head) items walked along x.
dim3 grid_for(const PrefillParams& p, int64_t items) {
  const int tiles = (p.heads.head_dim_k / kTile) * (p.heads.head_dim_v / kTile);
  const int64_t x = std::max<int64_t>(1, std::min<int64_t>(items, int64_t(device_sms()) * kCtasPerSm / tiles + 1));
  return dim3(unsigned(x), unsigned(tiles));
}

}  // namespace

size_t staged_bytes(const PrefillParams& p) {
  if (!states_staged(p) || p.num_seqs <= 0) return 0;
  return pool_copy_bytes(p) + checkpoint_copy_bytes(p) + slots_bytes(p) + owners_bytes(p);
}

PrefillParams stage_states_in(const PrefillParams& p, void* ws, size_t ws_bytes, cudaStream_t stream) {
  PrefillParams s = staged_shape(p);
  char* at = static_cast<char*>(ws);
  if (p.state.data != nullptr) s.state.data = at;
  at += pool_copy_bytes(p);
  const bool checkpoints = checkpoints_stored(p);
  if (checkpoints) s.checkpoints.data = at;
  at += checkpoint_copy_bytes(p);
  int32_t* slots = reinterpret_cast<int32_t*>(at);
  int32_t* owners = reinterpret_cast<int32_t*>(at + slots_bytes(p));
  if (staged_entries(p) > 0)  // entries no sequence stores keep -1
    GDNKIT_CUDA_CHECK(cudaMemsetAsync(owners, 0xff, size_t(staged_entries(p)) * sizeof(int32_t), stream));
  s.initial_indices = slots;
  s.final_indices = slots + p.num_seqs;
  s.checkpoint_indices = checkpoints ? slots + 2 * p.num_seqs : nullptr;
  const size_t used = staged_bytes(p);
  s.workspace = static_cast<char*>(ws) + used;
  s.workspace_bytes = ws_bytes - used;
  const dim3 block(kTile, kTileRows);
  stage_in_kernel<<<grid_for(p, int64_t(p.num_seqs) * p.heads.num_v_heads), block, 0, stream>>>(p, s, slots, owners,
                                                                                                 checkpoints);
  GDNKIT_CUDA_CHECK_LAUNCH();
  return s;
}

void stage_states_out(const PrefillParams& p, const PrefillParams& staged, cudaStream_t stream) {
  const bool checkpoints = checkpoints_stored(p);
  const int64_t entries = staged_entries(p);
  const int32_t* owners = staged.initial_indices + slots_bytes(p) / sizeof(int32_t);  // after the slots
  const dim3 block(kTile, kTileRows);
  stage_out_kernel<<<grid_for(p, (int64_t(p.num_seqs) + entries) * p.heads.num_v_heads), block, 0, stream>>>(
      p, staged, owners, checkpoints, entries);
  GDNKIT_CUDA_CHECK_LAUNCH();
}

}  // namespace gdnkit::cuda::chunked_prefill
