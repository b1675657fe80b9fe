// Recurrent kernels (decode / verify / commit by recompute) for vlast pools of fp32 states.
#define GDNKIT_RECURRENT_DEFINE_KERNELS
#include "cuda/recurrent/recurrent_kernel.cuh"

namespace gdnkit::cuda::recurrent {
GDNKIT_RECURRENT_INSTANTIATE(StateLayout::kVLast, float)
}  // namespace gdnkit::cuda::recurrent
