// gdnkit: command-line tool.
//   gdnkit info                 build, devices, supported configurations
//   gdnkit bench [op] [flags]   the benchmark (method: docs/benchmarks.md; see `gdnkit help`)
//   gdnkit --version            "gdnkit MAJOR.MINOR.PATCH" (include/gdnkit/version.h)
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench.h"
#include "gdnkit/gdnkit.h"

namespace {

using namespace gdnkit;
using namespace gdnkit::bench;

constexpr const char* kUsage = R"(usage: gdnkit <command> [options]

commands:
  info                       build information, devices, supported configurations
  bench [decode|verify|prefill|all]   benchmark (default: all), method of docs/benchmarks.md
  bench prefill-split        a prefill split over the machine's GPUs (NCCL), against the 1-GPU prefill
  help                       this text
  --version                  the version ("gdnkit 0.1.0")

bench options:
  --shape NAME[,NAME]|all    qwen3-next | qwen3.5-397b-tp8 | qwen3.5-27b | qwen3.5-397b
                             (default: qwen3-next; prefill all four, qwen3-next with --quick)
  --state LIST               state dtypes, comma-separated: fp32, bf16, fp16, fp8 (float8_e4m3 with block
                             scales; prefill off the head pass on staged K-last fp32 copies), both (= fp32,bf16), all
                             (= fp32,bf16,fp16)
                             (default: decode all, verify/prefill fp32)
  --layout klast|vlast|both  state layout (default: decode both, verify/prefill klast)
  --input bf16|fp16|fp32     dtype of q, k, v, a, b and o (default bf16)
  --dim 64|128|256           K = V for every shape (default 128)
  --no-qk-l2norm             every op's fused q/k L2 norm off, q and k normalized before the timed runs (as
                             peers' kernels are timed without their norm kernel); prefill rows' mode says no-l2n
  --batches 1,2,...          decode/verify batch sizes
                             (default: decode 1,2,4,...,512; verify 1,8,32,64,128,256)
  --draft 2,3,...            verify draft tokens T (default: 2,3,4,8)
  --seqs SET[,SET]           prefill sequence sets: NxL = N sequences of L tokens, A+B = lengths A and B, and
                             terms of both in order: 64x100+6144 = 64 sequences of 100 tokens, then one of 6144
                             (default: the 12 standard sets, plus 4x2048, 8x1024, 8x8192, 32x8192)
  --gpus 1,2,4               prefill-split GPU counts (default: 1, 2, 4, ... up to the machine's; sets
                             1x262144, 1x1048576 on qwen3-next and qwen3.5-397b-tp8)
  --checkpoint C             prefill: also store every sequence's state after each C of its tokens (prefix-cache
                             checkpoints, the pool's dtype and layout; C a multiple of 64; the mode column says ckptC)
  --cp-segment N             A/B switch: prefill's context-parallel segments of N tokens (0: off) instead of
                             the library's choice (the mode column says what ran)
  --cp-first-final N         A/B switch: 1 runs each cut prompt's first segment with its outputs beside the
                             local pass, 0 after the scan, instead of the library's choice
  --cp-scan-cols N           A/B switch: value columns per CTA of the context-parallel scan, 8 or 32, instead of
                             the library's choice
  --fp8-columns N            A/B switch: columns per warp of the float8_e4m3 decode kernel, 8, 16 or 32 (32 at
                             K = 128 only), instead of the library's choice
  --no-prefetch              A/B switch: decode, verify and commit without prefetch mode (their CTAs asking L2
                             for their state before the previous call ends), which also changes the recurrent
                             kernel choices that depend on it (docs/design/decode.md "How the kernel is chosen")
  --vlast-fp8-columns N      A/B switch: columns per CTA of V-last float8_e4m3 decode, 64 or 128, instead of the
                             library's choice
  --chain-min-tokens N       A/B switch: verify and commit of chains of at least N tokens on the tensor-core chain
                             kernel (0: never), instead of the library's choice
  --fp8-chain N              A/B switch: verify of chains on float8_e4m3 pools on the fp8 chain kernel from N
                             sequences (0: never), where it is built, instead of the library's choice
  --fp8-chain-mma N          A/B switch: those chains without a cache on the fp8 chain kernel's tensor-core form (1)
                             or its CUDA-core form (0), instead of the library's choice
  --vlast-chain N            A/B switch: verify of chains on V-last pools on their chain kernel from N sequences
                             (0: never), where it is built, instead of the library's choice
  --solo-min-batch N         A/B switch: K-last decode on one-warp CTAs from N sequences (0: never), instead of
                             the library's choice
  --wide-max-batch N         A/B switch: 16-bit K-last decode on the wide tile up to N sequences (0: never), where
                             its grid fits in prefetch mode, instead of the library's choice
  --narrow-max-batch N       A/B switch: 16-bit K-last decode on the narrow tile up to N sequences (0: never), instead
                             of the library's choice
  --prep-warpgroup N         A/B switch: prefill's prep warpgroup beside two state warpgroups, 0 none, 1 forming M,
                             2 forming the whole chunk prep (no chunk prep kernel), where the call allows it,
                             instead of the library's choice
  --chunk-flags N            A/B switch: prefill's head pass waits for the chunk prep's grid (0) or for each chunk's
                             flag wherever its producer can (1), instead of the library's choice
  --persistent-pass N        A/B switch: prefill's head pass with the prep warpgroup as one CTA per (sequence, value
                             head) (0) or as one CTA per SM taking them in turn (1), instead of the library's choice
  --longest-first N          A/B switch: prefill's head pass (persistent, or one CTA per item past one wave) taking
                             the sequences longest first (1) or in their order (0), instead of the library's choice
  --prep-parts N             A/B switch: prefill's chunk prep in N CTAs per (chunk, q/k head), each a share of
                             the GVA group's value heads (N divides HV / H), instead of the library's choice
  --short-max-len N          A/B switch: prefill's sequences of at most N tokens on the recurrent kernels (0: none),
                             where the call allows it, instead of the library's choice
  --prefill-vtile N          A/B switch: prefill's state pass on the tiled kernel with value tiles of N columns (16,
                             32 or 64; 64 needs K <= 128), no context parallelism, instead of the library's choice
  --prefill-stages N         timing: prefill's chunk prep alone (1) or state pass alone (2) instead of both (3);
                             the outputs of one alone are not the op's
  --quick                    smaller sweep (decode B 1,8,64,256; verify T 2,4 x B 1,32,256;
                             prefill 1x8192, 4096+4096, 8192x8 on qwen3-next)
  --replays N                decode/verify graph replays, median taken (default 20, >= 15)
  --prefill-iters N          prefill timed runs, median taken (default 12, >= 10)
  --device-memory GIB        device memory the CUDA bench takes for its rows, at least 3 (default: the free
                             memory less 2 GiB); less leaves room for a profiler's kernel replay (ncu saves what
                             a kernel may write)
  --json FILE                write every row and the device/ceiling info as JSON
  --markdown FILE            write the Markdown table (also printed to stdout)
                             (both are checked for writing before the run, and rewritten after every row)
  --cpu                      run the CPU reference backend (small shapes) even if a GPU is present

Without a usable CUDA device the bench runs the CPU reference backend on a small default shape
(H=2, HV=4, K=V=64): its numbers are CPU timings, not GPU numbers.
Progress goes to stderr: one line per row, "row i/N", the time elapsed and an estimate of the time left.
Exit status: 0 when every row ran, 1 when a row failed or an output file could not be written, 2 for bad
arguments (an output file that cannot be created included: checked before any work).
)";

[[noreturn]] void usage_error(const std::string& msg) {
  std::fprintf(stderr, "gdnkit: %s\n(run `gdnkit help` for the options)\n", msg.c_str());
  std::exit(2);
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string part;
  while (std::getline(ss, part, sep))
    if (!part.empty()) out.push_back(part);
  return out;
}

std::vector<int32_t> int_list(const std::string& flag, const std::string& text, int lo, int hi) {
  std::vector<int32_t> out;
  for (const auto& p : split(text, ',')) {
    char* end = nullptr;
    const long v = std::strtol(p.c_str(), &end, 10);
    if (*end != '\0' || v < lo || v > hi)
      usage_error(flag + ": '" + p + "' is not an integer in " + std::to_string(lo) + ".." + std::to_string(hi));
    out.push_back(int32_t(v));
  }
  if (out.empty()) usage_error(flag + ": empty list");
  return out;
}

Options parse_bench(int argc, char** argv, int first) {
  Options o;
  for (int i = 0; i < argc; ++i) o.command_line += (i ? " " : "") + std::string(argv[i]);
  std::string op = "all";
  auto value = [&](int& i) -> std::string {
    if (i + 1 >= argc) usage_error(std::string(argv[i]) + " needs a value");
    return argv[++i];
  };
  for (int i = first; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "decode" || a == "verify" || a == "prefill" || a == "prefill-split" || a == "all") {
      op = a;
    } else if (a == "--shape") {
      const std::string v = value(i);
      if (v == "all") {
        o.shapes = known_shapes();
      } else {
        for (const auto& n : split(v, ',')) {
          const Shape* s = find_shape(n);
          if (!s) usage_error("--shape: unknown shape '" + n + "' (qwen3-next, qwen3.5-397b-tp8, qwen3.5-27b, qwen3.5-397b, all)");
          o.shapes.push_back(*s);
        }
      }
    } else if (a == "--state") {
      o.states.clear();
      std::stringstream list(value(i));
      for (std::string v; std::getline(list, v, ',');) {
        if (v == "fp32") o.states.push_back(DType::kFloat32);
        else if (v == "bf16") o.states.push_back(DType::kBFloat16);
        else if (v == "fp16") o.states.push_back(DType::kFloat16);
        else if (v == "fp8") o.states.push_back(DType::kFloat8E4M3);
        else if (v == "both") o.states.insert(o.states.end(), {DType::kFloat32, DType::kBFloat16});
        else if (v == "all") o.states.insert(o.states.end(), {DType::kFloat32, DType::kBFloat16, DType::kFloat16});
        else usage_error("--state: expected fp32, bf16, fp16, fp8, both or all, got '" + v + "'");
      }
    } else if (a == "--layout") {
      const std::string v = value(i);
      if (v == "klast") o.layouts = {StateLayout::kKLast};
      else if (v == "vlast") o.layouts = {StateLayout::kVLast};
      else if (v == "both") o.layouts = {StateLayout::kKLast, StateLayout::kVLast};
      else usage_error("--layout: expected klast, vlast or both, got '" + v + "'");
    } else if (a == "--no-qk-l2norm") {
      o.qk_l2norm = false;
    } else if (a == "--input") {
      const std::string v = value(i);
      if (v == "bf16") o.input = DType::kBFloat16;
      else if (v == "fp16") o.input = DType::kFloat16;
      else if (v == "fp32") o.input = DType::kFloat32;
      else usage_error("--input: expected bf16, fp16 or fp32, got '" + v + "'");
    } else if (a == "--dim") {
      const int32_t d = int_list(a, value(i), 1, 1024).front();
      if (d != 64 && d != 128 && d != 256) usage_error("--dim: expected 64, 128 or 256, got " + std::to_string(d));
      o.dim = d;
    } else if (a == "--batches") {
      o.batches = int_list(a, value(i), 1, 65536);
    } else if (a == "--draft") {
      o.drafts = int_list(a, value(i), 1, 64);
    } else if (a == "--seqs") {
      try {
        for (const auto& s : split(value(i), ',')) o.seqsets.push_back(parse_seqset(s));
      } catch (const Error& e) {
        usage_error(e.what());
      }
    } else if (a == "--gpus") {
      o.gpus = int_list(a, value(i), 1, 64);
    } else if (a == "--replays") {
      o.replays = int_list(a, value(i), 15, 10000).front();
    } else if (a == "--prefill-iters") {
      o.prefill_iters = int_list(a, value(i), 10, 10000).front();
    } else if (a == "--device-memory") {
      o.device_memory_gib = int_list(a, value(i), 3, 1 << 20).front();  // the copy ceiling's run takes 2 GiB
    } else if (a == "--checkpoint") {
      o.checkpoint = int_list(a, value(i), 64, 1 << 30).front();
      if (o.checkpoint % 64 != 0) usage_error("--checkpoint: a multiple of 64 tokens");
    } else if (a == "--cp-first-final") {
      o.cp_first_final = int_list(a, value(i), 0, 1).front();
    } else if (a == "--cp-scan-cols") {
      o.cp_scan_cols = int_list(a, value(i), 8, 32).front();
      if (o.cp_scan_cols != 8 && o.cp_scan_cols != 32) usage_error("--cp-scan-cols: 8 or 32");
    } else if (a == "--cp-segment") {
      o.cp_segment = int_list(a, value(i), 0, 1 << 30).front();
      if (o.cp_segment % 64 != 0) usage_error("--cp-segment: a multiple of 64 tokens (0: off)");
    } else if (a == "--chain-min-tokens") {
      o.chain_min_tokens = int_list(a, value(i), 0, 64).front();
    } else if (a == "--fp8-chain") {
      o.fp8_chain = int_list(a, value(i), 0, 65536).front();
    } else if (a == "--fp8-chain-mma") {
      o.fp8_chain_mma = int_list(a, value(i), 0, 1).front();
    } else if (a == "--vlast-chain") {
      o.vlast_chain = int_list(a, value(i), 0, 65536).front();
    } else if (a == "--solo-min-batch") {
      o.solo_min_batch = int_list(a, value(i), 0, 65536).front();
    } else if (a == "--wide-max-batch") {
      o.wide_max_batch = int_list(a, value(i), 0, 65536).front();
    } else if (a == "--narrow-max-batch") {
      o.narrow_max_batch = int_list(a, value(i), 0, 65536).front();
    } else if (a == "--prep-warpgroup") {
      o.prep_warpgroup = int_list(a, value(i), 0, 2).front();
    } else if (a == "--chunk-flags") {
      o.chunk_flags = int_list(a, value(i), 0, 1).front();
    } else if (a == "--persistent-pass") {
      o.persistent_pass = int_list(a, value(i), 0, 1).front();
    } else if (a == "--longest-first") {
      o.longest_first = int_list(a, value(i), 0, 1).front();
    } else if (a == "--prep-parts") {
      o.prep_parts = int_list(a, value(i), 1, 64).front();
    } else if (a == "--short-max-len") {
      o.short_max_len = int_list(a, value(i), 0, 1 << 20).front();
    } else if (a == "--prefill-vtile") {
      o.prefill_vtile = int_list(a, value(i), 16, 64).front();
      if (o.prefill_vtile != 16 && o.prefill_vtile != 32 && o.prefill_vtile != 64)
        usage_error("--prefill-vtile: 16, 32 or 64");
    } else if (a == "--prefill-stages") {
      o.prefill_stages = int_list(a, value(i), 1, 3).front();
    } else if (a == "--vlast-fp8-columns") {
      o.vlast_fp8_columns = int_list(a, value(i), 64, 128).front();
      if (o.vlast_fp8_columns != 64 && o.vlast_fp8_columns != 128) usage_error("--vlast-fp8-columns: 64 or 128");
    } else if (a == "--fp8-columns") {
      o.fp8_columns = int_list(a, value(i), 8, 32).front();
      if (o.fp8_columns != 8 && o.fp8_columns != 16 && o.fp8_columns != 32) usage_error("--fp8-columns: 8, 16 or 32");
    } else if (a == "--no-prefetch") {
      o.prefetch = false;
    } else if (a == "--json") {
      o.json_path = value(i);
    } else if (a == "--markdown") {
      o.markdown_path = value(i);
    } else if (a == "--quick") {
      o.quick = true;
    } else if (a == "--cpu") {
      o.cpu = true;
    } else if (a == "--help" || a == "-h") {
      std::printf("%s", kUsage);
      std::exit(0);
    } else {
      usage_error("bench: unknown argument '" + a + "'");
    }
  }
  o.ops = op == "all" ? std::vector<std::string>{"decode", "verify", "prefill"} : std::vector<std::string>{op};
  const bool fp8 = std::find(o.states.begin(), o.states.end(), DType::kFloat8E4M3) != o.states.end();
  if (fp8 && o.cpu) usage_error("--state fp8: float8_e4m3 pools are benchmarked on CUDA");
  if (op == "prefill-split" && o.cpu) usage_error("prefill-split: the split over GPUs is benchmarked on CUDA (no --cpu)");
  if (!o.json_path.empty() && o.json_path == o.markdown_path)
    usage_error("--json and --markdown name the same file '" + o.json_path + "'");
  return o;
}

// Fails fast, before any work, when an output file cannot be written: opens it for appending (which
// creates a missing file and leaves an existing one as it is), then removes it again if it was not there.
void check_writable(const char* flag, const std::string& path) {
  if (path.empty()) return;
  std::error_code ec;
  const bool existed = std::filesystem::exists(path, ec);
  std::FILE* f = std::fopen(path.c_str(), "ab");
  if (f == nullptr) {
    const int err = errno;
    std::fprintf(stderr, "gdnkit bench: %s: cannot write %s: %s\n", flag, path.c_str(), std::strerror(err));
    std::exit(2);
  }
  std::fclose(f);
  if (!existed) std::filesystem::remove(path, ec);
}

// A failed write of an output file during the run: the run stops (exit status 1), once.
struct OutputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void write_file(const std::string& path, const std::string& text) {
  if (path.empty()) return;
  errno = 0;
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
  f.close();
  if (!f) throw OutputError("cannot write " + path + (errno ? std::string(": ") + std::strerror(errno) : ""));
}

int run_bench(int argc, char** argv) {
  const Options o = parse_bench(argc, argv, 2);
  check_writable("--json", o.json_path);
  check_writable("--markdown", o.markdown_path);
  RunInfo info;
  info.command = o.command_line;
  info.build_info = build_info();
  // The CPU path is announced on the first line printed, so nobody mistakes its numbers for GPU ones.
  bool use_cuda = false;
  if (o.cpu) {
    info.note = "gdnkit bench: --cpu given — running the CPU reference backend on a small default "
                "(numbers are CPU timings, not GPU)";
  } else if (!cuda_compiled()) {
    info.note = "gdnkit bench: gdnkit was built without CUDA — running the CPU reference backend on a small "
                "default (numbers are CPU timings, not GPU)";
  } else if (!cuda_available()) {
    info.note = "gdnkit bench: no CUDA device found — running the CPU reference backend on a small default "
                "(numbers are CPU timings, not GPU)";
  } else {
    use_cuda = true;
  }
  if (!use_cuda && std::find(o.states.begin(), o.states.end(), DType::kFloat8E4M3) != o.states.end())
    usage_error("--state fp8: float8_e4m3 pools are benchmarked on CUDA only, and this run has no usable CUDA device");
  if (!use_cuda) std::printf("%s\n", info.note.c_str());
  std::fflush(stdout);

  std::vector<Row> rows;
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  auto since = [](Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); };
  auto flush_files = [&] {
    info.wall_seconds = since(t0);
    write_file(o.json_path, to_json(info, rows));
    write_file(o.markdown_path, to_markdown(info, rows));
  };
  size_t planned = 0;
  Clock::time_point rows_t0 = t0;  // the estimate counts from the first row (not the ceiling measurements)
  RowSink sink;
  sink.plan = [&](size_t total) {
    planned = total;
    rows_t0 = Clock::now();
    std::fprintf(stderr, "gdnkit bench: %zu row(s) to measure\n", total);
  };
  sink.row = [&](const Row& r) {
    rows.push_back(r);
    const std::string where = progress_prefix(rows.size(), std::max(planned, rows.size()), since(rows_t0));
    std::fprintf(stderr, "[%s] %s\n", where.c_str(), progress_line(r).c_str());
    flush_files();
  };
  try {
    if (use_cuda) {
#ifdef GDNKIT_WITH_CUDA
      run_cuda(o, info, sink);
#endif
    } else {
      run_cpu(o, info, sink);
    }
    flush_files();
  } catch (const OutputError& e) {
    std::fprintf(stderr, "gdnkit bench: %s (stopped after %zu row(s))\n", e.what(), rows.size());
    return 1;
  } catch (const std::exception& e) {
    try {
      flush_files();  // keep the rows measured so far
    } catch (const OutputError& w) {
      std::fprintf(stderr, "gdnkit bench: %s\n", w.what());
    }
    std::fprintf(stderr, "gdnkit bench: %s\n", e.what());
    return 1;
  }
  std::printf("%s", to_markdown(info, rows).c_str());
  std::printf("(%zu rows in %.1f s)\n", rows.size(), info.wall_seconds);

  // Exit status 1 when a configuration failed or produced garbage; "not implemented" rows are not failures.
  int failed = 0;
  for (const Row& r : rows) failed += r.status == "error" || r.nonfinite_outputs > 0 || r.error_flag > 0;
  if (failed) std::fprintf(stderr, "gdnkit bench: %d configuration(s) failed (see the status column)\n", failed);
  return failed ? 1 : 0;
}

int info() {
  std::printf("%s", build_info().c_str());
  std::printf("cuda backend: %s, usable device: %s\n", cuda_compiled() ? "compiled" : "not compiled",
              cuda_available() ? "yes" : "no");
#ifdef GDNKIT_WITH_CUDA
  std::printf("cuda devices:\n%s", cuda_device_summary().c_str());
  try {
    const std::string ops = cuda_op_probe();
    if (!ops.empty()) std::printf("cuda ops (one tiny call each): %s\n", ops.c_str());
  } catch (const std::exception& e) {
    std::printf("cuda ops: probe failed: %s\n", e.what());
  }
#endif
  std::printf(
      "\nsupported configurations (docs/semantics.md):\n"
      "  ops:         decode; verify (chain or tree parents, fixed T or varlen, an intermediate cache of float32,\n"
      "               bfloat16, float16 or float8_e4m3, update_state); commit (from cache or by recompute); prefill\n"
      "               (chunk 64, cu_seqlens int32/int64, checkpoints every C tokens, C a multiple of 64);\n"
      "               convert_layout (K-last <-> V-last)\n"
      "  heads:       H q/k heads, HV value heads, HV %% H == 0\n"
      "  head dims:   K, V in {64, 128, 256} (128 is the tuned path)\n"
      "  inputs:      q, k, v, a, b: bfloat16, float16, float32; o has v's dtype; A_log, dt_bias, g: float32;\n"
      "               beta: float32, bfloat16, float16\n"
      "  gating:      fused (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)) or given (g, beta)\n"
      "  state:       float32, bfloat16, float16 or float8_e4m3 (block scales), accumulated in float32; layouts\n"
      "               K-last [V,K] and V-last [K,V]; pool-indexed by int32 slots (negative = padding), int64 slot\n"
      "               stride\n"
      "  backends:    cpu (reference, always), cuda (sm_90a%s)\n",
      cuda_compiled() ? "" : ", not in this build");
  std::printf("\nbench shapes (d = K = V):\n");
  for (const Shape& s : known_shapes())
    std::printf("  %-18s H=%-3d HV=%-3d K=%d V=%d\n", s.name.c_str(), s.H, s.HV, s.K, s.V);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string cmd = argc > 1 ? argv[1] : "help";
  try {
    if (cmd == "info") return info();
    if (cmd == "bench") return run_bench(argc, argv);
    if (cmd == "--version" || cmd == "version") {
      std::printf("gdnkit %s\n", GDNKIT_VERSION_STRING);
      return 0;
    }
    if (cmd == "help" || cmd == "--help" || cmd == "-h") {
      std::printf("%s", kUsage);
      return 0;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gdnkit: %s\n", e.what());
    return 1;
  }
  usage_error("unknown command '" + cmd + "'");
}
