// A prefill split over an NCCL communicator's ranks: the two halves of the split prefill around an in-place
// all-gather of the piece summaries (docs/design/prefill.md "Split over ranks").
#include <string>

#include "gdnkit/nccl.h"

namespace gdnkit {
namespace {
void check(ncclResult_t r, const char* call) {
  if (r != ncclSuccess)
    throw Error(ErrorCode::kCudaError, std::string(call) + " failed: " + ncclGetErrorString(r));
}
}  // namespace

void split_prefill_nccl(const SplitPrefillParams& params, ncclComm_t comm, const Context& ctx) {
  if (ctx.backend != Backend::kCUDA)
    throw Error(ErrorCode::kInvalidArgument, "context: split_prefill_nccl runs on the CUDA backend");
  SplitPrefillParams p = params;
  check(ncclCommUserRank(comm, &p.rank), "ncclCommUserRank");
  check(ncclCommCount(comm, &p.num_ranks), "ncclCommCount");
  split_prefill_begin(p, ctx);  // validates first: nothing is written on bad params
  const int64_t elems = split_prefill_exchange_elems(p.local);
  if (elems > 0)
    check(ncclAllGather(p.exchange + int64_t(p.rank) * elems, p.exchange, size_t(elems), ncclFloat32, comm,
                        static_cast<cudaStream_t>(ctx.stream)),
          "ncclAllGather");
  split_prefill_end(p, ctx);
}

}  // namespace gdnkit
