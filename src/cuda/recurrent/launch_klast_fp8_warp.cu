// The recurrent ops' warp kernel and launcher for K-last float8_e4m3 pools: verify, commit by recompute and short
// prefill (decode: launch_klast_fp8.cu).
#include "cuda/recurrent/launcher.cuh"

namespace gdnkit::cuda::recurrent {
GDNKIT_RECURRENT_INSTANTIATE_FP8(StateLayout::kKLast, float)
GDNKIT_RECURRENT_INSTANTIATE_FP8(StateLayout::kKLast, __nv_bfloat16)
GDNKIT_RECURRENT_INSTANTIATE_FP8(StateLayout::kKLast, __half)
GDNKIT_RECURRENT_INSTANTIATE_PREFILL(StateLayout::kKLast, uint8_t, __nv_bfloat16)
GDNKIT_RECURRENT_INSTANTIATE_PREFILL(StateLayout::kKLast, uint8_t, __half)
}  // namespace gdnkit::cuda::recurrent
