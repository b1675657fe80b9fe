// float8_e4m3 states (types.h kFp8Block): the host conversions against a brute-force nearest search, the block
// scales, and every op of the CPU backend on fp8 pools and caches against the same op on an fp32 twin that holds the
// dequantized values: each state the fp8 run stores must be the host quantization of what the twin stores (the
// reference computes in double from identical values, so the two runs differ only in the store), untouched slots,
// scales and slot padding bit-identical; bad fp8 params rejected with nothing written.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gdnkit/gdnkit.h"
#include "gdnkit/host_dtype.h"

namespace gdnkit::test {
namespace {

const Context kCpu{Backend::kCPU, nullptr};

// The e4m3 value nearest x (ties to the even code), saturating at +-448, by search over all finite codes.
uint8_t nearest_e4m3(float x) {
  if (std::fabs(x) >= 448.0f) return x > 0 ? 0x7e : 0xfe;
  int best = -1;
  double err = 0;
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    const double d = std::fabs(double(host::e4m3_to_float(uint8_t(c))) - x);
    const bool sign_ok = (c & 0x80) == (std::signbit(x) ? 0x80 : 0);
    if (!sign_ok) continue;
    if (best < 0 || d < err || (d == err && (c & 1) == 0)) best = c, err = d;
  }
  return uint8_t(best);
}

TEST(Fp8, CodesRoundTrip) {
  for (int c = 0; c < 256; ++c) {
    const float f = host::e4m3_to_float(uint8_t(c));
    if ((c & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(f)) << c;
      EXPECT_EQ(host::float_to_e4m3(f) & 0x7f, 0x7f) << c;
    } else {
      EXPECT_EQ(host::float_to_e4m3(f), c) << c << " = " << f;
    }
  }
  EXPECT_EQ(host::e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(host::e4m3_to_float(0x01), std::ldexp(1.0f, -9));
}

TEST(Fp8, RoundsToNearestEvenAndSaturates) {
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> expo(-12, 9);
  for (int i = 0; i < 20000; ++i) {
    const float x = std::ldexp(mant(gen), expo(gen));
    ASSERT_EQ(host::float_to_e4m3(x), nearest_e4m3(x)) << x;
  }
  // Ties: 1.0625 between 1 (even) and 1.125; 1.1875 between 1.125 and 1.25 (even); 1.5 * 2^-9 between codes 1 and 2.
  EXPECT_EQ(host::e4m3_to_float(host::float_to_e4m3(1.0625f)), 1.0f);
  EXPECT_EQ(host::e4m3_to_float(host::float_to_e4m3(1.1875f)), 1.25f);
  EXPECT_EQ(host::float_to_e4m3(std::ldexp(1.5f, -9)), 0x02);
  EXPECT_EQ(host::float_to_e4m3(464.0f), 0x7e);
  EXPECT_EQ(host::float_to_e4m3(1e30f), 0x7e);
  EXPECT_EQ(host::float_to_e4m3(-INFINITY), 0xfe);
}

TEST(Fp8, BlockScalePutsTheLargestElementOn128To240) {
  std::mt19937 gen(8);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> expo(-110, 110);
  float x[kFp8Block], back[kFp8Block];
  uint8_t q[kFp8Block], q2[kFp8Block];
  for (int it = 0; it < 4000; ++it) {
    const int e = expo(gen);
    for (float& v : x) v = std::ldexp(nd(gen), e);
    if (it % 7 == 0) x[it % kFp8Block] = std::ldexp(255.0f, e);  // rounds up to the next power of two
    const uint8_t s = host::quantize_e4m3_block(x, kFp8Block, q);
    const double scale = std::ldexp(1.0, int(s) - 127);
    float cmax = 0.0f;
    for (int i = 0; i < kFp8Block; ++i) {
      ASSERT_EQ(q[i], host::float_to_e4m3(float(x[i] / scale))) << it << " " << i;
      const float c = host::e4m3_to_float(q[i]);
      cmax = std::fmax(cmax, std::fabs(c));
      back[i] = float(c * scale);
      // Within half a step of the e4m3 grid at this scale (3 fraction bits; subnormal steps of 2^-9).
      ASSERT_LE(std::fabs(double(back[i]) - x[i]), std::fmax(std::fabs(x[i]) / 16, std::ldexp(scale, -10)) * (1 + 1e-9))
          << it;
    }
    ASSERT_GE(cmax, 128.0f) << it;
    ASSERT_LE(cmax, 240.0f) << it;
    // Quantizing the quantized block again changes no byte.
    ASSERT_EQ(host::quantize_e4m3_block(back, kFp8Block, q2), s) << it;
    ASSERT_EQ(std::memcmp(q, q2, kFp8Block), 0) << it;
  }
  for (float& v : x) v = 0.0f;
  EXPECT_EQ(host::quantize_e4m3_block(x, kFp8Block, q), 0);
  for (uint8_t b : q) EXPECT_EQ(host::e4m3_to_float(b), 0.0f);
  x[5] = NAN;
  EXPECT_EQ(host::quantize_e4m3_block(x, kFp8Block, q), 0xff);
  EXPECT_TRUE(std::isnan(host::e8m0_to_float(0xff)));
}

// ---- the ops on fp8 pools ---------------------------------------------------------------------------------------

constexpr int H = 1, HV = 2, K = 64, V = 64;
constexpr int64_t kHead = int64_t(K) * V, kBlocks = kHead / kFp8Block;
constexpr int64_t kStride = HV * kHead + 64;  // slot padding, which no op may touch
constexpr uint8_t kPadByte = 0xa5;

HeadConfig heads() {
  HeadConfig h;
  h.num_qk_heads = H, h.num_v_heads = HV, h.head_dim_k = K, h.head_dim_v = V;
  return h;
}

// A buffer of `slots` x `steps` states of HV heads in fp8 with scales, and its fp32 twin holding the dequantized
// values (slot stride kStride for a pool, steps * HV * kHead for a cache).
struct Fp8States {
  int64_t slots, steps, stride;
  std::vector<uint8_t> q, scales;
  std::vector<float> f;

  Fp8States(int64_t slots_, int64_t steps_, int64_t stride_, uint64_t seed)
      : slots(slots_), steps(steps_), stride(stride_), q(size_t(slots_ * stride_), kPadByte),
        scales(size_t(slots_ * steps_ * HV * kBlocks)), f(size_t(slots_ * stride_), NAN) {
    std::mt19937_64 gen(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::uniform_int_distribution<int> expo(-6, 3);  // blocks of different magnitudes
    float x[kFp8Block];
    for (int64_t s = 0; s < slots; ++s)
      for (int64_t e = 0; e < steps * HV * kHead; e += kFp8Block) {
        const int ex = expo(gen);
        for (float& v : x) v = std::ldexp(nd(gen), ex);
        const int64_t at = s * stride + e;
        uint8_t& sc = scales[size_t((s * steps * HV * kHead + e) / kFp8Block)];
        sc = host::quantize_e4m3_block(x, kFp8Block, &q[size_t(at)]);
        for (int i = 0; i < kFp8Block; ++i) f[size_t(at + i)] = dequant(at + i, sc);
      }
  }
  float dequant(int64_t at, uint8_t sc) const { return host::e4m3_to_float(q[size_t(at)]) * host::e8m0_to_float(sc); }
  uint8_t scale_of(int64_t slot, int64_t e) const {
    return scales[size_t((slot * steps * HV * kHead + e) / kFp8Block)];
  }

  StatePool pool(StateLayout layout) {
    return {q.data(), DType::kFloat8E4M3, layout, slots, stride, scales.data()};
  }
  StatePool twin_pool(StateLayout layout) { return {f.data(), DType::kFloat32, layout, slots, stride, nullptr}; }
  StateCache cache(StateLayout layout) {
    return {q.data(), DType::kFloat8E4M3, layout, slots, steps, stride, scales.data()};
  }
  StateCache twin_cache(StateLayout layout) {
    return {f.data(), DType::kFloat32, layout, slots, steps, stride, nullptr};
  }

  // Slot `slot` (all steps) holds exactly the host quantization of the twin's values, block by block.
  ::testing::AssertionResult quantizes_twin(int64_t slot) const {
    uint8_t want[kFp8Block];
    for (int64_t e = 0; e < steps * HV * kHead; e += kFp8Block) {
      const int64_t at = slot * stride + e;
      const uint8_t s = host::quantize_e4m3_block(&f[size_t(at)], kFp8Block, want);
      if (s != scale_of(slot, e) || std::memcmp(want, &q[size_t(at)], kFp8Block) != 0)
        return ::testing::AssertionFailure() << "slot " << slot << ", block at element " << e << " differs from the "
                                             << "quantized fp32 result (scale byte " << int(scale_of(slot, e))
                                             << ", expected " << int(s) << ")";
    }
    return ::testing::AssertionSuccess();
  }
  // Slot `slot`, its scales and its padding as in `before`.
  ::testing::AssertionResult untouched(const Fp8States& before, int64_t slot) const {
    if (std::memcmp(&q[size_t(slot * stride)], &before.q[size_t(slot * stride)], size_t(stride)) != 0)
      return ::testing::AssertionFailure() << "slot " << slot << " (or its padding) changed";
    const size_t s0 = size_t(slot * steps * HV * kBlocks), n = size_t(steps * HV * kBlocks);
    if (std::memcmp(&scales[s0], &before.scales[s0], n) != 0)
      return ::testing::AssertionFailure() << "the scales of slot " << slot << " changed";
    return ::testing::AssertionSuccess();
  }
};

// Token inputs: fp32 q, k, v [rows, heads, dim], given gates.
struct Tokens {
  std::vector<float> q, k, v, o, o_twin, g, beta;
  explicit Tokens(int64_t rows, uint64_t seed)
      : q(size_t(rows * H * K)), k(size_t(rows * H * K)), v(size_t(rows * HV * V)), o(size_t(rows * HV * V), NAN),
        o_twin(size_t(rows * HV * V), NAN), g(size_t(rows * HV)), beta(size_t(rows * HV)) {
    std::mt19937_64 gen(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::uniform_real_distribution<float> ud(0.0f, 1.0f);
    for (auto* x : {&q, &k, &v})
      for (float& e : *x) e = nd(gen);
    for (float& e : g) e = -0.5f * ud(gen);
    for (float& e : beta) e = ud(gen);
  }
  template <class P>
  void into(P& p, bool twin) {
    p.heads = heads();
    p.q = {q.data(), DType::kFloat32, H * K, K};
    p.k = {k.data(), DType::kFloat32, H * K, K};
    p.v = {v.data(), DType::kFloat32, HV * V, V};
    p.o = {twin ? o_twin.data() : o.data(), DType::kFloat32, HV * V, V};
    p.gating.mode = GateMode::kGiven;
    p.gating.g = {g.data(), DType::kFloat32, HV, 1};
    p.gating.beta = {beta.data(), DType::kFloat32, HV, 1};
  }
};

class Fp8Ops : public ::testing::TestWithParam<StateLayout> {};

// Verify / commit params of B rows of T tokens over the fp8 pool or its twin.
CommitParams step_params(Tokens& tok, Fp8States& pool, bool twin, StateLayout layout, int B, int T,
                         const std::vector<int32_t>& slots, const std::vector<int32_t>& accepted) {
  CommitParams p;
  tok.into(p, twin);
  p.batch = B;
  p.num_draft_tokens = T;
  p.state = twin ? pool.twin_pool(layout) : pool.pool(layout);
  p.state_indices = slots.data();
  p.accepted = accepted.data();
  return p;
}

TEST_P(Fp8Ops, DecodeStoresTheQuantizedState) {
  const StateLayout layout = GetParam();
  Fp8States pool(4, 1, kStride, 1);
  const Fp8States before = pool;
  Tokens tok(3, 2);
  const std::vector<int32_t> slots{2, 0, -1};  // a padding row
  DecodeParams d, t;
  for (auto [p, twin] : {std::pair<DecodeParams*, bool>{&d, false}, {&t, true}}) {
    tok.into(*p, twin);
    p->batch = 3;
    p->state = twin ? pool.twin_pool(layout) : pool.pool(layout);
    p->state_indices = slots.data();
  }
  decode(d, kCpu);
  decode(t, kCpu);
  EXPECT_EQ(tok.o, tok.o_twin);  // both read the same state values
  EXPECT_TRUE(pool.quantizes_twin(2));
  EXPECT_TRUE(pool.quantizes_twin(0));
  EXPECT_TRUE(pool.untouched(before, 1));
  EXPECT_TRUE(pool.untouched(before, 3));
  EXPECT_FALSE(pool.untouched(before, 2)) << "decode wrote nothing";
}

TEST_P(Fp8Ops, VerifyCacheThenCommit) {
  const StateLayout layout = GetParam();
  constexpr int B = 2, T = 3;
  Fp8States pool(3, 1, kStride, 3), cache(2, T, int64_t(T) * HV * kHead, 4);
  const Fp8States pool0 = pool;
  Tokens tok(B * T, 5);
  const std::vector<int32_t> slots{1, 2}, islots{1, 0}, accepted{2, 3};
  CommitParams c = step_params(tok, pool, false, layout, B, T, slots, accepted);
  CommitParams ct = step_params(tok, pool, true, layout, B, T, slots, accepted);
  c.intermediate = cache.cache(layout), ct.intermediate = cache.twin_cache(layout);
  c.intermediate_indices = ct.intermediate_indices = islots.data();
  c.source = ct.source = CommitSource::kCache;
  verify(c, kCpu);
  verify(ct, kCpu);
  EXPECT_EQ(tok.o, tok.o_twin);
  EXPECT_TRUE(cache.quantizes_twin(0));
  EXPECT_TRUE(cache.quantizes_twin(1));
  EXPECT_TRUE(pool.untouched(pool0, 1) && pool.untouched(pool0, 2)) << "verify without update_state wrote the pool";
  commit(c, kCpu);
  commit(ct, kCpu);
  // From the fp8 cache the pool gets the cached values, quantized again in the same blocks: the same bytes.
  EXPECT_TRUE(pool.quantizes_twin(1));
  EXPECT_TRUE(pool.quantizes_twin(2));
  EXPECT_TRUE(pool.untouched(pool0, 0));
  EXPECT_FALSE(pool.untouched(pool0, 1)) << "commit wrote nothing";
}

TEST_P(Fp8Ops, CommitByRecompute) {
  const StateLayout layout = GetParam();
  constexpr int B = 2, T = 4;
  Fp8States pool(3, 1, kStride, 6);
  const Fp8States pool0 = pool;
  Tokens tok(B * T, 7);
  const std::vector<int32_t> slots{0, 2}, accepted{3, 1};
  CommitParams c = step_params(tok, pool, false, layout, B, T, slots, accepted);
  CommitParams ct = step_params(tok, pool, true, layout, B, T, slots, accepted);
  c.source = ct.source = CommitSource::kRecompute;
  commit(c, kCpu);
  commit(ct, kCpu);
  EXPECT_TRUE(pool.quantizes_twin(0));
  EXPECT_TRUE(pool.quantizes_twin(2));
  EXPECT_TRUE(pool.untouched(pool0, 1));
  EXPECT_FALSE(pool.untouched(pool0, 0)) << "commit wrote nothing";
}

TEST_P(Fp8Ops, PrefillStatesAndCheckpoints) {
  const StateLayout layout = GetParam();
  constexpr int N = 2;
  const std::vector<int32_t> cu{0, 200, 330}, init{1, -1}, fin{1, 3}, cps{0, 1};
  Fp8States pool(4, 1, kStride, 8), ckpt(2, 3, 3 * HV * kHead + 32, 9);
  const Fp8States pool0 = pool;
  Tokens tok(cu[N], 10);
  for (auto algo : {PrefillAlgorithm::kRecurrent, PrefillAlgorithm::kChunked}) {
    PrefillParams p, pt;
    for (auto [x, twin] : {std::pair<PrefillParams*, bool>{&p, false}, {&pt, true}}) {
      tok.into(*x, twin);
      x->num_seqs = N;
      x->total_tokens = cu[N];
      x->cu_seqlens = cu.data();
      x->state = twin ? pool.twin_pool(layout) : pool.pool(layout);
      x->initial_indices = init.data();
      x->final_indices = fin.data();
      x->checkpoints = twin ? ckpt.twin_cache(layout) : ckpt.cache(layout);
      x->checkpoint_interval = 64;
      x->checkpoint_indices = cps.data();
      x->cpu_algorithm = algo;
    }
    // Each algorithm from the same start: the final slot 1 is also sequence 0's initial slot.
    pool = pool0;
    prefill(p, kCpu);
    prefill(pt, kCpu);
    SCOPED_TRACE(algo == PrefillAlgorithm::kRecurrent ? "recurrent" : "chunked");
    EXPECT_EQ(tok.o, tok.o_twin);
    EXPECT_TRUE(pool.quantizes_twin(1));
    EXPECT_TRUE(pool.quantizes_twin(3));
    EXPECT_TRUE(pool.untouched(pool0, 0) && pool.untouched(pool0, 2));
    // Sequence 0 (200 tokens) stores checkpoints 0..2 of slot 0, sequence 1 (130 tokens) 0..1 of slot 1; the rest of
    // slot 1 keeps its start (compared through the twin, whose step 2 was not written either).
    EXPECT_TRUE(ckpt.quantizes_twin(0));
    EXPECT_TRUE(ckpt.quantizes_twin(1));
    EXPECT_FALSE(pool.untouched(pool0, 3)) << "prefill stored no final state";
  }
  EXPECT_NE(ckpt.q, Fp8States(2, 3, 3 * HV * kHead + 32, 9).q) << "prefill stored no checkpoint";
}

TEST_P(Fp8Ops, LayoutConversion) {
  const StateLayout layout = GetParam();
  const StateLayout other = layout == StateLayout::kKLast ? StateLayout::kVLast : StateLayout::kKLast;
  Fp8States src(3, 1, kStride, 11), dst(3, 1, kStride, 12);
  const Fp8States src0 = src;
  LayoutParams p, pt;
  p.num_v_heads = pt.num_v_heads = HV;
  p.head_dim_k = pt.head_dim_k = K;
  p.head_dim_v = pt.head_dim_v = V;
  p.src = src.pool(layout), p.dst = dst.pool(other);
  pt.src = src.twin_pool(layout), pt.dst = dst.twin_pool(other);
  convert_layout(p, kCpu);
  convert_layout(pt, kCpu);
  for (int64_t s = 0; s < 3; ++s) {
    EXPECT_TRUE(dst.quantizes_twin(s));
    EXPECT_TRUE(src.untouched(src0, s));
  }
  // In place (K == V): the same blocks as out of place.
  LayoutParams in_place = p;
  in_place.dst = src.pool(other);
  convert_layout(in_place, kCpu);
  EXPECT_EQ(src.q, dst.q);
  EXPECT_EQ(src.scales, dst.scales);
}

INSTANTIATE_TEST_SUITE_P(Layouts, Fp8Ops, ::testing::Values(StateLayout::kKLast, StateLayout::kVLast),
                         [](const auto& info) { return info.param == StateLayout::kKLast ? "klast" : "vlast"; });

// ---- bad params -------------------------------------------------------------------------------------------------

template <class Fn>
std::string error_of(Fn fn, ErrorCode code) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

TEST(Fp8, MissingScalesRejectedAndNothingWritten) {
  Fp8States pool(2, 1, kStride, 13), ckpt(1, 1, HV * kHead, 14);
  const Fp8States pool0 = pool, ckpt0 = ckpt;
  Tokens tok(2, 15);
  const std::vector<int32_t> slots{0, 1};
  DecodeParams d;
  tok.into(d, false);
  d.batch = 2;
  d.state = pool.pool(StateLayout::kKLast);
  d.state.scales = nullptr;
  d.state_indices = slots.data();
  EXPECT_EQ(error_of([&] { decode(d, kCpu); }, ErrorCode::kInvalidArgument),
            "state: float8_e4m3 states need their scales (one byte per 32 elements), got a null pointer");
  EXPECT_TRUE(pool.untouched(pool0, 0) && pool.untouched(pool0, 1));
  for (float x : tok.o) EXPECT_TRUE(std::isnan(x)) << "o written";

  const std::vector<int32_t> cu{0, 64}, fin{0}, cps{0};
  PrefillParams p;
  tok = Tokens(64, 16);
  tok.into(p, false);
  p.num_seqs = 1, p.total_tokens = 64, p.cu_seqlens = cu.data();
  p.state = pool.pool(StateLayout::kKLast);
  p.final_indices = fin.data();
  p.checkpoints = ckpt.cache(StateLayout::kKLast);
  p.checkpoints.scales = nullptr;
  p.checkpoint_interval = 64, p.checkpoint_indices = cps.data();
  EXPECT_EQ(error_of([&] { prefill(p, kCpu); }, ErrorCode::kInvalidArgument),
            "checkpoints: float8_e4m3 states need their scales (one byte per 32 elements), got a null pointer");
  EXPECT_TRUE(pool.untouched(pool0, 0) && pool.untouched(pool0, 1) && ckpt.untouched(ckpt0, 0));
  for (float x : tok.o) EXPECT_TRUE(std::isnan(x)) << "o written";

  Fp8States cache(2, 2, 2 * HV * kHead, 23);
  const Fp8States cache0 = cache;
  VerifyParams v;
  tok = Tokens(4, 24);
  tok.into(v, false);
  v.batch = 2, v.num_draft_tokens = 2;
  v.state = pool.pool(StateLayout::kKLast);
  v.state_indices = slots.data();
  v.intermediate = cache.cache(StateLayout::kKLast);
  v.intermediate.scales = nullptr;
  v.intermediate_indices = slots.data();
  EXPECT_EQ(error_of([&] { verify(v, kCpu); }, ErrorCode::kInvalidArgument),
            "intermediate: float8_e4m3 states need their scales (one byte per 32 elements), got a null pointer");
  EXPECT_TRUE(pool.untouched(pool0, 0) && pool.untouched(pool0, 1));
  EXPECT_TRUE(cache.untouched(cache0, 0) && cache.untouched(cache0, 1));
  for (float x : tok.o) EXPECT_TRUE(std::isnan(x)) << "o written";
}

TEST(Fp8, LayoutScalesRules) {
  Fp8States src(2, 1, kStride, 17), dst(2, 1, kStride, 18);
  LayoutParams p;
  p.num_v_heads = HV, p.head_dim_k = K, p.head_dim_v = V;
  p.src = src.pool(StateLayout::kKLast);
  p.dst = dst.pool(StateLayout::kVLast);
  p.dst.scales = src.scales.data();
  EXPECT_NE(error_of([&] { convert_layout(p, kCpu); }, ErrorCode::kInvalidArgument).find("dst: scales overlap those of src"),
            std::string::npos);
  p.dst = dst.pool(StateLayout::kVLast);
  p.dst.scales = src.scales.data() + 1;  // overlapping, not equal
  EXPECT_NE(error_of([&] { convert_layout(p, kCpu); }, ErrorCode::kInvalidArgument).find("dst: scales overlap those of src"),
            std::string::npos);
  p.dst.scales = src.q.data();  // inside src's data
  EXPECT_NE(error_of([&] { convert_layout(p, kCpu); }, ErrorCode::kInvalidArgument).find("dst: scales overlap a pool's data"),
            std::string::npos);
  p.dst.scales = nullptr;
  EXPECT_EQ(error_of([&] { convert_layout(p, kCpu); }, ErrorCode::kInvalidArgument),
            "dst: float8_e4m3 states need their scales (one byte per 32 elements), got a null pointer");
  p.dst = src.pool(StateLayout::kVLast);
  p.dst.scales = dst.scales.data();
  EXPECT_NE(error_of([&] { convert_layout(p, kCpu); }, ErrorCode::kInvalidArgument)
                .find("dst: in-place conversion needs the scales of src"),
            std::string::npos);
}

// The CUDA backend takes fp8 pools, intermediate caches and checkpoints in every op (prefill on staged K-last fp32
// copies where no pass takes them in place), V-last fp8 pools in decode at K in {64, 128}, V in {128, 256}, and in a
// split prefill the ones prefill takes in place: the rest (V-last decode at other dims, a split prefill's buffers off
// the head pass: V-last, or K-last at K = 64) is refused after validation and before any device work, whether or not a
// GPU is present.
TEST(Fp8, CudaBackendRefusesFp8OutsideItsKernels) {
  Fp8States pool(2, 1, kStride, 19);
  const Fp8States pool0 = pool;
  Tokens tok(4, 20);
  const std::vector<int32_t> slots{0, 1};
  const Context cuda{Backend::kCUDA, nullptr};
  const std::string tail = ": the CUDA backend takes float8_e4m3 pools, intermediate caches and checkpoints in decode "
                           "(V-last pools with K in {64, 128} and V in {128, 256}), verify, commit and prefill, and in "
                           "split prefill those prefill takes in place";
  DecodeParams d;
  tok.into(d, false);
  d.batch = 2;
  d.state = pool.pool(StateLayout::kVLast);
  d.state_indices = slots.data();
  EXPECT_EQ(error_of([&] { decode(d, cuda); }, ErrorCode::kNotImplemented),
            "state" + tail + ", got V-last with K = 64, V = 64 (the CPU backend runs every op)");
  Fp8States pool32(2, 1, kStride, 22);  // an fp32 pool beside fp8 checkpoints (below)
  const std::vector<int32_t> cu{0, 4}, fin{0};
  std::vector<float> exchange(size_t(1) << 16);
  SplitPrefillParams sp;
  PrefillParams& pf = sp.local;
  tok.into(pf, false);
  pf.num_seqs = 1, pf.total_tokens = 4, pf.cu_seqlens = cu.data();
  pf.state = pool.pool(StateLayout::kKLast);  // fp32 inputs at K = 64: neither the head pass nor the tiled pass's fp8
  pf.final_indices = fin.data();
  sp.exchange = exchange.data();
  const std::string klast =
      ", got K-last with float32 inputs, K = 64, V = 64 (the head state pass takes bf16 or fp16 inputs in 16-byte aligned "
      "rows, K <= 128, V in {64, 128}; the tiled pass K >= 128) (the CPU backend runs every op)";
  const std::string vlast =
      ", got V-last with float32 inputs, K = 64, V = 64 (the head state pass takes bf16 or fp16 inputs in 16-byte "
      "aligned rows, K <= 128, V in {64, 128}) (the CPU backend runs every op)";
  // prefill takes them (on staged copies: its path is the staged call's)
  EXPECT_EQ(prefill_path(pf).context_parallel_segment, 0);
  EXPECT_EQ(error_of([&] { split_prefill_begin(sp, cuda); }, ErrorCode::kNotImplemented), "state" + tail + klast);
  EXPECT_EQ(error_of([&] { (void)split_prefill_workspace_bytes(sp); }, ErrorCode::kNotImplemented),
            "state" + tail + klast);
  pf.state = pool.pool(StateLayout::kVLast);
  EXPECT_EQ(prefill_path(pf).context_parallel_segment, 0);
  EXPECT_EQ(error_of([&] { split_prefill_end(sp, cuda); }, ErrorCode::kNotImplemented), "state" + tail + vlast);
  // fp8 checkpoints beside an fp32 pool: K-last, and at K = 64 16-bit inputs with V in {64, 128} (the head pass).
  Fp8States ckpt(1, 1, HV * kHead, 26);
  const std::vector<int32_t> cps{0};
  pf.state = pool32.twin_pool(StateLayout::kKLast);
  pf.checkpoints = ckpt.cache(StateLayout::kKLast);
  pf.checkpoint_interval = 64, pf.checkpoint_indices = cps.data();
  EXPECT_EQ(error_of([&] { split_prefill_begin(sp, cuda); }, ErrorCode::kNotImplemented), "checkpoints" + tail + klast);
  pf.state = pool32.twin_pool(StateLayout::kVLast);
  pf.checkpoints = ckpt.cache(StateLayout::kVLast);
  EXPECT_EQ(error_of([&] { split_prefill_begin(sp, cuda); }, ErrorCode::kNotImplemented), "checkpoints" + tail + vlast);
  // without a pool the checkpoints' layout is the call's
  pf.state = StatePool{}, pf.final_indices = nullptr;
  EXPECT_EQ(error_of([&] { split_prefill_begin(sp, cuda); }, ErrorCode::kNotImplemented), "checkpoints" + tail + vlast);
  EXPECT_TRUE(pool.untouched(pool0, 0) && pool.untouched(pool0, 1));
  for (float x : tok.o) EXPECT_TRUE(std::isnan(x)) << "o written";
}

}  // namespace
}  // namespace gdnkit::test
