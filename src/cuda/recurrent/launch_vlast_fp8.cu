// Decode of V-last float8_e4m3 pools (vlast_decode.cuh with TState = uint8_t): one instantiation per input dtype and
// head dims K in {64, 128}, V = 128 (a CTA owns one 128-byte piece of every row: 128 columns).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>
#include <type_traits>

#include "cuda/recurrent/launcher.cuh"
#include "cuda/recurrent/vlast_decode.cuh"

namespace gdnkit::cuda::recurrent {
namespace {

template <class TInput, int K, int V>
void launch_kv(const RecurrentParams& p, Stream stream) {
  using R = VLastRows<uint8_t, K>;
  static_assert(V % R::kCols == 0, "V-last fp8 decode: whole 128-column pieces");
  launch_recurrent(vlast_decode_kernel<uint8_t, TInput, K, V>, head_grid(p, V / R::kCols), R::kWarps * 32, false,
                   stream, p);
}

template <class TInput>
void launch_input(const RecurrentParams& p, Stream stream) {
  const int K = p.heads.head_dim_k, V = p.heads.head_dim_v;
  if (K == 64 && V == 128) return launch_kv<TInput, 64, 128>(p, stream);
  if (K == 128 && V == 128) return launch_kv<TInput, 128, 128>(p, stream);
  throw Error(ErrorCode::kNotImplemented, "cuda: V-last float8_e4m3 decode with K=" + std::to_string(K) +
                                              ", V=" + std::to_string(V) +
                                              " is not built (built: K in {64, 128}, V = 128)");
}

}  // namespace

void launch_vlast_fp8_decode(const RecurrentParams& p, Stream stream) {
  for_decode_inputs(p, [&](auto* input) { launch_input<std::remove_pointer_t<decltype(input)>>(p, stream); });
}

}  // namespace gdnkit::cuda::recurrent
