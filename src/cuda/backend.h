// The CUDA backend's entries (defined only when the library is built with CUDA: GDNKIT_WITH_CUDA).
// Params arrive validated (src/api/validate.cpp); every entry enqueues on `stream` without host sync.
#pragma once

#include <cstddef>
#include <string>

#include "gdnkit/params.h"

namespace gdnkit::cuda {
void decode(const DecodeParams& p, Stream stream);
void verify(const VerifyParams& p, Stream stream);
void commit(const CommitParams& p, Stream stream);
void prefill(const PrefillParams& p, Stream stream);
void convert_layout(const LayoutParams& p, Stream stream);
size_t prefill_workspace_bytes(const PrefillParams& p);
// A prefill split over ranks: begin (true) or end (docs/design/prefill.md "Split over ranks").
void split_prefill_begin(const SplitPrefillParams& p, Stream stream);
void split_prefill_end(const SplitPrefillParams& p, Stream stream);
size_t split_prefill_workspace_bytes(const SplitPrefillParams& p);
bool device_usable();       // an sm_90 device is present and the runtime works
int device_sms();           // the current device's SM count (132 where the query fails)
std::string device_info();  // one line per device
}  // namespace gdnkit::cuda
