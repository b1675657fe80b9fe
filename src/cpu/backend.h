// The CPU reference backend's entries. Params arrive validated (src/api/validate.cpp).
#pragma once

#include "gdnkit/params.h"

namespace gdnkit::cpu {
void decode(const DecodeParams& p);
void verify(const VerifyParams& p);
void commit(const CommitParams& p);
void prefill(const PrefillParams& p);           // dispatches on p.cpu_algorithm
void prefill_recurrent(const PrefillParams& p);  // token by token, the recurrence itself
void prefill_chunked(const PrefillParams& p);    // chunk 64, WY form: the blueprint of the CUDA prefill
void convert_layout(const LayoutParams& p);
// A prefill split over ranks (split.cpp): begin writes this rank's summaries, end the rest.
void split_prefill_begin(const SplitPrefillParams& p);
void split_prefill_end(const SplitPrefillParams& p);
}  // namespace gdnkit::cpu
