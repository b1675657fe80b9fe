// CPU reference of a prefill split over ranks (docs/semantics.md "Split prefill"): each piece's summary from the
// recurrence itself (its state from zero, or from the initial state on rank 0, and its transition P from the identity
// with v = 0), then the piece from its true initial state, the fold of the lower ranks' summaries.
#include <algorithm>
#include <vector>

#include "common/split.h"
#include "cpu/backend.h"
#include "cpu/prefill.h"
#include "gdnkit/gdnkit.h"

namespace gdnkit::cpu {
namespace {
using namespace detail;

struct Piece {
  int64_t start = 0, len = 0;
  int32_t islot = -1, fslot = -1, cslot = -1;
  bool span_ok = false, ok = false;
};

Piece piece(const PrefillParams& p, int32_t n) {
  Piece s;
  s.start = cu_at(p, n);
  const int64_t end = cu_at(p, n + 1);
  s.span_ok = s.start >= 0 && end >= s.start && end <= p.total_tokens;
  s.len = s.span_ok ? end - s.start : 0;
  s.islot = p.initial_indices ? p.initial_indices[n] : -1;
  s.fslot = p.final_indices ? p.final_indices[n] : -1;
  s.cslot = p.checkpoint_interval > 0 ? p.checkpoint_indices[n] : -1;
  s.ok = s.span_ok && s.islot < p.state.num_slots && s.fslot < p.state.num_slots && s.cslot < p.checkpoints.num_slots;
  return s;
}

// One piece's summary in the exchange: its state [HV, K x V] in the pool's layout, then its transition [HV, K x K].
struct Summary {
  float* base;
  int HV, K, V;
  StateLayout layout;
  float* state(int h) const { return base + int64_t(h) * K * V; }
  float* transition(int h) const { return base + int64_t(HV) * K * V + int64_t(h) * K * K; }
};
Summary summary(const SplitPrefillParams& sp, int32_t rank, int32_t n) {
  const PrefillParams& p = sp.local;
  const int HV = p.heads.num_v_heads, K = p.heads.head_dim_k, V = p.heads.head_dim_v;
  const int64_t elems = split_prefill_exchange_elems(p) / std::max(p.num_seqs, 1);
  return {sp.exchange + (int64_t(rank) * p.num_seqs + n) * elems, HV, K, V, p.state.layout};
}

// S (K x V) = P S + L with P, L of head h of a summary.
void apply(const Summary& s, int h, double* S) {
  const int K = s.K, V = s.V;
  const float *L = s.state(h), *P = s.transition(h);
  std::vector<double> out(int64_t(K) * V);
  for (int k = 0; k < K; ++k)
    for (int v = 0; v < V; ++v) {
      double x = L[state_elem(s.layout, K, V, k, v)];
      for (int j = 0; j < K; ++j) x += double(P[state_elem(s.layout, K, K, k, j)]) * S[int64_t(j) * V + v];
      out[int64_t(k) * V + v] = x;
    }
  std::copy(out.begin(), out.end(), S);
}

void begin(const SplitPrefillParams& sp, const PrefillParams& p) {
  const int HV = p.heads.num_v_heads, K = p.heads.head_dim_k, V = p.heads.head_dim_v;
  const TokenReader reader(p.heads, p.q, p.k, p.v, p.gating);
  std::vector<double> S(int64_t(K) * V), P(int64_t(K) * K);
  TokenInputs in;
  for (int32_t n = 0; n < p.num_seqs; ++n) {
    const Piece s = piece(p, n);
    const Summary out = summary(sp, sp.rank, n);
    for (int h = 0; h < HV; ++h) {
      if (s.ok && s.islot >= 0)
        load_state(pool_head(p.state, s.islot, HV, h, K, V), K, V, S.data());
      else
        std::fill(S.begin(), S.end(), 0.0);
      std::fill(P.begin(), P.end(), 0.0);
      for (int k = 0; k < K; ++k) P[int64_t(k) * K + k] = 1.0;
      for (int64_t t = 0; s.ok && t < s.len; ++t) {
        reader.read(s.start + t, h, /*need_q=*/false, &in);
        step(S.data(), K, V, in, nullptr);
        in.v.assign(K, 0.0);  // the transition: the same step on the identity's columns with v = 0
        step(P.data(), K, K, in, nullptr);
      }
      if (!s.ok) std::fill(S.begin(), S.end(), 0.0);  // a bad piece passes on the identity's summary
      for (int k = 0; k < K; ++k) {
        for (int v = 0; v < V; ++v) out.state(h)[state_elem(p.state.layout, K, V, k, v)] = float(S[int64_t(k) * V + v]);
        for (int j = 0; j < K; ++j)
          out.transition(h)[state_elem(p.state.layout, K, K, k, j)] = float(P[int64_t(k) * K + j]);
      }
    }
  }
}

void end(const SplitPrefillParams& sp, const PrefillParams& p) {
  const int HV = p.heads.num_v_heads, K = p.heads.head_dim_k, V = p.heads.head_dim_v;
  const TokenReader reader(p.heads, p.q, p.k, p.v, p.gating);
  const int64_t C = p.checkpoint_interval;
  std::vector<double> S(int64_t(K) * V), out(V);
  TokenInputs in;
  for (int32_t n = 0; n < p.num_seqs; ++n) {
    const Piece s = piece(p, n);
    if (!s.ok) {  // skipped and counted, as the whole prefill does
      flag_error(p.error_flag);
      for (int64_t t = s.start; s.span_ok && t < s.start + s.len; ++t) zero_output(p.o, t, HV, V);
      continue;
    }
    const int64_t offset = sp.piece_offsets ? sp.piece_offsets[n] : 0;
    const bool aligned = offset >= 0 && offset % 64 == 0;  // checkpoints count from the sequence's start, in chunks
    if (s.cslot >= 0 && !split_piece_checkpoints_ok(offset, s.len, C, p.checkpoints.num_steps))
      flag_error(p.error_flag);
    for (int h = 0; h < HV; ++h) {
      if (s.islot >= 0)
        load_state(pool_head(p.state, s.islot, HV, h, K, V), K, V, S.data());
      else
        std::fill(S.begin(), S.end(), 0.0);
      for (int32_t r = 0; r < sp.rank; ++r) apply(summary(sp, r, n), h, S.data());
      for (int64_t t = 0; t < s.len; ++t) {
        reader.read(s.start + t, h, /*need_q=*/true, &in);
        step(S.data(), K, V, in, out.data());
        store_output(p.o, s.start + t, h, V, out.data());
        const int64_t done = offset + t + 1;
        if (s.cslot >= 0 && aligned && done % C == 0 && done / C - 1 < p.checkpoints.num_steps)
          store_state(cache_head(p.checkpoints, s.cslot, done / C - 1, HV, h, K, V), K, V, S.data());
      }
      if (s.fslot < 0) continue;
      for (int32_t r = sp.rank + 1; r < sp.num_ranks; ++r) apply(summary(sp, r, n), h, S.data());
      store_state(pool_head(p.state, s.fslot, HV, h, K, V), K, V, S.data());
    }
  }
}

}  // namespace

void split_prefill_begin(const SplitPrefillParams& sp) { begin(sp, split_local_params(sp)); }
void split_prefill_end(const SplitPrefillParams& sp) { end(sp, split_local_params(sp)); }

}  // namespace gdnkit::cpu
