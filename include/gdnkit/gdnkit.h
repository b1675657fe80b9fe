// gdnkit: Gated DeltaNet kernels for serving. Public C++ API.
//
//   gdnkit::DecodeParams p;   // fill pointers, strides, sizes (see params.h)
//   gdnkit::decode(p, {gdnkit::Backend::kCUDA, stream});
//
// Every entry validates its params first and throws gdnkit::Error (nothing is written) when they are
// wrong. CUDA entries enqueue work on the stream and never synchronize the host: they are safe inside
// CUDA-graph capture.
#pragma once

#include <string>

#include "gdnkit/params.h"
#include "gdnkit/types.h"
#include "gdnkit/version.h"

namespace gdnkit {

struct Context {
  Backend backend = Backend::kCUDA;
  Stream stream = nullptr;  // CUDA backend only
};

void decode(const DecodeParams& params, const Context& ctx);
void verify(const VerifyParams& params, const Context& ctx);
void commit(const CommitParams& params, const Context& ctx);
void prefill(const PrefillParams& params, const Context& ctx);
void convert_layout(const LayoutParams& params, const Context& ctx);

// Validation alone (what every entry runs first); throws gdnkit::Error.
void validate(const DecodeParams& params, Backend backend);
void validate(const VerifyParams& params, Backend backend);
void validate(const CommitParams& params, Backend backend);
void validate(const PrefillParams& params, Backend backend);
void validate(const LayoutParams& params, Backend backend);

// Scratch bytes the CUDA prefill needs for these params (0 on the CPU backend).
size_t prefill_workspace_bytes(const PrefillParams& params);

// Prefill split over ranks (SplitPrefillParams). begin writes this rank's block of the exchange; end, after the
// all-gather, writes o, the checkpoints and the final states. Both take the same params and, on CUDA, the same
// workspace (local.workspace, or the library's own for the device): no other prefill may use it in between.
int64_t split_prefill_exchange_elems(const PrefillParams& local);  // fp32 elements of one rank's block: N HV K (K + V)
// 0 on the CPU backend; refuses (kNotImplemented) the float8_e4m3 buffers split_prefill_begin refuses on CUDA
size_t split_prefill_workspace_bytes(const SplitPrefillParams& params);
void split_prefill_begin(const SplitPrefillParams& params, const Context& ctx);
void split_prefill_end(const SplitPrefillParams& params, const Context& ctx);
void validate(const SplitPrefillParams& params, Backend backend);

// How the CUDA backend runs a prefill call's sequences (for tools and logs): sequences of at most
// short_max_len tokens on the recurrent kernels of decode and verify, the others on the chunked kernels, which
// cut sequences longer than context_parallel_segment tokens into segments of that length that run at once.
struct PrefillPath {
  int short_max_len = 0;                 // 0: every sequence on the chunked kernels
  int64_t context_parallel_segment = 0;  // 0: every sequence in one piece
};
PrefillPath prefill_path(const PrefillParams& params);

bool cuda_compiled();   // the library was built with the CUDA backend
bool cuda_available();  // ... and a usable sm_90 device is present
std::string build_info();  // "gdnkit <GDNKIT_VERSION_STRING>", compiler, CUDA version, architectures, devices

}  // namespace gdnkit
