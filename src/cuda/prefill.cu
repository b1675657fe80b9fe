// CUDA chunked prefill: host side. Workspace sizing and the library-owned workspace, the value-tile
// heuristic, alignment checks, and the dispatch on the head dim K. Kernels: cuda/prefill/kernels.cuh.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include <cudaTypedefs.h>

#include "api/backends.h"
#include "cuda/check.h"
#include "cuda/common/sequence.cuh"
#include "cuda/prefill/plan.h"

namespace gdnkit::cuda {
namespace chunked_prefill {
namespace {

constexpr size_t kAlign = 256;
size_t round_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

size_t t_bytes(const PrefillParams& p) {
  return round_up(size_t(num_chunk_slots(p)) * size_t(p.heads.num_v_heads) * kChunk * kChunk * 2);
}
size_t f_bytes(const PrefillParams& p) {
  return round_up(size_t(num_chunk_slots(p)) * size_t(p.heads.num_v_heads) * kFactorRowsMax * kChunk * 4);
}

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

// 16-byte loads of 8 contiguous elements need the base and both strides in whole 16-byte units.
template <class View>
bool vec_ok(const View& v) {
  const int64_t per = 16 / dtype_size(v.dtype);
  return aligned(v.data, 16) && v.token_stride % per == 0 && v.head_stride % per == 0;
}

}  // namespace

// T', M and the token factors, M's region also where the call's pass forms M (then it is not used): so
// the size grows with the tokens and the sequences alone, and a buffer sized for the largest call serves
// every smaller one, whose pass may read M (one or two sequences: the column split).
size_t workspace_bytes(const PrefillParams& p) {
  if (p.num_seqs <= 0 || p.total_tokens <= 0) return 0;
  return 2 * t_bytes(p) + f_bytes(p);
}

void carve_workspace(const PrefillParams& p, void* base, Plan& plan) {
  if (base == nullptr) {  // no workspace (no tokens, or no chunk prep kernel: kAuxAll)
    plan.ws_t = plan.ws_m = nullptr;
    plan.ws_f = nullptr;
    return;
  }
  char* at = static_cast<char*>(base);
  plan.ws_t = at;
  plan.ws_m = plan.m_in_pass ? nullptr : at + t_bytes(p);
  plan.ws_f = reinterpret_cast<float*>(at + 2 * t_bytes(p));
}

// Without tokens there is nothing to load (and no tensor to map): the mma.sync build stores the states.
bool head_tensor_maps_ok(const PrefillParams& p, const Plan& plan) {
  constexpr int64_t kMax = int64_t(1) << 31;  // TMA coordinates are signed 32-bit
  return p.total_tokens > 0 && plan.num_slots > 0 && p.total_tokens + kChunk < kMax;
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
  return m;
}

bool head_pass_wgmma(const PrefillParams& p, const Plan& plan, int vtile) {
  return vtile == kVTileHead && p.heads.head_dim_k <= 128 && (p.heads.head_dim_v / plan.head_split) % 64 == 0 &&
         head_tensor_maps_ok(p, plan);
}

bool aux_prep_possible(const PrefillParams& p, const Plan& plan) {
  return plan.wgmma_pass && plan.head_split == 1 && p.heads.head_dim_v == 128 && p.heads.head_dim_k % 64 == 0;
}

int choose_aux_prep(const PrefillParams& p, const Plan& plan, int aux) {
  if (!aux_prep_possible(p, plan)) return kAuxNone;
  if (aux >= 0) return std::min(aux, kAuxAll);
  const int from_env = prefill_aux_override();
  if (from_env >= 0) return from_env;
  // Measured (H100, qwen3-next, results/H100/prefill_ab17_aux.txt): M in the prep warpgroup takes 8x8192 1.11 ->
  // 1.04 ms, 32x8192 4.34 -> 4.07, 4x2048 -5.5%, 8x1024 -4%, but 8192x32 (a chunk per sequence, where nothing
  // overlaps the warpgroup's work) +3%; the whole chunk prep in it is 1.3-1.7x slower everywhere (its solve and
  // products take ~14k cycles a chunk against the state warpgroups' ~4.5k). So M there from 4 chunks per sequence.
  return p.total_tokens >= int64_t(4) * kChunk * p.num_seqs ? kAuxM : kAuxNone;
}

int plan_state_pass(const PrefillParams& p, Plan& plan, int num_sms, int vtile, int head_split, int aux) {
  plan.num_slots = p.num_seqs > 0 && p.total_tokens > 0 ? num_chunk_slots(p) : 0;
  if (vtile == 0) vtile = choose_vtile(p, num_sms);
  plan.head_split = head_split != 0 ? head_split : choose_head_split(p, num_sms);
  plan.wgmma_pass = head_pass_wgmma(p, plan, vtile);
  plan.aux_prep = choose_aux_prep(p, plan, aux);
  // m_in_pass: the chunk prep without M (M formed by the state warpgroups, or by the prep warpgroup)
  const bool state_forms_m = head_pass_forms_m(plan.wgmma_pass, p.heads.head_dim_v / plan.head_split);
  plan.m_in_pass = plan.aux_prep == kAuxM || (plan.aux_prep == kAuxNone && state_forms_m);
  return vtile;
}

bool vtile_supported(int K, int vtile) {
  return vtile == 16 || vtile == 32 || (vtile == 64 && K <= 128) || (is_head_tile(vtile) && K <= 128);
}

bool head_pass_ok(const PrefillParams& p) {
  const int K = p.heads.head_dim_k, V = p.heads.head_dim_v;
  const DType dt = p.q.dtype;
  return K <= 128 && (V == 64 || V == 128) && (dt == DType::kBFloat16 || dt == DType::kFloat16) &&
         p.k.dtype == dt && p.v.dtype == dt && p.o.dtype == dt && vec_ok(p.q) && vec_ok(p.k) && vec_ok(p.v) &&
         vec_ok(p.o);
}

bool head_split_supported(int V, int split) { return split == 1 || (split == 2 && V / 2 >= 32); }

// Measured on the H100 (1x32768, 1x8192: 32 heads): split 2 takes 0.67 of split 1's state pass time;
// a split of 4 (two warps per CTA) was slower than 2 and is not built.
int choose_head_split(const PrefillParams& p, int num_sms) {
  const int64_t heads = int64_t(p.num_seqs) * p.heads.num_v_heads;
  return head_split_supported(p.heads.head_dim_v, 2) && heads * 2 <= num_sms ? 2 : 1;
}

// The head state pass when it can run. Otherwise the tiled state pass, whose parallelism is
// N * HV * (V / VT) CTAs: the widest tile (least recomputation of the per-chunk q k^T and fewest q/k
// reloads) that still gives about two CTAs per SM, else the narrowest.
int choose_vtile(const PrefillParams& p, int num_sms) {
  if (head_pass_ok(p)) return kVTileHead;
  const int K = p.heads.head_dim_k, V = p.heads.head_dim_v;
  const int64_t rows = int64_t(p.num_seqs) * p.heads.num_v_heads;
  for (int vt : {64, 32, 16})
    if (vtile_supported(K, vt) && vt <= V && rows * (V / vt) >= 2 * int64_t(num_sms)) return vt;
  return 16;
}

// The short-sequence path's default reach: the longest sequence it beats the chunked kernels on, measured
// on the H100 (qwen3-next heads, 1024 sequences of L tokens, short-path time / chunked time;
// results/H100/prefill_short_reach_{off,64}.md). The recurrent kernels' math grows with the tokens, the
// chunked kernels' state I/O does not.
//   K-last, bf16 inputs (the chain kernel on tensor cores), fp32 pool: 0.50x at L = 8, 0.60 at 16, 0.79 at 24,
//     1.05 at 32 -> 24; bf16 pool: 0.31, 0.44, 0.61, 0.77 at 32 -> 32 (longer not measured)
//   the warp kernel (V-last; K-last with fp16 inputs, not measured, takes the same), fp32 pool: 0.98 at 8,
//     1.40 at 16 -> 8; bf16 pool: 0.55 at 8, 0.90 at 16, 1.28 at 24 -> 16
int short_len_default(const PrefillParams& p) {
  const bool bf16_pool = p.state.dtype == DType::kBFloat16;
  if (p.state.layout == StateLayout::kKLast && p.q.dtype == DType::kBFloat16) return bf16_pool ? 32 : 24;
  return bf16_pool ? 16 : 8;
}

// Sequences of at most len tokens, by the host copy of cu_seqlens (which the caller checks is given).
int32_t count_short(const PrefillParams& p, int len) {
  int32_t count = 0;
  for (int32_t n = 0; n < p.num_seqs; ++n)
    count += short_prefill_sequence(p.cu_seqlens_host[n], p.cu_seqlens_host[n + 1], p.total_tokens, len);
  return count;
}

int choose_short_len(const PrefillParams& p) {
  const int len = prefill_short_reach(short_len_default(p));
  if (len <= 0 || !prefill_short_supported(p)) return 0;
  if (p.cu_seqlens_host != nullptr) return count_short(p, len) > 0 ? len : 0;
  return p.total_tokens <= int64_t(p.num_seqs) * len ? len : 0;
}

void prefill_with_vtile(const PrefillParams& p_in, cudaStream_t stream, int vtile, int stages, int head_split,
                        int short_len, int aux) {
  if (p_in.num_seqs <= 0) return;
  PrefillParams p = p_in;
  // Short sequences run on the recurrent kernels (the chunked kernels skip them); with a host copy of
  // cu_seqlens showing only short sequences, nothing else runs. Every check comes before any launch.
  if (stages == kStagesAll) {
    if (short_len < 0) short_len = choose_short_len(p);
    if (short_len > 0 && !prefill_short_supported(p)) short_len = 0;
    // The short path stores no checkpoint: it takes only sequences shorter than the interval.
    if (p.checkpoint_interval > 0 && p.checkpoints.data != nullptr && p.checkpoint_indices != nullptr)
      short_len = std::min(short_len, p.checkpoint_interval - 1);
  } else {
    short_len = 0;  // timing of the chunked kernels alone
  }
  if (short_len > 0 && p.cu_seqlens_host != nullptr && count_short(p, short_len) == p.num_seqs)
    return prefill_short(p, short_len, reinterpret_cast<Stream>(stream));

  const int K = p.heads.head_dim_k;
  if (K != 64 && K != 128 && K != 256)
    throw Error(ErrorCode::kInvalidArgument,
                "q: head dim K=" + std::to_string(K) + " is not supported (expected 64, 128 or 256)");
  Plan plan;
  plan.num_sms = device_sms();
  plan.scale = p.heads.scale > 0.0f ? p.heads.scale : 1.0f / std::sqrt(float(K));
  plan.qkv_vec = vec_ok(p.q) && vec_ok(p.k) && vec_ok(p.v);
  plan.fp16_operands = p.q.dtype != DType::kBFloat16;
  const int64_t oes = dtype_size(p.o.dtype);
  plan.o_pair = aligned(p.o.data, size_t(2 * oes)) && p.o.token_stride % 2 == 0 && p.o.head_stride % 2 == 0;
  // Without checkpoint indices no checkpoint is stored: interval 0 tells the kernel so.
  if (p.checkpoint_indices == nullptr || p.checkpoints.data == nullptr) p.checkpoint_interval = 0;
  // Pairs (k, k+1) of a K-last state are adjacent; every offset the kernels form is even when the
  // slot stride is (heads and value rows are K elements apart, K even).
  const bool klast = p.state.layout == StateLayout::kKLast;
  plan.state_pairs = klast && aligned(p.state.data, 2 * dtype_size(p.state.dtype)) && p.state.slot_stride % 2 == 0;
  plan.checkpoint_pairs = klast && p.checkpoints.data != nullptr &&
                          aligned(p.checkpoints.data, 2 * dtype_size(p.checkpoints.dtype)) &&
                          p.checkpoints.slot_stride % 2 == 0;

  vtile = plan_state_pass(p, plan, plan.num_sms, vtile, head_split, aux);
  const size_t need = workspace_bytes(p);
  void* ws = nullptr;
  if (need > 0) {
    if (p.workspace != nullptr) {
      if (p.workspace_bytes < need)
        throw Error(ErrorCode::kInvalidArgument, "workspace: expected at least " + std::to_string(need) +
                                                     " bytes (prefill_workspace_bytes), got " +
                                                     std::to_string(p.workspace_bytes));
      ws = p.workspace;
    } else if (plan.aux_prep != kAuxAll) {  // without the chunk prep none is used (a caller's is still checked)
      ws = owned_workspace(need, stream);
    }
  }
  carve_workspace(p, ws, plan);
  plan.short_len = short_len;
  if (is_head_tile(vtile) && !head_split_supported(p.heads.head_dim_v, plan.head_split))
    throw Error(ErrorCode::kInvalidArgument, "prefill: head split " + std::to_string(plan.head_split) +
                                                 " is not supported for V=" + std::to_string(p.heads.head_dim_v));
  if (!vtile_supported(K, vtile) || vtile > p.heads.head_dim_v || (is_head_tile(vtile) && !head_pass_ok(p)))
    throw Error(ErrorCode::kInvalidArgument, "prefill: value tile " + std::to_string(vtile) +
                                                 " is not supported for K=" + std::to_string(K) +
                                                 ", V=" + std::to_string(p.heads.head_dim_v));
  if (short_len > 0) prefill_short(p, short_len, reinterpret_cast<Stream>(stream));
  if (K == 64) launch<64>(p, plan, vtile, stream, stages);
  if (K == 128) launch<128>(p, plan, vtile, stream, stages);
  if (K == 256) launch<256>(p, plan, vtile, stream, stages);
}

}  // namespace chunked_prefill

// The head pass's conditions (16-bit q/k/v/o of one dtype in 16-byte aligned rows, K <= 128), K = V, 16-byte
// aligned state slots, and a grid of N rows.
bool prefill_short_supported(const PrefillParams& p) {
  const int K = p.heads.head_dim_k;
  const int64_t slot_bytes = p.state.slot_stride * dtype_size(p.state.dtype);
  return chunked_prefill::head_pass_ok(p) && K == p.heads.head_dim_v && (K == 64 || K == 128) &&
         chunked_prefill::aligned(p.state.data, 16) && slot_bytes % 16 == 0 && p.num_seqs > 0 &&
         p.num_seqs <= 65535 && p.heads.num_v_heads > 0;
}

void prefill(const PrefillParams& p, Stream stream) {
  chunked_prefill::prefill_with_vtile(p, reinterpret_cast<cudaStream_t>(stream), 0);
}

size_t prefill_workspace_bytes(const PrefillParams& p) { return chunked_prefill::workspace_bytes(p); }

}  // namespace gdnkit::cuda
