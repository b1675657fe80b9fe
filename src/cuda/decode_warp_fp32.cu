// Warp-independent decode kernel (K-last pools, one token per sequence) for fp32 states.
#define GDNKIT_DECODE_WARP_DEFINE_KERNELS
#include "cuda/recurrent/decode_warp.cuh"

namespace gdnkit::cuda::recurrent {
GDNKIT_DECODE_WARP_INSTANTIATE(float)
}  // namespace gdnkit::cuda::recurrent
