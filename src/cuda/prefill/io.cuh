// Device loads/stores of the prefill kernels: token rows converted to the tensor-core operand
// type Op (bf16 or fp16) with their sums of squares (for the q/k L2 norm), gate scalars, outputs and states.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "cuda/arch/dtype.cuh"
#include "cuda/prefill/short_sequence.h"
#include "cuda/prefill/mma.cuh"
#include "cuda/prefill/plan.h"
#include "gdnkit/params.h"

namespace gdnkit::cuda::chunked_prefill {

__device__ __forceinline__ int64_t load_cu(const PrefillParams& p, int64_t i) {
  return p.cu_seqlens_dtype == DType::kInt64 ? static_cast<const int64_t*>(p.cu_seqlens)[i]
                                             : int64_t(static_cast<const int32_t*>(p.cu_seqlens)[i]);
}

// 8 contiguous elements at base[i..i+7] as 8 Op values (raw when the input dtype is Op, else
// rounded from fp32). vec: 16-byte loads are aligned (checked on the host from the pointer and strides).
template <class Op>
__device__ __forceinline__ uint4 load8(const void* base, DType dt, int64_t i, bool vec) {
  constexpr DType kOpType = std::is_same_v<Op, __half> ? DType::kFloat16 : DType::kBFloat16;
  uint4 out;
  uint32_t* o = reinterpret_cast<uint32_t*>(&out);
  if (dt == kOpType) {
    const uint16_t* u = static_cast<const uint16_t*>(base) + i;
    if (vec) return __ldg(reinterpret_cast<const uint4*>(u));
#pragma unroll
    for (int j = 0; j < 4; ++j) o[j] = uint32_t(u[2 * j]) | (uint32_t(u[2 * j + 1]) << 16);
    return out;
  }
  float f[8];
  if (dt == DType::kFloat16 || dt == DType::kBFloat16) {
    const uint16_t* u = static_cast<const uint16_t*>(base) + i;
    uint4 r;
    if (vec) {
      r = __ldg(reinterpret_cast<const uint4*>(u));
    } else {
      uint32_t* rr = reinterpret_cast<uint32_t*>(&r);
#pragma unroll
      for (int j = 0; j < 4; ++j) rr[j] = uint32_t(u[2 * j]) | (uint32_t(u[2 * j + 1]) << 16);
    }
    const uint32_t* rr = reinterpret_cast<const uint32_t*>(&r);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 t = dt == DType::kFloat16 ? unpack2<__half>(rr[j]) : unpack2<__nv_bfloat16>(rr[j]);
      f[2 * j] = t.x;
      f[2 * j + 1] = t.y;
    }
  } else {
    const float* p = static_cast<const float*>(base) + i;
    if (vec) {
      const float4 a = __ldg(reinterpret_cast<const float4*>(p));
      const float4 b = __ldg(reinterpret_cast<const float4*>(p + 4));
      f[0] = a.x;
      f[1] = a.y;
      f[2] = a.z;
      f[3] = a.w;
      f[4] = b.x;
      f[5] = b.y;
      f[6] = b.z;
      f[7] = b.w;
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) f[j] = p[j];
    }
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) o[j] = pack2<Op>(f[2 * j], f[2 * j + 1]);
  return out;
}

template <class Op>
__device__ __forceinline__ float sumsq8(const uint4& x) {
  const uint32_t* u = reinterpret_cast<const uint32_t*>(&x);
  float s = 0.0f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 t = unpack2<Op>(u[j]);
    s = fmaf(t.x, t.x, fmaf(t.y, t.y, s));
  }
  return s;
}

// Loads the 64 rows [t0, t0+L) of one q/k head into dst (Op; 1024-byte aligned, 128B-swizzled as wgmma's K-major
// operand, sw128_offset<kChunk>; rows >= L are zero) and
// writes mult / ||row|| (use_l2norm; eps 1e-6 inside the root, as docs/semantics.md) or mult per row
// (kNorm; else rnorm is not touched).
// Rows stay un-normalized in shared memory: the norm is a per-token factor applied to the mma
// results, so the operand is the input exactly (16-bit inputs) and the L2 norm costs no extra pass.
template <int K, class Op, bool kNorm = true>
__device__ __forceinline__ void load_rows_with_norm(Op* dst, float* rnorm, const InView& view, int head, int64_t t0,
                                                    int L, bool use_l2norm, float mult, bool vec) {
  constexpr int kVecPerRow = K / 8;  // 8, 16 or 32 lanes per row: a shuffle reduction stays in a warp
  constexpr int kIters = kChunk * kVecPerRow / kThreads;
  constexpr int kBatch = kIters < 8 ? kIters : 8;  // loads in flight per thread before the first use
  constexpr int kRowStep = kThreads / kVecPerRow;  // rows between a thread's pieces
  constexpr DType kOpType = std::is_same_v<Op, __half> ? DType::kFloat16 : DType::kBFloat16;
  const int tid = threadIdx.x, row0 = tid / kVecPerRow, cv = tid % kVecPerRow;
  // Rows in the operand dtype with 16-byte aligned pieces (the common case): one vector load per piece
  // from a pointer stepped by rows; anything else goes through load8's conversions.
  const bool raw = vec && view.dtype == kOpType;
  const int64_t first = (t0 + row0) * view.token_stride + head * view.head_stride + cv * 8;
  const uint4* src = reinterpret_cast<const uint4*>(static_cast<const Op*>(view.data) + first);
  const int64_t step = kRowStep * view.token_stride / 8;  // in 16-byte pieces (vec: token_stride % 8 == 0)
#pragma unroll
  for (int u0 = 0; u0 < kIters; u0 += kBatch) {
    uint4 x[kBatch];
    if (raw) {
#pragma unroll
      for (int u = 0; u < kBatch; ++u)
        x[u] = row0 + (u0 + u) * kRowStep < L ? __ldg(src + (u0 + u) * step) : make_uint4(0, 0, 0, 0);
    } else {
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int row = row0 + (u0 + u) * kRowStep;
        x[u] = row < L ? load8<Op>(view.data, view.dtype, first + int64_t((u0 + u) * kRowStep) * view.token_stride, vec)
                       : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u)
      *reinterpret_cast<uint4*>(dst + sw128_offset<kChunk>(row0 + (u0 + u) * kRowStep, cv * 8)) = x[u];
    if constexpr (kNorm) {
      // The batch's sums of squares reduced together over each row's kVecPerRow lanes (kBatch - 1 +
      // log2(kVecPerRow / kBatch) shuffles instead of kBatch log2(kVecPerRow)); lane cv ends with the sum
      // of row u = cv / (kVecPerRow / kBatch) of the batch.
      float ss[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) ss[u] = sumsq8<Op>(x[u]);
      const int u = transpose_group_sum<kBatch, kVecPerRow>(ss, tid % 32);
      if (cv % (kVecPerRow / kBatch) == 0)
        rnorm[row0 + (u0 + u) * kRowStep] = (use_l2norm ? rsqrtf(ss[0] + 1e-6f) : 1.0f) * mult;
    }
  }
}

// Two adjacent output elements o[i], o[i+1] in o's dtype.
__device__ __forceinline__ void store_pair(void* base, DType dt, int64_t i, float x, float y, bool pair_ok) {
  if (dt == DType::kBFloat16) {
    __nv_bfloat16* p = static_cast<__nv_bfloat16*>(base) + i;
    if (pair_ok) {
      *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x, y);
    } else {
      p[0] = __float2bfloat16_rn(x);
      p[1] = __float2bfloat16_rn(y);
    }
  } else if (dt == DType::kFloat16) {
    __half* p = static_cast<__half*>(base) + i;
    if (pair_ok) {
      *reinterpret_cast<__half2*>(p) = __floats2half2_rn(x, y);
    } else {
      p[0] = __float2half_rn(x);
      p[1] = __float2half_rn(y);
    }
  } else {
    float* p = static_cast<float*>(base) + i;
    if (pair_ok) {
      *reinterpret_cast<float2*>(p) = make_float2(x, y);
    } else {
      p[0] = x;
      p[1] = y;
    }
  }
}

// One sequence of the batch as the state passes see it: its tokens and its pool / checkpoint slots.
struct SeqSlots {
  int64_t start = 0, len = 0;
  int islot = -1, fslot = -1, cslot = -1;
};

// Reads sequence n's bounds and slots. A sequence of the short-sequence path (plan.short_len) is left
// alone. A bad sequence (cu_seqlens out of order or past total_tokens),
// or one with an initial, final or checkpoint slot past its buffer, is skipped as the CPU reference
// does: counted once in error_flag (by the CTA with `counter`), and for a bad slot its o columns
// [v0, v0 + vt) of head h are zeroed by threads tid, tid + threads, ... Returns false when skipped.
__device__ __forceinline__ bool begin_sequence_by(const PrefillParams& p, const Plan& plan, int n, int h, int v0,
                                                  int vt, bool counter, SeqSlots& s, int tid, int threads) {
  counter = counter && tid == 0 && p.error_flag != nullptr;
  const int64_t start = load_cu(p, n), end = load_cu(p, n + 1);
  if (start < 0 || end < start || end > p.total_tokens) {
    if (counter) atomicAdd(p.error_flag, 1);
    return false;
  }
  if (short_prefill_sequence(start, end, p.total_tokens, plan.short_len)) return false;  // the short path's
  s.start = start;
  s.len = end - start;
  s.islot = p.initial_indices ? p.initial_indices[n] : -1;
  s.fslot = p.final_indices ? p.final_indices[n] : -1;
  s.cslot = (p.checkpoint_interval > 0 && p.checkpoint_indices) ? p.checkpoint_indices[n] : -1;
  const int64_t P = p.state.num_slots;
  if (s.islot >= P || s.fslot >= P || s.cslot >= p.checkpoints.num_slots) {
    if (counter) atomicAdd(p.error_flag, 1);
    for (int64_t it = tid; it < s.len * (vt / 2); it += threads) {
      const int64_t t = start + it / (vt / 2);
      const int col = v0 + int(it % (vt / 2)) * 2;
      store_pair(p.o.data, p.o.dtype, t * p.o.token_stride + h * p.o.head_stride + col, 0.0f, 0.0f, plan.o_pair);
    }
    return false;
  }
  return true;
}
// ... by the CTA's kThreadsPerCta threads
template <int kThreadsPerCta>
__device__ __forceinline__ bool begin_sequence(const PrefillParams& p, const Plan& plan, int n, int h, int v0, int vt,
                                               bool counter, SeqSlots& s) {
  return begin_sequence_by(p, plan, n, h, v0, vt, counter, s, int(threadIdx.x), kThreadsPerCta);
}

// Element offset of S[k][v] of head h inside a state slot (pool or checkpoint entry).
__device__ __forceinline__ int64_t state_offset(StateLayout layout, int h, int k, int v, int K, int V) {
  return int64_t(h) * K * V + (layout == StateLayout::kVLast ? int64_t(k) * V + v : int64_t(v) * K + k);
}

// Bytes of one element of a state buffer of dtype dt.
__device__ __forceinline__ int64_t dtype_bytes(DType dt) {
  return dt == DType::kFloat32 ? 4 : dt == DType::kFloat8E4M3 ? 1 : 2;
}

// Elements i, i+1 in one access (i even, the buffer aligned to two elements).
__device__ __forceinline__ float2 load_state_pair(const void* base, DType dt, int64_t i) {
  if (dt == DType::kBFloat16)
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(static_cast<const __nv_bfloat16*>(base) + i));
  if (dt == DType::kFloat16)
    return __half22float2(*reinterpret_cast<const __half2*>(static_cast<const __half*>(base) + i));
  return *reinterpret_cast<const float2*>(static_cast<const float*>(base) + i);
}
__device__ __forceinline__ void store_state_pair(void* base, DType dt, int64_t i, float x, float y) {
  if (dt == DType::kBFloat16)
    *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(base) + i) = __floats2bfloat162_rn(x, y);
  else if (dt == DType::kFloat16)
    *reinterpret_cast<__half2*>(static_cast<__half*>(base) + i) = __floats2half2_rn(x, y);
  else
    *reinterpret_cast<float2*>(static_cast<float*>(base) + i) = make_float2(x, y);
}
__device__ __forceinline__ float load_state_elem(const void* base, DType dt, int64_t i) {
  if (dt == DType::kBFloat16) return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
  if (dt == DType::kFloat16) return __half2float(static_cast<const __half*>(base)[i]);
  return static_cast<const float*>(base)[i];
}
__device__ __forceinline__ void store_state_elem(void* base, DType dt, int64_t i, float x) {
  if (dt == DType::kBFloat16)
    static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(x);
  else if (dt == DType::kFloat16)
    static_cast<__half*>(base)[i] = __float2half_rn(x);
  else
    static_cast<float*>(base)[i] = x;
}

}  // namespace gdnkit::cuda::chunked_prefill
