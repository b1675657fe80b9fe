"""The recurrence of docs/semantics.md in NumPy float64, and random problems for the tests.

Everything here is written from that definition, token by token:

    g_t    = -exp(A_log[h]) * softplus(a_t[h] + dt_bias[h])      (or given)
    beta_t = sigmoid(b_t[h])                                     (or given)
    q_t, k_t <- x / sqrt(sum(x^2) + 1e-6)   (use_qk_l2norm);  q_t <- q_t * scale
    S   = exp(g_t) * S
    u_t = beta_t * (v_t - S^T k_t)
    S   = S + k_t u_t^T
    o_t = S^T q_t
"""

from __future__ import annotations

import numpy as np

TOLERANCES = {
    # (op kind, what, dtype) -> rel tolerance vs the fp64 reference (docs/semantics.md, "Tolerances")
    ("recurrent", "o", "bf16"): 4e-3,
    ("recurrent", "o", "fp16"): 4e-3,
    ("recurrent", "o", "fp32"): 5e-5,
    ("recurrent", "state", "fp32"): 1e-5,
    ("recurrent", "state", "bf16"): 8e-3,
    ("prefill", "o", "bf16"): 5e-3,
    ("prefill", "o", "fp16"): 5e-3,
    ("prefill", "o", "fp32"): 2e-3,
    ("prefill", "state", "fp32"): 5e-3,
    ("prefill", "state", "bf16"): 8e-3,
}


def rel(x, ref) -> float:
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert x.shape == ref.shape, (x.shape, ref.shape)
    assert np.all(np.isfinite(x)), "non-finite values in the result"
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(x - ref) / (den if den > 0 else 1.0))


def softplus(x):
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def fused_gates(a, b, A_log, dt_bias):
    """g, beta [T, HV] from raw projections, in float64."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    g = -np.exp(np.asarray(A_log, np.float64))[None, :] * softplus(a + np.asarray(dt_bias, np.float64)[None, :])
    return g, sigmoid(b)


def step(S, q, k, v, g, beta, scale, l2norm):
    """One token for all value heads. S [HV, K, V] (float64, updated in place); q, k [H, K]; v [HV, V];
    g, beta [HV]. Returns o [HV, V]."""
    HV = S.shape[0]
    H = q.shape[0]
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    if l2norm:
        q = q / np.sqrt(np.sum(q * q, axis=-1, keepdims=True) + 1e-6)
        k = k / np.sqrt(np.sum(k * k, axis=-1, keepdims=True) + 1e-6)
    q = q * scale
    o = np.empty((HV, S.shape[2]))
    for h in range(HV):
        hq = h // (HV // H)
        S[h] *= np.exp(g[h])
        u = beta[h] * (np.asarray(v[h], np.float64) - S[h].T @ k[hq])
        S[h] += np.outer(k[hq], u)
        o[h] = S[h].T @ q[hq]
    return o


def run_tokens(S, q, k, v, g, beta, scale, l2norm, keep_states=False):
    """Tokens in order from S [HV, K, V]; returns o [T, HV, V] (and the state after each token)."""
    S = np.array(S, dtype=np.float64)
    outs, states = [], []
    for t in range(q.shape[0]):
        outs.append(step(S, q[t], k[t], v[t], g[t], beta[t], scale, l2norm))
        if keep_states:
            states.append(S.copy())
    o = np.stack(outs) if outs else np.zeros((0,) + (S.shape[0], S.shape[2]))
    return (o, S, states) if keep_states else (o, S)


# ---- layouts ------------------------------------------------------------------------------------

def to_layout(S, layout):
    """[HV, K, V] math state -> stored per-head block ([V, K] for k_last)."""
    return np.swapaxes(S, -1, -2) if layout == "k_last" else S


def from_layout(block, layout):
    return np.swapaxes(np.asarray(block, np.float64), -1, -2) if layout == "k_last" else np.asarray(block, np.float64)


def pool_shape(P, HV, K, V, layout):
    return (P, HV, V, K) if layout == "k_last" else (P, HV, K, V)


# ---- random problems ----------------------------------------------------------------------------

class Problem:
    """Random inputs as docs/semantics.md draws them: q, k, v ~ N(0,1); a, b ~ N(0,1); A_log = log U(1,16);
    dt_bias ~ N(0, 0.5) (long_memory: A_log = log U(1e-3, 1e-2))."""

    def __init__(self, rng, T, H=2, HV=4, K=64, V=128, dtype=np.float32, gating="fused", long_memory=False,
                 fused_views=False):
        self.T, self.H, self.HV, self.K, self.V = T, H, HV, K, V
        self.gating = gating
        if fused_views:
            # q, k, v as views of one projection [T, H*K + H*K + HV*V]: strided token rows.
            width = 2 * H * K + HV * V + 8
            proj = rng.standard_normal((T, width)).astype(dtype)
            self.q = proj[:, : H * K].reshape(T, H, K)
            self.k = proj[:, H * K: 2 * H * K].reshape(T, H, K)
            self.v = proj[:, 2 * H * K: 2 * H * K + HV * V].reshape(T, HV, V)
        else:
            self.q = rng.standard_normal((T, H, K)).astype(dtype)
            self.k = rng.standard_normal((T, H, K)).astype(dtype)
            self.v = rng.standard_normal((T, HV, V)).astype(dtype)
        if long_memory:
            self.A_log = np.log(rng.uniform(1e-3, 1e-2, HV)).astype(np.float32)
        else:
            self.A_log = np.log(rng.uniform(1.0, 16.0, HV)).astype(np.float32)
        self.dt_bias = (0.5 * rng.standard_normal(HV)).astype(np.float32)
        self.a = rng.standard_normal((T, HV)).astype(dtype)
        self.b = rng.standard_normal((T, HV)).astype(dtype)
        g, beta = fused_gates(self.a, self.b, self.A_log, self.dt_bias)
        if gating == "given":
            self.g_in = g.astype(np.float32)
            self.beta_in = beta.astype(dtype)
            self.g = self.g_in.astype(np.float64)
            self.beta = self.beta_in.astype(np.float64)
        else:
            self.g, self.beta = g, beta

    def gate_kwargs(self, rows=slice(None)):
        if self.gating == "given":
            return dict(g=self.g_in[rows], beta=self.beta_in[rows])
        return dict(a=self.a[rows], b=self.b[rows], A_log=self.A_log, dt_bias=self.dt_bias)

    def tokens(self, rows):
        """(q, k, v, g, beta) of the given rows for run_tokens."""
        return self.q[rows], self.k[rows], self.v[rows], self.g[rows], self.beta[rows]


def random_pool(rng, P, HV, K, V, layout, dtype=np.float32):
    return (0.1 * rng.standard_normal(pool_shape(P, HV, K, V, layout))).astype(dtype)


def poison(shape, dtype=np.float32):
    return np.full(shape, np.nan, dtype=dtype)


def bits_equal(x, y) -> bool:
    """Bit-identical (NaN == NaN)."""
    x = np.ascontiguousarray(x)
    y = np.ascontiguousarray(y)
    return x.shape == y.shape and x.tobytes() == y.tobytes()
