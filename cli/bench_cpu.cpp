// gdnkit bench, CPU path: the reference backend on small shapes with host buffers. It exists so that
// `gdnkit bench` does something useful (and is tested) where no GPU is; its numbers are CPU timings.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "bench.h"
#include "gdnkit/host_dtype.h"

namespace gdnkit::bench {
namespace {

using Clock = std::chrono::steady_clock;

// The small default: every op takes microseconds to a few milliseconds on one core.
const Shape kSmall{"cpu-small", 2, 4, 64, 64};
// q, k, v, a, b dtype of this run (--input); set once by run_cpu / run_cuda.
DType g_input = DType::kBFloat16;
constexpr int kSamples = 7;

// Host buffer with float alignment.
struct HostBuf {
  std::vector<float> storage;
  explicit HostBuf(size_t bytes) : storage(bytes / 4 + 1) {}
  void* get() { return storage.data(); }
  template <class T>
  T* as() { return reinterpret_cast<T*>(storage.data()); }
};

void fill_normal(void* p, DType dtype, int64_t n, std::mt19937_64& rng, double mean, double stddev) {
  std::normal_distribution<double> dist(mean, stddev);
  for (int64_t i = 0; i < n; ++i) host::store(p, dtype, i, dist(rng));
}

// Each row of `dim` elements divided by its L2 norm (the op's: sqrt(sum x^2 + 1e-6)): the q and k a caller passes with
// the op's L2 norm off (--no-qk-l2norm).
void l2_normalize_rows(void* p, DType dtype, int64_t rows, int dim) {
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0.0;
    for (int i = 0; i < dim; ++i) ss += double(host::load(p, dtype, r * dim + i)) * host::load(p, dtype, r * dim + i);
    const double inv = 1.0 / std::sqrt(ss + 1e-6);
    for (int i = 0; i < dim; ++i) host::store(p, dtype, r * dim + i, host::load(p, dtype, r * dim + i) * inv);
  }
}

int64_t count_nonfinite(const void* p, DType dtype, int64_t n) {
  int64_t c = 0;
  for (int64_t i = 0; i < n; ++i) c += !std::isfinite(host::load(p, dtype, i));
  return c;
}

std::vector<int32_t> random_slots(int64_t pool, int64_t count, std::mt19937_64& rng) {
  std::vector<int32_t> perm(static_cast<size_t>(pool));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  perm.resize(static_cast<size_t>(count));
  return perm;
}

struct HostTokens {
  HostBuf q, k, v, o, a, b, A_log, dt_bias;
  TokenBuffers views;
  HostTokens(const Shape& s, int64_t tokens, std::mt19937_64& rng)
      : q(size_t(tokens) * s.H * s.K * dtype_size(g_input)),
        k(size_t(tokens) * s.H * s.K * dtype_size(g_input)),
        v(size_t(tokens) * s.HV * s.V * dtype_size(g_input)),
        o(size_t(tokens) * s.HV * s.V * dtype_size(g_input)),
        a(size_t(tokens) * s.HV * dtype_size(g_input)),
        b(size_t(tokens) * s.HV * dtype_size(g_input)),
        A_log(size_t(s.HV) * 4),
        dt_bias(size_t(s.HV) * 4) {
    fill_normal(q.get(), g_input, tokens * s.H * s.K, rng, 0, 1);
    fill_normal(k.get(), g_input, tokens * s.H * s.K, rng, 0, 1);
    if (!g_qk_l2norm) {  // the op's norm off: q and k arrive normalized, as a caller would pass them
      l2_normalize_rows(q.get(), g_input, tokens * s.H, s.K);
      l2_normalize_rows(k.get(), g_input, tokens * s.H, s.K);
    }
    fill_normal(v.get(), g_input, tokens * s.HV * s.V, rng, 0, 1);
    fill_normal(a.get(), g_input, tokens * s.HV, rng, 0, 1);
    fill_normal(b.get(), g_input, tokens * s.HV, rng, 0, 1);
    std::uniform_real_distribution<float> u(1.f, 16.f);
    for (int i = 0; i < s.HV; ++i) A_log.as<float>()[i] = std::log(u(rng));
    fill_normal(dt_bias.get(), DType::kFloat32, s.HV, rng, 0, 0.5);
    std::memset(o.storage.data(), 0xff, o.storage.size() * 4);  // NaN in every float dtype
    views = {q.get(), k.get(), v.get(), o.get(), a.get(), b.get(), A_log.as<float>(), dt_bias.as<float>()};
  }
};

// Median of kSamples timings of `reps` calls each, microseconds per call (after one warm-up call).
template <class Fn>
void time_calls(Row& r, int reps, Fn&& fn) {
  fn();
  std::vector<double> us;
  for (int i = 0; i < kSamples; ++i) {
    const auto t0 = Clock::now();
    for (int j = 0; j < reps; ++j) fn();
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / reps);
  }
  r.time_us = median(us);
  r.time_us_min = *std::min_element(us.begin(), us.end());
  r.time_us_max = *std::max_element(us.begin(), us.end());
  r.samples = kSamples;
  r.calls_per_replay = reps;
}

Row base_row(const std::string& op, const Shape& s, DType state, StateLayout layout) {
  return make_row("cpu", op, s, g_input, state, layout);
}

int64_t slot_elems(const Shape& s) { return int64_t(s.HV) * s.K * s.V; }

Row cpu_decode(const Shape& s, DType state, StateLayout layout, int32_t B) {
  Row r = base_row("decode", s, state, layout);
  r.batch = B;
  r.total_tokens = B;
  r.bytes = decode_bytes(s, B, g_input, state);
  std::mt19937_64 rng(uint64_t(B) * 31 + uint64_t(state) * 7 + uint64_t(layout));
  const int64_t pool_slots = 2 * int64_t(B) + 3;
  r.pool_slots = pool_slots;
  HostBuf pool(size_t(pool_slots * slot_elems(s) * dtype_size(state)));
  fill_normal(pool.get(), state, pool_slots * slot_elems(s), rng, 0, 0.05);
  HostTokens tok(s, B, rng);
  std::vector<int32_t> slots = random_slots(pool_slots, B, rng);
  int32_t flag = 0;
  DecodeParams p;
  p.heads = head_config(s);
  p.batch = B;
  set_token_views(s, g_input, tok.views, 0, p.q, p.k, p.v, p.o, p.gating);
  p.state = make_pool(s, pool.get(), state, layout, pool_slots);
  p.state_indices = slots.data();
  p.error_flag = &flag;
  time_calls(r, 10, [&] { decode(p, {Backend::kCPU, nullptr}); });
  r.nonfinite_outputs = count_nonfinite(tok.o.get(), g_input, int64_t(B) * s.HV * s.V);
  r.error_flag = flag;
  return r;
}

Row cpu_verify(const Shape& s, DType state, StateLayout layout, VerifyMode mode, int32_t T, int32_t B) {
  Row r = base_row("verify", s, state, layout);
  r.mode = verify_mode_name(mode);
  r.batch = B;
  r.draft_tokens = T;
  r.total_tokens = int64_t(B) * T;
  std::mt19937_64 rng(uint64_t(B) * 131 + uint64_t(T) * 7 + uint64_t(mode));
  std::vector<int32_t> accepted(static_cast<size_t>(B));
  int64_t accepted_total = 0;
  for (auto& a : accepted) accepted_total += (a = int32_t(1 + rng() % uint64_t(T)));
  const bool cache = mode != VerifyMode::kCommitRecompute, commit_after = mode != VerifyMode::kCache;
  if (commit_after) r.accepted_mean = double(accepted_total) / B;
  r.bytes = verify_bytes(s, B, T, g_input, state, mode, accepted_total);
  const int64_t pool_slots = 2 * int64_t(B) + 3;
  r.pool_slots = pool_slots;
  HostBuf pool(size_t(pool_slots * slot_elems(s) * dtype_size(state)));
  fill_normal(pool.get(), state, pool_slots * slot_elems(s), rng, 0, 0.05);
  HostBuf inter(size_t(cache ? B : 0) * T * slot_elems(s) * 4);
  HostTokens tok(s, int64_t(B) * T, rng);
  std::vector<int32_t> slots = random_slots(pool_slots, B, rng), islots = random_slots(B, B, rng);
  int32_t flag = 0;
  CommitParams p;
  p.heads = head_config(s);
  p.batch = B;
  p.num_draft_tokens = T;
  set_token_views(s, g_input, tok.views, 0, p.q, p.k, p.v, p.o, p.gating);
  p.state = make_pool(s, pool.get(), state, layout, pool_slots);
  p.state_indices = slots.data();
  p.error_flag = &flag;
  if (cache) {
    p.intermediate = {inter.get(), DType::kFloat32, layout, B, T, int64_t(T) * slot_elems(s)};
    p.intermediate_indices = islots.data();
  }
  p.source = mode == VerifyMode::kCommitRecompute ? CommitSource::kRecompute : CommitSource::kCache;
  p.accepted = accepted.data();
  const Context ctx{Backend::kCPU, nullptr};
  time_calls(r, 5, [&] {
    verify(static_cast<const VerifyParams&>(p), ctx);
    if (commit_after) commit(p, ctx);
  });
  r.nonfinite_outputs = count_nonfinite(tok.o.get(), g_input, int64_t(B) * T * s.HV * s.V);
  r.error_flag = flag;
  return r;
}

Row cpu_prefill(const Shape& s, DType state, StateLayout layout, const SeqSet& set, PrefillAlgorithm algo,
                int64_t C) {
  Row r = make_prefill_row("cpu", s, g_input, state, layout, set, C);
  r.mode = algo == PrefillAlgorithm::kRecurrent ? "recurrent" : algo == PrefillAlgorithm::kChunked ? "chunked" : "auto";
  const int32_t N = r.num_seqs;
  const int64_t T = r.total_tokens;
  std::mt19937_64 rng(uint64_t(T) * 7 + uint64_t(N) + uint64_t(algo));
  const int64_t pool_slots = 2 * int64_t(N) + 3;
  r.pool_slots = pool_slots;
  HostBuf pool(size_t(pool_slots * slot_elems(s) * dtype_size(state)));
  fill_normal(pool.get(), state, pool_slots * slot_elems(s), rng, 0, 0.05);
  HostTokens tok(s, T, rng);
  std::vector<int32_t> cu(size_t(N) + 1, 0);
  for (int32_t i = 0; i < N; ++i) cu[size_t(i) + 1] = cu[size_t(i)] + int32_t(set.lengths[size_t(i)]);
  std::vector<int32_t> slots = random_slots(pool_slots, N, rng);
  int32_t flag = 0;
  PrefillParams p;
  p.heads = head_config(s);
  p.num_seqs = N;
  p.total_tokens = T;
  set_token_views(s, g_input, tok.views, 0, p.q, p.k, p.v, p.o, p.gating);
  p.cu_seqlens = cu.data();
  p.cu_seqlens_dtype = DType::kInt32;
  p.state = make_pool(s, pool.get(), state, layout, pool_slots);
  p.initial_indices = slots.data();  // in place: start from the slot and store the final state there
  p.final_indices = slots.data();
  p.error_flag = &flag;
  p.cpu_algorithm = algo;
  // Checkpoints (--checkpoint C): sequence n's states after every C of its tokens in checkpoint slot n.
  const int64_t steps = checkpoint_steps(set, C);
  std::vector<int32_t> ckpt_idx(static_cast<size_t>(N));
  for (int32_t i = 0; i < N; ++i) ckpt_idx[size_t(i)] = i;
  HostBuf ckpt(size_t(N * steps * slot_elems(s) * dtype_size(state)));
  if (steps > 0) {
    p.checkpoints = make_checkpoints(s, ckpt.get(), state, layout, N, steps);
    p.checkpoint_interval = int32_t(C);
    p.checkpoint_indices = ckpt_idx.data();
    r.mode += " ckpt" + std::to_string(C);
  }
  if (!g_qk_l2norm) r.mode += " no-l2n";
  time_calls(r, 1, [&] { prefill(p, {Backend::kCPU, nullptr}); });
  r.nonfinite_outputs = count_nonfinite(tok.o.get(), g_input, T * s.HV * s.V);
  r.error_flag = flag;
  return r;
}

double host_copy_ceiling_tbps() {
  const size_t bytes = size_t(64) << 20;
  std::vector<char> src(bytes, 1), dst(bytes);
  std::vector<double> sec;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = Clock::now();
    std::memcpy(dst.data(), src.data(), bytes);
    sec.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    src[size_t(i)] = dst[bytes - 1 - size_t(i)];  // keep the copies observable
  }
  return 2.0 * double(bytes) / median(sec) / 1e12;
}

template <class Fn>
void guarded(Row fallback, const RowSink& sink, double ceiling, Fn&& fn) {
  Row r;
  try {
    r = fn();
  } catch (const Error& e) {
    r = std::move(fallback);
    r.status = e.code() == ErrorCode::kNotImplemented ? "not implemented" : "error";
    r.message = e.what();
  } catch (const std::exception& e) {
    r = std::move(fallback);
    r.status = "error";
    r.message = e.what();
  }
  finish_row(r, ceiling);
  sink(r);
}

}  // namespace

void run_cpu(const Options& o, RunInfo& info, const RowSink& sink) {
  g_input = o.input;
  g_qk_l2norm = o.qk_l2norm;
  info.backend = "cpu";
  info.device = "host CPU";
  info.copy_ceiling_tbps = host_copy_ceiling_tbps();
  const double ceiling = info.copy_ceiling_tbps;
  const std::vector<Shape> shapes = o.shapes.empty() ? with_dim(o, {kSmall}) : shapes_for(o, "decode");
  const std::vector<DType> states =
      o.states.empty() ? std::vector<DType>{DType::kFloat32, DType::kBFloat16} : o.states;
  const std::vector<StateLayout> layouts =
      o.layouts.empty() ? std::vector<StateLayout>{StateLayout::kKLast, StateLayout::kVLast} : o.layouts;
  std::vector<Job> jobs;
  for (const std::string& op : o.ops) {
    for (const Shape& s : shapes) {
      if (op == "decode") {
        for (DType st : states)
          for (StateLayout ly : layouts)
            for (int32_t B : o.batches.empty() ? std::vector<int32_t>{1, 4} : o.batches) {
              Row fb = base_row(op, s, st, ly);
              fb.batch = B;
              jobs.push_back({fb, [=] { return cpu_decode(s, st, ly, B); }});
            }
      } else if (op == "verify") {
        const DType st = states.front();
        const StateLayout ly = layouts.front();
        for (VerifyMode m : verify_modes())
          for (int32_t T : o.drafts.empty() ? std::vector<int32_t>{2} : o.drafts)
            for (int32_t B : o.batches.empty() ? std::vector<int32_t>{2} : o.batches) {
              Row fb = base_row(op, s, st, ly);
              fb.mode = verify_mode_name(m);
              fb.batch = B;
              fb.draft_tokens = T;
              jobs.push_back({fb, [=] { return cpu_verify(s, st, ly, m, T, B); }});
            }
      } else {
        const std::vector<SeqSet> sets = o.seqsets.empty() ? std::vector<SeqSet>{parse_seqset("2x128")} : o.seqsets;
        for (const SeqSet& set : sets)
          for (PrefillAlgorithm algo : {PrefillAlgorithm::kRecurrent, PrefillAlgorithm::kChunked}) {
            Row fb = base_row(op, s, states.front(), layouts.front());
            fb.seqset = set.name;
            fb.mode = algo == PrefillAlgorithm::kRecurrent ? "recurrent" : "chunked";
            const DType st = states.front();
            const StateLayout ly = layouts.front();
            const int64_t C = o.checkpoint;
            jobs.push_back({fb, [=] { return cpu_prefill(s, st, ly, set, algo, C); }});
          }
      }
    }
  }
  sink.plan(jobs.size());
  for (const Job& j : jobs) guarded(j.fallback, sink, ceiling, j.measure);
}

}  // namespace gdnkit::bench
