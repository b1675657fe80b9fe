// Long horizon (docs/semantics.md "Tolerances"): one sequence's prefill, then decode steps on the same pool slot,
// with the pool in fp32, bf16 and fp16. A 16-bit pool rounds the state at every store, and where the gates keep
// the state (gates near 0) the rounding accumulates; the test measures o over the decode steps and the final
// state against the fp32 pool's run (whose own rounding, ~1e-7, is far below) and prints the table.
// GDNKIT_LONG_HORIZON="T,D" sets the prefill and decode lengths (default 4096 and 512 on the CPU backend).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gdnkit/gdnkit.h"
#include "gdnkit/host_dtype.h"

namespace gdnkit::test {
namespace {

constexpr int K = 128, V = 128;

struct Inputs {
  int64_t tokens = 0;
  std::vector<float> q, k, v, g, beta;
};

// q, k, v ~ N(0, 1) (the op's L2 norm normalizes q and k), beta = sigmoid(N(0, 1)); gates near 0 (long memory),
// or with one token in ten decaying fast (mixed).
Inputs make_inputs(int64_t tokens, bool mixed, uint64_t seed) {
  Inputs in;
  in.tokens = tokens;
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ud(0.0f, 1.0f);
  in.q.resize(tokens * K), in.k.resize(tokens * K), in.v.resize(tokens * V), in.g.resize(tokens), in.beta.resize(tokens);
  for (auto& x : in.q) x = nd(gen);
  for (auto& x : in.k) x = nd(gen);
  for (auto& x : in.v) x = nd(gen);
  for (int64_t t = 0; t < tokens; ++t) {
    in.g[t] = mixed && ud(gen) < 0.1f ? -2.0f * ud(gen) : -1e-3f * ud(gen);
    in.beta[t] = 1.0f / (1.0f + std::exp(-nd(gen)));
  }
  return in;
}

struct PoolRun {
  std::vector<float> o;      // the decode steps' outputs
  std::vector<float> state;  // the final state
};

HeadConfig heads() {
  HeadConfig h;
  h.num_qk_heads = 1, h.num_v_heads = 1, h.head_dim_k = K, h.head_dim_v = V;
  return h;
}

Gating given(const Inputs& in, int64_t t0) {
  Gating gate;
  gate.mode = GateMode::kGiven;
  gate.g = {in.g.data() + t0, DType::kFloat32, 1, 1};
  gate.beta = {in.beta.data() + t0, DType::kFloat32, 1, 1};
  return gate;
}

PoolRun run_pool(const Inputs& in, int64_t prefill_tokens, DType pool_dtype) {
  const Context cpu{Backend::kCPU, nullptr};
  std::vector<uint16_t> pool16(size_t(K) * V);
  std::vector<float> pool32(size_t(K) * V);
  void* pool = pool_dtype == DType::kFloat32 ? static_cast<void*>(pool32.data()) : static_cast<void*>(pool16.data());
  const StatePool sp{pool, pool_dtype, StateLayout::kKLast, 1, int64_t(K) * V};
  const int32_t slot = 0, zero_slot = -1;

  std::vector<float> o_prefill(size_t(prefill_tokens) * V);
  PrefillParams p;
  p.heads = heads();
  p.num_seqs = 1;
  p.total_tokens = prefill_tokens;
  p.q = {in.q.data(), DType::kFloat32, K, K};
  p.k = {in.k.data(), DType::kFloat32, K, K};
  p.v = {in.v.data(), DType::kFloat32, V, V};
  p.o = {o_prefill.data(), DType::kFloat32, V, V};
  p.gating = given(in, 0);
  const int32_t cu[2] = {0, int32_t(prefill_tokens)};
  p.cu_seqlens = cu;
  p.state = sp;
  p.initial_indices = &zero_slot;
  p.final_indices = &slot;
  prefill(p, cpu);

  PoolRun r;
  r.o.resize(size_t(in.tokens - prefill_tokens) * V);
  for (int64_t t = prefill_tokens; t < in.tokens; ++t) {
    DecodeParams d;
    d.heads = heads();
    d.batch = 1;
    d.q = {in.q.data() + t * K, DType::kFloat32, K, K};
    d.k = {in.k.data() + t * K, DType::kFloat32, K, K};
    d.v = {in.v.data() + t * V, DType::kFloat32, V, V};
    d.o = {r.o.data() + (t - prefill_tokens) * V, DType::kFloat32, V, V};
    d.gating = given(in, t);
    d.state = sp;
    d.state_indices = &slot;
    decode(d, cpu);
  }
  r.state.resize(size_t(K) * V);
  for (int64_t i = 0; i < K * V; ++i) r.state[i] = float(host::load(pool, pool_dtype, i));
  return r;
}

double rel(const std::vector<float>& x, const std::vector<float>& ref) {
  double d2 = 0, r2 = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double d = double(x[i]) - ref[i];
    d2 += d * d, r2 += double(ref[i]) * ref[i];
  }
  return std::sqrt(d2 / r2);
}

TEST(LongHorizon, SixteenBitPoolsAgainstFp32) {
  int64_t T = 4096, D = 512;
  if (const char* env = std::getenv("GDNKIT_LONG_HORIZON")) {
    T = std::atoll(env);
    if (const char* comma = std::strchr(env, ',')) D = std::atoll(comma + 1);
  }
  for (bool mixed : {false, true}) {
    const Inputs in = make_inputs(T + D, mixed, mixed ? 12 : 11);
    const PoolRun ref = run_pool(in, T, DType::kFloat32);
    const PoolRun bf16 = run_pool(in, T, DType::kBFloat16), fp16 = run_pool(in, T, DType::kFloat16);
    const double o_bf = rel(bf16.o, ref.o), o_h = rel(fp16.o, ref.o);
    const double s_bf = rel(bf16.state, ref.state), s_h = rel(fp16.state, ref.state);
    std::printf("%s, prefill %lld + decode %lld: o rel. error bf16 %.3e, fp16 %.3e; final state bf16 %.3e, "
                "fp16 %.3e\n",
                mixed ? "mixed" : "long memory", (long long)T, (long long)D, o_bf, o_h, s_bf, s_h);
    // fp16 keeps 3 more significant bits than bf16: an eighth of its rounding, at least a quarter of its error
    EXPECT_LT(o_h, o_bf / 4) << (mixed ? "mixed" : "long memory");
    EXPECT_LT(s_h, s_bf / 4) << (mixed ? "mixed" : "long memory");
    EXPECT_GT(o_h, 0.0) << "an fp16 pool that does not round: the test would prove nothing";
  }
}

}  // namespace
}  // namespace gdnkit::test
