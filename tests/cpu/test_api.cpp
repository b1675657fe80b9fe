// The public API itself: names, errors, build information, backend selection, and one decode step through
// the public entry with a closed-form answer (padding rows, skipped slots, untouched slots).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
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

  const double beta = 1.0 / (1.0 + std::exp(-1.0));
  const double inv_sqrt_k = 1.0 / std::sqrt(double(SmallDecode::K));
  for (int row = 0; row < SmallDecode::B; ++row)
    for (int h = 0; h < SmallDecode::HV; ++h)
      for (int j = 0; j < SmallDecode::V; ++j) {
        const size_t i = (size_t(row) * SmallDecode::HV + h) * SmallDecode::V + j;
        // Rows 1 (padding) and 3 (slot >= P, skipped) give o = 0. k.q = -1 here (k < 0 < q).
        const double want = (row == 1 || row == 3) ? 0.0 : -beta * d.v[i] * inv_sqrt_k;
        ASSERT_NEAR(d.o[i], want, 1e-5) << "row " << row << " head " << h << " j " << j;
      }
  EXPECT_EQ(d.error_flag[0], 1) << "one slot >= P must be counted";
  // Slot 4 (row 0, K-last [V, K]): S^T[j][i] = k_i * u_j with k = -1/sqrt(K) after the norm.
  for (int h = 0; h < SmallDecode::HV; ++h)
    for (int j = 0; j < SmallDecode::V; ++j)
      for (int i = 0; i < SmallDecode::K; i += 13) {
        const double u = beta * d.v[(size_t(0) * SmallDecode::HV + h) * SmallDecode::V + j];
        const size_t at = 4 * SmallDecode::kSlot + (size_t(h) * SmallDecode::V + j) * SmallDecode::K + i;
        ASSERT_NEAR(d.pool[at], -inv_sqrt_k * u, 1e-6) << "h " << h << " j " << j << " i " << i;
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
  try {
    decode(d.params(), Context{Backend::kCUDA, nullptr});
    ADD_FAILURE() << "decode on the CUDA backend without a device did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kNoDevice) << e.what();
    EXPECT_NE(std::string(e.what()).find("backend cuda"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(std::isnan(d.o[0])) << "nothing may be written";
}

}  // namespace
}  // namespace gdnkit
