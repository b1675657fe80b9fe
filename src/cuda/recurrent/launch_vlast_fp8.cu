// Decode of V-last float8_e4m3 pools (vlast_decode.cuh with TState = uint8_t): one instantiation per input dtype,
// head dims K in {64, 128}, V in {128, 256} and CTA piece (a 128-byte line of every row, 128 columns, or half of
// one where the grid is small: heuristics.cpp vlast_fp8_decode_columns).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>
#include <type_traits>

#include "cuda/recurrent/launcher.cuh"
#include "cuda/recurrent/vlast_decode.cuh"

namespace gdnkit::cuda::recurrent {
namespace {

template <class TInput, int K, int V, int kGroups>
void launch_kv_groups(const RecurrentParams& p, Stream stream) {
  using R = VLastRows<uint8_t, K, kGroups>;
  static_assert(V % R::kCols == 0, "V-last fp8 decode: whole pieces");
  const auto kernel = vlast_decode_kernel<uint8_t, TInput, K, V, kGroups>;
  static const int64_t resident = resident_ctas(reinterpret_cast<const void*>(kernel), R::kWarps * 32);
  const dim3 grid = head_grid(p, V / R::kCols);
  // prefetch mode where the grid fits the GPU at once (share 1), as for the other V-last pools
  const bool prefetch = prefetch_mode(KernelFit{grid_ctas(grid), resident}, 1, overrides());
  last_recurrent_launch() = {kernel_name(RecurrentKernel::kVLastDecode), prefetch, R::kCols};
  launch_recurrent(kernel, grid, R::kWarps * 32, prefetch, stream, p);
}

template <class TInput, int K, int V>
void launch_kv(const RecurrentParams& p, Stream stream) {
  if (vlast_fp8_decode_columns(p.batch, p.heads.num_v_heads, V, device_sms(), overrides()) == 64)
    return launch_kv_groups<TInput, K, V, 4>(p, stream);
  launch_kv_groups<TInput, K, V, 8>(p, stream);
}

template <class TInput>
void launch_input(const RecurrentParams& p, Stream stream) {
  const int K = p.heads.head_dim_k, V = p.heads.head_dim_v;
  if (K == 64 && V == 128) return launch_kv<TInput, 64, 128>(p, stream);
  if (K == 128 && V == 128) return launch_kv<TInput, 128, 128>(p, stream);
  if (K == 64 && V == 256) return launch_kv<TInput, 64, 256>(p, stream);
  if (K == 128 && V == 256) return launch_kv<TInput, 128, 256>(p, stream);
  throw Error(ErrorCode::kNotImplemented, "cuda: V-last float8_e4m3 decode with K=" + std::to_string(K) +
                                              ", V=" + std::to_string(V) +
                                              " is not built (built: K in {64, 128}, V in {128, 256})");
}

}  // namespace

void launch_vlast_fp8_decode(const RecurrentParams& p, Stream stream) {
  for_decode_inputs(p, [&](auto* input) { launch_input<std::remove_pointer_t<decltype(input)>>(p, stream); });
}

}  // namespace gdnkit::cuda::recurrent
