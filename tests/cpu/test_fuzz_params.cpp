// Bad-input fuzzing of the public entries (docs/semantics.md "Bad input"): valid params of every op, then
// seeded random mutations, one or a few at a time. Every mutated call either succeeds or throws
// gdnkit::Error(kInvalidArgument) whose message names the mutated field, with every buffer bit-identical to
// before; validate(p, Backend::kCUDA) (host checks, no GPU needed) follows the same rule. A failure prints
// one line: seed, base problem, mutations. Also: the important single mutations as a readable list, and
// what NaN/Inf inputs do ("Non-finite inputs").
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <variant>
#include <vector>

#include "gdnkit/gdnkit.h"
#include "gdnkit/host_dtype.h"
#include "support/compare.h"
#include "support/naive.h"
#include "support/problem.h"

namespace gdnkit {
namespace {

using test::NaiveModel;
using test::OpKind;
using test::Problem;
using test::RelClose;
using test::ProblemConfig;

// ---- base problems ------------------------------------------------------------------------------

enum class Op { kDecode, kVerify, kCommit, kPrefill, kLayout };

struct Base {
  std::string name;
  Op op = Op::kDecode;
  ProblemConfig cfg;
  CommitSource source = CommitSource::kCache;
  PrefillAlgorithm algo = PrefillAlgorithm::kAuto;
  bool in_place = false;
};

std::vector<Base> bases() {
  std::vector<Base> out;
  auto add = [&](std::string name, Op op, auto edit) {
    Base b;
    b.name = std::move(name);
    b.op = op;
    b.cfg.op = op == Op::kDecode || op == Op::kLayout ? OpKind::kDecode
               : op == Op::kPrefill                  ? OpKind::kPrefill
                                                     : OpKind::kVerify;
    b.cfg.seed = 11 + out.size();
    edit(b);
    out.push_back(b);
  };
  add("decode_bf16_fused", Op::kDecode, [](Base& b) { b.cfg.batch = 3; });
  add("decode_fp32_given_vlast_padded", Op::kDecode, [](Base& b) {
    b.cfg.in_dtype = DType::kFloat32;
    b.cfg.gate_mode = GateMode::kGiven;
    b.cfg.gate_dtype = DType::kBFloat16;
    b.cfg.layout = StateLayout::kVLast;
    b.cfg.state_dtype = DType::kBFloat16;
    b.cfg.token_pad = 3;
    b.cfg.head_pad = 2;
    b.cfg.slot_pad = 5;
    b.cfg.padding_rows = 1;
  });
  add("decode_fp16_k64_v128", Op::kDecode, [](Base& b) {
    b.cfg.in_dtype = DType::kFloat16;
    b.cfg.H = 1;
    b.cfg.HV = 2;
    b.cfg.V = 128;
  });
  add("verify_chain_update", Op::kVerify, [](Base& b) {
    b.cfg.draft_tokens = 3;
    b.cfg.update_state = true;
  });
  add("verify_tree_cache", Op::kVerify, [](Base& b) { b.cfg.tree = true; });
  add("verify_varlen_nocache", Op::kVerify, [](Base& b) {
    b.cfg.seq_lens = {3, 0, 2};
    b.cfg.intermediate = false;
    b.cfg.gate_mode = GateMode::kGiven;
  });
  add("commit_chain_cache", Op::kCommit, [](Base& b) { b.cfg.draft_tokens = 3; });
  add("commit_tree_recompute", Op::kCommit, [](Base& b) {
    b.cfg.tree = true;
    b.source = CommitSource::kRecompute;
  });
  add("commit_varlen_cache_bf16", Op::kCommit, [](Base& b) {
    b.cfg.seq_lens = {4, 1, 0};
    b.cfg.cache_dtype = DType::kBFloat16;
    b.cfg.layout = StateLayout::kVLast;
  });
  add("prefill_int32_host_ckpt", Op::kPrefill, [](Base& b) {
    b.cfg.seq_lens = {70, 5, 0, 20};
    b.cfg.checkpoint_interval = 64;
    b.cfg.zero_initial_rows = 1;
  });
  add("prefill_int64_nohost_given", Op::kPrefill, [](Base& b) {
    b.cfg.seq_lens = {3, 9};
    b.cfg.cu_seqlens_dtype = DType::kInt64;
    b.cfg.pass_cu_seqlens_host = false;
    b.cfg.gate_mode = GateMode::kGiven;
    b.cfg.layout = StateLayout::kVLast;
    b.cfg.same_slot = true;
  });
  add("prefill_chunked_empty_seqs", Op::kPrefill, [](Base& b) {
    b.cfg.seq_lens = {0, 6, 0};
    b.cfg.in_dtype = DType::kFloat32;
    b.algo = PrefillAlgorithm::kChunked;
  });
  add("layout_out_of_place", Op::kLayout, [](Base& b) { b.cfg.layout_target = true; });
  add("layout_in_place_bf16", Op::kLayout, [](Base& b) {
    b.cfg.state_dtype = DType::kBFloat16;
    b.cfg.layout = StateLayout::kVLast;
    b.in_place = true;
  });
  add("layout_k64_v128", Op::kLayout, [](Base& b) {
    b.cfg.V = 128;
    b.cfg.H = 1;
    b.cfg.HV = 2;
    b.cfg.layout_target = true;
  });
  return out;
}

using AnyParams = std::variant<DecodeParams, VerifyParams, CommitParams, PrefillParams, LayoutParams>;

AnyParams make_params(const Base& b, Problem& p) {
  switch (b.op) {
    case Op::kDecode: return p.decode_params();
    case Op::kVerify: return p.verify_params();
    case Op::kCommit: return p.commit_params(b.source);
    case Op::kPrefill: return p.prefill_params(b.algo);
    case Op::kLayout: return p.layout_params(b.in_place);
  }
  return DecodeParams{};
}

void validate_any(const AnyParams& ap, Backend backend) {
  std::visit([&](const auto& p) { validate(p, backend); }, ap);
}

void run_any(const AnyParams& ap) {
  const Context ctx{Backend::kCPU, nullptr};
  std::visit(
      [&](const auto& p) {
        using P = std::decay_t<decltype(p)>;
        if constexpr (std::is_same_v<P, DecodeParams>) decode(p, ctx);
        if constexpr (std::is_same_v<P, VerifyParams>) verify(p, ctx);
        if constexpr (std::is_same_v<P, CommitParams>) commit(p, ctx);
        if constexpr (std::is_same_v<P, PrefillParams>) prefill(p, ctx);
        if constexpr (std::is_same_v<P, LayoutParams>) convert_layout(p, ctx);
      },
      ap);
}

// ---- mutations ----------------------------------------------------------------------------------

// kThrow: the spec makes the call invalid. kEither: valid or not, and safe to run on the problem's buffers
// when accepted. kEitherNoRun: may be valid, but a valid call would reach past the problem's buffers (a
// larger stride, a shifted pointer), so it is only validated.
enum class Expect { kThrow, kEither, kEitherNoRun };

struct Mutation {
  std::string what;                 // "q.token_stride=-3"
  std::vector<std::string> names;   // the message must name one of them
  Expect cpu = Expect::kThrow;
  Expect cuda = Expect::kThrow;     // validate(p, Backend::kCUDA)
  std::string group;                // at most one mutation per group in a combination; "heads" stands alone
};

// Memory a mutation points the params at (copies of index arrays, shifted pointers); outlives the call.
struct Scratch {
  std::vector<std::unique_ptr<std::vector<std::byte>>> blocks;
  // A 16-byte aligned copy of `bytes` bytes from src, with `slack` zero bytes after it.
  std::byte* copy(const void* src, size_t bytes, size_t slack = 32) {
    blocks.push_back(std::make_unique<std::vector<std::byte>>(bytes + slack + 16));
    auto* raw = blocks.back()->data();
    auto* p = raw + (16 - reinterpret_cast<uintptr_t>(raw) % 16) % 16;
    if (src != nullptr && bytes > 0) std::memcpy(p, src, bytes);
    return p;
  }
};

struct Rng {
  std::mt19937_64 gen;
  explicit Rng(uint64_t seed) : gen(seed) {}
  int64_t integer(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(gen); }
  bool coin(double p = 0.5) { return std::bernoulli_distribution(p)(gen); }
  template <class T>
  const T& pick(const std::vector<T>& v) {
    return v[size_t(integer(0, int64_t(v.size()) - 1))];
  }
};

std::string dstr(DType d) {
  return std::string(dtype_name(d)) + (dtype_size(d) == 0 ? "(" + std::to_string(int(d)) + ")" : "");
}

const void* shifted(const void* p, int64_t bytes) { return static_cast<const std::byte*>(p) + bytes; }

// What the mutators know about a call: the op, its base, the original problem, the params being mutated.
struct Ctx {
  const Base& base;
  const Problem& prob;
  AnyParams& ap;
  Scratch& scratch;
  Rng& rng;
  std::vector<std::string> taken;  // groups of the mutations already applied
  // A mutator of `group` may run: combinations take one mutation per group, and "heads" and "counts" stand
  // alone (they change the geometry and token counts every other check depends on, and the extents of the
  // index arrays the copies read).
  static bool alone(const std::string& g) { return g == "heads" || g == "counts"; }
  bool free(const std::string& group) const {
    if (alone(group) && !taken.empty()) return false;
    return std::none_of(taken.begin(), taken.end(), [&](const std::string& g) { return g == group || alone(g); });
  }
};

// The token views of decode-like and prefill params, with the geometry validate checks them against.
struct ViewRef {
  std::string name;
  const void** in = nullptr;  // one of in / out
  void** out = nullptr;
  DType* dtype = nullptr;
  int64_t* ts = nullptr;
  int64_t* hs = nullptr;
  int64_t count = 0;  // tokens (CPU); cuda_count: the bound CUDA validation uses
  int64_t cuda_count = 0;
  int64_t heads = 0, dim = 0;
  bool used = true;    // commit never reads q or o
  bool is_gate = false;
  const void* data() const { return in ? *in : *out; }
  void set(const void* p) {
    if (in) {
      *in = p;
    } else {
      *out = const_cast<void*>(p);
    }
  }
};

template <class Ptr>
ViewRef view_ref(const char* name, StridedView<Ptr>& v, int64_t count, int64_t cuda_count, int64_t heads, int64_t dim) {
  ViewRef r;
  r.name = name;
  if constexpr (std::is_same_v<Ptr, const void*>) {
    r.in = &v.data;
  } else {
    r.out = &v.data;
  }
  r.dtype = &v.dtype;
  r.ts = &v.token_stride;
  r.hs = &v.head_stride;
  r.count = count;
  r.cuda_count = cuda_count;
  r.heads = heads;
  r.dim = dim;
  return r;
}

// Token rows of the op (CPU: cu_seqlens read on the host; CUDA: B*T, the bound it validates with).
template <class P>
std::pair<int64_t, int64_t> token_counts(const P& p) {
  if constexpr (std::is_same_v<P, PrefillParams>) {
    return {p.total_tokens, p.total_tokens};
  } else if constexpr (std::is_base_of_v<VerifyParams, P>) {
    const int64_t bound = int64_t(p.batch) * p.num_draft_tokens;
    return {p.cu_seqlens ? int64_t(p.cu_seqlens[p.batch]) : bound, bound};
  } else {
    return {p.batch, p.batch};
  }
}

template <class P>
std::vector<ViewRef> views_of(P& p) {
  std::vector<ViewRef> out;
  const auto [n, nc] = token_counts(p);
  const HeadConfig& h = p.heads;
  const bool qo = !std::is_same_v<P, CommitParams>;
  out.push_back(view_ref("q", p.q, n, nc, h.num_qk_heads, h.head_dim_k));
  out.back().used = qo;
  out.push_back(view_ref("k", p.k, n, nc, h.num_qk_heads, h.head_dim_k));
  out.push_back(view_ref("v", p.v, n, nc, h.num_v_heads, h.head_dim_v));
  out.push_back(view_ref("o", p.o, n, nc, h.num_v_heads, h.head_dim_v));
  out.back().used = qo;
  const bool fused = p.gating.mode == GateMode::kFused;
  for (auto* name : {"a", "b", "g", "beta"}) {
    InView& v = name[0] == 'a' ? p.gating.a : name[0] == 'g' ? p.gating.g : std::string(name) == "b" ? p.gating.b
                                                                                                      : p.gating.beta;
    out.push_back(view_ref(name, v, n, nc, h.num_v_heads, 1));
    out.back().used = fused == (name[0] == 'a' || std::string(name) == "b");
    out.back().is_gate = true;
  }
  return out;
}

bool float_dtype(DType d) { return d == DType::kFloat32 || d == DType::kBFloat16 || d == DType::kFloat16; }

// Whether validate must reject view r as it is now (the documented view rules), on a backend.
bool view_invalid(const ViewRef& r, Backend backend) {
  const int64_t count = backend == Backend::kCPU ? r.count : r.cuda_count;
  if (!r.used || count <= 0) return false;
  if (r.data() == nullptr) return true;
  const int64_t elem = dtype_size(*r.dtype);
  if (r.heads > 1 && *r.hs < r.dim) return true;
  if (count > 1 && *r.ts < (r.heads - 1) * (r.heads > 1 ? *r.hs : 0) + r.dim) return true;
  const bool vector = backend == Backend::kCUDA && r.dim > 1;
  const int64_t align = vector ? 16 : elem;
  if (reinterpret_cast<uintptr_t>(r.data()) % uintptr_t(align) != 0) return true;
  if (vector && ((r.heads > 1 && (*r.hs * elem) % 16 != 0) || (count > 1 && (*r.ts * elem) % 16 != 0))) return true;
  return false;
}

// ---- the mutators: each returns false when it does not apply to the params ------------------------

using Mutator = std::function<bool(Ctx&, Mutation&)>;

template <class F>
bool on_tokens(Ctx& c, F f) {
  return std::visit(
      [&](auto& p) -> bool {
        using P = std::decay_t<decltype(p)>;
        if constexpr (std::is_same_v<P, LayoutParams>) {
          return false;
        } else {
          return f(p);
        }
      },
      c.ap);
}

// A view: dtype, null, misaligned pointer, head stride, token stride.
bool mutate_view(Ctx& c, Mutation& m) {
  return on_tokens(c, [&](auto& p) {
    if (!c.free("view")) return false;  // after "heads" or "counts" the extents below are unknown
    std::vector<ViewRef> vs = views_of(p);
    ViewRef r = c.rng.pick(vs);
    const bool qkvo = !r.is_gate;
    m.group = "view:" + r.name;
    if (!c.free(m.group) || (qkvo && !c.free("qkvo_dtype"))) return false;
    m.names = {r.name};
    const DType old_dtype = *r.dtype;
    const int64_t old_ts = *r.ts, old_hs = *r.hs;
    bool grows = false;  // a valid call would read or write more than the original view
    switch (c.rng.integer(0, 4)) {
      case 0: {  // dtype
        const DType d = c.rng.pick(std::vector<DType>{DType::kFloat32, DType::kBFloat16, DType::kFloat16,
                                                      DType::kInt32, DType::kInt64, DType(7)});
        if (d == old_dtype) return false;
        *r.dtype = d;
        m.what = r.name + ".dtype=" + dstr(d);
        if (qkvo) m.group = "qkvo_dtype";
        // q/k/v share a dtype and o takes v's: a change of one of them alone is an error (commit ignores q, o).
        bool invalid = !float_dtype(d) || (r.name == "g" && d != DType::kFloat32);
        if (qkvo && r.used) invalid = true;
        if (!r.used) invalid = false;
        grows = dtype_size(d) > dtype_size(old_dtype);
        m.cpu = m.cuda = invalid ? Expect::kThrow : grows ? Expect::kEitherNoRun : Expect::kEither;
        return true;
      }
      case 1:
        r.set(nullptr);
        m.what = r.name + ".data=nullptr";
        break;
      case 2: {
        const int64_t off = c.rng.integer(1, 15);
        r.set(shifted(r.data(), off));
        m.what = r.name + ".data+=" + std::to_string(off) + "B";
        grows = true;
        break;
      }
      case 3: {
        const int64_t d = r.dim;
        *r.hs = c.rng.pick(std::vector<int64_t>{-d, -1, 0, 1, d - 1, d, d + 1, d + 8, old_hs + 8, 2 * old_hs,
                                                c.rng.integer(-2 * d, 3 * d)});
        if (*r.hs == old_hs) return false;
        m.what = r.name + ".head_stride=" + std::to_string(*r.hs);
        grows = *r.hs > old_hs && r.heads > 1;
        break;
      }
      default: {
        const int64_t full = r.heads * r.dim;
        *r.ts = c.rng.pick(std::vector<int64_t>{-full, -1, 0, 1, full - 1, full, full + 8, old_ts + 16, 2 * old_ts,
                                                c.rng.integer(-2 * full, 3 * full)});
        if (*r.ts == old_ts) return false;
        m.what = r.name + ".token_stride=" + std::to_string(*r.ts);
        grows = *r.ts > old_ts;
        break;
      }
    }
    const Expect ok = grows ? Expect::kEitherNoRun : Expect::kEither;
    m.cpu = view_invalid(r, Backend::kCPU) ? Expect::kThrow : ok;
    m.cuda = view_invalid(r, Backend::kCUDA) ? Expect::kThrow : ok;
    return true;
  });
}

// Head configuration: H, HV, K, V, scale (alone: every stride check depends on them).
bool mutate_heads(Ctx& c, Mutation& m) {
  return on_tokens(c, [&](auto& p) {
    HeadConfig& h = p.heads;
    m.group = "heads";
    if (!c.free(m.group)) return false;
    switch (c.rng.integer(0, 4)) {
      case 0: {
        const int32_t H0 = h.num_qk_heads;
        h.num_qk_heads =
            int32_t(c.rng.pick(std::vector<int64_t>{0, -1, 3, H0 + 1, 1, h.num_v_heads, 2 * h.num_v_heads}));
        if (h.num_qk_heads == H0) return false;
        m.what = "heads.num_qk_heads=" + std::to_string(h.num_qk_heads);
        m.names = {"q", "H"};
        const bool bad = h.num_qk_heads <= 0 || h.num_v_heads % h.num_qk_heads != 0;
        m.cpu = m.cuda = bad ? Expect::kThrow : h.num_qk_heads < H0 ? Expect::kEither : Expect::kEitherNoRun;
        if (!bad && h.num_qk_heads > H0) m.names = {"q", "k", "H"};
        return true;
      }
      case 1: {
        const int32_t HV0 = h.num_v_heads;
        h.num_v_heads = int32_t(c.rng.pick(std::vector<int64_t>{0, -2, HV0 + 1, h.num_qk_heads, 2 * HV0, 3}));
        if (h.num_v_heads == HV0) return false;
        m.what = "heads.num_v_heads=" + std::to_string(h.num_v_heads);
        const bool bad = h.num_v_heads <= 0 || h.num_v_heads % h.num_qk_heads != 0;
        m.names = bad ? std::vector<std::string>{"v", "q", "HV"}
                      : std::vector<std::string>{"v", "o", "a", "b", "g", "beta", "HV", "state", "intermediate",
                                                 "checkpoints"};
        m.cpu = m.cuda = bad ? Expect::kThrow : h.num_v_heads < HV0 ? Expect::kEither : Expect::kEitherNoRun;
        return true;
      }
      case 2:
      case 3: {
        const bool k = c.rng.coin();
        int32_t& d = k ? h.head_dim_k : h.head_dim_v;
        const int32_t d0 = d;
        d = int32_t(c.rng.pick(std::vector<int64_t>{0, -64, 32, 100, 512, 63, 64, 128, 256}));
        if (d == d0) return false;
        m.what = std::string(k ? "heads.head_dim_k=" : "heads.head_dim_v=") + std::to_string(d);
        const bool bad = !(d == 64 || d == 128 || d == 256);
        if (bad) {
          m.names = {k ? "q" : "v", k ? "K" : "V"};
        } else {
          m.names = {k ? "q" : "v", k ? "k" : "o", k ? "K" : "V", "state", "intermediate", "checkpoints"};
        }
        m.cpu = m.cuda = bad ? Expect::kThrow : d < d0 ? Expect::kEither : Expect::kEitherNoRun;
        return true;
      }
      default: {
        const float s = c.rng.pick(std::vector<float>{std::numeric_limits<float>::quiet_NaN(),
                                                      std::numeric_limits<float>::infinity(),
                                                      -std::numeric_limits<float>::infinity(), -1.0f, 0.0f, 0.25f});
        h.scale = s;
        m.what = "heads.scale=" + std::to_string(s);
        m.names = {"scale"};
        m.cpu = m.cuda = std::isfinite(s) ? Expect::kEither : Expect::kThrow;
        return true;
      }
    }
  });
}

// Gating: mode, A_log and dt_bias.
bool mutate_gating(Ctx& c, Mutation& m) {
  return on_tokens(c, [&](auto& p) {
    Gating& g = p.gating;
    m.group = "gating";
    if (!c.free(m.group)) return false;
    const bool fused = g.mode == GateMode::kFused;
    switch (c.rng.integer(0, 3)) {
      case 0:
        g.mode = GateMode(c.rng.pick(std::vector<int>{-1, 2, 9}));
        m.what = "gating.mode=" + std::to_string(int(g.mode));
        m.names = {"gating"};
        m.cpu = m.cuda = Expect::kThrow;
        return true;
      case 1:
        // The other mode's views are empty (bfloat16, null): g's dtype or a's pointer is wrong.
        g.mode = fused ? GateMode::kGiven : GateMode::kFused;
        m.what = fused ? "gating.mode=kGiven (no g, beta)" : "gating.mode=kFused (no a, b, A_log, dt_bias)";
        m.names = fused ? std::vector<std::string>{"g", "beta"}
                        : std::vector<std::string>{"a", "b", "A_log", "dt_bias"};
        m.cpu = m.cuda = Expect::kThrow;
        return true;
      default: {
        const bool alog = c.rng.coin();
        const float*& ptr = alog ? g.A_log : g.dt_bias;
        m.names = {alog ? "A_log" : "dt_bias"};
        if (c.rng.coin()) {
          ptr = nullptr;
          m.what = m.names[0] + "=nullptr";
          m.cpu = m.cuda = fused ? Expect::kThrow : Expect::kEither;
        } else {
          const int64_t off = c.rng.integer(1, 4);
          ptr = static_cast<const float*>(shifted(ptr, off));
          m.what = m.names[0] + "+=" + std::to_string(off) + "B";
          m.cpu = m.cuda = !fused ? Expect::kEither : off % 4 != 0 ? Expect::kThrow : Expect::kEitherNoRun;
        }
        return true;
      }
    }
  });
}

// The pool and the caches: dtype, layout, slots, strides, pointers; commit's source; verify's update_state.
template <class P>
bool pool_required(const P& p) {
  if constexpr (std::is_same_v<P, PrefillParams>) {
    return p.num_seqs > 0 && (p.initial_indices != nullptr || p.final_indices != nullptr);
  } else {
    return p.batch > 0;
  }
}

bool mutate_state(Ctx& c, Mutation& m) {
  return on_tokens(c, [&](auto& p) {
    using P = std::decay_t<decltype(p)>;
    m.group = "state";
    if (!c.free(m.group)) return false;
    StatePool& s = p.state;
    const bool checked = pool_required(p) || s.data != nullptr;
    bool has_cache = false;
    if constexpr (std::is_same_v<P, PrefillParams>) has_cache = p.checkpoint_interval > 0;
    if constexpr (std::is_base_of_v<VerifyParams, P>) has_cache = p.intermediate.data != nullptr;
    const int64_t per = int64_t(p.heads.num_v_heads) * p.heads.head_dim_k * p.heads.head_dim_v;
    m.names = {"state"};
    auto set = [&](Expect e) { m.cpu = m.cuda = e; };
    const int which = int(c.rng.integer(0, 9));
    if (which <= 5) {
      switch (which) {
        case 0: {
          const DType d = c.rng.pick(std::vector<DType>{DType::kFloat32, DType::kBFloat16, DType::kFloat16,
                                                        DType::kInt32, DType(5)});
          if (d == s.dtype) return false;
          const bool grows = dtype_size(d) > dtype_size(s.dtype);
          s.dtype = d;
          m.what = "state.dtype=" + dstr(d);
          set(checked && !float_dtype(d) ? Expect::kThrow
              : grows                                                   ? Expect::kEitherNoRun
                                                                        : Expect::kEither);
          return true;
        }
        case 1: {
          const int l = int(c.rng.pick(std::vector<int64_t>{0, 1, 2, -1}));
          if (l == int(s.layout)) return false;
          s.layout = StateLayout(l);
          m.what = "state.layout=" + std::to_string(l);
          m.names = {"state", "intermediate", "checkpoints"};
          const bool unknown = l != 0 && l != 1;
          // A known layout is valid unless a cache of the old layout is given (a cache must match the pool).
          set(checked && (unknown || has_cache) ? Expect::kThrow : Expect::kEither);
          return true;
        }
        case 2: {
          const int64_t n = c.rng.pick(std::vector<int64_t>{0, -1, 1, s.num_slots - 1, s.num_slots + 4});
          if (n == s.num_slots) return false;
          m.what = "state.num_slots=" + std::to_string(n);
          // Fewer slots: the rows past P are skipped and counted. More: a slot index past the buffer (a seq
          // mutation) would become one the op writes.
          set(checked && n < 1 ? Expect::kThrow : n < s.num_slots ? Expect::kEither : Expect::kEitherNoRun);
          s.num_slots = n;
          return true;
        }
        case 3: {
          const int64_t st = c.rng.pick(std::vector<int64_t>{0, -per, per - 1, per / 2, per, per + 4, per + 8,
                                                             s.slot_stride + 1});
          if (st == s.slot_stride) return false;
          const bool grows = st > s.slot_stride;
          s.slot_stride = st;
          m.what = "state.slot_stride=" + std::to_string(st);
          const bool bad = checked && st < per;
          m.cpu = bad ? Expect::kThrow : grows ? Expect::kEitherNoRun : Expect::kEither;
          m.cuda = bad || (checked && (st * dtype_size(s.dtype)) % 16 != 0) ? Expect::kThrow : m.cpu;
          return true;
        }
        case 4: {
          s.data = nullptr;
          m.what = "state.data=nullptr";
          set(pool_required(p) ? Expect::kThrow : Expect::kEither);
          return true;
        }
        default: {
          const int64_t off = c.rng.integer(1, 15);
          s.data = const_cast<void*>(shifted(s.data, off));
          m.what = "state.data+=" + std::to_string(off) + "B";
          m.cpu = checked && off % dtype_size(s.dtype) != 0 ? Expect::kThrow : Expect::kEitherNoRun;
          m.cuda = checked ? Expect::kThrow : Expect::kEitherNoRun;
          return true;
        }
      }
    }
    // Caches, commit's source, verify's update_state, prefill's checkpoint options.
    if constexpr (std::is_base_of_v<VerifyParams, P>) {
      StateCache& ic = p.intermediate;
      const bool is_commit = std::is_same_v<P, CommitParams>;
      m.names = {"intermediate"};
      if (which == 6 && ic.data != nullptr) {
        switch (c.rng.integer(0, 5)) {
          case 0:
            ic.num_steps = c.rng.integer(-1, p.num_draft_tokens - 1);
            m.what = "intermediate.num_steps=" + std::to_string(ic.num_steps);
            break;
          case 1:
            ic.num_slots = c.rng.integer(-2, 0);
            m.what = "intermediate.num_slots=" + std::to_string(ic.num_slots);
            break;
          case 2:
            ic.slot_stride = ic.num_steps * per - c.rng.integer(1, per);
            m.what = "intermediate.slot_stride=" + std::to_string(ic.slot_stride);
            break;
          case 3:
            ic.dtype = c.rng.pick(std::vector<DType>{DType::kInt64, DType::kInt32, DType(6)});
            m.what = "intermediate.dtype=" + dstr(ic.dtype);
            break;
          case 4:
            ic.layout = ic.layout == StateLayout::kKLast ? StateLayout::kVLast : StateLayout::kKLast;
            m.what = "intermediate.layout=other";
            break;
          default: {
            const int64_t off = c.rng.integer(1, 15);
            ic.data = const_cast<void*>(shifted(ic.data, off));
            m.what = "intermediate.data+=" + std::to_string(off) + "B";
            m.cpu = off % dtype_size(ic.dtype) != 0 ? Expect::kThrow : Expect::kEitherNoRun;
            m.cuda = Expect::kThrow;
            return true;
          }
        }
        set(Expect::kThrow);
        return true;
      }
      if (which == 7 && ic.data != nullptr) {
        ic.data = nullptr;
        m.what = "intermediate.data=nullptr";
        bool needed = false;
        if constexpr (std::is_same_v<P, CommitParams>) needed = p.source == CommitSource::kCache && p.batch > 0;
        set(needed ? Expect::kThrow : Expect::kEither);
        return true;
      }
      if (which == 8 && p.intermediate_indices != nullptr && ic.data != nullptr) {  // required with the cache
        p.intermediate_indices = nullptr;
        m.what = "intermediate_indices=nullptr";
        m.names = {"intermediate_indices"};
        set(Expect::kThrow);
        return true;
      }
      if constexpr (std::is_same_v<P, CommitParams>) {
        if (which == 9) {
          if (c.rng.coin()) {
            p.source = CommitSource(c.rng.pick(std::vector<int>{-1, 2, 5}));
            m.what = "source=" + std::to_string(int(p.source));
            m.names = {"source"};
            set(Expect::kThrow);
          } else {
            p.source = p.source == CommitSource::kCache ? CommitSource::kRecompute : CommitSource::kCache;
            m.what = p.source == CommitSource::kCache ? "source=kCache" : "source=kRecompute";
            set(p.source == CommitSource::kCache && ic.data == nullptr ? Expect::kThrow : Expect::kEither);
          }
          return true;
        }
      } else {
        if (which == 9 && !is_commit) {
          if (!c.free("seq")) return false;  // valid or not with the parent tensor
          m.group = "seq";
          p.update_state = !p.update_state;
          m.what = p.update_state ? "update_state=true" : "update_state=false";
          m.names = {"update_state"};
          set(p.update_state && p.parent != nullptr ? Expect::kThrow : Expect::kEither);
          return true;
        }
      }
      return false;
    }
    if constexpr (std::is_same_v<P, PrefillParams>) {
      StateCache& ck = p.checkpoints;
      if (which == 6) {
        const int32_t C = int32_t(c.rng.pick(std::vector<int64_t>{-64, -1, 1, 32, 63, 65, 100, 96, 0, 128, 192}));
        if (C == p.checkpoint_interval) return false;
        p.checkpoint_interval = C;
        m.what = "checkpoint_interval=" + std::to_string(C);
        m.names = {"checkpoint_interval", "checkpoints", "checkpoint_indices"};
        const bool bad = C < 0 || C % 64 != 0 || (C > 0 && (ck.data == nullptr || p.checkpoint_indices == nullptr));
        set(bad ? Expect::kThrow : Expect::kEither);
        return true;
      }
      if (p.checkpoint_interval <= 0) return false;
      m.names = {"checkpoints"};
      if (which == 7) {
        switch (c.rng.integer(0, 4)) {
          case 0:
            ck.data = nullptr;
            m.what = "checkpoints.data=nullptr";
            break;
          case 1:
            ck.num_steps = c.rng.integer(-1, 0);
            m.what = "checkpoints.num_steps=" + std::to_string(ck.num_steps);
            break;
          case 2:
            ck.dtype = DType::kInt32;
            m.what = "checkpoints.dtype=int32";
            break;
          case 3:
            ck.slot_stride = ck.num_steps * per - 1;
            m.what = "checkpoints.slot_stride=" + std::to_string(ck.slot_stride);
            break;
          default:
            ck.layout = ck.layout == StateLayout::kKLast ? StateLayout::kVLast : StateLayout::kKLast;
            m.what = "checkpoints.layout=other";
            break;
        }
        set(Expect::kThrow);
        return true;
      }
      if (which == 8) {
        p.checkpoint_indices = nullptr;
        m.what = "checkpoint_indices=nullptr";
        m.names = {"checkpoint_indices"};
        set(p.num_seqs > 0 ? Expect::kThrow : Expect::kEither);
        return true;
      }
      if (which == 9) {
        p.cpu_algorithm = PrefillAlgorithm(c.rng.pick(std::vector<int>{-1, 3, 1, 2}));
        m.what = "cpu_algorithm=" + std::to_string(int(p.cpu_algorithm));
        m.names = {"cpu_algorithm"};
        set(int(p.cpu_algorithm) == 1 || int(p.cpu_algorithm) == 2 ? Expect::kEither : Expect::kThrow);
        return true;
      }
    }
    return false;
  });
}

// An int32 index array: a copy with room to shift (validate reads some of them on the CPU backend).
const int32_t* index_copy(Ctx& c, const int32_t* src, int64_t count) {
  return reinterpret_cast<const int32_t*>(c.scratch.copy(src, size_t(std::max<int64_t>(count, 0)) * 4));
}

// Sequences and index tensors: batch, T, cu_seqlens, parent, accepted, accepted_path, the slot arrays.
bool mutate_indices(Ctx& c, Mutation& m) {
  return on_tokens(c, [&](auto& p) {
    using P = std::decay_t<decltype(p)>;
    m.group = "seq";
    if (!c.free(m.group)) return false;
    auto set = [&](Expect cpu, Expect cuda) { m.cpu = cpu, m.cuda = cuda; };
    // Pointer mutations of one index array: null, misaligned, out-of-range values.
    auto pointer = [&](const char* name, const int32_t*& ptr, int64_t count, bool required, bool host_read) {
      m.names = {name};
      const int kind = int(c.rng.integer(0, 2));
      if (kind == 0) {
        ptr = nullptr;
        m.what = std::string(name) + "=nullptr";
        set(required && count > 0 ? Expect::kThrow : Expect::kEither, required && count > 0 ? Expect::kThrow
                                                                                              : Expect::kEither);
        return;
      }
      if (ptr == nullptr) ptr = index_copy(c, nullptr, count);  // any array: the option is turned on
      const int32_t* copy = index_copy(c, ptr, count);
      const int64_t off = kind == 1 ? c.rng.integer(1, 3) : 4 * c.rng.integer(0, 1);
      ptr = reinterpret_cast<const int32_t*>(shifted(copy, off));
      m.what = std::string(name) +
               (kind == 1 ? "+=" + std::to_string(off) + "B (misaligned)" : " copy+" + std::to_string(off) + "B");
      // Misaligned: rejected whatever the count. Shifted but aligned: other values (the slack reads as zeros),
      // which validate checks where it reads them and the op treats as slots otherwise: safe to run.
      (void)host_read;
      set(kind == 1 ? Expect::kThrow : Expect::kEither, kind == 1 ? Expect::kThrow : Expect::kEither);
    };
    if constexpr (std::is_same_v<P, PrefillParams>) {
      const int64_t N = p.num_seqs;
      const int which = int(c.rng.integer(0, 9));
      auto cu_copy = [&](DType dtype) -> std::byte* {
        return c.scratch.copy(p.cu_seqlens, size_t((N + 1) * dtype_size(dtype)), 64);
      };
      auto get = [&](const std::byte* cu, int64_t i) -> int64_t {
        return p.cu_seqlens_dtype == DType::kInt64 ? reinterpret_cast<const int64_t*>(cu)[i]
                                                   : reinterpret_cast<const int32_t*>(cu)[i];
      };
      auto put = [&](std::byte* cu, int64_t i, int64_t x) {
        if (p.cu_seqlens_dtype == DType::kInt64) {
          reinterpret_cast<int64_t*>(cu)[i] = x;
        } else {
          reinterpret_cast<int32_t*>(cu)[i] = int32_t(x);
        }
      };
      // A broken offsets array: wrong start, a decrease, a wrong end.
      auto break_offsets = [&](auto read, auto write, int64_t total) -> std::string {
        const int kind = int(c.rng.integer(0, 2));
        if (kind == 0) {
          write(0, c.rng.pick(std::vector<int64_t>{1, -1, 7}));
          return "[0]=" + std::to_string(read(0));
        }
        if (kind == 1 && N >= 1) {
          const int64_t i = c.rng.integer(1, N);
          write(i, read(i - 1) - c.rng.integer(1, 5));
          return "[" + std::to_string(i) + "]=" + std::to_string(read(i)) + " (decreasing)";
        }
        write(N, total + c.rng.pick(std::vector<int64_t>{-1, 1, 64}));
        if (N >= 1 && read(N) < read(N - 1)) write(N, read(N - 1) + 100);  // a wrong end, still non-decreasing
        if (read(N) == total) write(N, total + 1);
        return "[" + std::to_string(N) + "]=" + std::to_string(read(N)) + " (total " + std::to_string(total) + ")";
      };
      switch (which) {
        case 0: {  // the device copy (read on the CPU backend only)
          std::byte* cu = cu_copy(p.cu_seqlens_dtype);
          const std::string s = break_offsets([&](int64_t i) { return get(cu, i); },
                                              [&](int64_t i, int64_t x) { put(cu, i, x); }, p.total_tokens);
          if (N == 0 && get(cu, 0) == 0) return false;
          p.cu_seqlens = cu;
          m.what = "cu_seqlens(" + dstr(p.cu_seqlens_dtype) + ")" + s;
          m.names = {"cu_seqlens"};
          set(Expect::kThrow, Expect::kEither);
          return true;
        }
        case 1: {  // the host copy (read on both backends)
          std::vector<int64_t> h(size_t(N + 1));
          for (int64_t i = 0; i <= N; ++i) h[size_t(i)] = get(static_cast<const std::byte*>(p.cu_seqlens), i);
          auto* cu = reinterpret_cast<int64_t*>(c.scratch.copy(h.data(), h.size() * 8));
          const std::string s = break_offsets([&](int64_t i) { return cu[i]; },
                                              [&](int64_t i, int64_t x) { cu[i] = x; }, p.total_tokens);
          p.cu_seqlens_host = cu;
          m.what = "cu_seqlens_host" + s;
          m.names = {"cu_seqlens_host"};
          set(Expect::kThrow, Expect::kThrow);
          return true;
        }
        case 2: {
          if (p.cu_seqlens_host == nullptr) return false;
          p.cu_seqlens_host = nullptr;
          m.what = "cu_seqlens_host=nullptr";
          set(Expect::kEither, Expect::kEither);
          return true;
        }
        case 3: {
          const int d = c.rng.pick(std::vector<int>{0, 1, 2, 3, 4});
          const DType dt = DType(d);
          if (dt == p.cu_seqlens_dtype) return false;
          // The array is reread in the other width: a copy with room for it.
          p.cu_seqlens = cu_copy(p.cu_seqlens_dtype);
          p.cu_seqlens_dtype = dt;
          m.what = "cu_seqlens_dtype=" + dstr(dt);
          m.names = {"cu_seqlens"};
          const bool index = dt == DType::kInt32 || dt == DType::kInt64;
          set(index ? Expect::kEither : Expect::kThrow, index ? Expect::kEither : Expect::kThrow);
          return true;
        }
        case 4: {
          if (c.rng.coin()) {
            p.cu_seqlens = nullptr;
            m.what = "cu_seqlens=nullptr";
            m.names = {"cu_seqlens", "total_tokens"};
            const bool bad = N > 0 || p.total_tokens != 0;
            set(bad ? Expect::kThrow : Expect::kEither, bad ? Expect::kThrow : Expect::kEither);
          } else {
            const int64_t off = c.rng.integer(1, 7);
            p.cu_seqlens = shifted(cu_copy(p.cu_seqlens_dtype), off);
            m.what = "cu_seqlens+=" + std::to_string(off) + "B";
            m.names = {"cu_seqlens"};
            const bool bad = off % dtype_size(p.cu_seqlens_dtype) != 0;
            set(bad ? Expect::kThrow : Expect::kEitherNoRun, bad ? Expect::kThrow : Expect::kEither);
          }
          return true;
        }
        case 5: {
          const int64_t t = c.rng.pick(std::vector<int64_t>{-1, p.total_tokens - 1, p.total_tokens + 1, 0});
          if (t == p.total_tokens) return false;
          m.what = "total_tokens=" + std::to_string(t);
          m.group = "counts";
          m.names = {"total_tokens", "cu_seqlens", "cu_seqlens_host"};
          const bool host = p.cu_seqlens_host != nullptr;
          p.total_tokens = t;
          set(Expect::kThrow, t < 0 || host ? Expect::kThrow : Expect::kEitherNoRun);
          return true;
        }
        case 6: {
          const int32_t n = int32_t(c.rng.pick(std::vector<int64_t>{-1, -100, N - 1}));
          if (n == N || (n >= 0 && N == 0)) return false;
          m.what = "num_seqs=" + std::to_string(n);
          m.group = "counts";
          m.names = {"num_seqs", "cu_seqlens", "cu_seqlens_host"};
          const int64_t end_before = n >= 0 ? get(static_cast<const std::byte*>(p.cu_seqlens), n) : -1;
          p.num_seqs = n;
          // Fewer sequences are valid only when the dropped one is empty (the offsets still end at total).
          const bool ok = n >= 0 && end_before == p.total_tokens;
          set(ok ? Expect::kEither : Expect::kThrow,
              n < 0 || (!ok && p.cu_seqlens_host) ? Expect::kThrow : Expect::kEither);
          return true;
        }
        case 7:
          pointer("initial_indices", p.initial_indices, N, false, false);
          return true;
        case 8:
          pointer("final_indices", p.final_indices, N, false, false);
          return true;
        default:
          if (p.checkpoint_interval <= 0) {
            const int32_t* flag = p.error_flag;
            pointer("error_flag", flag, 1, false, false);
            p.error_flag = const_cast<int32_t*>(flag);
          } else {
            if (!c.free("state")) return false;  // checked only with checkpoints
            pointer("checkpoint_indices", p.checkpoint_indices, N, true, false);
            m.group = "state";
          }
          return true;
      }
    } else {
      const int64_t B = p.batch;
      const bool is_verify = std::is_base_of_v<VerifyParams, P>;
      const int which = int(c.rng.integer(0, is_verify ? 9 : 3));
      if (which == 0) {
        pointer("state_indices", p.state_indices, B, true, false);
        return true;
      }
      if (which == 1) {
        const int32_t* flag = p.error_flag;
        pointer("error_flag", flag, 1, false, false);
        p.error_flag = const_cast<int32_t*>(flag);
        return true;
      }
      if (which == 2) {  // out-of-range and padding slots: valid, skipped (and counted when >= P)
        int32_t* s = reinterpret_cast<int32_t*>(c.scratch.copy(p.state_indices, size_t(B) * 4));
        if (B == 0) return false;
        const int64_t b = c.rng.integer(0, B - 1);
        s[b] = int32_t(c.rng.pick(std::vector<int64_t>{-1, -1000, p.state.num_slots, p.state.num_slots + 7,
                                                      std::numeric_limits<int32_t>::max()}));
        p.state_indices = s;
        m.what = "state_indices[" + std::to_string(b) + "]=" + std::to_string(s[b]);
        set(Expect::kEither, Expect::kEither);
        return true;
      }
      if (which == 3) {
        const int32_t nb = int32_t(c.rng.pick(std::vector<int64_t>{-1, -7, B - 1, B + 1, 0}));
        if (nb == B) return false;
        m.what = "batch=" + std::to_string(nb);
        m.group = "counts";
        m.names = {"batch"};
        if (nb < 0) {
          p.batch = nb;
          set(Expect::kThrow, Expect::kThrow);
          return true;
        }
        if (nb > B) {
          if (is_verify) return false;  // validate would read the index arrays past their end
          p.batch = nb;
          set(Expect::kEitherNoRun, Expect::kEither);
          return true;
        }
        p.batch = nb;
        set(Expect::kEither, Expect::kEither);
        return true;
      }
      if constexpr (std::is_base_of_v<VerifyParams, P>) {
        const int64_t T = p.num_draft_tokens;
        auto len = [&](int64_t b) { return p.cu_seqlens ? int64_t(p.cu_seqlens[b + 1]) - p.cu_seqlens[b] : T; };
        switch (which) {
          case 4: {
            const int64_t t = c.rng.pick(std::vector<int64_t>{0, -1, T - 1, T + 1});
            if (t == T || (t == T - 1 && t < 1)) return false;
            bool commit_path = false;
            if constexpr (std::is_same_v<P, CommitParams>) commit_path = p.accepted_path != nullptr;
            if (t > T && (p.parent != nullptr || commit_path)) return false;  // [B, T] arrays read past their end
            p.num_draft_tokens = int32_t(t);
            m.what = "num_draft_tokens=" + std::to_string(t);
            m.group = "counts";
            m.names = {"num_draft_tokens", "T", "cu_seqlens", "parent", "accepted", "accepted_path", "intermediate"};
            if (t < 1) {
              set(Expect::kThrow, Expect::kThrow);
            } else {
              set(t < T ? Expect::kEither : Expect::kEitherNoRun, Expect::kEither);
            }
            return true;
          }
          case 5: {  // cu_seqlens values (read on the CPU backend only)
            if (p.cu_seqlens == nullptr || B == 0) {
              pointer("cu_seqlens", p.cu_seqlens, B + 1, false, true);
              m.group = "counts";
              if (m.what == "cu_seqlens=nullptr") return false;  // already absent
              // Other lengths can make the tokens' other index arrays the invalid ones.
              m.names = {"cu_seqlens", "accepted", "accepted_path", "parent"};
              return true;
            }
            int32_t* cu = reinterpret_cast<int32_t*>(c.scratch.copy(p.cu_seqlens, size_t(B + 1) * 4));
            const int kind = int(c.rng.integer(0, 2));
            if (kind == 0) {
              cu[0] = int32_t(c.rng.pick(std::vector<int64_t>{1, -1}));
              m.what = "cu_seqlens[0]=" + std::to_string(cu[0]);
              m.group = "counts";
            } else if (kind == 1) {
              const int64_t i = c.rng.integer(1, B);
              cu[i] = cu[i - 1] - int32_t(c.rng.integer(1, 3));
              m.what = "cu_seqlens[" + std::to_string(i) + "]=" + std::to_string(cu[i]) + " (decreasing)";
              m.group = "counts";
            } else {
              const int64_t i = c.rng.integer(1, B);
              const int32_t grow = int32_t(T + 1 - (cu[i] - cu[i - 1]));
              for (int64_t j = i; j <= B; ++j) cu[j] += grow;
              m.what = "cu_seqlens: sequence " + std::to_string(i - 1) + " of T+1 tokens";
            }
            p.cu_seqlens = cu;
            m.names = {"cu_seqlens"};
            set(Expect::kThrow, Expect::kEither);
            return true;
          }
          case 6: {
            if (p.cu_seqlens == nullptr) return false;
            pointer("cu_seqlens", p.cu_seqlens, B + 1, false, true);
            m.group = "counts";
            // Without cu_seqlens the call is fixed-T: B*T rows, more than the varlen problem has.
            if (p.cu_seqlens == nullptr) m.cpu = Expect::kEitherNoRun;
            m.names = {"cu_seqlens", "accepted", "accepted_path", "parent"};
            return true;
          }
          case 7: {  // parent values (trees; read on the CPU backend only)
            if (p.parent == nullptr) {
              // A chain turned into a tree of one bad parent.
              return false;
            }
            int32_t* par = reinterpret_cast<int32_t*>(c.scratch.copy(p.parent, size_t(B * T) * 4));
            std::vector<std::pair<int64_t, int64_t>> cells;
            for (int64_t b = 0; b < B; ++b)
              for (int64_t t = 0; t < len(b); ++t) cells.push_back({b, t});
            if (cells.empty()) return false;
            const auto [b, t] = c.rng.pick(cells);
            par[b * T + t] = int32_t(c.rng.pick(std::vector<int64_t>{t, t + 1, -2, T + 3, -100}));
            p.parent = par;
            m.what = "parent[" + std::to_string(b) + "][" + std::to_string(t) + "]=" + std::to_string(par[b * T + t]);
            m.names = {"parent"};
            set(Expect::kThrow, Expect::kEither);
            return true;
          }
          case 8: {
            if (p.parent != nullptr && c.rng.coin()) {
              m.names = {"parent"};
              const int64_t off = c.rng.integer(1, 3);
              p.parent = reinterpret_cast<const int32_t*>(shifted(index_copy(c, p.parent, B * T), off));
              m.what = "parent+=" + std::to_string(off) + "B";
              set(Expect::kThrow, Expect::kThrow);
              return true;
            }
            if (p.parent != nullptr) {
              p.parent = nullptr;  // the tree read as a chain: valid (a commit path stays a token list)
              m.what = "parent=nullptr";
              m.names = {"parent"};
              set(Expect::kEither, Expect::kEither);
              return true;
            }
            return false;
          }
          default: {
            if constexpr (std::is_same_v<P, CommitParams>) {
              if (c.rng.coin()) {
                int32_t* acc = reinterpret_cast<int32_t*>(c.scratch.copy(p.accepted, size_t(B) * 4));
                if (B == 0) return false;
                const int64_t b = c.rng.integer(0, B - 1);
                acc[b] = int32_t(c.rng.pick(std::vector<int64_t>{-1, len(b) + 1, T + 5, -1000}));
                p.accepted = acc;
                m.what = "accepted[" + std::to_string(b) + "]=" + std::to_string(acc[b]);
                m.names = {"accepted"};
                set(Expect::kThrow, Expect::kEither);
                return true;
              }
              if (p.accepted_path != nullptr && c.rng.coin()) {
                int32_t* path = reinterpret_cast<int32_t*>(c.scratch.copy(p.accepted_path, size_t(B * T) * 4));
                std::vector<std::pair<int64_t, int64_t>> cells;
                for (int64_t b = 0; b < B; ++b)
                  for (int64_t i = 0; i < p.accepted[b]; ++i) cells.push_back({b, i});
                if (cells.empty()) return false;
                const auto [b, i] = c.rng.pick(cells);
                path[b * T + i] = int32_t(c.rng.pick(std::vector<int64_t>{-1, len(b), T + 2}));
                p.accepted_path = path;
                m.what = "accepted_path[" + std::to_string(b) + "][" + std::to_string(i) + "]=" +
                         std::to_string(path[b * T + i]);
                m.names = {"accepted_path"};
                set(Expect::kThrow, Expect::kEither);
                return true;
              }
              if (c.rng.coin()) {
                pointer("accepted", p.accepted, B, true, true);
                return true;
              }
              pointer("accepted_path", p.accepted_path, B * T, p.parent != nullptr, true);
              return true;
            } else {
              if (p.intermediate.data == nullptr || !c.free("state")) return false;
              pointer("intermediate_indices", p.intermediate_indices, B, true, false);
              m.group = "state";  // checked only with the cache
              return true;
            }
          }
        }
      }
      return false;
    }
  });
}

// Layout conversion: heads, dtypes, layouts, slots, strides, pointers, overlap.
bool mutate_layout(Ctx& c, Mutation& m) {
  auto* pp = std::get_if<LayoutParams>(&c.ap);
  if (pp == nullptr) return false;
  LayoutParams& p = *pp;
  const bool in_place = p.dst.data == p.src.data;
  const bool dst_side = c.rng.coin();
  StatePool& s = dst_side ? p.dst : p.src;
  const std::string side = dst_side ? "dst" : "src";
  const int64_t per = int64_t(p.num_v_heads) * p.head_dim_k * p.head_dim_v;
  // One layout mutation per call: num_slots = 0 on both sides, for one, makes every other check moot.
  m.group = "layout";
  if (!c.free(m.group)) return false;
  m.names = {side};
  auto set = [&](Expect e) { m.cpu = m.cuda = e; };
  switch (c.rng.integer(0, 9)) {
    case 0:
      m.names = {"src"};
      switch (c.rng.integer(0, 2)) {
        case 0:
          p.num_v_heads = int32_t(c.rng.integer(-2, 0));
          m.what = "num_v_heads=" + std::to_string(p.num_v_heads);
          break;
        case 1:
          p.head_dim_k = int32_t(c.rng.pick(std::vector<int64_t>{0, 32, 96, 512}));
          m.what = "head_dim_k=" + std::to_string(p.head_dim_k);
          break;
        default:
          p.head_dim_v = int32_t(c.rng.pick(std::vector<int64_t>{-64, 48, 1024}));
          m.what = "head_dim_v=" + std::to_string(p.head_dim_v);
          break;
      }
      set(Expect::kThrow);
      return true;
    case 1: {
      const DType d = c.rng.pick(std::vector<DType>{DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kInt32});
      if (d == s.dtype) return false;
      s.dtype = d;
      m.what = side + ".dtype=" + dstr(d);
      m.names = {"src", "dst"};  // a valid src dtype makes dst the odd one out
      set(Expect::kThrow);
      return true;
    }
    case 2: {
      const int l = int(c.rng.pick(std::vector<int64_t>{0, 1, 3, -1}));
      if (l == int(s.layout)) return false;
      s.layout = StateLayout(l);
      m.what = side + ".layout=" + std::to_string(l);
      m.names = {"src", "dst"};  // equal layouts: dst is named
      set(Expect::kThrow);
      return true;
    }
    case 3: {
      const int64_t n = c.rng.pick(std::vector<int64_t>{-1, 0, s.num_slots - 1, s.num_slots + 1});
      if (n == s.num_slots) return false;
      if (c.rng.coin() && n >= 0) {  // both: valid (0: nothing to convert)
        p.src.num_slots = p.dst.num_slots = n;
        m.what = "num_slots=" + std::to_string(n) + " (both)";
        set(n <= c.prob.num_slots() ? Expect::kEither : Expect::kEitherNoRun);
        return true;
      }
      s.num_slots = n;
      m.what = side + ".num_slots=" + std::to_string(n);
      m.names = {"src", "dst"};
      set(Expect::kThrow);
      return true;
    }
    case 4:
      s.data = nullptr;
      m.what = side + ".data=nullptr";
      m.names = {side, "src", "dst"};  // in place, a null dst equals nothing; both pointers null: src is named
      set(p.src.num_slots > 0 ? Expect::kThrow : Expect::kEither);
      return true;
    case 5: {
      const int64_t st = c.rng.pick(std::vector<int64_t>{0, -1, per - 1, per / 2, per + 4, per + 64});
      if (st == s.slot_stride) return false;
      const bool grows = st > s.slot_stride;
      s.slot_stride = st;
      m.what = side + ".slot_stride=" + std::to_string(st);
      const bool bad = st < per || in_place;  // in place the two strides must be equal
      m.cpu = bad ? Expect::kThrow : grows ? Expect::kEitherNoRun : Expect::kEither;
      m.cuda = bad || (st * dtype_size(s.dtype)) % 16 != 0 ? Expect::kThrow : m.cpu;
      m.names = {side, "dst"};
      return true;
    }
    case 6: {
      const int64_t off = c.rng.integer(1, 15);
      s.data = const_cast<void*>(shifted(s.data, off));
      m.what = side + ".data+=" + std::to_string(off) + "B";
      m.names = {side, "dst"};  // in place, shifting one side makes the pools overlap: dst is named
      m.cpu = off % dtype_size(s.dtype) != 0 || in_place ? Expect::kThrow : Expect::kEitherNoRun;
      m.cuda = Expect::kThrow;
      return true;
    }
    case 7: {
      // dst inside src (or src inside dst): overlapping pools, not in place.
      const int64_t last = (p.src.num_slots - 1) * p.src.slot_stride;
      const int64_t elems = c.rng.pick(std::vector<int64_t>{4, per, per + 4, last});
      p.dst.data = static_cast<std::byte*>(p.src.data) + elems * dtype_size(p.src.dtype);
      if (elems == 0) return false;
      m.what = "dst.data=src.data+" + std::to_string(elems) + " elements";
      m.names = {"dst"};
      set(Expect::kThrow);
      return true;
    }
    case 8: {
      // In place: equal slot strides and K == V required.
      p.dst.data = p.src.data;
      p.dst.slot_stride = p.src.slot_stride;
      m.what = "dst.data=src.data (in place)";
      m.names = {"dst"};
      set(p.head_dim_k == p.head_dim_v ? Expect::kEither : Expect::kThrow);
      return true;
    }
    default:
      p.dst.layout = p.src.layout;
      m.what = "dst.layout=src.layout";
      m.names = {"dst"};
      set(Expect::kThrow);
      return true;
  }
}

const std::vector<Mutator>& mutators() {
  static const std::vector<Mutator> all = {mutate_view, mutate_view,    mutate_view,   mutate_heads,
                                           mutate_gating, mutate_state, mutate_state, mutate_indices,
                                           mutate_indices, mutate_indices, mutate_layout, mutate_layout};
  return all;
}

// ---- checking one mutated call ------------------------------------------------------------------

bool is_word_char(char ch) { return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_'; }

// `name` occurs in msg as a whole word ("q" in "q: ..." or "(the dtype of q)", not in "seq").
bool names_word(const std::string& msg, const std::string& name) {
  for (size_t at = msg.find(name); at != std::string::npos; at = msg.find(name, at + 1)) {
    const bool left = at == 0 || !is_word_char(msg[at - 1]);
    const bool right = at + name.size() >= msg.size() || !is_word_char(msg[at + name.size()]);
    if (left && right) return true;
  }
  return false;
}

bool names_any(const std::string& msg, const std::vector<std::string>& names) {
  return std::any_of(names.begin(), names.end(), [&](const std::string& n) { return names_word(msg, n); });
}

struct Outcome {
  bool threw = false;
  bool library_error = false;  // a gdnkit::Error of kInvalidArgument
  std::string message;
};

template <class F>
Outcome attempt(F f) {
  Outcome o;
  try {
    f();
  } catch (const Error& e) {
    o.threw = true;
    o.library_error = e.code() == ErrorCode::kInvalidArgument;
    o.message = std::string(e.what()) + (o.library_error ? "" : " [error code " + std::to_string(int(e.code())) + "]");
  } catch (const std::exception& e) {
    o.threw = true;
    o.message = std::string("not a gdnkit::Error: ") + e.what();
  }
  return o;
}

// The first buffer whose bytes differ from the pristine problem's, or "".
std::string changed_buffer(const Problem& work, const Problem& pristine) {
  for (size_t i = 0; i < work.buffers().size(); ++i)
    if (work.buffers()[i].bytes != pristine.buffers()[i].bytes) return work.buffers()[i].name;
  return "";
}

void restore(Problem& work, const Problem& pristine) {
  for (size_t i = 0; i < work.buffers().size(); ++i) {
    auto& dst = work.buffers()[i].bytes;
    const auto& src = pristine.buffers()[i].bytes;
    std::memcpy(dst.data(), src.data(), src.size());
  }
}

struct Stats {
  int64_t calls = 0, cpu_thrown = 0, cpu_ran = 0, cuda_thrown = 0, failures = 0;
};

// Checks one mutated call on both backends' validation and the CPU entry; returns "" or what went wrong.
std::string check_call(const AnyParams& ap, const std::vector<Mutation>& ms, Problem& work, const Problem& pristine,
                       bool cuda_base_valid, Stats& st) {
  Expect cpu = Expect::kEither, cuda = Expect::kEither;
  std::vector<std::string> names;
  for (const auto& m : ms) {
    names.insert(names.end(), m.names.begin(), m.names.end());
    if (m.cpu == Expect::kThrow || cpu == Expect::kThrow) {
      cpu = Expect::kThrow;
    } else if (m.cpu == Expect::kEitherNoRun) {
      cpu = Expect::kEitherNoRun;
    }
    if (m.cuda == Expect::kThrow) cuda = Expect::kThrow;
  }
  ++st.calls;
  const Outcome v = attempt([&] { validate_any(ap, Backend::kCPU); });
  if (v.threw) {
    ++st.cpu_thrown;
    if (!v.library_error) return "cpu validate threw " + v.message;
    if (!names_any(v.message, names)) return "cpu message does not name the mutated field: \"" + v.message + "\"";
    const Outcome e = attempt([&] { run_any(ap); });
    if (!e.threw) return "the cpu entry accepted what validate rejected (\"" + v.message + "\")";
    if (e.message != v.message) return "the cpu entry threw \"" + e.message + "\", validate \"" + v.message + "\"";
    const std::string changed = changed_buffer(work, pristine);
    if (!changed.empty()) return "buffer " + changed + " was written although the call threw \"" + v.message + "\"";
  } else if (cpu == Expect::kThrow) {
    return "cpu validate accepted it";
  } else if (cpu == Expect::kEither) {
    ++st.cpu_ran;
    const Outcome e = attempt([&] { run_any(ap); });
    restore(work, pristine);
    if (e.threw) return "the cpu entry threw after validate accepted: \"" + e.message + "\"";
  }
  if (!cuda_base_valid) return "";
  const Outcome vc = attempt([&] { validate_any(ap, Backend::kCUDA); });
  if (vc.threw) {
    ++st.cuda_thrown;
    if (!vc.library_error) return "cuda validate threw " + vc.message;
    if (!names_any(vc.message, names)) return "cuda message does not name the mutated field: \"" + vc.message + "\"";
  } else if (cuda == Expect::kThrow) {
    return "cuda validate accepted it";
  }
  // prefill_path() validates for CUDA, then plans from the host copy of cu_seqlens: no crash either way.
  if (const auto* pp = std::get_if<PrefillParams>(&ap); pp != nullptr && !vc.threw) {
    const Outcome path = attempt([&] { (void)prefill_path(*pp); });
    if (path.threw && !path.library_error) return "prefill_path threw " + path.message;
  }
  return "";
}

std::string describe(const std::vector<Mutation>& ms) {
  std::string s;
  for (const auto& m : ms) s += (s.empty() ? "" : " + ") + m.what;
  return s;
}

bool base_valid(const AnyParams& ap, Backend backend) {
  return !attempt([&] { validate_any(ap, backend); }).threw;
}

// ---- the fuzz loop ------------------------------------------------------------------------------

struct Prepared {
  Base base;
  Problem pristine;
  Problem work;
  bool cuda_valid = false;
};

std::vector<std::unique_ptr<Prepared>> prepare() {
  std::vector<std::unique_ptr<Prepared>> out;
  for (const Base& b : bases()) {
    Problem p(b.cfg);
    auto prep = std::make_unique<Prepared>(Prepared{b, p, p, false});
    AnyParams ap = make_params(b, prep->work);
    EXPECT_TRUE(base_valid(ap, Backend::kCPU)) << b.name << ": the base problem is not valid";
    prep->cuda_valid = base_valid(ap, Backend::kCUDA);
    out.push_back(std::move(prep));
  }
  return out;
}

uint64_t fuzz_seed() {
  if (const char* s = std::getenv("GDNKIT_FUZZ_SEED")) return std::strtoull(s, nullptr, 10);
  return 20240611;
}

int64_t fuzz_iterations() {
  if (const char* s = std::getenv("GDNKIT_FUZZ_ITERATIONS")) return std::strtoll(s, nullptr, 10);
  return 12000;
}

TEST(FuzzParams, RandomMutations) {
  auto prepared = prepare();
  const uint64_t seed0 = fuzz_seed();
  const int64_t iterations = fuzz_iterations();
  const bool trace = std::getenv("GDNKIT_FUZZ_TRACE") != nullptr;
  std::vector<Stats> per_base(prepared.size());
  const auto t0 = std::chrono::steady_clock::now();
  int64_t failures = 0;
  for (int64_t it = 0; it < iterations && failures < 20; ++it) {
    const uint64_t seed = seed0 * 1000003u + uint64_t(it);
    Rng rng(seed);
    const size_t bi = size_t(rng.integer(0, int64_t(prepared.size()) - 1));
    Prepared& pr = *prepared[bi];
    AnyParams ap = make_params(pr.base, pr.work);
    Scratch scratch;
    Ctx ctx{pr.base, pr.pristine, ap, scratch, rng, {}};
    // One mutation most of the time, sometimes two or three of different groups.
    const int want = rng.coin(0.7) ? 1 : int(rng.integer(2, 3));
    std::vector<Mutation> ms;
    for (int tries = 0; tries < 40 && int(ms.size()) < want; ++tries) {
      const AnyParams saved = ap;
      Mutation m;
      if (!rng.pick(mutators())(ctx, m)) {
        ap = saved;
        continue;
      }
      if (Ctx::alone(m.group) && !ms.empty()) {
        ap = saved;
        continue;
      }
      ms.push_back(m);
      ctx.taken.push_back(m.group);
    }
    if (ms.empty()) continue;
    // A crash cannot report itself: GDNKIT_FUZZ_TRACE=1 prints every call before it runs.
    if (trace) {
      std::printf("iteration %lld base %s mutation %s\n", (long long)it, pr.base.name.c_str(), describe(ms).c_str());
      std::fflush(stdout);
    }
    const std::string err = check_call(ap, ms, pr.work, pr.pristine, pr.cuda_valid, per_base[bi]);
    if (!err.empty()) {
      ++failures;
      ADD_FAILURE() << "GDNKIT_FUZZ_SEED=" << seed0 << " iteration " << it << " (seed " << seed << ") base "
                    << pr.base.name << " mutation " << describe(ms) << ": " << err;
      restore(pr.work, pr.pristine);
    }
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int64_t calls = 0;
  for (size_t i = 0; i < prepared.size(); ++i) {
    const Stats& s = per_base[i];
    calls += s.calls;
    std::printf("  %-32s %5lld calls: cpu rejected %5lld, ran %4lld; cuda rejected %5lld\n",
                prepared[i]->base.name.c_str(), (long long)s.calls, (long long)s.cpu_thrown, (long long)s.cpu_ran,
                (long long)s.cuda_thrown);
  }
  std::printf("  %lld mutated calls in %.2f s (GDNKIT_FUZZ_SEED=%llu)\n", (long long)calls, secs,
              (unsigned long long)seed0);
  EXPECT_GT(calls, iterations / 2);
}

// ---- the important single mutations, one readable line each -------------------------------------

struct Single {
  const char* base;
  const char* what;
  std::function<void(AnyParams&, Scratch&)> apply;
  const char* text;  // a part of the expected message
  bool cuda = true;  // validate(p, kCUDA) rejects it too (host-read index values: CPU only)
};

template <class P>
P& as(AnyParams& ap) {
  return std::get<P>(ap);
}

std::vector<Single> singles() {
  using DP = DecodeParams;
  using VP = VerifyParams;
  using CP = CommitParams;
  using PP = PrefillParams;
  using LP = LayoutParams;
  auto cu32 = [](AnyParams& ap, Scratch& sc, std::vector<int32_t> v) {
    as<VP>(ap).cu_seqlens = reinterpret_cast<const int32_t*>(sc.copy(v.data(), v.size() * 4));
  };
  return {
      {"decode_bf16_fused", "q.dtype=int32", [](AnyParams& ap, Scratch&) { as<DP>(ap).q.dtype = DType::kInt32; },
       "q: expected dtype float32, bfloat16 or float16, got int32"},
      {"decode_bf16_fused", "k.dtype=float16", [](AnyParams& ap, Scratch&) { as<DP>(ap).k.dtype = DType::kFloat16; },
       "k: expected dtype bfloat16 (the dtype of q), got float16"},
      {"decode_bf16_fused", "o.dtype=float32", [](AnyParams& ap, Scratch&) { as<DP>(ap).o.dtype = DType::kFloat32; },
       "o: expected dtype bfloat16 (the dtype of v), got float32"},
      {"decode_bf16_fused", "heads.num_qk_heads=3", [](AnyParams& ap, Scratch&) { as<DP>(ap).heads.num_qk_heads = 3; },
       "q: H=3 does not divide HV=4"},
      {"decode_bf16_fused", "heads.head_dim_v=96", [](AnyParams& ap, Scratch&) { as<DP>(ap).heads.head_dim_v = 96; },
       "v: head dim V=96 is not supported"},
      {"decode_bf16_fused", "heads.scale=NaN",
       [](AnyParams& ap, Scratch&) { as<DP>(ap).heads.scale = std::numeric_limits<float>::quiet_NaN(); },
       "scale: expected a finite value"},
      {"decode_bf16_fused", "batch=-1", [](AnyParams& ap, Scratch&) { as<DP>(ap).batch = -1; }, "batch: must be >= 0"},
      {"decode_bf16_fused", "v.head_stride=0", [](AnyParams& ap, Scratch&) { as<DP>(ap).v.head_stride = 0; },
       "v: head_stride=0 is smaller than V=64"},
      {"decode_bf16_fused", "q.head_stride=-64", [](AnyParams& ap, Scratch&) { as<DP>(ap).q.head_stride = -64; },
       "q: head_stride=-64 is smaller than K=64"},
      {"decode_bf16_fused", "o.token_stride=64 (overlapping rows)",
       [](AnyParams& ap, Scratch&) { as<DP>(ap).o.token_stride = 64; },
       "o: token_stride=64 overlaps the previous token"},
      {"decode_bf16_fused", "k.token_stride=-128", [](AnyParams& ap, Scratch&) { as<DP>(ap).k.token_stride = -128; },
       "k: token_stride=-128 overlaps the previous token"},
      {"decode_bf16_fused", "a.head_stride=0", [](AnyParams& ap, Scratch&) { as<DP>(ap).gating.a.head_stride = 0; },
       "a: head_stride=0 is smaller than 1"},
      {"decode_bf16_fused", "q.data=nullptr", [](AnyParams& ap, Scratch&) { as<DP>(ap).q.data = nullptr; },
       "q: required pointer is null"},
      {"decode_bf16_fused", "o.data+=1B", [](AnyParams& ap, Scratch&) {
         as<DP>(ap).o.data = static_cast<std::byte*>(as<DP>(ap).o.data) + 1; }, "o: data pointer"},
      {"decode_bf16_fused", "A_log=nullptr", [](AnyParams& ap, Scratch&) { as<DP>(ap).gating.A_log = nullptr; },
       "A_log: required pointer is null"},
      {"decode_bf16_fused", "dt_bias+=2B",
       [](AnyParams& ap, Scratch&) {
         auto& g = as<DP>(ap).gating;
         g.dt_bias = static_cast<const float*>(shifted(g.dt_bias, 2));
       },
       "dt_bias: data pointer"},
      {"decode_bf16_fused", "a.dtype=int32", [](AnyParams& ap, Scratch&) { as<DP>(ap).gating.a.dtype = DType::kInt32; },
       "a: expected dtype float32, bfloat16 or float16, got int32"},
      {"decode_bf16_fused", "gating.mode=kGiven without g", [](AnyParams& ap, Scratch&) {
         as<DP>(ap).gating.mode = GateMode::kGiven; }, "g: expected dtype float32"},
      {"decode_bf16_fused", "gating.mode=7", [](AnyParams& ap, Scratch&) { as<DP>(ap).gating.mode = GateMode(7); },
       "gating: unknown mode 7"},
      {"decode_fp32_given_vlast_padded", "g.dtype=bfloat16",
       [](AnyParams& ap, Scratch&) { as<DP>(ap).gating.g.dtype = DType::kBFloat16; }, "g: expected dtype float32"},
      {"decode_bf16_fused", "state.dtype=int32",
       [](AnyParams& ap, Scratch&) { as<DP>(ap).state.dtype = DType::kInt32; },
       "state: expected dtype float32, bfloat16, float16 or float8_e4m3, got int32"},
      {"decode_bf16_fused", "state.layout=2", [](AnyParams& ap, Scratch&) { as<DP>(ap).state.layout = StateLayout(2); },
       "state: unknown state layout 2"},
      {"decode_bf16_fused", "state.slot_stride=HV*K*V-1",
       [](AnyParams& ap, Scratch&) { as<DP>(ap).state.slot_stride = 4 * 64 * 64 - 1; }, "state: slot_stride=16383"},
      {"decode_bf16_fused", "state.num_slots=0", [](AnyParams& ap, Scratch&) { as<DP>(ap).state.num_slots = 0; },
       "state: num_slots must be >= 1"},
      {"decode_bf16_fused", "state.data=nullptr", [](AnyParams& ap, Scratch&) { as<DP>(ap).state.data = nullptr; },
       "state: required pointer is null"},
      {"decode_bf16_fused", "state_indices=nullptr",
       [](AnyParams& ap, Scratch&) { as<DP>(ap).state_indices = nullptr; },
       "state_indices: required pointer is null"},
      {"decode_bf16_fused", "error_flag+=2B", [](AnyParams& ap, Scratch&) {
         as<DP>(ap).error_flag = reinterpret_cast<int32_t*>(reinterpret_cast<std::byte*>(as<DP>(ap).error_flag) + 2); },
       "error_flag: data pointer"},
      {"verify_chain_update", "num_draft_tokens=0", [](AnyParams& ap, Scratch&) { as<VP>(ap).num_draft_tokens = 0; },
       "num_draft_tokens: must be >= 1"},
      {"verify_tree_cache", "update_state=true with parent",
       [](AnyParams& ap, Scratch&) { as<VP>(ap).update_state = true; },
       "update_state: only for chain drafts"},
      {"verify_tree_cache", "parent[0][1]=1",
       [](AnyParams& ap, Scratch& sc) {
         auto* par = reinterpret_cast<int32_t*>(sc.copy(as<VP>(ap).parent, 2 * 4 * 4));
         par[1] = 1;
         as<VP>(ap).parent = par;
       },
       "parent: expected -1 <= parent[b][t] < t (b=0, t=1), got 1", false},
      {"verify_tree_cache", "intermediate.num_steps=T-1",
       [](AnyParams& ap, Scratch&) { as<VP>(ap).intermediate.num_steps = 3; },
       "intermediate: num_steps must be >= 4, got 3"},
      {"verify_tree_cache", "intermediate.layout=V-last (pool K-last)",
       [](AnyParams& ap, Scratch&) { as<VP>(ap).intermediate.layout = StateLayout::kVLast; },
       "intermediate: expected layout K-last"},
      {"verify_tree_cache", "intermediate_indices=nullptr",
       [](AnyParams& ap, Scratch&) { as<VP>(ap).intermediate_indices = nullptr; },
       "intermediate_indices: required pointer"},
      {"verify_varlen_nocache", "cu_seqlens[0]=1", [cu32](AnyParams& ap, Scratch& sc) { cu32(ap, sc, {1, 3, 3, 5}); },
       "cu_seqlens: must start at 0 (index 0: 1)", false},
      {"verify_varlen_nocache", "cu_seqlens decreasing",
       [cu32](AnyParams& ap, Scratch& sc) { cu32(ap, sc, {0, 3, 2, 5}); },
       "cu_seqlens: must be non-decreasing (index 2: 3 > 2)", false},
      {"verify_varlen_nocache", "cu_seqlens: a sequence longer than T", [cu32](AnyParams& ap, Scratch& sc) {
         cu32(ap, sc, {0, 5, 5, 7}); }, "cu_seqlens: sequence 0 has 5 tokens, more than T=4", false},
      {"verify_varlen_nocache", "cu_seqlens+=2B", [](AnyParams& ap, Scratch& sc) {
         as<VP>(ap).cu_seqlens = reinterpret_cast<const int32_t*>(shifted(sc.copy(as<VP>(ap).cu_seqlens, 16), 2)); },
       "cu_seqlens: data pointer"},
      {"commit_chain_cache", "accepted[1]=4 (T=3)",
       [](AnyParams& ap, Scratch& sc) {
         auto* acc = reinterpret_cast<int32_t*>(sc.copy(as<CP>(ap).accepted, 8));
         acc[1] = 4;
         as<CP>(ap).accepted = acc;
       },
       "accepted: expected 0 <= accepted[b] <= 3 (the draft length of sequence b=1), got 4", false},
      {"commit_chain_cache", "source=kCache without intermediate",
       [](AnyParams& ap, Scratch&) { as<CP>(ap).intermediate.data = nullptr; },
       "intermediate: required pointer is null"},
      {"commit_chain_cache", "source=3", [](AnyParams& ap, Scratch&) { as<CP>(ap).source = CommitSource(3); },
       "source: unknown commit source 3"},
      {"commit_tree_recompute", "accepted_path=nullptr (tree)",
       [](AnyParams& ap, Scratch&) { as<CP>(ap).accepted_path = nullptr; }, "accepted_path: required pointer is null"},
      {"commit_tree_recompute", "accepted=nullptr", [](AnyParams& ap, Scratch&) { as<CP>(ap).accepted = nullptr; },
       "accepted: required pointer is null"},
      {"prefill_int32_host_ckpt", "checkpoint_interval=96",
       [](AnyParams& ap, Scratch&) { as<PP>(ap).checkpoint_interval = 96; },
       "checkpoint_interval: expected 0 or a multiple of 64 (the chunk), got 96"},
      {"prefill_int32_host_ckpt", "checkpoint_interval=-64",
       [](AnyParams& ap, Scratch&) { as<PP>(ap).checkpoint_interval = -64; },
       "checkpoint_interval: expected 0 or a multiple"},
      {"prefill_int32_host_ckpt", "checkpoints.data=nullptr",
       [](AnyParams& ap, Scratch&) { as<PP>(ap).checkpoints.data = nullptr; },
       "checkpoints: required pointer is null (checkpoint_interval=64)"},
      {"prefill_int32_host_ckpt", "checkpoint_indices=nullptr",
       [](AnyParams& ap, Scratch&) { as<PP>(ap).checkpoint_indices = nullptr; },
       "checkpoint_indices: required pointer is null"},
      {"prefill_int32_host_ckpt", "cu_seqlens_host decreasing",
       [](AnyParams& ap, Scratch& sc) {
         std::vector<int64_t> h = {0, 70, 60, 75, 95};
         as<PP>(ap).cu_seqlens_host = reinterpret_cast<const int64_t*>(sc.copy(h.data(), h.size() * 8));
       },
       "cu_seqlens_host: must be non-decreasing (index 2: 70 > 60)"},
      {"prefill_int32_host_ckpt", "cu_seqlens (device copy) wrong end, host copy right",
       [](AnyParams& ap, Scratch& sc) {
         std::vector<int32_t> d = {0, 70, 75, 75, 94};
         as<PP>(ap).cu_seqlens = sc.copy(d.data(), d.size() * 4);
       },
       "cu_seqlens: last entry (index 4) must equal total_tokens=95, got 94", false},
      {"prefill_int32_host_ckpt", "total_tokens=96", [](AnyParams& ap, Scratch&) { as<PP>(ap).total_tokens = 96; },
       "cu_seqlens_host: last entry (index 4) must equal total_tokens=96, got 95"},
      {"prefill_int32_host_ckpt", "num_seqs=-1", [](AnyParams& ap, Scratch&) { as<PP>(ap).num_seqs = -1; },
       "num_seqs: must be >= 0"},
      {"prefill_int32_host_ckpt", "cu_seqlens_dtype=float32",
       [](AnyParams& ap, Scratch&) { as<PP>(ap).cu_seqlens_dtype = DType::kFloat32; },
       "cu_seqlens: expected dtype int32 or int64, got float32"},
      {"prefill_int32_host_ckpt", "cu_seqlens=nullptr",
       [](AnyParams& ap, Scratch&) { as<PP>(ap).cu_seqlens = nullptr; },
       "cu_seqlens: required pointer is null"},
      {"prefill_int64_nohost_given", "cu_seqlens (int64) non-monotonic, no host copy",
       [](AnyParams& ap, Scratch& sc) {
         std::vector<int64_t> d = {0, 9, 3};
         as<PP>(ap).cu_seqlens = sc.copy(d.data(), d.size() * 8);
       },
       "cu_seqlens: must be non-decreasing (index 2: 9 > 3)", false},
      {"prefill_int64_nohost_given", "cu_seqlens (int64) +4B",
       [](AnyParams& ap, Scratch& sc) { as<PP>(ap).cu_seqlens = shifted(sc.copy(as<PP>(ap).cu_seqlens, 24), 4); },
       "cu_seqlens: data pointer"},
      {"prefill_int32_host_ckpt", "initial_indices+=1B", [](AnyParams& ap, Scratch&) {
         as<PP>(ap).initial_indices = reinterpret_cast<const int32_t*>(shifted(as<PP>(ap).initial_indices, 1)); },
       "initial_indices: data pointer"},
      {"prefill_int32_host_ckpt", "state.data=nullptr with initial/final indices",
       [](AnyParams& ap, Scratch&) { as<PP>(ap).state.data = nullptr; }, "state: required pointer is null"},
      {"prefill_chunked_empty_seqs", "cpu_algorithm=5", [](AnyParams& ap, Scratch&) {
         as<PP>(ap).cpu_algorithm = PrefillAlgorithm(5); }, "cpu_algorithm: unknown value 5"},
      {"layout_out_of_place", "dst.layout=src.layout (a conversion between equal layouts)",
       [](AnyParams& ap, Scratch&) { as<LP>(ap).dst.layout = as<LP>(ap).src.layout; }, "dst: expected layout V-last"},
      {"layout_out_of_place", "dst.dtype=bfloat16",
       [](AnyParams& ap, Scratch&) { as<LP>(ap).dst.dtype = DType::kBFloat16; },
       "dst: expected dtype float32 (the dtype of src)"},
      {"layout_out_of_place", "dst.num_slots=P-1", [](AnyParams& ap, Scratch&) { as<LP>(ap).dst.num_slots -= 1; },
       "dst: expected num_slots="},
      {"layout_out_of_place", "dst overlaps src", [](AnyParams& ap, Scratch&) {
         as<LP>(ap).dst.data = static_cast<float*>(as<LP>(ap).src.data) + 4 * 64 * 64; }, "dst: overlaps src"},
      {"layout_k64_v128", "in place with K != V",
       [](AnyParams& ap, Scratch&) { as<LP>(ap).dst.data = as<LP>(ap).src.data; },
       "dst: in-place conversion needs K == V, got K=64, V=128"},
      {"layout_in_place_bf16", "in place, other slot stride",
       [](AnyParams& ap, Scratch&) { as<LP>(ap).dst.slot_stride += 8; }, "dst: in-place conversion needs slot_stride="},
      {"layout_out_of_place", "num_v_heads=0", [](AnyParams& ap, Scratch&) { as<LP>(ap).num_v_heads = 0; },
       "src: number of value heads HV must be > 0"},
      {"layout_out_of_place", "src.data=nullptr", [](AnyParams& ap, Scratch&) { as<LP>(ap).src.data = nullptr; },
       "src: required pointer is null"},
  };
}

TEST(FuzzParams, ImportantSingleMutations) {
  auto prepared = prepare();
  for (const Single& sm : singles()) {
    auto it = std::find_if(prepared.begin(), prepared.end(), [&](const auto& p) { return p->base.name == sm.base; });
    ASSERT_NE(it, prepared.end()) << sm.base;
    Prepared& pr = **it;
    AnyParams ap = make_params(pr.base, pr.work);
    Scratch scratch;
    sm.apply(ap, scratch);
    const std::string line = std::string(sm.base) + " / " + sm.what;
    const Outcome v = attempt([&] { validate_any(ap, Backend::kCPU); });
    EXPECT_TRUE(v.threw && v.library_error) << line << ": " << (v.threw ? v.message : "accepted");
    EXPECT_NE(v.message.find(sm.text), std::string::npos) << line << ": \"" << v.message << "\"";
    const Outcome e = attempt([&] { run_any(ap); });
    EXPECT_EQ(e.message, v.message) << line;
    EXPECT_EQ(changed_buffer(pr.work, pr.pristine), "") << line << ": written although the call threw";
    restore(pr.work, pr.pristine);
    if (!pr.cuda_valid) continue;
    const Outcome vc = attempt([&] { validate_any(ap, Backend::kCUDA); });
    if (sm.cuda) {
      EXPECT_TRUE(vc.threw && vc.library_error) << line << " (cuda): " << (vc.threw ? vc.message : "accepted");
      EXPECT_NE(vc.message.find(sm.text), std::string::npos) << line << " (cuda): \"" << vc.message << "\"";
    } else if (vc.threw) {
      const std::string field = std::string(sm.text).substr(0, std::string(sm.text).find(':'));
      EXPECT_TRUE(vc.library_error && names_any(vc.message, {field}))
          << line << " (cuda): \"" << vc.message << "\"";
    }
  }
}

// ---- non-finite inputs ----------------------------------------------------------------------------
// docs/semantics.md "Non-finite values": a NaN reaches the outputs and states of the sequence and value
// heads that read it, from its token on, and nothing else; the library does not scan for it.

// Element i of head h of token t of a token tensor (q, k, v, or a gate with h the value head, i = 0).
void poison_token(Problem& p, const std::string& name, int64_t t, int h, int i, double value) {
  const DType dtype = name == "q" || name == "k" || name == "v" ? p.config().in_dtype
                      : name == "g"                            ? DType::kFloat32
                                                               : p.config().gate_dtype;
  host::store(p.buffer(name).bytes.data(), dtype, t * p.token_stride(name) + h * p.head_stride(name) + i, value);
}

// Per value head h and token t: must the poisoned run's o be NaN, equal to the clean run, or either?
struct Poisoned {
  int32_t row = 0;           // the sequence that reads the non-finite value
  int64_t first_token = 0;   // global token index from which its outputs are non-finite
  int64_t first_maybe = 0;   // before this, its outputs equal the clean run's (chunked forms: the chunk start)
  std::vector<int> heads;    // the value heads it reaches
  bool nan_only = true;      // NaN (else: non-finite, Inf or NaN)
};

bool bad_value(double x, bool nan_only) { return nan_only ? std::isnan(x) : !std::isfinite(x); }

// o of every token, the pool slots (`written`: row -> slot the op stores into), error_flag.
void expect_poisoned(const Problem& clean, const Problem& bad, const Poisoned& ps,
                     const std::vector<std::pair<int32_t, int64_t>>& written, const std::string& what) {
  const auto& cfg = clean.config();
  const std::vector<double> oc = clean.read_tokens("o"), ob = bad.read_tokens("o");
  const int64_t lo = clean.row_start(ps.row), hi = lo + clean.row_len(ps.row);
  int64_t bad_count = 0, mismatch = 0;
  for (int64_t t = 0; t < clean.total_tokens(); ++t)
    for (int h = 0; h < cfg.HV; ++h) {
      const bool reached = t >= lo && t < hi && std::count(ps.heads.begin(), ps.heads.end(), h) > 0;
      for (int i = 0; i < cfg.V; ++i) {
        const size_t at = (size_t(t) * cfg.HV + h) * cfg.V + i;
        if (reached && t >= ps.first_token) {
          bad_count += !bad_value(ob[at], ps.nan_only);
        } else if (!reached || t < ps.first_maybe) {
          mismatch += !(ob[at] == oc[at]);
        }
      }
    }
  EXPECT_EQ(bad_count, 0) << what << ": outputs of the poisoned sequence that stayed finite";
  EXPECT_EQ(mismatch, 0) << what << ": outputs of other sequences / heads / earlier tokens that changed";
  for (int64_t slot = 0; slot < clean.num_slots(); ++slot) {
    const auto w = std::find_if(written.begin(), written.end(), [&](const auto& x) { return x.second == slot; });
    const bool reached_slot = w != written.end() && w->first == ps.row;
    const std::vector<double> sc = clean.read_state("state", slot), sb = bad.read_state("state", slot);
    const int64_t per_head = int64_t(cfg.K) * cfg.V;
    for (int h = 0; h < cfg.HV; ++h) {
      const bool reached = reached_slot && std::count(ps.heads.begin(), ps.heads.end(), h) > 0;
      int64_t wrong = 0;
      for (int64_t e = h * per_head; e < (h + 1) * per_head; ++e)
        wrong += reached ? !bad_value(sb[e], ps.nan_only)
                         : std::memcmp(&sb[e], &sc[e], sizeof(double)) != 0;  // NaN-filled slots: bits
      EXPECT_EQ(wrong, 0) << what << ": slot " << slot << " head " << h << (reached ? " not poisoned" : " changed");
    }
  }
  EXPECT_EQ(bad.as<int32_t>("error_flag")[0], clean.as<int32_t>("error_flag")[0]) << what << ": error_flag";
}

std::vector<int> group_of(const ProblemConfig& cfg, int qk_head) {
  std::vector<int> out;
  for (int h = 0; h < cfg.HV; ++h)
    if (h / (cfg.HV / cfg.H) == qk_head) out.push_back(h);
  return out;
}

TEST(FuzzNonFinite, DecodeNaNInKPoisonsItsRowAndSlotOnly) {
  ProblemConfig cfg;
  cfg.op = OpKind::kDecode;
  cfg.batch = 4;
  cfg.padding_rows = 1;
  for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast}) {
    cfg.layout = layout;
    Problem clean(cfg);
    const int32_t* si = clean.as<int32_t>("state_indices");
    const int32_t row = si[1] >= 0 ? 1 : 2;
    Problem bad = clean;
    poison_token(bad, "k", row, 1, 7, std::numeric_limits<double>::quiet_NaN());
    decode(clean.decode_params(), {Backend::kCPU, nullptr});
    decode(bad.decode_params(), {Backend::kCPU, nullptr});
    std::vector<std::pair<int32_t, int64_t>> written;
    for (int32_t r = 0; r < clean.rows(); ++r)
      if (si[r] >= 0) written.push_back({r, si[r]});
    expect_poisoned(clean, bad, {row, row, row, group_of(cfg, 1), true}, written, "decode k NaN");
  }
}

TEST(FuzzNonFinite, DecodeNaNPoolSlotAndInfValue) {
  ProblemConfig cfg;
  cfg.op = OpKind::kDecode;
  cfg.batch = 3;
  Problem clean(cfg);
  const int32_t* si = clean.as<int32_t>("state_indices");
  std::vector<std::pair<int32_t, int64_t>> written;
  for (int32_t r = 0; r < clean.rows(); ++r) written.push_back({r, si[r]});
  {
    // A NaN head in a pool slot: that head of the row reading it. (A single NaN element S[k][v] reaches
    // column v only: the columns of S evolve independently.)
    Problem c = clean, bad = clean;
    std::vector<double> s = bad.read_state("state", si[2]);
    for (int e = 0; e < 64 * 64; ++e) s[2 * 64 * 64 + e] = std::numeric_limits<double>::quiet_NaN();
    bad.write_state("state", si[2], s);
    decode(c.decode_params(), {Backend::kCPU, nullptr});
    decode(bad.decode_params(), {Backend::kCPU, nullptr});
    expect_poisoned(c, bad, {2, 2, 2, {2}, true}, written, "decode NaN in the pool");
  }
  {
    // +Inf in v: the row's head goes non-finite (Inf, or NaN once Inf - Inf), nothing else.
    Problem c = clean, bad = clean;
    poison_token(bad, "v", 0, 3, 0, std::numeric_limits<double>::infinity());
    decode(c.decode_params(), {Backend::kCPU, nullptr});
    decode(bad.decode_params(), {Backend::kCPU, nullptr});
    // Only column 0 of row 0's head 3 holds the Inf, in o and in that row's slot: every other element of o and of
    // the pool as the clean run wrote it.
    const auto same = [](double x, double y) { return x == y || (std::isnan(x) && std::isnan(y)); };
    const auto ob = bad.read_tokens("o"), oc = c.read_tokens("o");
    for (size_t at = 0; at < ob.size(); ++at) {
      if (at == (size_t(0) * 4 + 3) * 64) {
        EXPECT_FALSE(std::isfinite(ob[at]));
      } else {
        EXPECT_TRUE(same(ob[at], oc[at])) << "v Inf leaked into o " << at;
      }
    }
    for (int64_t slot = 0; slot < clean.num_slots(); ++slot) {
      const auto sb = bad.read_state("state", slot), sc = c.read_state("state", slot);
      for (size_t e = 0; e < sb.size(); ++e) {
        const bool column = slot == si[0] && e / (64 * 64) == 3 && e % 64 == 0;  // S[3][k][0]
        if (!column)
          EXPECT_TRUE(same(sb[e], sc[e])) << "v Inf leaked into slot " << slot << " element " << e;
      }
    }
  }
  {
    // Saturating gates stay finite and exact: a = +Inf decays the state to 0, b = -Inf makes beta 0 (the fp64
    // model of the same inputs).
    Problem bad = clean;
    poison_token(bad, "a", 1, 0, 0, std::numeric_limits<double>::infinity());
    poison_token(bad, "b", 1, 1, 0, -std::numeric_limits<double>::infinity());
    const Problem bad_before = bad;
    decode(bad.decode_params(), {Backend::kCPU, nullptr});
    EXPECT_EQ(bad.as<int32_t>("error_flag")[0], 0);
    const NaiveModel model(bad_before);
    const auto o = bad.read_tokens("o");
    const size_t row_len = o.size() / size_t(bad.rows());
    for (int32_t r = 0; r < bad.rows(); ++r) {
      if (si[r] < 0) continue;  // a padding row
      std::vector<double> want;
      const std::vector<double> S = model.run(bad_before.read_state("state", si[r]), {r}, &want);
      const std::vector<double> got(o.begin() + r * row_len, o.begin() + (r + 1) * row_len);
      EXPECT_TRUE(RelClose("o of row " + std::to_string(r), got, want,
                           test::output_tolerance(test::OpFamily::kStep, cfg.in_dtype)));
      EXPECT_TRUE(RelClose("state of row " + std::to_string(r), bad.read_state("state", si[r]), S,
                           test::state_tolerance(test::OpFamily::kStep, cfg.state_dtype)));
    }
  }
}

TEST(FuzzNonFinite, VerifyNaNPoisonsFromItsTokenOn) {
  for (bool tree : {false, true}) {
    ProblemConfig cfg;
    cfg.op = OpKind::kVerify;
    cfg.batch = 3;
    cfg.draft_tokens = 5;
    cfg.update_state = !tree;
    cfg.tree = tree;
    Problem clean(cfg), bad = clean;
    const int32_t row = 1;
    const int64_t tok = clean.row_start(row) + 2;
    poison_token(bad, "k", tok, 0, 3, std::numeric_limits<double>::quiet_NaN());
    verify(clean.verify_params(), {Backend::kCPU, nullptr});
    verify(bad.verify_params(), {Backend::kCPU, nullptr});
    std::vector<std::pair<int32_t, int64_t>> written;
    if (!tree)
      for (int32_t r = 0; r < clean.rows(); ++r) written.push_back({r, clean.as<int32_t>("state_indices")[r]});
    Poisoned ps{row, tok, tok, group_of(cfg, 0), true};
    if (tree) {
      // In a tree only the poisoned token and its descendants read it: the token itself is NaN, earlier
      // tokens (never descendants) are equal, later ones depend on the tree.
      const auto ob = bad.read_tokens("o");
      for (int h : ps.heads)
        for (int i = 0; i < cfg.V; ++i) EXPECT_TRUE(std::isnan(ob[(size_t(tok) * cfg.HV + h) * cfg.V + i]));
      ps.first_token = clean.row_start(row) + clean.row_len(row);
    }
    expect_poisoned(clean, bad, ps, written, tree ? "verify tree k NaN" : "verify chain k NaN");
    // Intermediate states: steps before the token equal, steps from it (chain) NaN in the reached heads.
    const int64_t islot = clean.as<int32_t>("intermediate_indices")[row];
    for (int64_t step = 0; step < cfg.draft_tokens; ++step) {
      const auto a = clean.read_cache("intermediate", islot, step), b = bad.read_cache("intermediate", islot, step);
      int64_t wrong = 0;
      for (size_t e = 0; e < a.size(); ++e) {
        const int h = int(e / (cfg.K * cfg.V));
        const bool reached = std::count(ps.heads.begin(), ps.heads.end(), h) > 0;
        if (step < 2 || !reached) {
          wrong += !(a[e] == b[e]);
        } else if (!tree || step == 2) {
          wrong += !std::isnan(b[e]);
        }
      }
      EXPECT_EQ(wrong, 0) << (tree ? "tree" : "chain") << " intermediate step " << step;
    }
  }
}

TEST(FuzzNonFinite, PrefillNaNPoisonsItsSequenceOnly) {
  for (PrefillAlgorithm algo : {PrefillAlgorithm::kRecurrent, PrefillAlgorithm::kChunked}) {
    ProblemConfig cfg;
    cfg.op = OpKind::kPrefill;
    cfg.seq_lens = {70, 150, 9};
    cfg.checkpoint_interval = 64;
    Problem clean(cfg), bad = clean;
    const int32_t row = 1;
    const int64_t tok = clean.row_start(row) + 100;  // token 100 of the sequence: its second chunk
    poison_token(bad, "k", tok, 1, 0, std::numeric_limits<double>::quiet_NaN());
    prefill(clean.prefill_params(algo), {Backend::kCPU, nullptr});
    prefill(bad.prefill_params(algo), {Backend::kCPU, nullptr});
    std::vector<std::pair<int32_t, int64_t>> written;
    for (int32_t r = 0; r < clean.rows(); ++r) written.push_back({r, clean.as<int32_t>("final_indices")[r]});
    // The chunked form computes a 64-token chunk at once: earlier tokens of the chunk may be reached too.
    const int64_t chunk_start = clean.row_start(row) + 64;
    const bool chunked = algo == PrefillAlgorithm::kChunked;
    expect_poisoned(clean, bad, {row, tok, chunked ? chunk_start : tok, group_of(cfg, 1), true}, written,
                    chunked ? "prefill chunked k NaN" : "prefill recurrent k NaN");
    // Checkpoint after token 64 (before the NaN) equal; after token 128 NaN in the reached heads.
    const int64_t cslot = clean.as<int32_t>("checkpoint_indices")[row];
    const auto c0 = clean.read_cache("checkpoints", cslot, 0), b0 = bad.read_cache("checkpoints", cslot, 0);
    EXPECT_TRUE(c0 == b0) << "checkpoint before the NaN changed";
    const auto b1 = bad.read_cache("checkpoints", cslot, 1);
    const auto c1 = clean.read_cache("checkpoints", cslot, 1);
    for (size_t e = 0; e < b1.size(); ++e) {
      const int h = int(e / (cfg.K * cfg.V));
      if (h / (cfg.HV / cfg.H) == 1) {
        ASSERT_TRUE(std::isnan(b1[e])) << "checkpoint after the NaN, head " << h;
      } else {
        ASSERT_EQ(b1[e], c1[e]) << "checkpoint after the NaN, head " << h;
      }
    }
  }
}

}  // namespace
}  // namespace gdnkit
