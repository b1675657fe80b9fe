// The one launcher of the recurrent ops for a (layout, state dtype, input dtype, head dims, op): each candidate
// kernel's grid and residency, the heuristics' choice (heuristics.h), and the launch of what it chose. Included
// by the instantiation files (warp_<layout>_<state dtype>.cu), one per (layout, state dtype).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <string>
#include <type_traits>

#include "cuda/host/check.h"
#include "cuda/recurrent/chain_mma.cuh"
#include "cuda/recurrent/fp8_chain.cuh"
#include "cuda/recurrent/fp8_chain_mma.cuh"
#include "cuda/recurrent/vlast_chain.cuh"
#include "cuda/recurrent/heuristics.h"
#include "cuda/recurrent/launch.cuh"
#include "cuda/recurrent/mma_decode.cuh"
#include "cuda/recurrent/row.cuh"
#include "cuda/recurrent/vlast_decode.cuh"
#include "cuda/recurrent/warp_kernel.cuh"
#include "cuda/recurrent/warp_tile.cuh"

namespace gdnkit::cuda::recurrent {

template <class T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DType::kFloat32;
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return DType::kBFloat16;
  else if constexpr (std::is_same_v<T, uint8_t>) return DType::kFloat8E4M3;  // a pool's storage only
  else return DType::kFloat16;
}

template <StateLayout kLayout, class TState, class TInput, int K, int V, RecurrentOp kOp>
RecurrentCall describe_call(const RecurrentParams& p) {
  RecurrentCall c;
  c.op = kOp;
  c.layout = kLayout;
  c.state_dtype = dtype_of<TState>();
  c.input_dtype = dtype_of<TInput>();
  c.head_dim_k = K;
  c.head_dim_v = V;
  c.batch = p.batch;
  c.num_v_heads = p.heads.num_v_heads;
  c.num_draft_tokens = kOp == RecurrentOp::kDecode ? 1 : p.num_draft_tokens;
  c.tree = p.parent != nullptr;
  c.caches_states = p.intermediate.data != nullptr && p.intermediate_indices != nullptr;
  c.cache_dtype = p.intermediate.dtype;
  return c;
}

// The CTAs of a grid of `cols_per_head` CTAs per value head and one row per sequence.
inline dim3 head_grid(const RecurrentParams& p, int cols_per_head) {
  return dim3(unsigned(p.heads.num_v_heads) * unsigned(cols_per_head), unsigned(p.batch));
}

// write_state: verify of chains with update_state stores the final state (decode and recompute always do).
template <StateLayout kLayout, class TState, class TInput, int K, int V, RecurrentOp kOp>
void launch_recurrent_op(const RecurrentParams& p, bool write_state, Stream stream) {
  using Regular = WarpTile<kLayout, TState, K, V>;
  constexpr int kCtaWarps = Regular::kCtaWarps;
  constexpr int kThreads = kCtaWarps * 32;
  constexpr int kRegularCols = V / Regular::kRows / kCtaWarps;  // exact: kCtaWarps divides V / kRows
  constexpr int64_t kMaxGridY = 65535;  // CUDA's limit on gridDim.y: one row per sequence
  if (p.batch <= 0 || p.heads.num_v_heads <= 0) return;
  if (p.batch > kMaxGridY || int64_t(p.heads.num_v_heads) * kRegularCols > int64_t(INT32_MAX))
    throw Error(ErrorCode::kNotImplemented, "cuda recurrent: B = " + std::to_string(p.batch) + ", HV = " +
                                                std::to_string(p.heads.num_v_heads) + " exceed the grid (B <= 65535, HV * " +
                                                std::to_string(kRegularCols) + " < 2^31)");
  const RecurrentCall call = describe_call<kLayout, TState, TInput, K, V, kOp>(p);
  constexpr bool kKLastBf16Input = kLayout == StateLayout::kKLast && std::is_same_v<TInput, __nv_bfloat16>;
  constexpr bool kFp8State = std::is_same_v<TState, uint8_t>;  // float8_e4m3 pools: the warp kernel only
  constexpr bool kChainBuilt = kKLastBf16Input && K <= 128 && kOp != RecurrentOp::kDecode && !kFp8State;
  // bf16 state with bf16 inputs; fp16 state with fp16 or bf16 inputs (mma_decode.cuh).
  constexpr bool kMmaDecodeBuilt =
      kLayout == StateLayout::kKLast && kOp == RecurrentOp::kDecode && K <= 128 && V % 64 == 0 &&
      ((std::is_same_v<TState, __nv_bfloat16> && std::is_same_v<TInput, __nv_bfloat16>) ||
       (std::is_same_v<TState, __half> && (std::is_same_v<TInput, __half> || std::is_same_v<TInput, __nv_bfloat16>)));
  constexpr bool kMmaDecodeTf32Built =
      kMmaDecodeBuilt && std::is_same_v<TState, __half> && std::is_same_v<TInput, __nv_bfloat16>;
  constexpr bool kVLastBuilt = kLayout == StateLayout::kVLast && kOp == RecurrentOp::kDecode && K <= 128;
  constexpr bool kWidthsBuilt = kLayout == StateLayout::kKLast && kOp == RecurrentOp::kDecode && K == 128;
  constexpr bool kFp8ChainBuilt = kLayout == StateLayout::kKLast && kFp8State && kOp == RecurrentOp::kVerify &&
                                  sizeof(TInput) == 2 && (K == 64 || K == 128) && K == V;
  constexpr bool kVLastChainBuilt = kLayout == StateLayout::kVLast && kOp == RecurrentOp::kVerify &&
                                    sizeof(TInput) == 2 && (K == 64 || K == 128) && K == V;
  // the chain kernel's cache: fp8 with fp8 states, else fp32 or the state's dtype (the call's, at run time)
  using VLastCache = std::conditional_t<kFp8State, uint8_t, float>;

  Candidates fit;
  if constexpr (!kVLastBuilt) {  // V-last decode has its own kernel: the warp kernel is not built for it
    static const int64_t resident = resident_ctas(
        reinterpret_cast<const void*>(warp_recurrent_kernel<kLayout, TState, TInput, K, V, kOp>), kThreads);
    fit.regular = {grid_ctas(head_grid(p, kRegularCols)), resident};
  }

  if constexpr (kChainBuilt) {
    constexpr int kChainColCtas = V / (kChainCols * kChainWarps);
    static const int64_t resident = [] {  // 24 KB of shared memory per CTA: the largest carveout first
      const auto k = chain_mma_kernel<TState, K, V, kOp>;
      GDNKIT_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout,
                                             int(cudaSharedmemCarveoutMaxShared)));
      return resident_ctas(reinterpret_cast<const void*>(k), kChainWarps * 32);
    }();
    fit.chain_mma = {grid_ctas(head_grid(p, kChainColCtas)), resident};
  }
  if constexpr (kFp8ChainBuilt) {
    static const int64_t resident = resident_ctas(
        reinterpret_cast<const void*>(fp8_chain_kernel<TInput, K, V, true>), Fp8ChainTile<K>::kWarps * 32);
    fit.fp8_chain = {grid_ctas(head_grid(p, V / Fp8ChainTile<K>::kCtaCols)), resident};
    static const int64_t mma_resident = resident_ctas(
        reinterpret_cast<const void*>(fp8_chain_mma_kernel<TInput, K, V>), Fp8ChainMmaTile<K>::kWarps * 32);
    fit.fp8_chain_mma = {grid_ctas(head_grid(p, V / Fp8ChainMmaTile<K>::kCtaCols)), mma_resident};
  }
  if constexpr (kVLastChainBuilt) {
    using Rows = VLastChainRows<TState, K>;
    static const int64_t resident = resident_ctas(
        reinterpret_cast<const void*>(vlast_chain_kernel<TState, VLastCache, TInput, K, V, true>), Rows::kWarps * 32);
    fit.vlast_chain = {grid_ctas(head_grid(p, V / Rows::kCols)), resident};
  }
  if constexpr (kMmaDecodeBuilt) {
    using Tile = MmaDecodeTile<K, V>;
    static const int64_t resident =
        resident_ctas(reinterpret_cast<const void*>(mma_decode_kernel<TState, TInput, K, V>), Tile::kWarps * 32);
    fit.mma_decode = {grid_ctas(head_grid(p, V / Tile::kCtaCols)), resident};
    if constexpr (kMmaDecodeTf32Built) {
      static const int64_t tf32_resident = resident_ctas(
          reinterpret_cast<const void*>(mma_decode_kernel<TState, TInput, K, V, true>), Tile::kWarps * 32);
      fit.mma_decode_tf32 = {fit.mma_decode.grid_ctas, tf32_resident};
    }
  }
  if constexpr (kVLastBuilt) {
    using R = VLastRows<TState, K>;
    static_assert(V % R::kCols == 0, "V-last decode: V must be a multiple of the CTA's columns");
    static const int64_t resident =
        resident_ctas(reinterpret_cast<const void*>(vlast_decode_kernel<TState, TInput, K, V>), R::kWarps * 32);
    fit.vlast_decode = {grid_ctas(head_grid(p, V / R::kCols)), resident};
  }
  if constexpr (kWidthsBuilt && sizeof(TState) == 2) {
    using Wide = WarpTile<kLayout, TState, K, V, TileWidth::kWide>;
    using Narrow = WarpTile<kLayout, TState, K, V, TileWidth::kNarrow>;
    static_assert(Wide::kCtaWarps == kCtaWarps && Narrow::kCtaWarps == kCtaWarps, "tiles share the CTA's warps");
    constexpr int kNarrowCols = V / Narrow::kRows / kCtaWarps;
    static const int64_t wide_resident = resident_ctas(
        reinterpret_cast<const void*>(warp_recurrent_kernel<kLayout, TState, TInput, K, V, kOp, TileWidth::kWide>),
        kThreads);
    fit.wide = {grid_ctas(head_grid(p, V / Wide::kRows / kCtaWarps)), wide_resident};
    if (int64_t(p.heads.num_v_heads) * kNarrowCols <= int64_t(INT32_MAX))
      fit.narrow = {grid_ctas(head_grid(p, kNarrowCols)), 0};
  }

  const RecurrentChoice choice = choose_recurrent_kernel(call, fit, overrides());
  last_recurrent_launch() = {kernel_name(choice.kernel), choice.prefetch, 0};
  switch (choice.kernel) {
    case RecurrentKernel::kChainMma:
      if constexpr (kChainBuilt)
        return launch_recurrent(chain_mma_kernel<TState, K, V, kOp>, head_grid(p, V / (kChainCols * kChainWarps)),
                                kChainWarps * 32, choice.prefetch, stream, p, write_state);
      break;
    case RecurrentKernel::kFp8Chain:
      if constexpr (kFp8ChainBuilt) {
        const dim3 grid = head_grid(p, V / Fp8ChainTile<K>::kCtaCols);
        constexpr int kFp8ChainThreads = Fp8ChainTile<K>::kWarps * 32;
        if (call.caches_states)
          return launch_recurrent(fp8_chain_kernel<TInput, K, V, true>, grid, kFp8ChainThreads, false, stream, p,
                                  write_state);
        return launch_recurrent(fp8_chain_kernel<TInput, K, V, false>, grid, kFp8ChainThreads, false, stream, p,
                                write_state);
      }
      break;
    case RecurrentKernel::kFp8ChainMma:
      if constexpr (kFp8ChainBuilt)
        return launch_recurrent(fp8_chain_mma_kernel<TInput, K, V>, head_grid(p, V / Fp8ChainMmaTile<K>::kCtaCols),
                                Fp8ChainMmaTile<K>::kWarps * 32, false, stream, p, write_state);
      break;
    case RecurrentKernel::kVLastChain:
      if constexpr (kVLastChainBuilt) {
        using Rows = VLastChainRows<TState, K>;
        const dim3 grid = head_grid(p, V / Rows::kCols);
        constexpr int kThreadsPerCta = Rows::kWarps * 32;
        if (!call.caches_states)
          return launch_recurrent(vlast_chain_kernel<TState, TState, TInput, K, V, false>, grid, kThreadsPerCta, false,
                                  stream, p, write_state);
        if (call.cache_dtype == call.state_dtype)
          return launch_recurrent(vlast_chain_kernel<TState, TState, TInput, K, V, true>, grid, kThreadsPerCta, false,
                                  stream, p, write_state);
        if constexpr (!kFp8State)
          return launch_recurrent(vlast_chain_kernel<TState, float, TInput, K, V, true>, grid, kThreadsPerCta, false,
                                  stream, p, write_state);
      }
      break;
    case RecurrentKernel::kMmaDecode:
      if constexpr (kMmaDecodeBuilt)
        return launch_recurrent(mma_decode_kernel<TState, TInput, K, V>,
                                head_grid(p, V / MmaDecodeTile<K, V>::kCtaCols), MmaDecodeTile<K, V>::kWarps * 32,
                                choice.prefetch, stream, p);
      break;
    case RecurrentKernel::kMmaDecodeTf32:
      if constexpr (kMmaDecodeTf32Built)
        return launch_recurrent(mma_decode_kernel<TState, TInput, K, V, true>,
                                head_grid(p, V / MmaDecodeTile<K, V>::kCtaCols), MmaDecodeTile<K, V>::kWarps * 32,
                                choice.prefetch, stream, p);
      break;
    case RecurrentKernel::kVLastDecode:
      if constexpr (kVLastBuilt)
        return launch_recurrent(vlast_decode_kernel<TState, TInput, K, V>,
                                head_grid(p, V / VLastRows<TState, K>::kCols), VLastRows<TState, K>::kWarps * 32,
                                choice.prefetch, stream, p);
      break;
    case RecurrentKernel::kWarpWide:
      if constexpr (kWidthsBuilt && sizeof(TState) == 2)
        return launch_recurrent(warp_recurrent_kernel<kLayout, TState, TInput, K, V, kOp, TileWidth::kWide>,
                                head_grid(p, V / WarpTile<kLayout, TState, K, V, TileWidth::kWide>::kRows / kCtaWarps),
                                kThreads, choice.prefetch, stream, p, write_state);
      break;
    case RecurrentKernel::kWarpNarrow:
      if constexpr (kWidthsBuilt && sizeof(TState) == 2)
        return launch_recurrent(
            warp_recurrent_kernel<kLayout, TState, TInput, K, V, kOp, TileWidth::kNarrow>,
            head_grid(p, V / WarpTile<kLayout, TState, K, V, TileWidth::kNarrow>::kRows / kCtaWarps), kThreads,
            choice.prefetch, stream, p, write_state);
      break;
    case RecurrentKernel::kWarpSolo:
      if constexpr (kWidthsBuilt && (sizeof(TState) == 4 || sizeof(TState) == 2)) {
        constexpr TileWidth kSoloWidth = sizeof(TState) == 2 ? TileWidth::kWideSolo : TileWidth::kSolo;
        using Solo = WarpTile<kLayout, TState, K, V, kSoloWidth>;
        return launch_recurrent(warp_recurrent_kernel<kLayout, TState, TInput, K, V, kOp, kSoloWidth>,
                                head_grid(p, V / Solo::kRows / Solo::kCtaWarps), Solo::kCtaWarps * 32,
                                choice.prefetch, stream, p, write_state);
      }
      break;
    case RecurrentKernel::kWarpPinned:
      if constexpr (kWidthsBuilt && sizeof(TState) == 4)
        return launch_recurrent(warp_recurrent_kernel<kLayout, TState, TInput, K, V, kOp, TileWidth::kRegular, true>,
                                head_grid(p, kRegularCols), kThreads, choice.prefetch, stream, p, write_state);
      break;
    case RecurrentKernel::kWarpRegular:
      if constexpr (kOp == RecurrentOp::kVerify && WarpTile<kLayout, TState, K, V>::kStoresE4m3) {
        if (p.intermediate.data != nullptr && p.intermediate.dtype == DType::kFloat8E4M3)
          return launch_recurrent(
              warp_recurrent_kernel<kLayout, TState, TInput, K, V, kOp, TileWidth::kRegular, false, true>,
              head_grid(p, kRegularCols), kThreads, choice.prefetch, stream, p, write_state);
      }
      if constexpr (!kVLastBuilt)
        return launch_recurrent(warp_recurrent_kernel<kLayout, TState, TInput, K, V, kOp>, head_grid(p, kRegularCols),
                                kThreads, choice.prefetch, stream, p, write_state);
      break;
  }
  throw Error(ErrorCode::kNotImplemented,
              std::string("cuda recurrent: the chosen kernel (") + kernel_name(choice.kernel) + ") is not built here");
}

// Explicit instantiations: one translation unit per (layout, state dtype); all ops, input dtypes, dims.
#define GDNKIT_RECURRENT_INSTANTIATE_OPS(L, TState, TInput, D)                                                      \
  template void launch_recurrent_op<L, TState, TInput, D, D, RecurrentOp::kDecode>(const RecurrentParams&, bool,    \
                                                                                   Stream);                          \
  template void launch_recurrent_op<L, TState, TInput, D, D, RecurrentOp::kVerify>(const RecurrentParams&, bool,    \
                                                                                   Stream);                          \
  template void launch_recurrent_op<L, TState, TInput, D, D, RecurrentOp::kRecompute>(const RecurrentParams&, bool, \
                                                                                      Stream);
#define GDNKIT_RECURRENT_INSTANTIATE_DIMS(L, TState, TInput) \
  GDNKIT_RECURRENT_INSTANTIATE_OPS(L, TState, TInput, 64)    \
  GDNKIT_RECURRENT_INSTANTIATE_OPS(L, TState, TInput, 128)   \
  GDNKIT_RECURRENT_INSTANTIATE_OPS(L, TState, TInput, 256)
// float8_e4m3 pools: verify and commit by recompute (decode has its own kernels, fp8_decode.cuh and vlast_decode.cuh).
#define GDNKIT_RECURRENT_INSTANTIATE_FP8_OPS(L, TInput, D)                                                            \
  template void launch_recurrent_op<L, uint8_t, TInput, D, D, RecurrentOp::kVerify>(const RecurrentParams&, bool,    \
                                                                                    Stream);                          \
  template void launch_recurrent_op<L, uint8_t, TInput, D, D, RecurrentOp::kRecompute>(const RecurrentParams&, bool, \
                                                                                       Stream);
#define GDNKIT_RECURRENT_INSTANTIATE_FP8(L, TInput)     \
  GDNKIT_RECURRENT_INSTANTIATE_FP8_OPS(L, TInput, 64)  \
  GDNKIT_RECURRENT_INSTANTIATE_FP8_OPS(L, TInput, 128) \
  GDNKIT_RECURRENT_INSTANTIATE_FP8_OPS(L, TInput, 256)
// Prefill's short sequences: 16-bit inputs, K = V in {64, 128} (prefill_short_supported).
#define GDNKIT_RECURRENT_INSTANTIATE_PREFILL(L, TState, TInput)                                                   \
  template void launch_recurrent_op<L, TState, TInput, 64, 64, RecurrentOp::kPrefill>(const RecurrentParams&,     \
                                                                                      bool, Stream);              \
  template void launch_recurrent_op<L, TState, TInput, 128, 128, RecurrentOp::kPrefill>(const RecurrentParams&, \
                                                                                        bool, Stream);
#define GDNKIT_RECURRENT_INSTANTIATE(L, TState)                     \
  GDNKIT_RECURRENT_INSTANTIATE_DIMS(L, TState, float)               \
  GDNKIT_RECURRENT_INSTANTIATE_DIMS(L, TState, __nv_bfloat16)       \
  GDNKIT_RECURRENT_INSTANTIATE_DIMS(L, TState, __half)              \
  GDNKIT_RECURRENT_INSTANTIATE_PREFILL(L, TState, __nv_bfloat16)    \
  GDNKIT_RECURRENT_INSTANTIATE_PREFILL(L, TState, __half)

}  // namespace gdnkit::cuda::recurrent
