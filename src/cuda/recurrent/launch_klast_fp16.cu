// The recurrent ops' kernels and launcher for K-last pools of fp16 states (one translation unit each:
// parallel builds).
#include "cuda/recurrent/launcher.cuh"

namespace gdnkit::cuda::recurrent {
GDNKIT_RECURRENT_INSTANTIATE(StateLayout::kKLast, __half)
}  // namespace gdnkit::cuda::recurrent
