// Device mirroring of test problems (tests/common/problem.h) for the GPU suite, generic over ops:
//
//   Problem ref(cfg), got = ref;
//   DeviceProblem dev(got);                                   // every buffer copied to the device
//   gdnkit::cpu::decode(ref.decode_params());                 // (or the public API with kCPU)
//   gdnkit::decode(got.decode_params(dev.resolver()), {Backend::kCUDA, dev.stream()});
//   dev.download(got);                                        // outputs back (syncs the stream)
//   EXPECT_TRUE(RelClose("o", got.read_tokens("o"), ref.read_tokens("o"), tol));
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "support/compare.h"
#include "support/problem.h"

namespace gdnkit::test {

// Aborts the current test with the call and CUDA's message.
#define GDNKIT_TEST_CUDA(call)                                                                      \
  do {                                                                                              \
    const cudaError_t err_ = (call);                                                                \
    ASSERT_EQ(err_, cudaSuccess) << #call << ": " << cudaGetErrorName(err_) << " " << cudaGetErrorString(err_); \
  } while (0)

class DeviceProblem {
 public:
  // Allocates a device copy of every buffer of `host` and uploads it; owns a non-blocking stream.
  explicit DeviceProblem(const Problem& host);
  ~DeviceProblem();
  DeviceProblem(const DeviceProblem&) = delete;
  DeviceProblem& operator=(const DeviceProblem&) = delete;

  Resolver resolver() const;                      // Buffer -> its device copy (by name)
  void* device(const std::string& name) const;    // throws when there is no such buffer
  cudaStream_t stream() const { return stream_; }
  void upload(const Problem& host);                // every buffer host -> device (syncs)
  void upload(const Problem& host, const std::string& name);
  // Syncs the stream, then copies the buffers the op may write (is_output) device -> host.
  void download(Problem& host) const;
  void download(Problem& host, const std::string& name) const;

 private:
  struct Mirror {
    std::string name;
    void* data = nullptr;
    size_t bytes = 0;
  };
  const Mirror& find(const std::string& name) const;
  std::vector<Mirror> mirrors_;
  cudaStream_t stream_ = nullptr;
};

// Compare helpers shared by the step-op tests: outputs of every token, pool slots the op writes
// (with the spec's tolerance for the pool dtype), untouched slots bit-identical to `before`.
::testing::AssertionResult OutputsClose(const Problem& got, const Problem& ref, double tol);
::testing::AssertionResult SlotsClose(const Problem& got, const Problem& ref, const std::vector<int64_t>& slots,
                                      double tol, const std::string& name = "state");

}  // namespace gdnkit::test
