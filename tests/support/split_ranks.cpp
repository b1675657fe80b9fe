#include "support/split_ranks.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "gdnkit/gdnkit.h"

namespace gdnkit::test {
namespace {

template <class T>
Buffer vector_buffer(const std::string& name, const std::vector<T>& values, bool is_output) {
  Buffer b;
  b.name = name;
  b.is_output = is_output;
  b.bytes.resize(values.size() * sizeof(T));
  if (!values.empty()) std::memcpy(b.bytes.data(), values.data(), b.bytes.size());
  return b;
}

const char* const kCopied[] = {"state", "state_scales", "checkpoints", "checkpoints_scales"};

bool is_pool(const std::string& name) { return name == "state" || name == "state_scales"; }

// A rank's pool and its scales (copies).
std::vector<Buffer> pool_of(const std::vector<Buffer>& own) {
  std::vector<Buffer> out;
  for (const Buffer& b : own)
    if (is_pool(b.name)) out.push_back(b);
  return out;
}

// A view moved `tokens` rows on.
template <class View>
View shifted(View v, int64_t tokens) {
  if (v.data == nullptr) return v;
  using Byte = std::conditional_t<std::is_const_v<std::remove_pointer_t<decltype(v.data)>>, const char, char>;
  v.data = reinterpret_cast<Byte*>(v.data) + tokens * v.token_stride * dtype_size(v.dtype);
  return v;
}

}  // namespace

SplitRanks::SplitRanks(const Problem& full, std::vector<int64_t> cuts) : cuts_(std::move(cuts)) {
  if (cuts_.size() < 2 || cuts_.front() != 0 || cuts_.back() != full.total_tokens() ||
      !std::is_sorted(cuts_.begin(), cuts_.end()))
    throw std::invalid_argument("SplitRanks: cuts must run from 0 to the total tokens, non-decreasing");
  const int32_t N = full.rows();
  for (const char* name : kCopied)
    if (full.has(name)) before_.push_back(full.buffer(name));
  for (int r = 0; r < ranks(); ++r) {
    const int64_t t0 = cuts_[size_t(r)], t1 = cuts_[size_t(r) + 1];
    std::vector<int32_t> cu(size_t(N) + 1);
    std::vector<int64_t> offsets(static_cast<size_t>(N));
    for (int32_t n = 0; n <= N; ++n) {
      const int64_t at = n < N ? full.row_start(n) : full.total_tokens();
      cu[size_t(n)] = int32_t(std::clamp(at, t0, t1) - t0);
      if (n < N) offsets[size_t(n)] = std::clamp(t0, at, at + full.row_len(n)) - at;
    }
    cu_host_.emplace_back(cu.begin(), cu.end());
    std::vector<Buffer> own;
    own.push_back(vector_buffer("cu_seqlens", cu, false));
    own.push_back(vector_buffer("piece_offsets", offsets, false));
    own.push_back(vector_buffer("error_flag", std::vector<int32_t>{0}, true));
    for (const Buffer& b : before_) own.push_back(b);
    ranks_.push_back(std::move(own));
    pools_before_.push_back(pool_of(ranks_.back()));
  }
}

const Buffer& SplitRanks::buffer(int r, const std::string& name) const {
  for (const Buffer& b : ranks_[size_t(r)])
    if (b.name == name) return b;
  throw std::out_of_range("SplitRanks: rank " + std::to_string(r) + " has no buffer " + name);
}

RankPointers SplitRanks::host_pointers(int r) {
  RankPointers at;
  for (Buffer& b : ranks_[size_t(r)]) {
    if (b.name == "cu_seqlens") at.cu_seqlens = b.as<int32_t>();
    if (b.name == "piece_offsets") at.piece_offsets = b.as<int64_t>();
    if (b.name == "error_flag") at.error_flag = b.as<int32_t>();
    if (b.name == "state") at.state = b.bytes.data();
    if (b.name == "state_scales") at.state_scales = b.as<uint8_t>();
    if (b.name == "checkpoints") at.checkpoints = b.bytes.data();
    if (b.name == "checkpoints_scales") at.checkpoint_scales = b.as<uint8_t>();
  }
  return at;
}

SplitPrefillParams SplitRanks::params(const PrefillParams& full, int r, const RankPointers& at, float* exchange,
                                      bool final_on_every_rank) const {
  const int64_t t0 = cuts_[size_t(r)];
  SplitPrefillParams sp;
  PrefillParams& p = sp.local;
  p = full;
  p.total_tokens = cuts_[size_t(r) + 1] - t0;
  p.q = shifted(p.q, t0), p.k = shifted(p.k, t0), p.v = shifted(p.v, t0), p.o = shifted(p.o, t0);
  p.gating.g = shifted(p.gating.g, t0), p.gating.beta = shifted(p.gating.beta, t0);
  p.gating.a = shifted(p.gating.a, t0), p.gating.b = shifted(p.gating.b, t0);
  p.cu_seqlens = at.cu_seqlens;
  p.cu_seqlens_dtype = DType::kInt32;
  p.cu_seqlens_host = full.cu_seqlens_host ? cu_host_[size_t(r)].data() : nullptr;
  if (p.state.data) p.state.data = at.state, p.state.scales = at.state_scales;
  if (p.checkpoints.data) p.checkpoints.data = at.checkpoints, p.checkpoints.scales = at.checkpoint_scales;
  p.error_flag = at.error_flag;
  sp.rank = r;
  sp.num_ranks = ranks();
  sp.final_on_every_rank = final_on_every_rank;
  sp.piece_offsets = at.piece_offsets;
  sp.piece_offsets_host = buffer(r, "piece_offsets").as<int64_t>();
  sp.exchange = exchange;
  return sp;
}

::testing::AssertionResult SplitRanks::unchanged_since(const std::vector<std::vector<Buffer>>& snapshot) const {
  for (size_t r = 0; r < ranks_.size(); ++r)
    for (size_t i = 0; i < ranks_[r].size(); ++i)
      if (ranks_[r][i].bytes != snapshot[r][i].bytes)
        return ::testing::AssertionFailure() << "rank " << r << "'s " << ranks_[r][i].name << " written";
  return ::testing::AssertionSuccess();
}

int64_t SplitRanks::exchange_elems(const PrefillParams& full) const {
  return int64_t(ranks()) * split_prefill_exchange_elems(full);
}

void SplitRanks::poison_pools_past_rank0() {
  for (int r = 1; r < ranks(); ++r) {
    for (Buffer& b : ranks_[size_t(r)])
      if (is_pool(b.name)) std::fill(b.bytes.begin(), b.bytes.end(), std::byte{0xff});
    pools_before_[size_t(r)] = pool_of(ranks_[size_t(r)]);
  }
}

Problem SplitRanks::with_pool_before(Problem before, int r) const {
  for (const Buffer& b : pools_before_[size_t(r)]) before.buffer(b.name).bytes = b.bytes;
  return before;
}

::testing::AssertionResult SplitRanks::pool_unchanged(int r) const {
  for (const Buffer& was : pools_before_[size_t(r)]) {
    const Buffer& now = buffer(r, was.name);
    const auto diff = std::mismatch(now.bytes.begin(), now.bytes.end(), was.bytes.begin());
    if (diff.first != now.bytes.end())
      return ::testing::AssertionFailure() << "rank " << r << "'s " << was.name << " written at byte "
                                           << diff.first - now.bytes.begin();
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult SplitRanks::collect(Problem& got, int state_rank, bool final_on_every_rank) const {
  for (const char* name : {"state", "state_scales"})
    if (got.has(name)) got.buffer(name).bytes = buffer(state_rank, name).bytes;
  int32_t errors = 0;
  for (int r = 0; r < ranks(); ++r) errors += *buffer(r, "error_flag").as<int32_t>();
  *got.as<int32_t>("error_flag") = errors;
  if (!got.has("checkpoints")) return ::testing::AssertionSuccess();

  // owner[slot * S + step]: the rank that stores the entry (-1: none); named[slot]: the sequence that names the slot
  const int64_t Q = got.cache_slots(), S = got.cache_steps(), C = got.config().checkpoint_interval;
  const int64_t P = got.num_slots();
  std::vector<int> owner(size_t(Q * S), -1);
  std::vector<int32_t> named(size_t(Q), -1);
  const int32_t* ck = got.as<int32_t>("checkpoint_indices");
  const int32_t* ini = got.as<int32_t>("initial_indices");
  const int32_t* fin = got.as<int32_t>("final_indices");
  for (int32_t n = 0; n < got.rows(); ++n) {
    const int64_t slot = ck[n];
    if (slot < 0 || slot >= Q) continue;  // negative: stores none; past the buffer: the piece is bad on every rank
    if (named[size_t(slot)] < 0) named[size_t(slot)] = n;
    for (int r = 0; r < ranks(); ++r) {
      const int32_t* cu = buffer(r, "cu_seqlens").as<int32_t>();
      const int64_t start = cu[n], end = cu[n + 1], offset = buffer(r, "piece_offsets").as<int64_t>()[n];
      const bool stores_final = final_on_every_rank || r == ranks() - 1;
      const bool bad = start < 0 || end < start || end > cuts_[size_t(r) + 1] - cuts_[size_t(r)] ||
                       (r == 0 && ini[n] >= P) || (stores_final && fin[n] >= P);
      if (bad || offset < 0 || offset % 64 != 0) continue;  // such a piece stores none of its checkpoints
      for (int64_t j = 0; j < S; ++j)
        if (offset < (j + 1) * C && (j + 1) * C <= offset + (end - start)) owner[size_t(slot * S + j)] = r;
    }
  }

  std::ostringstream wrong;
  // Buffer `name` merged from its owners into `got`; entry_of(byte): the entry (slot * S + step) or -1 (padding).
  const auto merge = [&](const std::string& name, const auto& entry_of) {
    const Buffer* orig = nullptr;
    for (const Buffer& b : before_)
      if (b.name == name) orig = &b;
    Buffer& merged = got.buffer(name);
    merged.bytes = orig->bytes;
    for (int r = 0; r < ranks(); ++r) {
      const Buffer& mine = buffer(r, name);
      bool reported = false;  // the first stray byte of each rank is enough
      for (size_t i = 0; i < orig->bytes.size(); ++i) {
        const int64_t e = entry_of(int64_t(i));
        const int own = e >= 0 ? owner[size_t(e)] : -1;
        if (own == r) merged.bytes[i] = mine.bytes[i];
        if (own == r || reported || mine.bytes[i] == orig->bytes[i]) continue;
        reported = true;
        wrong << "\n  rank " << r << " wrote " << name << " byte " << i;
        if (e < 0) {
          wrong << " (slot padding)";
          continue;
        }
        const int64_t slot = e / S, step = e % S;
        wrong << " of slot " << slot << " step " << step;
        if (named[size_t(slot)] < 0)
          wrong << " (a slot no sequence names)";
        else
          wrong << " (sequence " << named[size_t(slot)] << "'s entry " << step << ", stored by "
                << (own < 0 ? std::string("no rank") : "rank " + std::to_string(own)) << ")";
      }
    }
  };
  const int64_t elems = got.state_elems(), stride = got.cache_slot_stride();
  const int64_t esize = dtype_size(got.config().cache_dtype);
  merge("checkpoints", [&](int64_t byte) -> int64_t {
    const int64_t elem = byte / esize, slot = elem / stride, step = elem % stride / elems;
    return slot < Q && step < S ? slot * S + step : -1;
  });
  if (got.has("checkpoints_scales"))
    merge("checkpoints_scales", [&](int64_t byte) -> int64_t {
      const int64_t e = byte / (elems / kFp8Block);
      return e < Q * S ? e : -1;
    });
  if (!wrong.str().empty())
    return ::testing::AssertionFailure() << "checkpoint bytes written by a rank that does not store them:"
                                         << wrong.str();
  return ::testing::AssertionSuccess();
}

void SplitRanks::check_pools(const Problem& before, const Problem& got, const Problem& ref, bool final_on_every_rank,
                             const std::function<void(const Problem&, const Problem&, const Problem&)>& check) const {
  const int last = ranks() - 1;
  for (int r = 0; r <= last; ++r) {
    SCOPED_TRACE("pool of rank " + std::to_string(r));
    if (!final_on_every_rank && r < last) {
      EXPECT_TRUE(pool_unchanged(r));
      continue;
    }
    Problem collected = got;
    EXPECT_TRUE(collect(collected, r, final_on_every_rank));
    check(with_pool_before(before, r), collected, ref);
  }
}

void SplitRanks::run_cpu(Problem& full, bool final_on_every_rank) {
  const PrefillParams fp = full.prefill_params();
  exchange_.assign(size_t(exchange_elems(fp)), std::numeric_limits<float>::quiet_NaN());
  const Context cpu{Backend::kCPU, nullptr};
  for (int r = 0; r < ranks(); ++r) split_prefill_begin(params(fp, r, host_pointers(r), exchange_.data(), final_on_every_rank), cpu);
  for (int r = 0; r < ranks(); ++r) split_prefill_end(params(fp, r, host_pointers(r), exchange_.data(), final_on_every_rank), cpu);
}

}  // namespace gdnkit::test
