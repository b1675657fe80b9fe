// CPU reference backend, internal helpers shared by every op (docs/semantics.md "The recurrence").
//
// Everything is computed in double: inputs are widened when read, the state of one (sequence, value
// head) lives in a double K x V matrix S[k][v] (canonical orientation whatever the pool layout), and
// values are rounded only when stored (o in v's dtype, states in the pool / cache dtype).
//
// Index conventions shared by all ops (the CUDA backend matches them):
//  - a negative slot is padding: nothing is read or written for it (outputs of a padding row are 0;
//    commit from the cache with a negative intermediate slot leaves the pool state as it is);
//  - a slot >= P (pool) or >= Q (cache), an accepted count outside 0..len, a parent outside
//    [-1, t-1], an accepted_path entry outside [0, len), a cached step >= the cache's steps, a varlen
//    row longer than T or a sequence outside [0, T_total): the row (verify/commit) or sequence
//    (prefill) is skipped entirely (outputs 0 where they are addressable, no state written) and
//    *error_flag is incremented once for that row or sequence.
#pragma once

#include <cstdint>
#include <vector>

#include "gdnkit/params.h"

namespace gdnkit::cpu::detail {

// Element offset of S[k][v] inside one head's K*V block.
inline int64_t state_elem(StateLayout layout, int K, int V, int k, int v) {
  return layout == StateLayout::kVLast ? int64_t(k) * V + v : int64_t(v) * K + k;
}

// One head's state in a pool slot or a cache entry: its K*V elements start at element `offset` of `base`; a
// float8_e4m3 state's block scales (types.h kFp8Block) start at `scales`.
struct HeadState {
  void* base = nullptr;
  DType dtype = DType::kFloat32;
  StateLayout layout = StateLayout::kKLast;
  int64_t offset = 0;
  uint8_t* scales = nullptr;
};

// Head h of a pool slot, and head h of cache entry (slot, step); the scales of both are unpadded
// ([P, HV*K*V / kFp8Block] and [Q, S, HV*K*V / kFp8Block]).
inline HeadState pool_head(const StatePool& pool, int64_t slot, int HV, int h, int K, int V) {
  const int64_t blocks = int64_t(K) * V / kFp8Block;
  return {pool.data, pool.dtype, pool.layout, slot * pool.slot_stride + int64_t(h) * K * V,
          pool.scales ? pool.scales + (slot * HV + h) * blocks : nullptr};
}
inline HeadState cache_head(const StateCache& cache, int64_t slot, int64_t step, int HV, int h, int K, int V) {
  const int64_t blocks = int64_t(K) * V / kFp8Block;
  return {cache.data, cache.dtype, cache.layout, slot * cache.slot_stride + (step * HV + h) * int64_t(K) * V,
          cache.scales ? cache.scales + ((slot * cache.num_steps + step) * HV + h) * blocks : nullptr};
}

// Load / store one head's state as S[k][v]. A store rounds each element to float, then to the dtype (float8_e4m3:
// per block of kFp8Block consecutive elements, host::quantize_e4m3_block).
void load_state(const HeadState& at, int K, int V, double* S);
void store_state(const HeadState& at, int K, int V, const double* S);

// One token's inputs for one value head, ready for the recurrence: k normalized, q normalized and
// scaled, g and beta resolved from the gating mode.
struct TokenInputs {
  std::vector<double> q, k, v;  // [K], [K], [V]
  double g = 0, beta = 0;
};

class TokenReader {
 public:
  TokenReader(const HeadConfig& heads, const InView& q, const InView& k, const InView& v, const Gating& gating);
  // need_q = false skips q (commit by recompute reads only k, v and the gates).
  void read(int64_t token, int h, bool need_q, TokenInputs* out) const;
  int K() const { return K_; }
  int V() const { return V_; }

 private:
  HeadConfig heads_;
  InView q_, k_, v_;
  Gating gating_;
  int K_, V_, group_;  // group_ = HV / H value heads per q/k head
  double scale_;
};

// One step of the recurrence on S (K x V, S[k][v]):
//   S = exp(g) S;  u = beta (v - S^T k);  S = S + k u^T;  and, when o != nullptr, o = S^T q.
void step(double* S, int K, int V, const TokenInputs& in, double* o);

// o[token, h, :] = vals (rounded to o's dtype); zero_output writes zeros for every value head.
void store_output(const OutView& o, int64_t token, int h, int V, const double* vals);
void zero_output(const OutView& o, int64_t token, int HV, int V);

inline void flag_error(int32_t* error_flag) {
  if (error_flag) *error_flag += 1;
}

}  // namespace gdnkit::cpu::detail
