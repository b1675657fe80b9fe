// Graph and stream soak: decode, verify + commit and a varlen prefill with checkpoints, captured once in CUDA
// graphs on two streams and replayed thousands of times, the slot, cache and padding indices and the accepted
// counts rewritten before every replay. An eager run of the same calls with the same indices runs beside it on
// two streams of its own; at every check the pools, outputs, caches and error flags of both are bit-identical
// (a graph that captured a stale pointer or host value, or state that drifts between replays, shows up here).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "support/compare.h"
#include "support/problem.h"
#include "gdnkit/gdnkit.h"
#include "gpu/gpu_harness.h"

namespace gdnkit::test {
namespace {

// GDNKIT_SOAK_REPLAYS (read by this test only) shortens the run under the sanitizers (tools/sanitize.sh).
int replay_count() {
  const char* v = std::getenv("GDNKIT_SOAK_REPLAYS");
  const int n = v != nullptr ? std::atoi(v) : 0;
  return n > 0 ? n : 3000;
}

// The index buffers a replay rewrites: name and int32 count per replay.
struct IndexSet {
  std::string name;
  size_t count = 0;
};

// Pinned host copies of every replay's indices, so the copies before each replay need no host sync.
class IndexPlan {
 public:
  IndexPlan(std::vector<IndexSet> sets, int replays) : sets_(std::move(sets)), replays_(replays) {
    for (const IndexSet& s : sets_) per_replay_ += s.count;
    if (cudaMallocHost(&host_, per_replay_ * replays_ * sizeof(int32_t)) != cudaSuccess) host_ = nullptr;
  }
  ~IndexPlan() { cudaFreeHost(host_); }
  IndexPlan(const IndexPlan&) = delete;
  IndexPlan& operator=(const IndexPlan&) = delete;
  bool ok() const { return host_ != nullptr; }
  int32_t* at(int replay, const std::string& name) {
    size_t off = per_replay_ * replay;
    for (const IndexSet& s : sets_) {
      if (s.name == name) return host_ + off;
      off += s.count;
    }
    return nullptr;
  }
  // Enqueues replay r's indices into the device buffers of `dev` on `stream`.
  cudaError_t upload(int r, const DeviceProblem& dev, cudaStream_t stream) {
    for (const IndexSet& s : sets_) {
      const cudaError_t err = cudaMemcpyAsync(dev.device(s.name), at(r, s.name), s.count * sizeof(int32_t),
                                              cudaMemcpyHostToDevice, stream);
      if (err != cudaSuccess) return err;
    }
    return cudaSuccess;
  }
  // Replay r's indices into host's buffers, as the device holds them after that replay's upload.
  void copy_to(int r, Problem& host) {
    for (const IndexSet& s : sets_)
      std::memcpy(host.buffer(s.name).bytes.data(), at(r, s.name), s.count * sizeof(int32_t));
  }
  const std::vector<IndexSet>& sets() const { return sets_; }

 private:
  std::vector<IndexSet> sets_;
  int replays_ = 0;
  size_t per_replay_ = 0;
  int32_t* host_ = nullptr;
};

// The first n of a random permutation of [0, range).
void draw_distinct(std::mt19937_64& gen, int32_t range, int32_t* out, size_t n) {
  std::vector<int32_t> perm(range);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), gen);
  std::copy_n(perm.begin(), n, out);
}

// The calls of one replay; `ws` is the prefill workspace (nullptr: the library's own).
struct Calls {
  Problem* dec;
  Problem* ver;
  Problem* pre;
  const DeviceProblem* d_dec;
  const DeviceProblem* d_ver;
  const DeviceProblem* d_pre;
  void* ws = nullptr;
  size_t ws_bytes = 0;

  void step(cudaStream_t s) const {
    decode(dec->decode_params(d_dec->resolver()), {Backend::kCUDA, s});
    verify(ver->verify_params(d_ver->resolver()), {Backend::kCUDA, s});
    commit(ver->commit_params(CommitSource::kCache, d_ver->resolver()), {Backend::kCUDA, s});
  }
  void prefill_call(cudaStream_t s) const {
    PrefillParams p = pre->prefill_params(PrefillAlgorithm::kAuto, d_pre->resolver());
    p.workspace = ws, p.workspace_bytes = ws_bytes;
    prefill(p, {Backend::kCUDA, s});
  }
};

struct Streams {
  cudaStream_t step = nullptr, pre = nullptr;
  Streams() {
    cudaStreamCreateWithFlags(&step, cudaStreamNonBlocking);
    cudaStreamCreateWithFlags(&pre, cudaStreamNonBlocking);
  }
  ~Streams() {
    cudaStreamDestroy(step);
    cudaStreamDestroy(pre);
  }
};

struct Graph {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ~Graph() {
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
  }
};

TEST(SoakGpu, GraphReplaysOnTwoStreamsEqualEagerWithNewIndicesEachReplay) {
  ProblemConfig dc;
  dc.op = OpKind::kDecode, dc.batch = 24, dc.H = 2, dc.HV = 8, dc.K = dc.V = 128, dc.pool_slots = 64, dc.seed = 91;
  ProblemConfig vc = dc;
  vc.op = OpKind::kVerify, vc.batch = 6, vc.draft_tokens = 4, vc.pool_slots = 32, vc.seed = 92;
  vc.state_dtype = DType::kBFloat16, vc.layout = StateLayout::kVLast, vc.cache_dtype = DType::kBFloat16;
  ProblemConfig pc = dc;
  pc.op = OpKind::kPrefill, pc.seq_lens = {1, 70, 300, 0, 33}, pc.pool_slots = 16, pc.same_slot = true;
  pc.checkpoint_interval = 64, pc.pass_cu_seqlens_host = false, pc.seed = 93;

  Problem dec0(dc), ver0(vc), pre0(pc);
  // Every pool slot holds a finite state, so any permutation of slots reads defined data.
  dec0.fill_every_slot(1), ver0.fill_every_slot(2), pre0.fill_every_slot(3);
  Problem dec_g = dec0, ver_g = ver0, pre_g = pre0, dec_e = dec0, ver_e = ver0, pre_e = pre0;
  DeviceProblem ddg(dec_g), dvg(ver_g), dpg(pre_g), dde(dec_e), dve(ver_e), dpe(pre_e);

  const int replays = replay_count(), check_every = std::max(1, replays / 6);
  const int32_t B = dc.batch, VB = vc.batch, T = vc.draft_tokens, N = int32_t(pc.seq_lens.size());
  IndexPlan dec_idx({{"state_indices", size_t(B)}}, replays);
  IndexPlan ver_idx({{"state_indices", size_t(VB)}, {"intermediate_indices", size_t(VB)}, {"accepted", size_t(VB)}},
                    replays);
  IndexPlan pre_idx({{"initial_indices", size_t(N)}, {"final_indices", size_t(N)}, {"checkpoint_indices", size_t(N)}},
                    replays);
  ASSERT_TRUE(dec_idx.ok() && ver_idx.ok() && pre_idx.ok());
  std::mt19937_64 gen(2024);
  for (int r = 0; r < replays; ++r) {
    int32_t* di = dec_idx.at(r, "state_indices");
    draw_distinct(gen, int32_t(dec0.num_slots()), di, B);
    for (int i = 0; i < 3; ++i) di[gen() % B] = -1;  // padding rows move between replays
    draw_distinct(gen, int32_t(ver0.num_slots()), ver_idx.at(r, "state_indices"), VB);
    ver_idx.at(r, "state_indices")[gen() % VB] = -1;
    draw_distinct(gen, int32_t(ver0.cache_slots()), ver_idx.at(r, "intermediate_indices"), VB);
    for (int b = 0; b < VB; ++b) ver_idx.at(r, "accepted")[b] = int32_t(gen() % (T + 1));
    int32_t* ini = pre_idx.at(r, "initial_indices");
    draw_distinct(gen, int32_t(pre0.num_slots()), ini, N);
    std::memcpy(pre_idx.at(r, "final_indices"), ini, N * sizeof(int32_t));  // the prefill resumes its own slot
    pre_idx.at(r, "initial_indices")[gen() % N] = -1;                        // one sequence starts from zero
    draw_distinct(gen, int32_t(pre0.cache_slots()), pre_idx.at(r, "checkpoint_indices"), N);
  }

  Streams graph_streams, eager_streams;
  size_t ws_bytes = prefill_workspace_bytes(pre_g.prefill_params(PrefillAlgorithm::kAuto, dpg.resolver()));
  void* ws = nullptr;
  if (ws_bytes) GDNKIT_TEST_CUDA(cudaMalloc(&ws, ws_bytes));
  const Calls graphed{&dec_g, &ver_g, &pre_g, &ddg, &dvg, &dpg, ws, ws_bytes};
  const Calls eager{&dec_e, &ver_e, &pre_e, &dde, &dve, &dpe, nullptr, 0};

  // One eager prefill first: the library's workspace exists before any capture.
  GDNKIT_TEST_CUDA(pre_idx.upload(0, dpe, eager_streams.pre));
  eager.prefill_call(eager_streams.pre);
  GDNKIT_TEST_CUDA(cudaDeviceSynchronize());
  dpe.upload(pre0, "state");
  dpe.upload(pre0, "checkpoints");

  Graph step_graph, pre_graph;
  GDNKIT_TEST_CUDA(cudaStreamBeginCapture(graph_streams.step, cudaStreamCaptureModeThreadLocal));
  graphed.step(graph_streams.step);
  GDNKIT_TEST_CUDA(cudaStreamEndCapture(graph_streams.step, &step_graph.graph));
  GDNKIT_TEST_CUDA(cudaGraphInstantiate(&step_graph.exec, step_graph.graph, 0));
  GDNKIT_TEST_CUDA(cudaStreamBeginCapture(graph_streams.pre, cudaStreamCaptureModeThreadLocal));
  graphed.prefill_call(graph_streams.pre);
  GDNKIT_TEST_CUDA(cudaStreamEndCapture(graph_streams.pre, &pre_graph.graph));
  GDNKIT_TEST_CUDA(cudaGraphInstantiate(&pre_graph.exec, pre_graph.graph, 0));

  int checks = 0;
  for (int r = 0; r < replays; ++r) {
    GDNKIT_TEST_CUDA(dec_idx.upload(r, ddg, graph_streams.step));
    GDNKIT_TEST_CUDA(ver_idx.upload(r, dvg, graph_streams.step));
    GDNKIT_TEST_CUDA(cudaGraphLaunch(step_graph.exec, graph_streams.step));
    GDNKIT_TEST_CUDA(pre_idx.upload(r, dpg, graph_streams.pre));
    GDNKIT_TEST_CUDA(cudaGraphLaunch(pre_graph.exec, graph_streams.pre));

    GDNKIT_TEST_CUDA(dec_idx.upload(r, dde, eager_streams.step));
    GDNKIT_TEST_CUDA(ver_idx.upload(r, dve, eager_streams.step));
    eager.step(eager_streams.step);
    GDNKIT_TEST_CUDA(pre_idx.upload(r, dpe, eager_streams.pre));
    eager.prefill_call(eager_streams.pre);

    if ((r + 1) % check_every != 0 && r + 1 != replays) continue;
    GDNKIT_TEST_CUDA(cudaDeviceSynchronize());
    const std::string at = " after replay " + std::to_string(r + 1);
    for (auto [got, d_got, want, d_want, plan] :
         {std::tuple{&dec_g, &ddg, &dec_e, &dde, &dec_idx}, std::tuple{&ver_g, &dvg, &ver_e, &dve, &ver_idx},
          std::tuple{&pre_g, &dpg, &pre_e, &dpe, &pre_idx}}) {
      plan->copy_to(r, *got);  // the inputs download() expects on the device
      plan->copy_to(r, *want);
      d_got->download(*got);
      d_want->download(*want);
      for (const char* name : {"o", "state", "intermediate", "checkpoints", "error_flag"})
        if (got->has(name)) {
          ASSERT_TRUE(BitwiseEqual(name + at, got->buffer(name), want->buffer(name)));
        }
      ASSERT_EQ(got->as<int32_t>("error_flag")[0], 0) << at;
    }
    ++checks;
  }
  EXPECT_EQ(checks, (replays + check_every - 1) / check_every);
  // The soak ran on live data: the last replay's outputs are finite where a row has a slot.
  const int32_t* last = dec_idx.at(replays - 1, "state_indices");
  const std::vector<double> o = dec_g.read_tokens("o");
  const size_t per_row = o.size() / B;
  for (int32_t b = 0; b < B; ++b) {
    if (last[b] < 0) continue;
    for (size_t i = 0; i < per_row; ++i) ASSERT_TRUE(std::isfinite(o[b * per_row + i])) << "decode row " << b;
  }
  if (ws) cudaFree(ws);
}

}  // namespace
}  // namespace gdnkit::test
