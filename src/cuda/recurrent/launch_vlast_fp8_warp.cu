// The recurrent ops' warp kernel and launcher for V-last float8_e4m3 pools: verify, commit by recompute and short
// prefill (decode: launch_vlast_fp8.cu).
#include "cuda/recurrent/launcher.cuh"

namespace gdnkit::cuda::recurrent {
GDNKIT_RECURRENT_INSTANTIATE_FP8(StateLayout::kVLast, float)
GDNKIT_RECURRENT_INSTANTIATE_FP8(StateLayout::kVLast, __nv_bfloat16)
GDNKIT_RECURRENT_INSTANTIATE_FP8(StateLayout::kVLast, __half)
GDNKIT_RECURRENT_INSTANTIATE_PREFILL(StateLayout::kVLast, uint8_t, __nv_bfloat16)
GDNKIT_RECURRENT_INSTANTIATE_PREFILL(StateLayout::kVLast, uint8_t, __half)
}  // namespace gdnkit::cuda::recurrent
