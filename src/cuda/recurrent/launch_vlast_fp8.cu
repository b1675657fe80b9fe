// Decode of V-last float8_e4m3 pools (vlast_decode.cuh with TState = uint8_t): one instantiation per input dtype and
// head dims K in {64, 128}, V = 128 (a CTA owns one 128-byte piece of every row: 128 columns).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

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
  constexpr int64_t kMaxGridY = 65535;  // CUDA's limit on gridDim.y: one row per sequence
  if (p.batch <= 0 || p.heads.num_v_heads <= 0) return;
  if (p.batch > kMaxGridY)
    throw Error(ErrorCode::kNotImplemented,
                "cuda recurrent: B = " + std::to_string(p.batch) + " exceeds the grid (B <= 65535)");
  switch (p.k.dtype) {  // q, k, v, o share it (validated)
    case DType::kFloat32: return launch_input<float>(p, stream);
    case DType::kBFloat16: return launch_input<__nv_bfloat16>(p, stream);
    case DType::kFloat16: return launch_input<__half>(p, stream);
    default:
      throw Error(ErrorCode::kInvalidArgument,
                  std::string("k: expected dtype float32, bfloat16 or float16, got ") + dtype_name(p.k.dtype));
  }
}

}  // namespace gdnkit::cuda::recurrent
