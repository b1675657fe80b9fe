// gdnkit bench, CUDA path: device inputs, cold-L2 CUDA-graph timing, the copy ceiling (docs/benchmarks.md).
// Calls only the public API with Backend::kCUDA.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "bench.h"
#include "cuda_util.cuh"
#include "cuda/host/overrides.h"
#include "gdnkit/gdnkit.h"
#ifdef GDNKIT_WITH_NCCL
#include <barrier>

#include "gdnkit/nccl.h"
#endif

namespace gdnkit::bench {
namespace {

// ---- random device inputs ----------------------------------------------------------------------
// Counter-based: element i of a fill is a function of (seed, i) only, so fills are reproducible and
// need no RNG state. Never zeros (the spec's rule for test and bench inputs).

__device__ __forceinline__ uint64_t mix64(uint64_t x) {  // splitmix64 finalizer
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform in (0, 1): 24 random bits, offset by half a step so log(u) is finite.
__device__ __forceinline__ float uniform_open(uint64_t seed, uint64_t i, uint64_t lane) {
  const uint64_t h = mix64(seed + mix64(2 * i + lane));
  return (float(h >> 40) + 0.5f) * (1.0f / 16777216.0f);
}

enum class Fill : int { kNormal, kLogUniform };

// kNormal: x0 + x1 * N(0,1) (Box-Muller); kLogUniform: log(U(x0, x1)).
template <class T>
__global__ void fill_kernel(T* __restrict__ p, int64_t n, uint64_t seed, Fill kind, float x0, float x1) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float u1 = uniform_open(seed, i, 0);
    float x;
    if (kind == Fill::kNormal) {
      const float u2 = uniform_open(seed, i, 1);
      x = x0 + x1 * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    } else {
      x = logf(x0 + (x1 - x0) * u1);
    }
    p[i] = from_float<T>(x);
  }
}

// float8_e4m3 pools: x1 N(0, 1) per element as e4m3 under one power-of-two scale (2^-kFp8FillShift) for every
// block, whose scale bytes fill_fp8_scales writes.
constexpr int kFp8FillShift = 10;
__global__ void fill_e4m3_kernel(uint8_t* __restrict__ p, int64_t n, uint64_t seed, float x1) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float u1 = uniform_open(seed, i, 0), u2 = uniform_open(seed, i, 1);
    const float x = x1 * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2) * float(1 << kFp8FillShift);
    p[i] = uint8_t(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
  }
}

// Each row of `dim` elements divided by its L2 norm (the op's: sqrt(sum x^2 + 1e-6)), a warp per row: the q and k a
// caller passes with the op's L2 norm off (--no-qk-l2norm).
template <class T>
__global__ void l2_normalize_rows_kernel(T* __restrict__ p, int64_t rows, int dim) {
  const int lane = int(threadIdx.x % 32);
  for (int64_t row = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; row < rows;
       row += int64_t(gridDim.x) * blockDim.x / 32) {
    T* x = p + row * dim;
    float ss = 0.0f;
    for (int i = lane; i < dim; i += 32) ss += to_float(x[i]) * to_float(x[i]);
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    const float r = rsqrtf(ss + 1e-6f);
    for (int i = lane; i < dim; i += 32) x[i] = from_float<T>(to_float(x[i]) * r);
  }
}

template <class T>
__global__ void count_nonfinite_kernel(const T* __restrict__ p, int64_t n, unsigned long long* count) {
  unsigned long long c = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    c += !isfinite(to_float(p[i]));
  if (c) atomicAdd(count, c);
}

constexpr int kFillThreads = 256;
int fill_blocks(int64_t n) { return int(std::min<int64_t>((n + kFillThreads - 1) / kFillThreads, 4096)); }  // grid-stride: enough CTAs to fill any GPU

void fill(void* p, DType dtype, int64_t n, uint64_t seed, Fill kind, float x0, float x1, cudaStream_t st) {
  if (n <= 0) return;
  const int blocks = fill_blocks(n);
  switch (dtype) {
    case DType::kFloat32:
      fill_kernel<<<blocks, kFillThreads, 0, st>>>(static_cast<float*>(p), n, seed, kind, x0, x1);
      break;
    case DType::kBFloat16:
      fill_kernel<<<blocks, kFillThreads, 0, st>>>(static_cast<__nv_bfloat16*>(p), n, seed, kind, x0, x1);
      break;
    case DType::kFloat16:
      fill_kernel<<<blocks, kFillThreads, 0, st>>>(static_cast<__half*>(p), n, seed, kind, x0, x1);
      break;
    case DType::kFloat8E4M3:  // kNormal around 0 only (pools); the scales by fill_fp8_scales
      fill_e4m3_kernel<<<blocks, kFillThreads, 0, st>>>(static_cast<uint8_t*>(p), n, seed, x1);
      break;
    default: throw Error(ErrorCode::kInvalidArgument, std::string("fill: not a float dtype: ") + dtype_name(dtype));
  }
  BENCH_CUDA_CHECK_LAUNCH();
}

void l2_normalize_rows(void* p, DType dtype, int64_t rows, int dim, cudaStream_t st) {
  if (rows <= 0) return;
  const int blocks = fill_blocks(rows * 32);
  switch (dtype) {
    case DType::kFloat32:
      l2_normalize_rows_kernel<<<blocks, kFillThreads, 0, st>>>(static_cast<float*>(p), rows, dim);
      break;
    case DType::kBFloat16:
      l2_normalize_rows_kernel<<<blocks, kFillThreads, 0, st>>>(static_cast<__nv_bfloat16*>(p), rows, dim);
      break;
    case DType::kFloat16:
      l2_normalize_rows_kernel<<<blocks, kFillThreads, 0, st>>>(static_cast<__half*>(p), rows, dim);
      break;
    default:
      throw Error(ErrorCode::kInvalidArgument, std::string("normalize: not an input dtype: ") + dtype_name(dtype));
  }
  BENCH_CUDA_CHECK_LAUNCH();
}

void fill_fp8_scales(void* scales, int64_t elems, cudaStream_t st) {
  BENCH_CUDA_CHECK(cudaMemsetAsync(scales, 127 - kFp8FillShift, size_t(elems / kFp8Block), st));
}

int64_t count_nonfinite(const void* p, DType dtype, int64_t n, cudaStream_t st) {
  if (n <= 0) return 0;
  unsigned long long* d_count = nullptr;
  BENCH_CUDA_CHECK(cudaMallocAsync(&d_count, sizeof *d_count, st));
  BENCH_CUDA_CHECK(cudaMemsetAsync(d_count, 0, sizeof *d_count, st));
  const int blocks = fill_blocks(n);
  if (dtype == DType::kFloat32)
    count_nonfinite_kernel<<<blocks, kFillThreads, 0, st>>>(static_cast<const float*>(p), n, d_count);
  else if (dtype == DType::kBFloat16)
    count_nonfinite_kernel<<<blocks, kFillThreads, 0, st>>>(static_cast<const __nv_bfloat16*>(p), n, d_count);
  else
    count_nonfinite_kernel<<<blocks, kFillThreads, 0, st>>>(static_cast<const __half*>(p), n, d_count);
  BENCH_CUDA_CHECK_LAUNCH();
  unsigned long long h = 0;
  BENCH_CUDA_CHECK(cudaMemcpyAsync(&h, d_count, sizeof h, cudaMemcpyDeviceToHost, st));
  BENCH_CUDA_CHECK(cudaFreeAsync(d_count, st));
  BENCH_CUDA_CHECK(cudaStreamSynchronize(st));
  return int64_t(h);
}

// ---- device memory and timing ------------------------------------------------------------------

// The rows' device memory: one cudaMalloc at the first use (the free memory less 2 GiB, for the library and
// the runtime), handed out as a stack; a row's buffers are released in reverse order when it returns, and
// every use is ordered on the bench's stream. Serving engines allocate their pools and workspaces once, and with a
// cudaMalloc / cudaFree per buffer a row read up to 9% slower after a row of larger footprint (docs/benchmarks.md).
class Arena {
 public:
  static Arena& get() {
    static Arena a;
    return a;
  }
  // Bytes the arena takes at its first use (0: the free memory less 2 GiB); set before any row runs.
  static size_t& limit() {
    static size_t bytes = 0;
    return bytes;
  }
  void* alloc(size_t bytes) {
    const size_t align = bytes >= (size_t(1) << 20) ? size_t(2) << 20 : 256;
    const size_t at = (top_ + align - 1) / align * align;
    if (at + bytes > cap_)
      throw Error(ErrorCode::kCudaError, "bench: " + std::to_string(bytes) + " bytes of device memory wanted, " +
                                             std::to_string(cap_ - std::min(cap_, at)) + " left in its arena");
    blocks_.push_back({top_, at, false});
    top_ = at + bytes;
    return base_ + at;
  }
  void release(void* p) {
    for (auto it = blocks_.rbegin(); it != blocks_.rend(); ++it)
      if (base_ + it->at == p) {
        it->freed = true;
        break;
      }
    while (!blocks_.empty() && blocks_.back().freed) {
      top_ = blocks_.back().prev_top;
      blocks_.pop_back();
    }
  }

 private:
  struct Block {
    size_t prev_top, at;
    bool freed;
  };
  Arena() {
    size_t free_b = 0, total_b = 0;
    BENCH_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    const size_t reserve = size_t(2) << 30;
    cap_ = free_b > 2 * reserve ? free_b - reserve : free_b / 2;
    if (limit() > 0) {
      if (limit() > cap_)
        throw Error(ErrorCode::kInvalidArgument, "bench: --device-memory " + std::to_string(limit() >> 30) +
                                                     " GiB asked, at most " + std::to_string(cap_ >> 30) +
                                                     " GiB (the free memory less 2 GiB)");
      cap_ = limit();
    }
    BENCH_CUDA_CHECK(cudaMalloc(&base_, cap_));
  }
  char* base_ = nullptr;
  size_t cap_ = 0, top_ = 0;
  std::vector<Block> blocks_;
};

// Device memory from the arena of the first device, or (arena = false: the other devices of a split run) its own
// cudaMalloc on the current device.
class DevBuf {
 public:
  explicit DevBuf(size_t bytes, bool arena = true) : bytes_(bytes), arena_(arena) {
    if (arena_)
      p_ = Arena::get().alloc(std::max<size_t>(bytes, 16));
    else
      BENCH_CUDA_CHECK(cudaMalloc(&p_, std::max<size_t>(bytes, 16)));
  }
  ~DevBuf() {
    if (arena_)
      Arena::get().release(p_);
    else
      cudaFree(p_);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  template <class T = void>
  T* get() const { return static_cast<T*>(p_); }
  size_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
  bool arena_ = true;
};

struct Device {
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  int64_t l2_bytes = 0;
  double ceiling_tbps = -1;
  Device() {
    BENCH_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    BENCH_CUDA_CHECK(cudaEventCreate(&start));
    BENCH_CUDA_CHECK(cudaEventCreate(&stop));
  }
  ~Device() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    cudaStreamDestroy(stream);
  }
  Context ctx() const { return Context{Backend::kCUDA, stream}; }
  float elapsed_ms() const {
    BENCH_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    BENCH_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    return ms;
  }
};

// Captures what `enqueue` launches into one CUDA graph, replays it (2 warm-up + `replays` timed, each
// between two events) and returns the milliseconds of each timed replay.
template <class Enqueue>
std::vector<double> time_graph(const Device& d, Enqueue&& enqueue, int replays) {
  BENCH_CUDA_CHECK(cudaStreamBeginCapture(d.stream, cudaStreamCaptureModeThreadLocal));
  try {
    enqueue();
  } catch (...) {
    cudaGraph_t broken = nullptr;
    cudaStreamEndCapture(d.stream, &broken);  // leave capture mode before reporting
    if (broken) cudaGraphDestroy(broken);
    cudaGetLastError();
    throw;
  }
  cudaGraph_t graph = nullptr;
  BENCH_CUDA_CHECK(cudaStreamEndCapture(d.stream, &graph));
  std::unique_ptr<std::remove_pointer_t<cudaGraph_t>, decltype(&cudaGraphDestroy)> graph_guard(graph, cudaGraphDestroy);
  cudaGraphExec_t exec = nullptr;
  BENCH_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  std::unique_ptr<std::remove_pointer_t<cudaGraphExec_t>, decltype(&cudaGraphExecDestroy)> exec_guard(exec, cudaGraphExecDestroy);
  for (int i = 0; i < 2; ++i) BENCH_CUDA_CHECK(cudaGraphLaunch(exec, d.stream));
  std::vector<double> ms;
  for (int r = 0; r < replays; ++r) {
    BENCH_CUDA_CHECK(cudaEventRecord(d.start, d.stream));
    BENCH_CUDA_CHECK(cudaGraphLaunch(exec, d.stream));
    BENCH_CUDA_CHECK(cudaEventRecord(d.stop, d.stream));
    ms.push_back(d.elapsed_ms());
  }
  return ms;
}

// The launch floor (RunInfo::launch_floor_us): an empty kernel launched as the recurrent kernels are
// (programmatic dependent launch: it waits for the previous grid, then lets the next one launch).
__global__ void empty_dependent_kernel() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;");
}

double launch_floor_us(const Device& d, int ctas, int calls) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(ctas));
  cfg.blockDim = dim3(64);
  cfg.stream = d.stream;
  cudaLaunchAttribute pdl;  // programmatic dependent launch, as the recurrent kernels
  pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &pdl;
  cfg.numAttrs = 1;
  const auto ms = time_graph(
      d, [&] { for (int j = 0; j < calls; ++j) BENCH_CUDA_CHECK(cudaLaunchKernelEx(&cfg, empty_dependent_kernel)); },
      20);
  return median(ms) * 1e3 / calls;
}

// Device-to-device copy of 1 GiB; bytes read + written per second (the ceiling the op rows are compared to).
double copy_ceiling_tbps(const Device& d, double gib) {
  const size_t bytes = size_t(gib * (1ull << 30));
  DevBuf src(bytes), dst(bytes);
  fill(src.get(), DType::kFloat32, int64_t(bytes / 4), 7, Fill::kNormal, 0.f, 1.f, d.stream);
  for (int i = 0; i < 2; ++i)
    BENCH_CUDA_CHECK(cudaMemcpyAsync(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice, d.stream));
  std::vector<double> ms;
  for (int i = 0; i < 10; ++i) {
    BENCH_CUDA_CHECK(cudaEventRecord(d.start, d.stream));
    BENCH_CUDA_CHECK(cudaMemcpyAsync(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice, d.stream));
    BENCH_CUDA_CHECK(cudaEventRecord(d.stop, d.stream));
    ms.push_back(d.elapsed_ms());
  }
  return 2.0 * double(bytes) / (median(ms) * 1e-3) / 1e12;
}

std::string nvidia_smi(const char* query) {
  std::string cmd = std::string("nvidia-smi --query-gpu=") + query + " --format=csv,noheader,nounits -i 0 2>/dev/null";
  FILE* f = popen(cmd.c_str(), "r");
  if (!f) return "";
  char buf[256] = {};
  std::string s;
  while (fgets(buf, sizeof buf, f)) s += buf;
  pclose(f);
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ' || s.back() == '\r')) s.pop_back();
  if (s.find("N/A") != std::string::npos || s.find("rror") != std::string::npos) return "";
  return s;
}

// A random permutation of 0..pool-1 (slots are never 0..B-1 in order), first `count` taken.
std::vector<int32_t> random_slots(int64_t pool, int64_t count, uint64_t seed) {
  std::vector<int32_t> perm(static_cast<size_t>(pool));
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(perm.begin(), perm.end(), rng);
  perm.resize(static_cast<size_t>(count));
  return perm;
}

void upload(void* dst, const void* src, size_t bytes, cudaStream_t st) {
  BENCH_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, st));
  BENCH_CUDA_CHECK(cudaStreamSynchronize(st));  // src is a host temporary
}

// q, k, v, a, b, A_log, dt_bias for `tokens` tokens with the spec's distributions; o NaN-poisoned.
struct DeviceTokens {
  DevBuf q, k, v, o, a, b, A_log, dt_bias;
  TokenBuffers views;
  DeviceTokens(const Shape& s, DType in, int64_t tokens, uint64_t seed, cudaStream_t st, bool arena = true)
      : q(size_t(tokens) * s.H * s.K * dtype_size(in), arena),
        k(q.bytes(), arena),
        v(size_t(tokens) * s.HV * s.V * dtype_size(in), arena),
        o(v.bytes(), arena),
        a(size_t(tokens) * s.HV * dtype_size(in), arena),
        b(a.bytes(), arena),
        A_log(size_t(s.HV) * 4, arena),
        dt_bias(size_t(s.HV) * 4, arena) {
    const int64_t nqk = tokens * s.H * s.K, nv = tokens * s.HV * s.V, ng = tokens * s.HV;
    fill(q.get(), in, nqk, seed + 1, Fill::kNormal, 0.f, 1.f, st);
    fill(k.get(), in, nqk, seed + 2, Fill::kNormal, 0.f, 1.f, st);
    if (!g_qk_l2norm) {  // the op's norm off: q and k arrive normalized, as a caller would pass them
      l2_normalize_rows(q.get(), in, tokens * s.H, s.K, st);
      l2_normalize_rows(k.get(), in, tokens * s.H, s.K, st);
    }
    fill(v.get(), in, nv, seed + 3, Fill::kNormal, 0.f, 1.f, st);
    fill(a.get(), in, ng, seed + 4, Fill::kNormal, 0.f, 1.f, st);
    fill(b.get(), in, ng, seed + 5, Fill::kNormal, 0.f, 1.f, st);
    fill(A_log.get(), DType::kFloat32, s.HV, seed + 6, Fill::kLogUniform, 1.f, 16.f, st);
    fill(dt_bias.get(), DType::kFloat32, s.HV, seed + 7, Fill::kNormal, 0.f, 0.5f, st);
    BENCH_CUDA_CHECK(cudaMemsetAsync(o.get(), 0xff, o.bytes(), st));  // all-ones bits: NaN in bf16/fp16/fp32
    views = {q.get(), k.get(), v.get(), o.get(), a.get(), b.get(), A_log.get<float>(), dt_bias.get<float>()};
  }
};

// q, k, v, a, b dtype of this run (--input); set once by run_cpu / run_cuda.
DType g_input = DType::kBFloat16;
constexpr int kMinCallsPerReplay = 8;

Row base_row(const std::string& op, const Shape& s, DType state, StateLayout layout) {
  return make_row("cuda", op, s, g_input, state, layout);
}

// Cold L2: slot sets such that one replay reads >= 4x L2 of state; at least 2, so that two consecutive
// calls never hit the same slots.
int slot_sets_for(const Device& d, double state_bytes_per_call) {
  return std::max(2, int(std::ceil(4.0 * double(d.l2_bytes) / state_bytes_per_call)));
}

void not_ok(Row& r, const Error& e) {
  r.status = e.code() == ErrorCode::kNotImplemented ? "not implemented" : "error";
  r.message = e.what();
}

void fill_timing(Row& r, const std::vector<double>& replay_ms, int calls) {
  std::vector<double> us;
  for (double ms : replay_ms) us.push_back(ms * 1e3 / calls);
  r.time_us = median(us);
  r.time_us_min = *std::min_element(us.begin(), us.end());
  r.time_us_max = *std::max_element(us.begin(), us.end());
  r.samples = int(us.size());
  r.calls_per_replay = calls;
}

int64_t read_flag(const DevBuf& flag) {
  int32_t h = 0;
  BENCH_CUDA_CHECK(cudaMemcpy(&h, flag.get(), 4, cudaMemcpyDeviceToHost));
  return h;
}

// ---- decode ------------------------------------------------------------------------------------

Row bench_decode(const Device& d, const Options& o, const Shape& s, DType state, StateLayout layout, int32_t B) {
  Row r = base_row("decode", s, state, layout);
  r.batch = B;
  r.total_tokens = B;
  const double slot_bytes = double(s.HV) * s.K * s.V * dtype_size(state);
  const int sets = slot_sets_for(d, B * slot_bytes);
  const int calls = std::max(sets, kMinCallsPerReplay);
  const int64_t pool_slots = int64_t(sets) * B + 8;
  r.slot_sets = sets;
  r.pool_slots = pool_slots;
  r.state_bytes_per_replay = double(calls) * B * slot_bytes;
  r.bytes = decode_bytes(s, B, g_input, state);

  const uint64_t seed = 1000003ull * B + 17 * int(state) + int(layout);
  const int64_t pool_elems = int64_t(pool_slots) * s.HV * s.K * s.V;
  const bool fp8 = state == DType::kFloat8E4M3;
  DevBuf pool(size_t(pool_slots * slot_bytes)), scales(fp8 ? size_t(pool_elems / kFp8Block) : 0),
      indices(size_t(sets) * B * 4), flag(4);
  fill(pool.get(), state, pool_elems, seed, Fill::kNormal, 0.f, 0.05f, d.stream);
  if (fp8) fill_fp8_scales(scales.get(), pool_elems, d.stream);
  DeviceTokens tok(s, g_input, int64_t(sets) * B, seed, d.stream);
  upload(indices.get(), random_slots(pool_slots, int64_t(sets) * B, seed).data(), indices.bytes(), d.stream);
  BENCH_CUDA_CHECK(cudaMemsetAsync(flag.get(), 0, 4, d.stream));

  std::vector<DecodeParams> params(static_cast<size_t>(sets));
  for (int i = 0; i < sets; ++i) {
    DecodeParams& p = params[size_t(i)];
    p.heads = head_config(s);
    p.batch = B;
    set_token_views(s, g_input, tok.views, int64_t(i) * B, p.q, p.k, p.v, p.o, p.gating);
    p.state = make_pool(s, pool.get(), state, layout, pool_slots, fp8 ? scales.get<uint8_t>() : nullptr);
    p.state_indices = indices.get<int32_t>() + int64_t(i) * B;
    p.error_flag = flag.get<int32_t>();
  }
  const Context ctx = d.ctx();
  try {
    for (const auto& p : params) decode(p, ctx);  // eager: validation, lazy setup, every output row written
  } catch (const Error& e) {
    not_ok(r, e);
    cudaStreamSynchronize(d.stream);
    return r;
  }
  BENCH_CUDA_CHECK(cudaStreamSynchronize(d.stream));
  const auto ms = time_graph(d, [&] { for (int j = 0; j < calls; ++j) decode(params[size_t(j % sets)], ctx); },
                             o.replays);
  fill_timing(r, ms, calls);
  r.nonfinite_outputs = count_nonfinite(tok.o.get(), g_input, int64_t(sets) * B * s.HV * s.V, d.stream);
  r.error_flag = read_flag(flag);
  return r;
}

// ---- verify (+ commit) -------------------------------------------------------------------------

Row bench_verify(const Device& d, const Options& o, const Shape& s, DType state, StateLayout layout, VerifyMode mode,
                 int32_t T, int32_t B) {
  Row r = base_row("verify", s, state, layout);
  r.mode = verify_mode_name(mode);
  r.batch = B;
  r.draft_tokens = T;
  r.total_tokens = int64_t(B) * T;
  const int64_t slot_elems = int64_t(s.HV) * s.K * s.V;
  const double slot_bytes = double(slot_elems) * dtype_size(state);
  const int sets = slot_sets_for(d, B * slot_bytes);
  const int calls = std::max(sets, kMinCallsPerReplay);
  const int64_t pool_slots = int64_t(sets) * B + 8;
  const bool cache = mode != VerifyMode::kCommitRecompute;
  const bool fp8 = state == DType::kFloat8E4M3;
  const DType cache_dtype = verify_cache_dtype(state);
  const bool commit_after = mode != VerifyMode::kCache;
  r.slot_sets = sets;
  r.pool_slots = pool_slots;
  r.state_bytes_per_replay = double(calls) * B * slot_bytes;

  // accepted[b] in 1..T: every sequence keeps at least one token, so every commit moves a state.
  std::mt19937 rng(uint32_t(B * 131 + T));
  std::vector<int32_t> accepted(static_cast<size_t>(B));
  int64_t accepted_total = 0;
  for (auto& a : accepted) accepted_total += (a = int32_t(1 + rng() % uint32_t(T)));
  if (commit_after) r.accepted_mean = double(accepted_total) / B;
  r.bytes = verify_bytes(s, B, T, g_input, state, mode, accepted_total);

  const uint64_t seed = 7000003ull * B + 101 * T + 17 * int(state) + int(layout) + 3 * int(mode);
  const int64_t cache_slots = cache ? int64_t(sets) * B : 0;
  DevBuf pool(size_t(pool_slots * slot_bytes)), indices(size_t(sets) * B * 4), flag(4);
  DevBuf scales(fp8 ? size_t(pool_slots * slot_elems / kFp8Block) : 0);
  const int64_t cache_elems = cache_slots * T * slot_elems;
  DevBuf inter(size_t(cache_elems * dtype_size(cache_dtype))), inter_indices(size_t(std::max<int64_t>(cache_slots, 1)) * 4);
  DevBuf inter_scales(fp8 ? size_t(cache_elems / kFp8Block) : 0);
  DevBuf d_accepted(size_t(B) * 4);
  fill(pool.get(), state, pool_slots * slot_elems, seed, Fill::kNormal, 0.f, 0.05f, d.stream);
  if (fp8) fill_fp8_scales(scales.get(), pool_slots * slot_elems, d.stream);
  DeviceTokens tok(s, g_input, int64_t(sets) * B * T, seed, d.stream);
  upload(indices.get(), random_slots(pool_slots, int64_t(sets) * B, seed).data(), indices.bytes(), d.stream);
  if (cache)
    upload(inter_indices.get(), random_slots(cache_slots, cache_slots, seed + 1).data(), inter_indices.bytes(),
           d.stream);
  upload(d_accepted.get(), accepted.data(), d_accepted.bytes(), d.stream);
  BENCH_CUDA_CHECK(cudaMemsetAsync(flag.get(), 0, 4, d.stream));

  std::vector<CommitParams> params(static_cast<size_t>(sets));  // CommitParams extends VerifyParams
  for (int i = 0; i < sets; ++i) {
    CommitParams& p = params[size_t(i)];
    p.heads = head_config(s);
    p.batch = B;
    p.num_draft_tokens = T;
    set_token_views(s, g_input, tok.views, int64_t(i) * B * T, p.q, p.k, p.v, p.o, p.gating);
    p.state = make_pool(s, pool.get(), state, layout, pool_slots, fp8 ? scales.get<uint8_t>() : nullptr);
    p.state_indices = indices.get<int32_t>() + int64_t(i) * B;
    p.error_flag = flag.get<int32_t>();
    p.update_state = false;
    if (cache) {
      p.intermediate.data = inter.get();
      p.intermediate.scales = fp8 ? inter_scales.get<uint8_t>() : nullptr;
      p.intermediate.dtype = cache_dtype;
      p.intermediate.layout = layout;
      p.intermediate.num_slots = cache_slots;
      p.intermediate.num_steps = T;
      p.intermediate.slot_stride = int64_t(T) * slot_elems;
      p.intermediate_indices = inter_indices.get<int32_t>() + int64_t(i) * B;
    }
    p.source = mode == VerifyMode::kCommitRecompute ? CommitSource::kRecompute : CommitSource::kCache;
    p.accepted = d_accepted.get<int32_t>();
  }
  const Context ctx = d.ctx();
  auto one_call = [&](const CommitParams& p) {
    verify(static_cast<const VerifyParams&>(p), ctx);
    if (commit_after) commit(p, ctx);
  };
  try {
    for (const auto& p : params) one_call(p);
  } catch (const Error& e) {
    not_ok(r, e);
    cudaStreamSynchronize(d.stream);
    return r;
  }
  BENCH_CUDA_CHECK(cudaStreamSynchronize(d.stream));
  const auto ms = time_graph(d, [&] { for (int j = 0; j < calls; ++j) one_call(params[size_t(j % sets)]); },
                             o.replays);
  fill_timing(r, ms, calls);
  r.nonfinite_outputs = count_nonfinite(tok.o.get(), g_input, int64_t(sets) * B * T * s.HV * s.V, d.stream);
  r.error_flag = read_flag(flag);
  return r;
}

// ---- prefill -----------------------------------------------------------------------------------

constexpr int kPrefillRowPauseMs = 300;

Row bench_prefill(const Device& d, const Options& o, const Shape& s, DType state, StateLayout layout,
                  const SeqSet& set) {
  Row r = make_prefill_row("cuda", s, g_input, state, layout, set, o.checkpoint);
  const int32_t N = r.num_seqs;
  const int64_t T = r.total_tokens;
  const int64_t slot_elems = int64_t(s.HV) * s.K * s.V;
  // Spare slots so that the N slots are a random subset; a quarter more (a set like 8192x32 has 8192 sequences,
  // 16 GiB of fp32 qwen3-next states).
  const int64_t pool_slots = int64_t(N) + std::max<int64_t>(8, N / 4);
  r.pool_slots = pool_slots;

  std::vector<int64_t> cu_host(size_t(N) + 1, 0);
  for (int32_t i = 0; i < N; ++i) cu_host[size_t(i) + 1] = cu_host[size_t(i)] + set.lengths[size_t(i)];
  std::vector<int32_t> cu32(cu_host.begin(), cu_host.end());

  const uint64_t seed = 90000049ull + uint64_t(T) * 7 + uint64_t(N) + 17 * int(state) + int(layout);
  const bool fp8 = state == DType::kFloat8E4M3;
  DevBuf pool(size_t(pool_slots * slot_elems * dtype_size(state))), cu(cu32.size() * 4), slots(size_t(N) * 4),
      flag(4), scales(fp8 ? size_t(pool_slots * slot_elems / kFp8Block) : 0);
  fill(pool.get(), state, pool_slots * slot_elems, seed, Fill::kNormal, 0.f, 0.05f, d.stream);
  if (fp8) fill_fp8_scales(scales.get(), pool_slots * slot_elems, d.stream);
  DeviceTokens tok(s, g_input, T, seed, d.stream);
  upload(cu.get(), cu32.data(), cu.bytes(), d.stream);
  upload(slots.get(), random_slots(pool_slots, N, seed).data(), slots.bytes(), d.stream);
  BENCH_CUDA_CHECK(cudaMemsetAsync(flag.get(), 0, 4, d.stream));

  PrefillParams p;
  p.heads = head_config(s);
  p.num_seqs = N;
  p.total_tokens = T;
  set_token_views(s, g_input, tok.views, 0, p.q, p.k, p.v, p.o, p.gating);
  p.cu_seqlens = cu.get();
  p.cu_seqlens_dtype = DType::kInt32;
  p.cu_seqlens_host = cu_host.data();
  p.state = make_pool(s, pool.get(), state, layout, pool_slots, fp8 ? scales.get<uint8_t>() : nullptr);
  // In place: each sequence starts from its slot and stores its final state there (read before write).
  p.initial_indices = slots.get<int32_t>();
  p.final_indices = slots.get<int32_t>();
  p.error_flag = flag.get<int32_t>();
  // Checkpoints (--checkpoint C): sequence n's states after every C of its tokens in checkpoint slot n.
  const int64_t steps = checkpoint_steps(set, o.checkpoint);
  std::vector<int32_t> ckpt_host(static_cast<size_t>(N));
  for (int32_t i = 0; i < N; ++i) ckpt_host[size_t(i)] = i;
  DevBuf ckpt(size_t(N * steps * slot_elems * dtype_size(state))), ckpt_idx(size_t(N) * 4),
      ckpt_scales(fp8 ? size_t(N * steps * slot_elems / kFp8Block) : 0);
  if (steps > 0) {
    upload(ckpt_idx.get(), ckpt_host.data(), ckpt_idx.bytes(), d.stream);
    p.checkpoints = make_checkpoints(s, ckpt.get(), state, layout, N, steps, fp8 ? ckpt_scales.get<uint8_t>() : nullptr);
    p.checkpoint_interval = int32_t(o.checkpoint);
    p.checkpoint_indices = ckpt_idx.get<int32_t>();
  }
  // The path the library takes: sequences of at most short_max_len tokens on the recurrent kernels, the others
  // on the chunked kernels.
  const PrefillPath path = prefill_path(p);
  const int short_len = path.short_max_len;
  const auto n_short = std::count_if(set.lengths.begin(), set.lengths.end(), [&](auto L) { return L <= short_len; });
  r.mode = n_short == N ? "short" : n_short == 0 ? "chunked" : "short+chunked";
  if (path.context_parallel_segment > 0 && n_short < N)
    r.mode += " cp" + std::to_string(path.context_parallel_segment);
  if (steps > 0) r.mode += " ckpt" + std::to_string(o.checkpoint);
  if (!o.qk_l2norm) r.mode += " no-l2n";
  std::unique_ptr<DevBuf> workspace;
  const Context ctx = d.ctx();
  try {
    const size_t ws = prefill_workspace_bytes(p);
    if (ws > 0) {
      workspace = std::make_unique<DevBuf>(ws);
      p.workspace = workspace->get();
      p.workspace_bytes = ws;
    }
    // Each row from an idle GPU (after a heavy row the power limit holds the clock down for a while), then warm.
    BENCH_CUDA_CHECK(cudaStreamSynchronize(d.stream));
    std::this_thread::sleep_for(std::chrono::milliseconds(kPrefillRowPauseMs));
    for (int i = 0; i < 2; ++i) prefill(p, ctx);  // warm-up
  } catch (const Error& e) {
    not_ok(r, e);
    cudaStreamSynchronize(d.stream);
    return r;
  }
  BENCH_CUDA_CHECK(cudaStreamSynchronize(d.stream));
  std::vector<double> us;
  for (int i = 0; i < o.prefill_iters; ++i) {
    BENCH_CUDA_CHECK(cudaEventRecord(d.start, d.stream));
    prefill(p, ctx);
    BENCH_CUDA_CHECK(cudaEventRecord(d.stop, d.stream));
    us.push_back(d.elapsed_ms() * 1e3);
  }
  r.time_us = median(us);
  r.time_us_min = *std::min_element(us.begin(), us.end());
  r.time_us_max = *std::max_element(us.begin(), us.end());
  r.samples = int(us.size());
  r.nonfinite_outputs = count_nonfinite(tok.o.get(), g_input, T * s.HV * s.V, d.stream);
  r.error_flag = read_flag(flag);
  return r;
}

// ---- prefill split over GPUs ------------------------------------------------------------------

#ifdef GDNKIT_WITH_NCCL
// One sequence set over G GPUs of this machine (split_prefill_nccl, one thread and one NCCL rank per GPU): rank q
// holds tokens [L q / G, L (q + 1) / G) of each sequence of L tokens (cut on chunks), fp32 pool slots of its own
// (initial state read on rank 0, final state written on the last). Time per call: the slowest rank's, between events
// on each rank's stream after a host barrier; median over the timed calls. The exchange: the all-gather alone, timed
// in calls run in their three steps, on the rank that reached it last (the others' time there includes waiting).
Row bench_prefill_split(const Options& o, const Shape& s, DType state, StateLayout layout, const SeqSet& set, int G,
                        double one_gpu_us) {
  Row r = make_prefill_row("cuda", s, g_input, state, layout, set);
  r.op = "prefill-split";
  r.mode = std::to_string(G) + " GPUs";
  if (!o.qk_l2norm) r.mode += " no-l2n";
  r.ranks = G;
  int devices = 0;
  BENCH_CUDA_CHECK(cudaGetDeviceCount(&devices));
  if (G > devices) {
    r.status = "not run";
    r.message = "needs " + std::to_string(G) + " GPUs, this machine has " + std::to_string(devices);
    return r;
  }
  const int32_t N = r.num_seqs;
  std::vector<std::vector<int64_t>> cut(static_cast<size_t>(N), std::vector<int64_t>(static_cast<size_t>(G) + 1));
  for (int32_t n = 0; n < N; ++n)
    for (int q = 0; q <= G; ++q)
      cut[size_t(n)][size_t(q)] = q == G ? set.lengths[size_t(n)] : set.lengths[size_t(n)] * q / G / 64 * 64;
  std::vector<ncclComm_t> comms(static_cast<size_t>(G));
  std::vector<int> ids(static_cast<size_t>(G));
  std::iota(ids.begin(), ids.end(), 0);
  if (ncclCommInitAll(comms.data(), G, ids.data()) != ncclSuccess)
    throw Error(ErrorCode::kCudaError, "bench: ncclCommInitAll failed");
  std::vector<std::vector<double>> total(static_cast<size_t>(G)), exchange(static_cast<size_t>(G));
  std::vector<std::string> errors(static_cast<size_t>(G));
  std::vector<int64_t> nonfinite(static_cast<size_t>(G), 0), flags(static_cast<size_t>(G), 0);
  std::barrier sync(G);
  const int iters = o.prefill_iters, warmup = 2;
  const auto rank_run = [&](int q, cudaStream_t st, cudaEvent_t* ev) {
    std::vector<int32_t> cu(static_cast<size_t>(N) + 1, 0);
    std::vector<int64_t> offsets(static_cast<size_t>(N));
    for (int32_t n = 0; n < N; ++n) {
      offsets[size_t(n)] = cut[size_t(n)][size_t(q)];
      cu[size_t(n) + 1] = cu[size_t(n)] + int32_t(cut[size_t(n)][size_t(q) + 1] - cut[size_t(n)][size_t(q)]);
    }
    std::vector<int64_t> cu_host(cu.begin(), cu.end());
    const int64_t T = cu.back(), slot_elems = int64_t(s.HV) * s.K * s.V;
    const bool arena = q == 0;  // device 0's memory is the bench arena's
    const uint64_t seed = 91000049ull + uint64_t(set.total()) * 7 + uint64_t(q);
    DeviceTokens tok(s, g_input, T, seed, st, arena);
    DevBuf pool(size_t(N * slot_elems * dtype_size(state)), arena), d_cu(cu.size() * 4, arena),
        d_off(offsets.size() * 8, arena), slots(size_t(N) * 4, arena), flag(4, arena),
        scales(state == DType::kFloat8E4M3 ? size_t(N * slot_elems / kFp8Block) : 0, arena);
    fill(pool.get(), state, N * slot_elems, seed, Fill::kNormal, 0.f, 0.05f, st);
    if (state == DType::kFloat8E4M3) fill_fp8_scales(scales.get(), N * slot_elems, st);
    upload(d_cu.get(), cu.data(), d_cu.bytes(), st);
    upload(d_off.get(), offsets.data(), d_off.bytes(), st);
    std::vector<int32_t> idx(static_cast<size_t>(N));
    std::iota(idx.begin(), idx.end(), 0);
    upload(slots.get(), idx.data(), slots.bytes(), st);
    BENCH_CUDA_CHECK(cudaMemsetAsync(flag.get(), 0, 4, st));
    SplitPrefillParams sp;
    PrefillParams& p = sp.local;
    p.heads = head_config(s);
    p.num_seqs = N;
    p.total_tokens = T;
    set_token_views(s, g_input, tok.views, 0, p.q, p.k, p.v, p.o, p.gating);
    p.cu_seqlens = d_cu.get();
    p.cu_seqlens_host = cu_host.data();
    p.state = make_pool(s, pool.get(), state, layout, N,
                        state == DType::kFloat8E4M3 ? scales.get<uint8_t>() : nullptr);
    p.initial_indices = p.final_indices = slots.get<int32_t>();
    p.error_flag = flag.get<int32_t>();
    sp.rank = q;
    sp.num_ranks = G;
    sp.piece_offsets = d_off.get<int64_t>();
    sp.piece_offsets_host = offsets.data();
    const int64_t elems = split_prefill_exchange_elems(p);
    DevBuf ex(size_t(G * elems) * 4, arena), ws(split_prefill_workspace_bytes(sp), arena);
    sp.exchange = ex.get<float>();
    p.workspace = ws.get();
    p.workspace_bytes = ws.bytes();
    const Context ctx{Backend::kCUDA, st};
    for (int i = 0; i < warmup + iters; ++i) {
      sync.arrive_and_wait();
      BENCH_CUDA_CHECK(cudaEventRecord(ev[0], st));
      split_prefill_nccl(sp, comms[size_t(q)], ctx);
      BENCH_CUDA_CHECK(cudaEventRecord(ev[3], st));
      BENCH_CUDA_CHECK(cudaEventSynchronize(ev[3]));
      float ms = 0;
      BENCH_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[0], ev[3]));
      if (i >= warmup) total[size_t(q)].push_back(ms * 1e3);
    }
    for (int i = 0; i < iters; ++i) {  // the same call in its three steps, the all-gather between events
      sync.arrive_and_wait();
      split_prefill_begin(sp, ctx);
      BENCH_CUDA_CHECK(cudaEventRecord(ev[1], st));
      if (ncclAllGather(sp.exchange + q * elems, sp.exchange, size_t(elems), ncclFloat32, comms[size_t(q)], st) !=
          ncclSuccess)
        throw Error(ErrorCode::kCudaError, "bench: ncclAllGather failed");
      BENCH_CUDA_CHECK(cudaEventRecord(ev[2], st));
      split_prefill_end(sp, ctx);
      BENCH_CUDA_CHECK(cudaEventSynchronize(ev[2]));
      float ms = 0;
      BENCH_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[1], ev[2]));
      exchange[size_t(q)].push_back(ms * 1e3);
    }
    nonfinite[size_t(q)] = count_nonfinite(tok.o.get(), g_input, T * s.HV * s.V, st);
    flags[size_t(q)] = read_flag(flag);
  };
  const auto rank_main = [&](int q) {
    cudaStream_t st = nullptr;
    cudaEvent_t ev[4] = {};
    try {
      BENCH_CUDA_CHECK(cudaSetDevice(q));
      BENCH_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
      for (cudaEvent_t& e : ev) BENCH_CUDA_CHECK(cudaEventCreate(&e));
      rank_run(q, st, ev);
    } catch (const std::exception& e) {
      errors[size_t(q)] = e.what();
      sync.arrive_and_drop();  // the others' host barriers go on (a failure inside a collective still stalls them)
    }
    if (st != nullptr) cudaStreamSynchronize(st);
    for (cudaEvent_t& e : ev)
      if (e != nullptr) cudaEventDestroy(e);
    if (st != nullptr) cudaStreamDestroy(st);
  };
  std::vector<std::thread> threads;
  for (int q = 0; q < G; ++q) threads.emplace_back(rank_main, q);
  for (auto& t : threads) t.join();
  for (ncclComm_t c : comms) ncclCommDestroy(c);
  cudaSetDevice(0);
  for (int q = 0; q < G; ++q)
    if (!errors[size_t(q)].empty()) throw Error(ErrorCode::kCudaError, "rank " + std::to_string(q) + ": " + errors[size_t(q)]);
  std::vector<double> slowest(static_cast<size_t>(iters), 0), first_in(static_cast<size_t>(iters), 1e30);
  for (int q = 0; q < G; ++q)
    for (int i = 0; i < iters; ++i) {
      slowest[size_t(i)] = std::max(slowest[size_t(i)], total[size_t(q)][size_t(i)]);
      first_in[size_t(i)] = std::min(first_in[size_t(i)], exchange[size_t(q)][size_t(i)]);
    }
  r.time_us = median(slowest);
  r.time_us_min = *std::min_element(slowest.begin(), slowest.end());
  r.time_us_max = *std::max_element(slowest.begin(), slowest.end());
  r.samples = iters;
  r.exchange_us = median(first_in);
  if (one_gpu_us > 0) r.efficiency = one_gpu_us / (G * r.time_us);
  r.nonfinite_outputs = std::accumulate(nonfinite.begin(), nonfinite.end(), int64_t(0));
  r.error_flag = std::accumulate(flags.begin(), flags.end(), int64_t(0));
  return r;
}
#endif

// Runs one configuration; failures of the harness itself (allocation, CUDA errors) become error rows.
template <class Fn>
void guarded(Row fallback, const RowSink& sink, double ceiling, Fn&& fn) {
  Row r;
  try {
    r = fn();
  } catch (const std::exception& e) {
    r = std::move(fallback);
    r.status = "error";
    r.message = e.what();
    cudaGetLastError();  // clear a non-sticky error (e.g. out of memory) so the next row can run
  }
  finish_row(r, ceiling);
  sink(r);
}

}  // namespace

std::string cuda_op_probe() {
  if (!cuda_available()) return "";
  // One tiny problem per op (H=1, HV=2, K=V=128, two tokens): tells which CUDA entries are implemented.
  const Shape s{"probe", 1, 2, 128, 128};
  const int64_t slot = int64_t(s.HV) * s.K * s.V;
  Device d;
  const Context ctx = d.ctx();
  DeviceTokens tok(s, DType::kBFloat16, 2, 5, d.stream);
  DevBuf pool(size_t(2 * slot * 4)), other(size_t(2 * slot * 4)), inter(size_t(2 * slot * 4)), ints(64);
  fill(pool.get(), DType::kFloat32, 2 * slot, 9, Fill::kNormal, 0.f, 0.05f, d.stream);
  const int32_t host_ints[8] = {1, 0, 1, 0, 2, 0, 0, 0};  // slot, islot, accepted, cu_seqlens {0, 2}, flag
  upload(ints.get(), host_ints, sizeof host_ints, d.stream);
  int32_t* di = ints.get<int32_t>();
  std::string out;
  auto attempt = [&](const char* name, auto&& call) {
    std::string st = "ok";
    try {
      call();
      BENCH_CUDA_CHECK(cudaStreamSynchronize(d.stream));
    } catch (const Error& e) {
      st = e.code() == ErrorCode::kNotImplemented ? "not implemented" : std::string("error (") + e.what() + ")";
    }
    out += std::string(out.empty() ? "" : ", ") + name + " " + st;
  };
  CommitParams p;
  p.heads = head_config(s);
  p.batch = 1;
  p.num_draft_tokens = 2;
  set_token_views(s, DType::kBFloat16, tok.views, 0, p.q, p.k, p.v, p.o, p.gating);
  p.state = make_pool(s, pool.get(), DType::kFloat32, StateLayout::kKLast, 2);
  p.state_indices = di;
  p.error_flag = di + 7;
  p.intermediate = {inter.get(), DType::kFloat32, StateLayout::kKLast, 1, 2, 2 * slot};
  p.intermediate_indices = di + 1;
  p.accepted = di + 2;
  attempt("decode", [&] { decode(static_cast<const DecodeParams&>(p), ctx); });
  attempt("verify", [&] { verify(static_cast<const VerifyParams&>(p), ctx); });
  attempt("commit", [&] { commit(p, ctx); });
  PrefillParams pf;
  pf.heads = head_config(s);
  pf.num_seqs = 1;
  pf.total_tokens = 2;
  set_token_views(s, DType::kBFloat16, tok.views, 0, pf.q, pf.k, pf.v, pf.o, pf.gating);
  pf.cu_seqlens = di + 3;
  pf.state = p.state;
  pf.initial_indices = di;
  pf.final_indices = di;
  attempt("prefill", [&] { prefill(pf, ctx); });
  LayoutParams lp;
  lp.num_v_heads = s.HV;
  lp.head_dim_k = s.K;
  lp.head_dim_v = s.V;
  lp.src = p.state;
  lp.dst = make_pool(s, other.get(), DType::kFloat32, StateLayout::kVLast, 2);
  attempt("convert_layout", [&] { convert_layout(lp, ctx); });
  return out;
}

std::string cuda_device_summary() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return "no CUDA device\n";
  }
  std::string s;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    char buf[512];
    std::snprintf(buf, sizeof buf, "  %d: %s, sm_%d%d, %d SMs, %.1f GiB, L2 %d MiB, smem/block opt-in %zu KiB\n", i,
                  prop.name, prop.major, prop.minor, prop.multiProcessorCount, double(prop.totalGlobalMem) / (1 << 30),
                  prop.l2CacheSize >> 20, prop.sharedMemPerBlockOptin >> 10);
    s += buf;
  }
  const std::string clocks = nvidia_smi("clocks.sm,clocks.max.sm,clocks.mem");
  if (!clocks.empty()) s += "  device 0 clocks (SM, max SM, memory; MHz): " + clocks + "\n";
  return s;
}

void run_cuda(const Options& o_in, RunInfo& info, const RowSink& sink) {
  Options o = o_in;
  if (o.gpus.empty()) {  // 1, 2, 4, ... up to the machine's GPUs
    int devices = 1;
    BENCH_CUDA_CHECK(cudaGetDeviceCount(&devices));
    for (int g = 1; g <= devices; g *= 2) o.gpus.push_back(g);
  }
  g_input = o.input;
  g_qk_l2norm = o.qk_l2norm;
  Arena::limit() = size_t(o.device_memory_gib) << 30;
  cuda::Overrides overrides = cuda::overrides();
  if (o.cp_segment >= 0) overrides.prefill_cp_segment_len = int(o.cp_segment);
  if (o.cp_first_final >= 0) overrides.prefill_cp_first_final = o.cp_first_final;
  if (o.cp_scan_cols > 0) overrides.prefill_cp_scan_cols = o.cp_scan_cols;
  if (o.fp8_columns > 0) overrides.decode_fp8_columns = o.fp8_columns;
  overrides.state_prefetch = o.prefetch;
  if (o.vlast_fp8_columns > 0) overrides.decode_vlast_fp8_columns = o.vlast_fp8_columns;
  if (o.chain_min_tokens >= 0) overrides.chain_mma_min_tokens = o.chain_min_tokens;
  if (o.prep_warpgroup >= 0) overrides.prefill_m_warpgroup = o.prep_warpgroup;
  if (o.chunk_flags >= 0) overrides.prefill_chunk_flags = o.chunk_flags;
  if (o.persistent_pass >= 0) overrides.prefill_persistent = o.persistent_pass;
  if (o.longest_first >= 0) overrides.prefill_longest_first = o.longest_first;
  if (o.prep_parts > 0) overrides.prefill_prep_parts = o.prep_parts;
  if (o.short_max_len >= 0) overrides.prefill_short_max_len = o.short_max_len;
  if (o.prefill_vtile > 0) overrides.prefill_vtile = o.prefill_vtile;
  if (o.solo_min_batch >= 0) overrides.decode_solo_min_batch = o.solo_min_batch;
  if (o.wide_max_batch >= 0) overrides.decode_wide_max_batch = o.wide_max_batch;
  if (o.narrow_max_batch >= 0) overrides.decode_narrow_max_batch = o.narrow_max_batch;
  if (o.fp8_chain >= 0) overrides.verify_fp8_chain_min_batch = o.fp8_chain;
  if (o.fp8_chain_mma >= 0) overrides.verify_fp8_chain_mma = o.fp8_chain_mma != 0;
  if (o.vlast_chain >= 0) overrides.verify_vlast_chain_min_batch = o.vlast_chain;
  overrides.prefill_stages = o.prefill_stages;
  const cuda::ScopedOverrides scoped(overrides);  // the A/B switches of this run
  Device d;
  int dev = 0;
  BENCH_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  BENCH_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  info.backend = "cuda";
  info.device = prop.name;
  info.sms = prop.multiProcessorCount;
  info.l2_bytes = prop.l2CacheSize;
  info.memory_bytes = int64_t(prop.totalGlobalMem);
  d.l2_bytes = prop.l2CacheSize;
  info.copy_ceiling_gib = 1.0;
  info.copy_ceiling_tbps = copy_ceiling_tbps(d, info.copy_ceiling_gib);
  // Sampled right after GPU work: an idle GPU reports its idle clock, which says nothing about the run.
  info.sm_clock_start = nvidia_smi("clocks.sm");
  info.sm_clock_max = nvidia_smi("clocks.max.sm");
  std::fprintf(stderr, "copy ceiling: %.3f TB/s (device-to-device copy of 1 GiB, read + write)\n",
               info.copy_ceiling_tbps);
  // qwen3-next's decode grid at B = 1: 32 value heads x 8 CTAs (K-last: 2 warps of 8 columns each).
  info.launch_floor_ctas = 256;
  info.launch_floor_us = launch_floor_us(d, info.launch_floor_ctas, 64);
  std::fprintf(stderr, "launch floor: %.2f µs per call (empty kernel, %d CTAs, PDL, CUDA graph)\n",
               info.launch_floor_us, info.launch_floor_ctas);
  const double ceiling = info.copy_ceiling_tbps;

  std::vector<Job> jobs;
  for (const std::string& op : o.ops) {
    for (const Shape& s : shapes_for(o, op)) {
      for (DType st : states_for(o, op)) {
        for (StateLayout ly : layouts_for(o, op)) {
          if (op == "decode") {
            for (int32_t B : batches_for(o, op)) {
              Row fb = base_row(op, s, st, ly);
              fb.batch = B;
              jobs.push_back({fb, [=, &d, &o] { return bench_decode(d, o, s, st, ly, B); }});
            }
          } else if (op == "verify") {
            for (VerifyMode m : verify_modes()) {
              for (int32_t T : drafts_for(o)) {
                for (int32_t B : batches_for(o, op)) {
                  Row fb = base_row(op, s, st, ly);
                  fb.mode = verify_mode_name(m);
                  fb.batch = B;
                  fb.draft_tokens = T;
                  jobs.push_back({fb, [=, &d, &o] { return bench_verify(d, o, s, st, ly, m, T, B); }});
                }
              }
            }
          } else if (op == "prefill-split") {
            for (const SeqSet& set : seqsets_for(o, op)) {
              // the single-GPU prefill first: the others' efficiency is against its time in this run
              auto one_gpu = std::make_shared<double>(-1.0);
              for (int G : o.gpus) {
                Row fb = base_row(op, s, st, ly);
                fb.seqset = set.name;
                fb.total_tokens = set.total();
                fb.num_seqs = int32_t(set.lengths.size());
                fb.ranks = G;
                fb.mode = std::to_string(G) + (G == 1 ? " GPU" : " GPUs");
                jobs.push_back({fb, [=, &d, &o]() -> Row {
                  if (G == 1) {
                    Row r = bench_prefill(d, o, s, st, ly, set);
                    r.op = "prefill-split";
                    r.mode = "1 GPU (" + (r.mode.empty() ? std::string("chunked") : r.mode) + ")";
                    r.ranks = 1;
                    *one_gpu = r.status == "ok" ? r.time_us : -1.0;
                    if (*one_gpu > 0) r.efficiency = 1.0;
                    return r;
                  }
#ifdef GDNKIT_WITH_NCCL
                  return bench_prefill_split(o, s, st, ly, set, G, *one_gpu);
#else
                  Row r = fb;
                  r.status = "not implemented";
                  r.message = "gdnkit was built without NCCL (GDNKIT_NCCL)";
                  return r;
#endif
                }});
              }
            }
          } else {
            for (const SeqSet& set : seqsets_for(o, op)) {
              Row fb = base_row(op, s, st, ly);
              fb.seqset = set.name;
              fb.total_tokens = set.total();
              fb.num_seqs = int32_t(set.lengths.size());
              jobs.push_back({fb, [=, &d, &o] { return bench_prefill(d, o, s, st, ly, set); }});
            }
          }
        }
      }
    }
  }
  sink.plan(jobs.size());
  for (size_t i = 0; i < jobs.size(); ++i) {
    guarded(jobs[i].fallback, sink, ceiling, jobs[i].measure);
    // After each op's rows, while the GPU is still clocked up.
    if (i + 1 == jobs.size() || jobs[i + 1].fallback.op != jobs[i].fallback.op)
      info.sm_clock_end = nvidia_smi("clocks.sm");
  }
}

}  // namespace gdnkit::bench
