// gdnkit._gdnkit: the nanobind binding over the C++ API (include/gdnkit/gdnkit.h).
//
// Arrays arrive through DLPack (torch, CuPy, JAX, NumPy, ...). This file turns them into the params
// structs: it reads shapes, strides and dtypes, checks what the structs cannot carry (ranks, shapes
// that must agree between tensors, one device for all tensors, contiguous last dims, int32 indices),
// picks the backend from the arrays' device and calls the library, which validates the rest.
// Every failure is a gdnkit::Error; the translator at the bottom maps its code to a Python exception.
//
// The Python layer (gdnkit/ops.py) allocates outputs and passes the caller's CUDA stream; nothing here
// allocates device memory or synchronizes, so every call is safe inside CUDA-graph capture.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/message.h"
#include "gdnkit/gdnkit.h"

#ifdef GDNKIT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace nb = nanobind;

namespace gdnkit::py {
namespace {

using Array = nb::ndarray<>;
using OptArray = std::optional<nb::ndarray<>>;

using msg::fail;

std::string shape_str(const Array& a) {
  std::string s = "[";
  for (size_t i = 0; i < a.ndim(); ++i) msg::append(s, msg::cat(i ? ", " : "", a.shape(i)));
  return s + "]";
}

// DLPack 1.1's codes of the 8-bit float types a state and its scales may have (torch.float8_e4m3fn,
// torch.float8_e8m0fnu), as numbers: older nanobind headers do not name them.
constexpr uint8_t kDLFloat8E4M3FN = 10, kDLFloat8E8M0FNU = 14;

std::string dl_dtype_name(nb::dlpack::dtype d) {
  using C = nb::dlpack::dtype_code;
  if (d.lanes == 1 && d.bits == 8 && d.code == kDLFloat8E4M3FN) return "float8_e4m3fn";
  if (d.lanes == 1 && d.bits == 8 && d.code == kDLFloat8E8M0FNU) return "float8_e8m0fnu";
  if (d.bits == 8 && d.code >= 7 && d.code <= 14) return "float8 (DLPack type code " + std::to_string(d.code) + ")";
  const char* kind = "dtype";
  switch (C(d.code)) {
    case C::Int: kind = "int"; break;
    case C::UInt: kind = "uint"; break;
    case C::Float: kind = "float"; break;
    case C::Bfloat: kind = "bfloat"; break;
    case C::Complex: kind = "complex"; break;
    case C::Bool: return "bool";
    default: break;
  }
  std::string s = kind + std::to_string(d.bits);
  if (d.lanes != 1) s += "x" + std::to_string(d.lanes);
  return s;
}

// The float dtypes gdnkit computes with; anything else is an error that names the tensor.
DType float_dtype(const Array& a, const char* name) {
  const auto d = a.dtype();
  if (d == nb::dtype<float>()) return DType::kFloat32;
  if (d.lanes == 1 && d.bits == 16 && d.code == uint8_t(nb::dlpack::dtype_code::Bfloat)) return DType::kBFloat16;
  if (d.lanes == 1 && d.bits == 16 && d.code == uint8_t(nb::dlpack::dtype_code::Float)) return DType::kFloat16;
  fail(name, ": expected dtype float32, bfloat16 or float16, got ", dl_dtype_name(d));
}

// ---- devices: one per call, which picks the backend ------------------------------------------

struct Devices {
  const char* first_name = nullptr;
  int32_t type = 0;
  int32_t id = 0;

  static std::string str(int32_t type, int32_t id) {
    if (type == nb::device::cpu::value) return "cpu";
    if (type == nb::device::cuda::value) return "cuda:" + std::to_string(id);
    if (type == nb::device::cuda_managed::value) return "cuda_managed:" + std::to_string(id);
    if (type == nb::device::cuda_host::value) return "cuda_host (pinned)";
    return "DLPack device type " + std::to_string(type) + ":" + std::to_string(id);
  }

  void add(const Array& a, const char* name) {
    int32_t type = a.device_type(), id = a.device_id();
    if (type == nb::device::cuda_managed::value) type = nb::device::cuda::value;
    if (type == nb::device::cpu::value) id = 0;
    if (type != nb::device::cpu::value && type != nb::device::cuda::value)
      fail(name, ": arrays on ", str(a.device_type(), a.device_id()),
           " are not supported (expected cpu or cuda)");
    if (first_name == nullptr) {
      first_name = name;
      this->type = type;
      this->id = id;
    } else if (type != this->type || id != this->id) {
      fail(name, ": is on ", str(type, id), " but ", first_name, " is on ", str(this->type, this->id),
           " (all arrays of one call must be on one device)");
    }
  }
  void add(const OptArray& a, const char* name) {
    if (a) add(*a, name);
  }

  Backend backend() const {
    return type == nb::device::cuda::value ? Backend::kCUDA : Backend::kCPU;
  }
};

// The caller's device is made current for the call (a CUDA stream belongs to one device).
class DeviceGuard {
 public:
  explicit DeviceGuard(const Devices& d) {
#ifdef GDNKIT_WITH_CUDA
    if (d.backend() != Backend::kCUDA) return;
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      cudaGetLastError();
      return;
    }
    if (previous_ != d.id) {
      if (cudaSetDevice(d.id) != cudaSuccess) {
        cudaGetLastError();
        throw Error(ErrorCode::kCudaError, "cudaSetDevice(" + std::to_string(d.id) + ") failed");
      }
      restore_ = true;
    }
#else
    (void)d;
#endif
  }
  ~DeviceGuard() {
#ifdef GDNKIT_WITH_CUDA
    if (restore_) cudaSetDevice(previous_);
#endif
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool restore_ = false;
};

Context make_context(const Devices& d, uintptr_t stream) {
  Context ctx;
  ctx.backend = d.backend();
  ctx.stream = reinterpret_cast<Stream>(stream);
  return ctx;
}

// ---- token data: [T, heads, dim] or [B, T, heads, dim] (B and T merged) ----------------------

struct Tokens {
  int64_t count = 0;  // T_total
  int64_t heads = 0;
  int64_t dim = 0;
  int64_t token_stride = 0;
  int64_t head_stride = 0;
  int64_t batch = -1;  // B of a 4-d [B, T, ...] array, -1 for 3-d
  int64_t per_batch = -1;  // T of a 4-d array
  DType dtype = DType::kFloat32;
  void* data = nullptr;
};

// Merges the leading [B, T] of a (dims+2)-d array into one token axis when the strides allow it.
// rank: 3 for q/k/v/o ([T, heads, dim]), 2 for gates ([T, heads]).
void merge_tokens(const Array& a, const char* name, size_t rank, Tokens& t) {
  const size_t nd = a.ndim();
  if (nd == rank) {
    t.count = int64_t(a.shape(0));
    t.token_stride = a.stride(0);
  } else if (nd == rank + 1) {
    const int64_t B = a.shape(0), T = a.shape(1);
    t.batch = B;
    t.per_batch = T;
    t.count = B * T;
    t.token_stride = a.stride(1);
    if (T == 1) t.token_stride = a.stride(0);
    if (B > 1 && T > 1 && a.stride(0) != T * a.stride(1))
      fail(name, ": the batch and token axes of shape ", shape_str(a), " cannot be merged (stride(0)=", a.stride(0),
           ", expected T*stride(1)=", T * a.stride(1), ")");
  } else {
    fail(name, ": expected ", rank, " dims ", rank == 3 ? "[T, heads, dim]" : "[T, heads]", " or ", rank + 1,
         " dims ", rank == 3 ? "[B, T, heads, dim]" : "[B, T, heads]", ", got shape ", shape_str(a));
  }
}

Tokens token_rows(const Array& a, const char* name) {
  Tokens t;
  merge_tokens(a, name, 3, t);
  const size_t nd = a.ndim();
  t.heads = a.shape(nd - 2);
  t.dim = a.shape(nd - 1);
  t.head_stride = a.stride(nd - 2);
  if (t.dim > 1 && a.stride(nd - 1) != 1)
    fail(name, ": the last dim must be contiguous (stride 1), got stride ", a.stride(nd - 1), " for shape ",
         shape_str(a));
  t.dtype = float_dtype(a, name);
  t.data = a.data();
  return t;
}

// A per-head scalar array [T, HV] (or [B, T, HV]); heads may be strided.
InView gate_view(const Array& a, const char* name, int64_t tokens, int64_t hv) {
  Tokens t;
  merge_tokens(a, name, 2, t);
  const int64_t heads = a.shape(a.ndim() - 1);
  if (t.count != tokens || heads != hv)
    fail(name, ": expected shape [", tokens, ", ", hv, "] (tokens, HV), got ", shape_str(a));
  InView v;
  v.data = a.data();
  v.dtype = float_dtype(a, name);
  v.token_stride = t.token_stride;
  v.head_stride = a.stride(a.ndim() - 1);
  return v;
}

template <class View>
View to_view(const Tokens& t) {
  View v;
  v.data = t.data;
  v.dtype = t.dtype;
  v.token_stride = t.token_stride;
  v.head_stride = t.head_stride;
  return v;
}

void require_shape(const Tokens& t, const char* name, int64_t count, int64_t heads, int64_t dim, const char* what) {
  if (t.count != count || t.heads != heads || t.dim != dim)
    fail(name, ": expected ", what, " = [", count, ", ", heads, ", ", dim, "], got [", t.count, ", ", t.heads, ", ",
         t.dim, "]");
}

// ---- 1-d arrays: per-head parameters and indices --------------------------------------------

const float* head_params(const Array& a, const char* name, int64_t hv) {
  if (a.ndim() != 1 || int64_t(a.shape(0)) != hv)
    fail(name, ": expected shape [", hv, "] (HV), got ", shape_str(a));
  if (a.dtype() != nb::dtype<float>()) fail(name, ": expected dtype float32, got ", dl_dtype_name(a.dtype()));
  if (hv > 1 && a.stride(0) != 1) fail(name, ": expected a contiguous array, got stride ", a.stride(0));
  return static_cast<const float*>(a.data());
}

// Any shape, its elements contiguous in row-major order.
void require_contiguous(const Array& a, const char* name) {
  int64_t expect = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) > 1 && a.stride(i) != expect)
      fail(name, ": expected a contiguous array, got shape ", shape_str(a), " with stride ", a.stride(i),
           " on dim ", i);
    expect *= a.shape(i);
  }
}

// An int32 index array of `count` elements (any shape, contiguous): state_indices, accepted, parent ...
int32_t* index_array(const Array& a, const char* name, int64_t count, const char* what) {
  if (a.dtype() != nb::dtype<int32_t>()) fail(name, ": expected dtype int32, got ", dl_dtype_name(a.dtype()));
  if (int64_t(a.size()) != count) fail(name, ": expected ", what, ", got shape ", shape_str(a));
  require_contiguous(a, name);
  return static_cast<int32_t*>(a.data());
}

int32_t* opt_index(const OptArray& a, const char* name, int64_t count, const char* what) {
  return a ? index_array(*a, name, count, what) : nullptr;
}

int32_t* error_flag_ptr(const OptArray& a) {
  if (!a) return nullptr;
  if (a->dtype() != nb::dtype<int32_t>()) fail("error_flag: expected dtype int32, got ", dl_dtype_name(a->dtype()));
  if (a->size() < 1) fail("error_flag: expected at least 1 element, got shape ", shape_str(*a));
  return static_cast<int32_t*>(a->data());
}

// ---- state pools and caches -------------------------------------------------------------------

// name: the argument that carries it ("layout", or convert_layout's "src_layout").
StateLayout parse_layout(const std::string& s, const char* name = "layout") {
  if (s == "k_last") return StateLayout::kKLast;
  if (s == "v_last") return StateLayout::kVLast;
  fail(name, ": expected 'k_last' ([P, HV, V, K]) or 'v_last' ([P, HV, K, V]), got '", s, "'");
}

const char* layout_shape(StateLayout l) { return l == StateLayout::kKLast ? "[.., HV, V, K]" : "[.., HV, K, V]"; }

// A state pool or cache: the float dtypes, or float8_e4m3fn with block scales (state_scales below).
DType state_dtype(const Array& a, const char* name) {
  const auto d = a.dtype();
  if (d.lanes == 1 && d.bits == 8 && d.code == kDLFloat8E4M3FN) return DType::kFloat8E4M3;
  if (d == nb::dtype<float>()) return DType::kFloat32;
  if (d.lanes == 1 && d.bits == 16 && d.code == uint8_t(nb::dlpack::dtype_code::Bfloat)) return DType::kBFloat16;
  if (d.lanes == 1 && d.bits == 16 && d.code == uint8_t(nb::dlpack::dtype_code::Float)) return DType::kFloat16;
  fail(name, ": expected dtype float32, bfloat16, float16 or float8_e4m3fn, got ", dl_dtype_name(d));
}

// The block scales of a state array of `entries` slots (or slots x steps): for float8_e4m3fn, one E8M0 byte per
// 32 consecutive elements of a head in its layout (docs/semantics.md "float8_e4m3 states"), `per_entry` a slot,
// contiguous, uint8 or float8_e8m0fnu; none for the other dtypes.
uint8_t* state_scales(const OptArray& s, const char* name, const char* state_name, DType dt, int64_t entries,
                      int64_t hv, int64_t k, int64_t v, const char* entries_what) {
  if (dt != DType::kFloat8E4M3) {
    if (s) fail(name, ": only with a float8_e4m3fn ", state_name, ", got ", state_name, " of dtype ", dtype_name(dt));
    return nullptr;
  }
  if (hv * k * v % kFp8Block != 0)
    fail(state_name, ": float8_e4m3fn needs HV*K*V a multiple of ", kFp8Block, ", got HV=", hv, ", K=", k, ", V=", v);
  const int64_t per_entry = hv * k * v / kFp8Block;
  const std::string want = msg::cat("[", entries_what, ", HV*K*V/", kFp8Block, "] = [", entries, ", ", per_entry, "]");
  if (!s) fail(name, ": required with a float8_e4m3fn ", state_name, " (uint8 ", want, ": one E8M0 scale byte per ",
               kFp8Block, " elements)");
  const auto d = s->dtype();
  const bool byte = d.lanes == 1 && d.bits == 8 && (d.code == uint8_t(nb::dlpack::dtype_code::UInt) || d.code == kDLFloat8E8M0FNU);
  if (!byte) fail(name, ": expected dtype uint8 or float8_e8m0fnu, got ", dl_dtype_name(d));
  if (int64_t(s->size()) != entries * per_entry) fail(name, ": expected ", want, " bytes, got shape ", shape_str(*s));
  require_contiguous(*s, name);
  return static_cast<uint8_t*>(s->data());
}

// The last three dims [HV, d1, d2] must be packed (heads of one slot are HV*K*V contiguous elements);
// `lead` leading dims (slots, or slots and steps) may be strided. Returns the stride of dim 0.
void check_state_tail(const Array& a, const char* name, size_t lead, int64_t hv, int64_t k, int64_t v,
                      StateLayout layout) {
  const int64_t d1 = layout == StateLayout::kKLast ? v : k;
  const int64_t d2 = layout == StateLayout::kKLast ? k : v;
  if (a.ndim() != lead + 3 || int64_t(a.shape(lead)) != hv || int64_t(a.shape(lead + 1)) != d1 ||
      int64_t(a.shape(lead + 2)) != d2) {
    const std::string want = msg::cat("[", lead == 1 ? "P" : "Q, S", ", ", hv, ", ", d1, ", ", d2, "]");
    fail(name, ": expected shape ", want, " (", layout == StateLayout::kKLast ? "k_last: [.., HV, V, K]"
                                                                                     : "v_last: [.., HV, K, V]",
         " with HV=", hv, ", K=", k, ", V=", v, "), got ", shape_str(a));
  }
  if (a.stride(lead + 2) != 1 || a.stride(lead + 1) != d2 || (hv > 1 && a.stride(lead) != d1 * d2))
    fail(name, ": the last three dims ", layout_shape(layout), " must be contiguous, got strides (", a.stride(lead),
         ", ", a.stride(lead + 1), ", ", a.stride(lead + 2), ")");
}

StatePool make_pool(const Array& a, const char* name, int64_t hv, int64_t k, int64_t v, StateLayout layout,
                    const OptArray& scales, const char* scales_name) {
  check_state_tail(a, name, 1, hv, k, v, layout);
  StatePool p;
  p.data = a.data();
  p.dtype = state_dtype(a, name);
  p.layout = layout;
  p.num_slots = a.shape(0);
  p.slot_stride = a.shape(0) > 1 ? a.stride(0) : hv * k * v;
  p.scales = state_scales(scales, scales_name, name, p.dtype, p.num_slots, hv, k, v, "P");
  return p;
}

StateCache make_cache(const Array& a, const char* name, int64_t hv, int64_t k, int64_t v, StateLayout layout,
                      const OptArray& scales, const char* scales_name) {
  check_state_tail(a, name, 2, hv, k, v, layout);
  const int64_t steps = a.shape(1);
  if (steps > 1 && a.stride(1) != hv * k * v)
    fail(name, ": steps must be HV*K*V=", hv * k * v, " elements apart, got stride(1)=", a.stride(1));
  StateCache c;
  c.data = a.data();
  c.dtype = state_dtype(a, name);
  c.layout = layout;
  c.num_slots = a.shape(0);
  c.num_steps = steps;
  c.slot_stride = a.shape(0) > 1 ? a.stride(0) : steps * hv * k * v;
  c.scales = state_scales(scales, scales_name, name, c.dtype, c.num_slots * steps, hv, k, v, "Q*S");
  return c;
}

// ---- heads and gates shared by the token ops --------------------------------------------------

HeadConfig make_heads(const Tokens& qk, const Tokens& v, std::optional<double> scale, bool use_qk_l2norm) {
  HeadConfig h;
  h.num_qk_heads = int32_t(qk.heads);
  h.num_v_heads = int32_t(v.heads);
  h.head_dim_k = int32_t(qk.dim);
  h.head_dim_v = int32_t(v.dim);
  h.scale = scale ? float(*scale) : 0.0f;
  if (scale && !(*scale > 0)) fail("scale: expected a positive value (or None for 1/sqrt(K)), got ", *scale);
  h.use_qk_l2norm = use_qk_l2norm;
  return h;
}

struct GateArgs {
  OptArray g, beta, a, b, A_log, dt_bias;
};

Gating make_gating(const GateArgs& ga, int64_t tokens, int64_t hv, Devices& dev) {
  const bool given = ga.g || ga.beta;
  const bool fused = ga.a || ga.b || ga.A_log || ga.dt_bias;
  Gating gt;
  if (given && fused)
    fail("gating: pass either g and beta (given gates) or a, b, A_log and dt_bias (fused gating), not both");
  if (given) {
    if (!ga.g) fail("g: required with beta (given gates: g [T, HV] float32 log-decay)");
    if (!ga.beta) fail("beta: required with g (given gates: beta [T, HV])");
    dev.add(ga.g, "g");
    dev.add(ga.beta, "beta");
    gt.mode = GateMode::kGiven;
    gt.g = gate_view(*ga.g, "g", tokens, hv);
    gt.beta = gate_view(*ga.beta, "beta", tokens, hv);
    return gt;
  }
  if (!fused) fail("gating: no gates given (pass g and beta, or a, b, A_log and dt_bias)");
  const char* missing = !ga.a ? "a" : !ga.b ? "b" : !ga.A_log ? "A_log" : !ga.dt_bias ? "dt_bias" : nullptr;
  if (missing) fail(missing, ": required for fused gating (a, b [T, HV], A_log, dt_bias [HV] float32)");
  dev.add(ga.a, "a");
  dev.add(ga.b, "b");
  dev.add(ga.A_log, "A_log");
  dev.add(ga.dt_bias, "dt_bias");
  gt.mode = GateMode::kFused;
  gt.a = gate_view(*ga.a, "a", tokens, hv);
  gt.b = gate_view(*ga.b, "b", tokens, hv);
  gt.A_log = head_params(*ga.A_log, "A_log", hv);
  gt.dt_bias = head_params(*ga.dt_bias, "dt_bias", hv);
  return gt;
}

// ---- sizes several arrays must agree on: naming the one that is wrong ---------------------------
//
// H, K and the token count are carried by q and k (and v), HV by v, the state pool and the gates, V by v and
// the pool. When two of them disagree, the message names the odd one out where a third array tells which
// one that is; where none does, it names the later token array (k against q) or the token array against
// the pool (v or k against state), since the pool is the array a caller allocates once.

// The HV the gates were given for (the last dim of a, b, g or beta; else the length of A_log or dt_bias);
// -1 when no gate array tells.
int64_t gates_hv(const GateArgs& ga) {
  for (const OptArray* x : {&ga.a, &ga.b, &ga.g, &ga.beta})
    if (*x && (*x)->ndim() >= 2) return int64_t((*x)->shape((*x)->ndim() - 1));
  for (const OptArray* x : {&ga.A_log, &ga.dt_bias})
    if (*x && (*x)->ndim() == 1) return int64_t((*x)->shape(0));
  return -1;
}

// HV, K and V of a state array of `lead` leading dims as `layout` places them; all -1 when its rank is wrong
// (make_pool / make_cache report that).
struct StateDims {
  int64_t hv = -1, k = -1, v = -1;
};
StateDims state_dims(const Array& a, size_t lead, StateLayout layout) {
  StateDims d;
  if (a.ndim() != lead + 3) return d;
  const int64_t d1 = a.shape(lead + 1), d2 = a.shape(lead + 2);
  d.hv = a.shape(lead);
  d.k = layout == StateLayout::kKLast ? d2 : d1;
  d.v = layout == StateLayout::kKLast ? d1 : d2;
  return d;
}

// q against k: the token count (v tells which one is off), H (nothing tells: k is named) and K (the state
// pool tells). q may be absent (commit).
void check_q_vs_k(const std::optional<Tokens>& tq, const Array* q, const Tokens& tk, const Array& k, const Tokens& tv,
                  const StateDims& sd) {
  if (!tq || (tq->count == tk.count && tq->heads == tk.heads && tq->dim == tk.dim)) return;
  const bool q_is_off = (tq->count != tk.count && tv.count == tk.count) ||
                        (tq->count == tk.count && tq->heads == tk.heads && sd.k == tk.dim);
  if (q_is_off)
    fail("q: expected shape [tokens, H, K] = [", tk.count, ", ", tk.heads, ", ", tk.dim, "] (that of k), got ",
         shape_str(*q));
  fail("k: expected shape [tokens, H, K] = [", tq->count, ", ", tq->heads, ", ", tq->dim, "] (that of q), got ",
       shape_str(k));
}

// v's and k's heads and head dims against the state pool. Names v (k) unless another array
// sides with it: the gates' HV for v's heads, q's K for k's (q and k agree by now), and K and V swapped
// (a pool of the other layout); then the pool is the odd one out and make_pool names it.
void check_tokens_vs_state(const Tokens& tk, const Array& k, const Tokens& tv, const Array& v, bool have_q,
                           const Array& state, const char* state_name, const StateDims& sd, StateLayout layout,
                           int64_t gate_hv) {
  if (sd.hv < 0) return;
  const std::string pool = msg::cat(state_name, " ", shape_str(state), " (",
                                    layout == StateLayout::kKLast ? "k_last: [.., HV, V, K]" : "v_last: [.., HV, K, V]",
                                    ")");
  if (tv.heads != sd.hv && gate_hv != tv.heads)
    fail("v: shape ", shape_str(v), " has HV=", tv.heads, " value heads, but ", pool, " has HV=", sd.hv,
         gate_hv == sd.hv ? " and the gates have HV=" + std::to_string(gate_hv) : std::string());
  const bool swapped = tk.dim != tv.dim && sd.k == tv.dim && sd.v == tk.dim;
  if (swapped) return;
  if (tk.dim != sd.k && !have_q)
    fail("k: shape ", shape_str(k), " has head dim K=", tk.dim, ", but ", pool, " has K=", sd.k);
  if (tv.dim != sd.v && tk.dim == sd.k)
    fail("v: shape ", shape_str(v), " has head dim V=", tv.dim, ", but ", pool, " has V=", sd.v);
}

// ---- ops --------------------------------------------------------------------------------------

// Runs one library entry with the GIL held and rethrows a gdnkit::Error from this module. Holding the GIL
// costs nothing that matters: CUDA calls only enqueue work, and the CPU backend is a reference.
template <class Fn>
void call_library(Fn&& fn) {
  ErrorCode code = ErrorCode::kInvalidArgument;
  std::string message;
  try {
    fn();
    return;
  } catch (const Error& e) {
    code = e.code();
    message = e.what();
  }
  throw Error(code, message);
}

// Test hook (_gdnkit._testing.raise_error, wrapped by gdnkit._testing): raises a gdnkit::Error along one of
// the ways an error can reach Python, so the tests check each of them:
//   0: Error thrown here with the GIL released      1: library error, GIL held, not caught here
//   2: library error through call_library            3: library error, GIL released, not caught here
void raise_error(int mode) {
  DecodeParams p;
  p.heads.num_qk_heads = 3;  // does not divide HV: validate() throws "q: H=3 does not divide HV=4"
  p.heads.num_v_heads = 4;
  if (mode == 0) {
    nb::gil_scoped_release release;
    fail("debug: thrown by the binding");
  }
  if (mode == 1) validate(p, Backend::kCPU);
  if (mode == 2) call_library([&] { validate(p, Backend::kCPU); });
  if (mode == 3) {
    nb::gil_scoped_release release;
    validate(p, Backend::kCPU);
  }
  fail("mode: expected 0, 1, 2 or 3, got ", mode);
}

// Fills the fields decode, verify and commit share. q and o may be absent (commit).
void fill_decode_like(DecodeParams& p, Devices& dev, const OptArray& q, const Array& k, const Array& v,
                      const OptArray& o, const Array& state, const OptArray& state_scales_arg,
                      const Array& state_indices, const std::string& layout, const GateArgs& gates,
                      std::optional<double> scale, bool use_qk_l2norm, const OptArray& error_flag, int64_t batch,
                      const char* batch_what, Tokens* tokens_out) {
  dev.add(q, "q");
  dev.add(state_scales_arg, "state_scales");
  dev.add(k, "k");
  dev.add(v, "v");
  dev.add(o, "o");
  dev.add(state, "state");
  dev.add(state_indices, "state_indices");
  dev.add(error_flag, "error_flag");
  const std::optional<Tokens> tq = q ? std::optional<Tokens>(token_rows(*q, "q")) : std::nullopt;
  const Tokens tk = token_rows(k, "k");
  const Tokens tv = token_rows(v, "v");
  const StateLayout l = parse_layout(layout);
  const StateDims sd = state_dims(state, 1, l);
  check_q_vs_k(tq, q ? &*q : nullptr, tk, k, tv, sd);
  if (tv.count != tk.count)
    fail("v: expected ", tk.count, " tokens (those of ", q ? "q and k" : "k", "), got ", tv.count, " (shape ",
         shape_str(v), ")");
  check_tokens_vs_state(tk, k, tv, v, q.has_value(), state, "state", sd, l, gates_hv(gates));
  p.q = to_view<InView>(tq ? *tq : tk);  // commit: q never read, kept valid
  if (o) {
    const Tokens to = token_rows(*o, "o");
    require_shape(to, "o", tv.count, tv.heads, tv.dim, "[tokens, HV, V] of v");
    p.o = to_view<OutView>(to);
  } else {
    p.o.dtype = tv.dtype;
  }
  p.heads = make_heads(tk, tv, scale, use_qk_l2norm);
  p.k = to_view<InView>(tk);
  p.v = to_view<InView>(tv);
  p.batch = int32_t(batch);
  p.gating = make_gating(gates, tk.count, tv.heads, dev);
  p.state = make_pool(state, "state", tv.heads, tk.dim, tv.dim, l, state_scales_arg, "state_scales");
  p.state_indices = index_array(state_indices, "state_indices", batch, batch_what);
  p.error_flag = error_flag_ptr(error_flag);
  if (tokens_out) *tokens_out = tk;
}

void decode_op(const Array& q, const Array& k, const Array& v, const Array& o, const Array& state,
               const Array& state_indices, const std::string& layout, OptArray g, OptArray beta, OptArray a,
               OptArray b, OptArray A_log, OptArray dt_bias, std::optional<double> scale, bool use_qk_l2norm,
               OptArray state_scales, OptArray error_flag, uintptr_t stream) {
  Devices dev;
  DecodeParams p;
  Tokens tk;
  const int64_t B = int64_t(state_indices.size());
  fill_decode_like(p, dev, q, k, v, o, state, state_scales, state_indices, layout, {g, beta, a, b, A_log, dt_bias}, scale,
                   use_qk_l2norm, error_flag, B, "[B] (one slot per sequence)", &tk);
  if (tk.count != B)
    fail("q: decode takes one token per sequence: expected ", B, " tokens (the length of state_indices), got ",
         tk.count);
  DeviceGuard guard(dev);
  call_library([&] { decode(p, make_context(dev, stream)); });
}

// B and T of a verify/commit call: varlen from cu_seqlens ([B+1]) and an explicit T, or fixed from the
// token count and the number of sequences (state_indices).
void fill_verify(VerifyParams& p, Devices& dev, const Tokens& tk, int64_t B, const OptArray& cu_seqlens,
                 const OptArray& parent, const OptArray& intermediate, const OptArray& intermediate_scales,
                 const OptArray& intermediate_indices, int64_t num_draft_tokens, const std::string& layout,
                 const Array& k) {
  dev.add(cu_seqlens, "cu_seqlens");
  dev.add(intermediate_scales, "intermediate_scales");
  dev.add(parent, "parent");
  dev.add(intermediate, "intermediate");
  dev.add(intermediate_indices, "intermediate_indices");
  int64_t T = num_draft_tokens;
  if (cu_seqlens) {
    if (T <= 0 && parent && parent->ndim() == 2) T = parent->shape(1);
    if (T <= 0)
      fail("num_draft_tokens: required with cu_seqlens (the longest draft T; or pass parent [B, T])");
    p.cu_seqlens = index_array(*cu_seqlens, "cu_seqlens", B + 1, "[B+1] (B = len(state_indices))");
  } else {
    if (B == 0) {
      T = T > 0 ? T : 1;
    } else {
      if (tk.count % B != 0)
        fail("k: ", tk.count, " tokens are not a multiple of B=", B, " sequences (fixed T; pass cu_seqlens for ",
             "varlen drafts)");
      const int64_t t_fixed = tk.count / B;
      if (T > 0 && T != t_fixed)
        fail("num_draft_tokens: T=", T, " but ", tk.count, " tokens / B=", B, " sequences = ", t_fixed);
      T = t_fixed;
    }
    if (tk.batch >= 0 && tk.per_batch != T && tk.batch != 1)
      fail("k: shape ", shape_str(k), " has T=", tk.per_batch, " tokens per row, expected ", T);
  }
  p.num_draft_tokens = int32_t(T);
  p.parent = opt_index(parent, "parent", B * T, "[B, T] int32 (B = len(state_indices))");
  if (intermediate) {
    p.intermediate = make_cache(*intermediate, "intermediate", p.heads.num_v_heads, p.heads.head_dim_k,
                                p.heads.head_dim_v, parse_layout(layout), intermediate_scales, "intermediate_scales");
    if (!intermediate_indices) fail("intermediate_indices: required with intermediate ([B] int32 slots)");
  } else if (intermediate_scales) {
    fail("intermediate_scales: only with intermediate (a float8_e4m3fn cache)");
  }
  p.intermediate_indices =
      opt_index(intermediate_indices, "intermediate_indices", B, "[B] int32 (B = len(state_indices))");
}

void verify_op(const Array& q, const Array& k, const Array& v, const Array& o, const Array& state,
               const Array& state_indices, const std::string& layout, OptArray g, OptArray beta, OptArray a,
               OptArray b, OptArray A_log, OptArray dt_bias, std::optional<double> scale, bool use_qk_l2norm,
               OptArray cu_seqlens, OptArray parent, OptArray intermediate, OptArray intermediate_indices,
               bool update_state, int64_t num_draft_tokens, OptArray state_scales, OptArray intermediate_scales,
               OptArray error_flag, uintptr_t stream) {
  Devices dev;
  VerifyParams p;
  Tokens tk;
  const int64_t B = int64_t(state_indices.size());
  fill_decode_like(p, dev, q, k, v, o, state, state_scales, state_indices, layout, {g, beta, a, b, A_log, dt_bias},
                   scale, use_qk_l2norm, error_flag, B, "[B] (one slot per sequence)", &tk);
  fill_verify(p, dev, tk, B, cu_seqlens, parent, intermediate, intermediate_scales, intermediate_indices,
              num_draft_tokens, layout, k);
  p.update_state = update_state;
  DeviceGuard guard(dev);
  call_library([&] { verify(p, make_context(dev, stream)); });
}

void commit_op(const Array& k, const Array& v, const Array& state, const Array& state_indices,
               const Array& accepted, const std::string& layout, const std::string& source, OptArray q,
               OptArray g, OptArray beta, OptArray a, OptArray b, OptArray A_log, OptArray dt_bias,
               std::optional<double> scale, bool use_qk_l2norm, OptArray cu_seqlens, OptArray parent,
               OptArray intermediate, OptArray intermediate_indices, OptArray accepted_path,
               int64_t num_draft_tokens, OptArray state_scales, OptArray intermediate_scales, OptArray error_flag,
               uintptr_t stream) {
  Devices dev;
  CommitParams p;
  Tokens tk;
  const int64_t B = int64_t(state_indices.size());
  fill_decode_like(p, dev, q, k, v, std::nullopt, state, state_scales, state_indices, layout,
                   {g, beta, a, b, A_log, dt_bias}, scale, use_qk_l2norm, error_flag, B, "[B] (one slot per sequence)",
                   &tk);
  fill_verify(p, dev, tk, B, cu_seqlens, parent, intermediate, intermediate_scales, intermediate_indices,
              num_draft_tokens, layout, k);
  if (source == "cache") {
    p.source = CommitSource::kCache;
  } else if (source == "recompute") {
    p.source = CommitSource::kRecompute;
  } else {
    fail("source: expected 'cache' or 'recompute', got '", source, "'");
  }
  dev.add(accepted, "accepted");
  dev.add(accepted_path, "accepted_path");
  p.accepted = index_array(accepted, "accepted", B, "[B] int32 (B = len(state_indices))");
  p.accepted_path = opt_index(accepted_path, "accepted_path", B * int64_t(p.num_draft_tokens),
                              "[B, T] int32 (B = len(state_indices))");
  DeviceGuard guard(dev);
  call_library([&] { commit(p, make_context(dev, stream)); });
}

// cu_seqlens values as int64 on the host, from a host array of either index dtype.
std::vector<int64_t> host_offsets(const Array& a, const char* name) {
  if (a.device_type() != nb::device::cpu::value) fail(name, ": expected a host (cpu) array");
  if (a.ndim() != 1) fail(name, ": expected 1 dim [N+1], got shape ", shape_str(a));
  std::vector<int64_t> out(a.shape(0));
  if (a.dtype() == nb::dtype<int64_t>()) {
    const auto* p = static_cast<const int64_t*>(a.data());
    for (size_t i = 0; i < out.size(); ++i) out[i] = p[i * a.stride(0)];
  } else if (a.dtype() == nb::dtype<int32_t>()) {
    const auto* p = static_cast<const int32_t*>(a.data());
    for (size_t i = 0; i < out.size(); ++i) out[i] = p[i * a.stride(0)];
  } else {
    fail(name, ": expected dtype int32 or int64, got ", dl_dtype_name(a.dtype()));
  }
  return out;
}

// A prefill call's params from its arguments (the devices added to `dev`); `host` holds the host copy of cu_seqlens.
PrefillParams prefill_params(Devices& dev, std::vector<int64_t>& host, const Array& q, const Array& k, const Array& v,
                             const Array& o, const Array& cu_seqlens, const std::string& layout, OptArray state,
                             OptArray initial_indices, OptArray final_indices, OptArray g, OptArray beta, OptArray a,
                             OptArray b, OptArray A_log, OptArray dt_bias, std::optional<double> scale,
                             bool use_qk_l2norm, OptArray checkpoints, int64_t checkpoint_interval,
                             OptArray checkpoint_indices, OptArray cu_seqlens_cpu, const std::string& cpu_algorithm,
                             OptArray workspace, OptArray state_scales, OptArray checkpoint_scales,
                             OptArray error_flag) {
  PrefillParams p;
  dev.add(q, "q");
  dev.add(state_scales, "state_scales");
  dev.add(checkpoint_scales, "checkpoint_scales");
  dev.add(k, "k");
  dev.add(v, "v");
  dev.add(o, "o");
  dev.add(cu_seqlens, "cu_seqlens");
  dev.add(state, "state");
  dev.add(initial_indices, "initial_indices");
  dev.add(final_indices, "final_indices");
  dev.add(checkpoints, "checkpoints");
  dev.add(checkpoint_indices, "checkpoint_indices");
  dev.add(workspace, "workspace");
  dev.add(error_flag, "error_flag");
  const Tokens tq = token_rows(q, "q");
  const Tokens tk = token_rows(k, "k");
  const Tokens tv = token_rows(v, "v");
  const Tokens to = token_rows(o, "o");
  const StateLayout l = parse_layout(layout);
  const StateDims sd = state ? state_dims(*state, 1, l) : StateDims{};
  check_q_vs_k(tq, &q, tk, k, tv, sd);
  if (tv.count != tq.count)
    fail("v: expected ", tq.count, " tokens (those of q and k), got ", tv.count, " (shape ", shape_str(v), ")");
  if (state)
    check_tokens_vs_state(tk, k, tv, v, true, *state, "state", sd, l, gates_hv({g, beta, a, b, A_log, dt_bias}));
  require_shape(to, "o", tv.count, tv.heads, tv.dim, "[T_total, HV, V] of v");
  p.heads = make_heads(tq, tv, scale, use_qk_l2norm);
  p.q = to_view<InView>(tq);
  p.k = to_view<InView>(tk);
  p.v = to_view<InView>(tv);
  p.o = to_view<OutView>(to);
  p.total_tokens = tq.count;

  if (cu_seqlens.ndim() != 1 || cu_seqlens.shape(0) < 1)
    fail("cu_seqlens: expected 1 dim [N+1] with N >= 0, got shape ", shape_str(cu_seqlens));
  if (cu_seqlens.shape(0) > 1 && cu_seqlens.stride(0) != 1)
    fail("cu_seqlens: expected a contiguous array, got stride ", cu_seqlens.stride(0));
  const int64_t N = int64_t(cu_seqlens.shape(0)) - 1;
  p.num_seqs = int32_t(N);
  if (cu_seqlens.dtype() == nb::dtype<int32_t>()) {
    p.cu_seqlens_dtype = DType::kInt32;
  } else if (cu_seqlens.dtype() == nb::dtype<int64_t>()) {
    p.cu_seqlens_dtype = DType::kInt64;
  } else {
    fail("cu_seqlens: expected dtype int32 or int64, got ", dl_dtype_name(cu_seqlens.dtype()));
  }
  p.cu_seqlens = cu_seqlens.data();
  if (cu_seqlens_cpu) {
    host = host_offsets(*cu_seqlens_cpu, "cu_seqlens_cpu");
    if (int64_t(host.size()) != N + 1)
      fail("cu_seqlens_cpu: expected ", N + 1, " elements (those of cu_seqlens), got ", host.size());
    p.cu_seqlens_host = host.data();
  }

  p.gating = make_gating({g, beta, a, b, A_log, dt_bias}, tq.count, tv.heads, dev);
  p.state.layout = l;
  if (state) p.state = make_pool(*state, "state", tv.heads, tq.dim, tv.dim, l, state_scales, "state_scales");
  else if (state_scales) fail("state_scales: only with state (a float8_e4m3fn pool)");
  if ((initial_indices || final_indices) && !state)
    fail("state: required with initial_indices or final_indices (the pool [P, HV, ..] they index)");
  p.initial_indices = opt_index(initial_indices, "initial_indices", N, "[N] int32 (N = len(cu_seqlens) - 1)");
  p.final_indices = opt_index(final_indices, "final_indices", N, "[N] int32 (N = len(cu_seqlens) - 1)");
  if (checkpoints) {
    p.checkpoints = make_cache(*checkpoints, "checkpoints", tv.heads, tq.dim, tv.dim, l, checkpoint_scales,
                               "checkpoint_scales");
    if (checkpoint_interval <= 0) fail("checkpoint_interval: required (> 0, a multiple of 64) with checkpoints");
  } else if (checkpoint_scales) {
    fail("checkpoint_scales: only with checkpoints (a float8_e4m3fn buffer)");
  } else if (checkpoint_interval != 0) {
    fail("checkpoints: required with checkpoint_interval=", checkpoint_interval);
  }
  p.checkpoint_interval = int32_t(checkpoint_interval);
  p.checkpoint_indices = opt_index(checkpoint_indices, "checkpoint_indices", N, "[N] int32");
  if (cpu_algorithm == "auto") {
    p.cpu_algorithm = PrefillAlgorithm::kAuto;
  } else if (cpu_algorithm == "recurrent") {
    p.cpu_algorithm = PrefillAlgorithm::kRecurrent;
  } else if (cpu_algorithm == "chunked") {
    p.cpu_algorithm = PrefillAlgorithm::kChunked;
  } else {
    fail("cpu_algorithm: expected 'auto', 'recurrent' or 'chunked', got '", cpu_algorithm, "'");
  }
  if (workspace) {
    p.workspace = workspace->data();
    p.workspace_bytes = workspace->nbytes();
  }
  p.error_flag = error_flag_ptr(error_flag);
  return p;
}

// The library names its host copies *_host; the arguments that fill them are *_cpu.
template <class Fn>
void call_with_host_names(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    const std::string m = e.what();
    for (const char* field : {"cu_seqlens_host:", "piece_offsets_host:"}) {
      const std::string f = field;
      if (m.compare(0, f.size(), f) == 0)
        throw Error(e.code(), f.substr(0, f.size() - 6) + "_cpu:" + m.substr(f.size()));
    }
    throw;
  }
}

void prefill_op(const Array& q, const Array& k, const Array& v, const Array& o, const Array& cu_seqlens,
                const std::string& layout, OptArray state, OptArray initial_indices, OptArray final_indices,
                OptArray g, OptArray beta, OptArray a, OptArray b, OptArray A_log, OptArray dt_bias,
                std::optional<double> scale, bool use_qk_l2norm, OptArray checkpoints,
                int64_t checkpoint_interval, OptArray checkpoint_indices, OptArray cu_seqlens_cpu,
                const std::string& cpu_algorithm, OptArray workspace, OptArray state_scales,
                OptArray checkpoint_scales, OptArray error_flag, uintptr_t stream) {
  Devices dev;
  std::vector<int64_t> host;
  const PrefillParams p = prefill_params(dev, host, q, k, v, o, cu_seqlens, layout, state, initial_indices,
                                         final_indices, g, beta, a, b, A_log, dt_bias, scale, use_qk_l2norm,
                                         checkpoints, checkpoint_interval, checkpoint_indices, cu_seqlens_cpu,
                                         cpu_algorithm, workspace, state_scales, checkpoint_scales, error_flag);
  DeviceGuard guard(dev);
  call_library([&] { call_with_host_names([&] { prefill(p, make_context(dev, stream)); }); });
}

// One half of a prefill split over ranks (begin, or end after the all-gather of `exchange`).
void split_prefill_op(const Array& q, const Array& k, const Array& v, const Array& o, const Array& cu_seqlens,
                      bool begin, int32_t rank, int32_t num_ranks, const Array& exchange, const std::string& layout,
                      OptArray state, OptArray initial_indices, OptArray final_indices, OptArray g, OptArray beta,
                      OptArray a, OptArray b, OptArray A_log, OptArray dt_bias, std::optional<double> scale,
                      bool use_qk_l2norm, OptArray checkpoints, int64_t checkpoint_interval,
                      OptArray checkpoint_indices, OptArray cu_seqlens_cpu, OptArray piece_offsets,
                      OptArray piece_offsets_cpu, bool final_on_every_rank, OptArray workspace,
                      OptArray state_scales, OptArray checkpoint_scales, OptArray error_flag, uintptr_t stream) {
  Devices dev;
  std::vector<int64_t> host;
  SplitPrefillParams sp;
  sp.local = prefill_params(dev, host, q, k, v, o, cu_seqlens, layout, state, initial_indices, final_indices, g,
                            beta, a, b, A_log, dt_bias, scale, use_qk_l2norm, checkpoints, checkpoint_interval,
                            checkpoint_indices, cu_seqlens_cpu, "auto", workspace, state_scales, checkpoint_scales,
                            error_flag);
  const int64_t N = sp.local.num_seqs;
  dev.add(exchange, "exchange");
  dev.add(piece_offsets, "piece_offsets");
  const int64_t elems = int64_t(num_ranks) * split_prefill_exchange_elems(sp.local);
  if (exchange.dtype() != nb::dtype<float>() || exchange.ndim() != 1 || int64_t(exchange.shape(0)) != elems ||
      (elems > 1 && exchange.stride(0) != 1))
    fail("exchange: expected a contiguous float32 array of ", elems, " elements (num_ranks x N x HV x K x (K + V)), "
         "got ", dl_dtype_name(exchange.dtype()), " of shape ", shape_str(exchange));
  sp.exchange = static_cast<float*>(exchange.data());
  std::vector<int64_t> offsets_host;
  if (piece_offsets) {
    if (piece_offsets->dtype() != nb::dtype<int64_t>() || piece_offsets->ndim() != 1 ||
        int64_t(piece_offsets->shape(0)) != N || (N > 1 && piece_offsets->stride(0) != 1))
      fail("piece_offsets: expected a contiguous int64 array of ", N, " elements (one per sequence), got ",
           dl_dtype_name(piece_offsets->dtype()), " of shape ", shape_str(*piece_offsets));
    sp.piece_offsets = static_cast<const int64_t*>(piece_offsets->data());
  }
  if (piece_offsets_cpu) {
    offsets_host = host_offsets(*piece_offsets_cpu, "piece_offsets_cpu");
    if (int64_t(offsets_host.size()) != N)
      fail("piece_offsets_cpu: expected ", N, " elements (one per sequence), got ", offsets_host.size());
    sp.piece_offsets_host = offsets_host.data();
  }
  sp.rank = rank;
  sp.num_ranks = num_ranks;
  sp.final_on_every_rank = final_on_every_rank;
  DeviceGuard guard(dev);
  call_library([&] {
    call_with_host_names([&] {
      if (begin)
        split_prefill_begin(sp, make_context(dev, stream));
      else
        split_prefill_end(sp, make_context(dev, stream));
    });
  });
}

void convert_layout_op(const Array& src, const Array& dst, const std::string& src_layout, OptArray src_scales,
                       OptArray dst_scales, uintptr_t stream) {
  Devices dev;
  dev.add(src, "src");
  dev.add(dst, "dst");
  dev.add(src_scales, "src_scales");
  dev.add(dst_scales, "dst_scales");
  const StateLayout ls = parse_layout(src_layout, "src_layout");
  const StateLayout ld = ls == StateLayout::kKLast ? StateLayout::kVLast : StateLayout::kKLast;
  if (src.ndim() != 4) fail("src: expected 4 dims [P, HV, ..], got shape ", shape_str(src));
  const int64_t hv = src.shape(1);
  const int64_t k = ls == StateLayout::kKLast ? src.shape(3) : src.shape(2);
  const int64_t vd = ls == StateLayout::kKLast ? src.shape(2) : src.shape(3);
  LayoutParams p;
  p.num_v_heads = int32_t(hv);
  p.head_dim_k = int32_t(k);
  p.head_dim_v = int32_t(vd);
  p.src = make_pool(src, "src", hv, k, vd, ls, src_scales, "src_scales");
  p.dst = make_pool(dst, "dst", hv, k, vd, ld, dst_scales, "dst_scales");
  if (p.dst.num_slots != p.src.num_slots)
    fail("dst: expected ", p.src.num_slots, " slots (those of src), got ", p.dst.num_slots);
  DeviceGuard guard(dev);
  call_library([&] { convert_layout(p, make_context(dev, stream)); });
}

}  // namespace
}  // namespace gdnkit::py

NB_MODULE(_gdnkit, m) {
  using namespace gdnkit::py;
  namespace g = gdnkit;
  m.doc() = "gdnkit C++ API binding (low level: outputs are passed in; see gdnkit.ops for the friendly API)";
  // The version compiled in (include/gdnkit/version.h); gdnkit.__version__ is this.
  m.attr("__version__") = GDNKIT_VERSION_STRING;

  // gdnkit::Error -> Python, by code: invalid arguments are ValueErrors, unimplemented requests
  // NotImplementedErrors, everything else (no device, CUDA failures) RuntimeErrors; same message.
  static nb::object error_type = nb::steal(PyErr_NewExceptionWithDoc(
      "gdnkit.GdnkitError", "Invalid arguments to a gdnkit op (gdnkit::ErrorCode::kInvalidArgument).",
      PyExc_ValueError, nullptr));
  static nb::object not_impl_type = nb::steal(PyErr_NewExceptionWithDoc(
      "gdnkit.GdnkitNotImplementedError", "A valid request the chosen backend does not implement (yet).",
      PyExc_NotImplementedError, nullptr));
  static nb::object runtime_type = nb::steal(PyErr_NewExceptionWithDoc(
      "gdnkit.GdnkitRuntimeError", "No usable device, or a CUDA runtime call failed.", PyExc_RuntimeError,
      nullptr));
  m.attr("GdnkitError") = error_type;
  m.attr("GdnkitNotImplementedError") = not_impl_type;
  m.attr("GdnkitRuntimeError") = runtime_type;
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const g::Error& e) {
      PyObject* type = runtime_type.ptr();
      if (e.code() == g::ErrorCode::kInvalidArgument) type = error_type.ptr();
      if (e.code() == g::ErrorCode::kNotImplemented) type = not_impl_type.ptr();
      PyErr_SetString(type, e.what());
    }
  });

  using namespace nb::literals;
  m.def("decode", &decode_op, "q"_a, "k"_a, "v"_a, "o"_a, "state"_a, "state_indices"_a, nb::kw_only(),
        "layout"_a, "g"_a = nb::none(), "beta"_a = nb::none(), "a"_a = nb::none(), "b"_a = nb::none(),
        "A_log"_a = nb::none(), "dt_bias"_a = nb::none(), "scale"_a = nb::none(), "use_qk_l2norm"_a = true,
        "state_scales"_a = nb::none(), "error_flag"_a = nb::none(), "stream"_a = 0);
  m.def("verify", &verify_op, "q"_a, "k"_a, "v"_a, "o"_a, "state"_a, "state_indices"_a, nb::kw_only(),
        "layout"_a, "g"_a = nb::none(), "beta"_a = nb::none(), "a"_a = nb::none(), "b"_a = nb::none(),
        "A_log"_a = nb::none(), "dt_bias"_a = nb::none(), "scale"_a = nb::none(), "use_qk_l2norm"_a = true,
        "cu_seqlens"_a = nb::none(), "parent"_a = nb::none(), "intermediate"_a = nb::none(),
        "intermediate_indices"_a = nb::none(), "update_state"_a = false, "num_draft_tokens"_a = 0,
        "state_scales"_a = nb::none(), "intermediate_scales"_a = nb::none(), "error_flag"_a = nb::none(),
        "stream"_a = 0);
  m.def("commit", &commit_op, "k"_a, "v"_a, "state"_a, "state_indices"_a, "accepted"_a, nb::kw_only(), "layout"_a,
        "source"_a, "q"_a = nb::none(), "g"_a = nb::none(), "beta"_a = nb::none(), "a"_a = nb::none(),
        "b"_a = nb::none(), "A_log"_a = nb::none(), "dt_bias"_a = nb::none(), "scale"_a = nb::none(),
        "use_qk_l2norm"_a = true, "cu_seqlens"_a = nb::none(), "parent"_a = nb::none(),
        "intermediate"_a = nb::none(), "intermediate_indices"_a = nb::none(), "accepted_path"_a = nb::none(),
        "num_draft_tokens"_a = 0, "state_scales"_a = nb::none(), "intermediate_scales"_a = nb::none(),
        "error_flag"_a = nb::none(), "stream"_a = 0);
  m.def("prefill", &prefill_op, "q"_a, "k"_a, "v"_a, "o"_a, "cu_seqlens"_a, nb::kw_only(), "layout"_a,
        "state"_a = nb::none(), "initial_indices"_a = nb::none(), "final_indices"_a = nb::none(),
        "g"_a = nb::none(), "beta"_a = nb::none(), "a"_a = nb::none(), "b"_a = nb::none(), "A_log"_a = nb::none(),
        "dt_bias"_a = nb::none(), "scale"_a = nb::none(), "use_qk_l2norm"_a = true, "checkpoints"_a = nb::none(),
        "checkpoint_interval"_a = 0, "checkpoint_indices"_a = nb::none(), "cu_seqlens_cpu"_a = nb::none(),
        "cpu_algorithm"_a = "auto", "workspace"_a = nb::none(), "state_scales"_a = nb::none(),
        "checkpoint_scales"_a = nb::none(), "error_flag"_a = nb::none(), "stream"_a = 0);
  m.def("split_prefill", &split_prefill_op, "q"_a, "k"_a, "v"_a, "o"_a, "cu_seqlens"_a, nb::kw_only(), "begin"_a,
        "rank"_a, "num_ranks"_a, "exchange"_a, "layout"_a, "state"_a = nb::none(), "initial_indices"_a = nb::none(),
        "final_indices"_a = nb::none(), "g"_a = nb::none(), "beta"_a = nb::none(), "a"_a = nb::none(),
        "b"_a = nb::none(), "A_log"_a = nb::none(), "dt_bias"_a = nb::none(), "scale"_a = nb::none(),
        "use_qk_l2norm"_a = true, "checkpoints"_a = nb::none(), "checkpoint_interval"_a = 0,
        "checkpoint_indices"_a = nb::none(), "cu_seqlens_cpu"_a = nb::none(), "piece_offsets"_a = nb::none(),
        "piece_offsets_cpu"_a = nb::none(), "final_on_every_rank"_a = false, "workspace"_a = nb::none(),
        "state_scales"_a = nb::none(), "checkpoint_scales"_a = nb::none(), "error_flag"_a = nb::none(),
        "stream"_a = 0);
  m.def("convert_layout", &convert_layout_op, "src"_a, "dst"_a, nb::kw_only(), "src_layout"_a,
        "src_scales"_a = nb::none(), "dst_scales"_a = nb::none(), "stream"_a = 0);
  m.def("cuda_compiled", &g::cuda_compiled);
  m.def("cuda_available", &g::cuda_available);
  m.def("build_info", &g::build_info);

  // Hooks for the tests only (gdnkit/_testing.py); not part of the API.
  nb::module_ testing = m.def_submodule("_testing", "Test hooks of the gdnkit binding (not part of the API).");
  testing.def("raise_error", &raise_error, "mode"_a);
}
