// The randomized differential tests' configuration draw (support/random_config.h): the same seed gives
// the same case, the one-line description parses back exactly, every drawn case is accepted by
// validation (CPU and CUDA rules) and stays inside what the CUDA backend implements, the fast tier keeps
// within its size budget and still reaches every axis; and the CPU backend's chunked prefill against its
// recurrence on fast-tier prefill draws.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/compare.h"
#include "support/problem.h"
#include "support/random_config.h"
#include "gdnkit/gdnkit.h"

namespace gdnkit::test {
namespace {

constexpr Tier kTiers[] = {Tier::kFast, Tier::kLong};

TEST(RandomConfig, SameSeedSameLine) {
  for (Tier tier : kTiers)
    for (uint64_t seed = 0; seed < 500; ++seed) ASSERT_EQ(describe(draw_case(seed, tier)), describe(draw_case(seed, tier)));
  // Pinned: the draw depends on nothing but the seed (no standard-library distribution), so this line is the
  // same on every platform; a change here changes the fast tier's cases.
  EXPECT_EQ(describe(draw_case(25, Tier::kFast)),
            "seed=25 tier=fast op=prefill H=2 HV=2 K=128 V=256 in=f32 gate=bf16 state=bf16 cache=bf16 layout=klast "
            "gating=fused l2=1 unit_qk=0 scale=0 token_pad=24 head_pad=0 slot_pad=24 pool_slots=0 batch=2 T=4 "
            "lens=48,0,32,68 padding_rows=0 oor_rows=0 oor_cache_rows=0 long_memory=0 corr_keys=0 extreme_gates=0 "
            "state_scale=0.5 tree=0 intermediate=1 update_state=0 cu=i32 cu_host=1 same_slot=0 zero_initial=0 "
            "no_final=0 ckpt=64 ckpt_steps=0 layout_target=0 in_place=0");
}

TEST(RandomConfig, DescribeParseRoundTrip) {
  for (Tier tier : kTiers)
    for (uint64_t seed = 1000; seed < 3000; ++seed) {
      const RandomCase c = draw_case(seed, tier);
      const std::string line = describe(c);
      ASSERT_EQ(line.find('\n'), std::string::npos);
      const RandomCase back = parse_case(line);
      ASSERT_EQ(describe(back), line);
      ASSERT_EQ(back.seed, c.seed);
      ASSERT_EQ(back.cfg.seq_lens, c.cfg.seq_lens);
      ASSERT_EQ(back.cfg.scale, c.cfg.scale);
      ASSERT_EQ(back.cfg.op, c.cfg.op);
    }
  // A large seed, and malformed lines.
  const RandomCase big = draw_case(~uint64_t(0), Tier::kLong);
  EXPECT_EQ(parse_case(describe(big)).seed, ~uint64_t(0));
  const std::string good = describe(draw_case(5, Tier::kFast));
  EXPECT_THROW(parse_case(good + " extra=1"), std::invalid_argument);
  EXPECT_THROW(parse_case(good.substr(0, good.rfind(' '))), std::invalid_argument);  // in_place missing
  EXPECT_THROW(parse_case("seed=1 tier=slow"), std::invalid_argument);
  std::string bad = good;
  bad.replace(bad.find(" K=") + 3, 1, "x");
  EXPECT_THROW(parse_case(bad), std::invalid_argument);
}

// A drawn case the API rejects is a bug in the draw.
void expect_valid(uint64_t seed, Tier tier) {
  const RandomCase c = draw_case(seed, tier);
  SCOPED_TRACE(describe(c));
  EXPECT_TRUE(cuda_implements(c));
  Problem p = build_problem(c);
  EXPECT_NO_THROW(validate_case(c, p, Backend::kCPU));
  EXPECT_NO_THROW(validate_case(c, p, Backend::kCUDA));  // host rules only: alignment, strides, pointers
}

TEST(RandomConfig, DrawsPassValidation) {
  for (uint64_t seed = 1; seed <= 150; ++seed) expect_valid(seed, Tier::kFast);
  // Long-tier problems are large: a sample of the ones that build quickly.
  int checked = 0;
  for (uint64_t seed = 1; checked < 5 && seed < 1000; ++seed)
    if (problem_bytes(draw_case(seed, Tier::kLong)) <= (int64_t(16) << 20)) expect_valid(seed, Tier::kLong), ++checked;
  EXPECT_EQ(checked, 5);
}

TEST(RandomConfig, FastTierWithinBudget) {
  int64_t cost = 0, tokens = 0;
  for (uint64_t seed = 1; seed <= 2000; ++seed) {
    const RandomCase c = draw_case(seed, Tier::kFast);
    ASSERT_LE(reference_cost(c), kFastTierCostBudget) << describe(c);
    ASSERT_LE(problem_bytes(c), kFastTierByteBudget) << describe(c);
    cost += reference_cost(c);
    if (c.op == RandomOp::kPrefill)
      for (int32_t l : c.cfg.seq_lens) tokens += l;
  }
  // The mean case is far below the cap (the GPU suite's time is sized from it).
  EXPECT_LE(cost / 2000, kFastTierCostBudget / 2);
  EXPECT_LE(tokens / 2000, 400);
}

// Every value of every axis is reached within the fast tier's first cases.
TEST(RandomConfig, FastTierCoversTheSpace) {
  std::map<std::string, std::set<std::string>> seen;
  for (uint64_t seed = 1; seed <= 2000; ++seed) {
    const RandomCase c = draw_case(seed, Tier::kFast);
    const ProblemConfig& p = c.cfg;
    auto see = [&](const std::string& axis, const std::string& value) { seen[axis].insert(value); };
    see("op", op_name(c.op));
    see("heads", std::to_string(p.H) + "x" + std::to_string(p.HV));
    see("KV", std::to_string(p.K) + "x" + std::to_string(p.V));
    see("in", dtype_name(p.in_dtype));
    see("gate", dtype_name(p.gate_dtype));
    see("state", dtype_name(p.state_dtype));
    see("cache", dtype_name(p.cache_dtype));
    see("layout", layout_name(p.layout));
    see("gating", p.gate_mode == GateMode::kFused ? "fused" : "given");
    see("l2", p.use_qk_l2norm ? "on" : "off");
    see("scale", p.scale > 0 ? "given" : "default");
    see("token_pad", p.token_pad ? "yes" : "no");
    see("head_pad", p.head_pad ? "yes" : "no");
    see("slot_pad", p.slot_pad ? "yes" : "no");
    see("long_memory", p.long_memory ? "yes" : "no");
    see("extreme_gates", p.extreme_gates ? "yes" : "no");
    if (c.op == RandomOp::kLayout) see("in_place", c.in_place ? "yes" : "no");
    if (c.op != RandomOp::kLayout && c.op != RandomOp::kPrefill) {
      see("padding", p.padding_rows ? "yes" : "no");
      see("oor", p.out_of_range_rows ? "yes" : "no");
      if (c.op != RandomOp::kDecode) {
        see("T", p.draft_tokens == 1 ? "1" : p.draft_tokens <= 8 ? "2..8" : p.draft_tokens <= 24 ? "9..24" : ">24");
        see("intermediate", p.intermediate ? "yes" : "no");
        see("oor_cache", p.out_of_range_cache_rows ? "yes" : "no");
      }
      if (c.op == RandomOp::kVerifyChain || c.op == RandomOp::kVerifyVarlen) see("update_state", p.update_state ? "yes" : "no");
      if (c.op == RandomOp::kVerifyVarlen) see("varlen_tree", p.tree ? "yes" : "no");
      if (c.op == RandomOp::kCommitCache || c.op == RandomOp::kCommitRecompute) {
        see("commit_tree", p.tree ? "yes" : "no");
        see("commit_varlen", p.seq_lens.empty() ? "no" : "yes");
      }
      const int32_t rows = p.seq_lens.empty() ? p.batch : int32_t(p.seq_lens.size());
      see("rows", rows == 1 ? "1" : rows <= 8 ? "2..8" : rows <= 32 ? "9..32" : ">32");
    }
    if (c.op == RandomOp::kPrefill) {
      for (int32_t l : p.seq_lens) see("len", l == 0 ? "0" : l < 64 ? "1..63" : l == 64 ? "64" : l < 129 ? "65..128" : ">128");
      see("cu", dtype_name(p.cu_seqlens_dtype));
      see("cu_host", p.pass_cu_seqlens_host ? "yes" : "no");
      see("same_slot", p.same_slot ? "yes" : "no");
      see("zero_initial", p.zero_initial_rows ? "yes" : "no");
      see("no_final", p.no_final_rows ? "yes" : "no");
      see("ckpt", p.checkpoint_interval ? std::to_string(p.checkpoint_interval) : "none");
      see("ckpt_steps", p.checkpoint_steps ? "given" : "default");
      see("corr_keys", p.correlated_keys ? "yes" : "no");
      see("oor_prefill", p.out_of_range_rows ? "yes" : "no");
    }
  }
  const std::map<std::string, size_t> want = {
      {"op", kNumRandomOps}, {"heads", 10}, {"KV", 9}, {"in", 3}, {"gate", 3}, {"state", 2}, {"cache", 2},
      {"layout", 2}, {"gating", 2}, {"l2", 2}, {"scale", 2}, {"token_pad", 2}, {"head_pad", 2}, {"slot_pad", 2},
      {"long_memory", 2}, {"extreme_gates", 2}, {"in_place", 2}, {"padding", 2}, {"oor", 2}, {"T", 4},
      {"intermediate", 2}, {"oor_cache", 2}, {"update_state", 2}, {"varlen_tree", 2}, {"commit_tree", 2},
      {"commit_varlen", 2}, {"rows", 4}, {"len", 5}, {"cu", 2}, {"cu_host", 2}, {"same_slot", 2},
      {"zero_initial", 2}, {"no_final", 2}, {"ckpt", 5}, {"ckpt_steps", 2}, {"corr_keys", 2}, {"oor_prefill", 2}};
  for (const auto& [axis, n] : want) {
    std::string values;
    for (const std::string& v : seen[axis]) values += " " + v;
    EXPECT_GE(seen[axis].size(), n) << axis << ":" << values;  // shrinking to the budget adds head shapes
  }
}

// The CPU backend's chunked prefill against its recurrence on fast-tier prefill draws (random lengths,
// slots past their buffers, checkpoints, gate regimes), within the spec's prefill tolerances.
TEST(RandomPrefillDifferential, CpuChunkedMatchesRecurrent) {
  int cases = 0;
  for (uint64_t seed = 1; cases < 20; ++seed) {
    const RandomCase c = draw_case(seed, Tier::kFast);
    if (c.op != RandomOp::kPrefill) continue;
    ++cases;
    SCOPED_TRACE(describe(c));
    const Problem before = build_problem(c);
    Problem rec = before, chk = before;
    run_case(c, rec, {Backend::kCPU, nullptr}, nullptr, PrefillAlgorithm::kRecurrent);
    run_case(c, chk, {Backend::kCPU, nullptr}, nullptr, PrefillAlgorithm::kChunked);
    const ProblemConfig& cfg = c.cfg;
    EXPECT_TRUE(RelClose("o", chk.read_tokens("o"), rec.read_tokens("o"), output_tolerance(OpFamily::kPrefill, cfg.in_dtype)));
    const std::vector<int64_t> finals = before.written_final_slots();
    for (int64_t slot : finals)
      EXPECT_TRUE(RelClose("final slot " + std::to_string(slot), chk.read_state("state", slot),
                           rec.read_state("state", slot), state_tolerance(OpFamily::kPrefill, cfg.state_dtype)));
    EXPECT_TRUE(UntouchedSlotsEqual(before, chk, "state", finals));
    const auto checkpoints = before.written_checkpoints();
    for (auto [slot, j] : checkpoints)
      EXPECT_TRUE(RelClose("checkpoint " + std::to_string(slot) + "/" + std::to_string(j), chk.read_cache("checkpoints", slot, j),
                           rec.read_cache("checkpoints", slot, j), state_tolerance(OpFamily::kPrefill, cfg.cache_dtype)));
    if (before.has("checkpoints")) EXPECT_EQ(chk.first_changed_cache_byte(before, "checkpoints", checkpoints), -1);
    EXPECT_EQ(chk.as<int32_t>("error_flag")[0], rec.as<int32_t>("error_flag")[0]);
  }
}

}  // namespace
}  // namespace gdnkit::test
