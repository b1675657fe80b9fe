// The long horizon on the CUDA backend (support/long_horizon.h): a prefill, then decode steps on one slot, with
// bf16 and fp16 pools against the fp32 pool, that pool's run and every run's prefill o against the fp64 recurrence
// (o and the pool NaN before the run); buffers in managed memory, so that the host reads the same bytes.
// GDNKIT_LONG_HORIZON="T,D" sets the prefill and decode lengths (default 32768 and 4096).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu_harness.h"
#include "support/long_horizon.h"

namespace gdnkit::test {
namespace {

TEST(LongHorizonGpu, SixteenBitPoolsAgainstFp32) {
  int64_t T = 32768, D = 4096;
  long_horizon_lengths(T, D);
  cudaStream_t stream = nullptr;
  GDNKIT_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const LongHorizonMemory managed{[](size_t bytes) {
                                    void* p = nullptr;
                                    return cudaMallocManaged(&p, bytes) == cudaSuccess ? p : nullptr;
                                  },
                                  [](void* p) { cudaFree(p); },
                                  [stream] { cudaStreamSynchronize(stream); }};
  expect_long_horizon({Backend::kCUDA, stream}, managed, T, D, "cuda");
  GDNKIT_TEST_CUDA(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace gdnkit::test
