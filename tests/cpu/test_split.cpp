// Prefill split over ranks (split_prefill_begin / _end) on the CPU backend: ranks simulated in one process, the
// exchange one buffer (an all-gather in place). Outputs, the final states, checkpoints and error counts must equal
// the whole prefill's on the same problem; untouched slots and entries stay bit-identical.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cpu/backend.h"
#include "gdnkit/gdnkit.h"
#include "support/compare.h"
#include "support/problem.h"
#include "support/split_ranks.h"

namespace gdnkit::test {
namespace {

ProblemConfig split_config(std::vector<int32_t> lens, uint64_t seed) {
  ProblemConfig c;
  c.op = OpKind::kPrefill;
  c.seq_lens = std::move(lens);
  c.H = 1, c.HV = 2, c.K = 64, c.V = 64;
  c.seed = seed;
  return c;
}

// The split run (`got`, ranks' results collected from `state_rank`) against the whole prefill (`ref`). The
// summaries are rounded to fp32 once per rank, so the split run stays within fp32 rounding of the whole one.
void check_split(const Problem& before, const Problem& got, const Problem& ref) {
  const ProblemConfig& cfg = before.config();
  const double out_tol = cfg.in_dtype == DType::kFloat32 ? 1e-5 : 2e-3;  // an o rounding may flip in 16 bits
  EXPECT_TRUE(RelClose("o", got.read_tokens("o"), ref.read_tokens("o"), out_tol));
  const double state_tol = cfg.state_dtype == DType::kFloat32 ? 1e-5 : state_tolerance(OpFamily::kStep, cfg.state_dtype);
  const std::vector<int64_t> written = before.written_final_slots();
  for (int64_t s : written)
    EXPECT_TRUE(RelClose("final slot " + std::to_string(s), got.read_state("state", s), ref.read_state("state", s),
                         state_tol, storage_floor(cfg.state_dtype)));
  EXPECT_TRUE(UntouchedSlotsEqual(before, got, "state", written));
  if (before.has("checkpoints")) {
    const auto entries = before.written_checkpoints();
    for (auto [slot, j] : entries)
      EXPECT_TRUE(RelClose("checkpoint " + std::to_string(slot) + "/" + std::to_string(j),
                           got.read_cache("checkpoints", slot, j), ref.read_cache("checkpoints", slot, j),
                           cfg.cache_dtype == DType::kFloat32 ? 1e-5 : state_tolerance(OpFamily::kStep, cfg.cache_dtype),
                           storage_floor(cfg.cache_dtype)));
    EXPECT_EQ(got.first_changed_cache_byte(before, "checkpoints", entries), -1);
  }
  EXPECT_EQ(got.as<int32_t>("error_flag")[0], ref.as<int32_t>("error_flag")[0]);
}

// Every rank's pool past rank 0 NaN (the initial states are read from rank 0's alone); the pools of the ranks that
// store final states checked against the whole prefill, every other rank's bit-identical to what it was.
void run_split_case(const ProblemConfig& cfg, const std::vector<int64_t>& cuts, bool every_rank) {
  const Problem before(cfg);
  Problem ref = before, got = before;
  cpu::prefill_recurrent(ref.prefill_params());
  SplitRanks ranks(got, cuts);
  ranks.poison_pools_past_rank0();
  ranks.run_cpu(got, every_rank);
  ranks.check_pools(before, got, ref, every_rank, check_split);
}

TEST(SplitPrefill, OneRankIsTheWholePrefill) {
  ProblemConfig c = split_config({300, 0, 129, 64}, 11);
  run_split_case(c, {0, 493}, false);
}

TEST(SplitPrefill, CutsInsideAndBetweenSequences) {
  // 4 sequences packed as [0, 300) [300, 300) [300, 429) [429, 493): cuts inside the first (at 100 and 250), at a
  // boundary (300), inside the third (301: a one-token piece on a middle rank) and an empty last rank.
  ProblemConfig c = split_config({300, 0, 129, 64}, 12);
  run_split_case(c, {0, 100, 250, 300, 301, 493, 493}, false);
}

TEST(SplitPrefill, EveryRankStoresTheFinalStates) {
  ProblemConfig c = split_config({200, 90}, 13);
  c.same_slot = true;
  run_split_case(c, {0, 37, 150, 290}, true);
}

TEST(SplitPrefill, LayoutsDtypesAndGates) {
  for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast})
    for (DType state : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      ProblemConfig c = split_config({180, 70}, 20 + int(state));
      c.layout = layout;
      c.state_dtype = state;
      c.in_dtype = state == DType::kFloat16 ? DType::kFloat16 : DType::kBFloat16;
      c.gate_mode = state == DType::kBFloat16 ? GateMode::kGiven : GateMode::kFused;
      c.zero_initial_rows = 1;
      c.HV = 4, c.H = 2;  // grouped value heads
      SCOPED_TRACE(std::string(layout_name(layout)) + " " + dtype_name(state));
      run_split_case(c, {0, 60, 121, 250}, false);
    }
}

TEST(SplitPrefill, CheckpointsOnEveryRank) {
  // Pieces start on chunk boundaries of their sequences (offsets 0, 128, 256 into the first; the second whole on
  // the last rank): each checkpoint (every 64 tokens) is stored by the rank that holds its token.
  ProblemConfig c = split_config({400, 150}, 31);
  c.checkpoint_interval = 64;
  c.cache_dtype = DType::kBFloat16;
  run_split_case(c, {0, 128, 256, 550}, false);
}

TEST(SplitPrefill, Fp8PoolAndCheckpointsBothLayouts) {
  // Each rank's own float8_e4m3 pool and checkpoint buffer with their scales; a checkpoint every 64 tokens on every rank.
  for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast}) {
    ProblemConfig c = split_config({400, 150}, 32 + int(layout));
    c.layout = layout;
    c.state_dtype = DType::kFloat8E4M3, c.cache_dtype = DType::kFloat8E4M3;
    c.checkpoint_interval = 64;
    SCOPED_TRACE(layout_name(layout));
    run_split_case(c, {0, 128, 256, 550}, false);
  }
}

TEST(SplitPrefill, CollectTakesEachCheckpointFromTheRankThatStoresIt) {
  // The check itself: a rank's bytes in an entry another rank stores (even that rank's own bytes), in an entry no rank
  // stores, or in an entry's scales fail collect, which names the rank, the entry and the sequence.
  ProblemConfig c = split_config({400, 150}, 35);
  c.cache_dtype = DType::kFloat8E4M3;  // a byte an element, and the scales
  c.checkpoint_interval = 64;
  Problem got(c);
  SplitRanks ranks(got, {0, 128, 256, 550});  // sequence 0's entries 0-1 on rank 0, 2-3 on rank 1, 4-5 on rank 2
  ranks.run_cpu(got, false);
  {
    Problem collected = got;
    ASSERT_TRUE(ranks.collect(collected, 2, false));
  }
  const auto own = [&](int r, const std::string& name) -> Buffer& {
    for (Buffer& b : ranks.buffers(r))
      if (b.name == name) return b;
    throw std::out_of_range(name);
  };
  const int64_t elems = got.state_elems(), blocks = elems / kFp8Block;
  const auto first_byte = [&](int32_t seq, int64_t step) {
    return got.as<int32_t>("checkpoint_indices")[seq] * got.cache_slot_stride() + step * elems;
  };
  const auto first_block = [&](int32_t seq, int64_t step) {
    return (got.as<int32_t>("checkpoint_indices")[seq] * got.cache_steps() + step) * blocks;
  };
  // Rank r's copy of `name` with bytes [begin, begin + n) from rank `from`'s (or flipped, from < 0): collect fails
  // naming the rank, the buffer and `entry`; then restored.
  const auto expect_refused = [&](int r, const std::string& name, int64_t begin, int64_t n, int from,
                                  const std::string& entry) {
    Buffer& mine = own(r, name);
    const std::vector<std::byte> kept = mine.bytes;
    for (int64_t i = begin; i < begin + n; ++i)
      mine.bytes[size_t(i)] = from >= 0 ? own(from, name).bytes[size_t(i)] : ~mine.bytes[size_t(i)];
    Problem collected = got;
    const ::testing::AssertionResult result = ranks.collect(collected, 2, false);
    const std::string message = result.message();
    EXPECT_FALSE(result) << entry;
    EXPECT_NE(message.find("rank " + std::to_string(r) + " wrote " + name + " byte"), std::string::npos) << message;
    EXPECT_NE(message.find(entry), std::string::npos) << message;
    mine.bytes = kept;
  };
  expect_refused(0, "checkpoints", first_byte(0, 2), elems, 1, "(sequence 0's entry 2, stored by rank 1)");
  expect_refused(2, "checkpoints", first_byte(0, 0), elems, 0, "(sequence 0's entry 0, stored by rank 0)");
  expect_refused(1, "checkpoints_scales", first_block(1, 1), 1, -1, "(sequence 1's entry 1, stored by rank 2)");
  expect_refused(2, "checkpoints", first_byte(1, 2), 1, -1, "(sequence 1's entry 2, stored by no rank)");
  Problem collected = got;
  EXPECT_TRUE(ranks.collect(collected, 2, false));
}

// A NaN-filled exchange buffer for `ranks` (what a rank reads of it must have been written).
std::vector<float> nan_exchange(SplitRanks& ranks, const PrefillParams& fp) {
  return std::vector<float>(size_t(ranks.exchange_elems(fp)), std::numeric_limits<float>::quiet_NaN());
}

// split_prefill_begin and split_prefill_end refuse sp as an invalid argument with a message that starts with `what`,
// and write nothing: not the problem's buffers, not any rank's pool, checkpoints or error flag, not the exchange.
void expect_split_error(const Problem& p, SplitRanks& ranks, const std::vector<float>& exchange,
                        const SplitPrefillParams& sp, const std::string& what) {
  const Problem snapshot = p;
  const auto rank_snapshot = ranks.snapshot();
  const std::vector<float> exchange_before = exchange;
  for (const bool begin : {true, false}) {
    try {
      if (begin)
        split_prefill_begin(sp, {Backend::kCPU, nullptr});
      else
        split_prefill_end(sp, {Backend::kCPU, nullptr});
      ADD_FAILURE() << (begin ? "begin" : "end") << ": expected an error naming " << what;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_EQ(std::string(e.what()).rfind(what, 0), 0u) << e.what();
    }
  }
  for (const Buffer& b : snapshot.buffers()) EXPECT_EQ(p.buffer(b.name).bytes, b.bytes) << b.name << " written";
  EXPECT_TRUE(ranks.unchanged_since(rank_snapshot));
  EXPECT_EQ(std::memcmp(exchange.data(), exchange_before.data(), exchange.size() * sizeof(float)), 0)
      << "exchange written";
}

TEST(SplitPrefill, MisalignedPieceWithCheckpointsIsCounted) {
  // A piece that starts 100 tokens into its sequence cannot store its checkpoints: the device counts it, the host
  // copy of the offsets refuses it before anything runs.
  ProblemConfig c = split_config({300}, 41);
  c.checkpoint_interval = 64;
  Problem p(c);
  SplitRanks ranks(p, {0, 100, 300});
  const PrefillParams fp = p.prefill_params();
  std::vector<float> exchange = nan_exchange(ranks, fp);
  SplitPrefillParams sp = ranks.params(fp, 1, ranks.host_pointers(1), exchange.data(), false);
  expect_split_error(p, ranks, exchange, sp, "piece_offsets_host: sequence 0's piece starts 100 tokens");
  // With checkpoints a rank past the first needs the offsets on the device too, 8-byte aligned.
  ASSERT_NE(sp.piece_offsets, nullptr);
  SplitPrefillParams bad = sp;
  bad.piece_offsets = nullptr;
  expect_split_error(p, ranks, exchange, bad,
                     "piece_offsets: required pointer is null with checkpoints on rank 1 (1 elements expected)");
  bad.piece_offsets = reinterpret_cast<const int64_t*>(reinterpret_cast<const char*>(sp.piece_offsets) + 4);
  expect_split_error(p, ranks, exchange, bad, "piece_offsets: data pointer ");
  // Without the host copy the call runs and counts the piece on the device side.
  const Problem before = p;
  for (int r = 0; r < 2; ++r) {
    SplitPrefillParams q = ranks.params(fp, r, ranks.host_pointers(r), exchange.data(), false);
    q.piece_offsets_host = nullptr;
    split_prefill_begin(q, {Backend::kCPU, nullptr});
  }
  for (int r = 0; r < 2; ++r) {
    SplitPrefillParams q = ranks.params(fp, r, ranks.host_pointers(r), exchange.data(), false);
    q.piece_offsets_host = nullptr;
    split_prefill_end(q, {Backend::kCPU, nullptr});
  }
  EXPECT_EQ(*ranks.buffer(1, "error_flag").as<int32_t>(), 1);
  EXPECT_EQ(*ranks.buffer(0, "error_flag").as<int32_t>(), 0);
  // rank 1 stored none of its checkpoints (entries 1..3), rank 0 its first
  EXPECT_NE(ranks.buffer(0, "checkpoints").bytes, before.buffer("checkpoints").bytes);
  Problem collected = p;
  EXPECT_TRUE(ranks.collect(collected, 1, false));
  EXPECT_EQ(collected.first_changed_cache_byte(before, "checkpoints", {{0, 0}}), -1);
}

// Sequences {120, 80} with sequence 1's final slot past the pool.
Problem bad_final_slot_problem(uint64_t seed) {
  Problem p(split_config({120, 80}, seed));
  p.as<int32_t>("final_indices")[1] = int32_t(p.num_slots()) + 3;
  return p;
}

// `before` (bad_final_slot_problem) split at `cuts` over two ranks: only the last rank reads the final slots, so it
// skips and counts its piece of sequence 1 there, once, and every other piece runs. The result (o of each sequence,
// sequence 0's final slot, every other slot untouched on both ranks, the error count) must be `ref`'s; returns the
// run (its o rows).
Problem check_bad_final_slot(const Problem& before, std::vector<int64_t> cuts, const Problem& ref) {
  Problem got = before;
  SplitRanks ranks(got, std::move(cuts));
  ranks.poison_pools_past_rank0();
  ranks.run_cpu(got, false);
  EXPECT_EQ(*ranks.buffer(1, "error_flag").as<int32_t>(), 1);
  EXPECT_EQ(*ranks.buffer(0, "error_flag").as<int32_t>(), 0);
  ranks.check_pools(before, got, ref, false, check_split);
  const int64_t row = 2 * 64;  // HV * V per token
  EXPECT_TRUE(RelClose("o of sequence 0", token_rows(got.read_tokens("o"), row, 0, 120),
                       token_rows(ref.read_tokens("o"), row, 0, 120), 2e-3));
  return got;
}

TEST(SplitPrefill, BadSlotOnOneRank) {
  // Sequence 1 lives on the last rank alone: skipped there whole (its o rows zero), as the whole prefill skips it.
  const Problem before = bad_final_slot_problem(51);
  Problem ref = before;
  cpu::prefill_recurrent(ref.prefill_params());
  const Problem got = check_bad_final_slot(before, {0, 60, 200}, ref);
  EXPECT_TRUE(AllZero("o of the skipped sequence", token_rows(got.read_tokens("o"), 2 * 64, 120, 200)));
}

TEST(SplitPrefill, BadSlotOnARankWithoutTokens) {
  // The last rank holds no tokens but stores the final states: it counts the bad slot. Rank 0 ran both sequences
  // whole, so the result is the whole prefill in which sequence 1 stores no final state (o does not depend on it),
  // with the one error more.
  const Problem before = bad_final_slot_problem(52);
  Problem ref = before;
  ref.as<int32_t>("final_indices")[1] = -1;
  cpu::prefill_recurrent(ref.prefill_params());
  ref.as<int32_t>("error_flag")[0] += 1;
  const Problem got = check_bad_final_slot(before, {0, 200, 200}, ref);
  EXPECT_TRUE(RelClose("o of sequence 1, run on rank 0", token_rows(got.read_tokens("o"), 2 * 64, 120, 200),
                       token_rows(ref.read_tokens("o"), 2 * 64, 120, 200), 2e-3));
}

TEST(SplitPrefill, Validation) {
  ProblemConfig c = split_config({100}, 61);
  Problem p(c);
  SplitRanks ranks(p, {0, 50, 100});
  const PrefillParams fp = p.prefill_params();
  std::vector<float> exchange = nan_exchange(ranks, fp);
  const auto expect_error = [&](const SplitPrefillParams& sp, const std::string& what) {
    expect_split_error(p, ranks, exchange, sp, what);
  };
  SplitPrefillParams sp = ranks.params(fp, 0, ranks.host_pointers(0), exchange.data(), false);
  SplitPrefillParams bad = sp;
  bad.rank = 2;
  expect_error(bad, "rank: expected 0..1, got 2");
  bad = sp;
  bad.num_ranks = 0;
  expect_error(bad, "num_ranks: must be >= 1, got 0");
  bad = sp;
  bad.exchange = nullptr;
  expect_error(bad, "exchange: required pointer is null");
  bad = sp;
  bad.exchange = exchange.data() + 1;
  expect_error(bad, "exchange: data pointer");
  bad = sp;
  bad.local.heads.head_dim_v = 48;
  expect_error(bad, "v: head dim V=48");
  std::vector<int64_t> negative = {-64};
  bad = sp;
  bad.piece_offsets_host = negative.data();
  expect_error(bad, "piece_offsets_host: entry 0 is -64 (expected >= 0)");
  bad = sp;
  bad.piece_offsets_host = nullptr;
  bad.piece_offsets = negative.data();
  expect_error(bad, "piece_offsets: entry 0 is -64 (expected >= 0)");
  EXPECT_EQ(split_prefill_exchange_elems(fp), int64_t(1) * 2 * 64 * (64 + 64));
}

}  // namespace
}  // namespace gdnkit::test
