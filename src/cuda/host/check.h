// Host code of the CUDA backend: every runtime call checked (failures throw gdnkit::Error with the call,
// file and line), and the launch attribute for programmatic dependent launch.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "cuda/host/overrides.h"
#include "gdnkit/types.h"

namespace gdnkit::cuda {

[[noreturn]] inline void throw_cuda(cudaError_t err, const char* what, const char* file, int line) {
  throw Error(ErrorCode::kCudaError, std::string(what) + " failed: " + cudaGetErrorName(err) + " (" +
                                         cudaGetErrorString(err) + ") at " + file + ":" + std::to_string(line));
}

// Asks cudaLaunchKernelEx for programmatic dependent launch (the kernel may start while the previous
// kernel of the stream finishes; it must griddepcontrol.wait before reading that kernel's results) when
// `on` and the overrides leave PDL on. `attr` holds the attribute cfg points to.
inline void set_programmatic_launch(cudaLaunchConfig_t& cfg, cudaLaunchAttribute& attr, bool on) {
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = on && overrides().programmatic_launch ? 1 : 0;
}
// SMs of the current device (queried once; sizes the heuristics). Defined in host/device.cpp.
int device_sms();

}  // namespace gdnkit::cuda

#define GDNKIT_CUDA_CHECK(call)                                                     \
  do {                                                                              \
    cudaError_t gdnkit_err_ = (call);                                               \
    if (gdnkit_err_ != cudaSuccess) ::gdnkit::cuda::throw_cuda(gdnkit_err_, #call, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: reports launch-configuration errors without synchronizing.
#define GDNKIT_CUDA_CHECK_LAUNCH() GDNKIT_CUDA_CHECK(cudaGetLastError())

namespace gdnkit::cuda {
// Lets kKernel take `bytes` of dynamic shared memory on the current device. The attribute is per device: it is set
// once on each, so that a process driving several GPUs (one thread per GPU) launches on every one.
template <auto kKernel>
void allow_dynamic_smem(size_t bytes) {
  static std::atomic<uint64_t> done{0};  // bit d: set on device d
  int dev = 0;
  GDNKIT_CUDA_CHECK(cudaGetDevice(&dev));
  const uint64_t bit = dev < 64 ? uint64_t(1) << dev : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return;
  GDNKIT_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
  done.fetch_or(bit, std::memory_order_acq_rel);
}
}  // namespace gdnkit::cuda
