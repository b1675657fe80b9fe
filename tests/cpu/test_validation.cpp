// Bad input: every public entry rejects each class of wrong params with gdnkit::Error(kInvalidArgument)
// and a message that names the tensor, the expectation and the value (docs/semantics.md "Bad input"); nothing is
// written when validation fails. The CUDA backend's rules (16-byte alignment) are checked through
// validate(p, Backend::kCUDA), which needs no GPU.
#include <gtest/gtest.h>

#include <climits>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "gdnkit/host_dtype.h"
#include "gdnkit/gdnkit.h"

namespace gdnkit {
namespace {

// ---- a small valid problem for every op, on host buffers --------------------------------------
// B = 2 sequences of T = 3 draft tokens (decode uses the first B rows); prefill packs N = 2 sequences
// of 2 and 4 tokens into the same 6 rows. Pool: P = 5 slots, K-last, fp32.
struct Host {
  static constexpr int32_t H = 2, HV = 4, K = 64, V = 64, B = 2, T = 3, P = 5, N = 2;
  static constexpr int64_t kRows = int64_t(B) * T;
  static constexpr int64_t kState = int64_t(HV) * K * V;

  std::vector<uint16_t> q = filled_bf16(kRows * H * K, 0.25f), k = filled_bf16(kRows * H * K, -0.5f),
                        v = filled_bf16(kRows * HV * V, 0.75f), o = filled_bf16(kRows * HV * V, NAN);
  std::vector<float> a = std::vector<float>(kRows * HV, 0.3f), b = std::vector<float>(kRows * HV, -0.2f),
                     A_log = std::vector<float>(HV, 0.5f), dt_bias = std::vector<float>(HV, 0.1f);
  std::vector<float> state = std::vector<float>(P * kState, NAN), state_t = std::vector<float>(P * kState, NAN);
  std::vector<float> inter = std::vector<float>(int64_t(B) * T * kState, NAN);
  std::vector<float> ckpt = std::vector<float>(int64_t(N) * kState, NAN);
  std::vector<int32_t> state_indices{3, 1}, intermediate_indices{1, 0}, accepted{2, 0};
  std::vector<int32_t> parent{-1, 0, 0, -1, -1, 1}, path{0, 2, 0, 0, 0, 0};
  std::vector<int32_t> cu32{0, 2, 6}, initial{4, -1}, final_{4, 2}, ckpt_indices{0, 1};
  std::vector<int64_t> cu_host{0, 2, 6};
  std::vector<int32_t> error_flag{0, 0};

  static std::vector<uint16_t> filled_bf16(int64_t n, float x) {
    std::vector<uint16_t> out(n);
    for (int64_t i = 0; i < n; ++i) out[i] = host::float_to_bf16(std::isnan(x) ? x : x * float(1 + i % 7));
    return out;
  }
  template <class View, class Ptr>
  static View view(Ptr data, DType dtype, int64_t heads, int64_t dim) {
    View out;
    out.data = data;
    out.dtype = dtype;
    out.head_stride = dim;
    out.token_stride = heads * dim;
    return out;
  }
  StatePool pool() {
    StatePool s;
    s.data = state.data();
    s.dtype = DType::kFloat32;
    s.layout = StateLayout::kKLast;
    s.num_slots = P;
    s.slot_stride = kState;
    return s;
  }
  template <class Params>
  void fill_tokens(Params& p) {
    p.heads.num_qk_heads = H;
    p.heads.num_v_heads = HV;
    p.heads.head_dim_k = K;
    p.heads.head_dim_v = V;
    p.q = view<InView>(q.data(), DType::kBFloat16, H, K);
    p.k = view<InView>(k.data(), DType::kBFloat16, H, K);
    p.v = view<InView>(v.data(), DType::kBFloat16, HV, V);
    p.o = view<OutView>(o.data(), DType::kBFloat16, HV, V);
    p.gating.mode = GateMode::kFused;
    p.gating.a = view<InView>(a.data(), DType::kFloat32, HV, 1);
    p.gating.b = view<InView>(b.data(), DType::kFloat32, HV, 1);
    p.gating.A_log = A_log.data();
    p.gating.dt_bias = dt_bias.data();
    p.state = pool();
    p.error_flag = error_flag.data();
  }
  DecodeParams decode() {
    DecodeParams p;
    fill_tokens(p);
    p.batch = B;
    p.state_indices = state_indices.data();
    return p;
  }
  VerifyParams verify() {
    VerifyParams p;
    static_cast<DecodeParams&>(p) = decode();
    p.num_draft_tokens = T;
    p.intermediate.data = inter.data();
    p.intermediate.dtype = DType::kFloat32;
    p.intermediate.layout = StateLayout::kKLast;
    p.intermediate.num_slots = B;
    p.intermediate.num_steps = T;
    p.intermediate.slot_stride = T * kState;
    p.intermediate_indices = intermediate_indices.data();
    return p;
  }
  CommitParams commit() {
    CommitParams p;
    static_cast<VerifyParams&>(p) = verify();
    p.source = CommitSource::kCache;
    p.accepted = accepted.data();
    return p;
  }
  PrefillParams prefill() {
    PrefillParams p;
    fill_tokens(p);
    p.num_seqs = N;
    p.total_tokens = kRows;
    p.cu_seqlens = cu32.data();
    p.cu_seqlens_dtype = DType::kInt32;
    p.cu_seqlens_host = cu_host.data();
    p.initial_indices = initial.data();
    p.final_indices = final_.data();
    return p;
  }
  LayoutParams layout() {
    LayoutParams p;
    p.num_v_heads = HV;
    p.head_dim_k = K;
    p.head_dim_v = V;
    p.src = pool();
    p.dst = pool();
    p.dst.data = state_t.data();
    p.dst.layout = StateLayout::kVLast;
    return p;
  }
};

// Runs validate(p, backend) and checks the error code and that the message contains `text`.
template <class Params>
void expect_invalid(const Params& p, Backend backend, const std::string& text) {
  try {
    validate(p, backend);
    ADD_FAILURE() << "validate(" << backend_name(backend) << ") accepted the params; expected an error containing \""
                  << text << "\"";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos)
        << "message: \"" << e.what() << "\"\nexpected it to contain: \"" << text << "\"";
  }
}

// Both backends reject it with the same message.
template <class Params>
void expect_invalid_both(const Params& p, const std::string& text) {
  expect_invalid(p, Backend::kCPU, text);
  expect_invalid(p, Backend::kCUDA, text);
}

#define EXPECT_INVALID(params, backend, text) \
  do {                                        \
    SCOPED_TRACE(text);                       \
    expect_invalid(params, backend, text);    \
  } while (0)
#define EXPECT_INVALID_BOTH(params, text) \
  do {                                    \
    SCOPED_TRACE(text);                   \
    expect_invalid_both(params, text);    \
  } while (0)

// ---- the valid baseline passes (so every failure below is caused by the one changed field) ---------

TEST(Validation, ValidParamsPassOnBothBackends) {
  Host h;
  for (Backend be : {Backend::kCPU, Backend::kCUDA}) {
    SCOPED_TRACE(backend_name(be));
    EXPECT_NO_THROW(validate(h.decode(), be));
    EXPECT_NO_THROW(validate(h.verify(), be));
    EXPECT_NO_THROW(validate(h.commit(), be));
    EXPECT_NO_THROW(validate(h.prefill(), be));
    EXPECT_NO_THROW(validate(h.layout(), be));
  }
}

TEST(Validation, AcceptedVariants) {
  Host h;
  // Views of one fused projection: token stride larger than heads * head stride, padded heads.
  auto d = h.decode();
  d.q.head_stride = d.k.head_stride = Host::K + 8;
  d.q.token_stride = d.k.token_stride = 4 * (Host::K + 8);
  EXPECT_NO_THROW(validate(d, Backend::kCUDA));
  // Padding rows and slots >= P are not validation errors: they are skipped on the device (error flag).
  h.state_indices = {-1, Host::P + 7};
  EXPECT_NO_THROW(validate(h.decode(), Backend::kCPU));
  // B = 0 needs no pointers for tokens, pool or indices.
  DecodeParams empty = h.decode();
  empty.batch = 0;
  empty.q.data = empty.k.data = empty.v.data = nullptr;
  empty.o.data = nullptr;
  empty.state = StatePool{};
  empty.state_indices = nullptr;
  EXPECT_NO_THROW(validate(empty, Backend::kCPU));
  // Given gates, bf16 state, V-last layout with a matching intermediate cache, fp16 inputs.
  auto v = h.verify();
  v.gating.mode = GateMode::kGiven;
  v.gating.g = v.gating.a;
  v.gating.beta = v.gating.b;
  v.gating.beta.dtype = DType::kBFloat16;
  v.state.dtype = DType::kBFloat16;
  v.state.layout = v.intermediate.layout = StateLayout::kVLast;
  v.q.dtype = v.k.dtype = v.v.dtype = v.o.dtype = DType::kFloat16;
  EXPECT_NO_THROW(validate(v, Backend::kCUDA));
  // Commit by recompute needs neither q/o nor the intermediate cache.
  auto c = h.commit();
  c.source = CommitSource::kRecompute;
  c.q.data = nullptr;
  c.o.data = nullptr;
  c.intermediate.data = nullptr;
  c.intermediate_indices = nullptr;
  EXPECT_NO_THROW(validate(c, Backend::kCPU));
  // In-place layout conversion with K == V.
  auto l = h.layout();
  l.dst.data = l.src.data;
  EXPECT_NO_THROW(validate(l, Backend::kCUDA));
  // Prefill without any pool slot named needs no pool; int64 cu_seqlens.
  auto p = h.prefill();
  p.initial_indices = p.final_indices = nullptr;
  p.state = StatePool{};
  std::vector<int64_t> cu64{0, 2, 6};
  p.cu_seqlens = cu64.data();
  p.cu_seqlens_dtype = DType::kInt64;
  EXPECT_NO_THROW(validate(p, Backend::kCPU));
}

// ---- wrong dtype ----------------------------------------------------------------------------------

TEST(Validation, WrongDtype) {
  Host h;
  auto d = h.decode();
  d.state.dtype = DType::kInt32;
  EXPECT_INVALID_BOTH(d, "state: expected dtype float32, bfloat16, float16 or float8_e4m3, got int32");

  d = h.decode();
  d.q.dtype = d.k.dtype = DType::kInt32;
  EXPECT_INVALID_BOTH(d, "q: expected dtype float32, bfloat16 or float16, got int32");

  d = h.decode();  // float8_e4m3 is a state dtype only
  d.q.dtype = d.k.dtype = DType::kFloat8E4M3;
  EXPECT_INVALID_BOTH(d, "q: expected dtype float32, bfloat16 or float16, got float8_e4m3");

  d = h.decode();
  d.k.dtype = DType::kFloat16;
  EXPECT_INVALID_BOTH(d, "k: expected dtype bfloat16 (the dtype of q), got float16");

  d = h.decode();
  d.v.dtype = DType::kFloat32;
  EXPECT_INVALID_BOTH(d, "v: expected dtype bfloat16 (the dtype of q), got float32");

  d = h.decode();
  d.o.dtype = DType::kFloat32;
  EXPECT_INVALID_BOTH(d, "o: expected dtype bfloat16 (the dtype of v), got float32");

  d = h.decode();
  d.gating.mode = GateMode::kGiven;
  d.gating.g = d.gating.a;
  d.gating.beta = d.gating.b;
  d.gating.g.dtype = DType::kBFloat16;
  EXPECT_INVALID_BOTH(d, "g: expected dtype float32, got bfloat16");

  d = h.decode();
  d.gating.b.dtype = DType::kInt64;
  EXPECT_INVALID_BOTH(d, "b: expected dtype float32, bfloat16 or float16, got int64");

  auto v = h.verify();
  v.intermediate.dtype = DType::kInt32;
  EXPECT_INVALID_BOTH(v, "intermediate: expected dtype float32, bfloat16, float16 or float8_e4m3, got int32");

  auto p = h.prefill();
  p.cu_seqlens_dtype = DType::kFloat32;
  EXPECT_INVALID_BOTH(p, "cu_seqlens: expected dtype int32 or int64, got float32");

  auto l = h.layout();
  l.dst.dtype = DType::kBFloat16;
  EXPECT_INVALID_BOTH(l, "dst: expected dtype float32 (the dtype of src), got bfloat16");
}

// ---- heads and head dims --------------------------------------------------------------------------

TEST(Validation, HeadsMustDivide) {
  Host h;
  auto d = h.decode();
  d.heads.num_qk_heads = 12;
  d.heads.num_v_heads = 32;
  EXPECT_INVALID_BOTH(d, "q: H=12 does not divide HV=32");
  d.heads.num_qk_heads = 0;
  EXPECT_INVALID_BOTH(d, "q: number of q/k heads H must be > 0, got H=0");
  auto p = h.prefill();
  p.heads.num_qk_heads = 3;
  EXPECT_INVALID_BOTH(p, "q: H=3 does not divide HV=4");
  auto l = h.layout();
  l.num_v_heads = -1;
  EXPECT_INVALID_BOTH(l, "HV must be > 0, got HV=-1");
}

TEST(Validation, UnsupportedHeadDim) {
  Host h;
  auto d = h.decode();
  d.heads.head_dim_k = 96;
  EXPECT_INVALID_BOTH(d, "q: head dim K=96 is not supported (expected 64, 128 or 256)");
  d = h.decode();
  d.heads.head_dim_v = 512;
  EXPECT_INVALID_BOTH(d, "v: head dim V=512 is not supported (expected 64, 128 or 256)");
  auto l = h.layout();
  l.head_dim_k = 32;
  EXPECT_INVALID_BOTH(l, "head dim K=32 is not supported");
}

// ---- shapes, sizes, counts ------------------------------------------------------------------------

TEST(Validation, ShapeMismatch) {
  Host h;
  auto d = h.decode();
  d.batch = -1;
  EXPECT_INVALID_BOTH(d, "batch: must be >= 0, got B=-1");

  d = h.decode();
  d.state.slot_stride = Host::kState - 64;
  EXPECT_INVALID_BOTH(d, "state: slot_stride=" + std::to_string(Host::kState - 64) +
                             " is smaller than HV*K*V=" + std::to_string(Host::kState));

  d = h.decode();
  d.state.num_slots = 0;
  EXPECT_INVALID_BOTH(d, "state: num_slots must be >= 1, got 0");

  auto v = h.verify();
  v.num_draft_tokens = 0;
  EXPECT_INVALID_BOTH(v, "num_draft_tokens: must be >= 1, got T=0");

  v = h.verify();
  v.intermediate.num_steps = Host::T - 1;
  EXPECT_INVALID_BOTH(v, "intermediate: num_steps must be >= 3, got 2");

  v = h.verify();
  v.intermediate.slot_stride = Host::kState;  // room for one step, 3 needed
  EXPECT_INVALID_BOTH(v, "intermediate: slot_stride=" + std::to_string(Host::kState) +
                             " is smaller than num_steps*HV*K*V=" + std::to_string(3 * Host::kState));

  auto p = h.prefill();
  p.num_seqs = -2;
  EXPECT_INVALID_BOTH(p, "num_seqs: must be >= 0, got N=-2");

  p = h.prefill();
  p.total_tokens = 7;  // cu_seqlens ends at 6
  EXPECT_INVALID_BOTH(p, "cu_seqlens_host: last entry (index 2) must equal total_tokens=7, got 6");
  p.cu_seqlens_host = nullptr;  // the CPU backend reads cu_seqlens itself
  EXPECT_INVALID(p, Backend::kCPU, "cu_seqlens: last entry (index 2) must equal total_tokens=7, got 6");
  EXPECT_NO_THROW(validate(p, Backend::kCUDA));  // device memory: not readable before launch

  auto l = h.layout();
  l.dst.num_slots = Host::P - 1;
  EXPECT_INVALID_BOTH(l, "dst: expected num_slots=5 (that of src), got 4");
}

// ---- sequence boundaries --------------------------------------------------------------------------

TEST(Validation, NonMonotonicCuSeqlens) {
  Host h;
  auto p = h.prefill();
  // 4 sequences; cu_seqlens[3] < cu_seqlens[2], as in docs/semantics.md's example.
  std::vector<int64_t> host{0, 16, 40, 32, 48};
  std::vector<int32_t> dev{0, 16, 40, 32, 48};
  p.num_seqs = 4;
  p.total_tokens = 48;
  std::vector<uint16_t> q(48 * Host::H * Host::K), v(48 * Host::HV * Host::V), o(48 * Host::HV * Host::V);
  std::vector<float> ab(48 * Host::HV);
  std::vector<int32_t> slots{0, 1, 2, 3};
  p.q.data = p.k.data = q.data();
  p.v.data = v.data();
  p.o.data = o.data();
  p.gating.a.data = p.gating.b.data = ab.data();
  p.initial_indices = p.final_indices = slots.data();
  p.cu_seqlens_host = host.data();
  p.cu_seqlens = dev.data();
  EXPECT_INVALID_BOTH(p, "cu_seqlens_host: must be non-decreasing (index 3: 40 > 32)");
  p.cu_seqlens_host = nullptr;
  EXPECT_INVALID(p, Backend::kCPU, "cu_seqlens: must be non-decreasing (index 3: 40 > 32)");
  std::vector<int64_t> dev64{0, 16, 40, 32, 48};
  p.cu_seqlens = dev64.data();
  p.cu_seqlens_dtype = DType::kInt64;
  EXPECT_INVALID(p, Backend::kCPU, "cu_seqlens: must be non-decreasing (index 3: 40 > 32)");
  dev64[0] = 1;
  EXPECT_INVALID(p, Backend::kCPU, "cu_seqlens: must start at 0 (index 0: 1)");

  // Verify varlen: lengths must not exceed T (CPU backend: cu_seqlens is host memory).
  auto ver = h.verify();
  std::vector<int32_t> cu{0, 4, 5};  // sequence 0 has 4 > T = 3 tokens
  ver.cu_seqlens = cu.data();
  EXPECT_INVALID(ver, Backend::kCPU, "cu_seqlens: sequence 0 has 4 tokens, more than T=3");
  cu = {0, 3, 2};
  EXPECT_INVALID(ver, Backend::kCPU, "cu_seqlens: must be non-decreasing (index 2: 3 > 2)");
}

// ---- strides --------------------------------------------------------------------------------------

TEST(Validation, OverlappingStrides) {
  Host h;
  auto d = h.decode();
  d.q.head_stride = Host::K - 8;  // rows of consecutive heads overlap (the last dim is contiguous)
  EXPECT_INVALID_BOTH(d, "q: head_stride=56 is smaller than K=64 (rows of consecutive heads overlap)");

  d = h.decode();
  d.o.token_stride = (Host::HV - 1) * Host::V;  // the last head of token t is token t+1's first head
  EXPECT_INVALID_BOTH(d, "o: token_stride=192 overlaps the previous token (expected >= (HV-1)*head_stride + V = 256)");

  d = h.decode();
  d.v.token_stride = 0;  // a broadcast row is not a valid token view
  EXPECT_INVALID_BOTH(d, "v: token_stride=0 overlaps the previous token");

  d = h.decode();
  d.gating.a.head_stride = 0;
  EXPECT_INVALID_BOTH(d, "a: head_stride=0 is smaller than 1 (values of consecutive heads overlap)");

  d = h.decode();
  d.k.head_stride = -Host::K;
  EXPECT_INVALID_BOTH(d, "k: head_stride=-64 is smaller than K=64");
}

// ---- alignment: the CUDA rules, checked without a GPU ---------------------------------------------

TEST(Validation, MisalignedPointerCudaRules) {
  Host h;
  auto d = h.decode();
  d.q.data = h.q.data() + 1;  // 2-byte aligned: fine for the CPU backend, not for 16-byte vector loads
  EXPECT_NO_THROW(validate(d, Backend::kCPU));
  EXPECT_INVALID(d, Backend::kCUDA, "q: data pointer ");
  EXPECT_INVALID(d, Backend::kCUDA, " is not 16-byte aligned (CUDA backend: 16-byte vector loads)");

  d = h.decode();
  d.v.token_stride = Host::HV * Host::V + 4;  // 8 bytes past a 16-byte multiple
  EXPECT_NO_THROW(validate(d, Backend::kCPU));
  EXPECT_INVALID(
      d, Backend::kCUDA,
      "v: token_stride=260 is not a multiple of 8 elements (16 bytes of bfloat16, CUDA backend vector loads)");

  d = h.decode();
  d.state.slot_stride = Host::kState + 2;
  EXPECT_NO_THROW(validate(d, Backend::kCPU));
  EXPECT_INVALID(d, Backend::kCUDA, "state: slot_stride=16386 is not a multiple of 4 elements (16 bytes of float32");

  d = h.decode();
  d.state.data = reinterpret_cast<char*>(h.state.data()) + 4;
  EXPECT_NO_THROW(validate(d, Backend::kCPU));
  EXPECT_INVALID(d, Backend::kCUDA, "state: data pointer ");

  // Element alignment is required everywhere.
  d = h.decode();
  d.o.data = reinterpret_cast<char*>(h.o.data()) + 1;
  EXPECT_INVALID(d, Backend::kCPU, " is not 2-byte aligned (element alignment)");
  d = h.decode();
  d.gating.a.data = reinterpret_cast<const char*>(h.a.data()) + 2;
  EXPECT_INVALID_BOTH(d, "a: data pointer ");
  d = h.decode();
  d.state_indices = reinterpret_cast<const int32_t*>(reinterpret_cast<const char*>(h.state_indices.data()) + 1);
  EXPECT_INVALID_BOTH(d, " is not aligned to its int32 elements");

  // Per-head scalars are not vector-loaded: element alignment suffices on CUDA too.
  d = h.decode();
  d.gating.a.data = h.a.data() + 1;
  EXPECT_NO_THROW(validate(d, Backend::kCUDA));
}

// ---- null required pointers -----------------------------------------------------------------------

TEST(Validation, NullRequiredPointer) {
  Host h;
  auto d = h.decode();
  d.q.data = nullptr;
  EXPECT_INVALID_BOTH(d, "q: required pointer is null (2 tokens)");
  d = h.decode();
  d.o.data = nullptr;
  EXPECT_INVALID_BOTH(d, "o: required pointer is null");
  d = h.decode();
  d.state_indices = nullptr;
  EXPECT_INVALID_BOTH(d, "state_indices: required pointer is null (2 elements expected)");
  d = h.decode();
  d.state.data = nullptr;
  EXPECT_INVALID_BOTH(d, "state: required pointer is null");
  d = h.decode();
  d.gating.A_log = nullptr;
  EXPECT_INVALID_BOTH(d, "A_log: required pointer is null (fused gating needs A_log [HV] float32)");
  d = h.decode();
  d.gating.dt_bias = nullptr;
  EXPECT_INVALID_BOTH(d, "dt_bias: required pointer is null");
  d = h.decode();
  d.gating.mode = GateMode::kGiven;  // g and beta are not set
  d.gating.g.dtype = DType::kFloat32;
  EXPECT_INVALID_BOTH(d, "g: required pointer is null");

  auto v = h.verify();
  v.intermediate_indices = nullptr;
  EXPECT_INVALID_BOTH(v, "intermediate_indices: required pointer is null");

  auto c = h.commit();
  c.accepted = nullptr;
  EXPECT_INVALID_BOTH(c, "accepted: required pointer is null");
  c = h.commit();
  c.k.data = nullptr;  // commit reads k even though it never reads q
  EXPECT_INVALID_BOTH(c, "k: required pointer is null");

  auto p = h.prefill();
  p.cu_seqlens = nullptr;
  EXPECT_INVALID_BOTH(p, "cu_seqlens: required pointer is null (3 elements expected)");
  p = h.prefill();
  p.state.data = nullptr;  // initial/final indices name slots
  EXPECT_INVALID_BOTH(p, "state: required pointer is null");

  auto l = h.layout();
  l.src.data = nullptr;
  EXPECT_INVALID_BOTH(l, "src: required pointer is null (5 slots)");
}

// ---- caches, trees, commit sources, layouts -------------------------------------------------------

TEST(Validation, BadCacheAndLayoutCombos) {
  Host h;
  auto v = h.verify();
  v.intermediate.layout = StateLayout::kVLast;
  EXPECT_INVALID_BOTH(v, "intermediate: expected layout K-last [V,K] (the layout of state), got V-last [K,V]");

  v = h.verify();
  v.parent = h.parent.data();
  v.update_state = true;
  EXPECT_INVALID_BOTH(v, "update_state: only for chain drafts (parent must be nullptr), but parent is given");

  v = h.verify();
  h.parent[4] = 1;  // token 1 of sequence 1 cannot continue from itself
  v.parent = h.parent.data();
  EXPECT_INVALID(v, Backend::kCPU, "parent: expected -1 <= parent[b][t] < t (b=1, t=1), got 1");
  h.parent[4] = -1;

  // Varlen trees: parents past a sequence's length are padding and not checked.
  v = h.verify();
  std::vector<int32_t> cu{0, 3, 4};  // sequence 1 has one token
  v.cu_seqlens = cu.data();
  v.parent = h.parent.data();
  h.parent[5] = 7;
  EXPECT_NO_THROW(validate(v, Backend::kCPU));
  h.parent[3] = 0;  // token 0 of sequence 1 cannot continue from itself
  EXPECT_INVALID(v, Backend::kCPU, "parent: expected -1 <= parent[b][t] < t (b=1, t=0), got 0");
  h.parent[3] = -1;
  h.parent[5] = 1;

  auto c = h.commit();
  c.intermediate.data = nullptr;
  c.intermediate_indices = nullptr;
  EXPECT_INVALID_BOTH(c,
                      "intermediate: required pointer is null (commit from the cache reads the intermediate states)");

  c = h.commit();
  c.parent = h.parent.data();  // a tree: the kept tokens must be listed
  EXPECT_INVALID_BOTH(c, "accepted_path: required pointer is null");
  c.accepted_path = h.path.data();  // sequence 0 keeps tokens 0, 2 (parent[2] = 0): a path
  EXPECT_NO_THROW(validate(c, Backend::kCPU));
  h.path[1] = 1;  // tokens 0, 1 is a path too
  EXPECT_NO_THROW(validate(c, Backend::kCPU));
  h.accepted[1] = 2;  // sequence 1 keeps 0 then 0: token 0's parent is -1, not 0
  EXPECT_INVALID(c, Backend::kCPU, "accepted_path: token 0 (b=1, i=1) has parent -1, expected 0");
  h.accepted[1] = 0;

  c = h.commit();
  h.accepted[0] = Host::T + 1;
  EXPECT_INVALID(c, Backend::kCPU,
                 "accepted: expected 0 <= accepted[b] <= 3 (the draft length of sequence b=0), got 4");
  h.accepted[0] = 2;

  auto p = h.prefill();
  p.checkpoint_interval = 100;
  EXPECT_INVALID_BOTH(p, "checkpoint_interval: expected 0 or a multiple of 64 (the chunk), got 100");
  p.checkpoint_interval = 64;
  EXPECT_INVALID_BOTH(p, "checkpoints: required pointer is null (checkpoint_interval=64)");
  p.checkpoints.data = h.ckpt.data();
  p.checkpoints.num_slots = Host::N;
  p.checkpoints.num_steps = 1;
  p.checkpoints.slot_stride = Host::kState;
  p.checkpoints.layout = StateLayout::kVLast;
  EXPECT_INVALID_BOTH(p, "checkpoints: expected layout K-last [V,K] (the layout of state), got V-last [K,V]");
  p.checkpoints.layout = StateLayout::kKLast;
  EXPECT_INVALID_BOTH(p, "checkpoint_indices: required pointer is null");
  p.checkpoint_indices = h.ckpt_indices.data();
  EXPECT_NO_THROW(validate(p, Backend::kCPU));

  auto l = h.layout();
  l.dst.layout = StateLayout::kKLast;
  EXPECT_INVALID_BOTH(l, "dst: expected layout V-last [K,V] (opposite of src), got K-last [V,K]");

  l = h.layout();
  l.head_dim_v = 128;
  l.src.slot_stride = l.dst.slot_stride = int64_t(Host::HV) * Host::K * 128;
  l.src.num_slots = l.dst.num_slots = 2;
  l.dst.data = l.src.data;
  EXPECT_INVALID_BOTH(l, "dst: in-place conversion needs K == V, got K=64, V=128");

  l = h.layout();
  l.dst.data = h.state.data() + Host::kState;  // overlaps src's slots 1..4
  EXPECT_INVALID_BOTH(l, "dst: overlaps src");

  l = h.layout();
  l.src.dtype = l.dst.dtype = DType::kInt32;
  EXPECT_INVALID_BOTH(l, "src: expected dtype float32, bfloat16, float16 or float8_e4m3, got int32");
}

TEST(Validation, UnknownEnumsAndOptions) {
  Host h;
  auto d = h.decode();
  d.state.layout = static_cast<StateLayout>(7);
  EXPECT_INVALID_BOTH(d, "state: unknown state layout 7 (expected K-last or V-last)");
  d = h.decode();
  d.gating.mode = static_cast<GateMode>(3);
  EXPECT_INVALID_BOTH(d, "gating: unknown mode 3 (expected kGiven or kFused)");
  d = h.decode();
  d.heads.scale = NAN;
  EXPECT_INVALID_BOTH(d, "scale: expected a finite value");
  auto c = h.commit();
  c.source = static_cast<CommitSource>(5);
  EXPECT_INVALID_BOTH(c, "source: unknown commit source 5 (expected kCache or kRecompute)");
  auto p = h.prefill();
  p.cpu_algorithm = static_cast<PrefillAlgorithm>(9);
  EXPECT_INVALID_BOTH(p, "cpu_algorithm: unknown value 9");
}

// A caller-provided prefill workspace must hold prefill_workspace_bytes() (CUDA backend only).
TEST(Validation, PrefillWorkspaceTooSmall) {
  Host h;
  auto p = h.prefill();
  std::vector<float> ws(4);
  p.workspace = ws.data();
  p.workspace_bytes = sizeof(float) * ws.size();
  EXPECT_NO_THROW(validate(p, Backend::kCPU));  // the CPU backend has no workspace
  const size_t need = prefill_workspace_bytes(p);
  if (need <= p.workspace_bytes) GTEST_SKIP() << "built without CUDA: no workspace is needed (" << need << " bytes)";
  EXPECT_INVALID(p, Backend::kCUDA,
                 "workspace: expected at least " + std::to_string(need) + " bytes (prefill_workspace_bytes), got 16");
}

// ---- the entries validate before anything else -----------------------------------------------------

// Validation runs before the device check: the CUDA entries report bad params, not a missing GPU.
TEST(Validation, EntriesValidateBeforeTheDeviceCheck) {
  Host h;
  auto d = h.decode();
  d.heads.num_qk_heads = 3;
  try {
    decode(d, Context{Backend::kCUDA, nullptr});
    ADD_FAILURE() << "decode accepted bad params";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find("q: H=3 does not divide HV=4"), std::string::npos) << e.what();
  }
}

// Snapshot of every buffer an op may write.
struct Snapshot {
  std::vector<std::vector<unsigned char>> bytes;
  template <class... Vecs>
  explicit Snapshot(const Vecs&... vecs) {
    (bytes.push_back(raw(vecs)), ...);
  }
  template <class T>
  static std::vector<unsigned char> raw(const std::vector<T>& v) {
    std::vector<unsigned char> out(v.size() * sizeof(T));
    std::memcpy(out.data(), v.data(), out.size());
    return out;
  }
};

Snapshot snapshot(const Host& h) { return Snapshot(h.o, h.state, h.state_t, h.inter, h.ckpt, h.error_flag); }

// Calls the entry on the CPU backend, expects kInvalidArgument with `text`, and checks that outputs,
// pool, caches and error flag are bit-identical afterwards (they hold NaN and patterns, so a partial
// write would show).
template <class Params, class Entry>
void expect_nothing_written(Host& h, const Params& p, Entry entry, const std::string& text) {
  SCOPED_TRACE(text);
  for (size_t i = 0; i < h.state.size(); i += 3) h.state[i] = float(i % 11) * 0.5f;  // NaN + a pattern
  const Snapshot before = snapshot(h);
  try {
    entry(p, Context{Backend::kCPU, nullptr});
    ADD_FAILURE() << "the entry accepted bad params";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
  const Snapshot after = snapshot(h);
  ASSERT_EQ(before.bytes.size(), after.bytes.size());
  for (size_t i = 0; i < before.bytes.size(); ++i) EXPECT_TRUE(before.bytes[i] == after.bytes[i]) << "buffer " << i;
}

TEST(Validation, NothingWrittenWhenValidationFails) {
  Host h;
  // Each bad field is one of the last things its validation checks, so a write before validation ends
  // would have happened already.
  auto d = h.decode();
  d.error_flag = reinterpret_cast<int32_t*>(reinterpret_cast<char*>(h.error_flag.data()) + 2);
  expect_nothing_written(
      h, d, [](const auto& p, const Context& c) { decode(p, c); }, "error_flag: data pointer ");

  auto v = h.verify();
  v.intermediate_indices = nullptr;
  v.update_state = true;
  expect_nothing_written(
      h, v, [](const auto& p, const Context& c) { verify(p, c); }, "intermediate_indices: required pointer is null");

  auto c = h.commit();
  h.accepted[1] = 9;
  expect_nothing_written(
      h, c, [](const auto& p, const Context& ctx) { commit(p, ctx); }, "accepted: expected 0 <= accepted[b] <= 3");
  h.accepted[1] = 0;

  auto p = h.prefill();
  p.checkpoint_interval = 64;
  p.checkpoints.data = h.ckpt.data();
  p.checkpoints.num_slots = Host::N;
  p.checkpoints.num_steps = 1;
  p.checkpoints.slot_stride = Host::kState;
  expect_nothing_written(
      h, p, [](const auto& q, const Context& ctx) { prefill(q, ctx); }, "checkpoint_indices: required pointer is null");

  auto l = h.layout();
  l.dst.data = h.state.data() + 5;
  expect_nothing_written(
      h, l, [](const auto& q, const Context& ctx) { convert_layout(q, ctx); }, "dst: overlaps src");
}

// A chain's accepted_path must be its prefix 0..accepted-1 (a chain's parent is t-1).
TEST(Validation, ChainAcceptedPathMustBeThePrefix) {
  Host h;
  auto c = h.commit();              // chain (no parent), from the cache; accepted = {2, 0}
  c.accepted_path = h.path.data();  // sequence 0 keeps tokens 0, 2: not a path of the chain
  EXPECT_INVALID(c, Backend::kCPU, "accepted_path: token 2 (b=0, i=1) has parent 1, expected 0");
  h.path[1] = 1;  // 0, 1: the prefix
  EXPECT_NO_THROW(validate(c, Backend::kCPU));
}
// Out of place, src's fp8 scales must not lie in dst's data.
TEST(Validation, LayoutSrcScalesInsideDstDataRefused) {
  Host h;
  auto l = h.layout();
  std::vector<uint8_t> dst_scales(size_t(Host::P) * Host::kState / kFp8Block);
  l.src.dtype = l.dst.dtype = DType::kFloat8E4M3;
  l.src.scales = reinterpret_cast<uint8_t*>(h.state_t.data());  // the first bytes of dst's slot 0
  l.dst.scales = dst_scales.data();
  EXPECT_INVALID_BOTH(l, "dst: overlaps the scales of src");
}
// Commit leaves padding rows alone: their accepted / accepted_path are not read.
TEST(Validation, CommitPaddingRowIsNotChecked) {
  Host h;
  h.state_indices = {-1, 1};
  h.accepted = {9, 0};
  EXPECT_NO_THROW(validate(h.commit(), Backend::kCPU));
}
// Range, overflow and CUDA alignment rules, each with its message.
TEST(Validation, RangeOverflowAndAlignmentRules) {
  Host h;
  auto c = h.commit();
  c.accepted_path = h.path.data();
  h.path[1] = Host::T;  // past sequence 0's 3 tokens
  EXPECT_INVALID(c, Backend::kCPU, "accepted_path: expected a token index in [0, 3) (b=0, i=1), got 3");
  h.path[1] = 2;

  auto p = h.prefill();
  p.num_seqs = 0;
  p.cu_seqlens = nullptr;
  p.cu_seqlens_host = nullptr;
  EXPECT_INVALID_BOTH(p, "total_tokens: expected 0 when cu_seqlens is null, got 6");

  auto l = h.layout();
  l.src.num_slots = l.dst.num_slots = -1;
  EXPECT_INVALID_BOTH(l, "src: num_slots must be >= 0, got -1");
  l = h.layout();
  l.src.slot_stride = l.dst.slot_stride = INT64_MAX / 2;
  EXPECT_INVALID_BOTH(l, "src: num_slots=5 x slot_stride=4611686018427387903 overflows int64");

  auto v = h.verify();
  v.intermediate.num_steps = INT64_MAX / 2;
  EXPECT_INVALID_BOTH(v, "intermediate: num_steps=4611686018427387903 is too large (offsets overflow int64)");

  auto d = h.decode();
  d.v.head_stride = INT64_MAX / 2;  // (HV-1)*head_stride + V overflows
  EXPECT_INVALID_BOTH(d, "v: head_stride=4611686018427387903 is too large (offsets overflow int64)");

  d = h.decode();
  d.v.head_stride = Host::V + 4;  // 136 bytes: not a multiple of 16
  d.v.token_stride = Host::HV * (Host::V + 8);
  EXPECT_NO_THROW(validate(d, Backend::kCPU));
  EXPECT_INVALID(d, Backend::kCUDA,
                 "v: head_stride=68 is not a multiple of 8 elements (16 bytes of bfloat16, CUDA backend vector loads)");

  p = h.prefill();
  std::vector<float> ws(prefill_workspace_bytes(p) / sizeof(float) + 8);
  p.workspace = ws.data() + 1;
  p.workspace_bytes = (ws.size() - 1) * sizeof(float);
  EXPECT_INVALID(p, Backend::kCUDA, "workspace: data pointer ");
}

}  // namespace
}  // namespace gdnkit
