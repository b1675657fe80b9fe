// Index values only the device sees, out of the spec's range: a varlen verify span before token 0 or past the
// B*T token rows, a tree commit whose accepted path does not follow the draft tree, a chain commit whose accepted path
// is not the chain's prefix. The CPU backend rejects
// them on the host; on CUDA the row is skipped and counted in error_flag and the other rows are computed as
// usual (docs/semantics.md "Padding, out-of-range slots and the error flag").
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "support/compare.h"
#include "support/problem.h"
#include "gdnkit/gdnkit.h"
#include "gpu/gpu_harness.h"

namespace gdnkit::test {
namespace {

// state float8_e4m3: an fp8 cache too (verify of chains then runs the fp8 chain kernel).
ProblemConfig verify_config(bool tree, uint64_t seed, DType state = DType::kFloat32) {
  ProblemConfig c;
  c.op = OpKind::kVerify;
  c.batch = 3, c.draft_tokens = 4, c.H = 1, c.HV = 2, c.K = c.V = 64;
  c.tree = tree, c.update_state = !tree, c.seed = seed;
  if (!tree) c.seq_lens = {2, 3, 3};
  c.state_dtype = state;
  if (state == DType::kFloat8E4M3) c.cache_dtype = state;
  return c;
}

// Token rows [begin, end) of `name` ([T_total][HV][V]) as doubles.
std::vector<double> token_rows(const Problem& p, const std::string& name, int64_t begin, int64_t end) {
  const std::vector<double> all = p.read_tokens(name);
  const size_t per = all.size() / size_t(p.total_tokens());
  return std::vector<double>(all.begin() + begin * per, all.begin() + end * per);
}

// cu_seqlens rewritten on the device so that row 0 keeps its span and rows 1 and 2 become unplaceable with a
// length inside 0..T: starting before token 0, or ending past B*T = 12.
TEST(VerifyGpu, VarlenSpanOutsideTheTokenRowsSkippedAndCountedSanitize) {
  const std::vector<std::vector<int32_t>> bad_cus = {{0, 2, -1, 2}, {0, 2, 10, 13}};
  for (DType state : {DType::kFloat32, DType::kFloat8E4M3})
  for (const auto& cu : bad_cus) {
    const Problem before(verify_config(false, 7100, state));
    Problem ref = before, got = before;
    DeviceProblem dev(got);
    verify(ref.verify_params(), {Backend::kCPU, nullptr});
    std::copy(cu.begin(), cu.end(), got.as<int32_t>("cu_seqlens"));
    dev.upload(got, "cu_seqlens");
    verify(got.verify_params(dev.resolver()), {Backend::kCUDA, dev.stream()});
    dev.download(got);
    const std::string what = "cu_seqlens {" + std::to_string(cu[1]) + ", " + std::to_string(cu[2]) + ", " +
                             std::to_string(cu[3]) + "}, state " + dtype_name(state);
    // Row 0 as in the reference; rows 1 and 2 counted (row 1's length is negative, row 2's span ends past the token rows).
    EXPECT_EQ(got.as<int32_t>("error_flag")[0], ref.as<int32_t>("error_flag")[0] + 2) << what;
    EXPECT_TRUE(RelClose("row 0's o", token_rows(got, "o", 0, 2), token_rows(ref, "o", 0, 2),
                         output_tolerance(OpFamily::kStep, before.config().in_dtype)))
        << what;
    const int32_t* slots = before.as<int32_t>("state_indices");
    for (int r = 1; r < 3; ++r)
      if (slots[r] >= 0)
        EXPECT_TRUE(Identical("row " + std::to_string(r) + "'s slot (skipped)", got.read_state("state", slots[r]),
                              before.read_state("state", slots[r])))
            << what;
    const std::vector<int64_t> written = slots[0] >= 0 ? std::vector<int64_t>{slots[0]} : std::vector<int64_t>{};
    EXPECT_TRUE(SlotsClose(got, ref, written, state_tolerance(OpFamily::kStep, before.config().state_dtype))) << what;
    EXPECT_TRUE(UntouchedSlotsEqual(before, got, "state", written)) << what;
    // Only row 0's tokens were written: the NaN-poisoned rows past them are untouched.
    const std::vector<double> rest = token_rows(got, "o", 2, before.total_tokens());
    EXPECT_EQ(std::count_if(rest.begin(), rest.end(), [](double x) { return !std::isnan(x); }), 0) << what;
    EXPECT_TRUE(OutputPaddingUntouched(before, got)) << what;
    // The cache: row 0's two states stored as the reference's, every other entry untouched.
    const int64_t islot0 = before.as<int32_t>("intermediate_indices")[0];
    std::vector<std::pair<int64_t, int64_t>> stored;
    if (slots[0] >= 0) stored = {{islot0, 0}, {islot0, 1}};
    SCOPED_TRACE(what);
    check_intermediate_entries(before, got, ref, stored);
  }
}

// After a commit whose row 0 the device skips (got) and the CPU reference without that row's fault (ref), from the
// pool `before`: one more error counted, row 0's slot untouched, the other written slots as the reference's.
void expect_row0_skipped(const Problem& before, const Problem& got, const Problem& ref, CommitSource src,
                         DType state) {
  const std::string name = std::string(src == CommitSource::kCache ? "from the cache" : "by recompute") + ", state " +
                           dtype_name(state);
  EXPECT_EQ(got.as<int32_t>("error_flag")[0], ref.as<int32_t>("error_flag")[0] + 1) << name;
  const int64_t slot0 = before.as<int32_t>("state_indices")[0];
  ASSERT_GE(slot0, 0) << name;
  EXPECT_TRUE(Identical("row 0's slot (skipped)", got.read_state("state", slot0), before.read_state("state", slot0)))
      << name;
  std::vector<int64_t> others;
  for (int64_t s : before.written_pool_slots_commit(src))
    if (s != slot0) others.push_back(s);
  EXPECT_TRUE(SlotsClose(got, ref, others, state_tolerance(OpFamily::kStep, before.config().state_dtype))) << name;
  EXPECT_TRUE(UntouchedSlotsEqual(before, got, "state", others)) << name;
  // What the verify before it wrote, which commit only reads: o and the cache as the reference's verify left them.
  const ProblemConfig& c = before.config();
  EXPECT_TRUE(OutputsClose(got, ref, output_tolerance(OpFamily::kStep, c.in_dtype))) << name;
  EXPECT_TRUE(OutputPaddingUntouched(before, got)) << name;
  SCOPED_TRACE(name);
  check_intermediate_entries(before, got, ref, before.written_intermediate());
}

// A tree commit whose path for row 0 is made of valid token indices that do not follow parent[]: on the
// device, the row is skipped and counted, from the cache and by recompute.
TEST(CommitGpu, TreePathThatIsNotAPathSkippedAndCountedSanitize) {
  for (DType state : {DType::kFloat32, DType::kFloat8E4M3})
  for (CommitSource src : {CommitSource::kCache, CommitSource::kRecompute}) {
    Problem p(verify_config(true, 7200, state));
    const int T = p.config().draft_tokens;
    // Row 0: token 1 hangs off the pool state, token 2 off token 1; the path {2, 1} lists them out of order.
    int32_t* parent = p.as<int32_t>("parent");
    parent[0] = -1, parent[1] = -1, parent[2] = 1, parent[3] = 0;
    p.as<int32_t>("accepted")[0] = 2;
    int32_t* path = p.as<int32_t>("accepted_path");
    path[0] = 1, path[1] = 2;
    for (int i = 2; i < T; ++i) path[i] = -1;
    Problem ref = p, got = p;
    DeviceProblem dev(got);
    verify(ref.verify_params(), {Backend::kCPU, nullptr});
    commit(ref.commit_params(src), {Backend::kCPU, nullptr});
    verify(got.verify_params(dev.resolver()), {Backend::kCUDA, dev.stream()});
    got.as<int32_t>("accepted_path")[0] = 2, got.as<int32_t>("accepted_path")[1] = 1;
    dev.upload(got, "accepted_path");
    commit(got.commit_params(src, dev.resolver()), {Backend::kCUDA, dev.stream()});
    dev.download(got);
    expect_row0_skipped(p, got, ref, src, state);
  }
}

// A chain commit given an accepted_path for row 0 that is not the chain's prefix (token 1 alone, every index in range):
// on the device, the row is skipped and counted, from the cache and by recompute; the other rows keep their prefixes.
TEST(CommitGpu, ChainPathThatIsNotItsPrefixSkippedAndCountedSanitize) {
  for (DType state : {DType::kFloat32, DType::kFloat8E4M3})
  for (CommitSource src : {CommitSource::kCache, CommitSource::kRecompute}) {
    ProblemConfig c = verify_config(false, 7300, state);
    c.update_state = false;  // the pool keeps its states until the commit
    Problem p(c);
    const int B = c.batch, T = c.draft_tokens;
    int32_t* accepted = p.as<int32_t>("accepted");
    accepted[0] = 1, accepted[1] = 2, accepted[2] = 3;  // row lengths 2, 3, 3
    std::vector<int32_t> path(size_t(B) * T, -1);
    for (int b = 1; b < B; ++b)
      for (int i = 0; i < accepted[b]; ++i) path[size_t(b) * T + i] = i;
    path[0] = 1;
    Problem ref = p, got = p;
    DeviceProblem dev(got);
    verify(ref.verify_params(), {Backend::kCPU, nullptr});
    commit(ref.commit_params(src), {Backend::kCPU, nullptr});  // row 0 without a path: its slot is not compared
    verify(got.verify_params(dev.resolver()), {Backend::kCUDA, dev.stream()});
    int32_t* d_path = nullptr;
    GDNKIT_TEST_CUDA(cudaMalloc(&d_path, path.size() * 4));
    GDNKIT_TEST_CUDA(cudaMemcpy(d_path, path.data(), path.size() * 4, cudaMemcpyHostToDevice));
    CommitParams cp = got.commit_params(src, dev.resolver());
    cp.accepted_path = d_path;
    commit(cp, {Backend::kCUDA, dev.stream()});
    dev.download(got);
    GDNKIT_TEST_CUDA(cudaFree(d_path));
    expect_row0_skipped(p, got, ref, src, state);
  }
}

}  // namespace
}  // namespace gdnkit::test
