// Quick timing of the CUDA prefill on the issue's target sets (qwen3-next: H=16, HV=32, K=V=128,
// fused gating + q/k L2 norm, initial and final states in a pooled fp32 K-last pool), for each value
// tile of the state pass, and for the chunk-prep kernel and the library's state pass alone. CUDA events
// around each call, warm-up first, median of 15. For iterating on the kernel; the committed numbers come
// from `gdnkit bench prefill`. Runs only with GDNKIT_PREFILL_TIMING=1 (skipped otherwise: it needs ~3 GB
// and seconds); GDNKIT_PREFILL_TIMING_SET=<name> times one set (for ncu); GDNKIT_PREFILL_TIMING_GATES=model
// draws A as `gdnkit bench` does (log U(1, 16): strong decay) instead of about 2.7.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda/prefill/plan.h"
#include "gdnkit/gdnkit.h"
#include "gpu/gpu_harness.h"

namespace gdnkit::test {
namespace {

__device__ __forceinline__ float hash_normalish(uint64_t i, uint32_t seed) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull + seed * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 31;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 29;
  // sum of 4 uniforms, centered: roughly N(0, 1/3) * ... scaled to unit variance
  float s = 0.0f;
  for (int j = 0; j < 4; ++j) s += float((x >> (16 * j)) & 0xffff) / 65535.0f;
  return (s - 2.0f) * 1.7320508f;
}

__global__ void fill_bf16(__nv_bfloat16* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16_rn(hash_normalish(uint64_t(i), seed));
}
__global__ void fill_f32(float* p, int64_t n, uint32_t seed, float mul, float add) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = hash_normalish(uint64_t(i), seed) * mul + add;
}

struct Set {
  const char* name;
  int N;
  int L;
  double target_ms;
};

double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

TEST(PrefillTiming, TargetSets) {
  const char* env = std::getenv("GDNKIT_PREFILL_TIMING");
  if (env == nullptr || std::string(env) != "1") GTEST_SKIP() << "set GDNKIT_PREFILL_TIMING=1 to time";
  const int H = 16, HV = 32, K = 128, V = 128;
  const Set sets[] = {{"8x8192", 8, 8192, 1.0},
                      {"1x32768", 1, 32768, 1.2},
                      {"1024x8", 1024, 8, 0.20},
                      {"1x8192", 1, 8192, 0.40},
                      {"8x1024", 8, 1024, 0.20},
                      {"1x2048", 1, 2048, 0.0}};
  cudaStream_t stream;
  GDNKIT_TEST_CUDA(cudaStreamCreate(&stream));
  cudaEvent_t e0, e1;
  GDNKIT_TEST_CUDA(cudaEventCreate(&e0));
  GDNKIT_TEST_CUDA(cudaEventCreate(&e1));
  std::printf("\n%-9s %-7s %10s %10s %10s %10s  (ms, median of 15; target)\n", "set", "vtile", "total", "prep", "pass",
              "TFLOP/s");
  const char* only = std::getenv("GDNKIT_PREFILL_TIMING_SET");  // e.g. "1x8192": time one set
  for (const Set& s : sets) {
    if (only != nullptr && std::string(only) != s.name) continue;
    const int64_t T = int64_t(s.N) * s.L, P = 2 * int64_t(s.N) + 1;
    __nv_bfloat16 *q, *k, *v, *o, *a, *b;
    float *A_log, *dt_bias, *pool;
    int32_t *cu, *ini, *fin, *err;
    GDNKIT_TEST_CUDA(cudaMalloc(&q, T * H * K * 2));
    GDNKIT_TEST_CUDA(cudaMalloc(&k, T * H * K * 2));
    GDNKIT_TEST_CUDA(cudaMalloc(&v, T * HV * V * 2));
    GDNKIT_TEST_CUDA(cudaMalloc(&o, T * HV * V * 2));
    GDNKIT_TEST_CUDA(cudaMalloc(&a, T * HV * 2));
    GDNKIT_TEST_CUDA(cudaMalloc(&b, T * HV * 2));
    GDNKIT_TEST_CUDA(cudaMalloc(&A_log, HV * 4));
    GDNKIT_TEST_CUDA(cudaMalloc(&dt_bias, HV * 4));
    GDNKIT_TEST_CUDA(cudaMalloc(&pool, P * HV * K * V * 4));
    GDNKIT_TEST_CUDA(cudaMalloc(&cu, (s.N + 1) * 4));
    GDNKIT_TEST_CUDA(cudaMalloc(&ini, s.N * 4));
    GDNKIT_TEST_CUDA(cudaMalloc(&fin, s.N * 4));
    GDNKIT_TEST_CUDA(cudaMalloc(&err, 4));
    fill_bf16<<<1024, 256>>>(q, T * H * K, 1);
    fill_bf16<<<1024, 256>>>(k, T * H * K, 2);
    fill_bf16<<<1024, 256>>>(v, T * HV * V, 3);
    fill_bf16<<<1024, 256>>>(a, T * HV, 4);
    fill_bf16<<<1024, 256>>>(b, T * HV, 5);
    fill_f32<<<1, 32>>>(A_log, HV, 6, 0.3f, 1.0f);  // A = e^A_log about 2.7
    if (const char* g = std::getenv("GDNKIT_PREFILL_TIMING_GATES"); g != nullptr && std::string(g) == "model") {
      // A spread over [1, 16] as Qwen3-Next initializes it (log U(1, 16); `gdnkit bench` draws it so): strong decay
      std::vector<float> alog(HV);
      for (int h = 0; h < HV; ++h) alog[h] = std::log(1.0f + 15.0f * (float(h) + 0.5f) / float(HV));
      GDNKIT_TEST_CUDA(cudaMemcpy(A_log, alog.data(), HV * 4, cudaMemcpyHostToDevice));
    }
    fill_f32<<<1, 32>>>(dt_bias, HV, 7, 0.5f, 0.0f);
    fill_f32<<<1024, 256>>>(pool, P * HV * K * V, 8, 0.5f, 0.0f);
    std::vector<int32_t> hcu(s.N + 1), hini(s.N), hfin(s.N);
    std::vector<int64_t> hcu64(s.N + 1);
    for (int i = 0; i <= s.N; ++i) hcu[i] = int32_t(int64_t(i) * s.L), hcu64[i] = int64_t(i) * s.L;
    for (int i = 0; i < s.N; ++i) hini[i] = 2 * i, hfin[i] = 2 * i + 1;  // distinct slots, spread over the pool
    GDNKIT_TEST_CUDA(cudaMemcpy(cu, hcu.data(), hcu.size() * 4, cudaMemcpyHostToDevice));
    GDNKIT_TEST_CUDA(cudaMemcpy(ini, hini.data(), hini.size() * 4, cudaMemcpyHostToDevice));
    GDNKIT_TEST_CUDA(cudaMemcpy(fin, hfin.data(), hfin.size() * 4, cudaMemcpyHostToDevice));
    GDNKIT_TEST_CUDA(cudaMemset(err, 0, 4));

    PrefillParams p;
    p.heads = {H, HV, K, V, 0.0f, true};
    p.num_seqs = s.N;
    p.total_tokens = T;
    p.q = {q, DType::kBFloat16, H * K, K};
    p.k = {k, DType::kBFloat16, H * K, K};
    p.v = {v, DType::kBFloat16, HV * V, V};
    p.o = {o, DType::kBFloat16, HV * V, V};
    p.gating.mode = GateMode::kFused;
    p.gating.a = {a, DType::kBFloat16, HV, 1};
    p.gating.b = {b, DType::kBFloat16, HV, 1};
    p.gating.A_log = A_log;
    p.gating.dt_bias = dt_bias;
    p.cu_seqlens = cu;
    p.cu_seqlens_host = hcu64.data();
    p.state = {pool, DType::kFloat32, StateLayout::kKLast, P, int64_t(HV) * K * V};
    p.initial_indices = ini;
    p.final_indices = fin;
    p.error_flag = err;
    validate(p, Backend::kCUDA);

    auto time_it = [&](auto&& fn) {
      for (int i = 0; i < 3; ++i) fn();
      std::vector<float> ms;
      for (int i = 0; i < 15; ++i) {
        cudaEventRecord(e0, stream);
        fn();
        cudaEventRecord(e1, stream);
        cudaEventSynchronize(e1);
        float t = 0;
        cudaEventElapsedTime(&t, e0, e1);
        ms.push_back(t);
      }
      return median(ms);
    };
    // The chunk prep alone, as the library's choice of state pass runs it (without M where that pass forms it).
    namespace cp = cuda::chunked_prefill;
    const double prep = time_it([&] { cp::prefill_with_vtile(p, stream, 0, cp::kStagePrep); });
    // ... and the state pass alone, on the workspace the prep runs above left (no programmatic launch then)
    const double pass = time_it([&] { cp::prefill_with_vtile(p, stream, 0, cp::kStageStatePass); });
    const double flop = 4.0 * double(T) * HV * K * V;
    // auto (the library's choices, the short-sequence path included), then the chunked kernels alone: their
    // heuristic, the head pass (wgmma and mma.sync builds) with each column split, the tiled pass with each
    // value tile
    constexpr int kWg = cuda::chunked_prefill::kVTileHead, kWarp = cuda::chunked_prefill::kVTileHeadWarp;
    struct Config {
      int vt, split, short_len;
    };
    const Config configs[] = {{0, 0, -1},    {0, 0, 0},  {kWg, 1, 0},  {kWg, 2, 0}, {kWarp, 1, 0},
                              {kWarp, 2, 0}, {16, 0, 0}, {32, 0, 0},   {64, 0, 0}};
    for (auto [vt, split, short_len] : configs) {
      if (cuda::chunked_prefill::is_head_tile(vt) && !cuda::chunked_prefill::head_split_supported(V, split)) continue;
      const double t = time_it([&, vt = vt, split = split, short_len = short_len] {
        cuda::chunked_prefill::prefill_with_vtile(p, stream, vt, cuda::chunked_prefill::kStagesAll, split, short_len);
      });
      const std::string name = vt == 0     ? (short_len < 0 ? "auto" : "chunked")
                               : vt == kWg ? "head/" + std::to_string(split)
                               : vt == kWarp ? "warp/" + std::to_string(split)
                                        : std::to_string(vt);
      std::printf("%-9s %-7s %10.3f %10.3f %10.3f %10.1f  %s\n", s.name, name.c_str(), t, prep, pass,
                  flop / (t * 1e-3) / 1e12,
                  s.target_ms > 0 ? ("target " + std::to_string(s.target_ms)).c_str() : "");
    }
    GDNKIT_TEST_CUDA(cudaStreamSynchronize(stream));
    int32_t herr = -1;
    GDNKIT_TEST_CUDA(cudaMemcpy(&herr, err, 4, cudaMemcpyDeviceToHost));
    EXPECT_EQ(herr, 0);
    for (void* ptr : {(void*)q, (void*)k, (void*)v, (void*)o, (void*)a, (void*)b, (void*)A_log, (void*)dt_bias,
                      (void*)pool, (void*)cu, (void*)ini, (void*)fin, (void*)err})
      cudaFree(ptr);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace gdnkit::test
