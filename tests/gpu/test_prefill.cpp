// GPU chunked prefill vs the CPU reference (the token-by-token recurrence, fp64) on the same random
// problems: lengths around the chunk (0, 1, 63, 64, 65, 1000) and mixed varlen batches, layouts,
// state / checkpoint dtypes, input dtypes, gating modes, q/k L2 norm, dims 64/128/256, GVA, strided
// views, checkpoints, initial == final slot, negative and out-of-range slots, the long-memory regime,
// every value tile of the state pass, bitwise repeatability and CUDA-graph capture. Outputs, pools and
// checkpoints start NaN-poisoned; untouched slots and checkpoint entries must stay bit-identical.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "support/compare.h"
#include "gdnkit/host_dtype.h"
#include "support/problem.h"
#include "cuda/host/check.h"
#include "cuda/host/overrides.h"
#include "cuda/prefill/item_order.h"
#include "cuda/prefill/plan.h"
#include "gdnkit/gdnkit.h"
#include "gpu/gpu_harness.h"

namespace gdnkit::test {
namespace {

std::string short_name(DType d) {
  switch (d) {
    case DType::kFloat32:
      return "f32";
    case DType::kBFloat16:
      return "bf16";
    case DType::kFloat16:
      return "f16";
    case DType::kFloat8E4M3:
      return "f8";
    case DType::kInt64:
      return "i64";
    default:
      return "i32";
  }
}

std::string case_name(const ProblemConfig& c, const std::string& tag = "") {
  std::string s = std::string(c.layout == StateLayout::kKLast ? "klast" : "vlast") + "_s" + short_name(c.state_dtype) +
                  "_in" + short_name(c.in_dtype) + (c.gate_mode == GateMode::kFused ? "_fused" : "_given") +
                  (c.use_qk_l2norm ? "_l2" : "_nol2") + "_h" + std::to_string(c.H) + "x" + std::to_string(c.HV) + "_k" +
                  std::to_string(c.K) + "v" + std::to_string(c.V);
  if (c.token_pad || c.head_pad) s += "_strided";
  if (c.slot_pad) s += "_slotpad";
  if (c.long_memory) s += "_longmem";
  if (c.checkpoint_interval) s += "_ckpt" + std::to_string(c.checkpoint_interval) + short_name(c.cache_dtype);
  if (c.same_slot) s += "_sameslot";
  if (c.cu_seqlens_dtype == DType::kInt64) s += "_cu64";
  if (!tag.empty()) s += "_" + tag;
  return s;
}

struct Case {
  std::string name;
  ProblemConfig cfg;
  int vtile = 0;       // 0: the library's heuristic
  int head_split = 0;  // with vtile = kVTileHead: CTAs per (sequence, head); 0: the heuristic
  // The longest sequence the short-sequence path (recurrent kernels) takes: 0 none (the chunked kernels
  // run every sequence), > 0 that length, < 0 the library's choice through the public API.
  int short_len = 0;
  // The head pass's prep warpgroup, where the plan allows it: -1 the library's choice, 0 none (the state warpgroups
  // form M, or it comes from the workspace), 1 the warpgroup forming M, 2 the warpgroup forming the whole chunk prep
  // (the fused prep: the gate kernel before the pass, no chunk prep kernel).
  int aux = -1;
  // Context-parallel segments of this many tokens: -1 the library's choice, 0 none.
  int cp = -1;
  // ... each cut sequence's first segment's final pass beside the local pass (1) or after the scan (0); -1 the choice's
  int first_final = -1;
  // > 0: the persistent pass on this many CTAs (each then runs many items through its stages); 0 the library's grid
  int pass_ctas = 0;
};

ProblemConfig base(std::vector<int32_t> lens, int H = 2, int HV = 4, int K = 128, int V = 128) {
  ProblemConfig c;
  c.op = OpKind::kPrefill;
  c.seq_lens = std::move(lens);
  c.H = H, c.HV = HV, c.K = K, c.V = V;
  c.zero_initial_rows = 1;  // the first sequence starts from S = 0 (initial index -1)
  return c;
}

// vtile = kShortOnly: the short-sequence path's launcher alone (cuda::prefill_short), no chunked kernel.
constexpr int kShortOnly = -100;

// The library's entry under the overrides a case asks for (0 / -1: the heuristics' choice).
cuda::Overrides case_overrides(int vtile, int head_split, int short_len, int aux, int cp = -1, int flags = -1,
                               int first_final = -1, int prep_parts = 0, int pass_ctas = 0) {
  cuda::Overrides o;
  if (pass_ctas > 0) o.prefill_persistent = 1, o.prefill_persistent_ctas = pass_ctas;
  o.prefill_prep_parts = prep_parts;
  o.prefill_cp_segment_len = cp;
  o.prefill_cp_first_final = first_final;
  o.prefill_cp_scan_cols = first_final == 1 ? 32 : first_final == 0 ? 8 : 0;  // both scans on every case
  o.prefill_chunk_flags = flags;
  o.prefill_vtile = vtile == kShortOnly ? 0 : vtile;
  o.prefill_head_split = head_split;
  o.prefill_short_max_len = short_len;
  o.prefill_m_warpgroup = aux;
  return o;
}

void run_gpu(Problem& got, DeviceProblem& dev, int vtile, int head_split = 0, int short_len = -1, int aux = -1,
             int cp = -1, int flags = -1, int first_final = -1, int prep_parts = 0, int pass_ctas = 0) {
  const PrefillParams call = got.prefill_params(PrefillAlgorithm::kAuto, dev.resolver());
  // what the passes run: the call, or its staged K-last fp32 copies (staged_states.h)
  const PrefillParams p = cuda::chunked_prefill::pass_params(call);
  const cuda::Overrides o =
      case_overrides(vtile, head_split, short_len, aux, cp, flags, first_final, prep_parts, pass_ctas);
  // A case that asks for the persistent pass on few CTAs must get it.
  if (pass_ctas > 0) {
    EXPECT_TRUE(cuda::chunked_prefill::choose_prefill(p, cuda::device_sms(), o).persistent_pass)
        << "the persistent pass would not run";
  }
  // A case that asks for the chunk prep in parts must get them.
  if (prep_parts > 0) {
    EXPECT_EQ(cuda::chunked_prefill::choose_prefill(p, cuda::device_sms(), o).prep_parts, prep_parts);
  }
  // A case that asks for the pass to wait per chunk (or for the prep's grid) must get what it asks for.
  if (flags >= 0) {
    EXPECT_EQ(cuda::chunked_prefill::choose_prefill(p, cuda::device_sms(), o).chunk_flags, flags > 0);
  }
  // ... and one that asks for context parallelism must get it.
  if (cp > 0) {
    const cuda::chunked_prefill::PrefillChoice choice = cuda::chunked_prefill::choose_prefill(p, cuda::device_sms(), o);
    EXPECT_EQ(choice.cp_segment_len, cp);
    if (first_final >= 0) EXPECT_EQ(choice.cp_first_final, first_final > 0);
  }
  // A case that asks for the short path must get it: were it refused, the chunked kernels would run
  // every sequence and the comparison would still pass.
  if (short_len > 0) {
    EXPECT_TRUE(cuda::chunked_prefill::short_path_supported(p)) << "the short path would not run";
  }
  // ... and one that asks for the prep warpgroup must get it (the plan falls back to none where it cannot).
  if (aux > 0) {
    const cuda::chunked_prefill::PrefillChoice choice = cuda::chunked_prefill::choose_prefill(p, cuda::device_sms(), o);
    EXPECT_TRUE(choice.m_warpgroup) << "the prep warpgroup would not run";
    EXPECT_EQ(choice.fused_prep, aux == 2) << "the fused prep would not run as asked";
  }
  if (vtile == kShortOnly) {
    validate(call, Backend::kCUDA);
    cuda::prefill_short(call, short_len, reinterpret_cast<Stream>(dev.stream()));
  } else {
    const cuda::ScopedOverrides scoped(o);
    prefill(call, {Backend::kCUDA, dev.stream()});
  }
  dev.download(got);
}

// The library's entry on `got` under overrides `o` (host false: without the host's copy of cu_seqlens); returns the
// plan it took.
cuda::chunked_prefill::PrefillChoice run_gpu_with(Problem& got, const cuda::Overrides& o, bool host = true) {
  DeviceProblem dev(got);
  PrefillParams pp = got.prefill_params(PrefillAlgorithm::kAuto, dev.resolver());
  if (!host) pp.cu_seqlens_host = nullptr;
  const cuda::chunked_prefill::PrefillChoice choice = cuda::chunked_prefill::choose_prefill(pp, cuda::device_sms(), o);
  {
    const cuda::ScopedOverrides scoped(o);
    prefill(pp, {Backend::kCUDA, dev.stream()});
  }
  dev.download(got);
  return choice;
}

// CPU reference (recurrent, fp64) and GPU from identical copies of `before`; compares everything.
void check_prefill(const Problem& before, int vtile = 0, int head_split = 0, int short_len = -1, int aux = -1,
                   int cp = -1, int flags = -1, int first_final = -1, int prep_parts = 0, int pass_ctas = 0) {
  Problem ref = before, got = before;
  prefill(ref.prefill_params(PrefillAlgorithm::kRecurrent), {Backend::kCPU, nullptr});
  {
    DeviceProblem dev(got);
    run_gpu(got, dev, vtile, head_split, short_len, aux, cp, flags, first_final, prep_parts, pass_ctas);
  }
  check_prefill_results(before, got, ref);
}

// ---- the spec's axes on a short varlen batch around the chunk boundaries -------------------------
std::vector<Case> axes_cases() {
  std::vector<Case> out;
  int i = 0;
  for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast})
    for (DType state : {DType::kFloat32, DType::kBFloat16, DType::kFloat16})
      for (DType in : {DType::kBFloat16, DType::kFloat16, DType::kFloat32})
        for (GateMode gate : {GateMode::kFused, GateMode::kGiven})
          for (bool l2 : {true, false}) {
            ProblemConfig c = base({1, 63, 64, 65, 200});
            c.layout = layout, c.state_dtype = state, c.in_dtype = in, c.gate_mode = gate, c.use_qk_l2norm = l2;
            c.gate_dtype = (i % 2) ? DType::kBFloat16 : DType::kFloat32;
            if (i % 3 == 1) c.token_pad = 24, c.head_pad = 8;  // views of a fused projection
            if (i % 3 == 2) c.slot_pad = 40;                   // strided pool
            if (i % 4 == 3) c.cu_seqlens_dtype = DType::kInt64;
            c.seed = 1000 + i++;
            out.push_back({case_name(c), c});
            // 16-bit inputs once more through the head pass with the prep warpgroup beside two state warpgroups
            if (in != DType::kFloat32) {
              Case f{case_name(c, "aux1"), c, cuda::chunked_prefill::kVTileHead, 1};
              f.aux = 1;
              out.push_back(f);
              // ... and forming the whole chunk prep there (the fused prep)
              f.name = case_name(c, "aux2"), f.aux = 2;
              out.push_back(f);
            }
          }
  return out;
}

// ---- lengths, dims, GVA, tiles, checkpoints, slots ---------------------------------------------
std::vector<Case> shape_cases() {
  std::vector<Case> out;
  int i = 0;
  auto add = [&](ProblemConfig c, const std::string& tag, int vtile = 0, int head_split = 0, int aux = -1) {
    c.seed = 2000 + i++;
    Case x{case_name(c, tag), c, vtile, head_split};
    x.aux = aux;
    out.push_back(x);
  };
  for (int len : {0, 1, 63, 64, 65, 1000}) add(base({len}), "len" + std::to_string(len));
  // Mixed varlen batch: short and long sequences, an empty one, few heads so the reference stays fast.
  add(base({5, 0, 1000, 64, 129, 1, 300, 0, 17}, 1, 2), "mixed");
  // More sequences than one block of the chunk prep's slot -> sequence lookup (300: a bisection over ten blocks of
  // 32, then a ballot over one), lengths 0..90 around the chunk.
  {
    std::mt19937 gen(5);
    std::vector<int32_t> lens(300);
    for (int32_t& x : lens) x = int32_t(gen() % 91);
    add(base(lens, 1, 2), "many");
  }
  {
    ProblemConfig c = base({2000, 3}, 1, 2);
    c.long_memory = true;
    add(c, "long");
    c.state_dtype = DType::kBFloat16, c.layout = StateLayout::kVLast;
    add(c, "long");
  }
  // Keys from a rank-4 subspace, beta ~ 0.95, long memory: each chunk's I + A far from the identity, which the
  // prep's triangular solve (fp16 block products, mma.cuh) must still invert; fp16 and
  // fp32 inputs within the spec's tolerances (fp32 outputs have the tighter one), bf16 within 3x (check_prefill).
  for (DType in : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    ProblemConfig c = base({700, 64}, 1, 2);
    c.in_dtype = in, c.long_memory = true, c.correlated_keys = true;
    add(c, "corrkeys");
  }
  // Head dims (K, V) and GVA ratios.
  for (auto [K, V] : std::vector<std::pair<int, int>>{{64, 64}, {256, 256}, {64, 128}, {128, 64}, {256, 128}})
    for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast}) {
      ProblemConfig c = base({70, 130, 1}, 2, 8, K, V);
      c.layout = layout;
      c.state_dtype = K == 256 ? DType::kBFloat16 : DType::kFloat32;
      add(c, "dims");
    }
  {
    ProblemConfig c = base({100, 30}, 1, 8);  // HV/H = 8
    add(c, "gva8");
  }
  // Kernel 1 loops over the value heads of a GVA group: one head per group, and an odd group size
  // (the second group starts at an odd head).
  add(base({100, 30}, 2, 2), "gva1");
  add(base({100, 30}, 2, 6), "gva3");
  // A group larger than the prep keeps A_log / dt_bias of in shared memory (32 value heads: the rest are read at
  // their use), on the path where the head pass forms M (80 (sequence, head) pairs).
  add(base({100, 70}, 1, 40), "gva40", 0, 0, 0);
  // ... and the head pass's prep warpgroup (one value head per CTA).
  add(base({100, 70}, 1, 40), "gva40_aux1", 0, 0, 1);
  add(base({100, 70}, 1, 40), "gva40_aux2", 0, 0, 2);  // the gate kernel: 10 CTAs of 4 value heads per chunk
  // Every value tile the state pass is built with, and the head state pass (bf16 and fp16 inputs,
  // V = 64 and 128, both layouts).
  for (int K : {64, 128, 256})
    for (int vt : {16, 32, 64}) {
      if (!cuda::chunked_prefill::vtile_supported(K, vt)) continue;
      ProblemConfig c = base({150, 64, 7}, 1, 2, K, 128);
      add(c, "vt" + std::to_string(vt), vt);
    }
  // The head pass in both builds of its products: wgmma (kVTileHead; mma.sync where a CTA has fewer
  // than 64 value columns) and mma.sync (kVTileHeadWarp).
  for (int vt : {cuda::chunked_prefill::kVTileHead, cuda::chunked_prefill::kVTileHeadWarp})
    for (int K : {64, 128})
      for (int V : {64, 128})
        for (int split : {1, 2}) {
          if (!cuda::chunked_prefill::head_split_supported(V, split)) continue;
          ProblemConfig c = base({150, 64, 7, 0, 200}, 1, 2, K, V);
          c.in_dtype = split == 2 ? DType::kFloat16 : DType::kBFloat16;
          c.layout = V == 64 ? StateLayout::kVLast : StateLayout::kKLast;
          const std::string kind = vt == cuda::chunked_prefill::kVTileHead ? "head" : "headwarp";
          // Two warpgroups per CTA (the wgmma build, split 1, V = 128): forming M and rq themselves after the chunk
          // prep kernel (rq is the scale alone without the L2 norm), or beside the prep warpgroup
          const bool two_wg = vt == cuda::chunked_prefill::kVTileHead && split == 1 && V == 128;
          for (int aux : two_wg ? std::vector<int>{0, 1, 2} : std::vector<int>{-1}) {
            const std::string tag = kind + std::to_string(split) + (aux > 0 ? "_aux" + std::to_string(aux) : "");
            ProblemConfig cf = c;
            add(cf, tag, vt, split, aux);
            if (split == 1 && V == 128) {
              cf.use_qk_l2norm = false, cf.gate_mode = GateMode::kGiven;
              add(cf, tag + "_nol2", vt, split, aux);
            }
          }
        }
  // Sequences of 8 to 16 chunks with and without the prep warpgroup (the stages' mbarrier phases wrap several times).
  for (int aux : {0, 1, 2}) {
    ProblemConfig c = base({1000, 700, 517}, 1, 2);
    c.checkpoint_interval = 256;
    add(c, "long_aux" + std::to_string(aux), cuda::chunked_prefill::kVTileHead, 1, aux);
  }
  // Checkpoints: C = 64 and 128, fp32 and bf16 buffers, a buffer with fewer steps than the longest
  // sequence needs.
  for (int C : {64, 128})
    for (DType cache : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      ProblemConfig c = base({300, 64, 127, 0, 256}, 1, 2);
      c.checkpoint_interval = C, c.cache_dtype = cache;
      c.slot_pad = 16;
      add(c, "");
    }
  {
    ProblemConfig c = base({400, 200}, 1, 2);
    c.checkpoint_interval = 64, c.checkpoint_steps = 2;
    add(c, "fewsteps");
  }
  // float8_e4m3 checkpoints beside fp32 and bf16 pools (head_state_io.cuh store_head_state_e4m3), K 64 and 128, as
  // the heuristics choose (a head split here), then each head pass build with one CTA per head: the wgmma build with
  // and without the prep warpgroup, and the mma.sync build.
  for (int K : {64, 128})
    for (DType state : {DType::kFloat32, DType::kBFloat16}) {
      ProblemConfig c = base({300, 64, 127, 0, 256}, 1, 2, K, K);
      c.checkpoint_interval = 64, c.cache_dtype = DType::kFloat8E4M3, c.state_dtype = state;
      c.slot_pad = 32;
      add(c, "");
    }
  {
    ProblemConfig c = base({700, 64, 333}, 1, 2);
    c.checkpoint_interval = 64, c.cache_dtype = DType::kFloat8E4M3, c.slot_pad = 32;
    for (int aux : {0, 1, 2}) add(c, "f8ckpt_aux" + std::to_string(aux), cuda::chunked_prefill::kVTileHead, 1, aux);
    add(c, "f8ckpt_warp", cuda::chunked_prefill::kVTileHeadWarp, 1);
  }
  // Initial == final slot (read before write), sequences without a final slot, all from zero.
  {
    ProblemConfig c = base({100, 64, 0, 33}, 1, 2);
    c.same_slot = true;
    add(c, "");
    c.same_slot = false, c.zero_initial_rows = 4, c.no_final_rows = 2;
    add(c, "zero_init_no_final");
  }
  // float8_e4m3 K-last pools (head_state_io.cuh load_head_state_e4m3, store_head_state_e4m3): K 64 and 128 as the
  // heuristics choose, fp16 inputs, then each head pass build with fp8 checkpoints, initial == final slot.
  for (int K : {64, 128}) {
    ProblemConfig c = base({300, 64, 127, 0, 256}, 1, 2, K, K);
    c.state_dtype = DType::kFloat8E4M3, c.slot_pad = 32;
    add(c, "");
  }
  {
    ProblemConfig c = base({200, 65, 0, 130}, 2, 4);
    c.state_dtype = DType::kFloat8E4M3, c.in_dtype = DType::kFloat16, c.gate_mode = GateMode::kGiven;
    add(c, "");
    c = base({700, 64, 333}, 1, 2);
    c.state_dtype = DType::kFloat8E4M3, c.checkpoint_interval = 64, c.cache_dtype = DType::kFloat8E4M3;
    for (int aux : {0, 1, 2}) add(c, "f8pool_aux" + std::to_string(aux), cuda::chunked_prefill::kVTileHead, 1, aux);
    add(c, "f8pool_warp", cuda::chunked_prefill::kVTileHeadWarp, 1);
    c.checkpoint_interval = 0, c.same_slot = true;
    add(c, "f8pool");
  }
  // float8_e4m3 K-last pools and checkpoints on the tiled pass (state_pass_tiled.cuh store_state_e4m3,
  // load_state_e4m3): fp32 inputs at K = V = 128, bf16 inputs at K = V = 256 with initial == final slot.
  {
    ProblemConfig c = base({300, 64, 127, 0, 256}, 1, 2, 128, 128);
    c.state_dtype = DType::kFloat8E4M3, c.in_dtype = DType::kFloat32, c.gate_mode = GateMode::kGiven;
    c.checkpoint_interval = 64, c.cache_dtype = DType::kFloat8E4M3, c.slot_pad = 32;
    add(c, "f8tiled");
    c = base({200, 65, 0, 130}, 1, 2, 256, 256);
    c.state_dtype = DType::kFloat8E4M3, c.checkpoint_interval = 64, c.cache_dtype = DType::kFloat8E4M3;
    c.same_slot = true;
    add(c, "f8tiled");
  }
  // float8_e4m3 V-last pools and checkpoints in place on the head pass (head_state_io.cuh store_head_state_vlast_e4m3,
  // load_head_state_vlast_e4m3): every build and head split at K, V in {64, 128}, with and without the prep warpgroup;
  // fp16 inputs with initial == final slot; sequences from zero and without a final slot; fp8 or 16-bit checkpoints
  // beside an fp8 pool and fp8 checkpoints beside a 16-bit pool; a call of no tokens; checkpoints asked of a call
  // shorter than their interval.
  for (int vt : {cuda::chunked_prefill::kVTileHead, cuda::chunked_prefill::kVTileHeadWarp})
    for (int K : {64, 128})
      for (int V : {64, 128})
        for (int split : {1, 2}) {
          if (!cuda::chunked_prefill::head_split_supported(V, split)) continue;
          ProblemConfig c = base({300, 64, 127, 0, 256, 5}, 1, 2, K, V);
          c.layout = StateLayout::kVLast, c.state_dtype = DType::kFloat8E4M3, c.slot_pad = 32;
          c.checkpoint_interval = 64, c.cache_dtype = DType::kFloat8E4M3;
          const bool two_wg = vt == cuda::chunked_prefill::kVTileHead && split == 1 && V == 128;
          const std::string kind = vt == cuda::chunked_prefill::kVTileHead ? "head" : "headwarp";
          for (int aux : two_wg ? std::vector<int>{0, 1, 2} : std::vector<int>{-1})
            add(c, "f8vlast_" + kind + std::to_string(split) + (aux >= 0 ? "_aux" + std::to_string(aux) : ""), vt,
                split, aux);
        }
  // A V-last float8_e4m3 pool's cases with checkpoints, on inputs of dtype `first` then `rest`: initial == final
  // slot, sequences from zero and without a final slot, fp8 or 16-bit checkpoints beside an fp8 pool, fp8 beside a
  // 16-bit one.
  const auto add_fp8_vlast_cases = [&](DType first, DType rest, const std::string& name) {
    ProblemConfig c = base({200, 65, 0, 130, 3}, 2, 4);
    c.layout = StateLayout::kVLast, c.state_dtype = DType::kFloat8E4M3;
    c.in_dtype = first, c.gate_mode = GateMode::kGiven, c.same_slot = true;
    add(c, name);
    c.in_dtype = rest, c.same_slot = false, c.zero_initial_rows = 2, c.no_final_rows = 1;
    c.checkpoint_interval = 64, c.cache_dtype = DType::kFloat8E4M3;
    add(c, name);
    c.cache_dtype = DType::kBFloat16, c.checkpoint_steps = 2;
    add(c, name + "_fewsteps");
    c.state_dtype = DType::kBFloat16, c.cache_dtype = DType::kFloat8E4M3, c.checkpoint_steps = 0;
    c.checkpoint_interval = 128;
    add(c, name);
  };
  add_fp8_vlast_cases(DType::kFloat16, DType::kBFloat16, "f8vlast");
  {
    ProblemConfig c = base({0, 0}, 1, 2);
    c.layout = StateLayout::kVLast, c.state_dtype = DType::kFloat8E4M3, c.zero_initial_rows = 0;
    add(c, "f8vlast_notokens");
    c = base({20, 30}, 1, 2);
    c.layout = StateLayout::kVLast, c.state_dtype = DType::kFloat8E4M3, c.checkpoint_interval = 64;
    c.checkpoint_steps = 1, c.cache_dtype = DType::kFloat8E4M3;
    add(c, "f8vlast_shortckpt");
  }
  // Staged states (staged_states.cu): float8_e4m3 V-last pools and checkpoints off the head pass (fp32 inputs, V = 256,
  // K = V = 256), and K-last ones past the passes' reach, through K-last fp32 copies: head dims, fp8 or 16-bit
  // checkpoints beside an fp8 pool and fp8 checkpoints beside a 16-bit pool, initial == final slot, sequences from zero
  // and without a final slot, a strided pool.
  for (auto [K, V] : std::vector<std::pair<int, int>>{{64, 64}, {128, 128}, {64, 128}, {128, 256}}) {
    ProblemConfig c = base({300, 64, 127, 0, 256, 5}, 1, 2, K, V);
    c.layout = StateLayout::kVLast, c.state_dtype = DType::kFloat8E4M3, c.slot_pad = 32;
    if (V <= 128) c.in_dtype = DType::kFloat32, c.gate_mode = GateMode::kGiven;
    add(c, "staged");
  }
  add_fp8_vlast_cases(DType::kFloat32, DType::kFloat32, "staged");
  {
    // K-last float8_e4m3 off the passes' reach: fp32 inputs at K = 64, and V = 256 at K = 64
    ProblemConfig c = base({300, 64, 127, 0, 256}, 1, 2, 64, 64);
    c.state_dtype = DType::kFloat8E4M3, c.in_dtype = DType::kFloat32, c.gate_mode = GateMode::kGiven;
    c.checkpoint_interval = 64, c.cache_dtype = DType::kFloat8E4M3, c.slot_pad = 32;
    add(c, "staged");
    c = base({200, 65, 0, 130}, 1, 2, 64, 256);
    c.state_dtype = DType::kFloat8E4M3, c.same_slot = true;
    add(c, "staged");
    // V-last K = V = 256 (the tiled pass on the copies), and a call of no tokens
    c = base({130, 64, 0, 3}, 1, 2, 256, 256);
    c.layout = StateLayout::kVLast, c.state_dtype = DType::kFloat8E4M3, c.checkpoint_interval = 64;
    c.cache_dtype = DType::kFloat8E4M3;
    add(c, "staged");
    c = base({0, 0}, 1, 2);
    c.layout = StateLayout::kVLast, c.state_dtype = DType::kFloat8E4M3, c.zero_initial_rows = 0;
    c.in_dtype = DType::kFloat32, c.gate_mode = GateMode::kGiven;
    add(c, "staged_notokens");
    // checkpoints asked of a call shorter than their interval: no entry to stage
    c = base({20, 30}, 1, 2);
    c.layout = StateLayout::kVLast, c.state_dtype = DType::kFloat8E4M3, c.checkpoint_interval = 64;
    c.checkpoint_steps = 1, c.cache_dtype = DType::kFloat8E4M3;
    c.in_dtype = DType::kFloat32, c.gate_mode = GateMode::kGiven;
    add(c, "staged_shortckpt");
  }
  // The persistent pass on one to three CTAs, so that each runs many items through its stages' ring: varlen batches
  // with empty sequences (items of no chunk), sequences from zero beside pool states (items with and without the
  // initial state's ring position), without a final slot, checkpoints at a last chunk beside the final state, fp32,
  // bf16, float8_e4m3 and V-last pools, short-path sequences skipped, no L2 norm.
  {
    const int head = cuda::chunked_prefill::kVTileHead;
    auto persistent = [&](ProblemConfig c, const std::string& tag, int ctas, int short_len = 0) {
      c.seed = 2000 + i++;
      Case x{case_name(c, tag + "_pers" + std::to_string(ctas)), c, head, 1, short_len, 1};
      x.pass_ctas = ctas;
      out.push_back(x);
    };
    std::mt19937 gen(7);
    std::vector<int32_t> lens(300);
    for (int32_t& x : lens) x = int32_t(gen() % 91);
    ProblemConfig c = base(lens, 1, 2);
    c.zero_initial_rows = 40, c.no_final_rows = 20;
    persistent(c, "many", 1);
    persistent(c, "many_short", 3, -1);
    c = base({5, 0, 1000, 64, 129, 1, 300, 0, 17}, 1, 2);
    c.checkpoint_interval = 64, c.slot_pad = 16;
    persistent(c, "mixed_ckpt", 3);
    c.cache_dtype = DType::kBFloat16, c.state_dtype = DType::kBFloat16, c.same_slot = true;
    persistent(c, "mixed_ckpt", 1);
    c = base({700, 64, 333, 0, 65}, 2, 4);
    c.state_dtype = DType::kFloat8E4M3, c.checkpoint_interval = 64, c.cache_dtype = DType::kFloat8E4M3;
    c.slot_pad = 32;
    persistent(c, "f8", 2);
    c.layout = StateLayout::kVLast;
    persistent(c, "f8vlast", 2);
    c = base({130, 64, 1, 0, 257, 40}, 1, 4);
    c.layout = StateLayout::kVLast, c.zero_initial_rows = 2;
    persistent(c, "vlast", 2);
    c = base({130, 64, 1, 0, 257, 40}, 2, 4);
    c.use_qk_l2norm = false, c.gate_mode = GateMode::kGiven, c.in_dtype = DType::kFloat16;
    persistent(c, "nol2", 1);
  }
  // Checkpoints by bulk copies through a stage (head_state_io.cuh store_head_checkpoint_bulk) beside the prep
  // warpgroup, fp32 (two rounds a warpgroup) and bf16, one at a sequence's last chunk beside its final state; the
  // other two-warpgroup build's per-thread stores.
  for (DType cache : {DType::kFloat32, DType::kBFloat16})
    for (int aux : {0, 1}) {
      ProblemConfig c = base({640, 64, 333, 1000}, 1, 2);
      c.checkpoint_interval = 64, c.cache_dtype = cache, c.slot_pad = 16;
      add(c, "bulk_aux" + std::to_string(aux), cuda::chunked_prefill::kVTileHead, 1, aux);
    }
  return out;
}

// Initial == final slot, then sequences from zero and without a final slot, through add(config, tag, param) of a
// case table (tags `tag` and `tag_zero_init_no_final`).
template <class Add>
void add_slot_cases(Add&& add, std::vector<int32_t> lens, const std::string& tag, int param) {
  ProblemConfig c = base(std::move(lens), 1, 2);
  c.same_slot = true;
  add(c, tag, param);
  c.same_slot = false, c.zero_initial_rows = 3, c.no_final_rows = 2;
  add(c, tag + (tag.empty() ? "" : "_") + "zero_init_no_final", param);
}

// ---- the short-sequence path (recurrent kernels, RecurrentOp::kPrefill) beside the chunked kernels ----
// Lengths around its reach (0, 1, 2 and 3 around the chain kernel's threshold, max_len, max_len + 1) in
// one batch with longer sequences, so both paths run and each must leave the other's sequences alone.
std::vector<Case> short_cases() {
  std::vector<Case> out;
  int i = 0;
  auto add = [&](ProblemConfig c, const std::string& tag, int short_len) {
    c.seed = 4000 + i++;
    out.push_back({case_name(c, tag), c, 0, 0, short_len});
  };
  for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast})
    for (DType state : {DType::kFloat32, DType::kBFloat16})
      for (DType in : {DType::kBFloat16, DType::kFloat16})
        for (GateMode gate : {GateMode::kFused, GateMode::kGiven}) {
          const int K = i % 3 == 2 ? 64 : 128;
          ProblemConfig c = base({1, 7, 32, 0, 33, 100, 5, 2, 3}, 2, 4, K, K);
          c.layout = layout, c.state_dtype = state, c.in_dtype = in, c.gate_mode = gate;
          c.use_qk_l2norm = gate == GateMode::kFused || i % 2 == 1;
          c.gate_dtype = (i % 2) ? DType::kBFloat16 : DType::kFloat32;
          if (i % 3 == 1) c.token_pad = 24, c.head_pad = 8;
          if (i % 3 == 0) c.slot_pad = 40;
          if (i % 4 == 3) c.cu_seqlens_dtype = DType::kInt64;
          add(c, "short32", 32);
        }
  // The warp kernel alone (max_len 2 < the chain kernel's 3 tokens), and the chain kernel over 8 chunks.
  add(base({2, 1, 0, 2, 70}), "short2", 2);
  add(base({63, 17, 64, 8, 1}), "short63", 63);
  // Checkpoints: a short sequence stores none, but its checkpoint slot is still checked.
  {
    ProblemConfig c = base({10, 64, 130, 3, 63}, 1, 2);
    c.checkpoint_interval = 64;
    add(c, "short63", 63);
  }
  // Initial == final slot, sequences without a final slot or from zero.
  add_slot_cases(add, {5, 64, 0, 20}, "short32", 32);
  // float8_e4m3 V-last pools in place: short sequences only, and beside chunked ones by the library's routing.
  {
    ProblemConfig c = base({1, 7, 16, 0, 9, 3}, 2, 4);
    c.layout = StateLayout::kVLast, c.state_dtype = DType::kFloat8E4M3;
    add(c, "f8vlast_short16", 16);
    c = base({3, 200, 17, 0, 64, 9}, 2, 4);
    c.layout = StateLayout::kVLast, c.state_dtype = DType::kFloat8E4M3, c.same_slot = true;
    add(c, "f8vlast_auto", -1);
  }
  // The recurrent kernels alone (cuda::prefill_short, no chunked kernel launched), so that the outputs
  // and final states can only be theirs: the chain kernel (K-last, bf16 inputs) and the warp kernel.
  for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast}) {
    ProblemConfig c = base({1, 7, 32, 0, 20, 3}, 2, 4);
    c.layout = layout;
    c.seed = 4000 + i++;
    out.push_back({case_name(c, "short_only"), c, kShortOnly, 0, 32});
  }
  // The library's default routing of mixed batches through the public API (short_len < 0): with the
  // host copy both paths run; without it too, the grid over every sequence being small (36 rows). Lengths
  // at the reach (16, 17) of K-last pools with bf16 inputs.
  {
    ProblemConfig c = base({3, 200, 17, 0, 64, 9, 16, 25, 1}, 2, 4);
    add(c, "mixed_auto", -1);
    c.pass_cu_seqlens_host = false;
    add(c, "mixed_auto_nohost", -1);
    c.layout = StateLayout::kVLast, c.state_dtype = DType::kBFloat16, c.pass_cu_seqlens_host = true;
    add(c, "mixed_auto", -1);
  }
  // The library's choice through the public API, qwen3-next heads: only short sequences (a host copy of
  // cu_seqlens: the chunked kernels are not launched), and the same without the host copy (mean length
  // <= max_len: both paths launched, the chunked kernels skipping every sequence).
  {
    std::mt19937 gen(11);
    std::vector<int32_t> lens(40);
    for (int32_t& x : lens) x = int32_t(gen() % 17);
    ProblemConfig c = base(lens, 16, 32);
    c.zero_initial_rows = 5;
    add(c, "auto", -1);
    c.pass_cu_seqlens_host = false;
    add(c, "auto_nohost", -1);
    c.layout = StateLayout::kVLast, c.state_dtype = DType::kBFloat16;
    add(c, "auto_nohost", -1);
  }
  // float8_e4m3 K-last pools on the warp kernel (WarpTile::load_e4m3 / store_e4m3) beside the chunked kernels, and
  // alone.
  for (int K : {64, 128}) {
    ProblemConfig c = base({1, 7, 32, 0, 33, 100, 5, 2, 3}, 2, 4, K, K);
    c.state_dtype = DType::kFloat8E4M3, c.slot_pad = K == 64 ? 32 : 0;
    add(c, "short32", 32);
  }
  {
    ProblemConfig c = base({1, 7, 16, 0, 20, 3}, 2, 4);
    c.state_dtype = DType::kFloat8E4M3, c.in_dtype = DType::kFloat16;
    c.seed = 4000 + i++;
    out.push_back({case_name(c, "short_only"), c, kShortOnly, 0, 32});
    c.same_slot = true;
    add(c, "short16", 16);
  }
  return out;
}

// Small cases for compute-sanitizer (memcheck, racecheck): each kernel path once.
std::vector<Case> sanitize_cases() {
  std::vector<Case> out;
  int i = 0;
  for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast}) {
    ProblemConfig c = base({0, 1, 65, 130}, 1, 2, 64, 64);
    c.layout = layout;
    c.state_dtype = layout == StateLayout::kKLast ? DType::kFloat32 : DType::kBFloat16;
    c.checkpoint_interval = 64;
    c.token_pad = 8;
    c.seed = 3000 + i++;
    out.push_back({case_name(c), c});
  }
  ProblemConfig c = base({70, 3}, 1, 2, 128, 128);
  c.seed = 3000 + i++;
  out.push_back({case_name(c), c, 32});
  c.seed = 3000 + i++;
  c.checkpoint_interval = 64;
  for (int aux : {0, 1, 2}) {
    out.push_back({case_name(c, aux > 0 ? "head_aux" + std::to_string(aux) : "head"), c,
                   cuda::chunked_prefill::kVTileHead, 1, 0, aux});
    c.seed = 3000 + i++;
  }
  {  // the default prep warpgroup (M) over 11 chunks: its stages' mbarrier phases wrap; then with checkpoints by bulk
     // copies through the stages (fp32 in two rounds a warpgroup, bf16 in one)
    ProblemConfig l = base({650, 70}, 1, 2, 128, 128);
    l.seed = 3000 + i++;
    out.push_back({case_name(l, "long_aux1"), l, cuda::chunked_prefill::kVTileHead, 1, 0, 1});
    for (DType cache : {DType::kFloat32, DType::kBFloat16}) {
      l.checkpoint_interval = 128, l.cache_dtype = cache, l.seed = 3000 + i++;
      out.push_back({case_name(l, "long_aux1"), l, cuda::chunked_prefill::kVTileHead, 1, 0, 1});
    }
  }
  out.push_back({case_name(c, "head2"), c, cuda::chunked_prefill::kVTileHead, 2});
  c.seed = 3000 + i++;
  out.push_back({case_name(c, "headwarp"), c, cuda::chunked_prefill::kVTileHeadWarp, 1});
  // The short-sequence path: the chain kernel (K-last, bf16 inputs) and the warp kernel's staged V-last.
  for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast}) {
    ProblemConfig s = base({0, 5, 20, 40, 2}, 1, 2, 64, 64);
    s.layout = layout;
    s.seed = 3000 + i++;
    out.push_back({case_name(s, "short"), s, 0, 0, 32});
  }
  return out;
}

// ---- context parallelism (context_parallel.cuh), forced with short segments on small problems --------------
// Lengths around the segment (len - 1, len, len + 1, one chunk past, several segments), varlen batches of cut and
// uncut sequences, checkpoints crossing segments, initial == final slot, both layouts, bf16 pools, fp16 inputs,
// given gates, K = V = 64, the long-memory regime, with and without the prep warpgroup. Each case twice: the first
// segment's final pass after the scan ("_after", the scan's CTAs of 8 columns) and beside the local pass ("_beside",
// of 32).
std::vector<Case> cp_cases() {
  std::vector<Case> out;
  int i = 0;
  auto add = [&](ProblemConfig c, const std::string& tag, int cp, int aux = -1) {
    c.seed = 6000 + i++;
    for (int first_final : {0, 1}) {
      Case x{case_name(c, tag + "_cp" + std::to_string(cp) + (first_final ? "_beside" : "_after")), c};
      x.cp = cp, x.aux = aux, x.first_final = first_final;
      out.push_back(x);
    }
  };
  for (int len : {127, 128, 129, 192, 1000}) add(base({len}, 1, 2), "len" + std::to_string(len), 128);
  add(base({5, 0, 1000, 64, 129, 1, 300, 0, 17}, 1, 2), "mixed", 128);
  add(base({5, 0, 1000, 64, 129, 1, 300, 0, 17}, 1, 2), "mixed", 192);
  for (int aux : {0, 1}) add(base({700, 64, 300}, 2, 4), "aux" + std::to_string(aux), 128, aux);
  {  // the short path beside context parallelism: sequences of at most 32 tokens on the recurrent kernels
    ProblemConfig c = base({5, 20, 1000, 64, 300, 32, 0}, 1, 2);
    c.seed = 6000 + i++;
    for (int first_final : {0, 1}) {
      Case x{case_name(c, first_final ? "short32_cp128_beside" : "short32_cp128_after"), c};
      x.cp = 128, x.short_len = 32, x.first_final = first_final;
      out.push_back(x);
    }
  }
  {
    ProblemConfig c = base({1000, 130, 640}, 1, 2);
    c.checkpoint_interval = 64;
    add(c, "", 192);
    c.checkpoint_interval = 128, c.cache_dtype = DType::kBFloat16, c.checkpoint_steps = 5;
    add(c, "fewsteps", 128);
    c.checkpoint_interval = 64, c.cache_dtype = DType::kFloat8E4M3, c.checkpoint_steps = 0, c.slot_pad = 32;
    add(c, "", 192);  // float8_e4m3 checkpoints from the final pass of every segment
  }
  add_slot_cases(add, {600, 64, 0, 333}, "", 128);
  for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast})
    for (DType state : {DType::kFloat32, DType::kBFloat16}) {
      ProblemConfig c = base({900, 70}, 1, 2);
      c.layout = layout, c.state_dtype = state;
      c.in_dtype = state == DType::kBFloat16 ? DType::kFloat16 : DType::kBFloat16;
      c.gate_mode = layout == StateLayout::kVLast ? GateMode::kGiven : GateMode::kFused;
      if (state == DType::kBFloat16) c.slot_pad = 40, c.token_pad = 24, c.head_pad = 8;
      add(c, "", 256);
    }
  for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast}) {
    ProblemConfig c = base({800, 129, 5}, 2, 8, 64, 64);
    c.layout = layout;
    add(c, "dims", 128);
  }
  {
    ProblemConfig c = base({2000, 3}, 1, 2);
    c.long_memory = true;
    add(c, "long", 256);
    c.use_qk_l2norm = false;
    add(c, "long_nol2", 320);
  }
  // float8_e4m3 K-last pools: the scan reads a cut sequence's initial state and writes its final state (cp_scan_kernel),
  // the final pass those of the uncut ones; with fp8 checkpoints, and in place.
  {
    ProblemConfig c = base({1000, 130, 640, 0}, 1, 2);
    c.state_dtype = DType::kFloat8E4M3;
    add(c, "", 128);
    c.checkpoint_interval = 64, c.cache_dtype = DType::kFloat8E4M3, c.slot_pad = 32;
    for (int aux : {0, 1}) add(c, "aux" + std::to_string(aux), 192, aux);
    c.checkpoint_interval = 0, c.same_slot = true;
    add(c, "", 256);
    // ... and V-last ones (the final pass's warp pairs store the blocks), with fp8 checkpoints
    c.layout = StateLayout::kVLast, c.same_slot = false;
    c.checkpoint_interval = 64, c.cache_dtype = DType::kFloat8E4M3;
    add(c, "f8vlast", 128);
    for (int aux : {0, 1}) add(c, "f8vlast_aux" + std::to_string(aux), 192, aux);
  }
  return out;
}

// Without the in-kernel L2 norm the problem feeds unit-scale q and k (ProblemConfig::unit_qk says why).
Problem make_problem(const ProblemConfig& c) {
  ProblemConfig u = c;
  u.unit_qk = !c.use_qk_l2norm;
  return Problem(u);
}

class PrefillTest : public ::testing::TestWithParam<Case> {};

TEST_P(PrefillTest, MatchesCpuReference) {
  const Case& c = GetParam();
  check_prefill(make_problem(c.cfg), c.vtile, c.head_split, c.short_len, c.aux, c.cp, -1, c.first_final, 0,
                c.pass_ctas);
}

INSTANTIATE_TEST_SUITE_P(Axes, PrefillTest, ::testing::ValuesIn(axes_cases()),
                         [](const auto& info) { return info.param.name; });
INSTANTIATE_TEST_SUITE_P(Shapes, PrefillTest, ::testing::ValuesIn(shape_cases()),
                         [](const auto& info) { return info.param.name; });
INSTANTIATE_TEST_SUITE_P(Short, PrefillTest, ::testing::ValuesIn(short_cases()),
                         [](const auto& info) { return info.param.name; });
INSTANTIATE_TEST_SUITE_P(ContextParallel, PrefillTest, ::testing::ValuesIn(cp_cases()),
                         [](const auto& info) { return info.param.name; });
INSTANTIATE_TEST_SUITE_P(Sanitize, PrefillTest, ::testing::ValuesIn(sanitize_cases()),
                         [](const auto& info) { return info.param.name; });

// Slots >= their buffer: the sequence is skipped (o = 0, no state stored) and counted once each. The
// library's choice (the short path takes 10 and 5), the chunked kernels alone, and the short path at 24
// (the bad initial and checkpoint slots on its sequences, the bad final slot on a chunked one).
TEST(PrefillGpu, OutOfRangeSlotsSkippedAndCountedSanitize) {
  for (int short_len : {-1, 0, 24, -2}) {  // -2: the library's choice on float8_e4m3 V-last states
    SCOPED_TRACE("short_len " + std::to_string(short_len));
    ProblemConfig c = base({70, 10, 65, 5}, 1, 2, 64, 64);
    c.zero_initial_rows = 0;
    c.checkpoint_interval = 64;
    if (short_len == -2) {
      c.layout = StateLayout::kVLast, c.state_dtype = DType::kFloat8E4M3, c.cache_dtype = DType::kFloat8E4M3;
      short_len = -1;
    }
    Problem p(c);
    p.as<int32_t>("initial_indices")[1] = int32_t(p.num_slots());
    p.as<int32_t>("final_indices")[2] = int32_t(p.num_slots()) + 7;
    p.as<int32_t>("checkpoint_indices")[3] = 1000;
    check_prefill(p, 0, 0, short_len);
    Problem got = p;
    {
      DeviceProblem dev(got);
      run_gpu(got, dev, 0, 0, short_len);
    }
    EXPECT_EQ(got.as<int32_t>("error_flag")[0], 3);
    const std::vector<double> o = got.read_tokens("o");
    for (int32_t r = 1; r < 4; ++r)
      EXPECT_TRUE(AllZero("o of sequence " + std::to_string(r),
                          token_rows(o, int64_t(c.HV) * c.V, p.row_start(r), p.row_start(r) + p.row_len(r))));
  }
}

// float8_e4m3 V-last states come back as the CPU backend stores them, in place (bf16 inputs) and staged (fp32 inputs):
// sequences of no tokens store their initial state again (dequantized to fp32, requantized by block), byte for byte
// and scale for scale, K 64 and 128; beside them a sequence of tokens, and all of it within the tolerances.
TEST(PrefillGpu, Fp8VLastStatesStoreTheCpuBackendsBytes) {
  for (DType input : {DType::kBFloat16, DType::kFloat32})
  for (int K : {64, 128}) {
    SCOPED_TRACE("K " + std::to_string(K) + ", " + dtype_name(input) + " inputs");
    ProblemConfig c = base({0, 0, 130, 0}, 1, 2, K, K);
    c.layout = StateLayout::kVLast, c.state_dtype = DType::kFloat8E4M3, c.zero_initial_rows = 0;
    c.in_dtype = input;
    c.seed = 4600 + K;
    const Problem before(c);
    check_prefill(before);
    Problem ref = before, got = before;
    prefill(ref.prefill_params(PrefillAlgorithm::kRecurrent), {Backend::kCPU, nullptr});
    {
      DeviceProblem dev(got);
      run_gpu(got, dev, 0);
    }
    const int64_t elems = before.state_elems(), blocks = elems / kFp8Block;
    const int32_t* fin = before.as<int32_t>("final_indices");
    for (int32_t n = 0; n < before.rows(); ++n) {
      if (before.row_len(n) != 0 || fin[n] < 0) continue;
      const int64_t at = fin[n] * before.slot_stride();
      EXPECT_EQ(std::memcmp(got.as<uint8_t>("state") + at, ref.as<uint8_t>("state") + at, size_t(elems)), 0)
          << "bytes of sequence " << n;
      EXPECT_EQ(std::memcmp(got.as<uint8_t>("state_scales") + fin[n] * blocks,
                            ref.as<uint8_t>("state_scales") + fin[n] * blocks, size_t(blocks)), 0)
          << "scales of sequence " << n;
    }
  }
}

// The head pass waiting for each chunk's count (Plan::chunk_ready) computes what it does after the chunk prep's grid:
// the outputs, final states, checkpoints and error flag of both bit for bit, and within the tolerances of the fp64
// recurrence; beside the prep warpgroup (a varlen batch with an empty sequence and checkpoints) and in the head split's
// one state warpgroup (one sequence, and a batch of few heads), the override taking it wherever a producer can.
TEST(PrefillGpu, ChunkFlagsMatchTheGridWait) {
  struct Set {
    std::vector<int32_t> lens;
    int H, HV, aux;
  };
  const Set sets[] = {{{700, 0, 1000, 333, 256}, 2, 4, 1}, {{1000}, 1, 2, -1}, {{300, 0, 129, 640}, 2, 8, -1}};
  int seed = 4700;
  for (const Set& s : sets) {
    SCOPED_TRACE("sequences " + std::to_string(s.lens.size()) + ", HV " + std::to_string(s.HV));
    ProblemConfig c = base(s.lens, s.H, s.HV);
    c.checkpoint_interval = 128;
    c.seed = seed++;
    const Problem before(c);
    const int vtile = s.aux > 0 ? cuda::chunked_prefill::kVTileHead : 0, split = s.aux > 0 ? 1 : 0;
    check_prefill(before, vtile, split, -1, s.aux, -1, 1);
    Problem flags = before, grid = before;
    {
      DeviceProblem dev(flags);
      run_gpu(flags, dev, vtile, split, -1, s.aux, -1, 1);
    }
    {
      DeviceProblem dev(grid);
      run_gpu(grid, dev, vtile, split, -1, s.aux, -1, 0);
    }
    for (const Buffer& b : flags.buffers())
      if (b.is_output) EXPECT_TRUE(BitwiseEqual(b.name + " (chunk counts)", b, grid.buffer(b.name)));
  }
}

// The persistent pass (one CTA per SM, or one to three, taking the (sequence, value head) items in turn) computes what
// one CTA per item does, bit for bit: outputs, final states, checkpoints and the error flag, with the initial, final
// and checkpoint slot of three sequences past their buffers (skipped, counted once, their o zeroed by the producer),
// waiting for each chunk's count or for the prep's grid, at K = 128 and 64, taking the sequences longest first (with and
// without the host's cu_seqlens) or in their order; and within the fp64 recurrence's tolerances.
TEST(PrefillGpu, PersistentPassMatchesOneCtaPerItem) {
  constexpr int kHead = cuda::chunked_prefill::kVTileHead;
  for (int K : {128, 64})
    for (int flags : {0, 1}) {
      SCOPED_TRACE("K " + std::to_string(K) + ", chunk counts " + std::to_string(flags));
      ProblemConfig c = base({70, 10, 65, 5, 200, 0, 129, 64}, 1, 4, K, 128);
      c.checkpoint_interval = 64;
      c.seed = 4800 + K + flags;
      Problem before(c);
      before.as<int32_t>("initial_indices")[1] = int32_t(before.num_slots());
      before.as<int32_t>("final_indices")[2] = int32_t(before.num_slots()) + 7;
      before.as<int32_t>("checkpoint_indices")[3] = 1000;
      check_prefill(before, kHead, 1, 0, 1, 0, flags, -1, 0, 3);
      // this build on one CTA per item (persistent 0) or persistent on `ctas` CTAs (0: one per SM), taking the
      // sequences longest first (the library's choice for these lengths; also without the host's cu_seqlens) or not
      const auto run = [&](Problem& got, int persistent, int ctas, int longest_first = -1, bool host = true) {
        cuda::Overrides o = case_overrides(kHead, 1, 0, 1, 0, flags);
        o.prefill_persistent = persistent, o.prefill_persistent_ctas = ctas;
        o.prefill_longest_first = longest_first;
        const cuda::chunked_prefill::PrefillChoice choice = run_gpu_with(got, o, host);
        EXPECT_EQ(choice.persistent_pass, persistent > 0);
        EXPECT_EQ(choice.chunk_flags, flags > 0);
        EXPECT_EQ(choice.longest_first, persistent > 0 && longest_first != 0);
      };
      Problem per_item = before;
      run(per_item, 0, 0);
      EXPECT_EQ(per_item.as<int32_t>("error_flag")[0], 3);
      struct Run {
        int ctas, longest_first;
        bool host;
      };
      for (const Run r : {Run{1, -1, true}, Run{3, -1, true}, Run{0, -1, true}, Run{0, 0, true}, Run{3, -1, false}}) {
        SCOPED_TRACE("persistent CTAs " + std::to_string(r.ctas) + ", longest first " +
                     std::to_string(r.longest_first) + (r.host ? "" : ", no host cu_seqlens"));
        Problem persistent = before;
        run(persistent, 1, r.ctas, r.longest_first, r.host);
        for (const Buffer& b : persistent.buffers())
          if (b.is_output) EXPECT_TRUE(BitwiseEqual(b.name + " (persistent)", b, per_item.buffer(b.name)));
      }
    }
}

// The head pass of one CTA per item takes the sequences longest first where its grid is more than one wave: each CTA
// reads its sequence through the order (a long prompt after short ones, an empty one, bad initial and final slots,
// checkpoints), bitwise equal to the grid's own order and within the fp64 recurrence's tolerances, at K = 128 and 64,
// beside the prep warpgroup forming M or the whole prep, without it, and on the head split.
TEST(PrefillGpu, OneCtaPerItemLongestFirstMatchesGridOrder) {
  constexpr int kHead = cuda::chunked_prefill::kVTileHead;
  const std::vector<int32_t> lens = {70, 10, 65, 5, 200, 0, 129, 64, 100, 900};
  // more (sequence, value head) CTAs than SMs, HV a multiple of H = 2
  const int HV = std::max(4, (cuda::device_sms() / int(lens.size()) + 2) / 2 * 2);
  struct Build {
    int split, aux;
  };
  for (int K : {128, 64}) {
    ProblemConfig c = base(lens, 2, HV, K, 128);
    c.checkpoint_interval = 64;
    c.seed = 5200 + K;
    Problem before(c);
    before.as<int32_t>("initial_indices")[3] = int32_t(before.num_slots());
    before.as<int32_t>("final_indices")[6] = int32_t(before.num_slots()) + 3;
    Problem ref = before;
    prefill(ref.prefill_params(PrefillAlgorithm::kRecurrent), {Backend::kCPU, nullptr});
    for (const Build bd : {Build{1, 1}, Build{1, 0}, Build{1, 2}, Build{2, 0}}) {
      SCOPED_TRACE("K " + std::to_string(K) + ", HV " + std::to_string(HV) + ", head split " +
                   std::to_string(bd.split) + ", prep warpgroup " + std::to_string(bd.aux));
      const auto run = [&](Problem& got, int longest_first) {
        cuda::Overrides o = case_overrides(kHead, bd.split, 0, bd.aux);
        o.prefill_persistent = 0, o.prefill_longest_first = longest_first;
        const cuda::chunked_prefill::PrefillChoice choice = run_gpu_with(got, o);
        EXPECT_FALSE(choice.persistent_pass);
        EXPECT_EQ(choice.head_split, bd.split);
        EXPECT_EQ(choice.longest_first, longest_first != 0);
      };
      Problem in_order = before, longest = before;
      run(in_order, 0);
      run(longest, -1);  // the library's choice for these lengths
      check_prefill_results(before, longest, ref);
      EXPECT_EQ(longest.as<int32_t>("error_flag")[0], 2);
      for (const Buffer& b : longest.buffers())
        if (b.is_output) EXPECT_TRUE(BitwiseEqual(b.name + " (longest first)", b, in_order.buffer(b.name)));
    }
  }
}

// The head pass's order (item_order.cuh) is the sequence indices stably sorted by length class, longest first:
// against std::stable_sort for counts around the kernel's tiles of 1024 and far past them, random lengths with empty
// and bad spans among them, int32 and int64 cu_seqlens; the buffer poisoned first.
TEST(PrefillGpu, LongestFirstOrderIsAStableSortByClass) {
  namespace cp = cuda::chunked_prefill;
  std::mt19937 rng(2911);
  for (const bool wide : {false, true})
    for (const int N : {1, 2, 31, 33, 1000, 1023, 1024, 1025, 3000, 70000}) {
      SCOPED_TRACE("N " + std::to_string(N) + (wide ? ", int64" : ", int32"));
      std::vector<int64_t> cu(size_t(N) + 1, 0);
      for (int n = 0; n < N; ++n) {
        const uint32_t pick = rng() % 16;
        const int64_t len = pick == 0 ? 0 : pick < 12 ? int64_t(rng() % 300) : int64_t(rng() % 20000);
        cu[size_t(n) + 1] = cu[size_t(n)] + len;
      }
      if (N > 2) cu[2] = cu[1] - 1;  // a bad span (end before start): class 0, and the next one longer
      std::vector<int32_t> cu32(cu.begin(), cu.end());
      void* d_cu = nullptr;
      int32_t* d_order = nullptr;
      const size_t cu_bytes = wide ? cu.size() * 8 : cu.size() * 4;
      GDNKIT_TEST_CUDA(cudaMalloc(&d_cu, cu_bytes));
      GDNKIT_TEST_CUDA(cudaMalloc(&d_order, size_t(N) * 4));
      GDNKIT_TEST_CUDA(cudaMemcpy(d_cu, wide ? static_cast<const void*>(cu.data()) : cu32.data(), cu_bytes,
                                  cudaMemcpyHostToDevice));
      GDNKIT_TEST_CUDA(cudaMemset(d_order, 0xff, size_t(N) * 4));
      GDNKIT_TEST_CUDA(cudaDeviceSynchronize());
      PrefillParams p;
      p.num_seqs = N;
      p.total_tokens = cu.back();
      p.cu_seqlens = d_cu;
      p.cu_seqlens_dtype = wide ? DType::kInt64 : DType::kInt32;
      cp::order_longest_first(p, d_order, nullptr);
      std::vector<int32_t> got(static_cast<size_t>(N));
      GDNKIT_TEST_CUDA(cudaMemcpy(got.data(), d_order, size_t(N) * 4, cudaMemcpyDeviceToHost));
      cudaFree(d_cu);
      cudaFree(d_order);
      std::vector<int32_t> want(static_cast<size_t>(N));
      for (int n = 0; n < N; ++n) want[size_t(n)] = n;
      std::stable_sort(want.begin(), want.end(), [&](int32_t a, int32_t b) {
        return cp::length_class(cu[size_t(a)], cu[size_t(a) + 1]) > cp::length_class(cu[size_t(b)], cu[size_t(b) + 1]);
      });
      EXPECT_EQ(got, want);
    }
}

// The chunk prep in parts (Plan::prep_parts: several CTAs per chunk and q/k head, each a share of the GVA group's value
// heads) computes what one CTA per group does, bit for bit, and within the tolerances of the fp64 recurrence: with M
// formed by the prep (the head split's one state warpgroup) and without (the prep warpgroup), waiting per chunk (whose
// count then takes every part) and for the grid, fused and given gates, and under context parallelism.
TEST(PrefillGpu, PrepPartsMatchOneCtaPerGroup) {
  struct Set {
    std::vector<int32_t> lens;
    int H, HV, vtile, split, aux, flags, cp;
    GateMode gate;
    int dim = 128;  // K = V
  };
  constexpr int kHead = cuda::chunked_prefill::kVTileHead;
  const Set sets[] = {
      {{700, 0, 1000, 333, 256}, 2, 8, kHead, 2, 0, 1, -1, GateMode::kFused},  // M in the prep, counts per chunk
      {{700, 0, 1000, 333, 256}, 2, 8, kHead, 2, 0, 0, -1, GateMode::kGiven},  // ... the grid wait, given gates
      {{300, 0, 129, 640}, 1, 4, kHead, 1, 1, 1, -1, GateMode::kFused},        // M in the prep warpgroup
      {{1000, 65}, 2, 6, kHead, 2, 0, -1, -1, GateMode::kFused},               // groups of 3
      {{4096, 100}, 2, 8, 0, 0, -1, -1, 1024, GateMode::kFused},               // context parallelism
      {{700, 0, 300, 64}, 2, 8, kHead, 2, 0, -1, -1, GateMode::kFused, 64},    // K = 64, T' and M row-major (mma.sync)
  };
  int seed = 4800;
  for (const Set& s : sets) {
    const int group = s.HV / s.H;
    SCOPED_TRACE("sequences " + std::to_string(s.lens.size()) + ", group " + std::to_string(group) + ", cp " +
                 std::to_string(s.cp) + ", flags " + std::to_string(s.flags) + ", K " + std::to_string(s.dim));
    ProblemConfig c = base(s.lens, s.H, s.HV, s.dim, s.dim);
    c.gate_mode = s.gate;
    c.checkpoint_interval = 128;
    c.seed = seed++;
    const Problem before(c);
    Problem one = before;
    {
      DeviceProblem dev(one);
      run_gpu(one, dev, s.vtile, s.split, -1, s.aux, s.cp, s.flags, -1, 1);
    }
    for (int parts = 2; parts <= group; ++parts) {
      if (group % parts != 0) continue;
      SCOPED_TRACE("parts " + std::to_string(parts));
      check_prefill(before, s.vtile, s.split, -1, s.aux, s.cp, s.flags, -1, parts);
      Problem split = before;
      {
        DeviceProblem dev(split);
        run_gpu(split, dev, s.vtile, s.split, -1, s.aux, s.cp, s.flags, -1, parts);
      }
      for (const Buffer& b : split.buffers())
        if (b.is_output) EXPECT_TRUE(BitwiseEqual(b.name + " (prep in parts)", b, one.buffer(b.name)));
    }
  }
}

// A cu_seqlens span out of order with the short path on: the CPU backend refuses such cu_seqlens (it
// reads them), so the chunked kernels alone are the reference here. Sequence 1's span [10, 8) is skipped
// and counted once by the chunked kernels and left alone by the recurrent kernels; sequence 2 then runs
// [8, 18) (its first two tokens are also sequence 0's, whose o rows both write: not compared). No host
// copy of cu_seqlens (it would show the good spans): the mean length is within the reach, both paths run.
TEST(PrefillGpu, BadSpanWithShortPathSanitize) {
  ProblemConfig c = base({10, 5, 3, 20, 8, 70}, 1, 2);
  c.pass_cu_seqlens_host = false;
  c.seed = 4500;
  Problem before(c);
  int32_t* cu = before.as<int32_t>("cu_seqlens");
  cu[2] = cu[1] - 2;
  before.as<int32_t>("final_indices")[1] = -1;  // the skipped sequence stores nothing either way
  Problem chunked = before, both = before;
  {
    DeviceProblem dev(chunked);
    run_gpu(chunked, dev, 0, 0, 0);
  }
  {
    DeviceProblem dev(both);
    run_gpu(both, dev, 0, 0, 24);
  }
  EXPECT_EQ(chunked.as<int32_t>("error_flag")[0], 1);
  EXPECT_EQ(both.as<int32_t>("error_flag")[0], 1);
  const int64_t row = int64_t(c.HV) * c.V, total = before.row_start(5) + before.row_len(5);
  const std::vector<double> o0 = chunked.read_tokens("o"), o1 = both.read_tokens("o");
  const double tol = output_tolerance(OpFamily::kPrefill, c.in_dtype);
  EXPECT_TRUE(RelClose("o, tokens 0..7", token_rows(o1, row, 0, 8), token_rows(o0, row, 0, 8), tol));
  EXPECT_TRUE(RelClose("o, tokens 10..", token_rows(o1, row, 10, total), token_rows(o0, row, 10, total), tol));
  std::vector<int64_t> written;
  for (int32_t r : {0, 2, 3, 4, 5}) written.push_back(before.as<int32_t>("final_indices")[r]);
  EXPECT_TRUE(SlotsClose(both, chunked, written, state_tolerance(OpFamily::kPrefill, c.state_dtype)));
  EXPECT_TRUE(UntouchedSlotsEqual(before, both, "state", written));
}

// Same inputs twice, a graph capture (library workspace, sized by an eager call first) and a run
// with a caller workspace: all bit-identical to one eager run, which matches the reference.
// The chunked kernels as the heuristic picks them, then with context-parallel segments of 128 tokens.
// (cp -2: the persistent pass on two CTAs, whose item counter the graph zeroes on every replay)
TEST(PrefillGpu, GraphReplayRepeatAndCallerWorkspaceBitwiseEqualEager) {
  for (int cp : {-1, 128, -128, -2})  // -128: segments of 128 with the first one's final pass beside the local pass
  for (int form : {0, 1, 2, 3}) {  // K-last fp32, V-last fp32, V-last float8_e4m3 in place and (fp32 inputs) staged
    if (form == 3 && cp != -1) continue;  // context parallelism takes 16-bit inputs
    const StateLayout layout = form == 0 ? StateLayout::kKLast : StateLayout::kVLast;
    SCOPED_TRACE("context-parallel segment " + std::to_string(cp) + ", form " + std::to_string(form));
    cuda::Overrides o;
    o.prefill_cp_segment_len = cp == -128 ? 128 : cp == -2 ? 0 : cp;
    o.prefill_cp_first_final = cp == -128 ? 1 : cp > 0 ? 0 : -1;
    o.prefill_cp_scan_cols = cp == -128 ? 32 : 0;
    if (cp == -2) o.prefill_head_split = 1, o.prefill_persistent = 1, o.prefill_persistent_ctas = 2;
    const cuda::ScopedOverrides scoped(o);
    ProblemConfig c = base({300, 1, 64, 129}, 2, 4);
    c.layout = layout;
    c.checkpoint_interval = 64;
    if (form >= 2) c.state_dtype = DType::kFloat8E4M3, c.cache_dtype = DType::kFloat8E4M3;
    if (form == 3) c.in_dtype = DType::kFloat32, c.gate_mode = GateMode::kGiven;
    const Problem before(c);
    Problem eager = before, again = before, graphed = before, own_ws = before;
    DeviceProblem d_eager(eager), d_again(again), d_graph(graphed), d_ws(own_ws);
    if (cp == -2) {
      const PrefillParams probe = eager.prefill_params(PrefillAlgorithm::kAuto, d_eager.resolver());
      const PrefillParams shape = cuda::chunked_prefill::pass_params(probe);
      EXPECT_TRUE(cuda::chunked_prefill::choose_prefill(shape, cuda::device_sms(), o).persistent_pass);
    }
    // The library's workspace is shared by the calls on every stream: each call completes before the next.
    prefill(eager.prefill_params(PrefillAlgorithm::kAuto, d_eager.resolver()), {Backend::kCUDA, d_eager.stream()});
    GDNKIT_TEST_CUDA(cudaStreamSynchronize(d_eager.stream()));
    prefill(again.prefill_params(PrefillAlgorithm::kAuto, d_again.resolver()), {Backend::kCUDA, d_again.stream()});
    GDNKIT_TEST_CUDA(cudaStreamSynchronize(d_again.stream()));

    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    GDNKIT_TEST_CUDA(cudaStreamBeginCapture(d_graph.stream(), cudaStreamCaptureModeGlobal));
    prefill(graphed.prefill_params(PrefillAlgorithm::kAuto, d_graph.resolver()), {Backend::kCUDA, d_graph.stream()});
    GDNKIT_TEST_CUDA(cudaStreamEndCapture(d_graph.stream(), &graph));
    GDNKIT_TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < 2; ++replay)  // initial and final slots differ: a replay writes the same again
      GDNKIT_TEST_CUDA(cudaGraphLaunch(exec, d_graph.stream()));
    GDNKIT_TEST_CUDA(cudaStreamSynchronize(d_graph.stream()));

    PrefillParams pw = own_ws.prefill_params(PrefillAlgorithm::kAuto, d_ws.resolver());
    pw.workspace_bytes = prefill_workspace_bytes(pw);
    ASSERT_GT(pw.workspace_bytes, 0u);
    GDNKIT_TEST_CUDA(cudaMalloc(&pw.workspace, pw.workspace_bytes));
    GDNKIT_TEST_CUDA(cudaMemset(pw.workspace, 0xff, pw.workspace_bytes));  // NaN-ish garbage
    GDNKIT_TEST_CUDA(cudaDeviceSynchronize());  // (the legacy stream's fill, before the call's non-blocking stream)
    prefill(pw, {Backend::kCUDA, d_ws.stream()});

    d_eager.download(eager);
    d_again.download(again);
    d_graph.download(graphed);
    d_ws.download(own_ws);
    cudaFree(pw.workspace);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    for (const char* name : {"o", "state", "state_scales", "checkpoints", "checkpoints_scales", "error_flag"}) {
      if (!before.has(name)) continue;  // the scales of float8_e4m3 buffers only
      EXPECT_TRUE(BitwiseEqual(std::string(name) + " (repeat)", again.buffer(name), eager.buffer(name)));
      EXPECT_TRUE(BitwiseEqual(std::string(name) + " (graph)", graphed.buffer(name), eager.buffer(name)));
      EXPECT_TRUE(BitwiseEqual(std::string(name) + " (caller workspace)", own_ws.buffer(name), eager.buffer(name)));
    }
    Problem ref = before;
    prefill(ref.prefill_params(PrefillAlgorithm::kRecurrent), {Backend::kCPU, nullptr});
    check_prefill_results(before, eager, ref);
  }
}

// Every sequence within the output tolerance on its own, not only the call as a whole: in a mixed batch the
// shortest sequences are the hardest, since a sequence of one token's o is one coefficient times v, so the
// rounding of that coefficient to a 16-bit operand moves all of o together instead of averaging out. Without a
// host copy of cu_seqlens (as the torch ops and adapters call), V-last pool (short-path reach 8), GVA 2/8.
// Returns the worst per-sequence relative error of o over `seeds` problems.
double worst_sequence_error(const std::vector<int32_t>& lens, int seeds, const cuda::Overrides& o) {
  double worst = 0;
  for (int seed = 0; seed < seeds; ++seed) {
    ProblemConfig c = base(lens, 2, 8);
    c.layout = StateLayout::kVLast;
    c.in_dtype = DType::kBFloat16;
    c.gate_dtype = DType::kBFloat16;
    c.pass_cu_seqlens_host = false;
    c.zero_initial_rows = seed % 2;
    c.seed = 7100 + seed;
    const Problem before(c);
    Problem ref = before, got = before;
    prefill(ref.prefill_params(PrefillAlgorithm::kRecurrent), {Backend::kCPU, nullptr});
    DeviceProblem dev(got);
    {
      const cuda::ScopedOverrides scoped(o);
      prefill(got.prefill_params(PrefillAlgorithm::kAuto, dev.resolver()), {Backend::kCUDA, dev.stream()});
    }
    dev.download(got);
    const std::vector<double> x = got.read_tokens("o"), r = ref.read_tokens("o");
    const int64_t row = int64_t(c.HV) * c.V;
    for (int32_t n = 0; n < before.rows(); ++n) {
      if (before.row_len(n) == 0) continue;
      const int64_t t0 = before.row_start(n), t1 = t0 + before.row_len(n);
      const ErrorStats e = error_stats(token_rows(x, row, t0, t1), token_rows(r, row, t0, t1));
      EXPECT_EQ(e.nan_count, 0) << "sequence " << n << ", seed " << seed;
      worst = std::max(worst, e.rel);
    }
  }
  return worst;
}

TEST(PrefillGpu, EverySequenceWithinTolerance) {
  const std::vector<int32_t> lens = {1, 300, 2, 8, 9, 1, 64, 16, 130};
  const double tol = output_tolerance(OpFamily::kPrefill, DType::kBFloat16);
  const double routed = worst_sequence_error(lens, 16, {});
  EXPECT_LE(routed, tol) << "the library's routing";
  cuda::Overrides chunked_only;  // every sequence on the chunked kernels: the 16-bit operands' bound, printed
  chunked_only.prefill_short_max_len = 0;
  const double chunked = worst_sequence_error(lens, 16, chunked_only);
  std::printf("worst per-sequence rel(o): routed %.2e, chunked kernels alone %.2e (tolerance %.0e)\n", routed, chunked,
              tol);
  EXPECT_LE(chunked, 2 * tol) << "the chunked kernels alone";
}

// Runs `call` with p's workspace a buffer of exactly `need` bytes of 0xff (NaN-ish garbage) followed by a 0xff guard,
// and expects the guard untouched.
template <class Call>
void run_in_exact_workspace(PrefillParams& p, size_t need, Call&& call) {
  constexpr size_t kGuard = 64 * 1024;
  unsigned char* ws = nullptr;
  GDNKIT_TEST_CUDA(cudaMalloc(&ws, need + kGuard));
  GDNKIT_TEST_CUDA(cudaMemset(ws, 0xff, need + kGuard));
  // the fill is on the legacy stream, which the harness's non-blocking streams do not wait for: done before the call
  GDNKIT_TEST_CUDA(cudaDeviceSynchronize());
  p.workspace = ws;
  p.workspace_bytes = need;
  call();
  std::vector<unsigned char> tail(kGuard);
  GDNKIT_TEST_CUDA(cudaMemcpy(tail.data(), ws + need, kGuard, cudaMemcpyDeviceToHost));
  cudaFree(ws);
  EXPECT_TRUE(std::all_of(tail.begin(), tail.end(), [](unsigned char b) { return b == 0xff; }))
      << "bytes past prefill_workspace_bytes were written";
}

// A caller workspace of exactly prefill_workspace_bytes, for the plans of the head pass: M formed in the pass
// (two-warpgroup CTAs after the chunk prep, M's region unused; by the prep warpgroup the same) and M from the
// workspace (the column split). Bytes past it stay untouched, and the results equal the library-workspace run's
// bit for bit.
TEST(PrefillGpu, CallerWorkspaceSizedByThePlan) {
  namespace cp = cuda::chunked_prefill;
  struct Plan {
    int aux;  // asked for
    bool few, m_in_pass;
    int cp = -1;           // context-parallel segments asked for (-1: the heuristic's choice)
    int first_final = -1;  // the first segment's final pass beside the local pass (1) or after the scan (0)
    int parts = 0;         // chunk prep CTAs per (chunk, q/k head) asked for (0: the heuristic's choice)
    int persistent = -1;   // the persistent pass on 3 CTAs, longest first (1)
  };
  for (const Plan want : {Plan{0, false, true}, Plan{0, true, false}, Plan{0, true, false, -1, -1, 2},
                          Plan{1, false, true}, Plan{1, false, true, 64}, Plan{1, false, true, 64, 1},
                          Plan{1, false, true, -1, -1, 0, 1}}) {
    // qwen3-next heads: 3 x 32 (sequence, head) pairs take one CTA each (no split: M formed in the pass, by the state
    // warpgroups or the prep warpgroup), 1 x 32 two each (M from the workspace; also with the prep in two parts); last,
    // context-parallel segments of 64 tokens (the workspace's per-segment states after the table), the first segment's
    // final pass after the scan and beside the local pass; the persistent pass on three CTAs taking the sequences
    // longest first (its counter and order: the workspace's last words).
    const Problem before(want.few ? base({130}, 16, 32) : base({130, 64, 71}, 16, 32));
    Problem lib = before, own = before;
    DeviceProblem d_lib(lib), d_own(own);
    PrefillParams p = own.prefill_params(PrefillAlgorithm::kAuto, d_own.resolver());
    cuda::Overrides o;
    o.prefill_m_warpgroup = want.aux;
    o.prefill_cp_segment_len = want.cp;
    o.prefill_cp_first_final = want.first_final;
    o.prefill_prep_parts = want.parts;
    if (want.persistent > 0) o.prefill_persistent = 1, o.prefill_persistent_ctas = 3;
    const cp::PrefillChoice choice = cp::choose_prefill(p, cuda::device_sms(), o);
    if (want.persistent > 0)  // (one CTA per item takes the order too where its grid passes a wave: SMs < 96)
      ASSERT_TRUE(choice.longest_first) << "the case no longer takes the plan it is written for";
    if (want.parts > 0)
      ASSERT_EQ(choice.prep_parts, want.parts) << "the case no longer takes the plan it is written for";
    if (want.first_final >= 0)
      ASSERT_EQ(choice.cp_first_final, want.first_final > 0) << "the case no longer takes the plan it is written for";
    ASSERT_EQ(choice.m_in_pass, want.m_in_pass) << "the case no longer takes the plan it is written for";
    ASSERT_EQ(choice.cp_segment_len, std::max(want.cp, 0)) << "the case no longer takes the plan it is written for";
    ASSERT_EQ(choice.m_warpgroup, !want.few && want.aux == 1) << "the case no longer takes the plan it is written for";
    const auto run = [&](const PrefillParams& q, cudaStream_t stream) {
      const cuda::ScopedOverrides scoped(o);
      prefill(q, {Backend::kCUDA, stream});
    };
    size_t need = 0;
    {
      const cuda::ScopedOverrides scoped(o);
      need = prefill_workspace_bytes(p);
    }
    ASSERT_GT(need, 0u);
    run_in_exact_workspace(p, need, [&] {
      run(p, d_own.stream());
      run(lib.prefill_params(PrefillAlgorithm::kAuto, d_lib.resolver()), d_lib.stream());
      d_own.download(own);
      d_lib.download(lib);
    });
    for (const char* name : {"o", "state", "error_flag"})
      EXPECT_TRUE(BitwiseEqual(std::string(name) + " (caller workspace)", own.buffer(name), lib.buffer(name)));
    Problem ref = before;
    prefill(ref.prefill_params(PrefillAlgorithm::kRecurrent), {Backend::kCPU, nullptr});
    check_prefill_results(before, own, ref);
  }
}

// The library's own choice of 768-token segments (few value heads, a prompt of 6 to 9 of them beside sequences of at
// most one) in a caller workspace of exactly prefill_workspace_bytes: against the CPU reference, nothing past it written.
TEST(PrefillGpu, ShortSegmentsChosenInTheCallersWorkspace) {
  namespace cp = cuda::chunked_prefill;
  if (cuda::device_sms() != 132) GTEST_SKIP() << "the rule's choice is written for 132 SMs";
  ProblemConfig c = base({768, 100, 6144}, 2, 8);
  c.checkpoint_interval = 1024;
  const Problem before(c);
  Problem got = before;
  DeviceProblem dev(got);
  PrefillParams p = got.prefill_params(PrefillAlgorithm::kAuto, dev.resolver());
  ASSERT_EQ(cp::choose_prefill(p, cuda::device_sms(), {}).cp_segment_len, cp::kCpShortSegment)
      << "the case no longer takes the plan it is written for";
  run_in_exact_workspace(p, prefill_workspace_bytes(p), [&] {
    prefill(p, {Backend::kCUDA, dev.stream()});
    dev.download(got);
  });
  Problem ref = before;
  prefill(ref.prefill_params(PrefillAlgorithm::kRecurrent), {Backend::kCPU, nullptr});
  check_prefill_results(before, got, ref);
}

// A staged call without a pool (float8_e4m3 checkpoints off the passes' reach, no initial or final slots): its
// workspace holds no copy of a pool (the staged call's pool stays null), nothing past it is written, and it stores
// what the CPU reference stores and, bit for bit, what the same call with a pool that no slot names stores.
TEST(PrefillGpu, StagedCheckpointsWithoutAPool) {
  ProblemConfig c = base({300, 64, 127, 0, 256}, 1, 2, 64, 64);
  c.in_dtype = DType::kFloat32, c.gate_mode = GateMode::kGiven;
  c.checkpoint_interval = 64, c.cache_dtype = DType::kFloat8E4M3;
  c.zero_initial_rows = c.no_final_rows = int32_t(c.seq_lens.size());  // every slot -1
  const Problem before(c);
  Problem pooled = before, bare = before;
  DeviceProblem d_pooled(pooled), d_bare(bare);
  const PrefillParams with = pooled.prefill_params(PrefillAlgorithm::kAuto, d_pooled.resolver());
  PrefillParams without = bare.prefill_params(PrefillAlgorithm::kAuto, d_bare.resolver());
  without.state = StatePool{};
  without.initial_indices = without.final_indices = nullptr;
  ASSERT_TRUE(cuda::chunked_prefill::states_staged(without)) << "the case no longer takes the plan it is written for";
  const size_t need = prefill_workspace_bytes(without);
  const size_t pool_copy = c.seq_lens.size() * size_t(c.HV) * c.K * c.V * sizeof(float);
  EXPECT_LE(need + pool_copy, prefill_workspace_bytes(with)) << "the call without a pool reserves a pool copy";
  run_in_exact_workspace(without, need, [&] {
    prefill(without, {Backend::kCUDA, d_bare.stream()});
    prefill(with, {Backend::kCUDA, d_pooled.stream()});
    d_bare.download(bare);
    d_pooled.download(pooled);
  });
  for (const char* name : {"o", "checkpoints", "checkpoints_scales", "error_flag"})
    EXPECT_TRUE(BitwiseEqual(std::string(name) + " (no pool)", bare.buffer(name), pooled.buffer(name)));
  Problem ref = before;
  prefill(ref.prefill_params(PrefillAlgorithm::kRecurrent), {Backend::kCPU, nullptr});
  check_prefill_results(before, bare, ref);
}

// A caller workspace smaller than prefill_workspace_bytes is refused before anything is written.
TEST(PrefillGpu, SmallCallerWorkspaceRefused) {
  const Problem before(base({100}, 1, 2));
  Problem got = before;
  DeviceProblem dev(got);
  PrefillParams p = got.prefill_params(PrefillAlgorithm::kAuto, dev.resolver());
  const size_t need = prefill_workspace_bytes(p);
  ASSERT_GT(need, 0u);
  void* ws = nullptr;
  GDNKIT_TEST_CUDA(cudaMalloc(&ws, need));
  p.workspace = ws;
  p.workspace_bytes = need - 256;
  try {
    prefill(p, {Backend::kCUDA, dev.stream()});
    ADD_FAILURE() << "a workspace 256 bytes short was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_EQ(std::string(e.what()).rfind("workspace: expected at least " + std::to_string(need) + " bytes", 0), 0u)
        << e.what();
  }
  dev.download(got);
  cudaFree(ws);
  for (const char* name : {"o", "state", "error_flag"})
    EXPECT_TRUE(BitwiseEqual(name, got.buffer(name), before.buffer(name)));
}

// Context parallelism against the fp64 recurrence on one long sequence from a pool state with two value heads
// (the heuristic's segments: 64 of 1024 tokens at 64K), in the long-memory regime (decays near 1) and with the
// sweep's faster decays; the whole-sequence path's error, and the context-parallel path's with the first segment's
// final pass beside the local pass, on the same inputs printed beside it. The length is
// 65536 tokens; GDNKIT_CP_PRECISION_TOKENS sets another (262144 for the 256K measurement, a few minutes of CPU).
TEST(PrefillGpu, ContextParallelLongSequenceAgainstFp64) {
  const char* tokens = std::getenv("GDNKIT_CP_PRECISION_TOKENS");
  const int32_t T = tokens != nullptr ? int32_t(std::atol(tokens)) : 65536;
  for (bool long_memory : {true, false}) {
    ProblemConfig c = base({T}, 1, 2);
    c.zero_initial_rows = 0;
    c.long_memory = long_memory;
    c.seed = 7000 + (long_memory ? 1 : 0);
    Problem before(c);
    Problem ref = before;
    prefill(ref.prefill_params(PrefillAlgorithm::kRecurrent), {Backend::kCPU, nullptr});
    const int32_t slot = before.as<int32_t>("final_indices")[0];
    double o_err[3], s_err[3];
    // 0: the library's choice (context parallel), 1: whole sequences, 2: context parallel with the first segment's
    // final pass beside the local pass
    for (int path = 0; path < 3; ++path) {
      Problem got = before;
      {
        DeviceProblem dev(got);
        if (path == 0) {
          const PrefillParams p = got.prefill_params(PrefillAlgorithm::kAuto, dev.resolver());
          EXPECT_GT(prefill_path(p).context_parallel_segment, 0) << "the context-parallel path would not run";
        }
        run_gpu(got, dev, 0, 0, -1, -1, path == 1 ? 0 : -1, -1, path == 2 ? 1 : -1);
      }
      const ErrorStats o = error_stats(got.read_tokens("o"), ref.read_tokens("o"));
      const ErrorStats st = error_stats(got.read_state("state", slot), ref.read_state("state", slot));
      EXPECT_EQ(o.nan_count, 0) << "path " << path << ": o not all written or not finite";
      EXPECT_EQ(st.nan_count, 0) << "path " << path << ": final state not written or not finite";
      o_err[path] = o.rel, s_err[path] = st.rel;
      EXPECT_LE(o_err[path], output_tolerance(OpFamily::kPrefill, c.in_dtype)) << "path " << path;
      EXPECT_LE(s_err[path], state_tolerance(OpFamily::kPrefill, c.state_dtype)) << "path " << path;
    }
    std::printf("1x%d, %s: o rel. error %.3e context-parallel, %.3e whole sequence, %.3e first segment beside the "
                "local pass; final state %.3e, %.3e, %.3e\n",
                T, long_memory ? "long memory" : "fast decay", o_err[0], o_err[1], o_err[2], s_err[0], s_err[1],
                s_err[2]);
  }
}

// One long prompt beside 200 short ones, as the library chooses: its segments hold per-segment states, the short
// sequences (some on the recurrent kernels) none; checkpoints every 4096 tokens cross the segments; the initial slot
// is the final one.
TEST(PrefillGpu, ContextParallelLongPromptBesideShortOnes) {
  std::mt19937 gen(11);
  std::vector<int32_t> lens(201);
  for (int32_t& x : lens) x = int32_t(gen() % 300) + 1;
  lens[77] = 60000;
  ProblemConfig c = base(lens, 1, 2);
  c.checkpoint_interval = 4096;
  c.same_slot = true;
  c.seed = 7100;
  const Problem before(c);
  {
    Problem probe = before;
    DeviceProblem dev(probe);
    const PrefillParams p = probe.prefill_params(PrefillAlgorithm::kAuto, dev.resolver());
    EXPECT_GT(prefill_path(p).context_parallel_segment, 0) << "the context-parallel path would not run";
  }
  check_prefill(before);
}

}  // namespace
}  // namespace gdnkit::test
