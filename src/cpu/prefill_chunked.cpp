// CPU chunked prefill: the blueprint of the CUDA prefill kernel, in double and staged the same way.
//
// Within a chunk of L <= 64 tokens (local index i = 0..L-1) with entering state S0, write
// G_i = g_0 + ... + g_i (cumulative log decay). Unrolling the recurrence of docs/semantics.md:
//
//   S_i = exp(G_i) S0 + sum_{j<=i} exp(G_i - G_j) k_j u_j^T                                  (1)
//   u_i = beta_i (v_i - exp(G_i) S0^T k_i - sum_{j<i} exp(G_i - G_j) (k_i . k_j) u_j)
//
// so the chunk's delta-rule values U = [u_0; ...; u_{L-1}] solve a unit lower-triangular system
//
//   (I + A) U = diag(beta) V - diag(beta exp(G)) Kc S0,
//   A[i][j] = beta_i exp(G_i - G_j) (k_i . k_j)  for j < i, 0 otherwise.
//
// With T = (I + A)^{-1} (the WY representation):
//   w = T diag(beta exp(G)) Kc   [L, K]      u = T diag(beta) V   [L, V]      U = u - w S0
//
// and then, from (1),
//   o_i   = exp(G_i) S0^T q_i + sum_{j<=i} exp(G_i - G_j) (q_i . k_j) U_j      (inter + intra-chunk)
//   S_out = exp(G_{L-1}) S0 + sum_j exp(G_{L-1} - G_j) k_j U_j^T                 (inter-chunk pass)
//
// Only differences G_i - G_j with j <= i (and G_i itself) are exponentiated: with g <= 0 they are
// <= 0, so nothing overflows however long the chunk's decay is (a factor exp(-G_j) alone would).
// The CUDA kernel runs the same stages (chunk.h): cumsum, A, triangular solve, w/u, output, state pass.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/chunk.h"
#include "cpu/prefill.h"

namespace gdnkit::cpu {
namespace chunk {

void gate_cumsum(double* g, int L) {
  for (int i = 1; i < L; ++i) g[i] += g[i - 1];
}

void decayed_kkt(const double* Kc, const double* G, const double* beta, int L, int K, double* A) {
  for (int i = 0; i < L; ++i)
    for (int j = 0; j < L; ++j) {
      double a = 0;
      if (j < i) {
        double kk = 0;
        for (int d = 0; d < K; ++d) kk += Kc[i * K + d] * Kc[j * K + d];
        a = beta[i] * std::exp(G[i] - G[j]) * kk;
      }
      A[i * L + j] = a;
    }
}

void invert_unit_lower(const double* A, int L, double* T) {
  // Row i of T only needs rows < i: the GPU solves it the same way, a row (or block of rows) at a time.
  for (int i = 0; i < L; ++i) {
    for (int j = 0; j < i; ++j) {
      double acc = 0;
      for (int m = j; m < i; ++m) acc += A[i * L + m] * T[m * L + j];
      T[i * L + j] = -acc;
    }
    T[i * L + i] = 1.0;
    for (int j = i + 1; j < L; ++j) T[i * L + j] = 0.0;
  }
}

void wy(const double* T, const double* Kc, const double* Vc, const double* G, const double* beta, int L, int K, int V,
        double* W, double* U) {
  for (int i = 0; i < L; ++i) {
    double* w = W + i * K;
    double* u = U + i * V;
    std::fill(w, w + K, 0.0);
    std::fill(u, u + V, 0.0);
    for (int j = 0; j <= i; ++j) {  // T is lower triangular
      const double t = T[i * L + j];
      const double wk = t * beta[j] * std::exp(G[j]), uv = t * beta[j];
      for (int d = 0; d < K; ++d) w[d] += wk * Kc[j * K + d];
      for (int d = 0; d < V; ++d) u[d] += uv * Vc[j * V + d];
    }
  }
}

void delta_values(const double* W, const double* S, int L, int K, int V, double* U) {
  for (int i = 0; i < L; ++i) {
    double* u = U + i * V;
    const double* w = W + i * K;
    for (int k = 0; k < K; ++k) {
      const double* row = S + k * V;
      for (int v = 0; v < V; ++v) u[v] -= w[k] * row[v];
    }
  }
}

void chunk_output(const double* Qc, const double* Kc, const double* U, const double* G, const double* S, int L, int K,
                  int V, double* O) {
  for (int i = 0; i < L; ++i) {
    const double* q = Qc + i * K;
    double* out = O + i * V;
    std::fill(out, out + V, 0.0);
    // Inter-chunk part: the entering state, decayed to token i.
    for (int k = 0; k < K; ++k) {
      const double* row = S + k * V;
      for (int v = 0; v < V; ++v) out[v] += q[k] * row[v];
    }
    const double gi = std::exp(G[i]);
    for (int v = 0; v < V; ++v) out[v] *= gi;
    // Intra-chunk part: causal (j <= i, the diagonal included) decayed attention on the values U.
    for (int j = 0; j <= i; ++j) {
      double qk = 0;
      for (int d = 0; d < K; ++d) qk += q[d] * Kc[j * K + d];
      const double c = std::exp(G[i] - G[j]) * qk;
      for (int v = 0; v < V; ++v) out[v] += c * U[j * V + v];
    }
  }
}

void state_pass(const double* Kc, const double* U, const double* G, int L, int K, int V, double* S) {
  const double glast = G[L - 1];
  const double decay = std::exp(glast);
  for (int e = 0; e < K * V; ++e) S[e] *= decay;
  for (int j = 0; j < L; ++j) {
    const double c = std::exp(glast - G[j]);
    for (int k = 0; k < K; ++k) {
      const double kj = c * Kc[j * K + k];
      double* row = S + k * V;
      for (int v = 0; v < V; ++v) row[v] += kj * U[j * V + v];
    }
  }
}

}  // namespace chunk

namespace detail {

void chunked_sequence(const TokenReader& reader, const OutView& o, int64_t start, int64_t len, int h, int64_t interval,
                      double* S, const CheckpointFn& checkpoint) {
  using chunk::kChunk;
  const int K = reader.K(), V = reader.V();
  std::vector<double> Qc(kChunk * K), Kc(kChunk * K), Vc(kChunk * V), G(kChunk), beta(kChunk);
  std::vector<double> A(kChunk * kChunk), T(kChunk * kChunk), W(kChunk * K), U(kChunk * V), O(kChunk * V);
  TokenInputs in;

  for (int64_t c0 = 0; c0 < len; c0 += kChunk) {
    const int L = int(std::min<int64_t>(kChunk, len - c0));
    // The chunk's inputs: q, k normalized, q scaled, g and beta resolved.
    for (int i = 0; i < L; ++i) {
      reader.read(start + c0 + i, h, /*need_q=*/true, &in);
      std::copy(in.q.begin(), in.q.end(), Qc.begin() + i * K);
      std::copy(in.k.begin(), in.k.end(), Kc.begin() + i * K);
      std::copy(in.v.begin(), in.v.end(), Vc.begin() + i * V);
      G[i] = in.g;
      beta[i] = in.beta;
    }
    chunk::gate_cumsum(G.data(), L);
    chunk::decayed_kkt(Kc.data(), G.data(), beta.data(), L, K, A.data());
    chunk::invert_unit_lower(A.data(), L, T.data());
    chunk::wy(T.data(), Kc.data(), Vc.data(), G.data(), beta.data(), L, K, V, W.data(), U.data());
    chunk::delta_values(W.data(), S, L, K, V, U.data());
    chunk::chunk_output(Qc.data(), Kc.data(), U.data(), G.data(), S, L, K, V, O.data());
    for (int i = 0; i < L; ++i) store_output(o, start + c0 + i, h, V, O.data() + i * V);
    chunk::state_pass(Kc.data(), U.data(), G.data(), L, K, V, S);
    // Checkpoints fall on chunk ends: C is a multiple of the chunk.
    const int64_t done = c0 + L;
    if (interval > 0 && done % interval == 0) checkpoint(done / interval - 1, S);
  }
}

}  // namespace detail
}  // namespace gdnkit::cpu
