// The stages of the chunked prefill (src/cpu/chunk.h) on their own: the triangular solve, the WY
// values, and one whole chunk against L steps of the recurrence, including very strong decays.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "support/compare.h"
#include "cpu/chunk.h"
#include "cpu/reference.h"

namespace gdnkit::test {
namespace {

using Mat = std::vector<double>;

struct ChunkInputs {
  int L, K, V;
  Mat Q, Kc, Vc, g, beta, S;
};

// Random chunk: q, k unit vectors (q scaled by 1/sqrt(K)), v ~ N(0,1), g = -decay * U(0,1), beta in (0,1).
ChunkInputs random_chunk(int L, int K, int V, double decay, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> n01;
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  ChunkInputs c{L, K, V, Mat(L * K), Mat(L * K), Mat(L * V), Mat(L), Mat(L), Mat(K * V)};
  auto unit = [&](double* x, double scale) {
    double ss = 0;
    for (int d = 0; d < K; ++d) {
      x[d] = n01(gen);
      ss += x[d] * x[d];
    }
    for (int d = 0; d < K; ++d) x[d] *= scale / std::sqrt(ss);
  };
  for (int i = 0; i < L; ++i) {
    unit(&c.Q[i * K], 1.0 / std::sqrt(double(K)));
    unit(&c.Kc[i * K], 1.0);
    for (int d = 0; d < V; ++d) c.Vc[i * V + d] = n01(gen);
    c.g[i] = -decay * u01(gen);
    c.beta[i] = u01(gen);
  }
  for (double& s : c.S) s = 0.5 * n01(gen);
  return c;
}

TEST(RefChunkStages, InvertUnitLowerIsTheInverse) {
  for (int L : {1, 2, 17, 64}) {
    std::mt19937_64 gen(L);
    std::normal_distribution<double> n(0.0, 0.3);
    Mat A(L * L, 0.0), T(L * L);
    for (int i = 0; i < L; ++i)
      for (int j = 0; j < i; ++j) A[i * L + j] = n(gen) / std::sqrt(double(L));
    cpu::chunk::invert_unit_lower(A.data(), L, T.data());
    Mat left(L * L, 0.0), right(L * L, 0.0), eye(L * L, 0.0);
    for (int i = 0; i < L; ++i) {
      eye[i * L + i] = 1;
      for (int j = 0; j < L; ++j)
        for (int m = 0; m < L; ++m) {
          const double a = (i == m) + A[i * L + m], b = (m == j) + A[m * L + j];
          left[i * L + j] += T[i * L + m] * b;   // T (I + A)
          right[i * L + j] += a * T[m * L + j];  // (I + A) T
        }
      for (int j = i + 1; j < L; ++j) ASSERT_EQ(T[i * L + j], 0.0) << "T is lower triangular";
      ASSERT_EQ(T[i * L + i], 1.0);
    }
    EXPECT_TRUE(RelClose("T (I + A), L=" + std::to_string(L), left, eye, 1e-12));
    EXPECT_TRUE(RelClose("(I + A) T, L=" + std::to_string(L), right, eye, 1e-12));
  }
}

// The WY values solve (I + A) U = diag(beta) V - diag(beta exp(G)) Kc S.
TEST(RefChunkStages, WyValuesSolveTheDeltaSystem) {
  for (int L : {1, 33, 64}) {
    ChunkInputs c = random_chunk(L, 64, 32, 0.5, 100 + L);
    const int K = c.K, V = c.V;
    Mat G = c.g, A(L * L), T(L * L), W(L * K), U(L * V);
    cpu::chunk::gate_cumsum(G.data(), L);
    cpu::chunk::decayed_kkt(c.Kc.data(), G.data(), c.beta.data(), L, K, A.data());
    cpu::chunk::invert_unit_lower(A.data(), L, T.data());
    cpu::chunk::wy(T.data(), c.Kc.data(), c.Vc.data(), G.data(), c.beta.data(), L, K, V, W.data(), U.data());
    cpu::chunk::delta_values(W.data(), c.S.data(), L, K, V, U.data());
    Mat lhs(L * V, 0.0), rhs(L * V, 0.0);
    for (int i = 0; i < L; ++i)
      for (int v = 0; v < V; ++v) {
        lhs[i * V + v] = U[i * V + v];
        for (int j = 0; j < i; ++j) lhs[i * V + v] += A[i * L + j] * U[j * V + v];
        double kS = 0;
        for (int k = 0; k < K; ++k) kS += c.Kc[i * K + k] * c.S[k * V + v];
        rhs[i * V + v] = c.beta[i] * c.Vc[i * V + v] - c.beta[i] * std::exp(G[i]) * kS;
      }
    EXPECT_TRUE(RelClose("(I + A) U, L=" + std::to_string(L), lhs, rhs, 1e-12));
  }
}

// One chunk (all stages) == L steps of the shared recurrence step, outputs and the state after it.
TEST(RefChunkStages, ChunkEqualsRecurrenceSteps) {
  struct Case {
    int L, K, V;
    double decay;
  };
  for (const Case k : {Case{1, 64, 64, 1.0}, Case{37, 128, 64, 1.0}, Case{64, 128, 128, 0.01}, Case{64, 64, 256, 60.0},
                       Case{64, 256, 128, 3.0}}) {
    const ChunkInputs c = random_chunk(k.L, k.K, k.V, k.decay, 7 + k.L + k.K);
    const int L = c.L, K = c.K, V = c.V;
    // Recurrence.
    Mat S_rec = c.S, O_rec(L * V);
    cpu::detail::TokenInputs in;
    for (int i = 0; i < L; ++i) {
      in.q.assign(c.Q.begin() + i * K, c.Q.begin() + (i + 1) * K);
      in.k.assign(c.Kc.begin() + i * K, c.Kc.begin() + (i + 1) * K);
      in.v.assign(c.Vc.begin() + i * V, c.Vc.begin() + (i + 1) * V);
      in.g = c.g[i];
      in.beta = c.beta[i];
      cpu::detail::step(S_rec.data(), K, V, in, O_rec.data() + i * V);
    }
    // Chunk.
    Mat G = c.g, A(L * L), T(L * L), W(L * K), U(L * V), O(L * V), S = c.S;
    cpu::chunk::gate_cumsum(G.data(), L);
    cpu::chunk::decayed_kkt(c.Kc.data(), G.data(), c.beta.data(), L, K, A.data());
    cpu::chunk::invert_unit_lower(A.data(), L, T.data());
    cpu::chunk::wy(T.data(), c.Kc.data(), c.Vc.data(), G.data(), c.beta.data(), L, K, V, W.data(), U.data());
    cpu::chunk::delta_values(W.data(), S.data(), L, K, V, U.data());
    cpu::chunk::chunk_output(c.Q.data(), c.Kc.data(), U.data(), G.data(), S.data(), L, K, V, O.data());
    cpu::chunk::state_pass(c.Kc.data(), U.data(), G.data(), L, K, V, S.data());
    const std::string what = "L=" + std::to_string(L) + " K=" + std::to_string(K) + " V=" + std::to_string(V) +
                             " decay " + std::to_string(k.decay);
    EXPECT_TRUE(RelClose(what + " o", O, O_rec, 1e-11));
    EXPECT_TRUE(RelClose(what + " state", S, S_rec, 1e-11));
  }
}

}  // namespace
}  // namespace gdnkit::test
