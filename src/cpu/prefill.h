// CPU reference prefill: the per-sequence driver shared by the recurrent and the chunked algorithm.
#pragma once

#include <cstdint>
#include <functional>

#include "cpu/reference.h"
#include "gdnkit/params.h"

namespace gdnkit::cpu::detail {

// Called with the state after token (j+1)*C of the sequence (j = 0, 1, ...); the driver stores it
// when the sequence has a checkpoint slot and j < checkpoints.num_steps.
using CheckpointFn = std::function<void(int64_t j, const double* S)>;

// Runs tokens [start, start + len) of value head h on S (K x V, in/out), writes o for every token and
// reports checkpoints every `interval` tokens (0: none).
using SequenceFn = void (*)(const TokenReader& reader, const OutView& o, int64_t start, int64_t len, int h,
                            int64_t interval, double* S, const CheckpointFn& checkpoint);

// cu_seqlens[i] in either index dtype.
int64_t cu_at(const PrefillParams& p, int64_t i);

// For each sequence: checks its range and slots, loads the initial state (or zeros), runs `fn` per
// value head and stores the final state and the checkpoints.
void run_prefill(const PrefillParams& p, SequenceFn fn);

// The chunked algorithm for one (sequence, head): see prefill_chunked.cpp.
void chunked_sequence(const TokenReader& reader, const OutView& o, int64_t start, int64_t len, int h, int64_t interval,
                      double* S, const CheckpointFn& checkpoint);

}  // namespace gdnkit::cpu::detail
