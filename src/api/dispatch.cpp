// Public entries: validate, then hand the params to the chosen backend.
#include <algorithm>
#include <string>

#include "cpu/backend.h"
#include "cuda/backend.h"
#include "cuda/host/overrides.h"
#include "cuda/prefill/heuristics.h"
#include "gdnkit/gdnkit.h"

namespace gdnkit {
namespace {

void require_cuda() {
#ifdef GDNKIT_WITH_CUDA
  if (!cuda::device_usable())
    throw Error(ErrorCode::kNoDevice, "backend cuda: no usable sm_90 CUDA device (use Backend::kCPU)");
#else
  throw Error(ErrorCode::kNoDevice, "backend cuda: gdnkit was built without CUDA (use Backend::kCPU)");
#endif
}

// The CUDA kernels take float32, bfloat16 and float16 states everywhere; float8_e4m3 pools, intermediate caches and
// checkpoints in decode (V-last pools: K in {64, 128}, V in {128, 256}: vlast_decode.cuh), verify, commit, prefill
// (in place where the passes take them, else on K-last fp32 copies: prefill/staged_states.h) and layout conversion,
// and in a split prefill the pools and checkpoints prefill takes in place (the head state pass with bf16 or fp16
// inputs, K <= 128, V in {64, 128}, or K-last the tiled pass at K >= 128); the CPU backend runs every op on them.
constexpr const char* kFp8Cuda =
    ": the CUDA backend takes float8_e4m3 pools, intermediate caches and checkpoints in decode (V-last pools with K in "
    "{64, 128} and V in {128, 256}), verify, commit and prefill, and in split prefill those prefill takes in place";
// Refuses a float8_e4m3 buffer where no CUDA kernel takes it; got() (what the call has) is formed only then, so that
// the calls that pass build no message.
template <class Got>
void refuse_cuda_fp8(const char* name, const void* data, DType dtype, const Got& got) {
  if (data != nullptr && dtype == DType::kFloat8E4M3)
    throw Error(ErrorCode::kNotImplemented,
                std::string(name) + kFp8Cuda + got() + " (the CPU backend runs every op)");
}
void require_cuda_states(const DecodeParams& p) {
  const int K = p.heads.head_dim_k, V = p.heads.head_dim_v;
  if (p.state.layout != StateLayout::kKLast && !((K == 64 || K == 128) && (V == 128 || V == 256)))
    refuse_cuda_fp8("state", p.state.data, p.state.dtype,
                    [&] { return ", got V-last with K = " + std::to_string(K) + ", V = " + std::to_string(V); });
}
void require_cuda_states(const VerifyParams&) {}  // and CommitParams: every dtype, both layouts
void require_cuda_states(const PrefillParams&) {}  // every dtype, both layouts
void require_cuda_states(const LayoutParams&) {}  // every dtype, float8_e4m3 both ways
void require_cuda_states(const SplitPrefillParams& sp) {
  const PrefillParams& p = sp.local;
  // the ranks run the context-parallel passes on the call's own buffers: no staged copies
  if (!cuda::chunked_prefill::states_staged(p)) return;
  const auto got = [&] {
    const bool klast = cuda::chunked_prefill::states_layout(p) == StateLayout::kKLast;
    return std::string(klast ? ", got K-last" : ", got V-last") + " with " + dtype_name(p.q.dtype) + " inputs, K = " +
           std::to_string(p.heads.head_dim_k) + ", V = " + std::to_string(p.heads.head_dim_v) +
           " (the head state pass takes bf16 or fp16 inputs in 16-byte aligned rows, K <= 128, V in {64, 128}" +
           (klast ? "; the tiled pass K >= 128)" : ")");
  };
  refuse_cuda_fp8("state", p.state.data, p.state.dtype, got);
  if (p.checkpoint_interval > 0) refuse_cuda_fp8("checkpoints", p.checkpoints.data, p.checkpoints.dtype, got);
}

template <class Params, class CpuFn, class CudaFn>
void run(const Params& p, const Context& ctx, CpuFn cpu_fn, CudaFn cuda_fn) {
  validate(p, ctx.backend);
  if (ctx.backend == Backend::kCPU) {
    cpu_fn(p);
    return;
  }
  require_cuda_states(p);
  require_cuda();
  cuda_fn(p, ctx.stream);
}

}  // namespace

#ifdef GDNKIT_WITH_CUDA
#define GDNKIT_CUDA_FN(name) [](const auto& p, Stream s) { cuda::name(p, s); }
#else
#define GDNKIT_CUDA_FN(name) [](const auto&, Stream) {}
#endif

void decode(const DecodeParams& p, const Context& ctx) {
  run(p, ctx, [](const auto& q) { cpu::decode(q); }, GDNKIT_CUDA_FN(decode));
}
void verify(const VerifyParams& p, const Context& ctx) {
  run(p, ctx, [](const auto& q) { cpu::verify(q); }, GDNKIT_CUDA_FN(verify));
}
void commit(const CommitParams& p, const Context& ctx) {
  run(p, ctx, [](const auto& q) { cpu::commit(q); }, GDNKIT_CUDA_FN(commit));
}
void prefill(const PrefillParams& p, const Context& ctx) {
  run(p, ctx, [](const auto& q) { cpu::prefill(q); }, GDNKIT_CUDA_FN(prefill));
}
void convert_layout(const LayoutParams& p, const Context& ctx) {
  run(p, ctx, [](const auto& q) { cpu::convert_layout(q); }, GDNKIT_CUDA_FN(convert_layout));
}

size_t prefill_workspace_bytes(const PrefillParams& p) {
  require_cuda_states(p);
#ifdef GDNKIT_WITH_CUDA
  return cuda::prefill_workspace_bytes(p);
#else
  (void)p;
  return 0;
#endif
}

int64_t split_prefill_exchange_elems(const PrefillParams& p) {
  return int64_t(std::max(p.num_seqs, 0)) * std::max(p.heads.num_v_heads, 0) * int64_t(p.heads.head_dim_k) *
         (int64_t(p.heads.head_dim_k) + p.heads.head_dim_v);
}

size_t split_prefill_workspace_bytes(const SplitPrefillParams& p) {
  require_cuda_states(p);
#ifdef GDNKIT_WITH_CUDA
  return cuda::split_prefill_workspace_bytes(p);
#else
  (void)p;
  return 0;
#endif
}

void split_prefill_begin(const SplitPrefillParams& p, const Context& ctx) {
  run(p, ctx, [](const auto& q) { cpu::split_prefill_begin(q); }, GDNKIT_CUDA_FN(split_prefill_begin));
}
void split_prefill_end(const SplitPrefillParams& p, const Context& ctx) {
  run(p, ctx, [](const auto& q) { cpu::split_prefill_end(q); }, GDNKIT_CUDA_FN(split_prefill_end));
}

PrefillPath prefill_path(const PrefillParams& p) {
  PrefillPath path;
  validate(p, Backend::kCUDA);
  require_cuda_states(p);
  if (p.num_seqs > 0) {
#ifdef GDNKIT_WITH_CUDA
    const int sms = cuda::device_sms();
#else
    const int sms = 1;
#endif
    // a call on staged states runs the passes on its K-last fp32 copies
    const auto choice =
        cuda::chunked_prefill::choose_prefill(cuda::chunked_prefill::pass_params(p), sms, cuda::overrides());
    path.short_max_len = choice.short_len;
    path.context_parallel_segment = choice.cp_segment_len;
  }
  return path;
}

bool cuda_compiled() {
#ifdef GDNKIT_WITH_CUDA
  return true;
#else
  return false;
#endif
}

bool cuda_available() {
#ifdef GDNKIT_WITH_CUDA
  return cuda::device_usable();
#else
  return false;
#endif
}

std::string build_info() {
  std::string s = "gdnkit " GDNKIT_VERSION_STRING "\n";  // gdnkit/version.h
#ifdef __VERSION__
  s += "compiler: " __VERSION__ "\n";
#endif
#ifdef GDNKIT_WITH_CUDA
  s += "backends: cpu, cuda (sm_90a)\n";
  s += cuda::device_info();
#else
  s += "backends: cpu (built without CUDA)\n";
#endif
  return s;
}

}  // namespace gdnkit
