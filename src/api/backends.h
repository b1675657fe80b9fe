// Internal: the entry points each backend implements. Params arrive already validated.
#pragma once

#include <string>

#include "gdnkit/params.h"

namespace gdnkit::cpu {
void decode(const DecodeParams& p);
void verify(const VerifyParams& p);
void commit(const CommitParams& p);
void prefill(const PrefillParams& p);           // dispatches on p.cpu_algorithm
void prefill_recurrent(const PrefillParams& p);  // token by token, the spec's recurrence
void prefill_chunked(const PrefillParams& p);    // chunk 64, WY form: the blueprint of the CUDA prefill
void convert_layout(const LayoutParams& p);
}  // namespace gdnkit::cpu

namespace gdnkit::cuda {
// Defined only when the library is built with CUDA (GDNKIT_WITH_CUDA).
void decode(const DecodeParams& p, Stream stream);
void verify(const VerifyParams& p, Stream stream);
void commit(const CommitParams& p, Stream stream);
void prefill(const PrefillParams& p, Stream stream);
void convert_layout(const LayoutParams& p, Stream stream);
size_t prefill_workspace_bytes(const PrefillParams& p);
bool device_usable();       // an sm_90 device is present and the runtime works
std::string device_info();  // one line per device
}  // namespace gdnkit::cuda
