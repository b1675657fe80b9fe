// Warp-independent decode kernel (K-last pools, one token per sequence) for bf16 states.
#define GDNKIT_DECODE_WARP_DEFINE_KERNELS
#include "cuda/recurrent/decode_warp.cuh"

namespace gdnkit::cuda::recurrent {
GDNKIT_DECODE_WARP_INSTANTIATE(__nv_bfloat16)
}  // namespace gdnkit::cuda::recurrent
