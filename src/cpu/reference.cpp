// CPU reference: state I/O by layout, token inputs (gating, L2 norm, scale, GVA), the one step of
// the recurrence every op uses.
#include "cpu/reference.h"

#include <cmath>
#include <vector>

#include "gdnkit/host_dtype.h"

namespace gdnkit::cpu::detail {

void load_state(const HeadState& at, int K, int V, double* S) {
  const bool fp8 = at.dtype == DType::kFloat8E4M3;
  const auto* q = static_cast<const uint8_t*>(at.base) + at.offset;
  for (int k = 0; k < K; ++k)
    for (int v = 0; v < V; ++v) {
      const int64_t e = state_elem(at.layout, K, V, k, v);
      S[int64_t(k) * V + v] = fp8 ? double(host::e4m3_to_float(q[e])) * host::e8m0_to_float(at.scales[e / kFp8Block])
                                  : host::load(at.base, at.dtype, at.offset + e);
    }
}

void store_state(const HeadState& at, int K, int V, const double* S) {
  if (at.dtype != DType::kFloat8E4M3) {
    for (int k = 0; k < K; ++k)
      for (int v = 0; v < V; ++v)
        host::store(at.base, at.dtype, at.offset + state_elem(at.layout, K, V, k, v), S[int64_t(k) * V + v]);
    return;
  }
  // The head's elements in storage order, rounded to float, then each block quantized with its own scale.
  std::vector<float> x(size_t(K) * V);
  for (int k = 0; k < K; ++k)
    for (int v = 0; v < V; ++v) x[size_t(state_elem(at.layout, K, V, k, v))] = float(S[int64_t(k) * V + v]);
  auto* q = static_cast<uint8_t*>(at.base) + at.offset;
  for (int64_t b = 0; b < int64_t(K) * V / kFp8Block; ++b)
    at.scales[b] = host::quantize_e4m3_block(x.data() + b * kFp8Block, kFp8Block, q + b * kFp8Block);
}

TokenReader::TokenReader(const HeadConfig& heads, const InView& q, const InView& k, const InView& v,
                         const Gating& gating)
    : heads_(heads), q_(q), k_(k), v_(v), gating_(gating), K_(heads.head_dim_k), V_(heads.head_dim_v) {
  group_ = heads.num_qk_heads > 0 ? heads.num_v_heads / heads.num_qk_heads : 1;
  if (group_ < 1) group_ = 1;
  scale_ = heads.scale > 0 ? double(heads.scale) : 1.0 / std::sqrt(double(K_));
}

namespace {

// x <- x / sqrt(sum(x^2) + 1e-6): the eps sits inside the root, as in the spec.
void l2_normalize(std::vector<double>& x) {
  double ss = 0;
  for (double e : x) ss += e * e;
  const double inv = 1.0 / std::sqrt(ss + 1e-6);
  for (double& e : x) e *= inv;
}

double softplus(double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }

}  // namespace

void TokenReader::read(int64_t token, int h, bool need_q, TokenInputs* out) const {
  const int hk = h / group_;  // grouped value attention: value head h reads q/k head h / (HV / H)
  out->k.resize(K_);
  out->v.resize(V_);
  const int64_t k_base = token * k_.token_stride + int64_t(hk) * k_.head_stride;
  for (int i = 0; i < K_; ++i) out->k[i] = host::load(k_.data, k_.dtype, k_base + i);
  const int64_t v_base = token * v_.token_stride + int64_t(h) * v_.head_stride;
  for (int i = 0; i < V_; ++i) out->v[i] = host::load(v_.data, v_.dtype, v_base + i);
  if (heads_.use_qk_l2norm) l2_normalize(out->k);
  if (need_q) {
    out->q.resize(K_);
    const int64_t q_base = token * q_.token_stride + int64_t(hk) * q_.head_stride;
    for (int i = 0; i < K_; ++i) out->q[i] = host::load(q_.data, q_.dtype, q_base + i);
    if (heads_.use_qk_l2norm) l2_normalize(out->q);
    for (double& e : out->q) e *= scale_;
  } else {
    out->q.clear();
  }
  if (gating_.mode == GateMode::kFused) {
    const InView& a = gating_.a;
    const InView& b = gating_.b;
    const double av = host::load(a.data, a.dtype, token * a.token_stride + int64_t(h) * a.head_stride);
    const double bv = host::load(b.data, b.dtype, token * b.token_stride + int64_t(h) * b.head_stride);
    out->g = -std::exp(double(gating_.A_log[h])) * softplus(av + double(gating_.dt_bias[h]));
    out->beta = 1.0 / (1.0 + std::exp(-bv));
  } else {
    const InView& g = gating_.g;
    const InView& beta = gating_.beta;
    out->g = host::load(g.data, g.dtype, token * g.token_stride + int64_t(h) * g.head_stride);
    out->beta = host::load(beta.data, beta.dtype, token * beta.token_stride + int64_t(h) * beta.head_stride);
  }
}

void step(double* S, int K, int V, const TokenInputs& in, double* o) {
  const double decay = std::exp(in.g);
  for (int64_t i = 0; i < int64_t(K) * V; ++i) S[i] *= decay;
  // u = beta (v - S^T k): the delta rule replaces what the state predicts for k by v.
  // (Loops run k outer, v inner: S is [K][V] row-major.)
  std::vector<double> u(V, 0.0);
  for (int k = 0; k < K; ++k) {
    const double* row = S + int64_t(k) * V;
    for (int v = 0; v < V; ++v) u[v] += row[v] * in.k[k];
  }
  for (int v = 0; v < V; ++v) u[v] = in.beta * (in.v[v] - u[v]);
  for (int k = 0; k < K; ++k) {
    double* row = S + int64_t(k) * V;
    for (int v = 0; v < V; ++v) row[v] += in.k[k] * u[v];
  }
  if (!o) return;
  // o = S^T q with the updated S.
  for (int v = 0; v < V; ++v) o[v] = 0;
  for (int k = 0; k < K; ++k) {
    const double* row = S + int64_t(k) * V;
    for (int v = 0; v < V; ++v) o[v] += row[v] * in.q[k];
  }
}

void store_output(const OutView& o, int64_t token, int h, int V, const double* vals) {
  const int64_t base = token * o.token_stride + int64_t(h) * o.head_stride;
  for (int i = 0; i < V; ++i) host::store(o.data, o.dtype, base + i, vals[i]);
}

void zero_output(const OutView& o, int64_t token, int HV, int V) {
  const std::vector<double> zeros(V, 0.0);
  for (int h = 0; h < HV; ++h) store_output(o, token, h, V, zeros.data());
}

}  // namespace gdnkit::cpu::detail
