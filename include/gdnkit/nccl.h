// gdnkit over NCCL (the gdnkit::nccl library; built when CMake finds NCCL: GDNKIT_NCCL).
//
//   gdnkit::SplitPrefillParams p;   // this rank's pieces, pool and buffers; p.exchange: num_ranks blocks
//   gdnkit::split_prefill_nccl(p, comm, {gdnkit::Backend::kCUDA, stream});
#pragma once

#include <nccl.h>

#include "gdnkit/gdnkit.h"

namespace gdnkit {

// A prefill split over the ranks of `comm` (SplitPrefillParams; rank and num_ranks are the communicator's):
// split_prefill_begin, an in-place all-gather of the exchange, split_prefill_end, all on ctx.stream, without a host
// sync. Every rank of the communicator calls it with the same N and heads. Params refused on one rank throw there
// before its all-gather, while the other ranks wait in theirs: keep them valid on every rank. CUDA graph capture works
// where NCCL's does.
void split_prefill_nccl(const SplitPrefillParams& params, ncclComm_t comm, const Context& ctx);

}  // namespace gdnkit
