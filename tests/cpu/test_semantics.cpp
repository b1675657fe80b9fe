// Semantics of the ops beyond the arithmetic (docs/semantics.md "Ops", "Bad input"): padding rows, out-of-range
// slots and the error flag, read-before-write prefill slots, layouts and their conversion, bf16 state
// rounding points, cu_seqlens dtypes, strided views, gating modes, int64 slot offsets.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "cpu/backend.h"
#include "support/compare.h"
#include "support/naive.h"
#include "support/problem.h"

namespace gdnkit::test {
namespace {

std::vector<double> o_rows(const Problem& p, int64_t t0, int64_t t1) {
  return token_rows(p.read_tokens("o"), int64_t(p.config().HV) * p.config().V, t0, t1);
}

int32_t& index_at(Problem& p, const std::string& name, int64_t i) { return p.as<int32_t>(name)[i]; }

// ---- padding rows ---------------------------------------------------------------------------------

TEST(SemPadding, DecodeVerifyCommitSkipPaddingRows) {
  ProblemConfig c;
  c.op = OpKind::kVerify;
  c.batch = 5;
  c.draft_tokens = 3;
  c.padding_rows = 2;
  c.update_state = true;
  Problem p(c);
  Problem d = p;  // decode on the same slots (one token per row: rows are T apart, harmless)
  const Problem before = p;
  cpu::verify(p.verify_params());
  for (int32_t r = 0; r < p.rows(); ++r) {
    if (index_at(p, "state_indices", r) >= 0) continue;
    EXPECT_TRUE(AllZero("padding row " + std::to_string(r) + " o", o_rows(p, p.row_start(r), p.row_start(r) + 3)));
    // A padding row stores nothing in its intermediate slot either.
    const int32_t islot = index_at(p, "intermediate_indices", r);
    for (int t = 0; t < 3; ++t)
      for (double x : p.read_cache("intermediate", islot, t)) ASSERT_TRUE(std::isnan(x));
  }
  EXPECT_TRUE(UntouchedSlotsEqual(before, p, "state", p.written_pool_slots_verify()));
  EXPECT_EQ(p.as<int32_t>("error_flag")[0], 0);

  const Problem after_verify = p;
  cpu::commit(p.commit_params(CommitSource::kRecompute));
  EXPECT_TRUE(
      UntouchedSlotsEqual(after_verify, p, "state", p.written_pool_slots_commit(CommitSource::kRecompute)));
  EXPECT_EQ(p.as<int32_t>("error_flag")[0], 0);

  cpu::decode(d.decode_params());
  EXPECT_TRUE(UntouchedSlotsEqual(before, d, "state", d.written_pool_slots_decode()));
  for (int32_t r = 0; r < d.rows(); ++r)
    if (index_at(d, "state_indices", r) < 0) {
      EXPECT_TRUE(AllZero("decode padding row o", o_rows(d, r, r + 1)));
    }
}

TEST(SemPadding, AllPaddingTouchesNothingButOutputs) {
  ProblemConfig c;
  c.batch = 3;
  c.padding_rows = 3;
  Problem p(c);
  const Problem before = p;
  cpu::decode(p.decode_params());
  EXPECT_TRUE(BitwiseEqual("state", p.buffer("state"), before.buffer("state")));
  EXPECT_TRUE(AllZero("o", p.read_tokens("o")));
}

// ---- out-of-range slots: skipped, counted, outputs 0 ----------------------------------------------

// Runs `op` on a copy where row `bad_row` was broken by `breakit`, and on a copy where that row is
// padding instead; everything but the error flag must match bit for bit (the bad row is skipped).
template <class Break, class Op>
void expect_skipped(const ProblemConfig& c, int bad_row, Break breakit, Op op, int expected_flags = 1) {
  Problem bad(c);
  Problem pad = bad;
  breakit(bad);
  if (pad.has("state_indices")) index_at(pad, "state_indices", bad_row) = -1;
  if (pad.has("initial_indices")) {
    // prefill: the skipped sequence neither reads nor writes; its outputs are 0 (see below).
    index_at(pad, "initial_indices", bad_row) = -1;
    index_at(pad, "final_indices", bad_row) = -1;
    if (pad.has("checkpoint_indices")) index_at(pad, "checkpoint_indices", bad_row) = -1;
  }
  op(bad);
  op(pad);
  EXPECT_EQ(bad.as<int32_t>("error_flag")[0], expected_flags);
  EXPECT_EQ(pad.as<int32_t>("error_flag")[0], 0);
  EXPECT_TRUE(
      AllZero("skipped row o", o_rows(bad, bad.row_start(bad_row), bad.row_start(bad_row) + bad.row_len(bad_row))));
  if (!pad.has("initial_indices")) {  // prefill's padding twin computes the row from S = 0
    EXPECT_TRUE(BitwiseEqual("o", bad.buffer("o"), pad.buffer("o")));
  }
  EXPECT_TRUE(BitwiseEqual("state", bad.buffer("state"), pad.buffer("state")));
  for (const char* cache : {"intermediate", "checkpoints"})
    if (bad.has(cache)) {
      EXPECT_TRUE(BitwiseEqual(cache, bad.buffer(cache), pad.buffer(cache)));
    }
}

ProblemConfig verify_config() {
  ProblemConfig c;
  c.op = OpKind::kVerify;
  c.batch = 4;
  c.draft_tokens = 4;
  c.update_state = true;
  c.seed = 5;
  return c;
}

TEST(SemOutOfRange, DecodeSlotBeyondPool) {
  ProblemConfig c;
  c.batch = 4;
  expect_skipped(
      c, 2, [](Problem& p) { index_at(p, "state_indices", 2) = int32_t(p.num_slots()); },
      [](Problem& p) { cpu::decode(p.decode_params()); });
  expect_skipped(
      c, 0, [](Problem& p) { index_at(p, "state_indices", 0) = int32_t(p.num_slots()) + 1000; },
      [](Problem& p) { cpu::decode(p.decode_params()); });
}

TEST(SemOutOfRange, NullErrorFlagStillSkips) {
  ProblemConfig c;
  c.batch = 3;
  Problem p(c);
  index_at(p, "state_indices", 1) = int32_t(p.num_slots()) + 3;
  const Problem before = p;
  DecodeParams d = p.decode_params();
  d.error_flag = nullptr;
  cpu::decode(d);
  EXPECT_TRUE(AllZero("o", o_rows(p, 1, 2)));
  EXPECT_TRUE(
      UntouchedSlotsEqual(before, p, "state", {index_at(p, "state_indices", 0), index_at(p, "state_indices", 2)}));
}

TEST(SemOutOfRange, VerifySlotIntermediateSlotAndParent) {
  const auto run = [](Problem& p) { cpu::verify(p.verify_params()); };
  expect_skipped(
      verify_config(), 1, [](Problem& p) { index_at(p, "state_indices", 1) = int32_t(p.num_slots()); }, run);
  expect_skipped(
      verify_config(), 3, [](Problem& p) { index_at(p, "intermediate_indices", 3) = 1 << 30; }, run);
  ProblemConfig tree = verify_config();
  tree.tree = true;
  tree.update_state = false;
  expect_skipped(
      tree, 2, [](Problem& p) { index_at(p, "parent", 2 * 4 + 1) = 1; }, run);  // parent[t] == t
  expect_skipped(
      tree, 0, [](Problem& p) { index_at(p, "parent", 0 * 4 + 3) = -2; }, run);  // below -1
}

TEST(SemOutOfRange, VerifyVarlenRowLongerThanT) {
  ProblemConfig c = verify_config();
  c.seq_lens = {2, 4, 1};
  Problem p(c);
  const Problem before = p;
  index_at(p, "cu_seqlens", 2) = index_at(p, "cu_seqlens", 1) + 6;  // row 1 claims 6 > T tokens
  cpu::verify(p.verify_params());
  // Rows 1 and 2 become impossible (row 2 then has a negative length): both counted, neither written.
  EXPECT_EQ(p.as<int32_t>("error_flag")[0], 2);
  EXPECT_TRUE(UntouchedSlotsEqual(before, p, "state", {index_at(p, "state_indices", 0)}));
}

TEST(SemOutOfRange, CommitBadAcceptedPathOrCacheSlot) {
  struct Breaker {
    const char* what;
    bool tree;
    bool cache_only;
    void (*apply)(Problem& p, int32_t r);
  };
  const Breaker breakers[] = {
      {"accepted > T", false, false, [](Problem& p, int32_t r) { index_at(p, "accepted", r) = 5; }},
      {"accepted < 0", false, false, [](Problem& p, int32_t r) { index_at(p, "accepted", r) = -1; }},
      {"accepted_path entry = T", true, false,
       [](Problem& p, int32_t r) {
         index_at(p, "accepted", r) = std::max(index_at(p, "accepted", r), 1);
         index_at(p, "accepted_path", int64_t(r) * 4) = 4;
       }},
      {"intermediate slot >= Q", false, true,
       [](Problem& p, int32_t r) {
         index_at(p, "accepted", r) = 2;
         index_at(p, "intermediate_indices", r) = 1 << 20;
       }},
  };
  for (const Breaker& br : breakers)
    for (CommitSource src : {CommitSource::kCache, CommitSource::kRecompute}) {
      if (br.cache_only && src != CommitSource::kCache) continue;
      ProblemConfig c = verify_config();
      c.update_state = false;
      c.tree = br.tree;
      Problem p(c);
      cpu::verify(p.verify_params());
      const int32_t r = 2;
      br.apply(p, r);
      const Problem before = p;
      cpu::commit(p.commit_params(src));
      EXPECT_EQ(p.as<int32_t>("error_flag")[0], 1) << br.what;
      std::vector<int64_t> written = before.written_pool_slots_commit(src);
      written.erase(std::remove(written.begin(), written.end(), int64_t(index_at(p, "state_indices", r))),
                    written.end());
      EXPECT_TRUE(UntouchedSlotsEqual(before, p, "state", written)) << br.what;
      EXPECT_FALSE(written.empty()) << br.what;  // the other rows did commit
    }
}

TEST(SemOutOfRange, CommitCachedStepBeyondTheCache) {
  // A cache with fewer steps than the kept token's index: that row is skipped and counted.
  ProblemConfig c = verify_config();
  c.update_state = false;
  Problem p(c);
  cpu::verify(p.verify_params());
  for (int32_t r = 0; r < p.rows(); ++r) index_at(p, "accepted", r) = r == 1 ? 4 : 2;
  const Problem before = p;
  CommitParams cp = p.commit_params(CommitSource::kCache);
  cp.intermediate.num_steps = 3;  // steps 0..2 exist; row 1 needs step 3
  cpu::commit(cp);
  EXPECT_EQ(p.as<int32_t>("error_flag")[0], 1);
  std::vector<int64_t> written = before.written_pool_slots_commit(CommitSource::kCache);
  written.erase(std::remove(written.begin(), written.end(), int64_t(index_at(p, "state_indices", 1))), written.end());
  EXPECT_EQ(written.size(), 3u);
  EXPECT_TRUE(UntouchedSlotsEqual(before, p, "state", written));
}

TEST(SemOutOfRange, CommitRowWithCacheSlotPastTheCache) {
  // From the cache the row is skipped whole and counted, its pool slot held bit-identical; by recompute the cache
  // slot is not read and the row commits.
  for (CommitSource src : {CommitSource::kCache, CommitSource::kRecompute}) {
    ProblemConfig c = verify_config();
    c.update_state = false;
    c.out_of_range_cache_rows = 1;  // row 0's cache slot is Q
    Problem p(c);
    ASSERT_EQ(index_at(p, "intermediate_indices", 0), p.cache_slots());
    index_at(p, "accepted", 0) = 2;
    cpu::verify(p.verify_params());
    const Problem before = p;
    cpu::commit(p.commit_params(src));
    const bool from_cache = src == CommitSource::kCache;
    EXPECT_EQ(p.as<int32_t>("error_flag")[0], before.as<int32_t>("error_flag")[0] + (from_cache ? 1 : 0));
    const std::vector<int64_t> written = before.written_pool_slots_commit(src);
    const int64_t slot0 = index_at(p, "state_indices", 0);
    EXPECT_EQ(std::count(written.begin(), written.end(), slot0), from_cache ? 0 : 1);
    EXPECT_TRUE(UntouchedSlotsEqual(before, p, "state", written));
    if (!from_cache) {  // the row committed, as with its cache slot in range (recompute reads no cache)
      Problem in_range = before;
      index_at(in_range, "intermediate_indices", 0) = 0;
      cpu::commit(in_range.commit_params(src));
      EXPECT_EQ(p.read_state("state", slot0), in_range.read_state("state", slot0));
      EXPECT_NE(p.read_state("state", slot0), before.read_state("state", slot0));
    }
  }
}

ProblemConfig prefill_config() {
  ProblemConfig c;
  c.op = OpKind::kPrefill;
  c.seq_lens = {70, 5, 130};
  c.checkpoint_interval = 64;
  c.seed = 9;
  return c;
}

TEST(SemOutOfRange, PrefillSlots) {
  for (PrefillAlgorithm algo : {PrefillAlgorithm::kRecurrent, PrefillAlgorithm::kChunked}) {
    const auto run = [algo](Problem& p) { cpu::prefill(p.prefill_params(algo)); };
    expect_skipped(
        prefill_config(), 0, [](Problem& p) { index_at(p, "initial_indices", 0) = int32_t(p.num_slots()); }, run);
    expect_skipped(
        prefill_config(), 2, [](Problem& p) { index_at(p, "final_indices", 2) = int32_t(p.num_slots()) + 7; }, run);
    expect_skipped(
        prefill_config(), 1, [](Problem& p) { index_at(p, "checkpoint_indices", 1) = 99; }, run);
  }
}

TEST(SemOutOfRange, PrefillSequenceBeyondTotal) {
  Problem p(prefill_config());
  const Problem before = p;
  PrefillParams pp = p.prefill_params();
  pp.total_tokens = 100;  // sequence 2 ends at 205 > T_total: skipped, counted; sequences 0, 1 run
  pp.cu_seqlens_host = nullptr;
  cpu::prefill(pp);
  EXPECT_EQ(p.as<int32_t>("error_flag")[0], 1);
  EXPECT_TRUE(
      UntouchedSlotsEqual(before, p, "state", {index_at(p, "final_indices", 0), index_at(p, "final_indices", 1)}));
  for (double x : o_rows(p, 75, 205)) ASSERT_TRUE(std::isnan(x));  // not addressable: not written at all
}

// ---- prefill slots -----------------------------------------------------------------------------

TEST(SemPrefill, FinalMayEqualInitial) {
  for (PrefillAlgorithm algo : {PrefillAlgorithm::kRecurrent, PrefillAlgorithm::kChunked}) {
    ProblemConfig c = prefill_config();
    Problem distinct(c);
    c.same_slot = true;
    Problem same(c);
    cpu::prefill(distinct.prefill_params(algo));
    cpu::prefill(same.prefill_params(algo));
    EXPECT_TRUE(BitwiseEqual("o", same.buffer("o"), distinct.buffer("o")));
    for (int32_t n = 0; n < same.rows(); ++n) {
      EXPECT_EQ(index_at(same, "final_indices", n), index_at(same, "initial_indices", n));
      EXPECT_TRUE(Identical("final state", same.read_state("state", index_at(same, "final_indices", n)),
                            distinct.read_state("state", index_at(distinct, "final_indices", n))));
    }
  }
}

TEST(SemPrefill, NoInitialMeansZeroStateNoFinalMeansNotStored) {
  ProblemConfig c = prefill_config();
  c.zero_initial_rows = 2;
  c.no_final_rows = 1;
  c.seq_lens = {3, 0, 66};
  Problem p(c);
  const Problem before = p;
  cpu::prefill(p.prefill_params());
  const NaiveModel m(before);
  const std::vector<double> zero(p.state_elems(), 0.0);
  std::vector<double> o;
  const auto S0 = m.run(zero, {0, 1, 2}, &o);
  EXPECT_TRUE(RelClose("seq 0 o", o_rows(p, 0, 3), round_to(o, c.in_dtype), 2e-4));
  EXPECT_TRUE(RelClose("seq 0 final", p.read_state("state", index_at(p, "final_indices", 0)), S0, 2e-6));
  // An empty sequence from S = 0 stores zeros.
  EXPECT_TRUE(AllZero("seq 1 final", p.read_state("state", index_at(p, "final_indices", 1))));
  EXPECT_EQ(index_at(p, "final_indices", 2), -1);
  EXPECT_TRUE(UntouchedSlotsEqual(before, p, "state", p.written_pool_slots_prefill()));
  // The same with null index tensors.
  Problem q = before;
  PrefillParams pp = q.prefill_params();
  pp.initial_indices = nullptr;
  pp.final_indices = nullptr;
  cpu::prefill(pp);
  EXPECT_TRUE(BitwiseEqual("state", q.buffer("state"), before.buffer("state")));
  EXPECT_TRUE(Identical("seq 0 o", o_rows(q, 0, 3), o_rows(p, 0, 3)));
}

TEST(SemPrefill, EmptySequenceCopiesInitialToFinal) {
  ProblemConfig c = prefill_config();
  c.seq_lens = {0, 4};
  Problem p(c);
  const Problem before = p;
  cpu::prefill(p.prefill_params());
  EXPECT_TRUE(Identical("final = initial", p.read_state("state", index_at(p, "final_indices", 0)),
                        before.read_state("state", index_at(p, "initial_indices", 0))));
}

TEST(SemPrefill, CheckpointsOnlyWhereDue) {
  ProblemConfig c = prefill_config();
  c.seq_lens = {200, 63, 128};
  c.checkpoint_interval = 64;
  c.checkpoint_steps = 2;  // seq 0 reaches 3 checkpoints, only 2 fit
  Problem p(c);
  cpu::prefill(p.prefill_params(PrefillAlgorithm::kChunked));
  auto stored = [&](int32_t n, int64_t j) {
    return !std::isnan(p.read_cache("checkpoints", index_at(p, "checkpoint_indices", n), j)[0]);
  };
  EXPECT_TRUE(stored(0, 0));
  EXPECT_TRUE(stored(0, 1));
  EXPECT_FALSE(stored(1, 0));  // 63 < C
  EXPECT_TRUE(stored(2, 0));
  EXPECT_TRUE(stored(2, 1));  // after token 128 = the final state
  EXPECT_TRUE(Identical("checkpoint at the end == final state",
                        p.read_cache("checkpoints", index_at(p, "checkpoint_indices", 2), 1),
                        p.read_state("state", index_at(p, "final_indices", 2))));
  // The spare checkpoint slot (Q = N + 1) is untouched.
  std::vector<int32_t> used = {index_at(p, "checkpoint_indices", 0), index_at(p, "checkpoint_indices", 1),
                               index_at(p, "checkpoint_indices", 2)};
  for (int32_t s = 0; s < p.rows() + 1; ++s)
    if (std::find(used.begin(), used.end(), s) == used.end()) {
      for (double x : p.read_cache("checkpoints", s, 0)) ASSERT_TRUE(std::isnan(x));
    }
}

TEST(SemPrefill, Int64CuSeqlensAndNoHostCopy) {
  ProblemConfig c = prefill_config();
  Problem a(c);
  c.cu_seqlens_dtype = DType::kInt64;
  c.pass_cu_seqlens_host = false;
  Problem b(c);
  cpu::prefill(a.prefill_params(PrefillAlgorithm::kChunked));
  cpu::prefill(b.prefill_params(PrefillAlgorithm::kChunked));
  EXPECT_TRUE(BitwiseEqual("o", a.buffer("o"), b.buffer("o")));
  EXPECT_TRUE(BitwiseEqual("state", a.buffer("state"), b.buffer("state")));
  EXPECT_TRUE(BitwiseEqual("checkpoints", a.buffer("checkpoints"), b.buffer("checkpoints")));
}

// ---- layouts ---------------------------------------------------------------------------------------

// Same inputs in both layouts (the K-last problem's states copied into the V-last one): results are
// the same numbers, only stored transposed.
TEST(SemLayout, KLastEqualsVLastTransposed) {
  for (OpKind op : {OpKind::kDecode, OpKind::kVerify, OpKind::kPrefill}) {
    ProblemConfig c;
    c.op = op;
    c.K = 64, c.V = 128;
    c.state_dtype = DType::kBFloat16;
    c.draft_tokens = 3;
    c.tree = true;
    c.seq_lens = op == OpKind::kPrefill ? std::vector<int32_t>{70, 3} : std::vector<int32_t>{};
    c.layout = StateLayout::kKLast;
    Problem kl(c);
    c.layout = StateLayout::kVLast;
    Problem vl(c);
    for (int64_t s = 0; s < kl.num_slots(); ++s) {
      const auto S = kl.read_state("state", s);
      if (!std::isnan(S[0])) vl.write_state("state", s, S);
    }
    if (op == OpKind::kDecode) {
      cpu::decode(kl.decode_params());
      cpu::decode(vl.decode_params());
    } else if (op == OpKind::kVerify) {
      cpu::verify(kl.verify_params());
      cpu::verify(vl.verify_params());
      cpu::commit(kl.commit_params(CommitSource::kCache));
      cpu::commit(vl.commit_params(CommitSource::kCache));
      for (int32_t r = 0; r < kl.rows(); ++r)
        for (int t = 0; t < 3; ++t)
          EXPECT_TRUE(Identical("intermediate",
                                kl.read_cache("intermediate", index_at(kl, "intermediate_indices", r), t),
                                vl.read_cache("intermediate", index_at(vl, "intermediate_indices", r), t)));
    } else {
      cpu::prefill(kl.prefill_params(PrefillAlgorithm::kChunked));
      cpu::prefill(vl.prefill_params(PrefillAlgorithm::kChunked));
    }
    EXPECT_TRUE(BitwiseEqual("o", kl.buffer("o"), vl.buffer("o")));
    for (int64_t s = 0; s < kl.num_slots(); ++s) {
      const auto a = kl.read_state("state", s), b = vl.read_state("state", s);
      if (std::isnan(a[0])) continue;
      EXPECT_TRUE(Identical("slot " + std::to_string(s), a, b));
    }
  }
}

TEST(SemLayout, ConvertRoundTripAndInPlace) {
  struct Dims {
    int K, V;
    DType dtype;
    StateLayout from;
  };
  for (const Dims d :
       {Dims{64, 128, DType::kFloat32, StateLayout::kKLast}, Dims{256, 64, DType::kBFloat16, StateLayout::kVLast},
        Dims{128, 128, DType::kBFloat16, StateLayout::kKLast}, Dims{64, 64, DType::kFloat32, StateLayout::kVLast}}) {
    ProblemConfig c;
    c.K = d.K, c.V = d.V;
    c.state_dtype = d.dtype;
    c.layout = d.from;
    c.slot_pad = 5;
    c.layout_target = true;
    Problem p(c);
    const Problem before = p;
    cpu::convert_layout(p.layout_params(/*in_place=*/false));
    EXPECT_TRUE(BitwiseEqual("src", p.buffer("state"), before.buffer("state")));
    for (int64_t s = 0; s < p.num_slots(); ++s) {
      const auto a = p.read_state("state", s), b = p.read_state("state_t", s);
      if (std::isnan(a[0])) {
        for (double x : b) ASSERT_TRUE(std::isnan(x));
        continue;
      }
      EXPECT_TRUE(Identical("slot " + std::to_string(s), b, a));
    }
    // Slot padding of the destination stays untouched (NaN-poisoned).
    EXPECT_TRUE(UntouchedSlotsEqual(before, p, "state_t", [&] {
      std::vector<int64_t> all(p.num_slots());
      std::iota(all.begin(), all.end(), 0);
      return all;
    }()));
    // Back again: bit-identical to the original pool.
    LayoutParams back = p.layout_params(false);
    std::swap(back.src, back.dst);
    Problem q = p;
    std::memset(q.buffer("state").bytes.data(), 0xff, q.buffer("state").bytes.size());
    back.src.data = q.buffer("state_t").bytes.data();
    back.dst.data = q.buffer("state").bytes.data();
    cpu::convert_layout(back);
    for (int64_t s = 0; s < p.num_slots(); ++s) {
      const int64_t off = s * p.slot_stride() * dtype_size(d.dtype);
      EXPECT_EQ(0, std::memcmp(q.buffer("state").bytes.data() + off, before.buffer("state").bytes.data() + off,
                               p.state_elems() * dtype_size(d.dtype)))
          << "slot " << s;
    }
    if (d.K != d.V) continue;
    // In place (K == V): twice is the identity, once is the transpose.
    Problem ip = before;
    cpu::convert_layout(ip.layout_params(/*in_place=*/true));
    const auto first = ip.read_state("state", ip.as<int32_t>("state_indices")[0]);
    const auto orig = before.read_state("state", ip.as<int32_t>("state_indices")[0]);
    // read_state reads with the original layout: after one in-place pass it sees S^T.
    std::vector<double> transposed(orig.size());
    for (int h = 0; h < c.HV; ++h)
      for (int k = 0; k < d.K; ++k)
        for (int v = 0; v < d.V; ++v)
          transposed[(int64_t(h) * d.K + k) * d.V + v] = orig[(int64_t(h) * d.K + v) * d.V + k];
    EXPECT_TRUE(Identical("in place once", first, transposed));
    cpu::convert_layout(ip.layout_params(/*in_place=*/true));
    EXPECT_TRUE(BitwiseEqual("in place twice", ip.buffer("state"), before.buffer("state")));
  }
}

// ---- bf16 state: rounding only when storing --------------------------------------------------------

TEST(SemStateDtype, Bf16IsFp32RoundedOnceAtTheStore) {
  for (OpKind op : {OpKind::kDecode, OpKind::kVerify, OpKind::kPrefill}) {
    ProblemConfig c;
    c.op = op;
    c.draft_tokens = 5;
    c.update_state = true;
    c.seq_lens = op == OpKind::kPrefill ? std::vector<int32_t>{130, 7} : std::vector<int32_t>{};
    c.checkpoint_interval = 64;
    c.state_dtype = DType::kBFloat16;
    c.cache_dtype = DType::kBFloat16;
    Problem b16(c);
    c.state_dtype = DType::kFloat32;
    c.cache_dtype = DType::kFloat32;
    Problem f32(c);
    for (int64_t s = 0; s < b16.num_slots(); ++s) {  // identical starting values (bf16-exact)
      const auto S = b16.read_state("state", s);
      if (!std::isnan(S[0])) f32.write_state("state", s, S);
    }
    std::vector<std::string> caches;
    if (op == OpKind::kDecode) {
      cpu::decode(b16.decode_params());
      cpu::decode(f32.decode_params());
    } else if (op == OpKind::kVerify) {
      cpu::verify(b16.verify_params());
      cpu::verify(f32.verify_params());
      caches = {"intermediate"};
    } else {
      cpu::prefill(b16.prefill_params());
      cpu::prefill(f32.prefill_params());
      caches = {"checkpoints"};
    }
    EXPECT_TRUE(BitwiseEqual("o", b16.buffer("o"), f32.buffer("o")));
    for (int64_t s = 0; s < b16.num_slots(); ++s) {
      const auto a = b16.read_state("state", s);
      if (!std::isnan(a[0])) {
        EXPECT_TRUE(Identical("slot " + std::to_string(s), a, round_to(f32.read_state("state", s), DType::kBFloat16)));
      }
    }
    for (const auto& name : caches) {
      const int64_t steps = op == OpKind::kVerify ? 5 : 2;
      for (int32_t s = 0; s < b16.rows() + 1; ++s)
        for (int64_t j = 0; j < steps; ++j) {
          const auto a = b16.read_cache(name, s, j);
          if (!std::isnan(a[0])) {
            EXPECT_TRUE(Identical(name, a, round_to(f32.read_cache(name, s, j), DType::kBFloat16)));
          }
        }
    }
  }
}

// ---- views, gates, options -----------------------------------------------------------------------

TEST(SemViews, StridedViewsAndSlotPaddingGiveIdenticalResults) {
  for (OpKind op : {OpKind::kDecode, OpKind::kVerify, OpKind::kPrefill}) {
    ProblemConfig c;
    c.op = op;
    c.tree = true;
    c.seq_lens = op == OpKind::kPrefill ? std::vector<int32_t>{65, 2} : std::vector<int32_t>{};
    Problem dense(c);
    c.token_pad = 7, c.head_pad = 9, c.slot_pad = 33;
    Problem strided(c);
    const Problem before = strided;
    const auto run = [op](Problem& p) {
      if (op == OpKind::kDecode) cpu::decode(p.decode_params());
      if (op == OpKind::kVerify) cpu::verify(p.verify_params());
      if (op == OpKind::kPrefill) cpu::prefill(p.prefill_params(PrefillAlgorithm::kChunked));
    };
    run(dense);
    run(strided);
    EXPECT_TRUE(Identical("o", strided.read_tokens("o"), dense.read_tokens("o")));
    for (int64_t s = 0; s < dense.num_slots(); ++s) {
      const auto a = dense.read_state("state", s);
      if (!std::isnan(a[0])) {
        EXPECT_TRUE(Identical("slot " + std::to_string(s), strided.read_state("state", s), a));
      }
    }
    // The padding of o (between heads and tokens) is never written.
    EXPECT_TRUE(OutputPaddingUntouched(before, strided));
    if (op != OpKind::kVerify) {
      EXPECT_TRUE(UntouchedSlotsEqual(
          before, strided, "state",
          op == OpKind::kDecode ? strided.written_pool_slots_decode() : strided.written_pool_slots_prefill()));
    } else {
      // verify (a tree: no update_state) writes the intermediate cache, not the pool
      EXPECT_TRUE(BitwiseEqual("state", strided.buffer("state"), before.buffer("state")));
      const auto entries = dense.written_intermediate();
      ASSERT_FALSE(entries.empty());
      for (const auto& [slot, step] : entries) {
        const std::string what = "intermediate " + std::to_string(slot) + "/" + std::to_string(step);
        EXPECT_TRUE(Identical(what, strided.read_cache("intermediate", slot, step),
                              dense.read_cache("intermediate", slot, step)));
      }
      EXPECT_EQ(strided.first_changed_cache_byte(before, "intermediate", strided.written_intermediate()), -1);
    }
  }
}

TEST(SemGates, GivenGatesEqualFusedFormula) {
  ProblemConfig c;
  c.op = OpKind::kVerify;
  c.gate_dtype = DType::kBFloat16;
  c.in_dtype = DType::kFloat32;
  Problem fused(c);
  c.gate_mode = GateMode::kGiven;
  Problem given(c);
  cpu::verify(fused.verify_params());
  cpu::verify(given.verify_params());
  // Given g is the fused value rounded to fp32 and beta rounded to bf16: close, not equal.
  EXPECT_TRUE(RelClose("o", given.read_tokens("o"), fused.read_tokens("o"), 4e-3));  // bf16 beta: 2^-9 a token
  EXPECT_FALSE(Identical("o", given.read_tokens("o"), fused.read_tokens("o")));
}

TEST(SemGates, SoftplusThresholdScaleAndNoL2Norm) {
  ProblemConfig c;
  c.op = OpKind::kPrefill;
  c.seq_lens = {40};
  c.in_dtype = DType::kFloat32;
  c.use_qk_l2norm = false;
  c.scale = 0.03f;
  c.long_memory = true;
  Problem p(c);
  // Push some a + dt_bias past the softplus threshold (20): softplus(x) = x there.
  for (int64_t t = 0; t < 40; t += 3) p.as<float>("a")[t * c.HV] = 25.0f;
  const Problem before = p;
  cpu::prefill(p.prefill_params());
  const NaiveModel m(before);
  EXPECT_NEAR(m.g(0, 0), -std::exp(double(before.as<float>("A_log")[0])) * (25.0 + before.as<float>("dt_bias")[0]),
              1e-9);
  std::vector<int64_t> tokens(40);
  std::iota(tokens.begin(), tokens.end(), 0);
  std::vector<double> o;
  const auto S = m.run(before.read_state("state", index_at(p, "initial_indices", 0)), tokens, &o);
  EXPECT_TRUE(RelClose("o", p.read_tokens("o"), round_to(o, DType::kFloat32), 2e-6));
  EXPECT_TRUE(RelClose("state", p.read_state("state", index_at(p, "final_indices", 0)), S, 2e-6));
}

TEST(SemGates, L2NormEpsInsideTheRoot) {
  // Tiny q, k: with the eps inside the root, x / sqrt(|x|^2 + 1e-6) is far from unit length.
  ProblemConfig c;
  c.in_dtype = DType::kFloat32;
  c.batch = 1;
  Problem p(c);
  for (const char* name : {"q", "k"}) {
    float* x = p.as<float>(name);
    for (int i = 0; i < c.H * c.K; ++i) x[i] *= 1e-4f;
  }
  const Problem before = p;
  cpu::decode(p.decode_params());
  const NaiveModel m(before);
  double kk = 0;
  for (int i = 0; i < c.K; ++i) kk += m.k(0, 0)[i] * m.k(0, 0)[i];
  EXPECT_LT(kk, 0.5);  // the normalization really is eps-dominated here
  std::vector<double> o;
  const auto S = m.run(before.read_state("state", index_at(p, "state_indices", 0)), {0}, &o);
  EXPECT_TRUE(RelClose("o", p.read_tokens("o"), round_to(o, DType::kFloat32), 2e-6));
}

// ---- 64-bit slot offsets -------------------------------------------------------------------------------

// slot * slot_stride beyond 2^31 elements: the pool is addressed through a base pointer placed so
// that only slot 1 (at element offset 2^31 + 2^20) lands in real memory. A 32-bit offset would wrap
// and read / write elsewhere.
TEST(SemOffsets, SlotOffsetsBeyond2To31) {
  ProblemConfig c;
  c.batch = 1;
  c.state_dtype = DType::kBFloat16;
  c.pool_slots = 1;
  Problem ref(c);
  Problem big = ref;
  cpu::decode(ref.decode_params());
  DecodeParams d = big.decode_params();
  const int64_t stride = (int64_t(1) << 31) + (1 << 20);
  auto* real = static_cast<std::byte*>(d.state.data);
  d.state.data = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(real) - uintptr_t(stride) * 2);
  d.state.slot_stride = stride;
  d.state.num_slots = 2;
  index_at(big, "state_indices", 0) = 1;
  cpu::decode(d);
  EXPECT_TRUE(BitwiseEqual("o", big.buffer("o"), ref.buffer("o")));
  EXPECT_TRUE(BitwiseEqual("state", big.buffer("state"), ref.buffer("state")));
}

}  // namespace
}  // namespace gdnkit::test
