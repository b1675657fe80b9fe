// Chunked prefill kernels for head dim K=128 (one translation unit per K: parallel builds).
#include "cuda/prefill/kernels.cuh"

namespace gdnkit::cuda::chunked_prefill {
template void launch<128>(const PrefillParams&, const Plan&, int, cudaStream_t, int);
template void launch_split<128>(const PrefillParams&, const Plan&, bool, cudaStream_t);
}  // namespace gdnkit::cuda::chunked_prefill
