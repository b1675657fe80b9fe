#include "support/random_config.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <sstream>
#include <stdexcept>
#include <vector>

namespace gdnkit::test {
namespace {

// splitmix64 over a counter: the same numbers on every compiler and standard library.
class Draw {
 public:
  explicit Draw(uint64_t seed) : state_(seed ^ 0x6a09e667f3bcc909ull) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [lo, hi] (the modulo bias is irrelevant at these ranges).
  int64_t range(int64_t lo, int64_t hi) { return lo + int64_t(next() % uint64_t(hi - lo + 1)); }
  bool chance(int num, int den) { return range(0, den - 1) < num; }
  template <class T>
  T pick(const std::vector<T>& options) {
    return options[size_t(range(0, int64_t(options.size()) - 1))];
  }

 private:
  uint64_t state_;
};

bool is_step(RandomOp op) { return op != RandomOp::kPrefill && op != RandomOp::kLayout; }
bool is_verify_like(RandomOp op) { return is_step(op) && op != RandomOp::kDecode; }
bool is_commit(RandomOp op) { return op == RandomOp::kCommitCache || op == RandomOp::kCommitRecompute; }

struct Heads {
  int32_t H, HV;
};

// Token counts of the step ops: B rows of T tokens, or the varlen lengths.
int64_t step_tokens(const ProblemConfig& c) {
  if (c.op == OpKind::kDecode) return c.batch;
  if (c.seq_lens.empty()) return int64_t(c.batch) * c.draft_tokens;
  int64_t n = 0;
  for (int32_t l : c.seq_lens) n += l;
  return n;
}

int64_t prefill_tokens(const ProblemConfig& c) {
  int64_t n = 0;
  for (int32_t l : c.seq_lens) n += l;
  return n;
}

int32_t rows_of(const ProblemConfig& c) {
  return c.op == OpKind::kPrefill || (c.op == OpKind::kVerify && !c.seq_lens.empty()) ? int32_t(c.seq_lens.size())
                                                                                      : c.batch;
}

// ---- the draw, one part per op family ----------------------------------------------------------

void draw_common(Draw& d, RandomCase& c) {
  ProblemConfig& p = c.cfg;
  p.in_dtype = d.pick<DType>({DType::kBFloat16, DType::kBFloat16, DType::kFloat16, DType::kFloat32});
  p.gate_dtype = d.pick<DType>({DType::kFloat32, DType::kBFloat16, DType::kFloat16});
  p.state_dtype = d.pick<DType>({DType::kFloat32, DType::kBFloat16, DType::kFloat32, DType::kFloat16});
  p.cache_dtype = d.pick<DType>({DType::kFloat32, DType::kBFloat16, DType::kFloat32, DType::kFloat16});
  p.layout = d.chance(1, 2) ? StateLayout::kKLast : StateLayout::kVLast;
  p.gate_mode = d.chance(2, 3) ? GateMode::kFused : GateMode::kGiven;
  p.use_qk_l2norm = d.chance(3, 4);
  p.unit_qk = !p.use_qk_l2norm;
  p.scale = d.chance(3, 4) ? 0.0f : d.pick<float>({0.05f, 0.0625f, 0.1f, 0.125f, 0.25f});
  // Strides in whole 16-byte units of every dtype (the CUDA backend's vector loads).
  p.token_pad = d.pick<int32_t>({0, 0, 0, 8, 24, 64});
  p.head_pad = d.pick<int32_t>({0, 0, 0, 8, 16});
  p.slot_pad = d.pick<int32_t>({0, 0, 0, 8, 24, 40});
  p.long_memory = d.chance(1, 5);
  p.extreme_gates = d.chance(1, 8);
}

// Dims of the step ops (the CUDA backend builds K == V only).
void draw_square_dims(Draw& d, ProblemConfig& p) { p.K = p.V = d.pick<int32_t>({64, 128, 128, 256}); }

void draw_decode(Draw& d, RandomCase& c) {
  ProblemConfig& p = c.cfg;
  p.op = OpKind::kDecode;
  const bool large = d.chance(1, 6);
  if (c.tier == Tier::kFast)
    p.batch = int32_t(large ? d.range(40, 160) : d.range(1, 24));
  else
    p.batch = int32_t(large ? d.range(256, 4096) : d.range(1, 128));
  p.padding_rows = d.chance(1, 2) ? int32_t(d.range(0, (p.batch + 3) / 4)) : 0;
  if (d.chance(1, 5)) p.out_of_range_rows = int32_t(std::min<int64_t>(d.range(1, 2), p.batch - p.padding_rows));
}

void draw_verify(Draw& d, RandomCase& c) {
  ProblemConfig& p = c.cfg;
  p.op = OpKind::kVerify;
  const bool fast = c.tier == Tier::kFast;
  switch (c.op) {
    case RandomOp::kVerifyChain: p.tree = false; break;
    case RandomOp::kVerifyTree: p.tree = true; break;
    case RandomOp::kVerifyVarlen: p.tree = d.chance(1, 2); break;
    default: p.tree = d.chance(1, 3); break;  // commit: trees need accepted_path, chains default it
  }
  const bool varlen = c.op == RandomOp::kVerifyVarlen || (is_commit(c.op) && d.chance(1, 3));
  // T: mostly MTP-sized drafts, sometimes past the chain kernel's chunks; trees up to 64 (CUDA's limit).
  const int64_t t_max = p.tree ? 64 : (fast ? 48 : 100);
  const int r = int(d.range(0, 9));
  p.draft_tokens = int32_t(r < 6 ? d.range(1, 8) : r < 9 ? d.range(9, 24) : d.range(25, t_max));
  const bool large = d.chance(1, 6);
  p.batch = int32_t(large ? (fast ? d.range(20, 64) : d.range(64, 512)) : d.range(1, 8));
  if (varlen) {
    p.seq_lens.resize(size_t(p.batch));
    for (int32_t& len : p.seq_lens) {
      const int k = int(d.range(0, 5));
      len = k == 0 ? 0 : k == 1 ? p.draft_tokens : int32_t(d.range(0, p.draft_tokens));
    }
  }
  p.padding_rows = d.chance(1, 2) ? int32_t(d.range(0, (p.batch + 3) / 4)) : 0;
  p.intermediate = c.op == RandomOp::kCommitCache || d.chance(1, 2);
  p.update_state = !p.tree && !is_commit(c.op) && d.chance(1, 2);
  const int32_t placed = p.batch - p.padding_rows;
  if (d.chance(1, 5)) p.out_of_range_rows = int32_t(std::min<int64_t>(d.range(1, 2), placed));
  if (p.intermediate && d.chance(1, 6))
    p.out_of_range_cache_rows = int32_t(std::min<int64_t>(1, placed - p.out_of_range_rows));
}

// Prefill lengths: many short ones (0 .. 63, the short-sequence path and partial chunks), some around
// and past the chunk; the long tier adds long sequences and batches of hundreds.
void draw_prefill(Draw& d, RandomCase& c) {
  ProblemConfig& p = c.cfg;
  p.op = OpKind::kPrefill;
  const bool fast = c.tier == Tier::kFast;
  const int shape = int(d.range(0, 9));
  int32_t n = int32_t(d.range(1, 12));
  if (!fast && shape == 9) n = int32_t(d.range(100, 400));
  p.seq_lens.resize(size_t(n));
  for (int32_t& len : p.seq_lens) {
    const int k = int(d.range(0, 19));
    if (k < 2) len = 0;
    else if (k < 14) len = int32_t(d.range(1, 63));
    else if (k < 18) len = d.pick<int32_t>({64, 65, 127, 128, 129, 192});
    else len = int32_t(d.range(130, fast ? 400 : 3000));
  }
  if (!fast && shape >= 7 && shape < 9) p.seq_lens[size_t(d.range(0, n - 1))] = int32_t(d.range(4000, 70000));
  p.cu_seqlens_dtype = d.chance(1, 3) ? DType::kInt64 : DType::kInt32;
  p.pass_cu_seqlens_host = d.chance(3, 4);
  p.same_slot = d.chance(1, 5);
  p.zero_initial_rows = d.chance(1, 3) ? int32_t(d.range(1, n)) : 0;
  p.no_final_rows = d.chance(1, 4) ? int32_t(d.range(1, n)) : 0;
  if (d.chance(1, 3)) {
    p.checkpoint_interval = d.pick<int32_t>({64, 64, 128, 192, 256});
    p.checkpoint_steps = d.chance(2, 3) ? 0 : int32_t(d.range(1, 3));
  }
  p.correlated_keys = d.chance(1, 8);
  if (p.correlated_keys) p.extreme_gates = false;  // b + 3 already sets beta ~ 0.95
  if (d.chance(1, 6)) p.out_of_range_rows = int32_t(std::min<int64_t>(d.range(1, 3), n));
  // Drawn last, so that the draws above name the same case as before the key existed.
  if (d.chance(1, 3)) c.cp_segment = d.pick<int32_t>({64, 128, 192, 256, 448, 1024});
}

void draw_layout(Draw& d, RandomCase& c) {
  ProblemConfig& p = c.cfg;
  p.op = OpKind::kDecode;
  p.batch = int32_t(d.range(1, c.tier == Tier::kFast ? 6 : 40));  // P = 2B + 3 slots
  p.layout_target = true;
  c.in_place = p.K == p.V && d.chance(1, 2);
}

// Shrinks a drawn case until the reference's work and the buffers fit the budgets: token counts first,
// then heads, then dims.
void fit_budget(RandomCase& c, int64_t cost_budget, int64_t byte_budget) {
  ProblemConfig& p = c.cfg;
  for (int guard = 0; guard < 64 && (reference_cost(c) > cost_budget || problem_bytes(c) > byte_budget); ++guard) {
    const bool varlen_step = is_verify_like(c.op) && !p.seq_lens.empty();
    if (c.op == RandomOp::kPrefill && prefill_tokens(p) > 64) {
      for (int32_t& len : p.seq_lens) len /= 2;
    } else if (is_verify_like(c.op) && p.draft_tokens > 4) {
      p.draft_tokens /= 2;
    } else if (c.op != RandomOp::kPrefill && rows_of(p) > 4) {
      p.batch /= 2;
      if (varlen_step) p.seq_lens.resize(size_t(p.batch));
    } else if (p.HV > 1) {
      const int32_t group = p.HV / p.H;  // keeps HV a multiple of H
      if (group > 1) p.HV = p.H * (group / 2);
      else p.H = p.HV = p.H / 2;
    } else if (p.K > 64 || p.V > 64) {
      p.K = std::max(64, p.K / 2), p.V = std::max(64, p.V / 2);
    } else {
      break;
    }
  }
  // Rows and counts that depend on the sizes above.
  const int32_t rows = rows_of(p);
  p.padding_rows = std::min(p.padding_rows, std::max(0, rows - 1));
  if (c.op == RandomOp::kPrefill) {
    p.zero_initial_rows = std::min(p.zero_initial_rows, rows);
    p.no_final_rows = std::min(p.no_final_rows, rows);
    p.out_of_range_rows = std::min(p.out_of_range_rows, rows);
  } else if (is_step(c.op)) {
    p.out_of_range_rows = std::min(p.out_of_range_rows, rows - p.padding_rows);
    p.out_of_range_cache_rows = std::min(p.out_of_range_cache_rows, rows - p.padding_rows - p.out_of_range_rows);
  }
  if (is_verify_like(c.op) && !p.seq_lens.empty())
    for (int32_t& len : p.seq_lens) len = std::min(len, p.draft_tokens);
  c.in_place = c.in_place && p.K == p.V;
}

// ---- describe / parse --------------------------------------------------------------------------

const char* dtype_token(DType d) {
  switch (d) {
    case DType::kFloat32: return "f32";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat16: return "f16";
    case DType::kInt32: return "i32";
    case DType::kInt64: return "i64";
  }
  return "?";
}

DType parse_dtype(const std::string& s) {
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kInt32, DType::kInt64})
    if (s == dtype_token(d)) return d;
  throw std::invalid_argument("random case: unknown dtype '" + s + "'");
}

std::string lens_token(const std::vector<int32_t>& lens) {
  if (lens.empty()) return "-";
  std::string s;
  for (size_t i = 0; i < lens.size(); ++i) s += (i ? "," : "") + std::to_string(lens[i]);
  return s;
}

std::string float_token(double x, int digits) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.*g", digits, x);
  return buf;
}

int64_t to_int(const std::string& key, const std::string& s) {
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || *end != '\0') throw std::invalid_argument("random case: " + key + "='" + s + "' is not an integer");
  return v;
}

}  // namespace

const char* op_name(RandomOp op) {
  switch (op) {
    case RandomOp::kDecode: return "decode";
    case RandomOp::kVerifyChain: return "verify_chain";
    case RandomOp::kVerifyTree: return "verify_tree";
    case RandomOp::kVerifyVarlen: return "verify_varlen";
    case RandomOp::kCommitCache: return "commit_cache";
    case RandomOp::kCommitRecompute: return "commit_recompute";
    case RandomOp::kPrefill: return "prefill";
    case RandomOp::kLayout: return "layout";
  }
  return "?";
}

const char* tier_name(Tier tier) { return tier == Tier::kFast ? "fast" : "long"; }

RandomCase draw_case(uint64_t seed, Tier tier) {
  Draw d(seed);
  RandomCase c;
  c.seed = seed;
  c.tier = tier;
  c.cfg.seed = seed;
  // Weights: the op families by how much of the kernels' space they reach.
  static const RandomOp kOps[] = {RandomOp::kDecode,      RandomOp::kDecode,        RandomOp::kDecode,
                                  RandomOp::kVerifyChain, RandomOp::kVerifyChain,   RandomOp::kVerifyTree,
                                  RandomOp::kVerifyTree,  RandomOp::kVerifyVarlen,  RandomOp::kVerifyVarlen,
                                  RandomOp::kCommitCache, RandomOp::kCommitCache,   RandomOp::kCommitRecompute,
                                  RandomOp::kCommitRecompute, RandomOp::kPrefill,   RandomOp::kPrefill,
                                  RandomOp::kPrefill,     RandomOp::kPrefill,       RandomOp::kPrefill,
                                  RandomOp::kLayout};
  c.op = kOps[d.range(0, int64_t(sizeof kOps / sizeof kOps[0]) - 1)];

  // Heads: MHA, GVA ratios 2..8 (qwen3-next's 16 x 32), an odd group of 3, one head.
  const Heads heads = d.pick<Heads>({{1, 1}, {1, 2}, {2, 2}, {2, 4}, {2, 8}, {4, 4}, {1, 8}, {2, 6}, {4, 16}, {16, 32}});
  c.cfg.H = heads.H, c.cfg.HV = heads.HV;
  draw_common(d, c);
  if (is_step(c.op)) {
    draw_square_dims(d, c.cfg);
  } else {
    c.cfg.K = d.pick<int32_t>({64, 128, 128, 256});
    c.cfg.V = d.chance(1, 2) ? c.cfg.K : d.pick<int32_t>({64, 128, 256});
  }
  switch (c.op) {
    case RandomOp::kDecode: draw_decode(d, c); break;
    case RandomOp::kPrefill: draw_prefill(d, c); break;
    case RandomOp::kLayout: draw_layout(d, c); break;
    default: draw_verify(d, c); break;
  }
  // The long tier's long sequences run with few heads (the reference is single-threaded).
  if (tier == Tier::kLong && c.op == RandomOp::kPrefill && prefill_tokens(c.cfg) > 4000) {
    c.cfg.H = 1, c.cfg.HV = std::min(c.cfg.HV, 2);
  }
  if (tier == Tier::kFast)
    fit_budget(c, kFastTierCostBudget, kFastTierByteBudget);
  else
    fit_budget(c, 64 * kFastTierCostBudget, 16 * kFastTierByteBudget);
  return c;
}

int64_t reference_cost(const RandomCase& c) {
  const ProblemConfig& p = c.cfg;
  const int64_t kv = int64_t(p.HV) * p.K * p.V;
  if (c.op == RandomOp::kLayout) return (2 * int64_t(p.batch) + 3) * kv;
  if (c.op == RandomOp::kPrefill) return (prefill_tokens(p) + int64_t(p.seq_lens.size())) * kv;
  const int64_t tokens = step_tokens(p), rows = rows_of(p);
  int64_t cost = (tokens + rows) * kv;  // the steps, and the initial states the builder draws
  if (p.tree) cost += tokens * kv / 2;  // trees copy the parent's state per token
  if (is_commit(c.op)) cost += tokens * kv;
  return cost;
}

int64_t problem_bytes(const RandomCase& c) {
  const ProblemConfig& p = c.cfg;
  const int64_t in = dtype_size(p.in_dtype), st = dtype_size(p.state_dtype), ca = dtype_size(p.cache_dtype);
  const int64_t tokens = c.op == RandomOp::kPrefill ? prefill_tokens(p) : c.op == RandomOp::kLayout ? 0 : step_tokens(p);
  const int64_t rows = c.op == RandomOp::kLayout ? p.batch : rows_of(p);
  const int64_t slot = int64_t(p.HV) * p.K * p.V + p.slot_pad;
  int64_t bytes = tokens * (2 * (int64_t(p.H) * (p.K + p.head_pad) + p.token_pad) +
                            2 * (int64_t(p.HV) * (p.V + p.head_pad) + p.token_pad)) * in;
  bytes += (p.pool_slots > 0 ? p.pool_slots : 2 * rows + 3) * slot * st * (p.layout_target ? 2 : 1);
  if (c.op != RandomOp::kPrefill && c.op != RandomOp::kDecode && c.op != RandomOp::kLayout && p.intermediate)
    bytes += (rows + 2) * (int64_t(p.draft_tokens) * (slot - p.slot_pad) + p.slot_pad) * ca;
  if (c.op == RandomOp::kPrefill && p.checkpoint_interval > 0) {
    int64_t max_len = 0;
    for (int32_t l : p.seq_lens) max_len = std::max<int64_t>(max_len, l);
    const int64_t steps = p.checkpoint_steps > 0 ? p.checkpoint_steps : std::max<int64_t>(1, max_len / p.checkpoint_interval);
    bytes += (rows + 1) * (steps * (slot - p.slot_pad) + p.slot_pad) * ca;
  }
  return bytes;
}

bool cuda_implements(const RandomCase& c) {
  const ProblemConfig& p = c.cfg;
  if (is_step(c.op) && p.K != p.V) return false;
  if (p.tree && p.draft_tokens > 64) return false;
  return rows_of(p) <= 65535;
}

std::string describe(const RandomCase& c) {
  const ProblemConfig& p = c.cfg;
  std::ostringstream s;
  auto b = [](bool x) { return x ? "1" : "0"; };
  s << "seed=" << c.seed << " tier=" << tier_name(c.tier) << " op=" << op_name(c.op) << " H=" << p.H << " HV=" << p.HV
    << " K=" << p.K << " V=" << p.V << " in=" << dtype_token(p.in_dtype) << " gate=" << dtype_token(p.gate_dtype)
    << " state=" << dtype_token(p.state_dtype) << " cache=" << dtype_token(p.cache_dtype)
    << " layout=" << (p.layout == StateLayout::kKLast ? "klast" : "vlast")
    << " gating=" << (p.gate_mode == GateMode::kFused ? "fused" : "given") << " l2=" << b(p.use_qk_l2norm)
    << " unit_qk=" << b(p.unit_qk) << " scale=" << float_token(p.scale, 9) << " token_pad=" << p.token_pad
    << " head_pad=" << p.head_pad << " slot_pad=" << p.slot_pad << " pool_slots=" << p.pool_slots
    << " batch=" << p.batch << " T=" << p.draft_tokens << " lens=" << lens_token(p.seq_lens)
    << " padding_rows=" << p.padding_rows << " oor_rows=" << p.out_of_range_rows
    << " oor_cache_rows=" << p.out_of_range_cache_rows << " long_memory=" << b(p.long_memory)
    << " corr_keys=" << b(p.correlated_keys) << " extreme_gates=" << b(p.extreme_gates)
    << " state_scale=" << float_token(p.state_scale, 17) << " tree=" << b(p.tree)
    << " intermediate=" << b(p.intermediate) << " update_state=" << b(p.update_state)
    << " cu=" << dtype_token(p.cu_seqlens_dtype) << " cu_host=" << b(p.pass_cu_seqlens_host)
    << " same_slot=" << b(p.same_slot) << " zero_initial=" << p.zero_initial_rows << " no_final=" << p.no_final_rows
    << " ckpt=" << p.checkpoint_interval << " ckpt_steps=" << p.checkpoint_steps
    << " layout_target=" << b(p.layout_target) << " in_place=" << b(c.in_place);
  if (c.cp_segment > 0) s << " cp=" << c.cp_segment;
  return s.str();
}

RandomCase parse_case(const std::string& line) {
  std::map<std::string, std::string> kv;
  std::istringstream in(line);
  for (std::string tok; in >> tok;) {
    const size_t eq = tok.find('=');
    if (eq == std::string::npos || eq == 0) throw std::invalid_argument("random case: '" + tok + "' is not key=value");
    if (!kv.emplace(tok.substr(0, eq), tok.substr(eq + 1)).second)
      throw std::invalid_argument("random case: key " + tok.substr(0, eq) + " given twice");
  }
  auto take = [&](const std::string& key) {
    auto it = kv.find(key);
    if (it == kv.end()) throw std::invalid_argument("random case: missing " + key + "=");
    std::string v = it->second;
    kv.erase(it);
    return v;
  };
  auto int_of = [&](const std::string& key) { return to_int(key, take(key)); };
  auto bool_of = [&](const std::string& key) {
    const std::string v = take(key);
    if (v != "0" && v != "1") throw std::invalid_argument("random case: " + key + "='" + v + "' is not 0 or 1");
    return v == "1";
  };

  RandomCase c;
  ProblemConfig& p = c.cfg;
  const std::string seed = take("seed");
  char* end = nullptr;
  c.seed = std::strtoull(seed.c_str(), &end, 10);
  if (seed.empty() || *end != '\0') throw std::invalid_argument("random case: seed='" + seed + "' is not a number");
  p.seed = c.seed;
  const std::string tier = take("tier");
  if (tier != "fast" && tier != "long") throw std::invalid_argument("random case: unknown tier '" + tier + "'");
  c.tier = tier == "fast" ? Tier::kFast : Tier::kLong;
  const std::string op = take("op");
  bool found = false;
  for (int i = 0; i < kNumRandomOps && !found; ++i)
    if (op == op_name(RandomOp(i))) c.op = RandomOp(i), found = true;
  if (!found) throw std::invalid_argument("random case: unknown op '" + op + "'");
  p.op = c.op == RandomOp::kPrefill ? OpKind::kPrefill
         : is_verify_like(c.op)     ? OpKind::kVerify
                                    : OpKind::kDecode;
  p.H = int32_t(int_of("H")), p.HV = int32_t(int_of("HV")), p.K = int32_t(int_of("K")), p.V = int32_t(int_of("V"));
  p.in_dtype = parse_dtype(take("in"));
  p.gate_dtype = parse_dtype(take("gate"));
  p.state_dtype = parse_dtype(take("state"));
  p.cache_dtype = parse_dtype(take("cache"));
  const std::string layout = take("layout");
  if (layout != "klast" && layout != "vlast") throw std::invalid_argument("random case: unknown layout '" + layout + "'");
  p.layout = layout == "klast" ? StateLayout::kKLast : StateLayout::kVLast;
  const std::string gating = take("gating");
  if (gating != "fused" && gating != "given") throw std::invalid_argument("random case: unknown gating '" + gating + "'");
  p.gate_mode = gating == "fused" ? GateMode::kFused : GateMode::kGiven;
  p.use_qk_l2norm = bool_of("l2");
  p.unit_qk = bool_of("unit_qk");
  p.scale = std::strtof(take("scale").c_str(), nullptr);
  p.token_pad = int32_t(int_of("token_pad"));
  p.head_pad = int32_t(int_of("head_pad"));
  p.slot_pad = int_of("slot_pad");
  p.pool_slots = int32_t(int_of("pool_slots"));
  p.batch = int32_t(int_of("batch"));
  p.draft_tokens = int32_t(int_of("T"));
  const std::string lens = take("lens");
  if (lens != "-") {
    std::istringstream ls(lens);
    for (std::string x; std::getline(ls, x, ',');) p.seq_lens.push_back(int32_t(to_int("lens", x)));
  }
  p.padding_rows = int32_t(int_of("padding_rows"));
  p.out_of_range_rows = int32_t(int_of("oor_rows"));
  p.out_of_range_cache_rows = int32_t(int_of("oor_cache_rows"));
  p.long_memory = bool_of("long_memory");
  p.correlated_keys = bool_of("corr_keys");
  p.extreme_gates = bool_of("extreme_gates");
  p.state_scale = std::strtod(take("state_scale").c_str(), nullptr);
  p.tree = bool_of("tree");
  p.intermediate = bool_of("intermediate");
  p.update_state = bool_of("update_state");
  p.cu_seqlens_dtype = parse_dtype(take("cu"));
  p.pass_cu_seqlens_host = bool_of("cu_host");
  p.same_slot = bool_of("same_slot");
  p.zero_initial_rows = int32_t(int_of("zero_initial"));
  p.no_final_rows = int32_t(int_of("no_final"));
  p.checkpoint_interval = int32_t(int_of("ckpt"));
  p.checkpoint_steps = int32_t(int_of("ckpt_steps"));
  p.layout_target = bool_of("layout_target");
  c.in_place = bool_of("in_place");
  if (kv.count("cp")) c.cp_segment = int32_t(int_of("cp"));
  if (!kv.empty()) throw std::invalid_argument("random case: unknown key " + kv.begin()->first + "=");
  return c;
}

Problem build_problem(const RandomCase& c) {
  Problem p(c.cfg);
  if (c.op == RandomOp::kLayout) p.fill_every_slot(c.seed);
  return p;
}

CommitSource commit_source(const RandomCase& c) {
  return c.op == RandomOp::kCommitCache ? CommitSource::kCache : CommitSource::kRecompute;
}

void validate_case(const RandomCase& c, Problem& p, Backend backend) {
  switch (c.op) {
    case RandomOp::kDecode: return validate(p.decode_params(), backend);
    case RandomOp::kPrefill: return validate(p.prefill_params(), backend);
    case RandomOp::kLayout: return validate(p.layout_params(c.in_place), backend);
    default:
      validate(p.verify_params(), backend);
      if (is_commit(c.op)) validate(p.commit_params(commit_source(c)), backend);
  }
}

void run_case(const RandomCase& c, Problem& p, const Context& ctx, const Resolver& resolver, PrefillAlgorithm algo) {
  switch (c.op) {
    case RandomOp::kDecode: return decode(p.decode_params(resolver), ctx);
    case RandomOp::kPrefill: return prefill(p.prefill_params(algo, resolver), ctx);
    case RandomOp::kLayout: return convert_layout(p.layout_params(c.in_place, resolver), ctx);
    default:
      verify(p.verify_params(resolver), ctx);
      if (is_commit(c.op)) commit(p.commit_params(commit_source(c), resolver), ctx);
  }
}

}  // namespace gdnkit::test
