// CUDA error handling for host code: every runtime call is checked; failures throw gdnkit::Error
// with the call, file and line.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "gdnkit/types.h"

namespace gdnkit::cuda {

[[noreturn]] inline void throw_cuda(cudaError_t err, const char* what, const char* file, int line) {
  throw Error(ErrorCode::kCudaError, std::string(what) + " failed: " + cudaGetErrorName(err) + " (" +
                                         cudaGetErrorString(err) + ") at " + file + ":" + std::to_string(line));
}

// Whether kernels that support it are launched with programmatic dependent launch (PDL): on unless the
// environment sets GDNKIT_PDL=0 (read once per process; for A/B timing). Defined in runtime.cpp.
bool programmatic_launch_enabled();
// Asks cudaLaunchKernelEx for programmatic dependent launch (the kernel may start while the previous
// kernel of the stream finishes; it must griddepcontrol.wait before reading that kernel's results) when
// `on` and programmatic_launch_enabled(). `attr` holds the attribute cfg points to.
inline void set_programmatic_launch(cudaLaunchConfig_t& cfg, cudaLaunchAttribute& attr, bool on) {
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = on && programmatic_launch_enabled() ? 1 : 0;
}
// Whether the recurrent kernels prefetch the state into L2 before griddepcontrol.wait: on unless
// GDNKIT_PREFETCH=0 (read once per process; for A/B timing). Defined in runtime.cpp.
bool state_prefetch_enabled();
// The fewest draft tokens T for which verify (chains without a cache) and commit by recompute run the
// tensor-core chain kernel (recurrent/chain_mma.cuh): `measured` unless GDNKIT_CHAIN_MMA sets it (a count
// n >= 1; 0: never). Read once per process; for A/B timing.
int chain_mma_min_tokens(int measured);
// The longest prefill sequence the short-sequence path takes (cuda/prefill.cu): `measured` unless
// GDNKIT_PREFILL_SHORT sets it (0: the path is off). Read once per process; for A/B timing.
int prefill_short_reach(int measured);
// The chunked prefill's prep warpgroup mode (prefill.cu choose_aux_prep) as GDNKIT_PREFILL_AUX sets it: 0, 1 or 2, or
// -1 when unset (the measured default). Read once per process; for A/B timing.
int prefill_aux_override();
// The largest batch K-last bf16-state decode (K = 128) runs on the narrow tile (recurrent/warp_tile.cuh; from
// B = 3, where the wide tile does not take it): `measured` unless GDNKIT_DECODE_NARROW sets it (0-2: never). Read
// once per process; for A/B timing.
int decode_narrow_batches(int measured);
// The largest batch K-last bf16-state decode (K = 128) runs on the wide tile (recurrent/warp_tile.cuh; from
// B = 2, where its grid is in prefetch mode): `measured` unless GDNKIT_DECODE_WIDE sets it (0-1: never). Read
// once per process; for A/B timing.
int decode_wide_batches(int measured);
// Whether K-last bf16-state decode with bf16 inputs runs the tensor-core kernel (recurrent/mma_decode.cuh) on the
// grids it is built for: on unless GDNKIT_DECODE_MMA=0 (read once per process; for A/B timing).
bool decode_mma_enabled();
// SMs of the first device asked (sizing heuristics only; 132 if the query fails). Defined in runtime.cpp.
int device_sms();

}  // namespace gdnkit::cuda

#define GDNKIT_CUDA_CHECK(call)                                                     \
  do {                                                                              \
    cudaError_t gdnkit_err_ = (call);                                               \
    if (gdnkit_err_ != cudaSuccess) ::gdnkit::cuda::throw_cuda(gdnkit_err_, #call, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: reports launch-configuration errors without synchronizing.
#define GDNKIT_CUDA_CHECK_LAUNCH() GDNKIT_CUDA_CHECK(cudaGetLastError())
