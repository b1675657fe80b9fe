// gdnkit bench: sweeps, byte/FLOP models and the JSON / Markdown output (both backends).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "bench.h"

namespace gdnkit::bench {

const std::vector<Shape>& known_shapes() {
  static const std::vector<Shape> shapes = {
      {"qwen3-next", 16, 32, 128, 128},
      {"qwen3.5-397b-tp8", 2, 8, 128, 128},
      {"qwen3.5-27b", 16, 48, 128, 128},
      {"qwen3.5-397b", 16, 64, 128, 128},
  };
  return shapes;
}

const Shape* find_shape(const std::string& name) {
  for (const Shape& s : known_shapes())
    if (s.name == name) return &s;
  return nullptr;
}

int64_t SeqSet::total() const {
  int64_t t = 0;
  for (int64_t l : lengths) t += l;
  return t;
}

SeqSet parse_seqset(const std::string& text) {
  auto bad = [&](const std::string& why) {
    return Error(ErrorCode::kInvalidArgument,
                 "--seqs: '" + text + "': " + why +
                     " (expected NxL such as 8192x4, A+B such as 1024+7168, or both such as 64x100+6144)");
  };
  auto number = [&](const std::string& s) -> int64_t {
    if (s.empty() || s.find_first_not_of("0123456789") != std::string::npos || s.size() > 12)
      throw bad("'" + s + "' is not a count");
    return std::stoll(s);
  };
  SeqSet set{text, {}};
  if (!text.empty() && text.back() == '+') throw bad("a '+' ends it");
  std::stringstream ss(text);
  std::string part;
  while (std::getline(ss, part, '+')) {  // terms L or NxL, in order
    const size_t x = part.find('x');
    if (set.lengths.size() >= size_t(1) << 20) throw bad("more than 1048576 sequences");
    if (x == std::string::npos) {
      set.lengths.push_back(number(part));
      continue;
    }
    const int64_t n = number(part.substr(0, x)), len = number(part.substr(x + 1));
    if (n <= 0 || n > (1 << 20)) throw bad("N must be in 1..1048576");
    if (set.lengths.size() + size_t(n) > size_t(1) << 20) throw bad("more than 1048576 sequences");
    set.lengths.insert(set.lengths.end(), size_t(n), len);
  }
  if (set.lengths.empty() || set.total() <= 0) throw bad("no tokens");
  return set;
}

const char* verify_mode_name(VerifyMode mode) {
  switch (mode) {
    case VerifyMode::kCache: return "cache";
    case VerifyMode::kCommitRecompute: return "commit-recompute";
    case VerifyMode::kCommitCache: return "commit-cache";
  }
  return "unknown-mode";
}

// ---- sweeps ------------------------------------------------------------------------------------

std::vector<Shape> with_dim(const Options& o, std::vector<Shape> shapes) {
  if (o.dim > 0) {
    for (Shape& s : shapes) {
      s.K = s.V = o.dim;
      s.name += "-d" + std::to_string(o.dim);
    }
  }
  return shapes;
}

std::vector<Shape> shapes_for(const Options& o, const std::string& op) {
  if (!o.shapes.empty()) return with_dim(o, o.shapes);
  if (op == "prefill-split") return with_dim(o, {*find_shape("qwen3-next"), *find_shape("qwen3.5-397b-tp8")});
  if (op == "prefill" && !o.quick)
    return with_dim(o, {*find_shape("qwen3-next"), *find_shape("qwen3.5-397b-tp8"), *find_shape("qwen3.5-27b"),
                        *find_shape("qwen3.5-397b")});
  return with_dim(o, {*find_shape("qwen3-next")});
}

std::vector<DType> states_for(const Options& o, const std::string& op) {
  if (!o.states.empty()) return o.states;
  // Decode is the state-bandwidth op: every pool dtype by default. Verify and prefill default to fp32
  // (the serving default for Qwen3-Next); --state sweeps them too.
  if (op == "decode") return {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  return {DType::kFloat32};
}

std::vector<StateLayout> layouts_for(const Options& o, const std::string& op) {
  if (!o.layouts.empty()) return o.layouts;
  if (op == "decode") return {StateLayout::kKLast, StateLayout::kVLast};
  return {StateLayout::kKLast};
}

std::vector<int32_t> batches_for(const Options& o, const std::string& op) {
  if (!o.batches.empty()) return o.batches;
  if (op == "decode") {
    if (o.quick) return {1, 8, 64, 256};
    return {1, 2, 4, 8, 16, 32, 64, 128, 256, 512};
  }
  if (o.quick) return {1, 32, 256};
  return {1, 8, 32, 64, 128, 256};
}

std::vector<int32_t> drafts_for(const Options& o) {
  if (!o.drafts.empty()) return o.drafts;
  if (o.quick) return {2, 4};
  return {2, 3, 4, 8};
}

std::vector<SeqSet> seqsets_for(const Options& o, const std::string& op) {
  if (!o.seqsets.empty()) return o.seqsets;
  if (op == "prefill-split") {  // one long prompt, where spreading it over GPUs pays
    std::vector<SeqSet> sets;
    for (const char* n : o.quick ? std::vector<const char*>{"1x65536"} : std::vector<const char*>{"1x262144", "1x1048576"})
      sets.push_back(parse_seqset(n));
    return sets;
  }
  // The twelve standard sets (docs/benchmarks.md) (NxL = N sequences of L tokens), then the four NxL sets with
  // N and L swapped (4x2048 = four sequences of 2048 tokens...): peers write "1024 x 8" for eight sequences of
  // 1024, so both readings are measured and each row names its set unambiguously.
  std::vector<std::string> names = {"1x2048", "1x8192", "1x32768", "1x65536", "1x131072", "1x262144", "4096+4096",
                                    "1024+7168", "2048x4", "1024x8", "8192x8", "8192x32", "4x2048", "8x1024",
                                    "8x8192", "32x8192"};
  if (o.quick) names = {"1x8192", "4096+4096", "8192x8"};
  std::vector<SeqSet> sets;
  for (const auto& n : names) sets.push_back(parse_seqset(n));
  return sets;
}

std::vector<VerifyMode> verify_modes() {
  return {VerifyMode::kCache, VerifyMode::kCommitRecompute, VerifyMode::kCommitCache};
}

// ---- problem views ---------------------------------------------------------------------------

bool g_qk_l2norm = true;

HeadConfig head_config(const Shape& s) {
  HeadConfig h;
  h.num_qk_heads = s.H;
  h.num_v_heads = s.HV;
  h.head_dim_k = s.K;
  h.head_dim_v = s.V;
  h.scale = 0.0f;  // 1/sqrt(K)
  h.use_qk_l2norm = g_qk_l2norm;
  return h;
}

void set_token_views(const Shape& s, DType in, const TokenBuffers& t, int64_t first, InView& q, InView& k, InView& v,
                     OutView& o, Gating& g) {
  const int64_t ib = dtype_size(in);
  auto at = [&](void* base, int64_t row_elems) {
    return static_cast<void*>(static_cast<char*>(base) + first * row_elems * ib);
  };
  const int64_t qk_row = int64_t(s.H) * s.K, v_row = int64_t(s.HV) * s.V;
  q = {at(t.q, qk_row), in, qk_row, s.K};
  k = {at(t.k, qk_row), in, qk_row, s.K};
  v = {at(t.v, v_row), in, v_row, s.V};
  o = {at(t.o, v_row), in, v_row, s.V};
  g = Gating{};
  g.mode = GateMode::kFused;
  g.a = {at(t.a, s.HV), in, s.HV, 1};
  g.b = {at(t.b, s.HV), in, s.HV, 1};
  g.A_log = t.A_log;
  g.dt_bias = t.dt_bias;
}

DType verify_cache_dtype(DType state) { return state == DType::kFloat8E4M3 ? state : DType::kFloat32; }

double state_elem_bytes(DType state) {
  return dtype_size(state) + (state == DType::kFloat8E4M3 ? 1.0 / kFp8Block : 0.0);
}

StatePool make_pool(const Shape& s, void* data, DType dtype, StateLayout layout, int64_t slots, uint8_t* scales) {
  StatePool p;
  p.data = data;
  p.scales = scales;
  p.dtype = dtype;
  p.layout = layout;
  p.num_slots = slots;
  p.slot_stride = int64_t(s.HV) * s.K * s.V;
  return p;
}

// ---- models ------------------------------------------------------------------------------------

namespace {
double slot_elems(const Shape& s) { return double(s.HV) * s.K * s.V; }
// q, k [H, K], v, o [HV, V], gates a, b [HV] (input dtype), per token.
double token_bytes(const Shape& s, DType in) {
  const double ib = dtype_size(in);
  return (2.0 * s.H * s.K + 2.0 * s.HV * s.V + 2.0 * s.HV) * ib;
}
double gate_param_bytes(const Shape& s) { return 2.0 * s.HV * 4; }  // A_log, dt_bias fp32
}  // namespace

double decode_bytes(const Shape& s, int32_t B, DType in, DType state) {
  const double sb = state_elem_bytes(state);
  return 2.0 * B * slot_elems(s) * sb + B * token_bytes(s, in) + 4.0 * B + gate_param_bytes(s);
}

double verify_bytes(const Shape& s, int32_t B, int32_t T, DType in, DType state, VerifyMode mode,
                    int64_t accepted_total) {
  const double sb = state_elem_bytes(state), ib = dtype_size(in);
  const double cb = state_elem_bytes(verify_cache_dtype(state));
  const double slot = slot_elems(s);
  // verify: the pool state is read once per sequence, every token's q, k, v, gates read and o written.
  double bytes = B * slot * sb + double(B) * T * token_bytes(s, in) + 4.0 * B + gate_param_bytes(s);
  if (mode != VerifyMode::kCommitRecompute) bytes += double(B) * T * slot * cb + 4.0 * B;  // the cache written
  if (mode == VerifyMode::kCommitRecompute) {
    // commit by recompute: pool read + written, and k, v, gates of the kept tokens only.
    bytes += 2.0 * B * slot * sb + double(accepted_total) * (s.H * s.K + s.HV * s.V + 2.0 * s.HV) * ib +
             8.0 * B + gate_param_bytes(s);
  } else if (mode == VerifyMode::kCommitCache) {
    // commit from the cache: one cached state read, the pool slot written (every accepted >= 1).
    bytes += B * slot * cb + B * slot * sb + 12.0 * B;
  }
  return bytes;
}

double prefill_floor_bytes(const Shape& s, const SeqSet& set, DType in, DType state) {
  const double n = double(set.lengths.size());
  return double(set.total()) * token_bytes(s, in) + 2.0 * n * slot_elems(s) * state_elem_bytes(state) +
         4.0 * (n + 1) + 8.0 * n + gate_param_bytes(s);
}

int64_t checkpoint_steps(const SeqSet& set, int64_t C) {
  int64_t longest = 0;
  for (int64_t L : set.lengths) longest = std::max(longest, L);
  return C > 0 ? longest / C : 0;
}

double checkpoint_bytes(const Shape& s, const SeqSet& set, DType state, int64_t C) {
  double entries = 0;
  for (int64_t L : set.lengths) entries += C > 0 ? double(L / C) : 0.0;
  return entries * slot_elems(s) * state_elem_bytes(state);
}

StateCache make_checkpoints(const Shape& s, void* data, DType dtype, StateLayout layout, int64_t slots, int64_t steps,
                            uint8_t* scales) {
  StateCache c;
  c.data = data;
  c.dtype = dtype;
  c.layout = layout;
  c.num_slots = slots;
  c.num_steps = steps;
  c.slot_stride = steps * int64_t(s.HV) * s.K * s.V;
  c.scales = scales;
  return c;
}

double prefill_flops(const Shape& s, int64_t total_tokens) {
  return 4.0 * double(total_tokens) * s.HV * s.K * s.V;
}

Row make_row(const std::string& backend, const std::string& op, const Shape& s, DType input, DType state,
             StateLayout layout) {
  Row r;
  r.op = op;
  r.backend = backend;
  r.shape = s;
  r.input_dtype = input;
  r.state_dtype = state;
  r.layout = layout;
  return r;
}

Row make_prefill_row(const std::string& backend, const Shape& s, DType input, DType state, StateLayout layout,
                     const SeqSet& set, int64_t C) {
  Row r = make_row(backend, "prefill", s, input, state, layout);
  r.seqset = set.name;
  r.num_seqs = int32_t(set.lengths.size());
  r.total_tokens = set.total();
  r.flops = prefill_flops(s, r.total_tokens);
  r.floor_bytes = prefill_floor_bytes(s, set, input, state) + checkpoint_bytes(s, set, state, C);
  r.checkpoint_interval = C;
  return r;
}

void finish_row(Row& r, double ceiling) {
  if (r.time_us <= 0) return;
  const double sec = r.time_us * 1e-6;
  if (r.bytes > 0) {
    r.tbps = r.bytes / sec / 1e12;
    if (ceiling > 0) r.pct_copy = 100.0 * r.tbps / ceiling;
  }
  if (r.flops > 0) r.tflops = r.flops / sec / 1e12;
  if (r.floor_bytes > 0 && ceiling > 0) {
    r.floor_us = r.floor_bytes / (ceiling * 1e12) * 1e6;
    r.pct_floor = 100.0 * r.floor_us / r.time_us;
  }
}

double median(std::vector<double> v) {
  if (v.empty()) return -1;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// ---- JSON --------------------------------------------------------------------------------------

namespace {

std::string json_str(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += char(c);
        }
    }
  }
  return out + "\"";
}

// Negative sentinels mean "does not apply / not measured": null.
std::string json_num(double x) {
  if (!std::isfinite(x) || x < 0) return "null";
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.10g", x);
  return buf;
}
std::string json_int(int64_t x, bool zero_is_null = false) {
  if (x < 0 || (zero_is_null && x == 0)) return "null";
  return std::to_string(x);
}

class Obj {
 public:
  explicit Obj(int indent) : pad_(size_t(indent), ' ') {}
  Obj& raw(const std::string& key, const std::string& value) {
    s_ += (first_ ? "" : ",\n") + pad_ + "  " + json_str(key) + ": " + value;
    first_ = false;
    return *this;
  }
  Obj& str(const std::string& key, const std::string& v) { return raw(key, v.empty() ? "null" : json_str(v)); }
  Obj& num(const std::string& key, double v) { return raw(key, json_num(v)); }
  Obj& integer(const std::string& key, int64_t v, bool zero_is_null = false) {
    return raw(key, json_int(v, zero_is_null));
  }
  std::string done() const { return "{\n" + s_ + "\n" + pad_ + "}"; }

 private:
  std::string pad_, s_;
  bool first_ = true;
};

std::string row_json(const Row& r) {
  const bool tok = r.op != "prefill" && r.op != "prefill-split";
  Obj o(4);
  o.str("op", r.op).str("mode", r.mode).str("backend", r.backend).str("status", r.status).str("message", r.message);
  o.str("shape", r.shape.name).integer("H", r.shape.H).integer("HV", r.shape.HV).integer("K", r.shape.K)
      .integer("V", r.shape.V);
  o.str("input_dtype", dtype_name(r.input_dtype)).str("state_dtype", dtype_name(r.state_dtype))
      .str("layout", r.layout == StateLayout::kKLast ? "k-last" : "v-last");
  o.integer("batch", tok ? r.batch : -1).integer("draft_tokens", r.draft_tokens, true).str("seqs", r.seqset)
      .integer("num_seqs", r.num_seqs, true).integer("total_tokens", r.total_tokens)
      .num("accepted_mean", r.accepted_mean);
  o.num("time_us", r.time_us).num("time_us_min", r.time_us_min).num("time_us_max", r.time_us_max)
      .integer("samples", r.samples, true).integer("calls_per_replay", r.calls_per_replay, true)
      .integer("slot_sets", r.slot_sets, true).integer("pool_slots", r.pool_slots, true)
      .num("state_bytes_per_replay", r.state_bytes_per_replay);
  o.num("bytes", r.bytes).num("tbps", r.tbps).num("pct_copy_ceiling", r.pct_copy);
  o.num("flops", r.flops).num("tflops", r.tflops).num("floor_bytes", r.floor_bytes).num("floor_us", r.floor_us)
      .num("pct_memory_floor", r.pct_floor);
  o.integer("ranks", r.ranks, true).num("efficiency", r.efficiency).num("exchange_us", r.exchange_us);
  o.integer("checkpoint_interval", r.checkpoint_interval, true);
  o.integer("nonfinite_outputs", r.nonfinite_outputs).integer("error_flag", r.error_flag);
  return o.done();
}

}  // namespace

std::string to_json(const RunInfo& info, const std::vector<Row>& rows) {
  Obj top(0);
  top.str("tool", "gdnkit bench").str("command", info.command).str("backend", info.backend).str("note", info.note);
  Obj dev(2);
  dev.str("name", info.device).integer("sms", info.sms, true).integer("l2_bytes", info.l2_bytes, true)
      .integer("memory_bytes", info.memory_bytes, true).str("sm_clock_mhz_start", info.sm_clock_start)
      .str("sm_clock_mhz_end", info.sm_clock_end).str("sm_clock_mhz_max", info.sm_clock_max);
  top.raw("device", dev.done());
  top.str("build_info", info.build_info);
  Obj ceil(2);
  ceil.num("tbps", info.copy_ceiling_tbps)
      .str("method", info.backend == "cuda"
                         ? "cudaMemcpyAsync device-to-device of " + json_num(info.copy_ceiling_gib) +
                               " GiB, bytes read + written / median time of 10"
                         : "host memcpy, bytes read + written / median time");
  top.raw("copy_ceiling", ceil.done());
  if (info.launch_floor_us >= 0) {
    Obj lf(2);
    lf.num("us", info.launch_floor_us)
        .str("method", "an empty kernel (griddepcontrol.wait, launch_dependents) of " +
                           std::to_string(info.launch_floor_ctas) +
                           " CTAs x 64 threads with programmatic dependent launch, back to back in one CUDA "
                           "graph; median µs per call");
    top.raw("launch_floor", lf.done());
  }
  top.str("method",
          info.backend == "cpu" ? "CPU reference backend on small shapes with host buffers: steady_clock around "
                                  "repeated calls, median of 7 samples; bytes model per docs/benchmarks.md" :
          "decode/verify: pool-indexed in place, slots a random permutation, calls rotate through slot sets so "
          "one replay reads >= 4x L2 of state, CUDA-graph replays timed with events, median per call; "
          "prefill: events around the op, 2 warm-up runs, median; bytes model per docs/benchmarks.md");
  top.num("wall_seconds", info.wall_seconds);
  std::string rs = "[";
  for (size_t i = 0; i < rows.size(); ++i) rs += (i ? ",\n    " : "\n    ") + row_json(rows[i]);
  rs += rows.empty() ? "]" : "\n  ]";
  top.raw("rows", rs);
  return top.done() + "\n";
}

// ---- Markdown ----------------------------------------------------------------------------------

namespace {

std::string fmt(double x, const char* f) {
  if (x < 0 || !std::isfinite(x)) return "—";
  char buf[40];
  std::snprintf(buf, sizeof buf, f, x);
  return buf;
}

const char* short_dtype(DType d) {
  return d == DType::kFloat32 ? "fp32" : d == DType::kBFloat16 ? "bf16" : d == DType::kFloat16 ? "fp16" : "fp8";
}
const char* short_layout(StateLayout l) { return l == StateLayout::kKLast ? "K-last" : "V-last"; }

std::string status_cell(const Row& r) {
  if (r.status == "ok") {
    if (r.nonfinite_outputs > 0) return "ok, " + std::to_string(r.nonfinite_outputs) + " non-finite outputs!";
    if (r.error_flag > 0) return "ok, error flag " + std::to_string(r.error_flag) + "!";
    return "ok";
  }
  return r.status + (r.message.empty() ? "" : ": " + r.message);
}

std::string table(const std::vector<Row>& rows, const std::string& op) {
  std::string s;
  const bool cpu = !rows.empty() && rows.front().backend == "cpu";
  const char* bw = cpu ? "GB/s" : "TB/s";
  const double bw_scale = cpu ? 1e3 : 1.0;
  if (op == "decode") {
    s += std::string("| shape | state | layout | B | µs/call | MB/call | ") + bw + " | % copy | status |\n";
    s += "|---|---|---|--:|--:|--:|--:|--:|---|\n";
  } else if (op == "verify") {
    s += std::string("| shape | mode | state | layout | T | B | µs/call | MB/call | ") + bw + " | % copy | status |\n";
    s += "|---|---|---|---|--:|--:|--:|--:|--:|--:|---|\n";
  } else if (op == "prefill-split") {
    s += "| shape | seqs | tokens | GPUs | path | ms | TFLOP/s | efficiency | exchange ms | exchange share | status |\n";
    s += "|---|---|--:|--:|---|--:|--:|--:|--:|--:|---|\n";
  } else {
    s += std::string("| shape | mode | seqs | tokens | state | layout | ms | ") + (cpu ? "GFLOP/s" : "TFLOP/s") +
         " | floor ms | floor/time | status |\n";
    s += "|---|---|---|--:|---|---|--:|--:|--:|--:|---|\n";
  }
  for (const Row& r : rows) {
    if (r.op != op) continue;
    const std::string st = short_dtype(r.state_dtype), ly = short_layout(r.layout);
    const double tb = r.tbps > 0 ? r.tbps * bw_scale : -1;
    if (op == "decode") {
      s += "| " + r.shape.name + " | " + st + " | " + ly + " | " + std::to_string(r.batch) + " | " +
           fmt(r.time_us, "%.2f") + " | " + fmt(r.bytes / 1e6, "%.2f") + " | " + fmt(tb, "%.3f") + " | " +
           fmt(r.pct_copy, "%.1f") + " | " + status_cell(r) + " |\n";
    } else if (op == "verify") {
      s += "| " + r.shape.name + " | " + r.mode + " | " + st + " | " + ly + " | " + std::to_string(r.draft_tokens) +
           " | " + std::to_string(r.batch) + " | " + fmt(r.time_us, "%.2f") + " | " + fmt(r.bytes / 1e6, "%.2f") +
           " | " + fmt(tb, "%.3f") + " | " + fmt(r.pct_copy, "%.1f") + " | " + status_cell(r) + " |\n";
    } else if (op == "prefill-split") {
      const double share = r.exchange_us > 0 && r.time_us > 0 ? 100.0 * r.exchange_us / r.time_us : -1;
      s += "| " + r.shape.name + " | " + r.seqset + " | " + std::to_string(r.total_tokens) + " | " +
           std::to_string(r.ranks) + " | " + r.mode + " | " + fmt(r.time_us / 1e3, "%.3f") + " | " +
           fmt(r.tflops, "%.2f") + " | " + fmt(r.efficiency, "%.2f") + " | " + fmt(r.exchange_us / 1e3, "%.3f") +
           " | " + fmt(share, "%.1f%%") + " | " + status_cell(r) + " |\n";
    } else {
      s += "| " + r.shape.name + " | " + (r.mode.empty() ? "chunked" : r.mode) + " | " + r.seqset + " | " +
           std::to_string(r.total_tokens) + " | " + st + " | " + ly + " | " + fmt(r.time_us / 1e3, "%.3f") + " | " +
           fmt(r.tflops > 0 ? r.tflops * bw_scale : -1, "%.2f") + " | " + fmt(r.floor_us / 1e3, "%.3f") + " | " + fmt(r.pct_floor, "%.1f%%") +
           " | " + status_cell(r) + " |\n";
    }
  }
  return s;
}

}  // namespace

std::string to_markdown(const RunInfo& info, const std::vector<Row>& rows) {
  const std::string normalized = "q and k normalized before the runs (the ops' L2 norm off)";
  std::string s = "## gdnkit bench: " + info.device + " (" + info.backend + " backend)\n\n";
  if (!info.note.empty()) s += info.note + "\n\n";
  s += "- copy ceiling: " + fmt(info.backend == "cpu" ? info.copy_ceiling_tbps * 1e3 : info.copy_ceiling_tbps, "%.3f") +
       (info.backend == "cpu" ? " GB/s (host memcpy" : " TB/s (device-to-device copy of 1 GiB") +
       ", bytes read + written)\n";
  if (info.launch_floor_us >= 0)
    s += "- launch floor: " + fmt(info.launch_floor_us, "%.2f") + " µs per call (an empty kernel of " +
         std::to_string(info.launch_floor_ctas) +
         " CTAs launched as decode is, back to back in a CUDA graph): no decode/verify call goes below it\n";
  if (info.backend == "cuda") {
    s += "- " + std::to_string(info.sms) + " SMs, L2 " + std::to_string(info.l2_bytes >> 20) + " MiB";
    if (!info.sm_clock_start.empty())
      s += ", SM clock " + info.sm_clock_start + " MHz after the copy-ceiling run" +
           (info.sm_clock_end.empty() ? "" : ", " + info.sm_clock_end + " MHz after the last row") + " (max " +
           info.sm_clock_max + ")";
    s += "\n";
    s += "- decode/verify: µs per call, median of CUDA-graph replays, cold L2 (calls rotate through slot sets, "
         ">= 4x L2 of state per replay); bytes = state read + written (+ fp32 intermediates) + q, k, v, o, "
         "gates; inputs " + std::string(rows.empty() ? "bf16" : short_dtype(rows.front().input_dtype)) +
         (g_qk_l2norm ? "" : ", " + normalized) + "\n";
    s += "- prefill: ms per op (events around it, median of runs after warm-up), fused gating" +
         std::string(g_qk_l2norm ? " + q/k L2 norm" : ", q/k taken as normalized (no L2 norm)") + ", "
         "initial state from the pool and final state written; TFLOP/s = 4 T HV K V / time; floor = "
         "(q, k, v, o, gates, states) / copy ceiling\n";
  }
  if (!g_qk_l2norm && info.backend != "cuda") s += "- " + normalized + "\n";
  s += "\n";
  if (std::any_of(rows.begin(), rows.end(), [](const Row& r) { return r.op == "prefill-split"; }))
    s += "- prefill-split: one sequence set over G GPUs of the machine (split_prefill_nccl, a thread and an NCCL rank "
         "per GPU, each rank a contiguous piece of every sequence); ms per call of the slowest rank; efficiency = "
         "time on 1 GPU (the prefill row of the same run) / (G x time); exchange = the all-gather of the summaries "
         "on the rank that reaches it last\n";
  for (const char* op : {"decode", "verify", "prefill", "prefill-split"}) {
    if (std::none_of(rows.begin(), rows.end(), [&](const Row& r) { return r.op == op; })) continue;
    s += std::string("### ") + op + "\n\n" + table(rows, op) + "\n";
  }
  return s;
}

namespace {
std::string clock_time(double seconds) {
  const long s = seconds > 0 ? long(seconds + 0.5) : 0;
  char buf[32];
  if (s >= 3600) std::snprintf(buf, sizeof buf, "%ld:%02ld:%02ld", s / 3600, s / 60 % 60, s % 60);
  else std::snprintf(buf, sizeof buf, "%ld:%02ld", s / 60, s % 60);
  return buf;
}
}  // namespace

std::string progress_prefix(size_t done, size_t total, double elapsed) {
  std::string s = "row " + std::to_string(done) + "/" + std::to_string(total) + ", " + clock_time(elapsed) + " elapsed";
  // The mean time per row so far times the rows left: rough (rows of one sweep differ in cost), but it
  // says whether a run takes minutes or hours.
  if (done > 0 && done < total) s += ", about " + clock_time(elapsed / double(done) * double(total - done)) + " left";
  return s;
}

std::string progress_line(const Row& r) {
  char buf[256];
  std::string what;
  if (r.op == "decode") {
    what = "B=" + std::to_string(r.batch);
  } else if (r.op == "verify") {
    what = r.mode + " T=" + std::to_string(r.draft_tokens) + " B=" + std::to_string(r.batch);
  } else {
    what = (r.mode.empty() ? "" : r.mode + " ") + r.seqset;
  }
  std::snprintf(buf, sizeof buf, "[%s %s %s %s] %s", r.op.c_str(), r.shape.name.c_str(), short_dtype(r.state_dtype),
                short_layout(r.layout), what.c_str());
  std::string s = buf;
  if (r.status != "ok") return s + ": " + status_cell(r);
  // CPU rows in G units (their T-unit values round to 0).
  const bool cpu = r.backend == "cpu";
  const double scale = cpu ? 1e3 : 1.0;
  const char* g = cpu ? "G" : "T";
  if (r.op == "prefill") {
    std::snprintf(buf, sizeof buf, ": %.3f ms, %.2f %sFLOP/s, floor %.1f%%", r.time_us / 1e3, r.tflops * scale, g,
                  r.pct_floor);
  } else if (r.op == "prefill-split" && r.ranks > 1) {
    std::snprintf(buf, sizeof buf, ": %.3f ms, efficiency %.2f, exchange %.3f ms", r.time_us / 1e3, r.efficiency,
                  r.exchange_us / 1e3);
  } else if (r.op == "prefill-split") {
    std::snprintf(buf, sizeof buf, ": %.3f ms", r.time_us / 1e3);
  } else {
    std::snprintf(buf, sizeof buf, ": %.2f us/call, %.3f %sB/s, %.1f%% of copy", r.time_us, r.tbps * scale, g,
                  r.pct_copy);
  }
  s += buf;
  if (r.nonfinite_outputs > 0 || r.error_flag > 0) s += "  (" + status_cell(r) + ")";
  return s;
}

}  // namespace gdnkit::bench
