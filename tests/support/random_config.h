// The configuration space of the randomized differential tests: one seeded draw of an op and every option
// the API accepts for it (heads, dims, dtypes, layout, gating, strided views, batch and lengths, slots
// past their buffers, checkpoints, gate regimes), a one-line description that parses back exactly, and
// the op run on a built problem. Host code only: the CPU suite checks the draws, the GPU suite runs them.
//
//   const RandomCase c = draw_case(seed, Tier::kFast);
//   std::printf("%s\n", describe(c).c_str());      // seed=... tier=fast op=prefill H=2 HV=8 ...
//   Problem p = build_problem(c);                    // == build_problem(parse_case(describe(c)))
//   run_case(c, p, {Backend::kCPU, nullptr});
//
// The draw uses its own splitmix64 stream (no <random> distributions, whose output differs between
// standard libraries), so a seed names the same case everywhere.
#pragma once

#include <cstdint>
#include <string>

#include "gdnkit/gdnkit.h"
#include "support/problem.h"

namespace gdnkit::test {

// kFast: small problems, the default suite. kLong: larger batches, heads and lengths (prefill up to
// ~70000 tokens), for runs asked for by name.
enum class Tier { kFast, kLong };

enum class RandomOp {
  kDecode,
  kVerifyChain,
  kVerifyTree,
  kVerifyVarlen,  // chain or tree, lengths by cu_seqlens
  kCommitCache,   // verify, then commit from the intermediate cache
  kCommitRecompute,
  kPrefill,
  kLayout,
};
inline constexpr int kNumRandomOps = 8;

struct RandomCase {
  uint64_t seed = 0;  // also the problem's seed (cfg.seed)
  Tier tier = Tier::kFast;
  RandomOp op = RandomOp::kDecode;
  ProblemConfig cfg;      // every field of the problem
  bool in_place = false;  // layout conversion with dst == src (K == V)
  // prefill: context-parallel segments of this many tokens where the CUDA call can take them; 0: the library's
  // choice (an optional key of the line: older lines parse as 0)
  int32_t cp_segment = 0;
};

RandomCase draw_case(uint64_t seed, Tier tier);

// One line with the seed, the tier and every field; parse_case reads it back (throws std::invalid_argument
// on a malformed line). describe(parse_case(describe(c))) == describe(c).
std::string describe(const RandomCase& c);
RandomCase parse_case(const std::string& line);

const char* op_name(RandomOp op);
const char* tier_name(Tier tier);

// Work of the CPU reference for the case, in state-element updates (token-head steps x K x V; a layout
// conversion counts one per element moved). Fast-tier draws stay within kFastTierCostBudget.
int64_t reference_cost(const RandomCase& c);
inline constexpr int64_t kFastTierCostBudget = int64_t(12) << 20;
// Bytes of the host buffers build_problem allocates (one copy, mirrored on the device by the GPU suite).
// Fast-tier draws stay within kFastTierByteBudget.
int64_t problem_bytes(const RandomCase& c);
inline constexpr int64_t kFastTierByteBudget = int64_t(32) << 20;

// What the CUDA backend implements of the accepted space (docs/semantics.md "Bad input": K == V for the
// step ops, trees of at most 64 tokens, at most 65535 sequences): draws stay inside it.
bool cuda_implements(const RandomCase& c);

// The problem of the case (for a layout conversion every pool slot holds a random state).
Problem build_problem(const RandomCase& c);

// Validates the case's params (commit: verify's and commit's) on `backend`; throws gdnkit::Error.
void validate_case(const RandomCase& c, Problem& p, Backend backend);

// Runs the case's op on `p` (commit: verify, then commit) through the public API. `resolver` maps the
// buffers to the backend's memory; `algo` is prefill's CPU algorithm.
void run_case(const RandomCase& c, Problem& p, const Context& ctx, const Resolver& resolver = nullptr,
              PrefillAlgorithm algo = PrefillAlgorithm::kAuto);

CommitSource commit_source(const RandomCase& c);

}  // namespace gdnkit::test
