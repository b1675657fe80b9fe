// Device discovery for the CUDA backend.
#include <cuda_runtime.h>

#include <string>

#include "cuda/backend.h"
#include "cuda/host/check.h"

namespace gdnkit::cuda {

bool device_usable() {
  static const bool usable = [] {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      cudaGetLastError();  // clear the sticky "no device" error
      return false;
    }
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return false;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return false;
    return major == 9;  // kernels are built for sm_90a only
  }();
  return usable;
}

int device_sms() {
  static const int sms = [] {
    int dev = 0, n = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) {
      cudaGetLastError();
      return 132;  // an H100 SXM's count: only sizes heuristics when the query fails
    }
    return n;
  }();
  return sms;
}

std::string device_info() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return "devices: none\n";
  }
  std::string s;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    s += "device " + std::to_string(i) + ": " + prop.name + ", sm_" + std::to_string(prop.major) +
         std::to_string(prop.minor) + ", " + std::to_string(prop.multiProcessorCount) + " SMs, " +
         std::to_string(prop.totalGlobalMem >> 20) + " MiB, L2 " + std::to_string(prop.l2CacheSize >> 20) +
         " MiB\n";
  }
  return s;
}

}  // namespace gdnkit::cuda
