// gdnkit bench: shared pieces of the CPU and CUDA benchmark paths (method: docs/benchmarks.md).
//
// The bench calls only the public API (gdnkit::decode / verify / commit / prefill), so it measures
// whatever kernels the library ships, independent of their internals. A backend that does not
// implement an op yet (ErrorCode::kNotImplemented) yields a row that says so.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "gdnkit/gdnkit.h"

namespace gdnkit::bench {

// A model's per-layer GDN shape (docs/benchmarks.md "Shapes").
struct Shape {
  std::string name;
  int32_t H = 0;   // q/k heads
  int32_t HV = 0;  // value heads
  int32_t K = 128;
  int32_t V = 128;
};
const std::vector<Shape>& known_shapes();
const Shape* find_shape(const std::string& name);  // nullptr if unknown

// A prefill sequence set: "1x2048" (N sequences of L tokens), "1024+7168" (explicit lengths), or terms of both joined
// by '+' in order ("64x100+6144": 64 sequences of 100 tokens, then one of 6144).
struct SeqSet {
  std::string name;
  std::vector<int64_t> lengths;
  int64_t total() const;
};
SeqSet parse_seqset(const std::string& text);  // throws gdnkit::Error on bad text

enum class VerifyMode {
  kCache,          // verify writing fp32 intermediate states (update_state off)
  kCommitRecompute,  // verify without cache, then commit by recompute from the pool
  kCommitCache,    // verify with the fp32 cache, then commit from the cache
};
const char* verify_mode_name(VerifyMode mode);

struct Options {
  std::vector<std::string> ops;  // decode, verify, prefill (in this order)
  std::vector<Shape> shapes;     // empty: per-op default (decode/verify qwen3-next; prefill + qwen3.5-397b-tp8)
  std::vector<DType> states;     // empty: per-op default
  std::vector<StateLayout> layouts;  // empty: per-op default
  std::vector<int32_t> batches;  // empty: per-op default
  std::vector<int32_t> drafts;   // verify T; empty: default
  std::vector<SeqSet> seqsets;   // prefill; empty: default
  std::vector<int32_t> gpus;     // prefill-split: GPU counts; empty: 1, 2, 4, ... up to the machine's
  std::string json_path, markdown_path;
  DType input = DType::kBFloat16;  // q, k, v, a, b (and o)
  bool qk_l2norm = true;           // false: q and k taken as normalized (the ops' fused L2 norm off)
  int32_t dim = 0;               // > 0: K = V = dim in every shape (name gets "-d<dim>")
  bool quick = false;
  bool cpu = false;
  int replays = 20;              // decode/verify graph replays (>= 15)
  int prefill_iters = 12;        // prefill timed runs (>= 10)
  int64_t device_memory_gib = 0; // device memory the CUDA rows take (0: the free memory less 2 GiB)
  int64_t cp_segment = -1;       // A/B switch: prefill's context-parallel segments forced (0: off; -1: the heuristic)
  int cp_first_final = -1;       // A/B switch: a cut prompt's first segment with o beside the local pass (1) or not (0)
  int cp_scan_cols = 0;          // A/B switch: value columns per CTA of the context-parallel scan (0: the heuristic)
  int64_t checkpoint = 0;        // prefill: a checkpoint of every sequence's state every C tokens (0: none)
  int fp8_columns = 0;           // A/B switch: the fp8 decode kernel's columns per warp (0: the heuristic)
  bool prefetch = true;          // A/B switch: false keeps the recurrent kernels out of prefetch mode
  int vlast_fp8_columns = 0;     // A/B switch: V-last fp8 decode's columns per CTA (0: the heuristic)
  int chain_min_tokens = -1;     // A/B switch: fewest tokens on the tensor-core chain kernel (0: never; -1: the heuristic)
  int fp8_chain = -1;            // A/B switch: fp8 chain verify on the fp8 chain kernel from this batch (0: never)
  int fp8_chain_mma = -1;        // A/B switch: fp8 chain verify without a cache on tensor cores (1) or CUDA cores (0)
  int vlast_chain = -1;          // A/B switch: V-last chain verify on its chain kernel from N sequences (0: never)
  int solo_min_batch = -1;       // A/B switch: K-last decode in one-warp CTAs from this batch (0: never)
  int wide_max_batch = -1;       // A/B switch: 16-bit K-last decode on the wide tile up to this batch (0: never)
  int narrow_max_batch = -1;     // A/B switch: 16-bit K-last decode on the narrow tile up to this batch (0: never)
  int prep_warpgroup = -1;       // A/B switch: prefill's prep warpgroup (0 off, 1 M, 2 the whole prep)
  int chunk_flags = -1;          // A/B switch: prefill's pass waiting per chunk (0: for the chunk prep's grid)
  int persistent_pass = -1;      // A/B switch: prefill's prep-warpgroup pass persistent (1) or a CTA per item (0)
  int longest_first = -1;        // A/B switch: ... its sequences longest first (1) or in their order (0)
  int prep_parts = 0;            // A/B switch: chunk prep CTAs per (chunk slot, q/k head) (0: the heuristic)
  int short_max_len = -1;        // A/B switch: prefill's longest sequence on the recurrent kernels (0: none)
  int prefill_vtile = 0;         // A/B switch: prefill's tiled state pass with this value tile (0: the heuristic)
  int prefill_stages = 3;        // timing: prefill's kernels, 1 the prep alone, 2 the state pass alone, 3 both
  std::string command_line;
};

// The shapes with --dim applied.
std::vector<Shape> with_dim(const Options& o, std::vector<Shape> shapes);
// The sweep each op runs, after defaults and --quick are applied.
std::vector<Shape> shapes_for(const Options& o, const std::string& op);
std::vector<DType> states_for(const Options& o, const std::string& op);
std::vector<StateLayout> layouts_for(const Options& o, const std::string& op);
std::vector<int32_t> batches_for(const Options& o, const std::string& op);
std::vector<int32_t> drafts_for(const Options& o);
std::vector<SeqSet> seqsets_for(const Options& o, const std::string& op = "prefill");
std::vector<VerifyMode> verify_modes();

// One measured configuration. Fields that do not apply to the op stay at their defaults and are
// written as null in the JSON.
struct Row {
  std::string op;    // decode | verify | prefill
  std::string mode;  // verify: cache | commit-recompute | commit-cache; prefill on CPU: the algorithm
  std::string backend;
  Shape shape;
  DType input_dtype = DType::kBFloat16;
  DType state_dtype = DType::kFloat32;
  StateLayout layout = StateLayout::kKLast;
  int32_t batch = 0;            // decode/verify B
  int32_t draft_tokens = 0;     // verify T
  std::string seqset;           // prefill
  int32_t num_seqs = 0;         // prefill N
  int64_t total_tokens = 0;     // tokens processed per call
  double accepted_mean = -1;    // commit modes: mean accepted tokens per sequence
  std::string status = "ok";    // ok | not implemented | error
  std::string message;          // the library's message when status != ok

  // Timing. Decode/verify: per call (one call = one op, or verify + commit for the commit modes).
  double time_us = -1, time_us_min = -1, time_us_max = -1;
  int samples = 0;              // replays (decode/verify) or timed runs (prefill)
  int calls_per_replay = 0;
  int slot_sets = 0;            // cold L2: distinct slot sets the calls rotate through
  int64_t pool_slots = 0;
  double state_bytes_per_replay = -1;  // state bytes read by one replay (>= 4x L2 on the GPU)

  // Bytes model (docs/benchmarks.md): state read + written (+ intermediate written) + q, k, v, o, gates.
  double bytes = -1;
  double tbps = -1;             // achieved, bytes / time
  double pct_copy = -1;         // tbps / copy ceiling * 100
  // Prefill.
  double flops = -1, tflops = -1;   // nominal 4 * T_total * HV * K * V
  double floor_bytes = -1;      // q, k, v read once, o written once, gates, states
  double floor_us = -1;         // floor_bytes / copy ceiling
  double pct_floor = -1;        // floor_us / time_us * 100
  // Prefill split over GPUs (op prefill-split).
  int32_t ranks = 0;             // GPUs
  double efficiency = -1;        // time on 1 GPU / (ranks x time), the 1-GPU prefill of the same run
  double exchange_us = -1;       // the all-gather of the summaries
  int64_t checkpoint_interval = 0;  // prefill: tokens between the checkpoints it stores (0: none)
  // Sanity of the result the timing ran on.
  int64_t nonfinite_outputs = -1;  // o entries that are NaN/inf after the runs (o is NaN-poisoned first)
  int64_t error_flag = -1;         // the op's device error counter (out-of-range slots); must be 0
};

struct RunInfo {
  std::string command;        // the command line that produced the run
  std::string backend;        // cuda | cpu
  std::string device;         // GPU name or "host CPU"
  std::string build_info;
  std::string note;           // e.g. why the CPU path ran
  int sms = 0;
  int64_t l2_bytes = 0;
  int64_t memory_bytes = 0;
  std::string sm_clock_start, sm_clock_end, sm_clock_max;  // MHz as nvidia-smi reports; empty if unknown
  double copy_ceiling_tbps = -1;  // device-to-device copy, bytes read + written / time
  double copy_ceiling_gib = 0;
  // CUDA: µs per call of an empty kernel launched as decode is (programmatic dependent launch, the grid of
  // decode at B = 1 for the qwen3-next heads), timed like the decode rows: the per-call time no decode or
  // verify call goes below, whatever its bytes. -1 when not measured.
  double launch_floor_us = -1;
  int launch_floor_ctas = 0;
  double wall_seconds = 0;
};

// Receives rows as they are measured: prints progress and rewrites the output files, so that a run
// killed half way still leaves the rows it measured. A backend calls plan() once, with the number of rows
// it is going to measure, before the first row (the progress line's "row i/N" and its time estimate).
struct RowSink {
  std::function<void(size_t total)> plan;
  std::function<void(const Row&)> row;
  void operator()(const Row& r) const { row(r); }
};

// One configuration of a sweep: the row to report if measuring fails, and the measurement. Each backend
// lists its sweep as jobs first, so the number of rows is known before the first one runs.
struct Job {
  Row fallback;
  std::function<Row()> measure;
};

// "row 12/40, 0:35 elapsed, about 1:20 left" (no estimate before the first row finished).
std::string progress_prefix(size_t done, size_t total, double elapsed_seconds);

// Token-major inputs/outputs of one problem, contiguous: q, k [tokens, H, K], v, o [tokens, HV, V],
// a, b [tokens, HV] (all in the input dtype), A_log, dt_bias [HV] fp32. Host or device pointers.
struct TokenBuffers {
  void* q = nullptr;
  void* k = nullptr;
  void* v = nullptr;
  void* o = nullptr;
  void* a = nullptr;
  void* b = nullptr;
  float* A_log = nullptr;
  float* dt_bias = nullptr;
};
// q and k L2-normalized inside the op (Options::qk_l2norm; set by the backend's run from the options)
extern bool g_qk_l2norm;
// The op's heads: the shape's, the default scale, the q/k L2 norm as g_qk_l2norm says.
HeadConfig head_config(const Shape& s);
// The token rows [first_token, ...) of `t` as op inputs, fused gating.
void set_token_views(const Shape& s, DType in, const TokenBuffers& t, int64_t first_token, InView& q, InView& k,
                     InView& v, OutView& o, Gating& gating);
StatePool make_pool(const Shape& s, void* data, DType dtype, StateLayout layout, int64_t slots,
                    uint8_t* scales = nullptr);
// Bytes a state element moves: its dtype, and for float8_e4m3 its share of the block's scale byte.
double state_elem_bytes(DType state);
// The dtype of verify's intermediate cache in the bench: float8_e4m3 beside float8_e4m3 pools, float32 otherwise.
DType verify_cache_dtype(DType state);

// Byte and FLOP models (shared by both backends).
double decode_bytes(const Shape& s, int32_t B, DType in, DType state);
double verify_bytes(const Shape& s, int32_t B, int32_t T, DType in, DType state, VerifyMode mode,
                    int64_t accepted_total);
double prefill_floor_bytes(const Shape& s, const SeqSet& set, DType in, DType state);
// Checkpoint entries per sequence for a checkpoint every C tokens (the longest sequence's), and their bytes in all.
int64_t checkpoint_steps(const SeqSet& set, int64_t C);
double checkpoint_bytes(const Shape& s, const SeqSet& set, DType state, int64_t C);
// Checkpoint buffer of `slots` entries of `steps` states each, the pool's layout and dtype.
StateCache make_checkpoints(const Shape& s, void* data, DType dtype, StateLayout layout, int64_t slots, int64_t steps,
                            uint8_t* scales = nullptr);
double prefill_flops(const Shape& s, int64_t total_tokens);
// A row with the fields every op fills the same way.
Row make_row(const std::string& backend, const std::string& op, const Shape& s, DType input, DType state,
             StateLayout layout);
// A prefill row of one sequence set: the fields above plus the set, its sizes and the op's FLOP and byte models
// (with a checkpoint every C tokens: their states in the floor).
Row make_prefill_row(const std::string& backend, const Shape& s, DType input, DType state, StateLayout layout,
                     const SeqSet& set, int64_t C = 0);
void finish_row(Row& r, double copy_ceiling_tbps);  // fills tbps / pct / tflops / floor from time_us

double median(std::vector<double> v);

// Output.
std::string to_json(const RunInfo& info, const std::vector<Row>& rows);
std::string to_markdown(const RunInfo& info, const std::vector<Row>& rows);
std::string progress_line(const Row& r);

// Backends. Each measures the sweep of `o` and hands rows to `sink`; fills `info`.
void run_cpu(const Options& o, RunInfo& info, const RowSink& sink);
#ifdef GDNKIT_WITH_CUDA
void run_cuda(const Options& o, RunInfo& info, const RowSink& sink);
std::string cuda_device_summary();  // for `gdnkit info`: clocks, L2, memory per device
std::string cuda_op_probe();        // for `gdnkit info`: "decode ok, verify not implemented, ..."; "" without a GPU
#endif

}  // namespace gdnkit::bench
