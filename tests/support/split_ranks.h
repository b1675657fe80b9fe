// A prefill problem (problem.h) split over ranks for split_prefill_begin / _end, cut at points of its packed token
// stream: rank r holds tokens [cuts[r], cuts[r + 1]), so a sequence is split where a cut falls inside it and lives on
// one rank otherwise (its pieces elsewhere empty). Each rank's token views point into the problem's own rows (each
// rank writes its rows of o in place); each rank has its own copies of the pool, the checkpoint buffer and the error
// flag, kept here as host buffers (a GPU test mirrors them).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "gdnkit/params.h"
#include "support/problem.h"

namespace gdnkit::test {

// Where one rank's own buffers live (host here, device copies in the GPU suite).
struct RankPointers {
  const int32_t* cu_seqlens = nullptr;  // [N+1] the rank's pieces, packed
  const int64_t* piece_offsets = nullptr;
  void* state = nullptr;
  uint8_t* state_scales = nullptr;
  void* checkpoints = nullptr;
  uint8_t* checkpoint_scales = nullptr;
  int32_t* error_flag = nullptr;
};

class SplitRanks {
 public:
  // cuts: 0 = cuts[0] <= cuts[1] <= ... <= cuts[G] = the problem's total tokens.
  SplitRanks(const Problem& full, std::vector<int64_t> cuts);
  int ranks() const { return int(cuts_.size()) - 1; }
  const std::vector<int64_t>& cuts() const { return cuts_; }

  // Rank r's own buffers (names: cu_seqlens, piece_offsets, state, state_scales, checkpoints, checkpoints_scales,
  // error_flag; the scales where the problem has them).
  std::vector<Buffer>& buffers(int r) { return ranks_[size_t(r)]; }
  const Buffer& buffer(int r, const std::string& name) const;
  // Every rank's buffers as they are now, and whether they still are, bit for bit (a refused call writes nothing).
  std::vector<std::vector<Buffer>> snapshot() const { return ranks_; }
  ::testing::AssertionResult unchanged_since(const std::vector<std::vector<Buffer>>& snapshot) const;
  RankPointers host_pointers(int r);

  // Rank r's params: `full` is the whole problem's (host or device pointers); its token views are moved to the
  // rank's first token, its pool, checkpoints, cu_seqlens and error flag replaced by `at`'s.
  SplitPrefillParams params(const PrefillParams& full, int r, const RankPointers& at, float* exchange,
                            bool final_on_every_rank) const;
  // fp32 elements of the exchange: ranks x split_prefill_exchange_elems.
  int64_t exchange_elems(const PrefillParams& full) const;

  // Every rank's pool past rank 0 (and its scales) all-ones bytes, NaN in every state dtype: initial states are read
  // from rank 0's pool alone (docs/semantics.md "split prefill"), so a rank that reads its own shows.
  void poison_pools_past_rank0();
  // `before` with rank r's pool and its scales as they were before the run.
  Problem with_pool_before(Problem before, int r) const;
  // Rank r's pool and its scales bit-identical to what they were before the run.
  ::testing::AssertionResult pool_unchanged(int r) const;

  // Into `got` (a copy of the problem before the run, whose o rows the ranks wrote): the pool of `state_rank`, each
  // checkpoint entry (and its scales) from the rank that stores it, the error flags summed. Entry j of sequence n is
  // stored by the rank whose piece holds token (j + 1) * C of the sequence, unless that piece is bad (a bad span, the
  // initial slot on rank 0 or a final slot on a rank that stores finals past the pool), misaligned or at a negative
  // offset; a negative or out-of-range checkpoint slot stores none. Fails, naming rank, slot, step and sequence, where
  // a rank's checkpoint buffer differs from the original outside the entries it stores. final_on_every_rank: the
  // run's (which ranks read the final slots).
  [[nodiscard]] ::testing::AssertionResult collect(Problem& got, int state_rank, bool final_on_every_rank) const;

  // The pools after a run whose o rows `got` holds: each rank that stores final states (the last; every one with
  // final_on_every_rank) collected into a copy of `got` and given to check(`before` with that rank's pool as it was,
  // the copy, ref); every other rank's pool bit-identical to what it was.
  void check_pools(const Problem& before, const Problem& got, const Problem& ref, bool final_on_every_rank,
                   const std::function<void(const Problem&, const Problem&, const Problem&)>& check) const;

  // Runs every rank's begin, then every rank's end, on the CPU backend (the exchange shared: an all-gather in place).
  void run_cpu(Problem& full, bool final_on_every_rank);

 private:
  std::vector<int64_t> cuts_;
  std::vector<std::vector<Buffer>> ranks_;
  std::vector<std::vector<int64_t>> cu_host_;  // each rank's cu_seqlens as PrefillParams::cu_seqlens_host
  std::vector<Buffer> before_;  // the problem's pool, checkpoints and their scales before the run
  std::vector<std::vector<Buffer>> pools_before_;  // each rank's pool and its scales before the run
  std::vector<float> exchange_;
};

}  // namespace gdnkit::test
