// CUDA decode, verify and commit: the host checks the kernels need beyond validate(), the one dispatch from
// run-time types (layout, state dtype, input dtype, head dims) to the launcher's instantiations (launcher.cuh,
// which picks the kernel through heuristics.h), and the commit-from-cache copy kernel. Nothing here
// synchronizes or allocates: graph-capturable.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/backend.h"
#include "cuda/host/check.h"
#include "cuda/arch/dtype.cuh"
#include "cuda/arch/fp8.cuh"
#include "cuda/recurrent/fp8_decode.cuh"
#include "cuda/recurrent/row.cuh"

namespace gdnkit::cuda {
namespace {

using recurrent::RecurrentParams;
using recurrent::RecurrentOp;

[[noreturn]] void invalid(const std::string& msg) { throw Error(ErrorCode::kInvalidArgument, msg); }

// The kernels move states in 16-byte vectors: every slot (and cache step) must start 16-byte aligned.
void check_aligned(const char* name, const void* data, int64_t slot_stride, DType dtype) {
  const int64_t bytes = slot_stride * dtype_size(dtype);
  const auto addr = reinterpret_cast<uintptr_t>(data);
  if (addr % 16 != 0 || bytes % 16 != 0)
    invalid(std::string(name) + ": the CUDA backend needs 16-byte aligned slots (data address % 16 = " +
            std::to_string(addr % 16) + ", slot_stride " + std::to_string(slot_stride) + " elements = " +
            std::to_string(bytes) + " bytes)");
}

void check_recurrent(const char* op, const CommitParams& p) {
  check_aligned("state", p.state.data, p.state.slot_stride, p.state.dtype);
  if (p.intermediate.data != nullptr) {
    check_aligned("intermediate", p.intermediate.data, p.intermediate.slot_stride, p.intermediate.dtype);
    if (p.intermediate.dtype != DType::kFloat32 && p.intermediate.dtype != DType::kBFloat16 &&
        p.intermediate.dtype != DType::kFloat16 && p.intermediate.dtype != DType::kFloat8E4M3)
      invalid(std::string("intermediate: expected dtype float32, bfloat16, float16 or float8_e4m3, got ") +
              dtype_name(p.intermediate.dtype));
  }
  if (p.parent != nullptr && p.num_draft_tokens > 64)
    throw Error(ErrorCode::kNotImplemented, std::string("cuda ") + op +
                                                ": tree drafts (parent) support T <= 64, got T=" +
                                                std::to_string(p.num_draft_tokens));
}

// The kernel of one op and layout behind the one dispatch. Prefill's short sequences are built for
// 16-bit inputs and K = V <= 128 only (prefill_short_supported keeps other calls away).
template <StateLayout L, RecurrentOp kOp>
struct OpLauncher {
  template <class TState, class TInput, int K, int V>
  static void launch(const RecurrentParams& p, bool write_state, Stream stream) {
    if constexpr (kOp != RecurrentOp::kPrefill || (!std::is_same_v<TInput, float> && K <= 128))
      recurrent::launch_recurrent_op<L, TState, TInput, K, V, kOp>(p, write_state, stream);
    else
      throw Error(ErrorCode::kNotImplemented, "cuda prefill: the short-sequence path is not built for this call");
  }
};

template <class Kernel, class TState, class TInput>
void by_dims(const RecurrentParams& p, bool write_state, Stream stream) {
  const int K = p.heads.head_dim_k, V = p.heads.head_dim_v;
  if (K == 64 && V == 64) return Kernel::template launch<TState, TInput, 64, 64>(p, write_state, stream);
  if (K == 128 && V == 128) return Kernel::template launch<TState, TInput, 128, 128>(p, write_state, stream);
  if (K == 256 && V == 256) return Kernel::template launch<TState, TInput, 256, 256>(p, write_state, stream);
  throw Error(ErrorCode::kNotImplemented, "cuda: head dims K=" + std::to_string(K) + ", V=" + std::to_string(V) +
                                              " are not built (built: K = V in {64, 128, 256})");
}

template <class Kernel, class TState>
void by_input(const RecurrentParams& p, bool write_state, Stream stream) {
  switch (p.k.dtype) {  // q, k, v, o share it (validated)
    case DType::kFloat32: return by_dims<Kernel, TState, float>(p, write_state, stream);
    case DType::kBFloat16: return by_dims<Kernel, TState, __nv_bfloat16>(p, write_state, stream);
    case DType::kFloat16: return by_dims<Kernel, TState, __half>(p, write_state, stream);
    default: invalid(std::string("k: expected dtype float32, bfloat16 or float16, got ") + dtype_name(p.k.dtype));
  }
}

template <class Kernel, bool kFp8Built>
void by_state(const RecurrentParams& p, bool write_state, Stream stream) {
  switch (p.state.dtype) {
    case DType::kFloat32: return by_input<Kernel, float>(p, write_state, stream);
    case DType::kBFloat16: return by_input<Kernel, __nv_bfloat16>(p, write_state, stream);
    case DType::kFloat16: return by_input<Kernel, __half>(p, write_state, stream);
    case DType::kFloat8E4M3:
      if constexpr (kFp8Built) return by_input<Kernel, uint8_t>(p, write_state, stream);
      throw Error(ErrorCode::kNotImplemented, "state: float8_e4m3 pools are not built for this op and layout");
    default:
      invalid(std::string("state: expected dtype float32, bfloat16, float16 or float8_e4m3, got ") +
              dtype_name(p.state.dtype));
  }
}

template <RecurrentOp kOp>
void by_layout(const RecurrentParams& p, bool write_state, Stream stream) {
  switch (p.state.layout) {
    case StateLayout::kKLast:  // float8_e4m3 pools: all but decode (launch_fp8_decode)
      return by_state<OpLauncher<StateLayout::kKLast, kOp>, kOp != RecurrentOp::kDecode>(p, write_state, stream);
    case StateLayout::kVLast:  // float8_e4m3 pools: all but decode too (launch_vlast_fp8_decode)
      return by_state<OpLauncher<StateLayout::kVLast, kOp>, kOp != RecurrentOp::kDecode>(p, write_state, stream);
    default: invalid("state: unknown layout " + std::to_string(int(p.state.layout)));
  }
}

// RecurrentParams::gva_group / gva_magic from the head counts (validated: H divides HV).
void set_gva(RecurrentParams& p) {
  const int64_t HV = p.heads.num_v_heads, H = p.heads.num_qk_heads;
  p.gva_group = H > 0 ? int32_t(HV / H) : 0;
  p.gva_magic = p.gva_group > 1 && HV < 65536 ? uint32_t(((int64_t(1) << 32) + p.gva_group - 1) / p.gva_group) : 0u;
}

template <RecurrentOp kOp>
void dispatch_recurrent(const char* op, RecurrentParams& p, bool write_state, Stream stream) {
  check_recurrent(op, p);
  set_gva(p);
  by_layout<kOp>(p, write_state, stream);
}

// ---- commit from the cache: pool[slot] = intermediate[islot, last kept token] -----------------
// One CTA per (sequence, value head) copies K*V elements, converting the cache dtype to the pool's.
constexpr int kCopyThreads = 256;
constexpr int kCopyRun = 8;  // elements per thread and iteration (16 B of bf16, 32 B of fp32)

template <class TC, class TState>
__global__ void __launch_bounds__(kCopyThreads) commit_cache_kernel(const CommitParams p) {
  const int b = blockIdx.x, hv = blockIdx.y, T = p.num_draft_tokens;
  const int64_t head_elems = int64_t(p.heads.head_dim_k) * p.heads.head_dim_v;
  const bool counter = hv == 0 && threadIdx.x == 0 && p.error_flag != nullptr;
  // The CPU reference's checks, in its order: a row that cannot be placed, a slot past the pool or
  // cache, a count past the row's tokens or a path entry out of range are skipped and counted.
  int len = T;
  if (p.cu_seqlens != nullptr) {
    const int64_t start = p.cu_seqlens[b], end = p.cu_seqlens[b + 1];
    len = int(end - start);
    if (end - start < 0 || end - start > T || start < 0 || end > int64_t(p.batch) * T) {
      if (counter) atomicAdd(p.error_flag, 1);
      return;
    }
  }
  const int slot = p.state_indices[b];
  if (slot < 0) return;  // padding row
  const int acc = p.accepted[b];
  const int32_t* path = p.accepted_path != nullptr ? p.accepted_path + int64_t(b) * T : nullptr;
  bool bad = slot >= p.state.num_slots || acc < 0 || acc > len;
  bad = bad || !recurrent::path_is_valid(p, b, T, len, acc);
  const int islot = p.intermediate_indices[b];
  bad = bad || islot >= p.intermediate.num_slots;
  const int step = bad || acc == 0 ? 0 : (path != nullptr ? path[acc - 1] : acc - 1);
  bad = bad || step >= p.intermediate.num_steps;
  if (bad) {
    if (counter) atomicAdd(p.error_flag, 1);
    return;
  }
  if (acc == 0 || islot < 0) return;  // nothing kept, or the row cached nothing: the pool state stays
  const TC* src = static_cast<const TC*>(p.intermediate.data) + int64_t(islot) * p.intermediate.slot_stride +
                  (int64_t(step) * p.heads.num_v_heads + hv) * head_elems;
  TState* dst = static_cast<TState*>(p.state.data) + int64_t(slot) * p.state.slot_stride + hv * head_elems;
  // float8_e4m3 caches and pools (uint8_t): each run of kCopyRun lies in one block of kFp8Block, whose
  // kFp8Block / kCopyRun runs are neighbouring lanes (the block's amax: shuffles among them).
  [[maybe_unused]] const uint8_t* scales = nullptr;
  [[maybe_unused]] uint8_t* dst_scales = nullptr;
  if constexpr (std::is_same_v<TC, uint8_t>)
    scales = p.intermediate.scales +
             ((int64_t(islot) * p.intermediate.num_steps + step) * p.heads.num_v_heads + hv) * (head_elems / kFp8Block);
  if constexpr (std::is_same_v<TState, uint8_t>)
    dst_scales = p.state.scales + (int64_t(slot) * p.heads.num_v_heads + hv) * (head_elems / kFp8Block);
  static_assert(kCopyThreads * kCopyRun % kFp8Block == 0 && kFp8Block % kCopyRun == 0, "whole blocks per pass");
  if constexpr (std::is_same_v<TC, uint8_t> && std::is_same_v<TState, uint8_t>) {
    // float8_e4m3 into float8_e4m3: bytes and scales as they are, the values requantizing gives (every block verify
    // stores comes from the quantizer), as the reference does. 16-byte pieces; the scales too where both are 16-byte
    // aligned (slots are, by check).
    for (int64_t i = int64_t(threadIdx.x) * 16; i < head_elems; i += kCopyThreads * 16)
      *reinterpret_cast<uint4*>(dst + i) = *reinterpret_cast<const uint4*>(src + i);
    const int64_t n = head_elems / kFp8Block;
    if (((reinterpret_cast<uintptr_t>(scales) | reinterpret_cast<uintptr_t>(dst_scales)) & 15u) == 0) {
      for (int64_t i = int64_t(threadIdx.x) * 16; i < n; i += kCopyThreads * 16)
        *reinterpret_cast<uint4*>(dst_scales + i) = *reinterpret_cast<const uint4*>(scales + i);
    } else {
      for (int64_t i = threadIdx.x; i < n; i += kCopyThreads) dst_scales[i] = scales[i];
    }
    return;
  }
#pragma unroll 4
  for (int64_t i = int64_t(threadIdx.x) * kCopyRun; i < head_elems; i += kCopyThreads * kCopyRun) {
    float x[kCopyRun];
    if constexpr (std::is_same_v<TC, uint8_t>) {
      const uint2 raw = *reinterpret_cast<const uint2*>(src + i);
      const float sc = e8m0_scale(scales[i / kFp8Block]);
      const uint32_t w[2] = {raw.x, raw.y};
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        const float2 f = e4m3x2_to_float2(w[h / 2] >> (16 * (h % 2)), sc);
        x[2 * h] = f.x, x[2 * h + 1] = f.y;
      }
    } else {
      load_vec<TC, kCopyRun>(src + i, x);
    }
    if constexpr (std::is_same_v<TState, uint8_t>) {  // head_elems is a multiple of the pass: whole warps here
      uint32_t m = 0;
#pragma unroll
      for (int j = 0; j < kCopyRun; ++j) m = max(m, abs_bits(x[j]));
#pragma unroll
      for (int off = 1; off < kFp8Block / kCopyRun; off <<= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, off));
      const Fp8Scale sc = e4m3_block_scale(m);
      *reinterpret_cast<uint2*>(dst + i) =
          make_uint2(e4m3x4(x[0], x[1], x[2], x[3], sc), e4m3x4(x[4], x[5], x[6], x[7], sc));
      if (i % kFp8Block == 0) dst_scales[i / kFp8Block] = uint8_t(sc.byte);
    } else {
      store_vec<TState, kCopyRun>(dst + i, x);
    }
  }
}

template <class TC>
void commit_cache_by_state(const CommitParams& p, Stream stream) {
  const dim3 grid(unsigned(p.batch), unsigned(p.heads.num_v_heads));
  switch (p.state.dtype) {
    case DType::kFloat32: commit_cache_kernel<TC, float><<<grid, kCopyThreads, 0, stream>>>(p); break;
    case DType::kBFloat16: commit_cache_kernel<TC, __nv_bfloat16><<<grid, kCopyThreads, 0, stream>>>(p); break;
    case DType::kFloat16: commit_cache_kernel<TC, __half><<<grid, kCopyThreads, 0, stream>>>(p); break;
    case DType::kFloat8E4M3: commit_cache_kernel<TC, uint8_t><<<grid, kCopyThreads, 0, stream>>>(p); break;
    default:
      invalid(std::string("state: expected dtype float32, bfloat16, float16 or float8_e4m3, got ") +
              dtype_name(p.state.dtype));
  }
  GDNKIT_CUDA_CHECK_LAUNCH();
}

void commit_from_cache(const CommitParams& p, Stream stream) {
  if (p.intermediate.data == nullptr || p.intermediate_indices == nullptr)
    invalid("intermediate: commit from the cache needs the intermediate buffer and intermediate_indices");
  check_aligned("state", p.state.data, p.state.slot_stride, p.state.dtype);
  check_aligned("intermediate", p.intermediate.data, p.intermediate.slot_stride, p.intermediate.dtype);
  if (p.state.dtype == DType::kFloat8E4M3 && int64_t(p.heads.head_dim_k) * p.heads.head_dim_v % (kCopyThreads * kCopyRun) != 0)
    throw Error(ErrorCode::kNotImplemented, "state: float8_e4m3 pools need K*V a multiple of " +
                                                std::to_string(kCopyThreads * kCopyRun) + " (whole copy passes), got K=" +
                                                std::to_string(p.heads.head_dim_k) + ", V=" +
                                                std::to_string(p.heads.head_dim_v));
  if (p.batch == 0 || p.heads.num_v_heads == 0) return;
  switch (p.intermediate.dtype) {
    case DType::kFloat32: return commit_cache_by_state<float>(p, stream);
    case DType::kBFloat16: return commit_cache_by_state<__nv_bfloat16>(p, stream);
    case DType::kFloat16: return commit_cache_by_state<__half>(p, stream);
    case DType::kFloat8E4M3: return commit_cache_by_state<uint8_t>(p, stream);
    default:
      invalid(std::string("intermediate: expected dtype float32, bfloat16, float16 or float8_e4m3, got ") +
              dtype_name(p.intermediate.dtype));
  }
}

}  // namespace

void prefill_short(const PrefillParams& p, int max_len, Stream stream) {
  RecurrentParams r;
  r.heads = p.heads;
  r.batch = p.num_seqs;
  r.q = p.q, r.k = p.k, r.v = p.v, r.o = p.o;
  r.gating = p.gating;
  r.state = p.state;
  r.state_indices = p.initial_indices;
  r.error_flag = p.error_flag;
  r.num_draft_tokens = max_len;
  r.update_state = true;
  r.final_indices = p.final_indices;
  r.seq_cu = p.cu_seqlens;
  r.seq_cu64 = p.cu_seqlens_dtype == DType::kInt64;
  r.total_tokens = p.total_tokens;
  if (p.checkpoint_interval > 0 && p.checkpoints.data != nullptr && p.checkpoint_indices != nullptr) {
    r.checkpoint_indices = p.checkpoint_indices;
    r.checkpoint_slots = p.checkpoints.num_slots;
  }
  set_gva(r);
  by_layout<RecurrentOp::kPrefill>(r, true, stream);
}

void decode(const DecodeParams& p, Stream stream) {
  // Decode is a chain of one token per sequence (token b of the batch), state updated in place.
  RecurrentParams r;
  static_cast<DecodeParams&>(r) = p;
  r.num_draft_tokens = 1;
  if (p.state.dtype == DType::kFloat8E4M3) {  // V-last: K in {64, 128}, V in {128, 256} (api/dispatch.cpp)
    check_aligned("state", p.state.data, p.state.slot_stride, p.state.dtype);
    set_gva(r);
    if (p.state.layout == StateLayout::kVLast) return recurrent::launch_vlast_fp8_decode(r, stream);
    return recurrent::launch_fp8_decode(r, stream);
  }
  dispatch_recurrent<RecurrentOp::kDecode>("decode", r, true, stream);
}

void verify(const VerifyParams& p, Stream stream) {
  RecurrentParams r;
  static_cast<VerifyParams&>(r) = p;
  dispatch_recurrent<RecurrentOp::kVerify>("verify", r, p.update_state && p.parent == nullptr, stream);
}

void commit(const CommitParams& p, Stream stream) {
  switch (p.source) {
    case CommitSource::kCache: return commit_from_cache(p, stream);
    case CommitSource::kRecompute: {
      RecurrentParams r;
      static_cast<CommitParams&>(r) = p;
      r.intermediate.data = nullptr;  // recompute stores only the final state
      return dispatch_recurrent<RecurrentOp::kRecompute>("commit", r, true, stream);
    }
    default: invalid("commit: unknown source " + std::to_string(int(p.source)));
  }
}

}  // namespace gdnkit::cuda
