// The shared problem builder itself: deterministic, poisoned where it must be, params consistent.
#include <gtest/gtest.h>

#include <cmath>

#include "support/compare.h"
#include "support/problem.h"

namespace gdnkit::test {
namespace {

TEST(RefProblem, SameSeedSameValuesAcrossGateModes) {
  ProblemConfig c;
  c.op = OpKind::kVerify;
  c.gate_mode = GateMode::kFused;
  Problem fused(c);
  c.gate_mode = GateMode::kGiven;
  Problem given(c);
  EXPECT_TRUE(Identical("q", fused.read_tokens("q"), given.read_tokens("q")));
  EXPECT_TRUE(Identical("v", fused.read_tokens("v"), given.read_tokens("v")));
  EXPECT_TRUE(Identical("state", fused.read_state("state", fused.as<int32_t>("state_indices")[0]),
                        given.read_state("state", given.as<int32_t>("state_indices")[0])));
  // The given g is the fused formula of the stored a (in fp32).
  const auto a = fused.read_tokens("a"), g = given.read_tokens("g");
  const float* A_log = fused.as<float>("A_log");
  const float* dt_bias = fused.as<float>("dt_bias");
  for (size_t i = 0; i < a.size(); ++i) {
    const int h = int(i % c.HV);
    ASSERT_NEAR(g[i], fused_g(A_log[h], a[i], dt_bias[h]), 1e-6 * std::fabs(g[i]) + 1e-30) << i;
    ASSERT_LT(g[i], 0.0);
  }
}

TEST(RefProblem, PoisonedAndStrided) {
  ProblemConfig c;
  c.op = OpKind::kPrefill;
  c.seq_lens = {3, 0, 70};
  c.token_pad = 5;
  c.head_pad = 3;
  c.slot_pad = 17;
  c.checkpoint_interval = 64;
  Problem p(c);
  const PrefillParams pp = p.prefill_params();
  EXPECT_EQ(pp.total_tokens, 73);
  EXPECT_EQ(pp.q.head_stride, c.K + 3);
  EXPECT_EQ(pp.q.token_stride, c.H * (c.K + 3) + 5);
  EXPECT_EQ(pp.state.slot_stride, int64_t(c.HV) * c.K * c.V + 17);
  EXPECT_EQ(pp.checkpoints.num_steps, 1);
  for (double x : p.read_tokens("o")) ASSERT_TRUE(std::isnan(x));
  for (double x : p.read_tokens("q")) ASSERT_TRUE(std::isfinite(x));
  // Padding between q heads is NaN (a kernel reading it would produce NaN).
  const auto* qb = p.as<uint16_t>("q");
  EXPECT_EQ(qb[c.K], 0x7fc0);
  // Unused pool slots are NaN; used initial slots are finite.
  const int32_t s0 = p.as<int32_t>("initial_indices")[0];
  for (double x : p.read_state("state", s0)) ASSERT_TRUE(std::isfinite(x));
  const int32_t f0 = p.as<int32_t>("final_indices")[0];
  ASSERT_NE(f0, s0);
  for (double x : p.read_state("state", f0)) ASSERT_TRUE(std::isnan(x));
}

TEST(RefProblem, ResolverMapsEveryPointer) {
  ProblemConfig c;
  c.op = OpKind::kVerify;
  c.tree = true;
  Problem p(c);
  int calls = 0;
  std::vector<std::string> names;
  const Resolver r = [&](const Buffer& b) -> void* {
    ++calls;
    names.push_back(b.name);
    return const_cast<std::byte*>(b.bytes.data());
  };
  const CommitParams cp = p.commit_params(CommitSource::kCache, r);
  EXPECT_EQ(cp.parent, p.as<int32_t>("parent"));
  EXPECT_EQ(cp.accepted_path, p.as<int32_t>("accepted_path"));
  EXPECT_GE(calls, 12);
  // Every buffer the params reference exists in buffers() (what a GPU test mirrors).
  for (const auto& n : names) EXPECT_TRUE(p.has(n)) << n;
}

}  // namespace
}  // namespace gdnkit::test
