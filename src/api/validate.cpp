// Validation of every public entry: what can be checked on the host without touching device memory.
// Each entry runs its validate() before any backend work, so nothing is written when a check fails.
// Messages name the tensor, the expectation and the value: "q: H=12 does not divide HV=32".
//
// One small function per tensor class (views, gating, pool, cache, indices) shared by all ops; verify's
// checks extend decode's, commit's extend verify's (commit never reads q or o, so they are optional there).
// On the CPU backend index tensors are host memory, so the values that would otherwise be read on the
// device (cu_seqlens, parent, accepted, accepted_path) are checked too.
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

#include "common/message.h"
#include "common/split.h"
#include "gdnkit/gdnkit.h"

namespace gdnkit {
namespace {

// ---- messages --------------------------------------------------------------------------------

using msg::fail;

std::string pointer_str(const void* ptr) { return msg::cat(ptr); }

// The CUDA kernels load rows of q/k/v/o and pool slots with 16-byte vector loads.
constexpr int64_t kVectorBytes = 16;

bool is_float(DType d) { return d == DType::kFloat32 || d == DType::kBFloat16 || d == DType::kFloat16; }
bool is_state_dtype(DType d) { return is_float(d) || d == DType::kFloat8E4M3; }
bool is_layout(StateLayout l) { return l == StateLayout::kKLast || l == StateLayout::kVLast; }
bool is_supported_dim(int64_t d) { return d == 64 || d == 128 || d == 256; }

// a * b + c without overflow; false when the result does not fit in int64.
bool mul_add(int64_t a, int64_t b, int64_t c, int64_t* out) {
  return !__builtin_mul_overflow(a, b, out) && !__builtin_add_overflow(*out, c, out);
}

bool aligned(const void* ptr, int64_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % uintptr_t(bytes) == 0; }

void require_float_dtype(const char* name, DType d) {
  if (!is_float(d)) fail(name, ": expected dtype float32, bfloat16 or float16, got ", dtype_name(d));
}

void require_state_dtype(const char* name, DType d) {
  if (!is_state_dtype(d)) fail(name, ": expected dtype float32, bfloat16, float16 or float8_e4m3, got ", dtype_name(d));
}

// float8_e4m3 states come with their block scales (types.h kFp8Block).
void require_fp8_scales(const char* name, DType d, const uint8_t* scales) {
  if (d == DType::kFloat8E4M3 && scales == nullptr)
    fail(name, ": float8_e4m3 states need their scales (one byte per ", kFp8Block, " elements), got a null pointer");
}

void require_layout(const char* name, StateLayout l) {
  if (!is_layout(l)) fail(name, ": unknown state layout ", int(l), " (expected K-last or V-last)");
}

// An int32 index tensor: non-null when it has elements, aligned to its element.
void validate_index_pointer(const char* name, const void* ptr, int64_t count, bool required) {
  if (ptr == nullptr) {
    if (required && count > 0) fail(name, ": required pointer is null (", count, " elements expected)");
    return;
  }
  if (!aligned(ptr, 4)) fail(name, ": data pointer ", pointer_str(ptr), " is not aligned to its int32 elements");
}

// ---- heads -----------------------------------------------------------------------------------

void validate_heads(const HeadConfig& h) {
  if (h.num_qk_heads <= 0) fail("q: number of q/k heads H must be > 0, got H=", h.num_qk_heads);
  if (h.num_v_heads <= 0) fail("v: number of value heads HV must be > 0, got HV=", h.num_v_heads);
  if (h.num_v_heads % h.num_qk_heads != 0) fail("q: H=", h.num_qk_heads, " does not divide HV=", h.num_v_heads);
  if (!is_supported_dim(h.head_dim_k))
    fail("q: head dim K=", h.head_dim_k, " is not supported (expected 64, 128 or 256)");
  if (!is_supported_dim(h.head_dim_v))
    fail("v: head dim V=", h.head_dim_v, " is not supported (expected 64, 128 or 256)");
  if (!std::isfinite(h.scale)) fail("scale: expected a finite value (<= 0 means 1/sqrt(K)), got ", h.scale);
}

// ---- token views: [count, heads, dim], dim contiguous ----------------------------------------

// Rows of different (token, head) pairs must not overlap: head_stride >= dim and
// token_stride >= (heads-1)*head_stride + dim. This allows views of one fused projection (token_stride
// larger than heads*head_stride) while rejecting aliasing that would make outputs race.
// On CUDA, rows are loaded with 16-byte vectors when dim > 1: the pointer must be 16-byte aligned and
// the strides multiples of 16 bytes. Per-head scalars (dim 1) need element alignment only.
template <class Ptr>
void validate_view(const char* name, const StridedView<Ptr>& view, int64_t count, int64_t heads, int64_t dim,
                   const char* heads_name, const char* dim_name, Backend backend) {
  if (count <= 0) return;  // nothing is read or written: the pointer may be anything
  if (view.data == nullptr) fail(name, ": required pointer is null (", count, " tokens)");
  const int64_t elem = dtype_size(view.dtype);
  if (heads > 1) {
    if (view.head_stride < dim)
      fail(name, ": head_stride=", view.head_stride, " is smaller than ", dim > 1 ? dim_name : "", dim > 1 ? "=" : "",
           dim, dim > 1 ? " (rows of consecutive heads overlap)" : " (values of consecutive heads overlap)");
  }
  if (count > 1) {
    int64_t need = 0;
    if (!mul_add(heads - 1, heads > 1 ? view.head_stride : 0, dim, &need))
      fail(name, ": head_stride=", view.head_stride, " is too large (offsets overflow int64)");
    if (view.token_stride < need)
      fail(name, ": token_stride=", view.token_stride, " overlaps the previous token (expected >= (", heads_name,
           "-1)*head_stride + ", dim > 1 ? dim_name : "1", " = ", need, ")");
  }
  const bool vector = backend == Backend::kCUDA && dim > 1;
  const int64_t align = vector ? kVectorBytes : elem;
  if (!aligned(view.data, align))
    fail(name, ": data pointer ", pointer_str(view.data), " is not ", align, "-byte aligned",
         vector ? " (CUDA backend: 16-byte vector loads)" : " (element alignment)");
  if (vector) {
    const int64_t step = kVectorBytes / elem;  // elements per 16 bytes
    if (heads > 1 && view.head_stride % step != 0)
      fail(name, ": head_stride=", view.head_stride, " is not a multiple of ", step, " elements (16 bytes of ",
           dtype_name(view.dtype), ", CUDA backend vector loads)");
    if (count > 1 && view.token_stride % step != 0)
      fail(name, ": token_stride=", view.token_stride, " is not a multiple of ", step, " elements (16 bytes of ",
           dtype_name(view.dtype), ", CUDA backend vector loads)");
  }
}

// q, k, v (and o when needed): same dtype for q/k/v in bf16/fp16/fp32, o in v's dtype.
template <class P>
void validate_qkvo(const P& p, int64_t tokens, bool need_q_o, Backend backend) {
  const HeadConfig& h = p.heads;
  if (need_q_o) require_float_dtype("q", p.q.dtype);
  require_float_dtype("k", p.k.dtype);
  require_float_dtype("v", p.v.dtype);
  if (need_q_o && p.k.dtype != p.q.dtype)
    fail("k: expected dtype ", dtype_name(p.q.dtype), " (the dtype of q), got ", dtype_name(p.k.dtype));
  if (p.v.dtype != p.k.dtype)
    fail("v: expected dtype ", dtype_name(p.k.dtype), " (the dtype of ", need_q_o ? "q" : "k", "), got ",
         dtype_name(p.v.dtype));
  if (need_q_o && p.o.dtype != p.v.dtype)
    fail("o: expected dtype ", dtype_name(p.v.dtype), " (the dtype of v), got ", dtype_name(p.o.dtype));
  if (need_q_o) validate_view("q", p.q, tokens, h.num_qk_heads, h.head_dim_k, "H", "K", backend);
  validate_view("k", p.k, tokens, h.num_qk_heads, h.head_dim_k, "H", "K", backend);
  validate_view("v", p.v, tokens, h.num_v_heads, h.head_dim_v, "HV", "V", backend);
  if (need_q_o) validate_view("o", p.o, tokens, h.num_v_heads, h.head_dim_v, "HV", "V", backend);
}

// ---- gating: [tokens, HV] per-head scalars ---------------------------------------------------

void validate_gating(const Gating& g, int64_t tokens, int64_t hv, Backend backend) {
  if (g.mode == GateMode::kGiven) {
    if (g.g.dtype != DType::kFloat32) fail("g: expected dtype float32, got ", dtype_name(g.g.dtype));
    require_float_dtype("beta", g.beta.dtype);
    validate_view("g", g.g, tokens, hv, 1, "HV", "", backend);
    validate_view("beta", g.beta, tokens, hv, 1, "HV", "", backend);
  } else if (g.mode == GateMode::kFused) {
    require_float_dtype("a", g.a.dtype);
    require_float_dtype("b", g.b.dtype);
    validate_view("a", g.a, tokens, hv, 1, "HV", "", backend);
    validate_view("b", g.b, tokens, hv, 1, "HV", "", backend);
    // A_log and dt_bias [HV] do not depend on the tokens: required whenever fused gating is chosen, so a
    // missing pointer is caught on the first call even if that call has no tokens.
    if (g.A_log == nullptr) fail("A_log: required pointer is null (fused gating needs A_log [HV] float32)");
    if (g.dt_bias == nullptr) fail("dt_bias: required pointer is null (fused gating needs dt_bias [HV] float32)");
    if (!aligned(g.A_log, 4)) fail("A_log: data pointer ", pointer_str(g.A_log), " is not aligned to float32");
    if (!aligned(g.dt_bias, 4)) fail("dt_bias: data pointer ", pointer_str(g.dt_bias), " is not aligned to float32");
  } else {
    fail("gating: unknown mode ", int(g.mode), " (expected kGiven or kFused)");
  }
}

// ---- state pool and state caches -------------------------------------------------------------

int64_t state_elems(int64_t hv, int64_t k, int64_t v) { return hv * k * v; }

// Pool slots are read and written with 16-byte vectors on CUDA: data 16-byte aligned, slot stride a
// multiple of 16 bytes (HV*K*V always is for the supported dims).
void validate_state_alignment(const char* name, const void* data, DType dtype, int64_t slot_stride, Backend backend) {
  const int64_t elem = dtype_size(dtype);
  const int64_t align = backend == Backend::kCUDA ? kVectorBytes : elem;
  if (!aligned(data, align))
    fail(name, ": data pointer ", pointer_str(data), " is not ", align, "-byte aligned",
         backend == Backend::kCUDA ? " (CUDA backend: 16-byte vector loads)" : " (element alignment)");
  if (backend == Backend::kCUDA && slot_stride % (kVectorBytes / elem) != 0)
    fail(name, ": slot_stride=", slot_stride, " is not a multiple of ", kVectorBytes / elem, " elements (16 bytes of ",
         dtype_name(dtype), ", CUDA backend vector loads)");
}

// required: the op reads or writes pool slots (some sequence may name a slot).
void validate_pool(const char* name, const StatePool& pool, const HeadConfig& h, bool required, Backend backend) {
  if (!required && pool.data == nullptr) return;
  require_state_dtype(name, pool.dtype);
  require_layout(name, pool.layout);
  if (pool.data == nullptr) fail(name, ": required pointer is null (the op reads or writes pool slots)");
  require_fp8_scales(name, pool.dtype, pool.scales);
  if (pool.num_slots < 1) fail(name, ": num_slots must be >= 1, got ", pool.num_slots);
  const int64_t need = state_elems(h.num_v_heads, h.head_dim_k, h.head_dim_v);
  if (pool.slot_stride < need)
    fail(name, ": slot_stride=", pool.slot_stride, " is smaller than HV*K*V=", need, " (slots overlap)");
  validate_state_alignment(name, pool.data, pool.dtype, pool.slot_stride, backend);
}

// A [Q, S, HV, <layout>] cache written by the op: verify's intermediate states, prefill's checkpoints.
void validate_cache(const char* name, const StateCache& cache, const StatePool& pool, const HeadConfig& h,
                    int64_t min_steps, Backend backend) {
  require_state_dtype(name, cache.dtype);
  require_fp8_scales(name, cache.dtype, cache.scales);
  require_layout(name, cache.layout);
  if (cache.layout != pool.layout)
    fail(name, ": expected layout ", layout_name(pool.layout), " (the layout of state), got ",
         layout_name(cache.layout));
  if (cache.num_slots < 1) fail(name, ": num_slots must be >= 1, got ", cache.num_slots);
  if (cache.num_steps < min_steps) fail(name, ": num_steps must be >= ", min_steps, ", got ", cache.num_steps);
  const int64_t per_step = state_elems(h.num_v_heads, h.head_dim_k, h.head_dim_v);
  int64_t need = 0;
  if (!mul_add(cache.num_steps, per_step, 0, &need))
    fail(name, ": num_steps=", cache.num_steps, " is too large (offsets overflow int64)");
  if (cache.slot_stride < need)
    fail(name, ": slot_stride=", cache.slot_stride, " is smaller than num_steps*HV*K*V=", need, " (slots overlap)");
  validate_state_alignment(name, cache.data, cache.dtype, cache.slot_stride, backend);
}

// ---- sequence boundaries (host-readable only) ------------------------------------------------

// cu[0] == 0, non-decreasing, every length <= max_len (when max_len >= 0), cu[n] == total (when total >= 0).
template <class Int>
int64_t check_cu_seqlens(const char* name, const Int* cu, int64_t n, int64_t max_len, int64_t total) {
  if (cu[0] != 0) fail(name, ": must start at 0 (index 0: ", int64_t(cu[0]), ")");
  for (int64_t i = 1; i <= n; ++i) {
    if (cu[i] < cu[i - 1])
      fail(name, ": must be non-decreasing (index ", i, ": ", int64_t(cu[i - 1]), " > ", int64_t(cu[i]), ")");
    if (max_len >= 0 && cu[i] - cu[i - 1] > max_len)
      fail(name, ": sequence ", i - 1, " has ", int64_t(cu[i] - cu[i - 1]), " tokens, more than T=", max_len);
  }
  if (total >= 0 && cu[n] != total)
    fail(name, ": last entry (index ", n, ") must equal total_tokens=", total, ", got ", int64_t(cu[n]));
  return cu[n];
}

// ---- decode / verify / commit ----------------------------------------------------------------

// What decode, verify and commit share: heads, token views, gates, pool, state_indices, error flag.
// need_q_o: commit never reads q or writes o.
void validate_decode_like(const DecodeParams& p, int64_t tokens, bool need_q_o, Backend backend) {
  validate_heads(p.heads);
  if (p.batch < 0) fail("batch: must be >= 0, got B=", p.batch);
  validate_qkvo(p, tokens, need_q_o, backend);
  validate_gating(p.gating, tokens, p.heads.num_v_heads, backend);
  validate_pool("state", p.state, p.heads, p.batch > 0, backend);
  validate_index_pointer("state_indices", p.state_indices, p.batch, true);
  validate_index_pointer("error_flag", p.error_flag, 1, false);
}

// Length of sequence b of a verify/commit call (host-readable cu_seqlens only).
int64_t seq_len(const VerifyParams& p, int64_t b) {
  return p.cu_seqlens == nullptr ? p.num_draft_tokens : int64_t(p.cu_seqlens[b + 1]) - p.cu_seqlens[b];
}

// Verify's own fields; returns the number of token rows. need_q_o: false for commit.
int64_t validate_verify_like(const VerifyParams& p, bool need_q_o, bool is_commit, Backend backend) {
  const int64_t B = p.batch, T = p.num_draft_tokens;
  if (B < 0) fail("batch: must be >= 0, got B=", B);
  if (T < 1) fail("num_draft_tokens: must be >= 1, got T=", T);
  // Fixed T: B*T rows. Varlen: cu_seqlens[B] rows, at most B*T (the bound used where it cannot be read).
  int64_t tokens = B * T;
  validate_index_pointer("cu_seqlens", p.cu_seqlens, B + 1, false);
  if (p.cu_seqlens != nullptr && backend == Backend::kCPU)
    tokens = check_cu_seqlens("cu_seqlens", p.cu_seqlens, B, T, -1);
  validate_decode_like(p, tokens, need_q_o, backend);

  validate_index_pointer("parent", p.parent, B * T, false);
  if (!is_commit && p.update_state && p.parent != nullptr)
    fail("update_state: only for chain drafts (parent must be nullptr), but parent is given");
  if (p.parent != nullptr && backend == Backend::kCPU) {
    // A token continues from an earlier token of its own sequence (or the pool state, -1). Entries past a
    // varlen sequence's length are not read.
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0, len = seq_len(p, b); t < len; ++t) {
        const int32_t par = p.parent[b * T + t];
        if (par < -1 || par >= t) fail("parent: expected -1 <= parent[b][t] < t (b=", b, ", t=", t, "), got ", par);
      }
  }

  if (p.intermediate.data != nullptr) {
    validate_cache("intermediate", p.intermediate, p.state, p.heads, T, backend);
    validate_index_pointer("intermediate_indices", p.intermediate_indices, B, true);
  }
  return tokens;
}

}  // namespace

void validate(const DecodeParams& p, Backend backend) { validate_decode_like(p, p.batch, true, backend); }

void validate(const VerifyParams& p, Backend backend) { validate_verify_like(p, true, false, backend); }

void validate(const CommitParams& p, Backend backend) {
  validate_verify_like(p, false, true, backend);
  const int64_t B = p.batch, T = p.num_draft_tokens;
  validate_index_pointer("accepted", p.accepted, B, true);
  if (p.source == CommitSource::kCache) {
    if (B > 0 && p.intermediate.data == nullptr)
      fail("intermediate: required pointer is null (commit from the cache reads the intermediate states)");
  } else if (p.source != CommitSource::kRecompute) {
    fail("source: unknown commit source ", int(p.source), " (expected kCache or kRecompute)");
  }
  // Trees: the kept tokens are not 0..accepted-1, so their indices must be given.
  validate_index_pointer("accepted_path", p.accepted_path, B * T, p.parent != nullptr);
  if (backend != Backend::kCPU) return;
  for (int64_t b = 0; b < B; ++b) {
    if (p.state_indices[b] < 0) continue;  // padding row: commit leaves it alone and reads nothing of it
    const int64_t len = seq_len(p, b), n = p.accepted[b];
    if (n < 0 || n > len)
      fail("accepted: expected 0 <= accepted[b] <= ", len, " (the draft length of sequence b=", b, "), got ", n);
    if (p.accepted_path == nullptr) continue;
    for (int64_t i = 0; i < n; ++i) {
      const int32_t tok = p.accepted_path[b * T + i];
      if (tok < 0 || tok >= len)
        fail("accepted_path: expected a token index in [0, ", len, ") (b=", b, ", i=", i, "), got ", tok);
      // The kept tokens form a path from the pool state: each continues from the previous one (a chain's t from t-1).
      const int32_t par = p.parent != nullptr ? p.parent[b * T + tok] : tok - 1;
      const int32_t want = i == 0 ? -1 : p.accepted_path[b * T + i - 1];
      if (par != want)
        fail("accepted_path: token ", tok, " (b=", b, ", i=", i, ") has parent ", par, ", expected ", want,
             " (not a path of the draft ", p.parent != nullptr ? "tree)" : "chain)");
    }
  }
}

namespace {
// A caller's CUDA workspace: at least `need` bytes (what `sizer` reports), 16-byte aligned.
void validate_workspace(const void* ws, size_t bytes, size_t need, const char* sizer) {
  if (bytes < need) fail("workspace: expected at least ", need, " bytes (", sizer, "), got ", bytes);
  if (!aligned(ws, kVectorBytes)) fail("workspace: data pointer ", pointer_str(ws), " is not 16-byte aligned");
}
}  // namespace

void validate(const PrefillParams& p, Backend backend) {
  validate_heads(p.heads);
  const int64_t N = p.num_seqs;
  if (N < 0) fail("num_seqs: must be >= 0, got N=", N);
  if (p.total_tokens < 0) fail("total_tokens: must be >= 0, got ", p.total_tokens);
  if (p.cu_seqlens_dtype != DType::kInt32 && p.cu_seqlens_dtype != DType::kInt64)
    fail("cu_seqlens: expected dtype int32 or int64, got ", dtype_name(p.cu_seqlens_dtype));
  // The host copy first: the same message on both backends.
  if (p.cu_seqlens_host != nullptr) check_cu_seqlens("cu_seqlens_host", p.cu_seqlens_host, N, -1, p.total_tokens);
  if (p.cu_seqlens == nullptr) {
    if (N > 0) fail("cu_seqlens: required pointer is null (", N + 1, " elements expected)");
    if (p.total_tokens != 0) fail("total_tokens: expected 0 when cu_seqlens is null, got ", p.total_tokens);
  } else {
    if (!aligned(p.cu_seqlens, dtype_size(p.cu_seqlens_dtype)))
      fail("cu_seqlens: data pointer ", pointer_str(p.cu_seqlens), " is not aligned to its ",
           dtype_name(p.cu_seqlens_dtype), " elements");
    // On the CPU backend cu_seqlens is host memory: read it directly.
    if (backend == Backend::kCPU) {
      if (p.cu_seqlens_dtype == DType::kInt32)
        check_cu_seqlens("cu_seqlens", static_cast<const int32_t*>(p.cu_seqlens), N, -1, p.total_tokens);
      else
        check_cu_seqlens("cu_seqlens", static_cast<const int64_t*>(p.cu_seqlens), N, -1, p.total_tokens);
    }
  }

  validate_qkvo(p, p.total_tokens, true, backend);
  validate_gating(p.gating, p.total_tokens, p.heads.num_v_heads, backend);
  const bool uses_pool = N > 0 && (p.initial_indices != nullptr || p.final_indices != nullptr);
  validate_pool("state", p.state, p.heads, uses_pool, backend);
  validate_index_pointer("initial_indices", p.initial_indices, N, false);
  validate_index_pointer("final_indices", p.final_indices, N, false);
  validate_index_pointer("error_flag", p.error_flag, 1, false);

  if (p.checkpoint_interval < 0 || p.checkpoint_interval % 64 != 0)
    fail("checkpoint_interval: expected 0 or a multiple of 64 (the chunk), got ", p.checkpoint_interval);
  if (p.checkpoint_interval > 0) {
    if (p.checkpoints.data == nullptr)
      fail("checkpoints: required pointer is null (checkpoint_interval=", p.checkpoint_interval, ")");
    // The checkpoints share the pool's layout; with no pool, any layout is accepted.
    StatePool layout_ref = p.state;
    if (p.state.data == nullptr) layout_ref.layout = p.checkpoints.layout;
    validate_cache("checkpoints", p.checkpoints, layout_ref, p.heads, 1, backend);
    validate_index_pointer("checkpoint_indices", p.checkpoint_indices, N, true);
  }

  if (p.cpu_algorithm != PrefillAlgorithm::kAuto && p.cpu_algorithm != PrefillAlgorithm::kRecurrent &&
      p.cpu_algorithm != PrefillAlgorithm::kChunked)
    fail("cpu_algorithm: unknown value ", int(p.cpu_algorithm), " (expected kAuto, kRecurrent or kChunked)");
  if (backend == Backend::kCUDA && p.workspace != nullptr)
    validate_workspace(p.workspace, p.workspace_bytes, prefill_workspace_bytes(p), "prefill_workspace_bytes");
}

void validate(const SplitPrefillParams& p, Backend backend) {
  if (p.num_ranks < 1) fail("num_ranks: must be >= 1, got ", p.num_ranks);
  if (p.rank < 0 || p.rank >= p.num_ranks) fail("rank: expected 0..", p.num_ranks - 1, ", got ", p.rank);
  // The local params as a prefill, but for the workspace, which a split call sizes itself.
  PrefillParams local = p.local;
  local.workspace = nullptr;
  validate(local, backend);
  const PrefillParams& q = p.local;
  const int64_t N = q.num_seqs;
  if (N > 0 && p.exchange == nullptr)
    fail("exchange: required pointer is null (", int64_t(p.num_ranks), " x ", split_prefill_exchange_elems(q),
         " float32 elements expected)");
  if (!aligned(p.exchange, kVectorBytes)) fail("exchange: data pointer ", pointer_str(p.exchange), " is not 16-byte aligned");
  const bool checkpoints = q.checkpoint_interval > 0 && q.checkpoint_indices != nullptr;
  if (checkpoints && N > 0 && p.rank > 0 && p.piece_offsets == nullptr)  // (rank 0's pieces start their sequences)
    fail("piece_offsets: required pointer is null with checkpoints on rank ", p.rank, " (", N, " elements expected)");
  if (!aligned(p.piece_offsets, 8))
    fail("piece_offsets: data pointer ", pointer_str(p.piece_offsets), " is not aligned to its int64 elements");
  if (p.piece_offsets_host != nullptr)  // the host copy first: the same message on both backends
    for (int64_t n = 0; n < N; ++n) {
      const int64_t off = p.piece_offsets_host[n];
      if (off < 0) fail("piece_offsets_host: entry ", n, " is ", off, " (expected >= 0)");
      // A piece that holds a checkpoint must start on a chunk of its sequence (with the host copy of cu_seqlens,
      // only those that hold one; else every piece).
      if (!checkpoints || off % 64 == 0) continue;
      const bool holds = q.cu_seqlens_host == nullptr ||
                         split_piece_holds_checkpoint(off, q.cu_seqlens_host[n + 1] - q.cu_seqlens_host[n],
                                                      q.checkpoint_interval, q.checkpoints.num_steps);
      if (holds)
        fail("piece_offsets_host: sequence ", n, "'s piece starts ", off,
             " tokens into it, not a multiple of 64, and would hold checkpoints (every ", q.checkpoint_interval,
             " tokens)");
    }
  // Then, on the CPU backend, the offsets themselves (host memory): none negative (the device skips and counts what a
  // negative or misaligned offset would store, as the CPU backend does for a misaligned one).
  if (backend == Backend::kCPU && p.piece_offsets != nullptr)
    for (int64_t n = 0; n < N; ++n)
      if (p.piece_offsets[n] < 0) fail("piece_offsets: entry ", n, " is ", p.piece_offsets[n], " (expected >= 0)");
  if (backend == Backend::kCUDA && q.workspace != nullptr)
    validate_workspace(q.workspace, q.workspace_bytes, split_prefill_workspace_bytes(p),
                       "split_prefill_workspace_bytes");
}

void validate(const LayoutParams& p, Backend backend) {
  if (p.num_v_heads <= 0) fail("src: number of value heads HV must be > 0, got HV=", p.num_v_heads);
  if (!is_supported_dim(p.head_dim_k))
    fail("src: head dim K=", p.head_dim_k, " is not supported (expected 64, 128 or 256)");
  if (!is_supported_dim(p.head_dim_v))
    fail("src: head dim V=", p.head_dim_v, " is not supported (expected 64, 128 or 256)");
  require_state_dtype("src", p.src.dtype);
  require_layout("src", p.src.layout);
  require_layout("dst", p.dst.layout);
  if (p.dst.layout == p.src.layout)
    fail("dst: expected layout ",
         layout_name(p.src.layout == StateLayout::kKLast ? StateLayout::kVLast : StateLayout::kKLast),
         " (opposite of src), got ", layout_name(p.dst.layout));
  if (p.dst.dtype != p.src.dtype)
    fail("dst: expected dtype ", dtype_name(p.src.dtype), " (the dtype of src), got ", dtype_name(p.dst.dtype));
  if (p.src.num_slots < 0) fail("src: num_slots must be >= 0, got ", p.src.num_slots);
  if (p.dst.num_slots != p.src.num_slots)
    fail("dst: expected num_slots=", p.src.num_slots, " (that of src), got ", p.dst.num_slots);
  if (p.src.num_slots == 0) return;  // nothing to convert

  const int64_t per_slot = state_elems(p.num_v_heads, p.head_dim_k, p.head_dim_v);
  for (const auto& [name, pool] : {std::pair<const char*, const StatePool&>{"src", p.src}, {"dst", p.dst}}) {
    if (pool.data == nullptr) fail(name, ": required pointer is null (", pool.num_slots, " slots)");
    require_fp8_scales(name, pool.dtype, pool.scales);
    if (pool.slot_stride < per_slot)
      fail(name, ": slot_stride=", pool.slot_stride, " is smaller than HV*K*V=", per_slot, " (slots overlap)");
    int64_t extent = 0;
    if (!mul_add(pool.num_slots - 1, pool.slot_stride, per_slot, &extent) ||
        !mul_add(extent, dtype_size(pool.dtype), 0, &extent))
      fail(name, ": num_slots=", pool.num_slots, " x slot_stride=", pool.slot_stride, " overflows int64");
    validate_state_alignment(name, pool.data, pool.dtype, pool.slot_stride, backend);
  }

  const int64_t elem = dtype_size(p.src.dtype);
  if (p.dst.data == p.src.data) {
    // In place a slot's [K, V] blocks are transposed onto themselves, which needs square blocks.
    if (p.head_dim_k != p.head_dim_v)
      fail("dst: in-place conversion needs K == V, got K=", p.head_dim_k, ", V=", p.head_dim_v);
    if (p.dst.slot_stride != p.src.slot_stride)
      fail("dst: in-place conversion needs slot_stride=", p.src.slot_stride, " (that of src), got ", p.dst.slot_stride);
    if (p.src.dtype == DType::kFloat8E4M3 && p.dst.scales != p.src.scales)
      fail("dst: in-place conversion needs the scales of src (", pointer_str(p.src.scales), "), got ",
           pointer_str(p.dst.scales));
    return;
  }
  // Out of place: the two pools must not share memory (a partial overlap would read converted data).
  auto extent = [&](const StatePool& pool) {
    const auto begin = reinterpret_cast<uintptr_t>(pool.data);
    return std::pair<uintptr_t, uintptr_t>{
        begin, begin + uintptr_t(((pool.num_slots - 1) * pool.slot_stride + per_slot) * elem)};
  };
  const auto [s0, s1] = extent(p.src);
  const auto [d0, d1] = extent(p.dst);
  if (s0 < d1 && d0 < s1)
    fail("dst: overlaps src (", pointer_str(p.dst.data), " vs ", pointer_str(p.src.data),
         "); convert in place with dst.data == src.data, or use separate buffers");
  if (p.src.dtype == DType::kFloat8E4M3) {
    // The scales of the two pools, [P, HV*K*V/32] bytes each: apart from each other and from both pools' data.
    const uintptr_t scale_bytes = uintptr_t(p.src.num_slots) * uintptr_t(per_slot / kFp8Block);
    const auto ss = reinterpret_cast<uintptr_t>(p.src.scales), ds = reinterpret_cast<uintptr_t>(p.dst.scales);
    const auto apart = [&](uintptr_t a, uintptr_t a1, uintptr_t b, uintptr_t b1) { return a1 <= b || b1 <= a; };
    if (!apart(ss, ss + scale_bytes, ds, ds + scale_bytes))
      fail("dst: scales overlap those of src (", pointer_str(p.dst.scales), " vs ", pointer_str(p.src.scales),
           "); out of place, dst needs scales of its own");
    if (!apart(ss, ss + scale_bytes, d0, d1))
      fail("dst: overlaps the scales of src (", pointer_str(p.dst.data), " vs ", pointer_str(p.src.scales), ")");
    if (!apart(ds, ds + scale_bytes, s0, s1) || !apart(ds, ds + scale_bytes, d0, d1))
      fail("dst: scales overlap a pool's data (", pointer_str(p.dst.scales), ")");
  }
}

}  // namespace gdnkit
