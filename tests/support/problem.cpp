#include "support/problem.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <stdexcept>

#include "gdnkit/host_dtype.h"

namespace gdnkit::test {
namespace {

int64_t elems_of(const Buffer& b, DType dtype) { return int64_t(b.bytes.size()) / dtype_size(dtype); }

bool is_qk(const std::string& name) { return name == "q" || name == "k"; }
bool is_vo(const std::string& name) { return name == "v" || name == "o"; }
bool is_gate(const std::string& name) { return name == "g" || name == "beta" || name == "a" || name == "b"; }

StateLayout other(StateLayout l) { return l == StateLayout::kKLast ? StateLayout::kVLast : StateLayout::kKLast; }

// Offset of S[h][k][v] inside one slot / cache step.
int64_t state_offset(StateLayout layout, int K, int V, int h, int k, int v) {
  const int64_t head = int64_t(h) * K * V;
  return layout == StateLayout::kVLast ? head + int64_t(k) * V + v : head + int64_t(v) * K + k;
}

}  // namespace

void fill_nan(void* data, DType dtype, int64_t count) {
  switch (dtype) {
    case DType::kFloat32: {
      const uint32_t nan = 0x7fc00000u;
      for (int64_t i = 0; i < count; ++i) std::memcpy(static_cast<char*>(data) + 4 * i, &nan, 4);
      return;
    }
    case DType::kBFloat16:
      std::fill_n(static_cast<uint16_t*>(data), count, uint16_t(0x7fc0));
      return;
    case DType::kFloat16:
      std::fill_n(static_cast<uint16_t*>(data), count, uint16_t(0x7e00));
      return;
    case DType::kFloat8E4M3:
      std::fill_n(static_cast<uint8_t*>(data), count, uint8_t(0x7f));
      return;
    default:
      throw std::invalid_argument("fill_nan: not a float dtype");
  }
}

double fused_g(double A_log, double a, double dt_bias) {
  const double x = a + dt_bias;
  const double softplus = x > 20.0 ? x : std::log1p(std::exp(x));
  return -std::exp(A_log) * softplus;
}

double fused_beta(double b) { return 1.0 / (1.0 + std::exp(-b)); }

Problem::Problem(const ProblemConfig& cfg) : cfg_(cfg) {
  buffers_.reserve(32);  // add() hands out references that must survive later adds
  if (cfg_.op == OpKind::kPrefill) {
    build_prefill();
  } else {
    build_decode_verify();
  }
  if (cfg_.unit_qk) scale_unit_qk();
  if (cfg_.v_scale != 1.0) scale_v();
  if (cfg_.out_of_range_rows > 0 || cfg_.out_of_range_cache_rows > 0) place_out_of_range_rows();
}

bool Problem::has(const std::string& name) const {
  return std::any_of(buffers_.begin(), buffers_.end(), [&](const Buffer& b) { return b.name == name; });
}

Buffer& Problem::buffer(const std::string& name) {
  for (auto& b : buffers_)
    if (b.name == name) return b;
  throw std::invalid_argument("Problem: no buffer named " + name);
}

const Buffer& Problem::buffer(const std::string& name) const {
  for (const auto& b : buffers_)
    if (b.name == name) return b;
  throw std::invalid_argument("Problem: no buffer named " + name);
}

Buffer& Problem::add(const std::string& name, size_t bytes, bool is_output) {
  // At least 8 bytes so that an empty tensor still has a distinct non-null address.
  buffers_.push_back(Buffer{name, std::vector<std::byte>(std::max<size_t>(bytes, 8)), is_output});
  return buffers_.back();
}

Buffer& Problem::add_states(const std::string& name, DType dtype, int64_t elems, int64_t states) {
  if (dtype == DType::kFloat8E4M3) {
    Buffer& sc = add(name + "_scales", size_t(states * state_elems() / kFp8Block), true);
    std::fill(sc.bytes.begin(), sc.bytes.end(), std::byte{0xff});  // the NaN scale
  }
  Buffer& b = add(name, size_t(elems) * dtype_size(dtype), true);
  fill_nan(b.bytes.data(), dtype, elems);
  return b;
}

std::vector<double> Problem::load_storage(const std::string& name, DType dtype, int64_t first,
                                          int64_t first_block) const {
  const Buffer& b = buffer(name);
  std::vector<double> x(static_cast<size_t>(state_elems()));
  if (dtype != DType::kFloat8E4M3) {
    for (size_t i = 0; i < x.size(); ++i) x[i] = host::load(b.bytes.data(), dtype, first + int64_t(i));
    return x;
  }
  const auto* q = b.as<uint8_t>() + first;
  const auto* sc = buffer(name + "_scales").as<uint8_t>() + first_block;
  for (size_t i = 0; i < x.size(); ++i)
    x[i] = double(host::e4m3_to_float(q[i])) * host::e8m0_to_float(sc[i / kFp8Block]);
  return x;
}

void Problem::store_storage(const std::string& name, DType dtype, int64_t first, int64_t first_block,
                            const std::vector<double>& x) {
  Buffer& b = buffer(name);
  if (dtype != DType::kFloat8E4M3) {
    for (size_t i = 0; i < x.size(); ++i) host::store(b.bytes.data(), dtype, first + int64_t(i), x[i]);
    return;
  }
  std::vector<float> f(x.begin(), x.end());
  auto* q = b.as<uint8_t>() + first;
  auto* sc = buffer(name + "_scales").as<uint8_t>() + first_block;
  for (size_t blk = 0; blk < f.size() / kFp8Block; ++blk)
    sc[blk] = host::quantize_e4m3_block(&f[blk * kFp8Block], kFp8Block, q + blk * kFp8Block);
}

int64_t Problem::state_elems() const { return int64_t(cfg_.HV) * cfg_.K * cfg_.V; }
int64_t Problem::slot_stride() const { return state_elems() + cfg_.slot_pad; }

int64_t Problem::head_stride(const std::string& name) const {
  if (is_qk(name)) return cfg_.K + cfg_.head_pad;
  if (is_vo(name)) return cfg_.V + cfg_.head_pad;
  if (is_gate(name)) return 1;
  throw std::invalid_argument("Problem: " + name + " is not a token tensor");
}

int64_t Problem::token_stride(const std::string& name) const {
  if (is_qk(name)) return int64_t(cfg_.H) * head_stride(name) + cfg_.token_pad;
  if (is_vo(name)) return int64_t(cfg_.HV) * head_stride(name) + cfg_.token_pad;
  if (is_gate(name)) return cfg_.HV + cfg_.token_pad;
  throw std::invalid_argument("Problem: " + name + " is not a token tensor");
}

// ---- construction ------------------------------------------------------------------------------

namespace {

struct Rng {
  std::mt19937_64 gen;
  explicit Rng(uint64_t seed) : gen(seed) {}
  double normal(double sd = 1.0) { return std::normal_distribution<double>(0.0, sd)(gen); }
  double uniform(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(gen); }
  int64_t integer(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(gen); }
  std::vector<int32_t> permutation(int64_t n) {
    std::vector<int32_t> p(n);
    std::iota(p.begin(), p.end(), 0);
    std::shuffle(p.begin(), p.end(), gen);
    return p;
  }
};

// Per-token tensor [T, heads, dim] with strides: NaN everywhere, then N(0,1) in the logical elements.
void fill_token_tensor(Buffer& buf, DType dtype, int64_t T, int heads, int dim, int64_t ts, int64_t hs, Rng* rng,
                       std::vector<double>* values) {
  fill_nan(buf.bytes.data(), dtype, elems_of(buf, dtype));
  if (!rng) return;
  for (int64_t t = 0; t < T; ++t)
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < dim; ++i) {
        const double x = values ? (*values)[(t * heads + h) * dim + i] : rng->normal();
        host::store(buf.bytes.data(), dtype, t * ts + h * hs + i, x);
      }
}

}  // namespace

// q, k, v, o and the gates, drawn in a fixed order so that configs differing only in gate mode or
// dtypes draw the same values.
void Problem::build_tokens(std::mt19937_64& gen) {
  Rng rng(0);
  std::swap(rng.gen, gen);
  const DType in = cfg_.in_dtype;
  for (const char* name : {"q", "k", "v"}) {
    const int heads = is_qk(name) ? cfg_.H : cfg_.HV, dim = is_qk(name) ? cfg_.K : cfg_.V;
    Buffer& b = add(name, size_t(total_ * token_stride(name)) * dtype_size(in), false);
    std::vector<double> rows;  // correlated_keys: k = z U / 2 + 0.05 N(0, 1), U a 4 x dim basis per head
    if (cfg_.correlated_keys && std::string(name) == "k") {
      constexpr int kRank = 4;
      std::vector<double> basis(size_t(heads) * kRank * dim);
      for (auto& x : basis) x = rng.normal();
      rows.resize(size_t(total_) * heads * dim);
      for (int64_t t = 0; t < total_; ++t)
        for (int h = 0; h < heads; ++h) {
          double z[kRank];
          for (double& x : z) x = rng.normal(0.5);
          for (int i = 0; i < dim; ++i) {
            double x = rng.normal(0.05);
            for (int m = 0; m < kRank; ++m) x += z[m] * basis[(size_t(h) * kRank + m) * dim + i];
            rows[(size_t(t) * heads + h) * dim + i] = x;
          }
        }
    }
    fill_token_tensor(b, in, total_, heads, dim, token_stride(name), head_stride(name), &rng,
                      rows.empty() ? nullptr : &rows);
  }
  {
    Buffer& o = add("o", size_t(total_ * token_stride("o")) * dtype_size(in), true);
    fill_token_tensor(o, in, total_, cfg_.HV, cfg_.V, token_stride("o"), head_stride("o"), nullptr, nullptr);
  }
  // Gates. a and b are rounded to the gate dtype first: given gates are the fused formula of the
  // stored inputs, so a given-gate problem and a fused one with the same seed compute the same thing.
  {
    const int HV = cfg_.HV;
    std::vector<double> a(total_ * HV), b(total_ * HV), A_log(HV), dt_bias(HV);
    for (auto& x : a) x = rng.normal();
    for (auto& x : b) x = rng.normal() + (cfg_.correlated_keys ? 3.0 : 0.0);
    if (cfg_.extreme_gates) {
      // a = +10: g = -exp(A_log) * 10 (decay ~0); a = -10: g ~ -exp(A_log) * 5e-5 (decay ~1); b = +-10: beta ~1 / ~0.
      for (auto* gate : {&a, &b})
        for (auto& x : *gate) {
          const double u = rng.uniform(0.0, 1.0);
          if (u < 0.25) x = -10.0;
          else if (u < 0.5) x = 10.0;
        }
    }
    for (auto& x : A_log) x = cfg_.long_memory ? std::log(rng.uniform(1e-3, 1e-2)) : std::log(rng.uniform(1.0, 16.0));
    for (auto& x : dt_bias) x = rng.normal(0.5);
    auto round_to = [](double x, DType d) {
      switch (d) {
        case DType::kBFloat16:
          return double(host::bf16_to_float(host::float_to_bf16(float(x))));
        case DType::kFloat16:
          return double(host::fp16_to_float(host::float_to_fp16(float(x))));
        default:
          return double(float(x));
      }
    };
    for (auto& x : a) x = round_to(x, cfg_.gate_dtype);
    for (auto& x : b) x = round_to(x, cfg_.gate_dtype);
    for (auto& x : A_log) x = double(float(x));
    for (auto& x : dt_bias) x = double(float(x));
    const int64_t ts = token_stride("g");
    auto make = [&](const char* name, DType d, std::vector<double>& vals) {
      Buffer& buf = add(name, size_t(total_ * ts) * dtype_size(d), false);
      fill_token_tensor(buf, d, total_, HV, 1, ts, 1, &rng, &vals);
    };
    if (cfg_.gate_mode == GateMode::kFused) {
      make("a", cfg_.gate_dtype, a);
      make("b", cfg_.gate_dtype, b);
      Buffer& al = add("A_log", HV * 4, false);
      for (int h = 0; h < HV; ++h) al.as<float>()[h] = float(A_log[h]);
      Buffer& dt = add("dt_bias", HV * 4, false);
      for (int h = 0; h < HV; ++h) dt.as<float>()[h] = float(dt_bias[h]);
    } else {
      std::vector<double> g(a.size()), beta(b.size());
      for (int64_t t = 0; t < total_; ++t)
        for (int h = 0; h < HV; ++h) {
          g[t * HV + h] = double(float(fused_g(A_log[h], a[t * HV + h], dt_bias[h])));
          beta[t * HV + h] = fused_beta(b[t * HV + h]);
        }
      make("g", DType::kFloat32, g);
      make("beta", cfg_.gate_dtype, beta);
    }
  }

  std::swap(rng.gen, gen);
}

void Problem::build_decode_verify() {
  Rng rng(cfg_.seed);
  const bool verify = cfg_.op == OpKind::kVerify;
  const int T = verify ? cfg_.draft_tokens : 1;
  const bool varlen = verify && !cfg_.seq_lens.empty();
  rows_ = varlen ? int32_t(cfg_.seq_lens.size()) : cfg_.batch;
  int64_t pos = 0;
  for (int32_t r = 0; r < rows_; ++r) {
    const int64_t len = varlen ? cfg_.seq_lens[r] : T;
    starts_.push_back(pos);
    lens_.push_back(len);
    pos += len;
  }
  total_ = pos;
  pool_slots_ = cfg_.pool_slots > 0 ? cfg_.pool_slots : 2 * int64_t(rows_) + 3;

  build_tokens(rng.gen);

  // Pool: NaN everywhere, random states in the slots the rows start from.
  add_states("state", cfg_.state_dtype, pool_slots_ * slot_stride(), pool_slots_);
  const std::vector<int32_t> perm = rng.permutation(pool_slots_);
  Buffer& si = add("state_indices", size_t(rows_) * 4, false);
  for (int32_t r = 0; r < rows_; ++r) si.as<int32_t>()[r] = perm[r % pool_slots_];
  const std::vector<int32_t> row_perm = rng.permutation(rows_);
  for (int32_t i = 0; i < std::min(cfg_.padding_rows, rows_); ++i) si.as<int32_t>()[row_perm[i]] = -1;
  random_start_states(si.as<int32_t>(), rng.gen);
  Buffer& ef = add("error_flag", 4, true);
  ef.as<int32_t>()[0] = 0;

  if (verify) {
    if (varlen) {
      Buffer& cu = add("cu_seqlens", size_t(rows_ + 1) * 4, false);
      for (int32_t r = 0; r <= rows_; ++r) cu.as<int32_t>()[r] = int32_t(r < rows_ ? starts_[r] : total_);
    }
    Buffer& parent = add("parent", size_t(rows_) * T * 4, false);
    for (int32_t r = 0; r < rows_; ++r)
      for (int t = 0; t < T; ++t)
        parent.as<int32_t>()[r * T + t] = cfg_.tree ? int32_t(t > 0 ? rng.integer(-1, t - 1) : -1) : t - 1;
    if (!cfg_.tree) buffers_.pop_back();  // chains pass no parent tensor; the draws above keep rng aligned
    cache_slots_ = rows_ + 2;
    cache_steps_ = T;
    if (cfg_.intermediate) {
      const int64_t stride = cache_steps_ * state_elems() + cfg_.slot_pad;
      add_states("intermediate", cfg_.cache_dtype, cache_slots_ * stride, cache_slots_ * cache_steps_);
      const std::vector<int32_t> iperm = rng.permutation(cache_slots_);
      Buffer& ii = add("intermediate_indices", size_t(rows_) * 4, false);
      for (int32_t r = 0; r < rows_; ++r) ii.as<int32_t>()[r] = iperm[r];
    }
    // Accepted tokens: chains keep a prefix; trees keep the path from the root to a random node.
    Buffer& acc = add("accepted", size_t(rows_) * 4, false);
    Buffer& path = add("accepted_path", size_t(rows_) * T * 4, false);
    const Buffer* par = cfg_.tree ? &buffer("parent") : nullptr;
    for (int32_t r = 0; r < rows_; ++r) {
      const int64_t len = lens_[r];
      int32_t* pr = path.as<int32_t>() + int64_t(r) * T;
      std::fill_n(pr, T, -1);
      if (!cfg_.tree) {
        const int32_t n = int32_t(rng.integer(0, len));
        acc.as<int32_t>()[r] = n;
        for (int32_t i = 0; i < n; ++i) pr[i] = i;
      } else {
        int32_t node = int32_t(rng.integer(-1, len - 1));
        std::vector<int32_t> chain;
        while (node >= 0) {
          chain.push_back(node);
          node = par->as<int32_t>()[int64_t(r) * T + node];
        }
        std::reverse(chain.begin(), chain.end());
        acc.as<int32_t>()[r] = int32_t(chain.size());
        std::copy(chain.begin(), chain.end(), pr);
      }
    }
    if (!cfg_.tree) buffers_.pop_back();  // chains pass no accepted_path
  }
  if (cfg_.layout_target) {
    add_states("state_t", cfg_.state_dtype, pool_slots_ * slot_stride(), pool_slots_);
  }
}

void Problem::build_prefill() {
  Rng rng(cfg_.seed);
  rows_ = int32_t(cfg_.seq_lens.size());
  int64_t pos = 0;
  for (int32_t r = 0; r < rows_; ++r) {
    starts_.push_back(pos);
    lens_.push_back(cfg_.seq_lens[r]);
    pos += cfg_.seq_lens[r];
  }
  total_ = pos;
  pool_slots_ = cfg_.pool_slots > 0 ? cfg_.pool_slots : 2 * int64_t(rows_) + 3;

  build_tokens(rng.gen);

  // cu_seqlens (int32 or int64) and its host copy.
  cu_host_.assign(starts_.begin(), starts_.end());
  cu_host_.push_back(total_);
  if (cfg_.cu_seqlens_dtype == DType::kInt64) {
    Buffer& cu = add("cu_seqlens", cu_host_.size() * 8, false);
    std::copy(cu_host_.begin(), cu_host_.end(), cu.as<int64_t>());
  } else {
    Buffer& cu = add("cu_seqlens", cu_host_.size() * 4, false);
    for (size_t i = 0; i < cu_host_.size(); ++i) cu.as<int32_t>()[i] = int32_t(cu_host_[i]);
  }

  // Pool and slots: initial slots hold random states; final slots are distinct (or the same).
  add_states("state", cfg_.state_dtype, pool_slots_ * slot_stride(), pool_slots_);
  const std::vector<int32_t> perm = rng.permutation(pool_slots_);
  Buffer& ini = add("initial_indices", size_t(rows_) * 4, false);
  Buffer& fin = add("final_indices", size_t(rows_) * 4, false);
  for (int32_t r = 0; r < rows_; ++r) {
    ini.as<int32_t>()[r] = r < cfg_.zero_initial_rows ? -1 : perm[r % pool_slots_];
    fin.as<int32_t>()[r] = cfg_.same_slot ? perm[r % pool_slots_] : perm[(rows_ + r) % pool_slots_];
    if (r >= rows_ - cfg_.no_final_rows) fin.as<int32_t>()[r] = -1;
  }
  random_start_states(ini.as<int32_t>(), rng.gen);
  Buffer& ef = add("error_flag", 4, true);
  ef.as<int32_t>()[0] = 0;

  if (cfg_.checkpoint_interval > 0) {
    int64_t max_len = 0;
    for (auto l : lens_) max_len = std::max(max_len, l);
    cache_slots_ = rows_ + 1;
    cache_steps_ =
        cfg_.checkpoint_steps > 0 ? cfg_.checkpoint_steps : std::max<int64_t>(1, max_len / cfg_.checkpoint_interval);
    const int64_t stride = cache_steps_ * state_elems() + cfg_.slot_pad;
    add_states("checkpoints", cfg_.cache_dtype, cache_slots_ * stride, cache_slots_ * cache_steps_);
    const std::vector<int32_t> cperm = rng.permutation(cache_slots_);
    Buffer& ci = add("checkpoint_indices", size_t(rows_) * 4, false);
    for (int32_t r = 0; r < rows_; ++r) ci.as<int32_t>()[r] = cperm[r];
  }
  if (cfg_.layout_target) {
    add_states("state_t", cfg_.state_dtype, pool_slots_ * slot_stride(), pool_slots_);
  }
}

// Without the in-kernel L2 norm, q, k ~ N(0, 1) give ||k||^2 ~ K, so beta k k^T has eigenvalues far
// above 2 and the delta rule diverges exponentially (states ~1e26 after 200 tokens): a regime no
// model runs in, where a chunked fp32 algorithm cannot track an fp64 recurrence. A model that
// normalizes outside the kernel feeds unit-scale rows: scale q and k by 1/sqrt(K).
void Problem::scale_unit_qk() {
  for (const char* name : {"q", "k"}) {
    Buffer& b = buffer(name);
    const int64_t n = int64_t(b.bytes.size()) / dtype_size(cfg_.in_dtype);
    for (int64_t i = 0; i < n; ++i)
      host::store(b.bytes.data(), cfg_.in_dtype, i,
                  host::load(b.bytes.data(), cfg_.in_dtype, i) / std::sqrt(double(cfg_.K)));
  }
}

void Problem::scale_v() {
  Buffer& b = buffer("v");
  const int64_t n = int64_t(b.bytes.size()) / dtype_size(cfg_.in_dtype);
  for (int64_t i = 0; i < n; ++i)
    host::store(b.bytes.data(), cfg_.in_dtype, i, host::load(b.bytes.data(), cfg_.in_dtype, i) * cfg_.v_scale);
}

// Rows that must be skipped and counted (docs/semantics.md "Padding, out-of-range slots and the error flag").
// Decode/verify/commit: the last placed rows get pool slots P, P + 37, ...; the first placed rows get cache slots
// Q, Q + 1, ... Prefill: sequence i gets an initial, final or checkpoint slot past its buffer, in turn.
void Problem::place_out_of_range_rows() {
  if (cfg_.op == OpKind::kPrefill) {
    int32_t* ini = as<int32_t>("initial_indices");
    int32_t* fin = as<int32_t>("final_indices");
    int32_t* ck = has("checkpoint_indices") ? as<int32_t>("checkpoint_indices") : nullptr;
    for (int32_t i = 0; i < std::min(cfg_.out_of_range_rows, rows_); ++i) {
      const int kind = ck ? i % 3 : i % 2;
      if (kind == 0) ini[i] = int32_t(pool_slots_ + i);
      if (kind == 1) fin[i] = int32_t(pool_slots_ + 37 * i);
      if (kind == 2) ck[i] = int32_t(cache_slots_ + i);
    }
    return;
  }
  int32_t* si = as<int32_t>("state_indices");
  std::vector<int32_t> placed;
  for (int32_t r = 0; r < rows_; ++r)
    if (si[r] >= 0) placed.push_back(r);
  const int32_t n = std::min<int32_t>(cfg_.out_of_range_rows, int32_t(placed.size()));
  for (int32_t i = 0; i < n; ++i) si[placed[placed.size() - 1 - i]] = int32_t(pool_slots_ + 37 * i);
  if (!has("intermediate_indices")) return;
  int32_t* ii = as<int32_t>("intermediate_indices");
  for (int32_t i = 0; i < std::min<int32_t>(cfg_.out_of_range_cache_rows, int32_t(placed.size()) - n); ++i)
    ii[placed[i]] = int32_t(cache_slots_ + i);
}

void Problem::fill_every_slot(uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (int64_t s = 0; s < num_slots(); ++s) {
    std::vector<double> x(static_cast<size_t>(state_elems()));
    for (double& e : x) e = normal(gen);
    write_state("state", s, x);
  }
}

// ---- params -----------------------------------------------------------------------------------

void* Problem::ptr(const Resolver& r, const std::string& name) {
  Buffer& b = buffer(name);
  return r ? r(b) : static_cast<void*>(b.bytes.data());
}

const void* Problem::ptr_or_null(const Resolver& r, const std::string& name) {
  return has(name) ? ptr(r, name) : nullptr;
}

Gating Problem::gating(const Resolver& r) {
  Gating g;
  g.mode = cfg_.gate_mode;
  auto view = [&](const char* name, DType dtype) {
    InView v;
    v.data = ptr(r, name);
    v.dtype = dtype;
    v.token_stride = token_stride(name);
    v.head_stride = 1;
    return v;
  };
  if (cfg_.gate_mode == GateMode::kFused) {
    g.a = view("a", cfg_.gate_dtype);
    g.b = view("b", cfg_.gate_dtype);
    g.A_log = static_cast<const float*>(ptr(r, "A_log"));
    g.dt_bias = static_cast<const float*>(ptr(r, "dt_bias"));
  } else {
    g.g = view("g", DType::kFloat32);
    g.beta = view("beta", cfg_.gate_dtype);
  }
  return g;
}

StatePool Problem::pool(const Resolver& r, const std::string& name, StateLayout layout) {
  StatePool p;
  p.data = ptr(r, name);
  p.dtype = cfg_.state_dtype;
  p.layout = layout;
  p.num_slots = pool_slots_;
  p.slot_stride = slot_stride();
  if (has(name + "_scales")) p.scales = static_cast<uint8_t*>(ptr(r, name + "_scales"));
  return p;
}

StateCache Problem::cache(const Resolver& r, const std::string& name) {
  StateCache c;
  c.dtype = cfg_.cache_dtype;
  c.layout = cfg_.layout;
  if (!has(name)) return c;
  c.data = ptr(r, name);
  c.num_slots = cache_slots_;
  c.num_steps = cache_steps_;
  c.slot_stride = cache_steps_ * state_elems() + cfg_.slot_pad;
  if (has(name + "_scales")) c.scales = static_cast<uint8_t*>(ptr(r, name + "_scales"));
  return c;
}

DecodeParams Problem::decode_params(const Resolver& r) {
  DecodeParams p;
  p.heads.num_qk_heads = cfg_.H;
  p.heads.num_v_heads = cfg_.HV;
  p.heads.head_dim_k = cfg_.K;
  p.heads.head_dim_v = cfg_.V;
  p.heads.scale = cfg_.scale;
  p.heads.use_qk_l2norm = cfg_.use_qk_l2norm;
  p.batch = rows_;
  auto in_view = [&](const char* name) {
    InView v;
    v.data = ptr(r, name);
    v.dtype = cfg_.in_dtype;
    v.token_stride = token_stride(name);
    v.head_stride = head_stride(name);
    return v;
  };
  p.q = in_view("q");
  p.k = in_view("k");
  p.v = in_view("v");
  p.o.data = ptr(r, "o");
  p.o.dtype = cfg_.in_dtype;
  p.o.token_stride = token_stride("o");
  p.o.head_stride = head_stride("o");
  p.gating = gating(r);
  p.state = pool(r, "state", cfg_.layout);
  p.state_indices = static_cast<const int32_t*>(ptr(r, "state_indices"));
  p.error_flag = static_cast<int32_t*>(ptr(r, "error_flag"));
  return p;
}

VerifyParams Problem::verify_params(const Resolver& r) {
  VerifyParams p;
  static_cast<DecodeParams&>(p) = decode_params(r);
  p.num_draft_tokens = cfg_.draft_tokens;
  p.cu_seqlens = static_cast<const int32_t*>(ptr_or_null(r, "cu_seqlens"));
  p.parent = static_cast<const int32_t*>(ptr_or_null(r, "parent"));
  p.intermediate = cache(r, "intermediate");
  p.intermediate_indices = static_cast<const int32_t*>(ptr_or_null(r, "intermediate_indices"));
  p.update_state = cfg_.update_state;
  return p;
}

CommitParams Problem::commit_params(CommitSource source, const Resolver& r) {
  CommitParams p;
  static_cast<VerifyParams&>(p) = verify_params(r);
  p.update_state = false;
  p.source = source;
  p.accepted = static_cast<const int32_t*>(ptr(r, "accepted"));
  p.accepted_path = static_cast<const int32_t*>(ptr_or_null(r, "accepted_path"));
  return p;
}

PrefillParams Problem::prefill_params(PrefillAlgorithm algo, const Resolver& r) {
  PrefillParams p;
  const DecodeParams d = [&] {
    // Token views and heads are the same as decode's; build them without the decode-only indices.
    DecodeParams x;
    x.heads.num_qk_heads = cfg_.H;
    x.heads.num_v_heads = cfg_.HV;
    x.heads.head_dim_k = cfg_.K;
    x.heads.head_dim_v = cfg_.V;
    x.heads.scale = cfg_.scale;
    x.heads.use_qk_l2norm = cfg_.use_qk_l2norm;
    for (const char* name : {"q", "k", "v"}) {
      InView v;
      v.data = ptr(r, name);
      v.dtype = cfg_.in_dtype;
      v.token_stride = token_stride(name);
      v.head_stride = head_stride(name);
      (name[0] == 'q' ? x.q : name[0] == 'k' ? x.k : x.v) = v;
    }
    x.o.data = ptr(r, "o");
    x.o.dtype = cfg_.in_dtype;
    x.o.token_stride = token_stride("o");
    x.o.head_stride = head_stride("o");
    return x;
  }();
  p.heads = d.heads;
  p.num_seqs = rows_;
  p.total_tokens = total_;
  p.q = d.q;
  p.k = d.k;
  p.v = d.v;
  p.o = d.o;
  p.gating = gating(r);
  p.cu_seqlens = ptr(r, "cu_seqlens");
  p.cu_seqlens_dtype = cfg_.cu_seqlens_dtype;
  p.cu_seqlens_host = cfg_.pass_cu_seqlens_host ? cu_host_.data() : nullptr;
  p.state = pool(r, "state", cfg_.layout);
  p.initial_indices = static_cast<const int32_t*>(ptr(r, "initial_indices"));
  p.final_indices = static_cast<const int32_t*>(ptr(r, "final_indices"));
  p.checkpoints = cache(r, "checkpoints");
  if (has("checkpoints")) {
    p.checkpoint_interval = cfg_.checkpoint_interval;
    p.checkpoint_indices = static_cast<const int32_t*>(ptr(r, "checkpoint_indices"));
  }
  p.error_flag = static_cast<int32_t*>(ptr(r, "error_flag"));
  p.cpu_algorithm = algo;
  return p;
}

LayoutParams Problem::layout_params(bool in_place, const Resolver& r) {
  LayoutParams p;
  p.num_v_heads = cfg_.HV;
  p.head_dim_k = cfg_.K;
  p.head_dim_v = cfg_.V;
  p.src = pool(r, "state", cfg_.layout);
  p.dst = pool(r, in_place ? "state" : "state_t", other(cfg_.layout));
  return p;
}

// ---- reads ------------------------------------------------------------------------------------

std::vector<double> Problem::read_tokens(const std::string& name) const {
  const Buffer& b = buffer(name);
  int heads, dim;
  DType dtype;
  if (is_qk(name)) {
    heads = cfg_.H, dim = cfg_.K, dtype = cfg_.in_dtype;
  } else if (is_vo(name)) {
    heads = cfg_.HV, dim = cfg_.V, dtype = cfg_.in_dtype;
  } else {
    heads = cfg_.HV, dim = 1, dtype = name == "g" ? DType::kFloat32 : cfg_.gate_dtype;
  }
  const int64_t ts = token_stride(name), hs = head_stride(name);
  std::vector<double> out(size_t(total_) * heads * dim);
  for (int64_t t = 0; t < total_; ++t)
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < dim; ++i)
        out[(t * heads + h) * dim + i] = host::load(b.bytes.data(), dtype, t * ts + h * hs + i);
  return out;
}

std::vector<double> Problem::read_state(const std::string& name, int64_t slot) const {
  const StateLayout layout = name == "state_t" ? other(cfg_.layout) : cfg_.layout;
  const std::vector<double> x =
      load_storage(name, cfg_.state_dtype, slot * slot_stride(), slot * (state_elems() / kFp8Block));
  return canonical(x, layout);
}

void Problem::write_state(const std::string& name, int64_t slot, const std::vector<double>& s) {
  const StateLayout layout = name == "state_t" ? other(cfg_.layout) : cfg_.layout;
  std::vector<double> x(s.size());
  const int K = cfg_.K, V = cfg_.V;
  for (int h = 0; h < cfg_.HV; ++h)
    for (int k = 0; k < K; ++k)
      for (int v = 0; v < V; ++v) x[size_t(state_offset(layout, K, V, h, k, v))] = s[(int64_t(h) * K + k) * V + v];
  store_storage(name, cfg_.state_dtype, slot * slot_stride(), slot * (state_elems() / kFp8Block), x);
}

std::vector<double> Problem::read_cache(const std::string& name, int64_t slot, int64_t step) const {
  const std::vector<double> x = load_storage(name, cfg_.cache_dtype, slot * cache_slot_stride() + step * state_elems(),
                                             (slot * cache_steps_ + step) * (state_elems() / kFp8Block));
  return canonical(x, cfg_.layout);
}

std::vector<double> Problem::canonical(const std::vector<double>& x, StateLayout layout) const {
  const int K = cfg_.K, V = cfg_.V;
  std::vector<double> s(x.size());
  for (int h = 0; h < cfg_.HV; ++h)
    for (int k = 0; k < K; ++k)
      for (int v = 0; v < V; ++v) s[(int64_t(h) * K + k) * V + v] = x[size_t(state_offset(layout, K, V, h, k, v))];
  return s;
}

void Problem::random_start_states(const int32_t* slots, std::mt19937_64& gen) {
  for (int32_t r = 0; r < rows_; ++r) {
    if (slots[r] < 0) continue;
    std::vector<double> x(static_cast<size_t>(state_elems()));
    // A distribution per draw (as Rng::normal): the draws, and so every config's later ones, stay as they were.
    for (double& e : x) e = std::normal_distribution<double>(0.0, cfg_.state_scale)(gen);
    store_storage("state", cfg_.state_dtype, slots[r] * slot_stride(), slots[r] * (state_elems() / kFp8Block), x);
  }
}

// ---- written slots ----------------------------------------------------------------------------

namespace {
void push_valid(std::vector<int64_t>& out, int64_t slot, int64_t P) {
  if (slot >= 0 && slot < P) out.push_back(slot);
}
}  // namespace

std::vector<int64_t> Problem::written_pool_slots_decode() const {
  std::vector<int64_t> out;
  for (int32_t r = 0; r < rows_; ++r) push_valid(out, as<int32_t>("state_indices")[r], pool_slots_);
  return out;
}

std::vector<int64_t> Problem::written_pool_slots_verify() const {
  std::vector<int64_t> out;
  if (!cfg_.update_state || cfg_.tree) return out;
  // a row whose cache slot is >= Q is skipped whole (docs/semantics.md "Padding, out-of-range slots and the error
  // flag"): its pool slot keeps its state
  const int32_t* islots = has("intermediate") ? as<int32_t>("intermediate_indices") : nullptr;
  for (int32_t r = 0; r < rows_; ++r)
    if (lens_[r] > 0 && !(islots && islots[r] >= cache_slots_))
      push_valid(out, as<int32_t>("state_indices")[r], pool_slots_);
  return out;
}

std::vector<int64_t> Problem::written_pool_slots_commit(CommitSource source) const {
  std::vector<int64_t> out;
  // from the cache, a row whose cache slot is negative stores nothing, and one whose cache slot is >= Q is skipped
  // whole (docs/semantics.md "commit", "Padding, out-of-range slots and the error flag"): its pool slot keeps its state
  const bool from_cache = source == CommitSource::kCache;
  if (from_cache && !has("intermediate")) return out;  // refused: there is no cache to commit from
  const int32_t* islots = from_cache ? as<int32_t>("intermediate_indices") : nullptr;
  for (int32_t r = 0; r < rows_; ++r)
    if (as<int32_t>("accepted")[r] > 0 && !(islots && (islots[r] < 0 || islots[r] >= cache_slots_)))
      push_valid(out, as<int32_t>("state_indices")[r], pool_slots_);
  return out;
}

std::vector<int64_t> Problem::written_pool_slots_prefill() const {
  std::vector<int64_t> out;
  for (int32_t r = 0; r < rows_; ++r) push_valid(out, as<int32_t>("final_indices")[r], pool_slots_);
  return out;
}

}  // namespace gdnkit::test

namespace gdnkit::test {

bool Problem::prefill_row_runs(int32_t r) const {
  if (as<int32_t>("initial_indices")[r] >= pool_slots_ || as<int32_t>("final_indices")[r] >= pool_slots_) return false;
  return !has("checkpoint_indices") || as<int32_t>("checkpoint_indices")[r] < cache_slots_;
}

std::vector<int64_t> Problem::written_final_slots() const {
  std::vector<int64_t> out;
  for (int32_t r = 0; r < rows_; ++r) {
    const int32_t slot = as<int32_t>("final_indices")[r];
    if (slot >= 0 && prefill_row_runs(r)) out.push_back(slot);
  }
  return out;
}

std::vector<std::pair<int64_t, int64_t>> Problem::written_checkpoints() const {
  std::vector<std::pair<int64_t, int64_t>> out;
  if (!has("checkpoints")) return out;
  for (int32_t r = 0; r < rows_; ++r) {
    const int32_t slot = as<int32_t>("checkpoint_indices")[r];
    if (slot < 0 || !prefill_row_runs(r)) continue;
    for (int64_t j = 0; j < std::min<int64_t>(cache_steps_, lens_[r] / cfg_.checkpoint_interval); ++j)
      out.push_back({slot, j});
  }
  return out;
}

std::vector<std::pair<int64_t, int64_t>> Problem::written_intermediate() const {
  std::vector<std::pair<int64_t, int64_t>> out;
  if (!has("intermediate")) return out;
  const int32_t* slots = as<int32_t>("state_indices");
  const int32_t* islots = as<int32_t>("intermediate_indices");
  for (int32_t r = 0; r < rows_; ++r) {
    if (slots[r] < 0 || slots[r] >= pool_slots_ || islots[r] < 0 || islots[r] >= cache_slots_) continue;
    for (int64_t t = 0; t < lens_[r]; ++t) out.push_back({islots[r], t});
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

int64_t Problem::first_changed_cache_byte(const Problem& before, const std::string& name,
                                          const std::vector<std::pair<int64_t, int64_t>>& entries) const {
  const auto& a = before.buffer(name).bytes;
  const auto& b = buffer(name).bytes;
  if (a.size() != b.size()) return 0;
  const int64_t es = dtype_size(cfg_.cache_dtype), entry = state_elems();
  std::vector<char> written(a.size(), 0);
  for (auto [slot, j] : entries)
    std::fill_n(written.begin() + (slot * cache_slot_stride() + j * entry) * es, entry * es, 1);
  for (size_t i = 0; i < a.size(); ++i)
    if (!written[i] && a[i] != b[i]) return int64_t(i);
  if (!has(name + "_scales")) return -1;
  // float8_e4m3: the scales of the entries not written (reported past the data's bytes)
  const auto& sa = before.buffer(name + "_scales").bytes;
  const auto& sb = buffer(name + "_scales").bytes;
  const int64_t blocks = entry / kFp8Block;
  std::vector<char> sw(sa.size(), 0);
  for (auto [slot, j] : entries) std::fill_n(sw.begin() + (slot * cache_steps_ + j) * blocks, blocks, 1);
  for (size_t i = 0; i < sa.size(); ++i)
    if (!sw[i] && sa[i] != sb[i]) return int64_t(a.size() + i);
  return -1;
}

}  // namespace gdnkit::test
