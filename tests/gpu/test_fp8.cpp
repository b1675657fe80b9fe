// Decode of float8_e4m3 pools on CUDA (K-last: recurrent/fp8_decode.cuh; V-last: vlast_decode.cuh) against the CPU
// backend on the same pool: o within the step ops' tolerance (both read the same dequantized state), the stored blocks
// equal to the CPU's up to the rare element whose fp32 arithmetic lands on the other side of a rounding boundary,
// untouched slots, scales and slot padding bit-identical, padding and out-of-range rows as the CPU backend leaves them;
// a block holding NaN or an infinity turns the columns it reaches to NaN codes under NaN scales on both backends.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/host/overrides.h"
#include "cuda/recurrent/heuristics.h"
#include "gdnkit/gdnkit.h"
#include "gdnkit/host_dtype.h"
#include "support/compare.h"

namespace gdnkit::test {
namespace {

#define FP8_CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

// Host bytes mirrored in device memory.
struct Mirror {
  std::vector<uint8_t> host;
  void* dev = nullptr;
  explicit Mirror(std::vector<uint8_t> bytes) : host(std::move(bytes)) {
    if (cudaMalloc(&dev, std::max<size_t>(host.size(), 16)) == cudaSuccess)
      cudaMemcpy(dev, host.data(), host.size(), cudaMemcpyHostToDevice);
  }
  ~Mirror() { cudaFree(dev); }
  Mirror(const Mirror&) = delete;
  std::vector<uint8_t> fetch() const {
    std::vector<uint8_t> out(host.size());
    cudaMemcpy(out.data(), dev, out.size(), cudaMemcpyDeviceToHost);
    return out;
  }
};

template <class T>
std::vector<uint8_t> bytes_of(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// Token values in the input dtype (bf16 or fp32) as bytes.
std::vector<uint8_t> token_bytes(std::mt19937_64& gen, size_t n, DType dt) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<uint8_t> b(n * size_t(dtype_size(dt)));
  for (size_t i = 0; i < n; ++i) host::store(b.data(), dt, int64_t(i), nd(gen));
  return b;
}

std::vector<double> read_floats(const std::vector<uint8_t>& b, DType dt) {
  std::vector<double> out(b.size() / size_t(dtype_size(dt)));
  for (size_t i = 0; i < out.size(); ++i) out[i] = host::load(b.data(), dt, int64_t(i));
  return out;
}

struct Fp8DecodeCase {
  int K;
  DType in;
  int cols;                // K-last: columns per warp (Overrides::decode_fp8_columns; 0: the heuristic); V-last:
                           // columns per CTA (Overrides::decode_vlast_fp8_columns)
  bool nonfinite = false;  // slot 3, head 1: a block of column 5 holds a NaN, one of column 9 an infinity
  bool tiny = false;       // some blocks of magnitude 2^-118 .. 2^-108 and v 64x larger: a factored update's
                           // (rk u / w) k would overflow for a finite state (kMinBlockFactor)
  bool zero = false;       // block 0 of some columns zero codes under the scale 2^73, and k zero over its 32 k: the
                           // block stays zero, whose store's factor w 2^127 overflows (zeros, not NaN codes, stored)
  StateLayout layout = StateLayout::kKLast;  // V-last: the same flat blocks are rows' (v-runs): "column" reads "row"
};

// V-last cases: K = V = 128, `cols` columns per CTA.
Fp8DecodeCase vlast_case(DType in, int cols, bool nonfinite = false, bool tiny = false, bool zero = false) {
  return {128, in, cols, nonfinite, tiny, zero, StateLayout::kVLast};
}

class Fp8DecodeGpu : public ::testing::TestWithParam<Fp8DecodeCase> {};

TEST_P(Fp8DecodeGpu, MatchesCpuBackend) {
  const int K = GetParam().K, V = K, H = 2, HV = 4, P = 6;
  const DType in = GetParam().in;
  const bool vlast = GetParam().layout == StateLayout::kVLast;
  cuda::Overrides ov;
  (vlast ? ov.decode_vlast_fp8_columns : ov.decode_fp8_columns) = GetParam().cols;
  const cuda::ScopedOverrides scoped(ov);
  const int64_t head = int64_t(K) * V, stride = HV * head + 128;  // slot padding no kernel may touch
  const std::vector<int32_t> slots{3, 0, -1, 7, 5};                 // a padding row, a slot past the pool
  const int B = int(slots.size());
  std::mt19937_64 gen(9000 + K + 7 * int(in));

  // The pool: blocks of varied magnitude through the host quantization; padding bytes 0x5a.
  std::vector<uint8_t> pool(size_t(P * stride), 0x5a), scales(size_t(P * HV * head / kFp8Block));
  {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::uniform_int_distribution<int> expo(-8, 2);
    float x[kFp8Block];
    for (int64_t s = 0; s < P; ++s)
      for (int64_t e = 0; e < HV * head; e += kFp8Block) {
        // Some blocks so small that their scale is the smallest, 2^-127 (scale byte 0, a subnormal fp32 scale).
        const int64_t blk = e / kFp8Block;
        const int ex = blk % 17 == 5 ? -132 : GetParam().tiny && blk % 3 == 1 ? -118 + int(blk % 11) : expo(gen);
        for (float& v : x) v = std::ldexp(nd(gen), ex);
        if (GetParam().nonfinite && s == 3 && e == head + 5 * K + kFp8Block) x[7] = NAN;
        if (GetParam().nonfinite && s == 3 && e == head + 9 * K) x[30] = INFINITY;
        scales[size_t((s * HV * head + e) / kFp8Block)] =
            host::quantize_e4m3_block(x, kFp8Block, &pool[size_t(s * stride + e)]);
        if (GetParam().zero && (e % head) % K == 0 && (e / K) % 3 == 0) {  // block 0 of every third column
          std::fill_n(&pool[size_t(s * stride + e)], kFp8Block, uint8_t(0));
          scales[size_t((s * HV * head + e) / kFp8Block)] = 200;
        }
      }
  }
  std::vector<float> a(static_cast<size_t>(B * HV)), bb(static_cast<size_t>(B * HV)), A_log(static_cast<size_t>(HV)),
      dt_bias(static_cast<size_t>(HV));
  {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::uniform_real_distribution<float> ud(1.0f, 16.0f);
    for (float& x : a) x = nd(gen);
    for (float& x : bb) x = nd(gen);
    for (float& x : A_log) x = std::log(ud(gen));
    for (float& x : dt_bias) x = 0.5f * nd(gen);
  }
  const std::vector<uint8_t> q = token_bytes(gen, size_t(B * H * K), in);
  std::vector<uint8_t> k = token_bytes(gen, size_t(B * H * K), in);
  if (GetParam().zero)
    for (int64_t r = 0; r < int64_t(B) * H; ++r)
      for (int j = 0; j < kFp8Block; ++j) host::store(k.data(), in, r * K + j, 0.0);
  std::vector<uint8_t> v = token_bytes(gen, size_t(B * HV * V), in);
  if (GetParam().tiny)
    for (int64_t i = 0; i < int64_t(B) * HV * V; ++i) host::store(v.data(), in, i, 64.0 * host::load(v.data(), in, i));
  std::vector<uint8_t> o_init(size_t(B * HV * V * dtype_size(in)));
  for (size_t i = 0; i < o_init.size() / size_t(dtype_size(in)); ++i) host::store(o_init.data(), in, int64_t(i), NAN);

  // The same params over host (CPU backend) or device (CUDA) buffers.
  const auto params = [&](void* pq, void* pk, void* pv, void* po, void* pa, void* pb, void* palog, void* pdt,
                          void* ppool, void* pscales, void* pslots, void* pflag) {
    DecodeParams d;
    d.heads.num_qk_heads = H, d.heads.num_v_heads = HV, d.heads.head_dim_k = K, d.heads.head_dim_v = V;
    d.batch = B;
    d.q = {pq, in, H * K, K};
    d.k = {pk, in, H * K, K};
    d.v = {pv, in, HV * V, V};
    d.o = {po, in, HV * V, V};
    d.gating.mode = GateMode::kFused;
    d.gating.a = {pa, DType::kFloat32, HV, 1};
    d.gating.b = {pb, DType::kFloat32, HV, 1};
    d.gating.A_log = static_cast<const float*>(palog);
    d.gating.dt_bias = static_cast<const float*>(pdt);
    d.state = {ppool, DType::kFloat8E4M3, GetParam().layout, P, stride, static_cast<uint8_t*>(pscales)};
    d.state_indices = static_cast<const int32_t*>(pslots);
    d.error_flag = static_cast<int32_t*>(pflag);
    return d;
  };

  // CPU backend on host copies.
  std::vector<uint8_t> cpool = pool, cscales = scales, co = o_init;
  std::vector<uint8_t> cq = q, ck = k, cv = v;
  std::vector<float> ca = a, cb = bb;
  int32_t cflag = 0;
  std::vector<int32_t> cslots = slots;
  decode(params(cq.data(), ck.data(), cv.data(), co.data(), ca.data(), cb.data(), A_log.data(), dt_bias.data(),
                cpool.data(), cscales.data(), cslots.data(), &cflag),
         {Backend::kCPU, nullptr});

  // CUDA.
  Mirror dq(q), dk(k), dv(v), dout(o_init), da(bytes_of(a)), db(bytes_of(bb)), dalog(bytes_of(A_log)),
      ddt(bytes_of(dt_bias)), dpool(pool), dscales(scales), dslots(bytes_of(slots)), dflag(std::vector<uint8_t>(4, 0));
  cuda::recurrent::last_recurrent_launch() = {};
  decode(params(dq.dev, dk.dev, dv.dev, dout.dev, da.dev, db.dev, dalog.dev, ddt.dev, dpool.dev, dscales.dev, dslots.dev,
                dflag.dev),
         {Backend::kCUDA, nullptr});
  FP8_CUDA_OK(cudaDeviceSynchronize());
  {  // the kernel and columns asked for took effect
    const cuda::recurrent::RecurrentLaunch& got = cuda::recurrent::last_recurrent_launch();
    EXPECT_EQ(std::string(got.kernel),
              vlast ? cuda::recurrent::kernel_name(cuda::recurrent::RecurrentKernel::kVLastDecode)
                    : cuda::recurrent::kFp8DecodeKernel);
    if (GetParam().cols != 0) EXPECT_EQ(got.columns, GetParam().cols);
  }
  const std::vector<uint8_t> gpool = dpool.fetch(), gscales = dscales.fetch(), go = dout.fetch(), gflag = dflag.fetch();

  int32_t flag = 0;
  std::memcpy(&flag, gflag.data(), 4);
  EXPECT_EQ(flag, cflag);
  EXPECT_EQ(flag, 1) << "the slot past the pool is counted once";
  // A non-finite block makes its whole column NaN (its sums, u, o and the new state: NaN scales, NaN codes), on both
  // backends; the comparisons below take the finite values. V-last: the two blocks (row 5's v 32..63, row 9's v 0..31)
  // reach the sums of their 32 columns each, so o of 64 columns and those columns of every row.
  const size_t nan_o = GetParam().nonfinite ? (vlast ? 2u * kFp8Block : 2u) : 0u;
  const int64_t nan_state = GetParam().nonfinite ? (vlast ? 2 * kFp8Block * K : 2 * K) : 0;
  const auto finite_pair = [](std::vector<double>& got, std::vector<double>& ref, const std::string& what) {
    size_t n = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      EXPECT_EQ(std::isnan(got[i]), std::isnan(ref[i])) << what << " element " << i;
      if (!std::isnan(ref[i])) got[n] = got[i], ref[n] = ref[i], ++n;
    }
    got.resize(n), ref.resize(n);
    return ref.size();
  };
  {
    std::vector<double> got = read_floats(go, in), ref = read_floats(co, in);
    const size_t all = ref.size();
    EXPECT_EQ(all - finite_pair(got, ref, "o"), nan_o);
    EXPECT_TRUE(RelClose("o", got, ref, output_tolerance(OpFamily::kStep, in)));
  }
  for (int r : {2, 3})  // padding row and out-of-range row: o = 0
    for (int64_t i = 0; i < int64_t(HV) * V; ++i)
      ASSERT_EQ(host::load(go.data(), in, r * int64_t(HV) * V + i), 0.0) << "row " << r;

  for (int64_t s = 0; s < P; ++s) {
    const bool written = s == 3 || s == 0 || s == 5;
    const size_t s0 = size_t(s * HV * head / kFp8Block), sn = size_t(HV * head / kFp8Block);
    if (!written) {
      EXPECT_EQ(std::memcmp(&gpool[size_t(s * stride)], &pool[size_t(s * stride)], size_t(stride)), 0) << "slot " << s;
      EXPECT_EQ(std::memcmp(&gscales[s0], &scales[s0], sn), 0) << "scales of slot " << s;
      continue;
    }
    EXPECT_EQ(std::memcmp(&gpool[size_t(s * stride + HV * head)], &pool[size_t(s * stride + HV * head)], 128), 0)
        << "padding after slot " << s;
    std::vector<double> got(size_t(HV * head)), ref(size_t(HV * head));
    int64_t differ = 0;
    for (int64_t e = 0; e < HV * head; ++e) {
      const size_t at = size_t(s * stride + e), sc = s0 + size_t(e / kFp8Block);
      got[size_t(e)] = double(host::e4m3_to_float(gpool[at])) * host::e8m0_to_float(gscales[sc]);
      ref[size_t(e)] = double(host::e4m3_to_float(cpool[at])) * host::e8m0_to_float(cscales[sc]);
      differ += got[size_t(e)] != ref[size_t(e)] && !std::isnan(ref[size_t(e)]);
    }
    if (GetParam().nonfinite && s == 3 && vlast) {  // v 0..63 of every row: NaN codes under NaN scales
      for (int row = 0; row < K; ++row) {
        const size_t e0 = size_t(head + row * V);
        for (size_t e = e0; e < e0 + 2 * kFp8Block; ++e) {
          ASSERT_EQ(gpool[size_t(s * stride) + e], cpool[size_t(s * stride) + e]) << "row " << row;
          ASSERT_EQ(gpool[size_t(s * stride) + e] & 0x7fu, 0x7fu) << "row " << row;
        }
        ASSERT_EQ(gscales[s0 + e0 / kFp8Block], 0xffu) << "row " << row;
        ASSERT_EQ(gscales[s0 + e0 / kFp8Block + 1], 0xffu) << "row " << row;
      }
    }
    if (GetParam().nonfinite && s == 3 && !vlast) {  // the two NaN columns: NaN codes under NaN scales
      for (int col : {5, 9}) {
        const size_t e0 = size_t(head + col * K);
        for (size_t e = e0; e < e0 + size_t(K); ++e) {
          ASSERT_EQ(gpool[size_t(s * stride) + e], cpool[size_t(s * stride) + e]) << "column " << col;
          ASSERT_EQ(gpool[size_t(s * stride) + e] & 0x7fu, 0x7fu) << "column " << col;
        }
        for (size_t b = e0 / kFp8Block; b < (e0 + size_t(K)) / kFp8Block; ++b)
          ASSERT_EQ(gscales[s0 + b], 0xffu) << "column " << col;
      }
    }
    EXPECT_EQ(HV * head - int64_t(finite_pair(got, ref, "state slot " + std::to_string(s))), s == 3 ? nan_state : 0);
    // One e4m3 step is 2^-3 relative: a few differing elements stay far below 1e-2 over the slot.
    EXPECT_TRUE(RelClose("state slot " + std::to_string(s), got, ref, 1e-2));
    EXPECT_LT(differ, HV * head / 50) << "slot " << s << ": " << differ << " elements differ from the CPU backend's";
    EXPECT_NE(std::memcmp(&gpool[size_t(s * stride)], &pool[size_t(s * stride)], size_t(HV * head)), 0)
        << "slot " << s << " was not written";
  }
}

INSTANTIATE_TEST_SUITE_P(Dims, Fp8DecodeGpu,
                         ::testing::Values(Fp8DecodeCase{64, DType::kBFloat16, 8}, Fp8DecodeCase{64, DType::kBFloat16, 16},
                                           Fp8DecodeCase{128, DType::kBFloat16, 8},
                                           Fp8DecodeCase{128, DType::kBFloat16, 16},
                                           Fp8DecodeCase{128, DType::kBFloat16, 32},
                                           Fp8DecodeCase{128, DType::kFloat32, 32},
                                           Fp8DecodeCase{256, DType::kBFloat16, 8},
                                           Fp8DecodeCase{256, DType::kFloat32, 16},
                                           Fp8DecodeCase{128, DType::kBFloat16, 16, true},
                                           Fp8DecodeCase{128, DType::kBFloat16, 32, true},
                                           Fp8DecodeCase{128, DType::kBFloat16, 32, false, true},
                                           Fp8DecodeCase{128, DType::kBFloat16, 16, false, true},
                                           Fp8DecodeCase{128, DType::kBFloat16, 32, false, false, true},
                                           Fp8DecodeCase{128, DType::kBFloat16, 16, false, false, true},
                                           Fp8DecodeCase{64, DType::kBFloat16, 8, false, false, true},
                                           vlast_case(DType::kBFloat16, 128), vlast_case(DType::kFloat32, 64),
                                           vlast_case(DType::kBFloat16, 128, true),
                                           vlast_case(DType::kBFloat16, 64, true),
                                           vlast_case(DType::kBFloat16, 128, false, true),
                                           vlast_case(DType::kBFloat16, 64, false, true),
                                           vlast_case(DType::kBFloat16, 128, false, false, true),
                                           vlast_case(DType::kBFloat16, 64, false, false, true)),
                         [](const auto& info) {
                           return std::string(info.param.layout == StateLayout::kVLast ? "VLast_" : "") + "K" +
                                  std::to_string(info.param.K) +
                                  (info.param.in == DType::kFloat32 ? "_f32" : "_bf16") + "_cols" +
                                  std::to_string(info.param.cols) + (info.param.nonfinite ? "_nonfinite" : "") +
                                  (info.param.tiny ? "_tiny" : "") + (info.param.zero ? "_zero" : "");
                         });

}  // namespace
}  // namespace gdnkit::test
