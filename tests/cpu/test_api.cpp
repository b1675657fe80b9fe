// The public API itself: names, errors, build information, backend selection, and one decode step through
// the public entry with a closed-form answer (padding rows, skipped slots, untouched slots).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "gdnkit/gdnkit.h"

namespace gdnkit {
namespace {

TEST(Api, Names) {
  EXPECT_STREQ(dtype_name(DType::kFloat32), "float32");
  EXPECT_STREQ(dtype_name(DType::kBFloat16), "bfloat16");
  EXPECT_STREQ(dtype_name(DType::kFloat16), "float16");
  EXPECT_STREQ(dtype_name(DType::kInt32), "int32");
  EXPECT_STREQ(dtype_name(DType::kInt64), "int64");
  EXPECT_EQ(dtype_size(DType::kFloat32), 4);
  EXPECT_EQ(dtype_size(DType::kBFloat16), 2);
  EXPECT_EQ(dtype_size(DType::kFloat16), 2);
  EXPECT_EQ(dtype_size(DType::kInt32), 4);
  EXPECT_EQ(dtype_size(DType::kInt64), 8);
  EXPECT_STREQ(backend_name(Backend::kCPU), "cpu");
  EXPECT_STREQ(backend_name(Backend::kCUDA), "cuda");
  EXPECT_NE(std::string(layout_name(StateLayout::kKLast)), std::string(layout_name(StateLayout::kVLast)));
}

TEST(Api, ErrorCarriesCodeAndMessage) {
  try {
    throw Error(ErrorCode::kNoDevice, "backend cuda: none");
  } catch (const std::runtime_error& e) {  // catchable as a standard exception
    EXPECT_STREQ(e.what(), "backend cuda: none");
    ASSERT_NE(dynamic_cast<const Error*>(&e), nullptr);
    EXPECT_EQ(dynamic_cast<const Error&>(e).code(), ErrorCode::kNoDevice);
  }
}

TEST(Api, BuildInfo) {
  const std::string info = build_info();
  EXPECT_NE(info.find("gdnkit "), std::string::npos) << info;
#ifdef GDNKIT_WITH_CUDA
  EXPECT_TRUE(cuda_compiled());
  EXPECT_NE(info.find("cuda"), std::string::npos) << info;
#else
  EXPECT_FALSE(cuda_compiled());
  EXPECT_FALSE(cuda_available());
  EXPECT_NE(info.find("built without CUDA"), std::string::npos) << info;
#endif
  if (!cuda_compiled()) {
    EXPECT_FALSE(cuda_available());
  }
}

// include/gdnkit/version.h is the one source of the version: the string is made of the three numbers, the
// library reports it, and CMake's project version (find_package(gdnkit X.Y), read from the same header) is it.
TEST(Api, Version) {
  const std::string v = GDNKIT_VERSION_STRING;
  EXPECT_EQ(v, std::to_string(GDNKIT_VERSION_MAJOR) + "." + std::to_string(GDNKIT_VERSION_MINOR) + "." +
                   std::to_string(GDNKIT_VERSION_PATCH));
  EXPECT_EQ(GDNKIT_VERSION_NUMBER, GDNKIT_VERSION_MAJOR * 10000 + GDNKIT_VERSION_MINOR * 100 + GDNKIT_VERSION_PATCH);
#if !defined(GDNKIT_VERSION_NUMBER) || GDNKIT_VERSION_NUMBER < 100  // usable in #if; 0.1.0 was the first
#error "GDNKIT_VERSION_NUMBER is not usable in #if"
#endif
  const std::string info = build_info();
  EXPECT_EQ(info.substr(0, info.find('\n')), "gdnkit " + v) << info;
#ifdef GDNKIT_CMAKE_PROJECT_VERSION
  EXPECT_EQ(v, GDNKIT_CMAKE_PROJECT_VERSION);
#endif
}

// One decode step from S = 0 with constant inputs has a closed form: with L2-normalized q, k of equal
// entries, k.q = 1 (up to eps), beta = sigmoid(b), u = beta * v, S = k u^T, o = S^T q * scale = u / sqrt(K).
struct SmallDecode {
  static constexpr int B = 4, H = 1, HV = 2, K = 64, V = 64, P = 6;
  static constexpr int64_t kSlot = int64_t(HV) * K * V;
  std::vector<float> q = std::vector<float>(B * H * K, 0.7f), k = std::vector<float>(B * H * K, -0.3f);
  std::vector<float> v = std::vector<float>(B * HV * V), o = std::vector<float>(B * HV * V, NAN);
  std::vector<float> a = std::vector<float>(B * HV, 0.0f), b = std::vector<float>(B * HV, 1.0f);
  std::vector<float> A_log = std::vector<float>(HV, 0.0f), dt_bias = std::vector<float>(HV, 0.0f);
  std::vector<float> pool;
  std::vector<int32_t> slots{4, -1, 1, P + 3};  // a slot, a padding row, a slot, a slot past the pool
  std::vector<int32_t> error_flag{0};

  SmallDecode() {
    for (size_t i = 0; i < v.size(); ++i) v[i] = 0.01f * float(i % 97) - 0.4f;
    // Row 2's k points the other way and each row has its own beta, so rows read in each other's place show.
    std::fill(k.begin() + 2 * H * K, k.begin() + 3 * H * K, 0.3f);
    for (int row = 0; row < B; ++row) std::fill(b.begin() + row * HV, b.begin() + (row + 1) * HV, 1.0f + 0.5f * row);
    pool.assign(size_t(P) * kSlot, NAN);
    for (int s : {4, 1}) std::fill(pool.begin() + s * kSlot, pool.begin() + (s + 1) * kSlot, 0.0f);
  }
  DecodeParams params() {
    DecodeParams p;
    p.heads = {H, HV, K, V, 0.0f, true};
    p.batch = B;
    p.q = {q.data(), DType::kFloat32, H * K, K};
    p.k = {k.data(), DType::kFloat32, H * K, K};
    p.v = {v.data(), DType::kFloat32, HV * V, V};
    p.o = {o.data(), DType::kFloat32, HV * V, V};
    p.gating.a = {a.data(), DType::kFloat32, HV, 1};
    p.gating.b = {b.data(), DType::kFloat32, HV, 1};
    p.gating.A_log = A_log.data();
    p.gating.dt_bias = dt_bias.data();
    p.state = {pool.data(), DType::kFloat32, StateLayout::kKLast, P, kSlot};
    p.state_indices = slots.data();
    p.error_flag = error_flag.data();
    return p;
  }
};

TEST(Api, DecodeStepThroughThePublicEntry) {
  SmallDecode d;
  const std::vector<float> before = d.pool;
  decode(d.params(), Context{Backend::kCPU, nullptr});

  const auto beta = [](int row) { return 1.0 / (1.0 + std::exp(-(1.0 + 0.5 * row))); };
  const auto k_sign = [](int row) { return row == 2 ? 1.0 : -1.0; };  // after the norm k = sign / sqrt(K)
  const double inv_sqrt_k = 1.0 / std::sqrt(double(SmallDecode::K));
  for (int row = 0; row < SmallDecode::B; ++row)
    for (int h = 0; h < SmallDecode::HV; ++h)
      for (int j = 0; j < SmallDecode::V; ++j) {
        const size_t i = (size_t(row) * SmallDecode::HV + h) * SmallDecode::V + j;
        // Rows 1 (padding) and 3 (slot >= P, skipped) give o = 0; else o = beta (k.q) v / sqrt(K), k.q = sign.
        const double want = (row == 1 || row == 3) ? 0.0 : k_sign(row) * beta(row) * d.v[i] * inv_sqrt_k;
        ASSERT_NEAR(d.o[i], want, 1e-5) << "row " << row << " head " << h << " j " << j;
      }
  EXPECT_EQ(d.error_flag[0], 1) << "one slot >= P must be counted";
  // Slots 4 (row 0) and 1 (row 2), K-last [V, K], from S = 0: S^T[j][i] = k_i u_j, u_j = beta v_j.
  for (const auto [row, slot] : {std::pair{0, 4}, std::pair{2, 1}})
    for (int h = 0; h < SmallDecode::HV; ++h)
      for (int j = 0; j < SmallDecode::V; ++j)
        for (int i = 0; i < SmallDecode::K; ++i) {
          const double u = beta(row) * d.v[(size_t(row) * SmallDecode::HV + h) * SmallDecode::V + j];
          const size_t at = size_t(slot) * SmallDecode::kSlot + (size_t(h) * SmallDecode::V + j) * SmallDecode::K + i;
          ASSERT_NEAR(d.pool[at], k_sign(row) * inv_sqrt_k * u, 1e-6)
              << "slot " << slot << " h " << h << " j " << j << " i " << i;
        }
  // Slots no row names stay bit-identical (NaN).
  for (int s : {0, 2, 3, 5})
    EXPECT_EQ(std::memcmp(d.pool.data() + s * SmallDecode::kSlot, before.data() + s * SmallDecode::kSlot,
                          SmallDecode::kSlot * sizeof(float)),
              0)
        << "slot " << s;
}

TEST(Api, CudaBackendWithoutDeviceReportsNoDevice) {
  if (cuda_available()) GTEST_SKIP() << "a usable GPU is present; this checks the no-GPU path";
  SmallDecode d;
  const SmallDecode before;
  try {
    decode(d.params(), Context{Backend::kCUDA, nullptr});
    ADD_FAILURE() << "decode on the CUDA backend without a device did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kNoDevice) << e.what();
    EXPECT_NE(std::string(e.what()).find("backend cuda"), std::string::npos) << e.what();
  }
  // nothing written: o, the pool and the error flag as they were (bit for bit: NaN included)
  EXPECT_EQ(std::memcmp(d.o.data(), before.o.data(), d.o.size() * sizeof(float)), 0) << "o written";
  EXPECT_EQ(std::memcmp(d.pool.data(), before.pool.data(), d.pool.size() * sizeof(float)), 0) << "pool written";
  EXPECT_EQ(d.error_flag, before.error_flag);
}

}  // namespace
}  // namespace gdnkit
