// CUDA chunked prefill, host side: the choice (heuristics.h) turned into a plan, the workspace (the caller's or
// the library-owned one), the TMA descriptors, and the dispatch on the head dim K. Kernels: kernels.cuh.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include <cudaTypedefs.h>

#include "common/split.h"
#include "cuda/backend.h"
#include "cuda/host/check.h"
#include "cuda/prefill/item_order.cuh"
#include "cuda/prefill/plan.h"
#include "cuda/prefill/staged_states.h"

namespace gdnkit::cuda {
namespace chunked_prefill {
namespace {


size_t t_bytes(const PrefillParams& p) {
  return workspace_round_up(size_t(num_chunk_slots(p)) * size_t(p.heads.num_v_heads) * kChunk * kChunk * 2);
}
size_t f_bytes(const PrefillParams& p) {
  return workspace_round_up(size_t(num_chunk_slots(p)) * size_t(p.heads.num_v_heads) * kFactorRowsMax * kChunk * 4);
}
// A count per chunk slot: the chunk prep's CTAs that finished (H prep_parts of them; Plan::chunk_ready), then the
// persistent pass's item counter (Plan::pass_ticket), then the head pass's order of the sequences (Plan::pass_order).
size_t ready_bytes(const PrefillParams& p) {
  return workspace_round_up(size_t(num_chunk_slots(p) + 1 + p.num_seqs) * 4);
}
// The regions in order: T', M, the factors, the context-parallel part (cp_workspace_bytes), the counts.
size_t cp_offset(const PrefillParams& p) { return 2 * t_bytes(p) + f_bytes(p); }
size_t ready_offset(const PrefillParams& p) { return cp_offset(p) + cp_workspace_bytes(p, overrides()); }

// The workspace the library owns per device when PrefillParams::workspace is nullptr. It only grows;
// growing frees the old buffer (cudaFree waits for the device, so kernels still using it finish
// first) and is refused while the stream is capturing a graph: make one eager call first.
struct OwnedWorkspace {
  std::mutex mutex;
  std::vector<std::pair<void*, size_t>> per_device;
};
OwnedWorkspace& owned() {
  static OwnedWorkspace w;  // never destroyed before exit; the driver reclaims the memory
  return w;
}

void* owned_workspace(size_t bytes, cudaStream_t stream) {
  int dev = 0;
  GDNKIT_CUDA_CHECK(cudaGetDevice(&dev));
  OwnedWorkspace& w = owned();
  std::lock_guard<std::mutex> lock(w.mutex);
  if (w.per_device.size() <= size_t(dev)) w.per_device.resize(size_t(dev) + 1, {nullptr, 0});
  auto& [ptr, size] = w.per_device[size_t(dev)];
  if (size >= bytes) return ptr;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  GDNKIT_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  if (status != cudaStreamCaptureStatusNone)
    throw Error(ErrorCode::kInvalidArgument,
                "workspace: the library-owned prefill workspace must grow to " + std::to_string(bytes) +
                    " bytes (has " + std::to_string(size) +
                    ") while the stream is capturing a CUDA graph; make one eager prefill call with the largest "
                    "sizes before capture, or pass PrefillParams::workspace (prefill_workspace_bytes)");
  if (ptr != nullptr) GDNKIT_CUDA_CHECK(cudaFree(ptr));
  ptr = nullptr;
  size = 0;
  GDNKIT_CUDA_CHECK(cudaMalloc(&ptr, bytes));
  size = bytes;
  return ptr;
}

bool aligned(const void* ptr, size_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

}  // namespace

// T', M and the token factors, M's region also where the call's pass forms M (then it is not used): so
// the size grows with the tokens and the sequences alone, and a buffer sized for the largest call serves
// every smaller one, whose pass may read M (one or two sequences: the column split). Staged states add their
// copies in front (staged_bytes: the sequences, and T / C checkpoint entries).
size_t workspace_bytes(const PrefillParams& p) {
  if (states_staged(p) && p.num_seqs > 0) return staged_bytes(p) + workspace_bytes(staged_shape(p));
  if (p.num_seqs <= 0 || p.total_tokens <= 0) return 0;
  return ready_offset(p) + ready_bytes(p);
}

void carve_workspace(const PrefillParams& p, void* base, Plan& plan, bool chunk_flags, bool ticket, bool order) {
  if (base == nullptr) {  // no workspace: no tokens
    plan.ws_tprime = plan.ws_masked_qk = nullptr;
    plan.ws_factors = nullptr;
    return;
  }
  char* at = static_cast<char*>(base);
  plan.ws_tprime = at;
  plan.ws_masked_qk = plan.m_in_pass ? nullptr : at + t_bytes(p);
  plan.ws_factors = reinterpret_cast<float*>(at + 2 * t_bytes(p));
  if (chunk_flags) plan.chunk_ready = reinterpret_cast<uint32_t*>(at + ready_offset(p));
  if (ticket) plan.pass_ticket = reinterpret_cast<uint32_t*>(at + ready_offset(p)) + num_chunk_slots(p);
  if (order)  // after the ticket
    plan.pass_order = reinterpret_cast<int32_t*>(at + ready_offset(p)) + num_chunk_slots(p) + 1;
  if (plan.cp_segment_len > 0) {  // the segment table and its indices, then the three per-segment states
    char* cp = at + cp_offset(p);
    const CpLayout l = cp_layout(p, plan.cp_max_segments, plan.cp_max_states, plan.cp_max_cuts);
    plan.cp_segments = reinterpret_cast<CpSegment*>(cp);
    plan.cp_state_entry = reinterpret_cast<int32_t*>(cp + l.state_entry);
    plan.cp_cut_first = reinterpret_cast<int32_t*>(cp + l.cut_first);
    plan.cp_local = reinterpret_cast<float*>(cp + l.states);
    plan.cp_transition = reinterpret_cast<float*>(cp + l.states + l.state_bytes);
    plan.cp_initial = reinterpret_cast<float*>(cp + l.states + 2 * l.state_bytes);
  }
}

namespace {
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    GDNKIT_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || ptr == nullptr)
      throw Error(ErrorCode::kCudaError, "cuTensorMapEncodeTiled: not found in the CUDA driver");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

// A 128B-swizzled tiled map over `rank` dims (dims[0] innermost, 16-bit elements), byte strides of the
// outer dims, boxes of 64 x (1 x) 64.
CUtensorMap encode_map(const char* name, const void* data, bool fp16, int rank, const cuuint64_t* dims,
                       const cuuint64_t* strides, const cuuint32_t* box) {
  CUtensorMap map;
  const cuuint32_t unit[3] = {1, 1, 1};
  const CUresult r = tensor_map_encoder()(
      &map, fp16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, cuuint32_t(rank),
      const_cast<void*>(data), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw Error(ErrorCode::kCudaError, std::string("cuTensorMapEncodeTiled(") + name + ") failed: error " +
                                           std::to_string(int(r)));
  return map;
}
}  // namespace

HeadTensorMaps make_head_tensor_maps(const PrefillParams& p, const Plan& plan) {
  const cuuint64_t T = cuuint64_t(p.total_tokens);
  const cuuint32_t box3[3] = {64, 1, kChunk};
  auto rows3 = [&](const char* name, const auto& view, int heads, int dim) {
    const cuuint64_t dims[3] = {cuuint64_t(dim), cuuint64_t(heads), T};
    // one head: its stride is never stepped (any multiple of 16 bytes will do)
    const cuuint64_t head_bytes = heads > 1 ? cuuint64_t(view.head_stride) * 2 : cuuint64_t(dim) * 2;
    const cuuint64_t strides[2] = {head_bytes, cuuint64_t(view.token_stride) * 2};
    return encode_map(name, view.data, plan.fp16_operands, 3, dims, strides, box3);
  };
  HeadTensorMaps m;
  m.k = rows3("k", p.k, p.heads.num_qk_heads, p.heads.head_dim_k);
  m.q = rows3("q", p.q, p.heads.num_qk_heads, p.heads.head_dim_k);
  m.v = rows3("v", p.v, p.heads.num_v_heads, p.heads.head_dim_v);
  m.o = rows3("o", p.o, p.heads.num_v_heads, p.heads.head_dim_v);
  return m;
}

namespace {
// The plan of a call from its choice (without the workspace). Clears p.checkpoint_interval where nothing is stored.
Plan make_plan(PrefillParams& p, const PrefillChoice& choice) {
  const int K = p.heads.head_dim_k;
  Plan plan;
  plan.scale = p.heads.scale > 0.0f ? p.heads.scale : 1.0f / std::sqrt(float(K));
  plan.qkv_vec = qkv_vectorized(p);
  plan.fp16_operands = p.q.dtype != DType::kBFloat16;
  const int64_t oes = dtype_size(p.o.dtype);
  plan.o_pair = aligned(p.o.data, size_t(2 * oes)) && p.o.token_stride % 2 == 0 && p.o.head_stride % 2 == 0;
  // Without checkpoint indices no checkpoint is stored: interval 0 tells the kernel so.
  if (p.checkpoint_indices == nullptr || p.checkpoints.data == nullptr) p.checkpoint_interval = 0;
  // The kernels read the states' layout from the pool's (states_layout: the checkpoints' without a pool).
  p.state.layout = states_layout(p);
  // Pairs (k, k+1) of a K-last state are adjacent; every offset the kernels form is even when the
  // slot stride is (heads and value rows are K elements apart, K even).
  const bool klast = p.state.layout == StateLayout::kKLast;
  plan.state_pairs = klast && aligned(p.state.data, 2 * dtype_size(p.state.dtype)) && p.state.slot_stride % 2 == 0;
  plan.state_bulk = state_bulk_copies(p, choice.head_split);
  plan.checkpoint_pairs = klast && p.checkpoints.data != nullptr &&
                          aligned(p.checkpoints.data, 2 * dtype_size(p.checkpoints.dtype)) &&
                          p.checkpoints.slot_stride % 2 == 0;
  plan.checkpoint_bulk = checkpoint_bulk_copies(p, choice.head_split);
  plan.num_slots = p.total_tokens > 0 ? num_chunk_slots(p) : 0;
  plan.head_split = choice.head_split;
  plan.wgmma_pass = choice.wgmma_pass;
  plan.m_in_pass = choice.m_in_pass;
  plan.m_warpgroup = choice.m_warpgroup;
  plan.fused_prep = choice.fused_prep;
  plan.early_state_pass = choice.early_state_pass;
  plan.prep_parts = choice.prep_parts;
  plan.pass_ctas = choice.pass_ctas;
  plan.short_len = choice.short_len;
  plan.cp_segment_len = choice.cp_segment_len;
  plan.cp_first_final = choice.cp_first_final;
  plan.cp_scan_cols = choice.cp_scan_cols;
  plan.cp_max_segments = choice.cp_segment_len > 0 ? int32_t(cp_max_segments(p, choice.cp_segment_len)) : 0;
  plan.cp_max_states = choice.cp_segment_len > 0 ? int32_t(cp_max_states(p, choice.cp_segment_len)) : 0;
  plan.cp_max_cuts = int32_t(cp_max_cuts(plan.cp_max_states));
  return plan;
}

// The caller's workspace (checked against `need`) or the library's.
void* call_workspace(const PrefillParams& p, size_t need, const char* sizer, cudaStream_t stream) {
  if (need == 0) return nullptr;
  if (p.workspace == nullptr) return owned_workspace(need, stream);
  if (p.workspace_bytes < need)
    throw Error(ErrorCode::kInvalidArgument, "workspace: expected at least " + std::to_string(need) + " bytes (" +
                                                 sizer + "), got " + std::to_string(p.workspace_bytes));
  return p.workspace;
}
}  // namespace

void run(const PrefillParams& p_in, cudaStream_t stream) {
  if (p_in.num_seqs <= 0) return;
  if (states_staged(p_in)) {  // on K-last fp32 copies of the states (staged_states.h)
    const size_t need = workspace_bytes(p_in);
    const PrefillParams staged =
        stage_states_in(p_in, call_workspace(p_in, need, "prefill_workspace_bytes", stream), need, stream);
    run(staged, stream);
    return stage_states_out(p_in, staged, stream);
  }
  PrefillParams p = p_in;
  const PrefillChoice choice = choose_prefill(p, device_sms(), overrides());
  if (choice.only_short) return prefill_short(p, choice.short_len, reinterpret_cast<Stream>(stream));

  const int K = p.heads.head_dim_k;
  if (K != 64 && K != 128 && K != 256)
    throw Error(ErrorCode::kInvalidArgument,
                "q: head dim K=" + std::to_string(K) + " is not supported (expected 64, 128 or 256)");
  Plan plan = make_plan(p, choice);
  void* ws = call_workspace(p, workspace_bytes(p), "prefill_workspace_bytes", stream);
  carve_workspace(p, ws, plan, choice.chunk_flags, choice.persistent_pass, choice.longest_first);
  // before the chunk prep, behind which the pass launches early
  if (plan.pass_order != nullptr) launch_pass_order(p, plan.pass_order, stream);
  if (choice.short_len > 0) prefill_short(p, choice.short_len, reinterpret_cast<Stream>(stream));
  if (K == 64) launch<64>(p, plan, choice.vtile, stream, choice.stages);
  if (K == 128) launch<128>(p, plan, choice.vtile, stream, choice.stages);
  if (K == 256) launch<256>(p, plan, choice.vtile, stream, choice.stages);
}

size_t split_workspace_bytes(const SplitPrefillParams& sp) {
  const PrefillParams p = split_local_params(sp);
  if (p.num_seqs <= 0) return 0;
  return cp_offset(p) + split_cp_workspace_bytes(p, device_sms(), overrides());
}

void run_split(const SplitPrefillParams& sp, bool begin, cudaStream_t stream) {
  PrefillParams p = split_local_params(sp);
  if (p.num_seqs <= 0) return;
  const PrefillChoice choice = choose_split(p, device_sms(), overrides());
  Plan plan = make_plan(p, choice);
  plan.cp_max_states = plan.cp_max_segments;  // every piece's segments hold states
  plan.cp_max_cuts = p.num_seqs;
  plan.cp_split = true;
  plan.split_rank = sp.rank;
  plan.split_ranks = sp.num_ranks;
  plan.split_final = p.final_indices != nullptr;
  plan.split_offsets = sp.piece_offsets;
  plan.split_exchange = sp.exchange;
  carve_workspace(p, call_workspace(p, split_workspace_bytes(sp), "split_prefill_workspace_bytes", stream), plan, false,
                  false, false);
  if (p.heads.head_dim_k == 64) launch_split<64>(p, plan, begin, stream);
  if (p.heads.head_dim_k == 128) launch_split<128>(p, plan, begin, stream);
}

}  // namespace chunked_prefill

void prefill(const PrefillParams& p, Stream stream) {
  chunked_prefill::run(p, reinterpret_cast<cudaStream_t>(stream));
}

size_t prefill_workspace_bytes(const PrefillParams& p) { return chunked_prefill::workspace_bytes(p); }

namespace chunked_prefill {
void order_longest_first(const PrefillParams& p, int32_t* order, cudaStream_t stream) {
  if (p.num_seqs > 0) launch_pass_order(p, order, stream);
}
}  // namespace chunked_prefill

void split_prefill_begin(const SplitPrefillParams& p, Stream stream) {
  chunked_prefill::run_split(p, true, reinterpret_cast<cudaStream_t>(stream));
}
void split_prefill_end(const SplitPrefillParams& p, Stream stream) {
  chunked_prefill::run_split(p, false, reinterpret_cast<cudaStream_t>(stream));
}

size_t split_prefill_workspace_bytes(const SplitPrefillParams& p) { return chunked_prefill::split_workspace_bytes(p); }

}  // namespace gdnkit::cuda
