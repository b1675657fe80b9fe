// The long horizon on the CPU backend (support/long_horizon.h): bf16, fp16 and float8_e4m3 pools against the fp32
// pool.
// GDNKIT_LONG_HORIZON="T,D" sets the prefill and decode lengths (default 4096 and 512).
#include <gtest/gtest.h>

#include <cstdlib>

#include "support/long_horizon.h"

namespace gdnkit::test {
namespace {

TEST(LongHorizon, SixteenBitPoolsAgainstFp32) {
  int64_t T = 4096, D = 512;
  long_horizon_lengths(T, D);
  const LongHorizonMemory host{[](size_t bytes) { return std::malloc(bytes); }, [](void* p) { std::free(p); },
                               [] {}};
  expect_long_horizon({Backend::kCPU, nullptr}, host, T, D, "cpu");
}

TEST(LongHorizon, Fp8PoolAgainstFp32) {
  int64_t T = 4096, D = 512;
  long_horizon_lengths(T, D);
  const LongHorizonMemory host{[](size_t bytes) { return std::malloc(bytes); }, [](void* p) { std::free(p); },
                               [] {}};
  expect_long_horizon_fp8({Backend::kCPU, nullptr}, host, T, D, "cpu");
}

}  // namespace
}  // namespace gdnkit::test
