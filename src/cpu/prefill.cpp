// CPU reference prefill: the per-sequence driver and the token-by-token recurrence (the reference the
// chunked form is checked against).
#include "cpu/prefill.h"

#include <algorithm>
#include <vector>

#include "cpu/backend.h"

namespace gdnkit::cpu {
namespace detail {

int64_t cu_at(const PrefillParams& p, int64_t i) {
  return p.cu_seqlens_dtype == DType::kInt64 ? static_cast<const int64_t*>(p.cu_seqlens)[i]
                                             : static_cast<const int32_t*>(p.cu_seqlens)[i];
}
namespace {

void recurrent_sequence(const TokenReader& reader, const OutView& o, int64_t start, int64_t len, int h,
                        int64_t interval, double* S, const CheckpointFn& checkpoint) {
  const int K = reader.K(), V = reader.V();
  TokenInputs in;
  std::vector<double> out(V);
  for (int64_t t = 0; t < len; ++t) {
    reader.read(start + t, h, /*need_q=*/true, &in);
    step(S, K, V, in, out.data());
    store_output(o, start + t, h, V, out.data());
    if (interval > 0 && (t + 1) % interval == 0) checkpoint((t + 1) / interval - 1, S);
  }
}

}  // namespace

void run_prefill(const PrefillParams& p, SequenceFn fn) {
  const int HV = p.heads.num_v_heads, K = p.heads.head_dim_k, V = p.heads.head_dim_v;
  const TokenReader reader(p.heads, p.q, p.k, p.v, p.gating);
  const bool checkpoints = p.checkpoints.data != nullptr && p.checkpoint_interval > 0 && p.checkpoint_indices;
  std::vector<double> S(int64_t(K) * V);

  for (int32_t n = 0; n < p.num_seqs; ++n) {
    const int64_t start = cu_at(p, n), end = cu_at(p, n + 1);
    if (start < 0 || end < start || end > p.total_tokens) {  // no addressable rows: skip
      flag_error(p.error_flag);
      continue;
    }
    const int32_t init = p.initial_indices ? p.initial_indices[n] : -1;
    const int32_t fin = p.final_indices ? p.final_indices[n] : -1;
    const int32_t cslot = checkpoints ? p.checkpoint_indices[n] : -1;
    if (init >= p.state.num_slots || fin >= p.state.num_slots || cslot >= p.checkpoints.num_slots) {
      flag_error(p.error_flag);
      for (int64_t t = start; t < end; ++t) zero_output(p.o, t, HV, V);
      continue;
    }
    for (int h = 0; h < HV; ++h) {
      // Read before write: the initial state is loaded before anything is stored, so final may equal
      // initial.
      if (init >= 0)
        load_state(pool_head(p.state, init, HV, h, K, V), K, V, S.data());
      else
        std::fill(S.begin(), S.end(), 0.0);
      const CheckpointFn store_checkpoint = [&](int64_t j, const double* state) {
        if (cslot < 0 || j >= p.checkpoints.num_steps) return;
        store_state(cache_head(p.checkpoints, cslot, j, HV, h, K, V), K, V, state);
      };
      fn(reader, p.o, start, end - start, h, checkpoints ? p.checkpoint_interval : 0, S.data(), store_checkpoint);
      if (fin >= 0)
        store_state(pool_head(p.state, fin, HV, h, K, V), K, V, S.data());
    }
  }
}

}  // namespace detail

void prefill_recurrent(const PrefillParams& p) { detail::run_prefill(p, detail::recurrent_sequence); }

void prefill_chunked(const PrefillParams& p) { detail::run_prefill(p, detail::chunked_sequence); }

void prefill(const PrefillParams& p) {
  switch (p.cpu_algorithm) {
    case PrefillAlgorithm::kAuto:  // the recurrence is the reference
    case PrefillAlgorithm::kRecurrent:
      prefill_recurrent(p);
      return;
    case PrefillAlgorithm::kChunked:
      prefill_chunked(p);
      return;
  }
  throw Error(ErrorCode::kInvalidArgument,
              "prefill: cpu_algorithm " + std::to_string(int(p.cpu_algorithm)) + " is not auto, recurrent or chunked");
}

}  // namespace gdnkit::cpu
