// Chunked prefill kernels for head dim K=256 (one translation unit per K: parallel builds).
#include "cuda/prefill/kernels.cuh"

namespace gdnkit::cuda::chunked_prefill {
template void launch<256>(const PrefillParams&, const Plan&, int, cudaStream_t, int);
}  // namespace gdnkit::cuda::chunked_prefill
