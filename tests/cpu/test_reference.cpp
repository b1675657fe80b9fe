// CPU reference backend vs independent models: an explicit product of the per-token transition
// matrices (tiny sizes) and the NaiveModel (tests/common/naive.h), over the spec's axes: head dims,
// input / state / cache dtypes, layouts, gating modes, GVA, strided views. Also: chunked == recurrent.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "cpu/backend.h"
#include "support/compare.h"
#include "support/naive.h"
#include "support/problem.h"

namespace gdnkit::test {
namespace {

std::vector<int64_t> iota_tokens(int64_t start, int64_t len) {
  std::vector<int64_t> t(len);
  std::iota(t.begin(), t.end(), start);
  return t;
}

// Tokens of row r from the root to token t (tree: following parent[], chain: 0..t).
std::vector<int64_t> path_to(const Problem& p, int32_t r, int64_t t) {
  std::vector<int64_t> path;
  const int T = p.config().draft_tokens;
  while (t >= 0) {
    path.insert(path.begin(), p.row_start(r) + t);
    t = p.config().tree ? p.as<int32_t>("parent")[int64_t(r) * T + t] : t - 1;
  }
  return path;
}

// The CPU reference keeps the state in double and rounds once per store, as the model rounded the same
// way: values agree up to rare one-ulp rounding flips. These bounds are far below the spec's tolerances.
// The model rounds stored states to float (and bf16 / fp16); float8_e4m3 blocks it cannot round without the layout,
// so their states are held to one e4m3 rounding (3 fraction bits: about 2.5% RMS) against the unrounded model.
double tight(DType dtype) {
  return dtype == DType::kFloat32 ? 2e-6 : dtype == DType::kFloat8E4M3 ? 5e-2 : 2e-4;
}

// The o rows [t0, t1) of a problem as [t][HV][V].
std::vector<double> o_rows(const Problem& p, int64_t t0, int64_t t1) {
  const int64_t row = int64_t(p.config().HV) * p.config().V;
  return token_rows(p.read_tokens("o"), row, t0, t1);
}

// ---- 1. closed form on tiny sizes ----------------------------------------------------------

// S_t = M_t S_{t-1} + beta_t k_t v_t^T with M_t = exp(g_t) (I - beta_t k_t k_t^T), so
// S_n = (M_n ... M_1) S_0 + sum_j (M_n ... M_{j+1}) beta_j k_j v_j^T: expand the products explicitly.
TEST(RefClosedForm, PrefillEqualsExpandedProduct) {
  for (GateMode mode : {GateMode::kFused, GateMode::kGiven}) {
    ProblemConfig c;
    c.op = OpKind::kPrefill;
    c.seq_lens = {6, 9, 0};
    c.H = 1, c.HV = 2, c.K = 4, c.V = 3;  // the CPU functions are size-generic
    c.in_dtype = DType::kFloat32;
    c.gate_mode = mode;
    c.long_memory = true;  // keep the decays near 1 so that S_0 still matters at the end
    c.zero_initial_rows = 1;
    c.seed = 11;
    Problem p(c);
    const Problem before = p;
    cpu::prefill_recurrent(p.prefill_params());
    const NaiveModel m(before);
    const int K = c.K, V = c.V;
    for (int32_t n = 0; n < p.rows(); ++n) {
      const int32_t init = p.as<int32_t>("initial_indices")[n];
      std::vector<double> S0 = init >= 0 ? before.read_state("state", init) : std::vector<double>(p.state_elems(), 0);
      std::vector<double> o_ref(p.row_len(n) * c.HV * V), S_ref(p.state_elems());
      for (int h = 0; h < c.HV; ++h) {
        for (int64_t t = 0; t < p.row_len(n); ++t) {
          // prod = M_t ... M_0 applied to S0, plus the sum of the k v^T terms.
          std::vector<double> S(S0.begin() + h * K * V, S0.begin() + (h + 1) * K * V);
          std::vector<double> Sn(K * V, 0.0);
          for (int64_t j = -1; j <= t; ++j) {
            // P = M_t ... M_{j+1} (K x K), explicitly.
            std::vector<double> P(K * K, 0.0);
            for (int i = 0; i < K; ++i) P[i * K + i] = 1;
            for (int64_t s = j + 1; s <= t; ++s) {
              const int64_t tok = p.row_start(n) + s;
              const double* k = m.k(tok, h);
              std::vector<double> M(K * K), PM(K * K, 0.0);
              for (int a = 0; a < K; ++a)
                for (int b = 0; b < K; ++b)
                  M[a * K + b] = std::exp(m.g(tok, h)) * ((a == b) - m.beta(tok, h) * k[a] * k[b]);
              for (int a = 0; a < K; ++a)
                for (int b = 0; b < K; ++b)
                  for (int d = 0; d < K; ++d) PM[a * K + b] += M[a * K + d] * P[d * K + b];
              P = PM;
            }
            // term: P S0 (j = -1) or P beta_j k_j v_j^T.
            for (int a = 0; a < K; ++a)
              for (int b = 0; b < V; ++b) {
                double x = 0;
                if (j < 0) {
                  for (int d = 0; d < K; ++d) x += P[a * K + d] * S[d * V + b];
                } else {
                  const int64_t tok = p.row_start(n) + j;
                  for (int d = 0; d < K; ++d) x += P[a * K + d] * m.beta(tok, h) * m.k(tok, h)[d] * m.v(tok, h)[b];
                }
                Sn[a * V + b] += x;
              }
          }
          const double* q = m.q(p.row_start(n) + t, h);
          for (int b = 0; b < V; ++b) {
            double x = 0;
            for (int a = 0; a < K; ++a) x += q[a] * Sn[a * V + b];
            o_ref[(t * c.HV + h) * V + b] = x;
          }
          if (t == p.row_len(n) - 1) std::copy(Sn.begin(), Sn.end(), S_ref.begin() + h * K * V);
        }
        if (p.row_len(n) == 0)
          std::copy(S0.begin() + h * K * V, S0.begin() + (h + 1) * K * V, S_ref.begin() + h * K * V);
      }
      const std::string what = "seq " + std::to_string(n) + (mode == GateMode::kFused ? " fused" : " given");
      EXPECT_TRUE(RelClose(what + " o", o_rows(p, p.row_start(n), p.row_start(n) + p.row_len(n)), o_ref, 1e-6));
      const int32_t fin = p.as<int32_t>("final_indices")[n];
      EXPECT_TRUE(RelClose(what + " state", p.read_state("state", fin), S_ref, 1e-6));
    }
  }
}

// ---- 2. every op against the naive model, over the axes ----------------------------------------

struct Case {
  int K, V, H, HV;
  DType in, state, cache;
  StateLayout layout;
  GateMode gate;
  int token_pad, head_pad, slot_pad;
  DType gate_dtype = DType::kFloat32;
  std::string name() const {
    auto d = [](DType t) {
      return std::string(t == DType::kFloat32    ? "f32"
                         : t == DType::kBFloat16 ? "bf16"
                         : t == DType::kFloat16  ? "f16"
                                                 : "f8");
    };
    return "K" + std::to_string(K) + "V" + std::to_string(V) + "_H" + std::to_string(H) + "HV" + std::to_string(HV) +
           "_in" + d(in) + "_st" + d(state) + "_c" + d(cache) + (layout == StateLayout::kKLast ? "_Klast" : "_Vlast") +
           (gate == GateMode::kFused ? "_fused" : "_given") + "_g" + d(gate_dtype) +
           (token_pad + head_pad + slot_pad ? "_strided" : "");
  }
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name(); }

ProblemConfig config_for(const Case& k, OpKind op) {
  ProblemConfig c;
  c.op = op;
  c.K = k.K, c.V = k.V, c.H = k.H, c.HV = k.HV;
  c.in_dtype = k.in, c.state_dtype = k.state, c.cache_dtype = k.cache;
  c.layout = k.layout;
  c.gate_mode = k.gate;
  c.gate_dtype = k.gate_dtype;
  c.token_pad = k.token_pad, c.head_pad = k.head_pad, c.slot_pad = k.slot_pad;
  c.seed = 1000 + k.K * 7 + k.V * 3 + int(k.in) * 11 + int(k.state) * 13 + int(k.layout) * 17 + int(k.gate) * 19;
  return c;
}

class RefOps : public ::testing::TestWithParam<Case> {};

TEST_P(RefOps, DecodeMatchesModel) {
  ProblemConfig c = config_for(GetParam(), OpKind::kDecode);
  c.batch = 4;
  c.padding_rows = 1;
  Problem p(c);
  const Problem before = p;
  cpu::decode(p.decode_params());
  const NaiveModel m(before);
  for (int32_t r = 0; r < p.rows(); ++r) {
    const int32_t slot = p.as<int32_t>("state_indices")[r];
    if (slot < 0) {
      EXPECT_TRUE(AllZero("padding row o", o_rows(p, r, r + 1)));
      continue;
    }
    std::vector<double> o;
    const auto S = m.run(before.read_state("state", slot), {r}, &o);
    EXPECT_TRUE(
        RelClose("row " + std::to_string(r) + " o", o_rows(p, r, r + 1), round_to(o, c.in_dtype), tight(c.in_dtype)));
    EXPECT_TRUE(RelClose("row " + std::to_string(r) + " state", p.read_state("state", slot), round_to(S, c.state_dtype),
                         tight(c.state_dtype)));
  }
  EXPECT_TRUE(UntouchedSlotsEqual(before, p, "state", p.written_pool_slots_decode()));
  EXPECT_EQ(p.as<int32_t>("error_flag")[0], 0);
}

void check_verify(const Case& k, bool tree, bool varlen) {
  ProblemConfig c = config_for(k, OpKind::kVerify);
  c.batch = 3;
  c.draft_tokens = 5;
  c.tree = tree;
  c.update_state = !tree;
  if (varlen) c.seq_lens = {5, 0, 3, 2};
  Problem p(c);
  const Problem before = p;
  cpu::verify(p.verify_params());
  const NaiveModel m(before);
  for (int32_t r = 0; r < p.rows(); ++r) {
    const int32_t slot = p.as<int32_t>("state_indices")[r];
    const int32_t islot = p.as<int32_t>("intermediate_indices")[r];
    const auto S0 = before.read_state("state", slot);
    std::vector<double> last;
    for (int64_t t = 0; t < p.row_len(r); ++t) {
      std::vector<double> o;
      const auto S = m.run(S0, path_to(before, r, t), &o);
      const std::vector<double> o_t(o.end() - c.HV * c.V, o.end());
      const std::string what = "row " + std::to_string(r) + " token " + std::to_string(t);
      EXPECT_TRUE(RelClose(what + " o", o_rows(p, p.row_start(r) + t, p.row_start(r) + t + 1),
                           round_to(o_t, c.in_dtype), tight(c.in_dtype)));
      EXPECT_TRUE(RelClose(what + " intermediate", p.read_cache("intermediate", islot, t), round_to(S, c.cache_dtype),
                           tight(c.cache_dtype)));
      last = S;
    }
    if (c.update_state && p.row_len(r) > 0) {
      EXPECT_TRUE(RelClose("row " + std::to_string(r) + " updated state", p.read_state("state", slot),
                           round_to(last, c.state_dtype), tight(c.state_dtype)));
    }
  }
  EXPECT_TRUE(UntouchedSlotsEqual(before, p, "state", p.written_pool_slots_verify()));
  EXPECT_EQ(p.as<int32_t>("error_flag")[0], 0);
}

TEST_P(RefOps, VerifyChainMatchesModel) { check_verify(GetParam(), false, false); }
TEST_P(RefOps, VerifyTreeMatchesModel) { check_verify(GetParam(), true, false); }
TEST_P(RefOps, VerifyVarlenMatchesModel) { check_verify(GetParam(), false, true); }

void check_commit(const Case& k, bool tree, CommitSource source) {
  ProblemConfig c = config_for(k, OpKind::kVerify);
  c.batch = 4;
  c.draft_tokens = 4;
  c.tree = tree;
  Problem p(c);
  cpu::verify(p.verify_params());  // fills the intermediate cache; the pool is not updated
  const Problem before = p;
  cpu::commit(p.commit_params(source));
  const NaiveModel m(before);
  const int T = c.draft_tokens;
  for (int32_t r = 0; r < p.rows(); ++r) {
    const int32_t slot = p.as<int32_t>("state_indices")[r];
    const int32_t n = p.as<int32_t>("accepted")[r];
    std::vector<int64_t> kept;
    for (int32_t i = 0; i < n; ++i)
      kept.push_back(p.row_start(r) + (tree ? p.as<int32_t>("accepted_path")[r * T + i] : i));
    const auto S = m.run(before.read_state("state", slot), kept, nullptr);
    // From the cache the state was rounded to the cache dtype first (accepted 0: the pool is unchanged).
    const std::vector<double> expect = source == CommitSource::kCache && n > 0
                                           ? round_to(round_to(S, c.cache_dtype), c.state_dtype)
                                           : round_to(S, c.state_dtype);
    const bool from_cache = source == CommitSource::kCache;
    const DType worst =
        c.state_dtype == DType::kFloat8E4M3 || (from_cache && c.cache_dtype == DType::kFloat8E4M3) ? DType::kFloat8E4M3
        : c.state_dtype == DType::kFloat32 && (!from_cache || c.cache_dtype == DType::kFloat32)      ? DType::kFloat32
                                                                                                     : DType::kBFloat16;
    EXPECT_TRUE(RelClose("row " + std::to_string(r) + " accepted " + std::to_string(n) + " state",
                         p.read_state("state", slot), expect, tight(worst)));
  }
  EXPECT_TRUE(UntouchedSlotsEqual(before, p, "state", p.written_pool_slots_commit(source)));
  EXPECT_EQ(p.as<int32_t>("error_flag")[0], 0);
}

TEST_P(RefOps, CommitChainFromCache) { check_commit(GetParam(), false, CommitSource::kCache); }
TEST_P(RefOps, CommitChainByRecompute) { check_commit(GetParam(), false, CommitSource::kRecompute); }
TEST_P(RefOps, CommitTreeFromCache) { check_commit(GetParam(), true, CommitSource::kCache); }
TEST_P(RefOps, CommitTreeByRecompute) { check_commit(GetParam(), true, CommitSource::kRecompute); }

void check_prefill(const Case& k, PrefillAlgorithm algo) {
  ProblemConfig c = config_for(k, OpKind::kPrefill);
  c.seq_lens = {130, 1, 0, 64, 9};
  c.zero_initial_rows = 1;
  c.no_final_rows = 1;
  c.checkpoint_interval = 64;
  Problem p(c);
  const Problem before = p;
  cpu::prefill(p.prefill_params(algo));
  const NaiveModel m(before);
  // Chunked reassociates the sums: allow it the spec's prefill tolerance, the recurrence a tight one.
  const bool chunked = algo == PrefillAlgorithm::kChunked;
  const double tol_o = chunked ? output_tolerance(OpFamily::kPrefill, c.in_dtype) : tight(c.in_dtype);
  const double tol_s =
      chunked ? std::max(state_tolerance(OpFamily::kPrefill, c.state_dtype), tight(c.state_dtype)) : tight(c.state_dtype);
  const double tol_c =
      chunked ? std::max(state_tolerance(OpFamily::kPrefill, c.cache_dtype), tight(c.cache_dtype)) : tight(c.cache_dtype);
  for (int32_t n = 0; n < p.rows(); ++n) {
    const int32_t init = p.as<int32_t>("initial_indices")[n];
    const int32_t fin = p.as<int32_t>("final_indices")[n];
    const int32_t cslot = p.as<int32_t>("checkpoint_indices")[n];
    const std::string what = "seq " + std::to_string(n) + " (len " + std::to_string(p.row_len(n)) + ")";
    const std::vector<double> S0 =
        init >= 0 ? before.read_state("state", init) : std::vector<double>(p.state_elems(), 0.0);
    std::vector<double> o;
    const auto S = m.run(S0, iota_tokens(p.row_start(n), p.row_len(n)), &o);
    EXPECT_TRUE(RelClose(what + " o", o_rows(p, p.row_start(n), p.row_start(n) + p.row_len(n)), round_to(o, c.in_dtype),
                         tol_o));
    if (fin >= 0) {
      EXPECT_TRUE(RelClose(what + " final state", p.read_state("state", fin), round_to(S, c.state_dtype), tol_s));
    }
    for (int64_t j = 0; j < p.row_len(n) / 64; ++j) {
      const auto Sj = m.run(S0, iota_tokens(p.row_start(n), (j + 1) * 64), nullptr);
      EXPECT_TRUE(RelClose(what + " checkpoint " + std::to_string(j), p.read_cache("checkpoints", cslot, j),
                           round_to(Sj, c.cache_dtype), tol_c));
    }
  }
  EXPECT_TRUE(UntouchedSlotsEqual(before, p, "state", p.written_pool_slots_prefill()));
  EXPECT_EQ(p.as<int32_t>("error_flag")[0], 0);
}

TEST_P(RefOps, PrefillRecurrentMatchesModel) { check_prefill(GetParam(), PrefillAlgorithm::kAuto); }
TEST_P(RefOps, PrefillChunkedMatchesModel) { check_prefill(GetParam(), PrefillAlgorithm::kChunked); }

constexpr DType F32 = DType::kFloat32, BF16 = DType::kBFloat16, F16 = DType::kFloat16, F8 = DType::kFloat8E4M3;
constexpr StateLayout KL = StateLayout::kKLast, VL = StateLayout::kVLast;
constexpr GateMode FUSED = GateMode::kFused, GIVEN = GateMode::kGiven;

INSTANTIATE_TEST_SUITE_P(Axes, RefOps,
                         ::testing::Values(
                             //   K    V    H  HV  in    state cache layout gate   pads         gate dtype
                             Case{128, 128, 2, 4, BF16, F32, F32, KL, FUSED, 0, 0, 0},
                             Case{128, 128, 2, 4, BF16, F32, F32, VL, GIVEN, 0, 0, 0},
                             Case{128, 128, 1, 2, F32, BF16, BF16, KL, GIVEN, 0, 0, 0},
                             Case{128, 128, 2, 2, F16, F32, BF16, VL, FUSED, 0, 0, 0, F16},
                             Case{64, 64, 2, 4, BF16, BF16, F32, VL, FUSED, 3, 5, 7, BF16},
                             Case{256, 256, 1, 1, BF16, F32, F32, KL, FUSED, 0, 0, 0},
                             Case{64, 128, 1, 2, F16, F32, F32, KL, GIVEN, 8, 0, 16},
                             Case{128, 64, 2, 4, F32, F32, F32, VL, FUSED, 0, 4, 0, BF16},
                             Case{256, 128, 1, 2, BF16, BF16, BF16, VL, GIVEN, 0, 0, 3},
                             Case{128, 256, 1, 1, F16, F32, F32, KL, FUSED, 1, 1, 1},
                             Case{128, 128, 2, 4, BF16, F8, F8, KL, FUSED, 0, 0, 0},
                             Case{64, 64, 2, 4, F32, F8, F32, VL, GIVEN, 3, 5, 7, BF16},
                             Case{128, 64, 1, 2, BF16, F32, F8, KL, GIVEN, 0, 0, 32}),
                         [](const ::testing::TestParamInfo<Case>& param_info) { return param_info.param.name(); });

// ---- 3. chunked prefill == recurrent prefill ----------------------------------------------------

struct ChunkCase {
  std::vector<int32_t> lens;
  bool long_memory;
  DType in;
  bool correlated_keys = false;  // ProblemConfig::correlated_keys: I + A far from the identity in every chunk
};

void PrintTo(const ChunkCase& c, std::ostream* os) {
  *os << "lens";
  for (int32_t l : c.lens) *os << " " << l;
  *os << (c.long_memory ? " long-memory " : " ") << dtype_name(c.in) << (c.correlated_keys ? " correlated-keys" : "");
}

class RefChunked : public ::testing::TestWithParam<ChunkCase> {};

TEST_P(RefChunked, EqualsRecurrent) {
  const ChunkCase& k = GetParam();
  ProblemConfig c;
  c.op = OpKind::kPrefill;
  c.seq_lens = k.lens;
  c.H = 1, c.HV = 2, c.K = 128, c.V = 128;
  c.in_dtype = k.in;
  c.long_memory = k.long_memory;
  c.correlated_keys = k.correlated_keys;
  c.checkpoint_interval = 128;
  c.seed = 77 + k.lens.size() + (k.long_memory ? 1 : 0);
  Problem rec(c);
  Problem chk = rec;
  cpu::prefill(rec.prefill_params(PrefillAlgorithm::kRecurrent));
  cpu::prefill(chk.prefill_params(PrefillAlgorithm::kChunked));
  // Both run in double: the chunked form is an exact rearrangement, so they agree far below the
  // spec's prefill tolerances (asserted too, they are the contract).
  const double tight_o = k.in == DType::kFloat32 ? 1e-6 : 1e-4;
  EXPECT_TRUE(RelClose("o", chk.read_tokens("o"), rec.read_tokens("o"), output_tolerance(OpFamily::kPrefill, k.in)));
  EXPECT_TRUE(RelClose("o (tight)", chk.read_tokens("o"), rec.read_tokens("o"), tight_o));
  for (int32_t n = 0; n < rec.rows(); ++n) {
    const int32_t fin = rec.as<int32_t>("final_indices")[n];
    EXPECT_TRUE(
        RelClose("final state " + std::to_string(n), chk.read_state("state", fin), rec.read_state("state", fin), 1e-6));
    const int32_t cslot = rec.as<int32_t>("checkpoint_indices")[n];
    for (int64_t j = 0; j < rec.row_len(n) / 128; ++j)
      EXPECT_TRUE(RelClose("checkpoint " + std::to_string(j), chk.read_cache("checkpoints", cslot, j),
                           rec.read_cache("checkpoints", cslot, j), 1e-6));
  }
  EXPECT_TRUE(UntouchedSlotsEqual(rec, chk, "state", rec.written_pool_slots_prefill()));
}

INSTANTIATE_TEST_SUITE_P(
    Lengths, RefChunked,
    ::testing::Values(ChunkCase{{0}, false, DType::kBFloat16}, ChunkCase{{1}, false, DType::kBFloat16},
                      ChunkCase{{63}, false, DType::kFloat32}, ChunkCase{{64}, false, DType::kBFloat16},
                      ChunkCase{{65}, false, DType::kFloat32}, ChunkCase{{1000}, false, DType::kBFloat16},
                      ChunkCase{{1000}, true, DType::kBFloat16}, ChunkCase{{1000}, true, DType::kFloat32},
                      ChunkCase{{0, 1, 63, 64, 65, 129}, true, DType::kFloat16},
                      ChunkCase{{1000}, true, DType::kFloat32, true}, ChunkCase{{700, 64}, true, DType::kBFloat16, true}));

// ---- 4. verify (chain) == T decode steps -----------------------------------------------------------

// Decode step t of a verify problem: the views of token t of every row (token stride T * stride).
DecodeParams decode_step(Problem& p, int t) {
  DecodeParams d = p.decode_params();
  const int T = p.config().draft_tokens;
  auto shift_in = [&](InView& v) {
    v.data = static_cast<const char*>(v.data) + t * v.token_stride * dtype_size(v.dtype);
    v.token_stride *= T;
  };
  shift_in(d.q);
  shift_in(d.k);
  shift_in(d.v);
  d.o.data = static_cast<char*>(d.o.data) + t * d.o.token_stride * dtype_size(d.o.dtype);
  d.o.token_stride *= T;
  if (d.gating.mode == GateMode::kFused) {
    shift_in(d.gating.a);
    shift_in(d.gating.b);
  } else {
    shift_in(d.gating.g);
    shift_in(d.gating.beta);
  }
  return d;
}

TEST(RefVerify, ChainEqualsDecodeSteps) {
  for (DType state : {DType::kFloat32, DType::kBFloat16}) {
    ProblemConfig c;
    c.op = OpKind::kVerify;
    c.batch = 3;
    c.draft_tokens = 6;
    c.update_state = true;
    c.state_dtype = state;
    c.cache_dtype = state;
    c.padding_rows = 1;
    Problem ver(c);
    Problem dec = ver;
    cpu::verify(ver.verify_params());
    for (int t = 0; t < c.draft_tokens; ++t) {
      cpu::decode(decode_step(dec, t));
      // The state after decode step t equals verify's intermediate entry t (decode rounds the state
      // to its dtype after every step, verify only when storing: equal within the step tolerance).
      for (int32_t r = 0; r < ver.rows(); ++r) {
        const int32_t slot = ver.as<int32_t>("state_indices")[r];
        if (slot < 0) continue;
        EXPECT_TRUE(RelClose("row " + std::to_string(r) + " step " + std::to_string(t), dec.read_state("state", slot),
                             ver.read_cache("intermediate", ver.as<int32_t>("intermediate_indices")[r], t),
                             state_tolerance(OpFamily::kStep, state)));
      }
    }
    EXPECT_TRUE(
        RelClose("o", dec.read_tokens("o"), ver.read_tokens("o"), output_tolerance(OpFamily::kStep, c.in_dtype)));
    for (int32_t r = 0; r < ver.rows(); ++r) {
      const int32_t slot = ver.as<int32_t>("state_indices")[r];
      if (slot >= 0) {
        EXPECT_TRUE(RelClose("final state row " + std::to_string(r), dec.read_state("state", slot),
                             ver.read_state("state", slot), state_tolerance(OpFamily::kStep, state)));
      }
    }
    if (state == DType::kFloat32) continue;
    // bf16: T roundings vs one must actually differ somewhere (the test can tell the two apart).
    EXPECT_FALSE(BitwiseEqual("pool", dec.buffer("state"), ver.buffer("state")));
  }
}

// ---- commit: from the cache == by recompute == decode steps -----------------------------------------

TEST(RefCommit, CacheEqualsRecomputeEqualsDecodeSteps) {
  for (bool tree : {false, true}) {
    ProblemConfig c;
    c.op = OpKind::kVerify;
    c.batch = 5;
    c.draft_tokens = 5;
    c.tree = tree;
    c.seed = tree ? 31 : 32;
    Problem cached(c);
    const Problem original = cached;
    cpu::verify(cached.verify_params());
    Problem recomputed = cached;
    cpu::commit(cached.commit_params(CommitSource::kCache));
    cpu::commit(recomputed.commit_params(CommitSource::kRecompute));
    const double tol = state_tolerance(OpFamily::kStep, c.state_dtype);
    for (int32_t r = 0; r < cached.rows(); ++r) {
      const int32_t slot = cached.as<int32_t>("state_indices")[r];
      EXPECT_TRUE(RelClose(std::string(tree ? "tree" : "chain") + " row " + std::to_string(r) + " cache vs recompute",
                           cached.read_state("state", slot), recomputed.read_state("state", slot), tol));
    }
    if (tree) continue;
    // Chains: decode steps t = 0 .. accepted-1 per row (a row that kept fewer tokens is padding in
    // the later steps).
    Problem dec = original;
    for (int t = 0; t < c.draft_tokens; ++t) {
      Problem step = dec;  // fresh index tensor per step; the pool carries over
      for (int32_t r = 0; r < step.rows(); ++r)
        if (t >= original.as<int32_t>("accepted")[r]) step.as<int32_t>("state_indices")[r] = -1;
      cpu::decode(decode_step(step, t));
      dec.buffer("state").bytes = step.buffer("state").bytes;
    }
    for (int32_t r = 0; r < dec.rows(); ++r) {
      const int32_t slot = dec.as<int32_t>("state_indices")[r];
      EXPECT_TRUE(RelClose("chain row " + std::to_string(r) + " decode steps vs cache", dec.read_state("state", slot),
                           cached.read_state("state", slot), tol));
    }
    // decode steps replay the kept tokens, as a commit by recompute does
    EXPECT_TRUE(
        UntouchedSlotsEqual(original, dec, "state", original.written_pool_slots_commit(CommitSource::kRecompute)));
  }
}

}  // namespace
}  // namespace gdnkit::test
