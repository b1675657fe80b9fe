// Prefill calls whose states no pass reads or writes in place (heuristics.h states_staged: float8_e4m3 pools or
// checkpoints in V-last, or in K-last past the passes' reach) run on K-last fp32 copies of the batch's states in the
// workspace: one kernel copies the initial states in and gives the staged call its slots, the passes run that call,
// one kernel stores its final states and checkpoints into the caller's buffers (docs/design/prefill.md "Staged
// states").
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "gdnkit/params.h"

namespace gdnkit::cuda::chunked_prefill {

// Bytes of the copies and the staged call's slots, in front of that call's own workspace (0 where not staged).
size_t staged_bytes(const PrefillParams& p);
// The staged call (staged_shape with its buffers and slots in `ws`, its workspace after them) and the kernel that
// fills its pool with the batch's initial states and writes its slots.
PrefillParams stage_states_in(const PrefillParams& p, void* ws, size_t ws_bytes, cudaStream_t stream);
// The staged call's final states and checkpoints to p's pool and checkpoint buffer.
void stage_states_out(const PrefillParams& p, const PrefillParams& staged, cudaStream_t stream);

}  // namespace gdnkit::cuda::chunked_prefill
