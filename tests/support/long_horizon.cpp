#include "support/long_horizon.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>

#include "gdnkit/host_dtype.h"
#include "support/compare.h"
#include "support/naive.h"
#include "support/problem.h"

namespace gdnkit::test {
namespace {

constexpr int K = 128, V = 128;

HeadConfig one_head() {
  HeadConfig h;
  h.num_qk_heads = 1, h.num_v_heads = 1, h.head_dim_k = K, h.head_dim_v = V;
  h.use_qk_l2norm = true, h.scale = 0.0f;  // the fp64 model's: the norm on, q scaled by 1 / sqrt(K)
  return h;
}

// A copy of `n` floats in memory the backend addresses.
float* place(const LongHorizonMemory& mem, std::vector<void*>& owned, const float* src, size_t n) {
  auto* p = static_cast<float*>(mem.alloc(n * sizeof(float)));
  owned.push_back(p);
  if (src != nullptr) std::memcpy(p, src, n * sizeof(float));
  return p;
}

}  // namespace

LongHorizonInputs long_horizon_inputs(int64_t tokens, bool mixed, uint64_t seed) {
  LongHorizonInputs in;
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

LongHorizonRun long_horizon_run(const LongHorizonInputs& in, int64_t prefill_tokens, DType pool_dtype,
                                const Context& ctx, const LongHorizonMemory& mem, bool fp8_once) {
  std::vector<void*> owned;
  const size_t T = size_t(in.tokens);
  const float* q = place(mem, owned, in.q.data(), T * K);
  const float* k = place(mem, owned, in.k.data(), T * K);
  const float* v = place(mem, owned, in.v.data(), T * V);
  const float* g = place(mem, owned, in.g.data(), T);
  const float* beta = place(mem, owned, in.beta.data(), T);
  float* o = place(mem, owned, nullptr, T * V);
  // o and the pool NaN: a row or state no call writes shows as NaN
  std::fill_n(o, T * V, std::numeric_limits<float>::quiet_NaN());
  void* pool = mem.alloc(size_t(K) * V * size_t(dtype_size(pool_dtype)));
  owned.push_back(pool);
  fill_nan(pool, pool_dtype, int64_t(K) * V);
  auto* scales = static_cast<uint8_t*>(mem.alloc(size_t(K) * V / kFp8Block));  // float8_e4m3 pools
  owned.push_back(scales);
  std::fill_n(scales, size_t(K) * V / kFp8Block, uint8_t(0xff));  // the NaN scale
  auto* ints = static_cast<int32_t*>(mem.alloc(4 * sizeof(int32_t)));
  owned.push_back(ints);
  const int32_t ints_before[4] = {0, int32_t(prefill_tokens), 0 /* slot */, -1 /* from S = 0 */};
  std::copy_n(ints_before, 4, ints);
  const StatePool sp{pool, pool_dtype, StateLayout::kKLast, 1, int64_t(K) * V, scales};
  const auto gates = [&](int64_t t0) {
    Gating gate;
    gate.mode = GateMode::kGiven;
    gate.g = {g + t0, DType::kFloat32, 1, 1};
    gate.beta = {beta + t0, DType::kFloat32, 1, 1};
    return gate;
  };

  PrefillParams p;
  p.heads = one_head();
  p.num_seqs = 1;
  p.total_tokens = prefill_tokens;
  p.q = {q, DType::kFloat32, K, K};
  p.k = {k, DType::kFloat32, K, K};
  p.v = {v, DType::kFloat32, V, V};
  p.o = {o, DType::kFloat32, V, V};
  p.gating = gates(0);
  p.cu_seqlens = ints;
  p.state = sp;
  p.initial_indices = ints + 3;
  p.final_indices = ints + 2;
  prefill(p, ctx);
  if (fp8_once) {  // the prefill's state through float8_e4m3 once, as a checkpoint stored and restored
    mem.sync();
    auto* s = static_cast<float*>(pool);
    uint8_t q[kFp8Block];
    for (int64_t b = 0; b < int64_t(K) * V; b += kFp8Block) {
      const float scale = host::e8m0_to_float(host::quantize_e4m3_block(s + b, kFp8Block, q));
      for (int i = 0; i < kFp8Block; ++i) s[b + i] = host::e4m3_to_float(q[i]) * scale;
    }
  }
  for (int64_t t = prefill_tokens; t < in.tokens; ++t) {
    DecodeParams d;
    d.heads = one_head();
    d.batch = 1;
    d.q = {q + t * K, DType::kFloat32, K, K};
    d.k = {k + t * K, DType::kFloat32, K, K};
    d.v = {v + t * V, DType::kFloat32, V, V};
    d.o = {o + t * V, DType::kFloat32, V, V};
    d.gating = gates(t);
    d.state = sp;
    d.state_indices = ints + 2;
    decode(d, ctx);
  }
  mem.sync();

  LongHorizonRun r;
  r.inputs_unchanged = std::memcmp(q, in.q.data(), T * K * sizeof(float)) == 0 &&
                       std::memcmp(k, in.k.data(), T * K * sizeof(float)) == 0 &&
                       std::memcmp(v, in.v.data(), T * V * sizeof(float)) == 0 &&
                       std::memcmp(g, in.g.data(), T * sizeof(float)) == 0 &&
                       std::memcmp(beta, in.beta.data(), T * sizeof(float)) == 0 &&
                       std::memcmp(ints, ints_before, sizeof(ints_before)) == 0;
  r.prefill_o.assign(o, o + prefill_tokens * V);
  r.o.assign(o + prefill_tokens * V, o + T * V);
  r.state.resize(size_t(K) * V);
  for (int64_t i = 0; i < K * V; ++i)
    r.state[i] = pool_dtype == DType::kFloat8E4M3
                     ? host::e4m3_to_float(static_cast<const uint8_t*>(pool)[i]) * host::e8m0_to_float(scales[i / kFp8Block])
                     : float(host::load(pool, pool_dtype, i));
  for (void* x : owned) mem.release(x);
  return r;
}

LongHorizonExact long_horizon_fp64(const LongHorizonInputs& in) {
  LongHorizonExact out;
  out.o.resize(size_t(in.tokens) * V);
  std::vector<double> S(size_t(K) * V, 0.0), q(K), k(K), v(V);  // S[k][v]
  for (int64_t t = 0; t < in.tokens; ++t) {
    std::copy_n(&in.q[size_t(t) * K], K, q.begin());
    std::copy_n(&in.k[size_t(t) * K], K, k.begin());
    std::copy_n(&in.v[size_t(t) * V], V, v.begin());
    naive_normalize(q.data(), K, true, 1.0 / std::sqrt(double(K)));
    naive_normalize(k.data(), K, true, 1.0);
    naive_step(S.data(), K, V, q.data(), k.data(), v.data(), in.g[size_t(t)], in.beta[size_t(t)],
               &out.o[size_t(t) * V]);
  }
  out.state.resize(S.size());
  for (int i = 0; i < K; ++i)
    for (int j = 0; j < V; ++j) out.state[size_t(j) * K + i] = S[size_t(i) * V + j];
  return out;
}

double long_horizon_rel(const std::vector<float>& x, const std::vector<float>& ref) {
  double d2 = 0, r2 = 0;
  for (size_t i = 0; i < x.size() && i < ref.size(); ++i) {
    const double d = double(x[i]) - ref[i];
    d2 += d * d, r2 += double(ref[i]) * ref[i];
  }
  return std::sqrt(d2 / r2);
}

void long_horizon_lengths(int64_t& prefill_tokens, int64_t& decode_steps) {
  if (const char* env = std::getenv("GDNKIT_LONG_HORIZON")) {
    prefill_tokens = std::atoll(env);
    if (const char* comma = std::strchr(env, ',')) decode_steps = std::atoll(comma + 1);
  }
}

namespace {

struct LongHorizonError {
  double o, state;  // relative to the fp32 pool's run
};
using ErrorOf = std::function<LongHorizonError(DType pool_dtype, bool fp8_once)>;

std::vector<double> widened(const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); }

// Every run: its prefill's o within the prefill's output tolerance of the fp64 recurrence, its inputs unchanged.
void expect_prefill_exact(const LongHorizonRun& r, const LongHorizonExact& exact, const std::string& what) {
  EXPECT_TRUE(r.inputs_unchanged) << what << ": an input changed";
  const std::vector<double> want(exact.o.begin(), exact.o.begin() + ptrdiff_t(r.prefill_o.size()));
  EXPECT_TRUE(RelClose(what + ", prefill o against fp64", widened(r.prefill_o), want,
                       output_tolerance(OpFamily::kPrefill, DType::kFloat32)));
}

// Both regimes: their inputs and the fp32 pool's run, then body(regime, errors of a pool dtype on those inputs).
void for_each_regime(const Context& ctx, const LongHorizonMemory& mem, int64_t prefill_tokens, int64_t decode_steps,
                     const std::function<void(const char*, const ErrorOf&)>& body) {
  for (bool mixed : {false, true}) {
    const char* regime = mixed ? "mixed" : "long memory";
    const LongHorizonInputs in = long_horizon_inputs(prefill_tokens + decode_steps, mixed, mixed ? 12 : 11);
    const LongHorizonExact exact = long_horizon_fp64(in);
    const LongHorizonRun ref = long_horizon_run(in, prefill_tokens, DType::kFloat32, ctx, mem);
    expect_prefill_exact(ref, exact, std::string(regime) + ", fp32 pool");
    // the decode steps continue from the prefill's state, so they are held to its tolerance
    const double tol = state_tolerance(OpFamily::kPrefill, DType::kFloat32);
    EXPECT_TRUE(RelClose(std::string(regime) + ", fp32 pool, decode o against fp64", widened(ref.o),
                         std::vector<double>(exact.o.begin() + prefill_tokens * V, exact.o.end()), tol));
    EXPECT_TRUE(RelClose(std::string(regime) + ", fp32 pool, final state against fp64", widened(ref.state),
                         exact.state, tol));
    body(regime, [&](DType dt, bool once) {
      const LongHorizonRun r = long_horizon_run(in, prefill_tokens, dt, ctx, mem, once);
      expect_prefill_exact(r, exact, std::string(regime) + ", " + dtype_name(dt) + " pool" + (once ? " (once)" : ""));
      return LongHorizonError{long_horizon_rel(r.o, ref.o), long_horizon_rel(r.state, ref.state)};
    });
  }
}

}  // namespace

void expect_long_horizon(const Context& ctx, const LongHorizonMemory& mem, int64_t prefill_tokens,
                         int64_t decode_steps, const char* backend) {
  for_each_regime(ctx, mem, prefill_tokens, decode_steps, [&](const char* regime, const ErrorOf& error) {
    const LongHorizonError bf = error(DType::kBFloat16, false), h = error(DType::kFloat16, false);
    std::printf("%s, %s, prefill %lld + decode %lld: o rel. error bf16 %.3e, fp16 %.3e; final state bf16 %.3e, "
                "fp16 %.3e\n",
                backend, regime, (long long)prefill_tokens, (long long)decode_steps, bf.o, h.o, bf.state, h.state);
    EXPECT_TRUE(std::isfinite(h.o) && std::isfinite(bf.o) && std::isfinite(h.state) && std::isfinite(bf.state))
        << regime;
    // bf16's own bound (docs/semantics.md: about 2e-2 over 32768 + 4096 tokens), then fp16's below it
    EXPECT_LT(bf.o, 6e-2) << regime;
    EXPECT_LT(bf.state, 6e-2) << regime;
    EXPECT_LT(h.o, bf.o / 4) << regime;
    EXPECT_LT(h.state, bf.state / 4) << regime;
    EXPECT_GT(h.o, 0.0) << regime << ": an fp16 pool that does not round: the test would prove nothing";
  });
}

void expect_long_horizon_fp8(const Context& ctx, const LongHorizonMemory& mem, int64_t prefill_tokens,
                             int64_t decode_steps, const char* backend) {
  for_each_regime(ctx, mem, prefill_tokens, decode_steps, [&](const char* regime, const ErrorOf& error) {
    const LongHorizonError bf = error(DType::kBFloat16, false), e8 = error(DType::kFloat8E4M3, false);
    const LongHorizonError once = error(DType::kFloat32, true);
    std::printf("%s, %s, prefill %lld + decode %lld: o rel. error float8_e4m3 %.3e (bf16 %.3e); final state "
                "float8_e4m3 %.3e (bf16 %.3e); float8_e4m3 once after the prefill, fp32 after: o %.3e, state %.3e\n",
                backend, regime, (long long)prefill_tokens, (long long)decode_steps, e8.o, bf.o, e8.state, bf.state,
                once.o, once.state);
    EXPECT_GT(once.o, 0.0) << regime;
    EXPECT_LT(once.o, e8.o / 4) << regime << ": one rounding should cost far less than one per step";
    // 3 significant bits against bf16's 8: about 32x the rounding; far from garbage (o ~ 1 when unrelated).
    EXPECT_GT(e8.o, 4 * bf.o) << regime << ": an e4m3 pool that rounds like bf16 or finer: not e4m3";
    EXPECT_GT(e8.state, 4 * bf.state) << regime;
    EXPECT_LT(e8.o, 0.5) << regime;
    EXPECT_LT(e8.state, 0.5) << regime;
  });
}

}  // namespace gdnkit::test
