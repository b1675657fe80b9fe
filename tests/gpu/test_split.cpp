// Prefill split over ranks (split_prefill_begin / _end) on the CUDA backend against the fp64 recurrence of the whole
// prefill: ranks simulated on one GPU (each with its own pool, checkpoints, error flag and workspace; the exchange one
// buffer every rank writes its block of, as an in-place all-gather leaves it), cuts inside and between sequences,
// pieces shorter than a chunk, empty ranks, checkpoints on every rank, pieces cut into segments, layouts and pool
// dtypes, graph replay and bitwise repeat; then over NCCL on every GPU of the machine (one thread per rank).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cpu/backend.h"
#include "cuda/host/overrides.h"
#include "gdnkit/gdnkit.h"
#include "gpu/gpu_harness.h"
#include "support/compare.h"
#include "support/problem.h"
#include "support/split_ranks.h"
#ifdef GDNKIT_WITH_NCCL
#include "gdnkit/nccl.h"
#endif

namespace gdnkit::test {
namespace {

struct DeviceMemory {
  void* ptr = nullptr;
  explicit DeviceMemory(size_t bytes) {
    if (cudaMalloc(&ptr, bytes > 0 ? bytes : 1) != cudaSuccess) ptr = nullptr;
  }
  ~DeviceMemory() { cudaFree(ptr); }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
};

// All-ones bytes (fp32 NaN), finished before any stream's later work (the legacy stream's fill, then a sync).
void poison(void* ptr, size_t bytes) {
  if (ptr == nullptr) return;
  cudaMemset(ptr, 0xff, bytes);
  cudaDeviceSynchronize();
}

// Device copies of one rank's own buffers (SplitRanks::buffers), and its workspace.
class RankMirror {
 public:
  explicit RankMirror(std::vector<Buffer>& host) : host_(host) {
    for (Buffer& b : host_) {
      mem_.push_back(std::make_unique<DeviceMemory>(b.bytes.size()));
      cudaMemcpy(mem_.back()->ptr, b.bytes.data(), b.bytes.size(), cudaMemcpyHostToDevice);
    }
  }
  RankPointers pointers() const {
    RankPointers at;
    for (size_t i = 0; i < host_.size(); ++i) {
      void* d = mem_[i]->ptr;
      const std::string& n = host_[i].name;
      if (n == "cu_seqlens") at.cu_seqlens = static_cast<const int32_t*>(d);
      if (n == "piece_offsets") at.piece_offsets = static_cast<const int64_t*>(d);
      if (n == "error_flag") at.error_flag = static_cast<int32_t*>(d);
      if (n == "state") at.state = d;
      if (n == "state_scales") at.state_scales = static_cast<uint8_t*>(d);
      if (n == "checkpoints") at.checkpoints = d;
      if (n == "checkpoints_scales") at.checkpoint_scales = static_cast<uint8_t*>(d);
    }
    return at;
  }
  // The host buffers again, finished before any stream's later work.
  void upload() {
    for (size_t i = 0; i < host_.size(); ++i)
      cudaMemcpy(mem_[i]->ptr, host_[i].bytes.data(), host_[i].bytes.size(), cudaMemcpyHostToDevice);
    cudaDeviceSynchronize();
  }
  // The outputs back; the inputs (cu_seqlens, piece_offsets), which the calls only read, expected as uploaded.
  void download() {
    for (size_t i = 0; i < host_.size(); ++i) {
      Buffer now{host_[i].name, std::vector<std::byte>(host_[i].bytes.size()), false};
      cudaMemcpy(now.bytes.data(), mem_[i]->ptr, now.bytes.size(), cudaMemcpyDeviceToHost);
      if (host_[i].is_output)
        host_[i].bytes = std::move(now.bytes);
      else
        EXPECT_TRUE(BitwiseEqual("rank input " + host_[i].name + " after the calls (read only)", now, host_[i]));
    }
  }
  // NaN-filled when allocated, so that a scan reading a transition or local state no pass wrote fails the test.
  void* workspace(size_t bytes) {
    if (bytes > ws_bytes_) {
      ws_ = std::make_unique<DeviceMemory>(bytes), ws_bytes_ = bytes;
      poison(ws_->ptr, bytes);
    }
    return ws_ ? ws_->ptr : nullptr;
  }
  size_t workspace_bytes() const { return ws_bytes_; }

 private:
  std::vector<Buffer>& host_;
  std::vector<std::unique_ptr<DeviceMemory>> mem_;
  std::unique_ptr<DeviceMemory> ws_;
  size_t ws_bytes_ = 0;
};

// Every rank's begin, then every rank's end, on one stream.
struct SimulatedRanks {
  SplitRanks ranks;
  std::vector<std::unique_ptr<RankMirror>> mirrors;
  std::unique_ptr<DeviceMemory> exchange;
  SimulatedRanks(Problem& got, const std::vector<int64_t>& cuts, const PrefillParams& full) : ranks(got, cuts) {
    for (int r = 0; r < ranks.ranks(); ++r) mirrors.push_back(std::make_unique<RankMirror>(ranks.buffers(r)));
    exchange = std::make_unique<DeviceMemory>(size_t(ranks.exchange_elems(full)) * 4);
    poison(exchange->ptr, size_t(ranks.exchange_elems(full)) * 4);  // each summary read must have been written
  }
  std::vector<SplitPrefillParams> params(const PrefillParams& full, bool every_rank) {
    std::vector<SplitPrefillParams> out;
    for (int r = 0; r < ranks.ranks(); ++r) {
      SplitPrefillParams sp = ranks.params(full, r, mirrors[size_t(r)]->pointers(),
                                           static_cast<float*>(exchange->ptr), every_rank);
      const size_t need = split_prefill_workspace_bytes(sp);
      sp.local.workspace = mirrors[size_t(r)]->workspace(need);
      sp.local.workspace_bytes = need;
      out.push_back(sp);
    }
    return out;
  }
  static void run(const std::vector<SplitPrefillParams>& ps, cudaStream_t stream) {
    for (const auto& sp : ps) split_prefill_begin(sp, {Backend::kCUDA, stream});
    for (const auto& sp : ps) split_prefill_end(sp, {Backend::kCUDA, stream});
  }
  // Every rank's pool past rank 0 NaN, on the host and the device (initial states are read from rank 0's alone).
  void poison_pools_past_rank0() {
    ranks.poison_pools_past_rank0();
    for (auto& m : mirrors) m->upload();
  }
  void download() {
    for (auto& m : mirrors) m->download();
  }
};

ProblemConfig split_config(std::vector<int32_t> lens, int K, uint64_t seed) {
  ProblemConfig c;
  c.op = OpKind::kPrefill;
  c.seq_lens = std::move(lens);
  c.H = 2, c.HV = 4, c.K = K, c.V = K;
  c.in_dtype = DType::kBFloat16;
  c.seed = seed;
  return c;
}

// The split run on the GPU against the fp64 recurrence of the whole prefill, with the pool of every rank that stores
// final states; every other rank's pool bit-identical to what it was, every pool past rank 0 NaN before the run.
void run_case(const ProblemConfig& cfg, const std::vector<int64_t>& cuts, bool every_rank,
              int64_t segment_len = -1, int scan_cols = 0) {
  cuda::Overrides o;
  o.prefill_cp_segment_len = int(segment_len);
  o.prefill_cp_scan_cols = scan_cols;
  cuda::ScopedOverrides scoped(o);
  const Problem before(cfg);
  Problem ref = before, got = before;
  cpu::prefill_recurrent(ref.prefill_params());
  DeviceProblem dev(got);
  const PrefillParams full = got.prefill_params(PrefillAlgorithm::kAuto, dev.resolver());
  SimulatedRanks sim(got, cuts, full);
  sim.poison_pools_past_rank0();
  SimulatedRanks::run(sim.params(full, every_rank), dev.stream());
  dev.download(got);
  sim.download();
  sim.ranks.check_pools(before, got, ref, every_rank, check_prefill_results);
}

TEST(SplitPrefillGpu, RanksAndCuts) {
  // 4 sequences packed as [0, 2000) [2000, 2300) [2300, 2300) [2300, 3500)
  const std::vector<int32_t> lens = {2000, 300, 0, 1200};
  const std::vector<std::vector<int64_t>> cuts = {
      {0, 3500},                          // one rank
      {0, 1000, 3500},                    // two: inside the first sequence
      {0, 700, 2000, 2040, 3500},         // four: a 40-token piece (less than a chunk) on a middle rank
      {0, 0, 1999, 2301, 3500, 3500},     // empty first and last ranks, a one-token piece
  };
  for (int K : {128, 64})
    for (const auto& c : cuts) {
      const int scan_cols = c.size() % 2 == 0 ? 32 : 8;  // both scans (the compose and fold roles)
      SCOPED_TRACE("K=" + std::to_string(K) + " ranks " + std::to_string(c.size() - 1) + " scan columns " +
                   std::to_string(scan_cols));
      run_case(split_config(lens, K, 100 + c.size()), c, false, -1, scan_cols);
    }
}

TEST(SplitPrefillGpu, LayoutsPoolDtypesAndGates) {
  struct Case {
    StateLayout layout;
    DType state, in;
    GateMode gates;
  };
  for (const Case& k : {Case{StateLayout::kKLast, DType::kBFloat16, DType::kBFloat16, GateMode::kFused},
                        Case{StateLayout::kVLast, DType::kFloat32, DType::kFloat16, GateMode::kGiven},
                        Case{StateLayout::kVLast, DType::kFloat16, DType::kBFloat16, GateMode::kFused},
                        Case{StateLayout::kKLast, DType::kFloat8E4M3, DType::kBFloat16, GateMode::kFused}}) {
    ProblemConfig c = split_config({1500, 700}, 128, 7 + int(k.state));
    c.layout = k.layout, c.state_dtype = k.state, c.in_dtype = k.in, c.gate_mode = k.gates;
    c.same_slot = k.state == DType::kFloat32;
    for (int scan_cols : {8, 32}) {
      SCOPED_TRACE(std::string(layout_name(k.layout)) + " pool " + dtype_name(k.state) + " scan columns " +
                   std::to_string(scan_cols));
      run_case(c, {0, 900, 1800, 2200}, k.state == DType::kBFloat16, -1, scan_cols);
    }
  }
}

TEST(SplitPrefillGpu, CheckpointsOnEveryRankAndSegments) {
  // Pieces start on chunk boundaries (offsets 1024 and 2112 into the first sequence), checkpoints every 512 tokens
  // fall on every rank; segments of 256 tokens put checkpoints inside segments.
  ProblemConfig c = split_config({5000, 900}, 128, 21);
  c.checkpoint_interval = 512;
  c.cache_dtype = DType::kBFloat16;
  for (int64_t seg : {int64_t(-1), int64_t(256), int64_t(0)}) {
    SCOPED_TRACE("segments " + std::to_string(seg));
    run_case(c, {0, 1024, 2112, 5900}, true, seg);
  }
}

// A V-last float8_e4m3 pool and checkpoints: the final pass stores the checkpoints in place, the last rank's fold its
// final states (a 32-column block a CTA's 8 lanes: the scan on 32 columns a CTA), beside the library's segments and
// segments of 256 tokens.
TEST(SplitPrefillGpu, VLastFp8PoolAndCheckpoints) {
  ProblemConfig c = split_config({5000, 900}, 128, 23);
  c.layout = StateLayout::kVLast, c.state_dtype = DType::kFloat8E4M3;
  c.checkpoint_interval = 512, c.cache_dtype = DType::kFloat8E4M3;
  for (int64_t seg : {int64_t(-1), int64_t(256)}) {
    SCOPED_TRACE("segments " + std::to_string(seg));
    run_case(c, {0, 1024, 2112, 5900}, true, seg);
  }
  ProblemConfig k64 = split_config({1500, 700}, 64, 24);
  k64.layout = StateLayout::kVLast, k64.state_dtype = DType::kFloat8E4M3, k64.same_slot = true;
  run_case(k64, {0, 900, 1800, 2200}, false);
}

TEST(SplitPrefillGpu, LongSequenceTwoRanks) {
  // One 20000-token sequence split in two, the library's segments, checkpoints every 4096 crossing them.
  ProblemConfig c = split_config({20000}, 128, 31);
  c.H = 1, c.HV = 2;
  c.checkpoint_interval = 4096;
  run_case(c, {0, 12288, 20000}, false);
}

TEST(SplitPrefillGpu, BadSlotOnARankWithoutTokens) {
  // The last rank holds no tokens but stores the final states: its bad final slot is counted there, once (no final
  // pass runs on it), as the CPU backend counts it. Rank 0 runs both sequences whole, so the result is the whole
  // prefill in which sequence 1 stores no final state (o does not depend on it), with the one error more.
  ProblemConfig c = split_config({1200, 300}, 128, 71);
  Problem before(c);
  before.as<int32_t>("final_indices")[1] = int32_t(before.num_slots()) + 3;
  Problem ref = before, got = before;
  ref.as<int32_t>("final_indices")[1] = -1;
  cpu::prefill_recurrent(ref.prefill_params());
  ref.as<int32_t>("error_flag")[0] += 1;
  DeviceProblem dev(got);
  const PrefillParams full = got.prefill_params(PrefillAlgorithm::kAuto, dev.resolver());
  SimulatedRanks sim(got, {0, 1500, 1500}, full);
  sim.poison_pools_past_rank0();
  SimulatedRanks::run(sim.params(full, false), dev.stream());
  dev.download(got);
  sim.download();
  EXPECT_EQ(*sim.ranks.buffer(1, "error_flag").as<int32_t>(), 1);
  EXPECT_EQ(*sim.ranks.buffer(0, "error_flag").as<int32_t>(), 0);
  const int64_t row = int64_t(c.HV) * c.V;
  const double tol = output_tolerance(OpFamily::kPrefill, c.in_dtype);
  const std::vector<double> o = got.read_tokens("o"), o_ref = ref.read_tokens("o");
  EXPECT_TRUE(RelClose("o of sequence 0", token_rows(o, row, 0, 1200), token_rows(o_ref, row, 0, 1200), tol));
  EXPECT_TRUE(RelClose("o of sequence 1, run on rank 0", token_rows(o, row, 1200, 1500),
                       token_rows(o_ref, row, 1200, 1500), tol));
  // sequence 0's final slot on the last rank, every other slot untouched, rank 0's pool unwritten, the flags summed
  sim.ranks.check_pools(before, got, ref, false, check_prefill_results);
}

TEST(SplitPrefillGpu, GraphReplayAndRepeatBitwiseEqualEager) {
  ProblemConfig c = split_config({3000, 500}, 128, 41);
  c.checkpoint_interval = 1024;
  const Problem before(c);
  const std::vector<int64_t> cuts = {0, 1024, 3500};
  std::vector<Problem> got(3, before);
  std::vector<std::unique_ptr<DeviceProblem>> dev;
  std::vector<std::unique_ptr<SimulatedRanks>> sim;
  for (int i = 0; i < 3; ++i) {
    dev.push_back(std::make_unique<DeviceProblem>(got[size_t(i)]));
    const PrefillParams full = got[size_t(i)].prefill_params(PrefillAlgorithm::kAuto, dev.back()->resolver());
    sim.push_back(std::make_unique<SimulatedRanks>(got[size_t(i)], cuts, full));
    sim.back()->poison_pools_past_rank0();
    const auto ps = sim.back()->params(full, false);
    if (i < 2) {  // eager, twice
      SimulatedRanks::run(ps, dev.back()->stream());
      continue;
    }
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    GDNKIT_TEST_CUDA(cudaStreamBeginCapture(dev.back()->stream(), cudaStreamCaptureModeGlobal));
    SimulatedRanks::run(ps, dev.back()->stream());
    GDNKIT_TEST_CUDA(cudaStreamEndCapture(dev.back()->stream(), &graph));
    GDNKIT_TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    GDNKIT_TEST_CUDA(cudaGraphLaunch(exec, dev.back()->stream()));
    GDNKIT_TEST_CUDA(cudaStreamSynchronize(dev.back()->stream()));
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  for (int i = 0; i < 3; ++i) {
    dev[size_t(i)]->download(got[size_t(i)]);
    sim[size_t(i)]->download();
    EXPECT_TRUE(sim[size_t(i)]->ranks.collect(got[size_t(i)], 1, false));
  }
  for (const char* name : {"o", "state", "checkpoints"}) {
    EXPECT_TRUE(BitwiseEqual(std::string(name) + " (repeat)", got[1].buffer(name), got[0].buffer(name)));
    EXPECT_TRUE(BitwiseEqual(std::string(name) + " (graph)", got[2].buffer(name), got[0].buffer(name)));
  }
  // and the eager run is right: the fp64 recurrence of the whole prefill, the last rank's pool untouched elsewhere
  Problem ref = before;
  cpu::prefill_recurrent(ref.prefill_params());
  check_prefill_results(sim[0]->ranks.with_pool_before(before, 1), got[0], ref);
}

TEST(SplitPrefillGpu, UnsupportedCallsAreRefused) {
  ProblemConfig c = split_config({300}, 128, 51);
  c.in_dtype = DType::kFloat32;
  Problem p(c);
  DeviceProblem dev(p);
  const PrefillParams full = p.prefill_params(PrefillAlgorithm::kAuto, dev.resolver());
  SimulatedRanks sim(p, {0, 100, 300}, full);
  const auto ps = sim.params(full, false);
  const Problem before = p;
  const auto ranks_before = sim.ranks.snapshot();
  for (const bool begin : {true, false}) {
    try {
      if (begin)
        split_prefill_begin(ps[0], {Backend::kCUDA, dev.stream()});
      else
        split_prefill_end(ps[0], {Backend::kCUDA, dev.stream()});
      ADD_FAILURE() << "expected kNotImplemented";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kNotImplemented);
      EXPECT_NE(std::string(e.what()).find("bf16 or fp16 q, k, v and o"), std::string::npos) << e.what();
    }
  }
  // nothing written: o, every rank's pool, checkpoints and flag, the NaN-filled exchange
  dev.download(p);
  sim.download();
  for (const char* name : {"o", "state", "error_flag"})
    EXPECT_TRUE(BitwiseEqual(name, p.buffer(name), before.buffer(name)));
  EXPECT_TRUE(sim.ranks.unchanged_since(ranks_before));
  std::vector<uint8_t> exchange(size_t(sim.ranks.exchange_elems(full)) * 4);
  GDNKIT_TEST_CUDA(cudaMemcpy(exchange.data(), sim.exchange->ptr, exchange.size(), cudaMemcpyDeviceToHost));
  EXPECT_TRUE(std::all_of(exchange.begin(), exchange.end(), [](uint8_t x) { return x == 0xff; })) << "exchange written";
}

#ifdef GDNKIT_WITH_NCCL
// One thread per GPU, each rank's buffers on its own device: the NCCL entry against the fp64 recurrence.
TEST(SplitPrefillNccl, EveryGpuOfTheMachine) {
  int devices = 0;
  GDNKIT_TEST_CUDA(cudaGetDeviceCount(&devices));
  if (devices < 2) GTEST_SKIP() << "needs 2 or more GPUs (found " << devices << ")";
  for (int G : {2, 4}) {
    if (G > devices) continue;
    SCOPED_TRACE(std::to_string(G) + " ranks");
    ProblemConfig c = split_config({6000, 100}, 128, 60 + G);
    c.checkpoint_interval = 1024;
    const Problem before(c);
    Problem ref = before;
    cpu::prefill_recurrent(ref.prefill_params());
    std::vector<int64_t> cuts = {0};
    for (int r = 1; r < G; ++r) cuts.push_back(r == G - 1 ? 5990 : 2048 * r);  // the last rank: 10 + 100 tokens
    cuts.push_back(6100);
    std::vector<ncclComm_t> comms(static_cast<size_t>(G));
    std::vector<int> ids(static_cast<size_t>(G));
    for (int r = 0; r < G; ++r) ids[size_t(r)] = r;
    ASSERT_EQ(ncclCommInitAll(comms.data(), G, ids.data()), ncclSuccess);
    std::vector<Problem> got(static_cast<size_t>(G), before);  // rank r's copy of the whole problem (its rows of o)
    SplitRanks ranks(before, cuts);
    std::vector<std::string> errors(static_cast<size_t>(G));
    std::vector<std::thread> threads;
    for (int r = 0; r < G; ++r)
      threads.emplace_back([&, r] {
        cudaSetDevice(r);
        DeviceProblem dev(got[size_t(r)]);
        RankMirror mine(ranks.buffers(r));
        const PrefillParams full = got[size_t(r)].prefill_params(PrefillAlgorithm::kAuto, dev.resolver());
        DeviceMemory exchange(size_t(ranks.exchange_elems(full)) * 4);
        SplitPrefillParams sp = ranks.params(full, r, mine.pointers(), static_cast<float*>(exchange.ptr), true);
        try {
          split_prefill_nccl(sp, comms[size_t(r)], {Backend::kCUDA, dev.stream()});
        } catch (const std::exception& e) {
          errors[size_t(r)] = e.what();
        }
        dev.download(got[size_t(r)]);
        mine.download();
      });
    for (auto& t : threads) t.join();
    for (ncclComm_t comm : comms) ncclCommDestroy(comm);
    cudaSetDevice(0);
    for (int r = 0; r < G; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      ASSERT_EQ(errors[size_t(r)], "");
      // each rank's o rows from its own copy
      Problem collected = before;
      std::vector<std::byte>& o = collected.buffer("o").bytes;
      const size_t row = o.size() / size_t(before.total_tokens());
      for (int q = 0; q < G; ++q)
        std::copy(got[size_t(q)].buffer("o").bytes.begin() + ptrdiff_t(row * size_t(cuts[size_t(q)])),
                  got[size_t(q)].buffer("o").bytes.begin() + ptrdiff_t(row * size_t(cuts[size_t(q) + 1])),
                  o.begin() + ptrdiff_t(row * size_t(cuts[size_t(q)])));
      EXPECT_TRUE(ranks.collect(collected, r, true));
      check_prefill_results(before, collected, ref);
    }
  }
}
#endif

}  // namespace
}  // namespace gdnkit::test
