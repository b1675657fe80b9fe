// GPU decode vs the CPU reference on the same random problems, over the spec's axes: layout x state
// dtype x input dtype x gating x q/k L2 norm (qwen3-next heads, 128 dims), GVA shapes and dims 64/256,
// strided views and padded slots; padding rows, out-of-range slots, CUDA-graph replay, determinism
// and pool offsets past 2^31 elements. Every output starts NaN-poisoned, untouched slots must stay
// bit-identical.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "support/compare.h"
#include "gdnkit/host_dtype.h"
#include "support/problem.h"
#include "gdnkit/gdnkit.h"
#include "gpu/gpu_harness.h"
#include "cuda/host/overrides.h"
#include "cuda/recurrent/heuristics.h"

namespace gdnkit::test {
namespace {

std::string short_name(DType d) {
  switch (d) {
    case DType::kFloat32: return "f32";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat16: return "f16";
    case DType::kFloat8E4M3: return "f8";
    default: return "x";
  }
}

std::string case_name(const ProblemConfig& c) {
  std::string s = std::string(c.layout == StateLayout::kKLast ? "klast" : "vlast") + "_s" + short_name(c.state_dtype) +
                  "_in" + short_name(c.in_dtype) + (c.gate_mode == GateMode::kFused ? "_fused" : "_given") +
                  (c.use_qk_l2norm ? "_l2" : "_nol2") + "_h" + std::to_string(c.H) + "x" + std::to_string(c.HV) +
                  "_d" + std::to_string(c.K);
  if (c.V != c.K) s += "_v" + std::to_string(c.V);
  if (c.token_pad || c.head_pad) s += "_strided";
  if (c.slot_pad) s += "_slotpad";
  if (c.long_memory) s += "_longmem";
  return s;
}

struct Named {
  std::string name;
  ProblemConfig cfg;
};

std::vector<Named> decode_cases() {
  std::vector<Named> out;
  int i = 0;
  for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast})
    for (DType state : {DType::kFloat32, DType::kBFloat16, DType::kFloat16})
      for (DType in : {DType::kBFloat16, DType::kFloat16, DType::kFloat32})
        for (GateMode gate : {GateMode::kFused, GateMode::kGiven})
          for (bool l2 : {true, false}) {
            ProblemConfig c;
            c.op = OpKind::kDecode;
            c.batch = 6;
            c.padding_rows = 1;
            c.H = 16, c.HV = 32, c.K = 128, c.V = 128;
            c.layout = layout, c.state_dtype = state, c.in_dtype = in, c.gate_mode = gate, c.use_qk_l2norm = l2;
            c.gate_dtype = (i % 2) ? DType::kBFloat16 : DType::kFloat32;
            if (i % 3 == 1) c.token_pad = 24, c.head_pad = 8;  // views of a fused projection
            if (i % 3 == 2) c.slot_pad = 40;                   // strided pool (16-byte multiple)
            c.seed = 100 + i++;
            out.push_back({case_name(c), c});
          }
  // GVA H=2, HV=8 with the other head dims; long-memory decay on some.
  for (int d : {64, 256})
    for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast})
      for (DType state : {DType::kFloat32, DType::kBFloat16}) {
        ProblemConfig c;
        c.op = OpKind::kDecode;
        c.batch = 5;
        c.padding_rows = 1;
        c.H = 2, c.HV = 8, c.K = d, c.V = d;
        c.layout = layout, c.state_dtype = state;
        c.long_memory = state == DType::kFloat32;
        c.token_pad = 8, c.slot_pad = 16;
        c.seed = 200 + i++;
        out.push_back({case_name(c), c});
      }
  // float8_e4m3 pools against the CPU backend's e4m3 stores: K-last (fp8_decode.cuh) and V-last (vlast_decode.cuh:
  // a scale block over two lanes; at these small grids the 64-column CTAs, 2 or 4 per head; the 128-column CTAs in
  // DecodeForcedKernels.VLastFp8PiecesMatchCpuReference).
  const auto fp8_cases = [&](StateLayout layout, int K, int V, int H, int HV, int seed0, std::vector<DType> inputs) {
    for (DType in : inputs) {
      ProblemConfig c;
      c.op = OpKind::kDecode;
      c.batch = 7;
      c.padding_rows = 1;
      c.H = H, c.HV = HV, c.K = K, c.V = V;
      c.layout = layout, c.state_dtype = DType::kFloat8E4M3, c.in_dtype = in;
      c.gate_mode = in == DType::kFloat32 ? GateMode::kGiven : GateMode::kFused;
      c.slot_pad = 32;
      c.seed = seed0 + i++;
      out.push_back({case_name(c), c});
    }
  };
  const std::vector<DType> all_inputs = {DType::kBFloat16, DType::kFloat32, DType::kFloat16};
  for (int d : {64, 128, 256})
    fp8_cases(StateLayout::kKLast, d, d, d == 128 ? 16 : 2, d == 128 ? 32 : 8, 300, all_inputs);
  for (int d : {64, 128}) fp8_cases(StateLayout::kVLast, d, 128, 4, 8, 320, all_inputs);
  for (int d : {64, 128}) fp8_cases(StateLayout::kVLast, d, 256, 4, 8, 340, {DType::kBFloat16});
  return out;
}

// Small batches with qwen3-next heads, where the launcher's prefetch mode depends on the grid's size
// (recurrent/launch.cuh): B = 1..4 for both state dtypes against the reference (bf16 state with bf16 inputs: the
// tensor-core kernel, recurrent/mma_decode.cuh; with fp32 inputs the regular tile at B = 1, the wide tile from B = 2,
// recurrent/warp_kernel.cuh).
std::vector<Named> small_batch_cases() {
  std::vector<Named> out;
  int i = 0;
  for (int batch : {1, 2, 3, 4})
    for (DType state : {DType::kFloat32, DType::kBFloat16})
      for (DType in : {DType::kBFloat16, DType::kFloat32}) {
        ProblemConfig c;
        c.op = OpKind::kDecode;
        c.batch = batch;
        c.padding_rows = batch >= 3 || (batch == 2 && state == DType::kBFloat16) ? 1 : 0;  // the wide tile's ends
        c.H = 16, c.HV = 32, c.K = 128, c.V = 128;
        c.state_dtype = state, c.in_dtype = in;
        if (i % 2 == 1) c.token_pad = 24, c.head_pad = 8, c.slot_pad = 40;
        c.seed = 400 + i++;
        out.push_back({case_name(c) + "_b" + std::to_string(batch), c});
      }
  // fp16 state on the tensor-core kernel: fp16 inputs as loaded, bf16 inputs on its tf32 steps (mma_decode.cuh).
  for (int batch : {1, 2, 4})
    for (DType in : {DType::kBFloat16, DType::kFloat16}) {
      ProblemConfig c;
      c.op = OpKind::kDecode;
      c.batch = batch, c.padding_rows = batch >= 2 ? 1 : 0;
      c.H = 16, c.HV = 32, c.K = 128, c.V = 128;
      c.state_dtype = DType::kFloat16, c.in_dtype = in;
      c.seed = 400 + i++;
      out.push_back({case_name(c) + "_b" + std::to_string(batch), c});
    }
  return out;
}

// Batches around the launcher's switches (recurrent/warp_kernel.cuh): bf16-state K-last decode (bf16 inputs) at
// B = 5 and 6 runs the tensor-core kernel (mma_decode.cuh: grids of at most half the GPU), at B = 7 and 12 the wide
// tile (16 columns per warp, the state as bf16 pairs), at B = 13 and 16 the narrow tile (4 columns per warp), B = 17
// and fp32 state the regular one; padding rows.
std::vector<Named> batch_cases() {
  std::vector<Named> out;
  int i = 0;
  for (int batch : {5, 6, 7, 12, 13, 16, 17})
    for (DType state : {DType::kFloat32, DType::kBFloat16}) {
      ProblemConfig c;
      c.op = OpKind::kDecode;
      c.batch = batch;
      c.padding_rows = (batch + 7) / 8;
      c.H = 16, c.HV = 32, c.K = 128, c.V = 128;
      c.state_dtype = state;
      if (i % 2 == 1) c.token_pad = 24, c.head_pad = 8, c.slot_pad = 40;
      c.seed = 500 + i++;
      out.push_back({case_name(c) + "_b" + std::to_string(batch), c});
    }
  return out;
}

// Small cases for compute-sanitizer (memcheck, racecheck): every layout / state dtype, padding rows.
std::vector<Named> sanitize_cases() {
  std::vector<Named> out;
  int i = 0;
  for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast})
    for (DType state : {DType::kFloat32, DType::kBFloat16}) {
      ProblemConfig c;
      c.op = OpKind::kDecode;
      c.batch = 3, c.padding_rows = 1;
      c.H = 1, c.HV = 2, c.K = 64, c.V = 64;
      c.layout = layout, c.state_dtype = state, c.token_pad = 8;
      c.seed = 300 + i++;
      out.push_back({case_name(c), c});
    }
  // qwen3-next heads at B = 1 and 2 (prefetch mode at both state dtypes or one, launch.cuh), and bf16 state at
  // B = 4 (the tensor-core kernel, mma_decode.cuh) and 8 (the wide tile, warp_tile.cuh).
  for (int batch : {1, 2, 4, 8}) {
    ProblemConfig c;
    c.op = OpKind::kDecode;
    c.batch = batch;
    if (batch >= 4) c.state_dtype = DType::kBFloat16, c.padding_rows = 1;
    c.H = 16, c.HV = 32, c.K = 128, c.V = 128;
    c.seed = 300 + i++;
    out.push_back({case_name(c) + "_b" + std::to_string(batch), c});
  }
  return out;
}

// Runs decode on the CPU (ref) and the GPU (got) from identical copies of `before`, compares.
void check_decode(const Problem& before) {
  Problem ref = before, got = before;
  DeviceProblem dev(got);
  cuda::recurrent::last_recurrent_launch() = {};  // a call that launched nothing leaves no earlier record
  decode(ref.decode_params(), {Backend::kCPU, nullptr});
  decode(got.decode_params(dev.resolver()), {Backend::kCUDA, dev.stream()});
  dev.download(got);
  check_decode_results(before, got, ref);
}

class DecodeTest : public ::testing::TestWithParam<Named> {};

TEST_P(DecodeTest, MatchesCpuReference) { check_decode(Problem(GetParam().cfg)); }

INSTANTIATE_TEST_SUITE_P(Axes, DecodeTest, ::testing::ValuesIn(decode_cases()),
                         [](const auto& info) { return info.param.name; });
INSTANTIATE_TEST_SUITE_P(SmallBatch, DecodeTest, ::testing::ValuesIn(small_batch_cases()),
                         [](const auto& info) { return info.param.name; });
INSTANTIATE_TEST_SUITE_P(Batches, DecodeTest, ::testing::ValuesIn(batch_cases()),
                         [](const auto& info) { return info.param.name; });
INSTANTIATE_TEST_SUITE_P(Sanitize, DecodeTest, ::testing::ValuesIn(sanitize_cases()),
                         [](const auto& info) { return info.param.name; });

// fp16 pools with bf16 q and k far past fp16's range (x 2^20) or far below its normal range (x 2^-20), on both forms
// of the tensor-core kernel (mma_decode.cuh): its tf32 steps take them as they are; its fp16 steps (the override
// decode_mma_tf32 off) scale them by a power of two of their norm before rounding them to fp16 (without it they would
// round to infinity, or to fp16's subnormals and zero). Larger batches run the warp kernel.
TEST(DecodeGpu, Fp16PoolBf16InputsPastFp16Range) {
  int seed = 450;
  for (bool tf32 : {true, false})
  for (int scale : {20, -20})
  for (int K : {64, 128})
    for (int batch : {1, 4, 12}) {
      SCOPED_TRACE(std::string(tf32 ? "tf32" : "fp16") + " K=" + std::to_string(K) + " B=" + std::to_string(batch) +
                   " x 2^" + std::to_string(scale));
      cuda::Overrides o;
      o.decode_mma_tf32 = tf32;
      const cuda::ScopedOverrides scoped(o);
      ProblemConfig c;
      c.op = OpKind::kDecode;
      c.batch = batch, c.padding_rows = batch >= 2 ? 1 : 0;
      c.H = 16, c.HV = 32, c.K = K, c.V = K;
      c.state_dtype = DType::kFloat16, c.in_dtype = DType::kBFloat16;
      c.seed = seed++;
      Problem p(c);
      for (const char* name : {"q", "k"}) {
        Buffer& b = p.buffer(name);
        const int64_t n = int64_t(b.bytes.size()) / dtype_size(c.in_dtype);
        for (int64_t i = 0; i < n; ++i)
          host::store(b.bytes.data(), c.in_dtype, i, std::ldexp(host::load(b.bytes.data(), c.in_dtype, i), scale));
      }
      check_decode(p);
    }
}

ProblemConfig qwen_decode(StateLayout layout, DType state, int batch = 8) {
  ProblemConfig c;
  c.op = OpKind::kDecode;
  c.batch = batch, c.padding_rows = 1;
  c.H = 16, c.HV = 32, c.K = 128, c.V = 128;
  c.layout = layout, c.state_dtype = state;
  return c;
}

// Every K-last decode kernel the heuristics can pick, forced through the overrides at batches where the heuristics
// would pick another (recurrent/heuristics.h): each must match the reference wherever it is launched.
struct Forced {
  std::string name;
  cuda::Overrides o;
};
std::vector<Forced> forced_kernels() {
  cuda::Overrides tiles;  // no tensor-core decode: the heuristic's tiles (bf16: wide, narrow, one-warp CTAs)
  tiles.decode_mma = false;
  cuda::Overrides narrow = tiles;  // the narrow tile from 3 sequences (no prefetch mode, so none for the regular tile)
  narrow.decode_wide_max_batch = 0;
  narrow.decode_narrow_max_batch = 1 << 20;
  narrow.decode_solo_min_batch = 0;
  narrow.state_prefetch = false;
  cuda::Overrides regular = narrow;  // the regular tile, and for fp32 state no pinned slot (no prefetch mode)
  regular.decode_narrow_max_batch = 0;
  regular.decode_solo_min_batch = 0;
  regular.state_prefetch = false;
  cuda::Overrides solo = regular;  // one-warp CTAs at every batch: the regular tile (fp32), the wide tile (bf16)
  solo.decode_solo_min_batch = 1;
  cuda::Overrides wide = tiles;  // the wide tile up to 14 sequences (its prefetch-mode limit)
  wide.decode_wide_max_batch = 1 << 20;
  return {{"tiles", tiles}, {"narrow", narrow}, {"regular", regular}, {"solo", solo}, {"wide", wide}};
}

// What a forced set must have launched (recurrent::last_recurrent_launch), so that an override the launcher stopped
// honouring fails here rather than testing the default kernel again.
void expect_forced_launch(const std::string& name, DType state, int batch) {
  namespace rc = cuda::recurrent;
  const rc::RecurrentLaunch& got = rc::last_recurrent_launch();
  const std::string k = got.kernel;
  const auto is = [&](rc::RecurrentKernel kernel) { return k == rc::kernel_name(kernel); };
  SCOPED_TRACE("launched " + k);
  const bool bf16 = state == DType::kBFloat16;
  EXPECT_FALSE(is(rc::RecurrentKernel::kMmaDecode));  // every set turns the tensor-core decode off
  if (is(rc::RecurrentKernel::kWarpWide)) EXPECT_TRUE(got.prefetch);  // the wide tile runs in prefetch mode only
  if (name == "regular") EXPECT_TRUE(is(rc::RecurrentKernel::kWarpRegular) && !got.prefetch);
  if (name == "solo") EXPECT_TRUE(is(rc::RecurrentKernel::kWarpSolo));
  if (name == "wide" && bf16 && batch >= 2 && batch <= 14) EXPECT_TRUE(is(rc::RecurrentKernel::kWarpWide));
  if (name == "narrow") {  // bf16: the narrow tile from 3 sequences; below, and fp32, the regular tile; no prefetch
    EXPECT_TRUE(is(bf16 && batch >= 3 ? rc::RecurrentKernel::kWarpNarrow : rc::RecurrentKernel::kWarpRegular));
    EXPECT_FALSE(got.prefetch);
  }
  if (name == "tiles" && bf16) {  // the heuristic at HV = 32: the wide tile up to B = 12, one-warp CTAs from B = 13
    if (batch == 3 || batch == 8) EXPECT_TRUE(is(rc::RecurrentKernel::kWarpWide));
    if (batch >= 14) EXPECT_TRUE(is(rc::RecurrentKernel::kWarpSolo));
  }
}

TEST(DecodeForcedKernels, MatchCpuReference) {
  int seed = 700;
  for (const Forced& f : forced_kernels())
    for (int batch : {1, 3, 8, 14, 33})
      for (DType state : {DType::kFloat32, DType::kBFloat16}) {
        SCOPED_TRACE(f.name + " B=" + std::to_string(batch) + (state == DType::kFloat32 ? " fp32" : " bf16"));
        ProblemConfig c = qwen_decode(StateLayout::kKLast, state, batch);
        c.in_dtype = DType::kBFloat16;
        c.padding_rows = batch > 1 ? 1 : 0;
        c.seed = seed++;
        const cuda::ScopedOverrides scoped(f.o);
        check_decode(Problem(c));
        expect_forced_launch(f.name, state, batch);
      }
}


// V-last float8_e4m3 decode in both CTA pieces (heuristics.cpp vlast_fp8_decode_columns: 64 columns where the grid is
// small, 128 else), each forced at every batch here, with and without prefetch mode.
TEST(DecodeForcedKernels, VLastFp8PiecesMatchCpuReference) {
  struct Piece {
    const char* name;
    int columns;
    bool prefetch;
  };
  int seed = 760, prefetched = 0;
  for (const Piece& piece : {Piece{"64 columns", 64, true}, Piece{"128 columns", 128, true},
                             Piece{"64 columns, no prefetch", 64, false},
                             Piece{"128 columns, no prefetch", 128, false}})
    for (int K : {64, 128})
      for (int V : {128, 256})
        for (int batch : {1, 9, 40}) {
          SCOPED_TRACE(std::string(piece.name) + " K=" + std::to_string(K) + " V=" + std::to_string(V) +
                       " B=" + std::to_string(batch));
          ProblemConfig c = qwen_decode(StateLayout::kVLast, DType::kFloat8E4M3, batch);
          c.H = 4, c.HV = 8, c.K = K, c.V = V;
          c.in_dtype = batch == 9 ? DType::kFloat16 : DType::kBFloat16;
          c.padding_rows = batch > 1 ? 1 : 0;
          c.slot_pad = batch == 40 ? 32 : 0;
          c.seed = seed++;
          cuda::Overrides o;
          o.decode_vlast_fp8_columns = piece.columns;
          o.state_prefetch = piece.prefetch;
          const cuda::ScopedOverrides scoped(o);
          check_decode(Problem(c));
          const cuda::recurrent::RecurrentLaunch& got = cuda::recurrent::last_recurrent_launch();
          EXPECT_EQ(std::string(got.kernel), cuda::recurrent::kernel_name(cuda::recurrent::RecurrentKernel::kVLastDecode));
          EXPECT_EQ(got.columns, piece.columns);
          if (!piece.prefetch) EXPECT_FALSE(got.prefetch);
          prefetched += got.prefetch ? 1 : 0;
        }
  EXPECT_GT(prefetched, 0) << "no piece ran in prefetch mode";
}

// Slots >= P are skipped on the device: o = 0, counted in error_flag, no state I/O. Small heads (a grid in
// prefetch mode) and qwen3-next heads at B = 16 (a grid too large for it: the state is asked of L2 only
// after the index is read, recurrent/launch.cuh) with both state dtypes. (It checks the loads and stores of
// that path; an L2 prefetch outside the pool neither faults nor shows in memcheck on the H100.) float8_e4m3 pools
// on their own kernels, both layouts; B = 40 for V-last fp8's line CTAs outside prefetch mode (B = 16 fits it).
TEST(DecodeGpu, OutOfRangeSlotsSkippedAndCountedSanitize) {
  // small fp32 B = 4, qwen3-next fp32 B = 16, bf16 B = 16, bf16 B = 4 (K-last: the wide tile, prefetch mode), fp8
  // B = 16, B = 4 and B = 40
  static const char* const kWhich[] = {"small heads, B = 4, fp32", "qwen3-next, B = 16, fp32",
                                       "qwen3-next, B = 16, bf16", "qwen3-next, B = 4, bf16",
                                       "qwen3-next, B = 16, fp8",  "qwen3-next, B = 4, fp8",
                                       "qwen3-next, B = 40, fp8"};
  for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast})
    for (int which = 0; which < 7; ++which) {
      const DType state = which >= 4 ? DType::kFloat8E4M3 : which >= 2 ? DType::kBFloat16 : DType::kFloat32;
      const int batch = which == 6 ? 40 : which == 1 || which == 2 || which == 4 ? 16 : 4;
      ProblemConfig c = qwen_decode(layout, state, batch);
      if (which == 0) c.H = 2, c.HV = 4, c.K = 64, c.V = 64;
      SCOPED_TRACE(kWhich[which]);
      Problem p(c);
      // Two rows past the pool, neither of them the padding row (which stays padding).
      int32_t* slots = p.as<int32_t>("state_indices");
      std::vector<int32_t> placed_rows;
      for (int32_t r = 0; r < p.rows(); ++r)
        if (slots[r] >= 0) placed_rows.push_back(r);
      ASSERT_GE(placed_rows.size(), 3u);
      slots[placed_rows[0]] = int32_t(p.num_slots());
      slots[placed_rows[1]] = int32_t(p.num_slots()) + 1000;
      check_decode(p);
      Problem got = p;
      DeviceProblem dev(got);
      decode(got.decode_params(dev.resolver()), {Backend::kCUDA, dev.stream()});
      dev.download(got);
      EXPECT_EQ(got.as<int32_t>("error_flag")[0], 2);
    }
}

// Same inputs twice, and a CUDA-graph capture replayed once: all bit-identical to one eager run. B = 16, and B = 4
// (prefetch mode; bf16 K-last: the wide tile).
TEST(DecodeGpu, GraphReplayAndRepeatBitwiseEqualEager) {
  for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast})
    for (DType state : {DType::kFloat32, DType::kBFloat16})
    for (int batch : {16, 4}) {
      SCOPED_TRACE("B = " + std::to_string(batch));
      const Problem before(qwen_decode(layout, state, batch));
      Problem eager = before, again = before, graphed = before;
      DeviceProblem d_eager(eager), d_again(again), d_graph(graphed);
      decode(eager.decode_params(d_eager.resolver()), {Backend::kCUDA, d_eager.stream()});
      decode(again.decode_params(d_again.resolver()), {Backend::kCUDA, d_again.stream()});
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      GDNKIT_TEST_CUDA(cudaStreamBeginCapture(d_graph.stream(), cudaStreamCaptureModeGlobal));
      decode(graphed.decode_params(d_graph.resolver()), {Backend::kCUDA, d_graph.stream()});
      GDNKIT_TEST_CUDA(cudaStreamEndCapture(d_graph.stream(), &graph));
      GDNKIT_TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
      GDNKIT_TEST_CUDA(cudaGraphLaunch(exec, d_graph.stream()));
      d_eager.download(eager);
      d_again.download(again);
      d_graph.download(graphed);
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      for (const char* name : {"o", "state", "error_flag"}) {
        EXPECT_TRUE(BitwiseEqual(std::string(name) + " (repeat)", again.buffer(name), eager.buffer(name)));
        EXPECT_TRUE(BitwiseEqual(std::string(name) + " (graph)", graphed.buffer(name), eager.buffer(name)));
      }
      // and the eager run is right
      Problem ref = before;
      decode(ref.decode_params(), {Backend::kCPU, nullptr});
      check_decode_results(before, eager, ref);
    }
}

// A bf16 pool whose touched slots start past 2^31 elements: slots 2 (and 3) of slot_stride 2^30 + 64 elements
// (4.3 / 6.4 GB of device memory). Only those slots hold data; the result must match the reference computed
// on a small pool. B = 1 (regular tile) and 2 (K-last: the wide tile).
TEST(DecodeGpu, PoolOffsetsPast2Pow31Elements) {
  for (int batch : {1, 2})
  for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast}) {
    SCOPED_TRACE("B = " + std::to_string(batch));
    ProblemConfig c = qwen_decode(layout, DType::kBFloat16, batch);
    c.padding_rows = 0, c.pool_slots = batch;
    c.H = 2, c.HV = 8;
    const Problem before(c);
    Problem ref = before, got = before;
    decode(ref.decode_params(), {Backend::kCPU, nullptr});

    const int64_t big_stride = (int64_t(1) << 30) + 64, big_slot = 2, elems = before.state_elems();
    const int64_t stride = before.slot_stride();
    ASSERT_GT(big_slot * big_stride, int64_t(1) << 31);
    void* big = nullptr;
    const size_t bytes = size_t((big_slot + batch - 1) * big_stride + elems) * 2;
    if (cudaMalloc(&big, bytes) != cudaSuccess) {
      cudaGetLastError();
      GTEST_SKIP() << "cannot allocate " << bytes << " bytes";
    }
    GDNKIT_TEST_CUDA(cudaMemset(big, 0xff, bytes));  // NaN bf16: where a truncated offset would write shows
    DeviceProblem dev(got);
    // problem slot s -> big slot big_slot + s
    uint16_t* slot_data = static_cast<uint16_t*>(big) + big_slot * big_stride;
    for (int s = 0; s < batch; ++s)
      GDNKIT_TEST_CUDA(cudaMemcpy(slot_data + s * big_stride, before.buffer("state").bytes.data() + s * stride * 2,
                                  size_t(elems) * 2, cudaMemcpyHostToDevice));
    for (int s = 0; s < batch; ++s) got.as<int32_t>("state_indices")[s] += int32_t(big_slot);
    dev.upload(got, "state_indices");
    DecodeParams p = got.decode_params(dev.resolver());
    p.state.data = big;
    p.state.num_slots = big_slot + batch;
    p.state.slot_stride = big_stride;
    decode(p, {Backend::kCUDA, dev.stream()});
    dev.download(got);
    for (int s = 0; s < batch; ++s)
      GDNKIT_TEST_CUDA(cudaMemcpy(got.buffer("state").bytes.data() + s * stride * 2, slot_data + s * big_stride,
                                  size_t(elems) * 2, cudaMemcpyDeviceToHost));
    // An offset wrapped at 2^31 elements lands at the buffer's start; the bytes just below slot 2 are its neighbours':
    // both still 0xff.
    std::vector<uint8_t> probe(size_t(64) << 20);
    for (const uint8_t* at : {static_cast<const uint8_t*>(big),
                              reinterpret_cast<const uint8_t*>(slot_data) - probe.size()}) {
      GDNKIT_TEST_CUDA(cudaMemcpy(probe.data(), at, probe.size(), cudaMemcpyDeviceToHost));
      EXPECT_TRUE(std::all_of(probe.begin(), probe.end(), [](uint8_t x) { return x == 0xff; }))
          << "written outside the slots at byte " << (at - static_cast<const uint8_t*>(big));
    }
    cudaFree(big);
    EXPECT_EQ(got.as<int32_t>("error_flag")[0], 0);
    EXPECT_TRUE(OutputsClose(got, ref, output_tolerance(OpFamily::kStep, c.in_dtype)));
    std::vector<int64_t> all(batch);
    for (int s = 0; s < batch; ++s) all[size_t(s)] = s;
    EXPECT_TRUE(SlotsClose(got, ref, all, state_tolerance(OpFamily::kStep, c.state_dtype)));
  }
}

}  // namespace
}  // namespace gdnkit::test
