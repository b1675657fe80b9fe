#include "support/naive.h"

#include <cmath>
#include <vector>

#include "gdnkit/host_dtype.h"

namespace gdnkit::test {

NaiveModel::NaiveModel(const Problem& p) : H_(p.config().H), HV_(p.config().HV), K_(p.config().K), V_(p.config().V) {
  const ProblemConfig& c = p.config();
  q_ = p.read_tokens("q");
  k_ = p.read_tokens("k");
  v_ = p.read_tokens("v");
  const int64_t T = p.total_tokens();
  const double scale = c.scale > 0 ? double(c.scale) : 1.0 / std::sqrt(double(K_));
  for (int64_t i = 0; i < T * H_; ++i) {
    naive_normalize(&q_[i * K_], K_, c.use_qk_l2norm, scale);
    naive_normalize(&k_[i * K_], K_, c.use_qk_l2norm, 1.0);
  }
  if (c.gate_mode == GateMode::kGiven) {
    g_ = p.read_tokens("g");
    beta_ = p.read_tokens("beta");
  } else {
    const auto a = p.read_tokens("a"), b = p.read_tokens("b");
    g_.resize(a.size());
    beta_.resize(b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      const int h = int(i % HV_);
      g_[i] = fused_g(p.as<float>("A_log")[h], a[i], p.as<float>("dt_bias")[h]);
      beta_[i] = fused_beta(b[i]);
    }
  }
}

void naive_normalize(double* x, int n, bool l2norm, double scale) {
  double ss = 0;
  for (int d = 0; d < n; ++d) ss += x[d] * x[d];
  const double f = l2norm ? scale / std::sqrt(ss + 1e-6) : scale;
  for (int d = 0; d < n; ++d) x[d] *= f;
}

void naive_step(double* S, int K, int V, const double* q, const double* k, const double* v, double g, double beta,
                double* o) {
  std::vector<double> kS(size_t(V), 0.0);
  for (int i = 0; i < K; ++i)
    for (int j = 0; j < V; ++j) kS[j] += k[i] * S[i * V + j];
  const double decay = std::exp(g);
  for (int i = 0; i < K; ++i)
    for (int j = 0; j < V; ++j) S[i * V + j] = decay * (S[i * V + j] - beta * k[i] * kS[j]) + beta * k[i] * v[j];
  if (!o) return;
  for (int j = 0; j < V; ++j) {
    double acc = 0;
    for (int i = 0; i < K; ++i) acc += q[i] * S[i * V + j];
    o[j] = acc;
  }
}

std::vector<double> NaiveModel::run(std::vector<double> S, const std::vector<int64_t>& tokens,
                                    std::vector<double>* o) const {
  if (o) o->assign(tokens.size() * HV_ * V_, 0.0);
  for (size_t n = 0; n < tokens.size(); ++n) {
    const int64_t t = tokens[n];
    for (int h = 0; h < HV_; ++h)
      naive_step(S.data() + int64_t(h) * K_ * V_, K_, V_, q(t, h), k(t, h), v(t, h), g(t, h), beta(t, h),
                 o ? o->data() + (n * HV_ + h) * V_ : nullptr);
  }
  return S;
}

std::vector<double> round_to(const std::vector<double>& x, DType dtype) {
  std::vector<double> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const float f = float(x[i]);
    switch (dtype) {
      case DType::kBFloat16:
        out[i] = host::bf16_to_float(host::float_to_bf16(f));
        break;
      case DType::kFloat16:
        out[i] = host::fp16_to_float(host::float_to_fp16(f));
        break;
      default:
        out[i] = f;
    }
  }
  return out;
}

}  // namespace gdnkit::test
