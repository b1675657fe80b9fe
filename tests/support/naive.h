// An independent fp64 model of the recurrence, computed from a Problem's logical reads (not from the
// params): the CPU tests check gdnkit::cpu against it, and it documents the spec in a few lines.
// Per token: S' = exp(g) (S - beta k (k^T S)) + beta k v^T,  o = S'^T q  (the spec's step, rearranged).
#pragma once

#include <cstdint>
#include <vector>

#include "support/problem.h"

namespace gdnkit::test {

class NaiveModel {
 public:
  explicit NaiveModel(const Problem& p);

  // Runs the given tokens (global token indices, in order) on all value heads from S [HV][K][V].
  // Returns the state after the last token; o (if not null) gets [tokens.size()][HV][V].
  std::vector<double> run(std::vector<double> S, const std::vector<int64_t>& tokens, std::vector<double>* o) const;

  double g(int64_t t, int h) const { return g_[t * HV_ + h]; }
  double beta(int64_t t, int h) const { return beta_[t * HV_ + h]; }
  // Normalized k (and normalized, scaled q) of token t for value head h.
  const double* k(int64_t t, int h) const { return &k_[(t * H_ + h / (HV_ / H_)) * K_]; }
  const double* q(int64_t t, int h) const { return &q_[(t * H_ + h / (HV_ / H_)) * K_]; }
  const double* v(int64_t t, int h) const { return &v_[(t * HV_ + h) * V_]; }

 private:
  int H_, HV_, K_, V_;
  std::vector<double> q_, k_, v_, g_, beta_;
};

// The ops' q/k norm on n values: x <- x scale / sqrt(|x|^2 + 1e-6) with l2norm, else x scale (docs/semantics.md).
void naive_normalize(double* x, int n, bool l2norm, double scale);
// One token of one head: S [K][V] <- exp(g) (S - beta k (k^T S)) + beta k v^T, then o [V] = S^T q (o may be null).
void naive_step(double* S, int K, int V, const double* q, const double* k, const double* v, double g, double beta,
                double* o);

// Rounds every element to the dtype (through float, as the library's stores do).
std::vector<double> round_to(const std::vector<double>& x, DType dtype);

}  // namespace gdnkit::test
