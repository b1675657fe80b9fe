// GPU verify and commit vs the CPU reference: chains, trees (parent), varlen (cu_seqlens), the
// intermediate cache in fp32 / bf16 / fp16 / float8_e4m3, update_state; commit from the cache and by recompute. Every
// output and cache entry starts NaN-poisoned: the ones the op stores must be close to the reference,
// the others (and untouched pool slots) bit-identical to before.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "support/compare.h"
#include "support/problem.h"
#include "gdnkit/gdnkit.h"
#include "gdnkit/host_dtype.h"
#include "cuda/host/overrides.h"
#include "cuda/recurrent/heuristics.h"
#include "gpu/gpu_harness.h"

namespace gdnkit::test {
namespace {

enum class Shape { kChain, kChainUpdate, kTree, kVarlenChain, kVarlenTree };

const char* shape_name(Shape s) {
  switch (s) {
    case Shape::kChain: return "chain";
    case Shape::kChainUpdate: return "chain_update";
    case Shape::kTree: return "tree";
    case Shape::kVarlenChain: return "varlen_chain_update";
    case Shape::kVarlenTree: return "varlen_tree";
  }
  return "?";
}

std::string dt(DType d) {
  return d == DType::kFloat32 ? "f32" : d == DType::kBFloat16 ? "bf16" : d == DType::kFloat16 ? "f16" : "f8";
}

struct Named {
  std::string name;
  ProblemConfig cfg;
};

ProblemConfig make(Shape shape, StateLayout layout, DType state, DType cache, int T, uint64_t seed) {
  ProblemConfig c;
  c.op = OpKind::kVerify;
  c.batch = 5, c.padding_rows = 1, c.draft_tokens = T;
  c.H = 2, c.HV = 8, c.K = 128, c.V = 128;
  c.layout = layout, c.state_dtype = state, c.cache_dtype = cache;
  c.tree = shape == Shape::kTree || shape == Shape::kVarlenTree;
  c.update_state = shape == Shape::kChainUpdate || shape == Shape::kVarlenChain;
  if (shape == Shape::kVarlenChain || shape == Shape::kVarlenTree) c.seq_lens = {T, 1, T - 1, 0, 2};
  c.seed = seed;
  return c;
}

std::string name_of(Shape s, const ProblemConfig& c) {
  return std::string(shape_name(s)) + (c.layout == StateLayout::kKLast ? "_klast" : "_vlast") + "_s" +
         dt(c.state_dtype) + "_c" + dt(c.cache_dtype) + "_in" + dt(c.in_dtype) + "_T" + std::to_string(c.draft_tokens) +
         "_d" + std::to_string(c.K) + "_h" + std::to_string(c.H) + "x" + std::to_string(c.HV) +
         (c.gate_mode == GateMode::kGiven ? "_given" : "") + (c.use_qk_l2norm ? "" : "_nol2") +
         (c.token_pad ? "_strided" : "") + (c.slot_pad ? "_slotpad" : "") + (c.intermediate ? "" : "_nocache") +
         (c.long_memory ? "_longmem" : "") + (c.scale > 0.0f ? "_scaled" : "");
}

const Shape kShapes[] = {Shape::kChain, Shape::kChainUpdate, Shape::kTree, Shape::kVarlenChain, Shape::kVarlenTree};

// n varlen lengths cycling through 0..T (by a step coprime to T + 1, so that every length comes).
std::vector<int32_t> many_lens(int n, int T) {
  int step = 5;
  while (std::gcd(step, T + 1) != 1) ++step;
  std::vector<int32_t> lens;
  for (int i = 0; i < n; ++i) lens.push_back((step * i) % (T + 1));
  return lens;
}

std::vector<Named> verify_cases() {
  std::vector<Named> out;
  uint64_t seed = 1000;
  for (Shape s : kShapes)
    for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast})
      for (DType state : {DType::kFloat32, DType::kBFloat16, DType::kFloat16})
        for (DType cache : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
          ProblemConfig c = make(s, layout, state, cache, 4, seed++);
          if (seed % 2) c.token_pad = 8, c.head_pad = 8, c.slot_pad = 24;
          out.push_back({name_of(s, c), c});
        }
  // float8_e4m3 intermediate caches (WarpTile::store_e4m3), every shape, 16-bit and fp32 pools, both layouts.
  for (Shape s : kShapes)
    for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast})
      for (DType state : {DType::kFloat32, DType::kBFloat16}) {
        ProblemConfig c = make(s, layout, state, DType::kFloat8E4M3, 4, seed++);
        if (seed % 2) c.token_pad = 8, c.head_pad = 8, c.slot_pad = 32;
        out.push_back({name_of(s, c), c});
      }
  for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast})
    for (int d : {64, 256}) {  // K-last: runs of 2 and 4 (fp32) / 8 (bf16) k a lane; V-last: 8 and 4 columns a warp
      ProblemConfig c = make(Shape::kTree, layout, d == 64 ? DType::kFloat32 : DType::kBFloat16, DType::kFloat8E4M3,
                             4, seed++);
      c.K = c.V = d;
      out.push_back({name_of(Shape::kTree, c), c});
    }
  // Other inputs, gating, dims, T and the qwen3-next heads.
  for (Shape s : {Shape::kChainUpdate, Shape::kTree})
    for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast}) {
      ProblemConfig c = make(s, layout, DType::kFloat32, DType::kFloat32, 8, seed++);
      c.in_dtype = DType::kFloat16, c.gate_mode = GateMode::kGiven, c.use_qk_l2norm = false;
      out.push_back({name_of(s, c), c});
      c = make(s, layout, DType::kFloat32, DType::kFloat32, 3, seed++);
      c.in_dtype = DType::kFloat32, c.H = 16, c.HV = 32;
      out.push_back({name_of(s, c), c});
      for (int d : {64, 256}) {
        c = make(s, layout, DType::kBFloat16, DType::kBFloat16, 4, seed++);
        c.K = c.V = d;
        out.push_back({name_of(s, c), c});
      }
    }
  // Chains without the cache. K-last with bf16 inputs, K <= 128 and T >= 3 runs the tensor-core chain
  // kernel (chunks of 8 tokens: T = 13 crosses a chunk), the rest the warp kernel.
  for (Shape s : {Shape::kChain, Shape::kChainUpdate, Shape::kVarlenChain})
    for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast})
      for (DType state : {DType::kFloat32, DType::kBFloat16})
        for (int T : {2, 3, 5, 13}) {
          ProblemConfig c = make(s, layout, state, DType::kFloat32, T, seed++);
          c.intermediate = false;
          c.long_memory = T == 13 && state == DType::kFloat32;
          if (seed % 3 == 0) c.token_pad = 8, c.head_pad = 8, c.slot_pad = 24;
          out.push_back({name_of(s, c), c});
        }
  // Batches of the qwen3-next heads in several waves of CTAs (24 x 32 heads x 4 column CTAs), padding
  // rows, empty rows and rows of two chunks among them.
  for (Shape s : {Shape::kChain, Shape::kVarlenChain})
    for (DType state : {DType::kFloat32, DType::kBFloat16}) {
      ProblemConfig c = make(s, StateLayout::kKLast, state, DType::kFloat32, 10, seed++);
      c.intermediate = false, c.H = 16, c.HV = 32, c.batch = 24, c.padding_rows = 4;
      if (s == Shape::kVarlenChain) c.seq_lens = many_lens(c.batch, 10);
      out.push_back({name_of(s, c) + "_b24", c});
    }
  for (Shape s : {Shape::kChain, Shape::kChainUpdate}) {
    ProblemConfig c = make(s, StateLayout::kKLast, DType::kFloat32, DType::kFloat32, 16, seed++);
    c.intermediate = false, c.K = c.V = 64, c.H = 16, c.HV = 32;
    out.push_back({name_of(s, c), c});
    c = make(s, StateLayout::kKLast, DType::kFloat32, DType::kFloat32, 6, seed++);
    c.intermediate = false, c.gate_mode = GateMode::kGiven, c.use_qk_l2norm = false, c.scale = 0.3f;
    out.push_back({name_of(s, c), c});
    c = make(s, StateLayout::kKLast, DType::kBFloat16, DType::kFloat32, 5, seed++);
    c.intermediate = false, c.in_dtype = DType::kFloat16;  // the warp kernel
    out.push_back({name_of(s, c), c});
  }
  // float8_e4m3 pools (WarpTile::load_e4m3 / store_e4m3), both layouts: every shape beside fp32, bf16 and fp8 caches,
  // chains without a cache (the warp kernel even where bf16 inputs would take the chain kernel), K = 64 and 256
  // (K-last: runs of 2 and 8 bytes a lane; V-last: 8 and 4 columns a warp), fp32 and fp16 inputs, the qwen3-next
  // heads.
  for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast}) {
    for (Shape s : kShapes)
      for (DType cache : {DType::kFloat32, DType::kBFloat16, DType::kFloat8E4M3}) {
        ProblemConfig c = make(s, layout, DType::kFloat8E4M3, cache, 4, seed++);
        if (seed % 2) c.token_pad = 8, c.head_pad = 8, c.slot_pad = 32;
        out.push_back({name_of(s, c), c});
      }
    for (Shape s : {Shape::kChain, Shape::kChainUpdate, Shape::kVarlenChain}) {
      ProblemConfig c = make(s, layout, DType::kFloat8E4M3, DType::kFloat32, 13, seed++);
      c.intermediate = false, c.long_memory = s == Shape::kChainUpdate;
      out.push_back({name_of(s, c), c});
    }
    for (int d : {64, 256})
      for (Shape s : {Shape::kChainUpdate, Shape::kTree}) {
        ProblemConfig c = make(s, layout, DType::kFloat8E4M3, DType::kFloat8E4M3, 4, seed++);
        c.K = c.V = d;
        out.push_back({name_of(s, c), c});
      }
    for (DType in : {DType::kFloat32, DType::kFloat16}) {
      ProblemConfig c = make(Shape::kVarlenTree, layout, DType::kFloat8E4M3, DType::kFloat8E4M3, 6, seed++);
      c.in_dtype = in, c.gate_mode = in == DType::kFloat16 ? GateMode::kGiven : GateMode::kFused;
      out.push_back({name_of(Shape::kVarlenTree, c), c});
    }
    ProblemConfig c = make(Shape::kVarlenChain, layout, DType::kFloat8E4M3, DType::kFloat8E4M3, 4, seed++);
    c.H = 16, c.HV = 32, c.batch = 24, c.padding_rows = 4, c.seq_lens = many_lens(c.batch, 4);
    out.push_back({name_of(Shape::kVarlenChain, c) + "_b24", c});
  }
  // Long chains that cache their states (the warp kernel: the chain kernel stores no intermediate state), every
  // cache dtype beside fp32, bf16 and float8_e4m3 pools.
  for (DType state : {DType::kFloat32, DType::kBFloat16, DType::kFloat8E4M3})
    for (DType cache : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat8E4M3}) {
      const Shape s = state == DType::kBFloat16 ? Shape::kVarlenChain : Shape::kChainUpdate;
      ProblemConfig c = make(s, StateLayout::kKLast, state, cache, 13, seed++);
      c.long_memory = cache == DType::kFloat32;
      if (seed % 2) c.token_pad = 8, c.head_pad = 8, c.slot_pad = 32;
      out.push_back({name_of(s, c), c});
    }
  // Chains on the fp8 chain kernels (from B = 2; fp8_chain.cuh with a cache, fp8_chain_mma.cuh without one): past 32
  // tokens (the gates of the next 32), the qwen3-next heads over several waves with padding and empty rows, one
  // sequence (the warp kernel), K = 64, fp16 inputs, given gates without the L2 norm, long memory.
  for (int T : {33, 40}) {
    ProblemConfig c = make(Shape::kChainUpdate, StateLayout::kKLast, DType::kFloat8E4M3,
                           T == 40 ? DType::kFloat8E4M3 : DType::kFloat32, T, seed++);
    c.intermediate = T == 40, c.long_memory = T == 33;
    out.push_back({name_of(Shape::kChainUpdate, c), c});
  }
  for (DType cache : {DType::kFloat8E4M3, DType::kFloat32}) {
    ProblemConfig c = make(Shape::kVarlenChain, StateLayout::kKLast, DType::kFloat8E4M3, cache, 6, seed++);
    c.intermediate = cache == DType::kFloat8E4M3, c.H = 16, c.HV = 32, c.batch = 40, c.padding_rows = 5;
    c.seq_lens = many_lens(c.batch, 6);
    out.push_back({name_of(Shape::kVarlenChain, c) + "_b40", c});
  }
  // No cache, 48 tokens of the usual decays and v 16x larger: the state's factor w takes every decay (the sum falls
  // far below -87) and must be folded into the values before x = S / w leaves the fp32 range (kMinBlockFactor).
  for (DType in : {DType::kBFloat16, DType::kFloat16}) {
    ProblemConfig c = make(Shape::kChainUpdate, StateLayout::kKLast, DType::kFloat8E4M3, DType::kFloat32, 48, seed++);
    c.intermediate = false, c.in_dtype = in, c.H = 4, c.HV = 16, c.batch = 6, c.v_scale = 16.0;
    out.push_back({name_of(Shape::kChainUpdate, c) + "_decayed", c});
  }
  for (Shape s : {Shape::kChainUpdate, Shape::kVarlenChain}) {  // one sequence: the warp kernel
    ProblemConfig c = make(s, StateLayout::kKLast, DType::kFloat8E4M3, DType::kFloat8E4M3, 4, seed++);
    c.batch = 1, c.padding_rows = 0, c.H = 16, c.HV = 32;
    if (s == Shape::kVarlenChain) c.seq_lens = {3};
    out.push_back({name_of(s, c) + "_b1", c});
  }
  for (int d : {64, 128}) {
    ProblemConfig c = make(Shape::kChainUpdate, StateLayout::kKLast, DType::kFloat8E4M3, DType::kFloat8E4M3, 5, seed++);
    c.K = c.V = d, c.in_dtype = DType::kFloat16, c.gate_mode = GateMode::kGiven, c.use_qk_l2norm = false;
    c.token_pad = 8, c.head_pad = 8, c.slot_pad = 32;
    out.push_back({name_of(Shape::kChainUpdate, c), c});
  }
  return out;
}

std::vector<Named> sanitize_cases() {
  std::vector<Named> out;
  uint64_t seed = 2000;
  for (Shape s : {Shape::kChainUpdate, Shape::kVarlenTree})
    for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast}) {
      ProblemConfig c = make(s, layout, s == Shape::kChainUpdate ? DType::kFloat32 : DType::kBFloat16,
                             DType::kBFloat16, 4, seed++);
      c.H = 1, c.HV = 2, c.K = c.V = 64;
      out.push_back({name_of(s, c), c});
    }
  ProblemConfig c = make(Shape::kVarlenChain, StateLayout::kKLast, DType::kFloat32, DType::kFloat32, 11, seed++);
  c.H = 1, c.HV = 2, c.K = c.V = 64, c.intermediate = false;  // the chain kernel, two chunks
  out.push_back({name_of(Shape::kVarlenChain, c), c});
  c = make(Shape::kVarlenChain, StateLayout::kKLast, DType::kBFloat16, DType::kFloat32, 11, seed++);
  c.H = 2, c.HV = 8, c.K = c.V = 64, c.intermediate = false, c.padding_rows = 5;
  c.seq_lens = many_lens(40, 11);  // 40 rows, every length 0 .. 11
  out.push_back({name_of(Shape::kVarlenChain, c) + "_b40", c});
  // A varlen chain of float8_e4m3 pool and cache.
  c = make(Shape::kVarlenChain, StateLayout::kKLast, DType::kFloat8E4M3, DType::kFloat8E4M3, 11, seed++);
  c.H = 1, c.HV = 2, c.K = c.V = 64;
  out.push_back({name_of(Shape::kVarlenChain, c), c});
  // V-last float8_e4m3 pools and caches: the block maxima meet in shared memory (warp_tile.cuh store_e4m3)
  for (Shape s : {Shape::kChainUpdate, Shape::kVarlenTree}) {
    c = make(s, StateLayout::kVLast, DType::kFloat8E4M3, DType::kFloat8E4M3, 4, seed++);
    c.H = 1, c.HV = 2, c.K = c.V = 64;
    out.push_back({name_of(s, c), c});
  }
  return out;
}

// Verify on both backends from the same inputs; the CUDA outputs, cache and pool must match the reference's. Returns
// the CUDA run's problem.
Problem check_verify(const Problem& before) {
  Problem ref = before, got = before;
  DeviceProblem dev(got);
  cuda::recurrent::last_recurrent_launch() = {};  // a call that launched nothing leaves no earlier record
  verify(ref.verify_params(), {Backend::kCPU, nullptr});
  verify(got.verify_params(dev.resolver()), {Backend::kCUDA, dev.stream()});
  dev.download(got);
  check_verify_results(before, got, ref);
  return got;
}
void check_verify(const ProblemConfig& c) { check_verify(Problem(c)); }

class VerifyTest : public ::testing::TestWithParam<Named> {};

TEST_P(VerifyTest, MatchesCpuReference) { check_verify(GetParam().cfg); }

INSTANTIATE_TEST_SUITE_P(Axes, VerifyTest, ::testing::ValuesIn(verify_cases()),
                         [](const auto& info) { return info.param.name; });
INSTANTIATE_TEST_SUITE_P(Sanitize, VerifyTest, ::testing::ValuesIn(sanitize_cases()),
                         [](const auto& info) { return info.param.name; });

// Chains of float8_e4m3 pools without a cache on both forms of the fp8 chain kernel: on tensor cores
// (fp8_chain_mma.cuh, the library's choice) and on CUDA cores (fp8_chain.cuh, by override). K = 64 and 128, bf16 and
// fp16 inputs, one group of tokens, three (the later groups' products from x split into hi + lo) and nine (past 32
// tokens: the next gates), update_state on and off, varlen rows of every length, padding rows; and 48 tokens whose
// decays sum far below -87 with v 16x larger (the state's factor w folded into its values).
TEST(VerifyGpu, Fp8ChainsWithoutACacheOnBothForms) {
  uint64_t seed = 4100;
  std::vector<Named> cases;
  for (int d : {64, 128})
    for (DType in : {DType::kBFloat16, DType::kFloat16}) {
      for (Shape s : {Shape::kChain, Shape::kChainUpdate, Shape::kVarlenChain})
        for (int T : {4, 11, 33}) {
          ProblemConfig c = make(s, StateLayout::kKLast, DType::kFloat8E4M3, DType::kFloat32, T, seed++);
          c.intermediate = false, c.K = c.V = d, c.in_dtype = in, c.H = 4, c.HV = 16, c.batch = 12;
          c.padding_rows = 2;
          if (s == Shape::kVarlenChain) c.seq_lens = many_lens(c.batch, T);
          cases.push_back({name_of(s, c), c});
        }
      ProblemConfig c =
          make(Shape::kChainUpdate, StateLayout::kKLast, DType::kFloat8E4M3, DType::kFloat32, 48, seed++);
      c.intermediate = false, c.K = c.V = d, c.in_dtype = in, c.H = 4, c.HV = 16, c.batch = 6, c.v_scale = 16.0;
      cases.push_back({name_of(Shape::kChainUpdate, c) + "_decayed", c});
    }
  for (bool mma : {true, false})
    for (const Named& n : cases) {
      SCOPED_TRACE(std::string(mma ? "tensor cores " : "CUDA cores ") + n.name);
      cuda::Overrides o;
      o.verify_fp8_chain_mma = mma;
      const cuda::ScopedOverrides scoped(o);
      check_verify(n.cfg);
      EXPECT_EQ(std::string(cuda::recurrent::last_recurrent_launch().kernel),
                cuda::recurrent::kernel_name(mma ? cuda::recurrent::RecurrentKernel::kFp8ChainMma
                                                 : cuda::recurrent::RecurrentKernel::kFp8Chain));
    }
}

// Chains of V-last pools on their chain kernel (vlast_chain.cuh, at every batch by override), with a cache and without:
// float8_e4m3 pools (an fp8 cache), bf16 (a bf16 or fp32 cache), fp16 (fp16), fp32 (fp32); K = V = 64 and 128 (one or
// two CTAs a head; fp32: two or four), bf16 and fp16 inputs, one token, four, and 33 (past 32: the next gates),
// update_state on and off, varlen rows of every length, padding rows; and 48 tokens whose decays sum far below -87
// with v 16x larger (the rows' factor w folded into their values).
TEST(VerifyGpu, VLastChains) {
  uint64_t seed = 4300;
  std::vector<Named> cases;
  const std::pair<DType, DType> kinds[] = {{DType::kFloat8E4M3, DType::kFloat8E4M3},
                                           {DType::kBFloat16, DType::kBFloat16},
                                           {DType::kBFloat16, DType::kFloat32},
                                           {DType::kFloat16, DType::kFloat16},
                                           {DType::kFloat32, DType::kFloat32}};
  for (const auto& [state, cache_dtype] : kinds)
    for (int d : {64, 128})
      for (bool cache : {true, false}) {
        if (!cache && cache_dtype != state) continue;  // the same call as the state's own cache dtype
        const DType in = (d == 64) == cache ? DType::kFloat16 : DType::kBFloat16;
        for (Shape s : {Shape::kChain, Shape::kChainUpdate, Shape::kVarlenChain})
          for (int T : {1, 4, 33}) {
            ProblemConfig c = make(s, StateLayout::kVLast, state, cache_dtype, T, seed++);
            c.intermediate = cache, c.K = c.V = d, c.in_dtype = in, c.H = 4, c.HV = 8;
            c.batch = 10, c.padding_rows = 2;
            if (s == Shape::kVarlenChain) c.seq_lens = many_lens(c.batch, T);
            cases.push_back({name_of(s, c), c});
          }
        ProblemConfig c = make(Shape::kChainUpdate, StateLayout::kVLast, state, cache_dtype, 48, seed++);
        c.intermediate = cache, c.K = c.V = d, c.in_dtype = in, c.H = 4, c.HV = 8, c.batch = 6, c.v_scale = 16.0;
        cases.push_back({name_of(Shape::kChainUpdate, c) + "_decayed", c});
      }
  cuda::Overrides o;
  o.verify_vlast_chain_min_batch = 1;
  const cuda::ScopedOverrides scoped(o);
  for (const Named& n : cases) {
    SCOPED_TRACE(n.name);
    check_verify(n.cfg);
    EXPECT_EQ(std::string(cuda::recurrent::last_recurrent_launch().kernel),
              cuda::recurrent::kernel_name(cuda::recurrent::RecurrentKernel::kVLastChain));
  }
}

// Blocks of zero codes under the scale 2^73 (block 0 of every third column, K-last; of every third row, V-last) with k
// zero over its first 32 entries in every token: the blocks that no token updates (K-last: those blocks; V-last: the
// rows below 32) stay zero through the chain and are stored as zeros (values), in the pool and in the cache, on the
// fp8 chain kernels (K-last with the cache, and without one on both forms; V-last with the cache and without one).
// Their stores' factor w 2^127 would overflow without the factored scale's floor (arch/fp8.cuh e4m3_factored_scale).
TEST(VerifyGpu, Fp8ZeroBlocksUnderLargeScales) {
  uint64_t seed = 4700;
  for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast})
    for (bool cache : {true, false})
      for (bool mma : {true, false}) {
        if (mma && (cache || layout == StateLayout::kVLast)) continue;  // the tensor-core form: K-last, no cache
        SCOPED_TRACE(std::string(layout_name(layout)) + (cache ? " cache" : " no cache") +
                     (mma ? " tensor cores" : ""));
        ProblemConfig c = make(Shape::kChainUpdate, layout, DType::kFloat8E4M3, DType::kFloat8E4M3, 4, seed++);
        c.intermediate = cache, c.H = 4, c.HV = 8, c.batch = 12, c.padding_rows = 1;
        Problem p(c);
        const int64_t head = int64_t(c.K) * c.V, stride = p.slot_stride();
        uint8_t* pool = p.as<uint8_t>("state");
        uint8_t* scales = p.as<uint8_t>("state_scales");
        for (int64_t s = 0; s < p.num_slots(); ++s)
          for (int64_t e = 0; e < c.HV * head; e += kFp8Block)
            if ((e % head) % c.V == 0 && (e % head) / c.V % 3 == 0 &&
                scales[(s * c.HV * head + e) / kFp8Block] != 255) {
              std::fill_n(pool + s * stride + e, kFp8Block, uint8_t(0));
              scales[(s * c.HV * head + e) / kFp8Block] = 200;
            }
        for (int64_t t = 0; t < p.total_tokens(); ++t)
          for (int h = 0; h < c.H; ++h)
            for (int i = 0; i < kFp8Block; ++i)
              host::store(p.buffer("k").bytes.data(), c.in_dtype, t * p.token_stride("k") + h * p.head_stride("k") + i,
                          0.0);
        cuda::Overrides o;
        o.verify_fp8_chain_min_batch = 1, o.verify_fp8_chain_mma = mma, o.verify_vlast_chain_min_batch = 1;
        const cuda::ScopedOverrides scoped(o);
        const Problem got = check_verify(p);
        // The untouched zero blocks read back as zeros (not NaN) from the pool slots written.
        for (int64_t slot : p.written_pool_slots_verify()) {
          const std::vector<double> st = got.read_state("state", slot);
          for (int h = 0; h < c.HV; ++h)
            for (int a = 0; a < 32; a += 3)
              for (int b = 0; b < kFp8Block; ++b) {  // S[h][k][v]: K-last column a block 0, V-last row a block 0
                const int64_t at =
                    h * head + (layout == StateLayout::kKLast ? int64_t(b) * c.V + a : int64_t(a) * c.V + b);
                ASSERT_EQ(st[size_t(at)], 0.0) << "slot " << slot << " head " << h << " at " << at;
              }
        }
      }
}

// ---- commit ------------------------------------------------------------------------------------
struct CommitCase {
  std::string name;
  ProblemConfig cfg;
  CommitSource source;
};

// Verify then commit, on both backends; the committed pool slots must match the reference's.
void check_commit(const Problem& before, CommitSource source) {
  Problem ref = before, got = before;
  DeviceProblem dev(got);
  verify(ref.verify_params(), {Backend::kCPU, nullptr});
  commit(ref.commit_params(source), {Backend::kCPU, nullptr});
  verify(got.verify_params(dev.resolver()), {Backend::kCUDA, dev.stream()});
  commit(got.commit_params(source, dev.resolver()), {Backend::kCUDA, dev.stream()});
  dev.download(got);
  check_commit_results(before, got, ref, source);
  // What commit only reads, o and the intermediate cache (and its scales), as verify alone leaves them.
  Problem verified = before;
  DeviceProblem dev_v(verified);
  verify(verified.verify_params(dev_v.resolver()), {Backend::kCUDA, dev_v.stream()});
  dev_v.download(verified);
  for (const char* name : {"o", "intermediate", "intermediate_scales"})
    if (before.has(name)) EXPECT_TRUE(BitwiseEqual(std::string(name) + " (written by commit)", got.buffer(name),
                                                   verified.buffer(name)));
}

std::vector<CommitCase> commit_cases() {
  std::vector<CommitCase> out;
  uint64_t seed = 3000;
  for (CommitSource src : {CommitSource::kCache, CommitSource::kRecompute})
    for (Shape s : {Shape::kChain, Shape::kTree, Shape::kVarlenTree})
      for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast})
        for (DType state : {DType::kFloat32, DType::kBFloat16, DType::kFloat16})
          for (DType cache : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
            if (src == CommitSource::kRecompute && cache != DType::kFloat32) continue;  // cache unused
            ProblemConfig c = make(s, layout, state, cache, 4, seed++);
            c.update_state = false;
            if (seed % 2) c.token_pad = 8, c.slot_pad = 24;
            out.push_back({std::string(src == CommitSource::kCache ? "cache_" : "recompute_") + name_of(s, c), c, src});
          }
  // From float8_e4m3 caches into 32- and 16-bit pools (commit_cache_kernel dequantizes by block), both layouts.
  for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast})
    for (Shape s : {Shape::kChain, Shape::kVarlenTree})
      for (DType state : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
        ProblemConfig c = make(s, layout, state, DType::kFloat8E4M3, 4, seed++);
        c.update_state = false;
        out.push_back({"cache_" + name_of(s, c), c, CommitSource::kCache});
      }
  // Replay past one chunk of the chain kernel (8 tokens), along a chain and along a tree's path.
  for (Shape s : {Shape::kChain, Shape::kTree, Shape::kVarlenTree})
    for (DType state : {DType::kFloat32, DType::kBFloat16}) {
      ProblemConfig c = make(s, StateLayout::kKLast, state, DType::kFloat32, 12, seed++);
      c.update_state = false, c.long_memory = state == DType::kFloat32;
      out.push_back({"recompute_" + name_of(s, c), c, CommitSource::kRecompute});
    }
  // Replay of batches in several waves of CTAs (see verify_cases).
  for (Shape s : {Shape::kChain, Shape::kVarlenTree})
    for (DType state : {DType::kFloat32, DType::kBFloat16}) {
      ProblemConfig c = make(s, StateLayout::kKLast, state, DType::kFloat32, 10, seed++);
      c.update_state = false, c.intermediate = false, c.H = 16, c.HV = 32, c.batch = 24, c.padding_rows = 4;
      if (s == Shape::kVarlenTree) c.seq_lens = many_lens(c.batch, 10);
      out.push_back({"recompute_" + name_of(s, c) + "_b24", c, CommitSource::kRecompute});
    }
  // Into float8_e4m3 pools, both layouts: from fp32 caches (commit_cache_kernel quantizes by block) and fp8 caches (it
  // copies the bytes and scales), by replay.
  for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast}) {
    for (Shape s : {Shape::kChain, Shape::kTree, Shape::kVarlenTree}) {
      for (DType cache : {DType::kFloat32, DType::kFloat8E4M3}) {
        ProblemConfig c = make(s, layout, DType::kFloat8E4M3, cache, 4, seed++);
        c.update_state = false;
        if (seed % 2) c.token_pad = 8, c.slot_pad = 32;
        out.push_back({"cache_" + name_of(s, c), c, CommitSource::kCache});
      }
      ProblemConfig c = make(s, layout, DType::kFloat8E4M3, DType::kFloat32, 12, seed++);
      c.update_state = false, c.long_memory = s == Shape::kChain;
      out.push_back({"recompute_" + name_of(s, c), c, CommitSource::kRecompute});
    }
    for (int d : {64, 256}) {
      ProblemConfig c = make(Shape::kVarlenTree, layout, DType::kFloat8E4M3, DType::kFloat8E4M3, 4, seed++);
      c.update_state = false, c.K = c.V = d;
      out.push_back({"cache_" + name_of(Shape::kVarlenTree, c), c, CommitSource::kCache});
      out.push_back({"recompute_" + name_of(Shape::kVarlenTree, c), c, CommitSource::kRecompute});
    }
  }
  for (CommitSource src : {CommitSource::kCache, CommitSource::kRecompute})
    for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast}) {
      ProblemConfig c = make(Shape::kChain, layout, DType::kBFloat16, DType::kBFloat16, 2, seed++);
      c.H = c.HV = 1, c.K = c.V = 64;
      out.push_back({std::string("Sanitize_") + (src == CommitSource::kCache ? "cache_" : "recompute_") + name_of(Shape::kChain, c),
                     c, src});
    }
  // Replay on float8_e4m3 pools after verify on the fp8 chain kernel: the qwen3-next heads over several waves with
  // padding rows, along chains and trees' paths, fp16 inputs with given gates, past 32 tokens, one sequence.
  for (Shape s : {Shape::kChain, Shape::kVarlenTree}) {
    ProblemConfig c = make(s, StateLayout::kKLast, DType::kFloat8E4M3, DType::kFloat32, 6, seed++);
    c.update_state = false, c.intermediate = false, c.H = 16, c.HV = 32, c.batch = 24, c.padding_rows = 4;
    if (s == Shape::kVarlenTree) c.seq_lens = many_lens(c.batch, 6);
    out.push_back({"recompute_" + name_of(s, c) + "_b24", c, CommitSource::kRecompute});
  }
  {
    ProblemConfig c = make(Shape::kTree, StateLayout::kKLast, DType::kFloat8E4M3, DType::kFloat32, 5, seed++);
    c.update_state = false, c.in_dtype = DType::kFloat16, c.gate_mode = GateMode::kGiven, c.K = c.V = 64;
    out.push_back({"recompute_" + name_of(Shape::kTree, c), c, CommitSource::kRecompute});
    c = make(Shape::kChain, StateLayout::kKLast, DType::kFloat8E4M3, DType::kFloat32, 40, seed++);
    c.update_state = false, c.long_memory = true;
    out.push_back({"recompute_" + name_of(Shape::kChain, c), c, CommitSource::kRecompute});
    c = make(Shape::kTree, StateLayout::kKLast, DType::kFloat8E4M3, DType::kFloat32, 4, seed++);
    c.update_state = false, c.batch = 1, c.padding_rows = 0;
    out.push_back({"recompute_" + name_of(Shape::kTree, c) + "_b1", c, CommitSource::kRecompute});
  }
  return out;
}

class CommitTest : public ::testing::TestWithParam<CommitCase> {};

TEST_P(CommitTest, MatchesCpuReference) { check_commit(Problem(GetParam().cfg), GetParam().source); }

INSTANTIATE_TEST_SUITE_P(Axes, CommitTest, ::testing::ValuesIn(commit_cases()),
                         [](const auto& info) { return info.param.name; });

// Bad rows found on the device: a slot past the pool, accepted past the draft: skipped and counted.
TEST(CommitGpu, BadRowsSkippedAndCountedSanitize) {
  for (CommitSource src : {CommitSource::kCache, CommitSource::kRecompute}) {
    for (int T : {2, 5}) {  // replay: the warp kernel, the chain kernel
    ProblemConfig c = make(Shape::kChain, StateLayout::kKLast, DType::kFloat32, DType::kFloat32, T, 4000);
    c.H = 1, c.HV = 2, c.K = c.V = 64, c.padding_rows = 0, c.batch = 4;
    Problem p(c);
    p.as<int32_t>("state_indices")[0] = int32_t(p.num_slots()) + 7;
    p.as<int32_t>("accepted")[1] = T;
    p.as<int32_t>("accepted")[2] = 2;
    Problem ref = p, got = p;
    DeviceProblem dev(got);
    // Verify runs as usual (row 0 is skipped there too); commit sees accepted > T only on the device:
    // the reference gets valid params and the bad row is compared as untouched.
    verify(ref.verify_params(), {Backend::kCPU, nullptr});
    commit(ref.commit_params(src), {Backend::kCPU, nullptr});
    verify(got.verify_params(dev.resolver()), {Backend::kCUDA, dev.stream()});
    got.as<int32_t>("accepted")[2] = T + 1;
    dev.upload(got, "accepted");
    commit(got.commit_params(src, dev.resolver()), {Backend::kCUDA, dev.stream()});
    dev.download(got);
    // Reference error count: row 0 in verify and in commit. The device adds one for row 2.
    EXPECT_EQ(got.as<int32_t>("error_flag")[0], ref.as<int32_t>("error_flag")[0] + 1);
    const int64_t slot1 = p.as<int32_t>("state_indices")[1], slot2 = p.as<int32_t>("state_indices")[2];
    EXPECT_TRUE(SlotsClose(got, ref, {slot1}, state_tolerance(OpFamily::kStep, c.state_dtype)));
    EXPECT_TRUE(Identical("row 2's slot (skipped)", got.read_state("state", slot2), p.read_state("state", slot2)));
    // every slot the commit stores (the reference's less row 2's) as the reference's, all the others untouched
    std::vector<int64_t> written;
    for (int64_t s : p.written_pool_slots_commit(src))
      if (s != slot2) written.push_back(s);
    EXPECT_TRUE(SlotsClose(got, ref, written, state_tolerance(OpFamily::kStep, c.state_dtype)));
    EXPECT_TRUE(UntouchedSlotsEqual(p, got, "state", written));
    EXPECT_TRUE(CacheUntouched(p, got, "intermediate", p.written_intermediate()));
    }
  }
}

// Verify in a CUDA graph, replayed, equals eager verify bit for bit (trees, the cache, and the chain kernel).
TEST(VerifyGpu, GraphReplayBitwiseEqualEager) {
  for (Shape s : {Shape::kChainUpdate, Shape::kVarlenTree, Shape::kVarlenChain}) {
    ProblemConfig c = make(s, StateLayout::kKLast, DType::kFloat32, DType::kFloat32, s == Shape::kVarlenChain ? 10 : 4, 5000);
    c.intermediate = s != Shape::kVarlenChain;  // no cache: the chain kernel
    const Problem before(c);
    Problem eager = before, graphed = before;
    DeviceProblem d_eager(eager), d_graph(graphed);
    verify(eager.verify_params(d_eager.resolver()), {Backend::kCUDA, d_eager.stream()});
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    GDNKIT_TEST_CUDA(cudaStreamBeginCapture(d_graph.stream(), cudaStreamCaptureModeGlobal));
    verify(graphed.verify_params(d_graph.resolver()), {Backend::kCUDA, d_graph.stream()});
    GDNKIT_TEST_CUDA(cudaStreamEndCapture(d_graph.stream(), &graph));
    GDNKIT_TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    GDNKIT_TEST_CUDA(cudaGraphLaunch(exec, d_graph.stream()));
    d_eager.download(eager);
    d_graph.download(graphed);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    for (const char* name : {"o", "state", "intermediate", "error_flag"})
      if (before.has(name)) EXPECT_TRUE(BitwiseEqual(name, graphed.buffer(name), eager.buffer(name)));
    // and the eager run is right
    Problem ref = before;
    verify(ref.verify_params(), {Backend::kCPU, nullptr});
    check_verify_results(before, eager, ref);
  }
}

}  // namespace
}  // namespace gdnkit::test
