// The stages of the chunked (WY) prefill on one chunk of L <= kChunk tokens of one value head, in
// double. prefill_chunked.cpp composes them; the CUDA prefill kernel runs the same stages, and the
// tests check each stage on its own. Matrices are row-major: Qc, Kc [L][K], Vc, U [L][V],
// A, T [L][L], W [L][K], S [K][V], O [L][V]. The math is in prefill_chunked.cpp's header comment.
#pragma once

namespace gdnkit::cpu::chunk {

constexpr int kChunk = 64;

// G_i = g_0 + ... + g_i, in place.
void gate_cumsum(double* g, int L);

// A_ij = beta_i exp(G_i - G_j) (k_i . k_j) for j < i, 0 on and above the diagonal.
void decayed_kkt(const double* Kc, const double* G, const double* beta, int L, int K, double* A);

// T = (I + A)^{-1} for strictly lower triangular A, by forward substitution:
//   T_ii = 1,  T_ij = -sum_{m=j}^{i-1} A_im T_mj  (j < i),  T_ij = 0 (j > i).
void invert_unit_lower(const double* A, int L, double* T);

// The WY representation: W = T diag(beta exp(G)) Kc,  U = T diag(beta) Vc.
void wy(const double* T, const double* Kc, const double* Vc, const double* G, const double* beta, int L, int K, int V,
        double* W, double* U);

// U <- U - W S: the chunk's delta-rule values u_i given the entering state S.
void delta_values(const double* W, const double* S, int L, int K, int V, double* U);

// O_i = exp(G_i) S^T q_i + sum_{j<=i} exp(G_i - G_j) (q_i . k_j) U_j   (S = the entering state).
void chunk_output(const double* Qc, const double* Kc, const double* U, const double* G, const double* S, int L, int K,
                  int V, double* O);

// S <- exp(G_{L-1}) S + sum_j exp(G_{L-1} - G_j) k_j U_j^T   (the inter-chunk state pass).
void state_pass(const double* Kc, const double* U, const double* G, int L, int K, int V, double* S);

}  // namespace gdnkit::cpu::chunk
