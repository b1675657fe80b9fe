#include "support/naive.h"

#include <cmath>

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
    double qq = 0, kk = 0;
    for (int d = 0; d < K_; ++d) {
      qq += q_[i * K_ + d] * q_[i * K_ + d];
      kk += k_[i * K_ + d] * k_[i * K_ + d];
    }
    const double qn = c.use_qk_l2norm ? std::sqrt(qq + 1e-6) : 1.0;
    const double kn = c.use_qk_l2norm ? std::sqrt(kk + 1e-6) : 1.0;
    for (int d = 0; d < K_; ++d) {
      q_[i * K_ + d] *= scale / qn;
      k_[i * K_ + d] /= kn;
    }
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

std::vector<double> NaiveModel::run(std::vector<double> S, const std::vector<int64_t>& tokens,
                                    std::vector<double>* o) const {
  if (o) o->assign(tokens.size() * HV_ * V_, 0.0);
  std::vector<double> kS(V_);
  for (size_t n = 0; n < tokens.size(); ++n) {
    const int64_t t = tokens[n];
    for (int h = 0; h < HV_; ++h) {
      double* Sh = S.data() + int64_t(h) * K_ * V_;
      const double *kt = k(t, h), *vt = v(t, h), *qt = q(t, h);
      const double decay = std::exp(g(t, h)), bt = beta(t, h);
      for (int j = 0; j < V_; ++j) {
        kS[j] = 0;
        for (int i = 0; i < K_; ++i) kS[j] += kt[i] * Sh[i * V_ + j];
      }
      for (int i = 0; i < K_; ++i)
        for (int j = 0; j < V_; ++j)
          Sh[i * V_ + j] = decay * (Sh[i * V_ + j] - bt * kt[i] * kS[j]) + bt * kt[i] * vt[j];
      if (!o) continue;
      for (int j = 0; j < V_; ++j) {
        double acc = 0;
        for (int i = 0; i < K_; ++i) acc += qt[i] * Sh[i * V_ + j];
        (*o)[(n * HV_ + h) * V_ + j] = acc;
      }
    }
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
