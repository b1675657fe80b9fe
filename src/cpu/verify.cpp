// CPU reference: decode, verify (chain, tree, varlen) and commit (from cache, by recompute).
// Decode is verify with T = 1 and update_state: one code path for every token-by-token op.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu/backend.h"
#include "cpu/reference.h"

namespace gdnkit::cpu {
namespace {

using detail::flag_error;

// Token range [start, start + len) of row b; false when cu_seqlens describes an impossible row.
bool row_range(const VerifyParams& p, int32_t b, int64_t* start, int64_t* len) {
  const int64_t T = p.num_draft_tokens;
  if (!p.cu_seqlens) {
    *start = int64_t(b) * T;
    *len = T;
    return true;
  }
  *start = p.cu_seqlens[b];
  *len = int64_t(p.cu_seqlens[b + 1]) - p.cu_seqlens[b];
  return *start >= 0 && *len >= 0 && *len <= T;
}

void zero_row(const VerifyParams& p, int64_t start, int64_t len) {
  for (int64_t t = 0; t < len; ++t) detail::zero_output(p.o, start + t, p.heads.num_v_heads, p.heads.head_dim_v);
}

}  // namespace

void verify(const VerifyParams& p) {
  const int HV = p.heads.num_v_heads, K = p.heads.head_dim_k, V = p.heads.head_dim_v;
  const int64_t T = p.num_draft_tokens;
  const bool tree = p.parent != nullptr;
  const bool cache = p.intermediate.data != nullptr && p.intermediate_indices != nullptr;
  const detail::TokenReader reader(p.heads, p.q, p.k, p.v, p.gating);
  const int64_t KV = int64_t(K) * V;

  for (int32_t b = 0; b < p.batch; ++b) {
    int64_t start, len;
    if (!row_range(p, b, &start, &len)) {
      flag_error(p.error_flag);
      continue;
    }
    const int32_t slot = p.state_indices[b];
    const int32_t islot = cache ? p.intermediate_indices[b] : -1;
    const int32_t* parent = tree ? p.parent + int64_t(b) * T : nullptr;
    bool bad = slot >= p.state.num_slots || islot >= p.intermediate.num_slots;
    for (int64_t t = 0; tree && t < len; ++t) bad = bad || parent[t] < -1 || parent[t] >= t;
    if (slot < 0 || bad) {  // padding row, or a row we must not touch: outputs 0, no state I/O
      if (bad) flag_error(p.error_flag);
      zero_row(p, start, len);
      continue;
    }

    detail::TokenInputs in;
    std::vector<double> o(V), pool_state(KV);
    // Trees keep the state after every token (in double): token t continues from parent[t]'s state.
    std::vector<double> after(tree ? len * KV : KV);
    for (int h = 0; h < HV; ++h) {
      detail::load_state(detail::pool_head(p.state, slot, HV, h, K, V), K, V, pool_state.data());
      if (!tree) after.assign(pool_state.begin(), pool_state.end());
      for (int64_t t = 0; t < len; ++t) {
        double* S = tree ? after.data() + t * KV : after.data();
        if (tree) {
          const double* from = parent[t] < 0 ? pool_state.data() : after.data() + parent[t] * KV;
          std::copy(from, from + KV, S);
        }
        reader.read(start + t, h, /*need_q=*/true, &in);
        detail::step(S, K, V, in, o.data());
        detail::store_output(p.o, start + t, h, V, o.data());
        if (islot >= 0)
          detail::store_state(detail::cache_head(p.intermediate, islot, t, HV, h, K, V), K, V, S);
      }
      if (p.update_state && !tree && len > 0)
        detail::store_state(detail::pool_head(p.state, slot, HV, h, K, V), K, V, after.data());
    }
  }
}

void decode(const DecodeParams& p) {
  VerifyParams v;
  static_cast<DecodeParams&>(v) = p;
  v.num_draft_tokens = 1;
  v.update_state = true;
  verify(v);
}

void commit(const CommitParams& p) {
  const int HV = p.heads.num_v_heads, K = p.heads.head_dim_k, V = p.heads.head_dim_v;
  const int64_t T = p.num_draft_tokens;
  const int64_t KV = int64_t(K) * V;
  const bool from_cache = p.source == CommitSource::kCache;
  const detail::TokenReader reader(p.heads, p.q, p.k, p.v, p.gating);

  for (int32_t b = 0; b < p.batch; ++b) {
    int64_t start, len;
    if (!row_range(p, b, &start, &len)) {
      flag_error(p.error_flag);
      continue;
    }
    const int32_t slot = p.state_indices[b];
    if (slot < 0) continue;
    const int32_t n = p.accepted[b];
    const int32_t* path = p.accepted_path ? p.accepted_path + int64_t(b) * T : nullptr;
    auto kept = [&](int32_t i) { return path ? path[i] : i; };  // i-th kept token of the row
    bool bad = slot >= p.state.num_slots || n < 0 || n > len;
    for (int32_t i = 0; !bad && i < n; ++i) bad = kept(i) < 0 || kept(i) >= len;
    int32_t islot = -1;
    if (!bad && from_cache) {
      islot = p.intermediate.data && p.intermediate_indices ? p.intermediate_indices[b] : -1;
      bad = islot >= p.intermediate.num_slots || (n > 0 && kept(n - 1) >= p.intermediate.num_steps);
    }
    if (bad) {
      flag_error(p.error_flag);
      continue;
    }
    if (n == 0) continue;  // nothing kept: the pool state stays as it is

    std::vector<double> S(KV);
    detail::TokenInputs in;
    for (int h = 0; h < HV; ++h) {
      const detail::HeadState pool = detail::pool_head(p.state, slot, HV, h, K, V);
      if (from_cache) {
        // The state after the last kept token was stored by verify at step kept(n-1).
        if (islot < 0) break;  // the row cached nothing: padding
        const detail::HeadState entry = detail::cache_head(p.intermediate, islot, kept(n - 1), HV, h, K, V);
        if (entry.dtype == DType::kFloat8E4M3 && pool.dtype == DType::kFloat8E4M3) {
          // float8_e4m3 into float8_e4m3: the bytes and scales as stored (the values requantizing would write)
          std::memcpy(static_cast<uint8_t*>(pool.base) + pool.offset,
                      static_cast<const uint8_t*>(entry.base) + entry.offset, size_t(KV));
          std::memcpy(pool.scales, entry.scales, size_t(KV / kFp8Block));
          continue;
        }
        detail::load_state(entry, K, V, S.data());
      } else {
        // Replay the kept tokens in order from the pool state; q and o are not needed.
        detail::load_state(pool, K, V, S.data());
        for (int32_t i = 0; i < n; ++i) {
          reader.read(start + kept(i), h, /*need_q=*/false, &in);
          detail::step(S.data(), K, V, in, nullptr);
        }
      }
      detail::store_state(pool, K, V, S.data());
    }
  }
}

}  // namespace gdnkit::cpu
