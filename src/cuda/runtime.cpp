// Device discovery for the CUDA backend, and the process-wide launch switches.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <string>

#include "api/backends.h"
#include "cuda/check.h"

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

namespace {
// An on/off switch from the environment: on unless the variable is "0".
bool env_switch(const char* name) {
  const char* e = std::getenv(name);
  return e == nullptr || std::string(e) != "0";
}
// A count from the environment (negative values read as 0), -1 where `name` is unset.
int env_count(const char* name) {
  const char* e = std::getenv(name);
  return e == nullptr ? -1 : std::max(0, std::atoi(e));
}
}  // namespace

bool programmatic_launch_enabled() {
  static const bool enabled = env_switch("GDNKIT_PDL");
  return enabled;
}

int device_sms() {
  static const int sms = [] {
    int dev = 0, n = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0)
      return 132;
    return n;
  }();
  return sms;
}

bool state_prefetch_enabled() {
  static const bool enabled = env_switch("GDNKIT_PREFETCH");
  return enabled;
}

int chain_mma_min_tokens(int measured) {
  static const int from_env = [] {  // 0: unset
    const char* e = std::getenv("GDNKIT_CHAIN_MMA");
    if (e == nullptr) return 0;
    const int n = std::atoi(e);
    return n > 0 ? n : INT_MAX;  // "0" (or anything but a count): never
  }();
  return from_env > 0 ? from_env : measured;
}

int decode_narrow_batches(int measured) {
  static const int from_env = env_count("GDNKIT_DECODE_NARROW");
  return from_env >= 0 ? from_env : measured;
}

int decode_wide_batches(int measured) {
  static const int from_env = env_count("GDNKIT_DECODE_WIDE");
  return from_env >= 0 ? from_env : measured;
}

bool decode_mma_enabled() {
  static const bool enabled = env_switch("GDNKIT_DECODE_MMA");
  return enabled;
}

int prefill_aux_override() {
  static const int from_env = [] {  // -1: unset, or not one of 0, 1, 2 (then the default)
    const char* e = std::getenv("GDNKIT_PREFILL_AUX");
    if (e == nullptr || e[0] < '0' || e[0] > '2' || e[1] != '\0') return -1;
    return e[0] - '0';
  }();
  return from_env;
}

int prefill_short_reach(int measured) {
  static const int from_env = env_count("GDNKIT_PREFILL_SHORT");
  return from_env >= 0 ? from_env : measured;
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
