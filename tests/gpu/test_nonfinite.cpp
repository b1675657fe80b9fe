// Non-finite inputs on the CUDA backend (docs/semantics.md "Non-finite values"): a NaN in one sequence's k
// reaches that sequence's outputs from its token on (on the chunked and tensor-core forms possibly from the
// start of its chunk or draft) and its state, in the value heads of that q/k head's group; every other
// sequence, head and slot is bit-identical to the same launch without the NaN, and no error is counted.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "gdnkit/gdnkit.h"
#include "gdnkit/host_dtype.h"
#include "gpu/gpu_harness.h"
#include "support/problem.h"

namespace gdnkit::test {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

void poison_k(Problem& p, int64_t t, int h, int i) {
  host::store(p.buffer("k").bytes.data(), p.config().in_dtype, t * p.token_stride("k") + h * p.head_stride("k") + i,
              kNaN);
}

std::vector<int> group_of(const ProblemConfig& cfg, int qk_head) {
  std::vector<int> out;
  for (int h = 0; h < cfg.HV; ++h)
    if (h / (cfg.HV / cfg.H) == qk_head) out.push_back(h);
  return out;
}

// Outputs and pool of `bad` against `clean` (both CUDA runs): the row's reached heads NaN from first_token on,
// equal before first_maybe; everything else equal; slots written for the row (`slot`, -1: none) NaN in the
// reached heads; the other slots bit-identical; error_flag equal.
void expect_poisoned(const Problem& clean, const Problem& bad, int32_t row, int64_t first_token, int64_t first_maybe,
                     const std::vector<int>& heads, int64_t slot, const std::string& what) {
  const auto& cfg = clean.config();
  const auto oc = clean.read_tokens("o"), ob = bad.read_tokens("o");
  const int64_t lo = clean.row_start(row), hi = lo + clean.row_len(row);
  int64_t finite = 0, changed = 0;
  for (int64_t t = 0; t < clean.total_tokens(); ++t)
    for (int h = 0; h < cfg.HV; ++h) {
      const bool reached = t >= lo && t < hi && std::count(heads.begin(), heads.end(), h) > 0;
      for (int i = 0; i < cfg.V; ++i) {
        const size_t at = (size_t(t) * cfg.HV + h) * cfg.V + i;
        if (reached && t >= first_token) {
          finite += !std::isnan(ob[at]);
        } else if (!reached || t < first_maybe) {
          changed += std::memcmp(&ob[at], &oc[at], sizeof(double)) != 0;
        }
      }
    }
  EXPECT_EQ(finite, 0) << what << ": outputs of the poisoned sequence that stayed finite";
  EXPECT_EQ(changed, 0) << what << ": outputs of other sequences, heads or earlier tokens that changed";
  const int64_t per_head = int64_t(cfg.K) * cfg.V;
  for (int64_t s = 0; s < clean.num_slots(); ++s) {
    const auto sc = clean.read_state("state", s), sb = bad.read_state("state", s);
    for (int h = 0; h < cfg.HV; ++h) {
      const bool reached = s == slot && std::count(heads.begin(), heads.end(), h) > 0;
      int64_t wrong = 0;
      for (int64_t e = h * per_head; e < (h + 1) * per_head; ++e)
        wrong += reached ? !std::isnan(sb[e]) : std::memcmp(&sb[e], &sc[e], sizeof(double)) != 0;
      EXPECT_EQ(wrong, 0) << what << ": slot " << s << " head " << h << (reached ? " not poisoned" : " changed");
    }
  }
  EXPECT_EQ(bad.as<int32_t>("error_flag")[0], clean.as<int32_t>("error_flag")[0]) << what << ": error_flag";
}

class NonFinite : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device";
  }
};

TEST_F(NonFinite, DecodeNaNInK) {
  for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast})
    for (DType state : {DType::kFloat32, DType::kBFloat16}) {
      ProblemConfig cfg;
      cfg.op = OpKind::kDecode;
      cfg.batch = 8;
      cfg.H = 4, cfg.HV = 8, cfg.K = 128, cfg.V = 128;
      cfg.layout = layout;
      cfg.state_dtype = state;
      Problem clean(cfg), bad = clean;
      const Problem before = clean;
      const int32_t row = 5;
      poison_k(bad, row, 2, 17);
      for (Problem* p : {&clean, &bad}) {
        DeviceProblem dev(*p);
        decode(p->decode_params(dev.resolver()), {Backend::kCUDA, dev.stream()});
        dev.download(*p);
      }
      Problem ref = before;  // the clean run is right (so that "bad equals clean" means something)
      decode(ref.decode_params(), {Backend::kCPU, nullptr});
      check_decode_results(before, clean, ref);
      expect_poisoned(clean, bad, row, row, row, group_of(cfg, 2), clean.as<int32_t>("state_indices")[row],
                      std::string("decode ") + layout_name(layout) + " " + dtype_name(state));
    }
}

TEST_F(NonFinite, VerifyNaNInK) {
  // T = 2 runs token by token; T = 4 and 8 on the tensor-core chain kernels, where earlier tokens of the
  // poisoned draft may be reached too.
  for (int T : {2, 4, 8}) {
    ProblemConfig cfg;
    cfg.op = OpKind::kVerify;
    cfg.batch = 6;
    cfg.draft_tokens = T;
    cfg.H = 2, cfg.HV = 4, cfg.K = 128, cfg.V = 128;
    cfg.update_state = true;
    Problem clean(cfg), bad = clean;
    const Problem before = clean;
    const int32_t row = 3;
    const int64_t tok = clean.row_start(row) + T / 2;
    poison_k(bad, tok, 1, 0);
    for (Problem* p : {&clean, &bad}) {
      DeviceProblem dev(*p);
      verify(p->verify_params(dev.resolver()), {Backend::kCUDA, dev.stream()});
      dev.download(*p);
    }
    Problem ref = before;  // the clean run is right
    verify(ref.verify_params(), {Backend::kCPU, nullptr});
    check_verify_results(before, clean, ref);
    expect_poisoned(clean, bad, row, tok, clean.row_start(row), group_of(cfg, 1),
                    clean.as<int32_t>("state_indices")[row], "verify T=" + std::to_string(T));
    // The other sequences' cached states are bit-identical.
    const int32_t* ii = clean.as<int32_t>("intermediate_indices");
    for (int32_t r = 0; r < clean.rows(); ++r) {
      if (r == row) continue;
      for (int64_t step = 0; step < T; ++step)
        EXPECT_TRUE(clean.read_cache("intermediate", ii[r], step) == bad.read_cache("intermediate", ii[r], step))
            << "verify T=" << T << ": cache of row " << r << " step " << step << " changed";
    }
  }
}

TEST_F(NonFinite, PrefillNaNInK) {
  // A long sequence (chunked kernels) poisoned in its third chunk, between a short one and a long one.
  ProblemConfig cfg;
  cfg.op = OpKind::kPrefill;
  cfg.seq_lens = {300, 37, 520};
  cfg.H = 2, cfg.HV = 4, cfg.K = 128, cfg.V = 128;
  cfg.checkpoint_interval = 64;
  Problem clean(cfg), bad = clean;
  const Problem before = clean;
  const int32_t row = 2;
  const int64_t tok = clean.row_start(row) + 150;
  poison_k(bad, tok, 0, 5);
  for (Problem* p : {&clean, &bad}) {
    DeviceProblem dev(*p);
    prefill(p->prefill_params(PrefillAlgorithm::kAuto, dev.resolver()), {Backend::kCUDA, dev.stream()});
    dev.download(*p);
  }
  Problem ref = before;  // the clean run is right
  prefill(ref.prefill_params(PrefillAlgorithm::kRecurrent), {Backend::kCPU, nullptr});
  check_prefill_results(before, clean, ref);
  const int64_t chunk_start = clean.row_start(row) + 128;
  expect_poisoned(clean, bad, row, tok, chunk_start, group_of(cfg, 0), clean.as<int32_t>("final_indices")[row],
                  "prefill");
  // Checkpoints: the row's entries before the poisoned chunk and every other row's entries are bit-identical.
  const int32_t* ci = clean.as<int32_t>("checkpoint_indices");
  for (int32_t r = 0; r < clean.rows(); ++r)
    for (int64_t step = 0; step < clean.cache_steps() && (step + 1) * 64 <= clean.row_len(r); ++step) {
      if (r == row && (step + 1) * 64 > 128) continue;
      EXPECT_TRUE(clean.read_cache("checkpoints", ci[r], step) == bad.read_cache("checkpoints", ci[r], step))
          << "prefill: checkpoint of row " << r << " step " << step << " changed";
    }
}

}  // namespace
}  // namespace gdnkit::test
