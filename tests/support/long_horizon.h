// The long-horizon check (docs/semantics.md "Tolerances"): one sequence's prefill, then decode steps on the same
// pool slot, run on any backend; the CPU and GPU suites compare 16-bit pools against the fp32 pool's run, and that
// run against the fp64 recurrence.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "gdnkit/gdnkit.h"

namespace gdnkit::test {

// One head, K = V = 128, given gates: q, k, v ~ N(0, 1) (the op's L2 norm normalizes q and k), beta =
// sigmoid(N(0, 1)); gates near 0 (long memory), or with one token in ten decaying fast (mixed).
struct LongHorizonInputs {
  int64_t tokens = 0;
  std::vector<float> q, k, v, g, beta;
};
LongHorizonInputs long_horizon_inputs(int64_t tokens, bool mixed, uint64_t seed);

struct LongHorizonRun {
  std::vector<float> prefill_o;  // the prefill's outputs [prefill_tokens][V]
  std::vector<float> o;          // the decode steps' outputs
  std::vector<float> state;      // the final state, in the pool's K-last order [V][K]
  bool inputs_unchanged = false;  // q, k, v, g, beta and the slot indices bit-identical after the run
};

// The recurrence in fp64 (docs/semantics.md) over every token of `in` from S = 0, with the ops' L2 norm and scale:
// o [tokens][V] and the final state in the pool's K-last order [V][K].
struct LongHorizonExact {
  std::vector<double> o, state;
};
LongHorizonExact long_horizon_fp64(const LongHorizonInputs& in);

// Memory the backend and the host both address (host memory for the CPU backend, managed memory for CUDA), and
// a wait for the backend's work.
struct LongHorizonMemory {
  std::function<void*(size_t)> alloc;
  std::function<void(void*)> release;
  std::function<void()> sync;
};

// The first prefill_tokens tokens as one prefill from S = 0, the rest as decode steps, on a pool of pool_dtype (o and
// the pool NaN before the run);
// fp8_once (fp32 pool): the state after the prefill rounded through float8_e4m3 blocks once, as a prefix-cache
// checkpoint stored in e4m3 and restored into an fp32 pool.
LongHorizonRun long_horizon_run(const LongHorizonInputs& in, int64_t prefill_tokens, DType pool_dtype,
                                const Context& ctx, const LongHorizonMemory& mem, bool fp8_once = false);

// ||x - ref|| / ||ref||
double long_horizon_rel(const std::vector<float>& x, const std::vector<float>& ref);

// Prefill and decode lengths: GDNKIT_LONG_HORIZON="T,D", else the defaults given.
void long_horizon_lengths(int64_t& prefill_tokens, int64_t& decode_steps);

// Both regimes with bf16 and fp16 pools against the fp32 pool on ctx: prints the table and expects fp16's errors
// below a quarter of bf16's (3 more significant bits: an eighth of the rounding). In both this and the fp8 check, the
// fp32 pool's run (prefill o, decode o, final state) and every run's prefill o are held to the fp64 recurrence, and
// every run leaves its inputs unchanged.
void expect_long_horizon(const Context& ctx, const LongHorizonMemory& mem, int64_t prefill_tokens,
                         int64_t decode_steps, const char* backend);

// Both regimes with a float8_e4m3 pool against the fp32 pool on ctx (bf16's error beside it, and e4m3 once after
// the prefill): prints the table and expects e4m3's errors well above bf16's and below 0.5, and one rounding far
// below a rounding per step.
void expect_long_horizon_fp8(const Context& ctx, const LongHorizonMemory& mem, int64_t prefill_tokens,
                             int64_t decode_steps, const char* backend);

}  // namespace gdnkit::test
