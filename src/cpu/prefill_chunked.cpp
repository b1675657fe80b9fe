// CPU chunked prefill: the blueprint of the CUDA prefill kernel, in double and staged the same way.
//
// Within a chunk of L <= 64 tokens (local index i = 0..L-1) with entering state S0, write
// G_i = g_0 + ... + g_i (cumulative log decay). Unrolling the recurrence of SPEC.md:
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
// The CUDA kernel runs the same stages: cumsum, A, triangular solve, w/u, state pass, output.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/prefill.h"

namespace gdnkit::cpu::detail {

namespace {
constexpr int kChunk = 64;
}

void chunked_sequence(const TokenReader& reader, const OutView& o, int64_t start, int64_t len, int h,
                      int64_t interval, double* S, const CheckpointFn& checkpoint) {
  const int K = reader.K(), V = reader.V();
  // Chunk buffers, row-major: Qc, Kc [L][K]; Vc [L][V]; A, Tm [L][L]; W [L][K]; U [L][V].
  std::vector<double> Qc(kChunk * K), Kc(kChunk * K), Vc(kChunk * V), G(kChunk), beta(kChunk);
  std::vector<double> A(kChunk * kChunk), Tm(kChunk * kChunk), W(kChunk * K), U(kChunk * V), out(V);
  TokenInputs in;

  for (int64_t c0 = 0; c0 < len; c0 += kChunk) {
    const int L = int(std::min<int64_t>(kChunk, len - c0));

    // Stage 0: the chunk's inputs (q, k normalized, q scaled, gates resolved).
    for (int i = 0; i < L; ++i) {
      reader.read(start + c0 + i, h, /*need_q=*/true, &in);
      std::copy(in.q.begin(), in.q.end(), Qc.begin() + int64_t(i) * K);
      std::copy(in.k.begin(), in.k.end(), Kc.begin() + int64_t(i) * K);
      std::copy(in.v.begin(), in.v.end(), Vc.begin() + int64_t(i) * V);
      G[i] = in.g;
      beta[i] = in.beta;
    }

    // Stage 1: gate cumsum, G_i = sum_{j<=i} g_j.
    for (int i = 1; i < L; ++i) G[i] += G[i - 1];

    // Stage 2: A = strictly lower triangular beta-scaled, decayed K K^T.
    for (int i = 0; i < L; ++i)
      for (int j = 0; j < L; ++j) {
        double a = 0;
        if (j < i) {
          double kk = 0;
          for (int d = 0; d < K; ++d) kk += Kc[int64_t(i) * K + d] * Kc[int64_t(j) * K + d];
          a = beta[i] * std::exp(G[i] - G[j]) * kk;
        }
        A[i * kChunk + j] = a;
      }

    // Stage 3: T = (I + A)^{-1} by forward substitution, row by row (the intra-chunk triangular solve):
    //   T_ii = 1,  T_ij = -sum_{m=j}^{i-1} A_im T_mj  for j < i.
    for (int i = 0; i < L; ++i) {
      for (int j = 0; j < i; ++j) {
        double acc = 0;
        for (int m = j; m < i; ++m) acc += A[i * kChunk + m] * Tm[m * kChunk + j];
        Tm[i * kChunk + j] = -acc;
      }
      Tm[i * kChunk + i] = 1.0;
      for (int j = i + 1; j < L; ++j) Tm[i * kChunk + j] = 0.0;
    }

    // Stage 4: w = T diag(beta exp(G)) Kc, u = T diag(beta) Vc (T is lower triangular: j <= i).
    for (int i = 0; i < L; ++i) {
      double* w = W.data() + int64_t(i) * K;
      double* u = U.data() + int64_t(i) * V;
      std::fill(w, w + K, 0.0);
      std::fill(u, u + V, 0.0);
      for (int j = 0; j <= i; ++j) {
        const double t = Tm[i * kChunk + j];
        const double wk = t * beta[j] * std::exp(G[j]), uv = t * beta[j];
        for (int d = 0; d < K; ++d) w[d] += wk * Kc[int64_t(j) * K + d];
        for (int d = 0; d < V; ++d) u[d] += uv * Vc[int64_t(j) * V + d];
      }
    }

    // Stage 5: U = u - w S0, the chunk's delta-rule values given the entering state.
    for (int i = 0; i < L; ++i) {
      double* u = U.data() + int64_t(i) * V;
      const double* w = W.data() + int64_t(i) * K;
      for (int k = 0; k < K; ++k) {
        const double* row = S + int64_t(k) * V;
        for (int v = 0; v < V; ++v) u[v] -= w[k] * row[v];
      }
    }

    // Stage 6: o_i = exp(G_i) S0^T q_i + sum_{j<=i} exp(G_i - G_j) (q_i . k_j) U_j (causal mask j <= i).
    for (int i = 0; i < L; ++i) {
      const double* q = Qc.data() + int64_t(i) * K;
      std::fill(out.begin(), out.end(), 0.0);
      for (int k = 0; k < K; ++k) {
        const double* row = S + int64_t(k) * V;
        for (int v = 0; v < V; ++v) out[v] += q[k] * row[v];
      }
      const double gi = std::exp(G[i]);
      for (int v = 0; v < V; ++v) out[v] *= gi;
      for (int j = 0; j <= i; ++j) {
        double qk = 0;
        for (int d = 0; d < K; ++d) qk += q[d] * Kc[int64_t(j) * K + d];
        const double c = std::exp(G[i] - G[j]) * qk;
        for (int v = 0; v < V; ++v) out[v] += c * U[int64_t(j) * V + v];
      }
      store_output(o, start + c0 + i, h, V, out.data());
    }

    // Stage 7: inter-chunk state pass, S = exp(G_{L-1}) S0 + sum_j exp(G_{L-1} - G_j) k_j U_j^T.
    const double glast = G[L - 1];
    const double decay = std::exp(glast);
    for (int64_t e = 0; e < int64_t(K) * V; ++e) S[e] *= decay;
    for (int j = 0; j < L; ++j) {
      const double c = std::exp(glast - G[j]);
      for (int k = 0; k < K; ++k) {
        const double kj = c * Kc[int64_t(j) * K + k];
        double* row = S + int64_t(k) * V;
        for (int v = 0; v < V; ++v) row[v] += kj * U[int64_t(j) * V + v];
      }
    }

    // Checkpoints fall on chunk ends: C is a multiple of the chunk.
    const int64_t done = c0 + L;
    if (interval > 0 && done % interval == 0) checkpoint(done / interval - 1, S);
  }
}

}  // namespace gdnkit::cpu::detail
