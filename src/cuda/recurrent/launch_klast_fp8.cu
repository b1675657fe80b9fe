// Decode of K-last float8_e4m3 pools (fp8_decode.cuh): one instantiation per input dtype and K = V.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>
#include <type_traits>

#include "cuda/recurrent/fp8_decode.cuh"
#include "cuda/host/overrides.h"
#include "cuda/recurrent/heuristics.h"
#include "cuda/recurrent/launch.cuh"

namespace gdnkit::cuda::recurrent {
namespace {

template <class TInput, int K, int kCols>
void launch_k(const RecurrentParams& p, Stream stream) {
  using Tile = Fp8DecodeTile<K, kCols>;
  const auto kernel = fp8_decode_kernel<TInput, K, K, kCols>;
  const dim3 grid(unsigned(p.heads.num_v_heads) * unsigned(K / Tile::kCtaCols), unsigned(p.batch));
  const bool prefetch = fp8_decode_prefetch(grid_ctas(grid), overrides());
  last_recurrent_launch() = {kFp8DecodeKernel, prefetch, kCols};
  launch_recurrent(kernel, grid, Tile::kWarps * 32, prefetch, stream, p);
}

template <class TInput, int K>
void launch_cols(const RecurrentParams& p, Stream stream) {
  const int cols = fp8_decode_columns(p.batch, p.heads.num_v_heads, K, overrides());
  if (cols == 8) return launch_k<TInput, K, 8>(p, stream);
  if constexpr (K == 128)
    if (cols == 32) return launch_k<TInput, K, 32>(p, stream);
  launch_k<TInput, K, 16>(p, stream);
}

template <class TInput>
void launch_input(const RecurrentParams& p, Stream stream) {
  const int K = p.heads.head_dim_k, V = p.heads.head_dim_v;
  if (K == 64 && V == 64) return launch_cols<TInput, 64>(p, stream);
  if (K == 128 && V == 128) return launch_cols<TInput, 128>(p, stream);
  if (K == 256 && V == 256) return launch_cols<TInput, 256>(p, stream);
  throw Error(ErrorCode::kNotImplemented, "cuda: head dims K=" + std::to_string(K) + ", V=" + std::to_string(V) +
                                              " are not built (built: K = V in {64, 128, 256})");
}

}  // namespace

void launch_fp8_decode(const RecurrentParams& p, Stream stream) {
  for_decode_inputs(p, [&](auto* input) { launch_input<std::remove_pointer_t<decltype(input)>>(p, stream); });
}

}  // namespace gdnkit::cuda::recurrent
