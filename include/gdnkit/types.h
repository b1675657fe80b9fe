// gdnkit public types: dtypes, layouts, tensor views, errors.
// Framework-free: no CUDA, PyTorch or STL-container types cross this boundary.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

struct CUstream_st;  // the same type cudaStream_t points to; no CUDA header needed here

namespace gdnkit {

using Stream = CUstream_st*;  // == cudaStream_t; nullptr is the legacy default stream

enum class DType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kInt32 = 3, kInt64 = 4, kFloat8E4M3 = 5 };

// float8_e4m3 states (OCP FP8 E4M3, "fn": max 448, no infinities) carry one power-of-two scale per block of
// kFp8Block consecutive elements of a head's state in its layout (k-runs in K-last, v-runs in V-last): a byte e
// (E8M0, 2^(e - 127); 255 is NaN), element = e4m3 value x 2^(e - 127). The OCP MX format's blocks and scales.
inline constexpr int kFp8Block = 32;

// Per-head state layout inside a pool slot.
//   kKLast: [V, K] per head, k contiguous; stores S^T   (FLA / SGLang / vLLM default)
//   kVLast: [K, V] per head, v contiguous; stores S
enum class StateLayout : int32_t { kKLast = 0, kVLast = 1 };

enum class Backend : int32_t { kCPU = 0, kCUDA = 1 };

// kGiven: g (log-space decay, fp32) and beta are inputs.
// kFused: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), computed in the kernel.
enum class GateMode : int32_t { kGiven = 0, kFused = 1 };

// Where commit takes the new pool state from.
enum class CommitSource : int32_t { kCache = 0, kRecompute = 1 };

// CPU backend only: which prefill implementation runs (the CUDA backend is always chunked).
enum class PrefillAlgorithm : int32_t { kAuto = 0, kRecurrent = 1, kChunked = 2 };

const char* dtype_name(DType dtype);
int dtype_size(DType dtype);  // bytes per element
const char* layout_name(StateLayout layout);
const char* backend_name(Backend backend);

enum class ErrorCode : int32_t {
  kInvalidArgument = 1,  // a tensor or option is wrong; message names it, what was expected and got
  kNotImplemented = 2,   // valid request the chosen backend does not implement (yet)
  kNoDevice = 3,         // CUDA backend asked for, but no usable GPU / not built with CUDA
  kCudaError = 4,        // a CUDA runtime call failed
};

// Every failure in the library is reported by throwing gdnkit::Error; the library never exits.
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

// A strided view of per-token data: [T_total, heads, dim] (dim contiguous) for q/k/v/o,
// or [T_total, heads] for per-head scalars (g, beta, a, b). Strides are in elements.
template <class Ptr>
struct StridedView {
  Ptr data = nullptr;
  DType dtype = DType::kBFloat16;
  int64_t token_stride = 0;  // elements between consecutive tokens
  int64_t head_stride = 0;   // elements between consecutive heads
};
using InView = StridedView<const void*>;
using OutView = StridedView<void*>;

// Pool of recurrent states: [P, HV, K, V] (V-last) or [P, HV, V, K] (K-last).
// Heads of one slot are packed (head stride K*V); slots are slot_stride elements apart.
struct StatePool {
  void* data = nullptr;
  DType dtype = DType::kFloat32;  // kFloat32, kBFloat16, kFloat16 or kFloat8E4M3
  StateLayout layout = StateLayout::kKLast;
  int64_t num_slots = 0;    // P
  int64_t slot_stride = 0;  // elements between slots, >= HV*K*V
  uint8_t* scales = nullptr;  // kFloat8E4M3: [P, HV*K*V / kFp8Block] block scales, contiguous; else unused
};

// A buffer of states indexed by (slot, step): [Q, S, HV, <layout>].
// Used for verify's intermediate states (S = T_max) and prefill's checkpoints (S = max checkpoints).
// The layout must equal the pool's. Steps are HV*K*V elements apart.
struct StateCache {
  void* data = nullptr;  // may be nullptr: nothing cached
  DType dtype = DType::kFloat32;  // kFloat32, kBFloat16, kFloat16 or kFloat8E4M3
  StateLayout layout = StateLayout::kKLast;
  int64_t num_slots = 0;    // Q
  int64_t num_steps = 0;    // S
  int64_t slot_stride = 0;  // elements between slots, >= S*HV*K*V
  uint8_t* scales = nullptr;  // kFloat8E4M3: [Q, S, HV*K*V / kFp8Block] block scales, contiguous; else unused
};

}  // namespace gdnkit
