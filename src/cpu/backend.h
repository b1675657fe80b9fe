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
// A prefill split over ranks: begin (true) writes this rank's summaries, end the rest (split.cpp).
void split_prefill(const SplitPrefillParams& p, bool begin);
}  // namespace gdnkit::cpu
