// The recurrent ops' kernels and launcher for V-last pools of bf16 states (one translation unit each:
// parallel builds).
#include "cuda/recurrent/launcher.cuh"

namespace gdnkit::cuda::recurrent {
GDNKIT_RECURRENT_INSTANTIATE(StateLayout::kVLast, __nv_bfloat16)
}  // namespace gdnkit::cuda::recurrent
