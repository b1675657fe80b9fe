// GPU suite entry: runs the CUDA backend against the CPU reference, or skips visibly (exit 77,
// which CTest reports as "Skipped") on a machine without a usable GPU.
#include <gtest/gtest.h>

#include <cstdio>

#include "gdnkit/gdnkit.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (!gdnkit::cuda_available()) {
    std::printf("SKIPPED: GPU tests need a CUDA sm_90 device and a CUDA build (%s)\n",
                gdnkit::cuda_compiled() ? "built with CUDA, no usable device" : "built without CUDA");
    return 77;
  }
  return RUN_ALL_TESTS();
}
