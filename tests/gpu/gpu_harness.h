// Device mirroring of test problems (tests/support/problem.h) for the GPU suite, generic over ops, and the
// per-op checks of a backend's results against the CPU reference:
//
//   Problem ref(cfg), got = ref;
//   DeviceProblem dev(got);                                   // every buffer copied to the device
//   gdnkit::cpu::decode(ref.decode_params());                 // (or the public API with kCPU)
//   gdnkit::decode(got.decode_params(dev.resolver()), {Backend::kCUDA, dev.stream()});
//   dev.download(got);                                        // outputs back (syncs the stream), inputs checked
//   EXPECT_TRUE(RelClose("o", got.read_tokens("o"), ref.read_tokens("o"), tol));
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <utility>
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
  // Syncs the stream, then copies the buffers the op may write (is_output) device -> host, and expects every other
  // buffer (the inputs) on the device bit-identical to host's: a test that writes an input on the device writes
  // host's copy too (then upload(host, name)).
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
// Cache buffer `name` (intermediate / checkpoints) bit-identical to `before` outside `entries` (slot, step).
::testing::AssertionResult CacheUntouched(const Problem& before, const Problem& after, const std::string& name,
                                          const std::vector<std::pair<int64_t, int64_t>>& entries);

// Every check of one op's results: `got` (the backend under test) against `ref` (the CPU reference), both run
// from copies of `before`. Failures are reported with EXPECT_*, so a caller can go on to its next problem.
// decode: outputs, written slots, untouched slots bit-identical, error_flag, o = 0 on padding and skipped rows.
void check_decode_results(const Problem& before, const Problem& got, const Problem& ref);
// verify: outputs, update_state slots, untouched slots, error_flag, intermediate entries stored / untouched.
void check_verify_results(const Problem& before, const Problem& got, const Problem& ref);
// commit (after verify on both sides): committed slots, untouched slots, error_flag.
void check_commit_results(const Problem& before, const Problem& got, const Problem& ref, CommitSource source);
// prefill: outputs, final slots of the sequences that run, untouched slots, checkpoint entries stored /
// untouched, error_flag.
void check_prefill_results(const Problem& before, const Problem& got, const Problem& ref);
// the intermediate cache: the entries `stored` (cache slot, step) close to the reference's, every other byte untouched.
void check_intermediate_entries(const Problem& before, const Problem& got, const Problem& ref,
                                const std::vector<std::pair<int64_t, int64_t>>& stored);
// layout conversion of every slot of `before` (Problem::fill_every_slot): exact, slot padding untouched, the
// source of an out-of-place conversion unchanged. In place, `got`'s state_t receives its converted pool.
void check_layout_results(const Problem& before, Problem& got, bool in_place);

}  // namespace gdnkit::test
