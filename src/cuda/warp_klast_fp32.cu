// Warp-independent recurrent kernels (decode / verify / commit by recompute) for klast pools of fp32 states.
#define GDNKIT_WARP_RECURRENT_DEFINE_KERNELS
#include "cuda/recurrent/warp_kernel.cuh"

namespace gdnkit::cuda::recurrent {
GDNKIT_WARP_RECURRENT_INSTANTIATE(StateLayout::kKLast, float)
}  // namespace gdnkit::cuda::recurrent
