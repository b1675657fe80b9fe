// The CUDA backend's kernel choice as pure host code (src/cuda/recurrent/heuristics.h,
// src/cuda/prefill/heuristics.h): every rule of the choice, on an H100's SM count and residencies, without a GPU.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "cuda/host/overrides.h"
#include "cuda/prefill/checkpoint_clock.h"
#include "cuda/prefill/heuristics.h"
#include "cuda/prefill/item_order.h"
#include "cuda/recurrent/heuristics.h"
#include "gdnkit/gdnkit.h"
#include "support/problem.h"

namespace gdnkit::cuda {
namespace {

using recurrent::Candidates;
using recurrent::RecurrentCall;
using recurrent::RecurrentKernel;
using recurrent::RecurrentOp;

constexpr int kSms = 132;  // H100 SXM

// qwen3-next (HV = 32, K = V = 128) on an H100: each candidate's grid for B sequences and its residency
// (CTAs per SM x SMs) as the launcher would measure them.
Candidates h100_candidates(int64_t B) {
  Candidates c;
  c.regular = {32 * 4 * B, 8 * kSms};      // 4 CTAs per head, 32 warps per SM
  c.wide = {32 * 2 * B, 7 * kSms};         // 2 CTAs per head, 28 warps per SM
  c.narrow = {32 * 8 * B, 0};
  c.vlast_decode = {32 * 4 * B, 8 * kSms};
  c.mma_decode = {32 * 2 * B, 6 * kSms};   // 24 warps per SM
  c.mma_decode_tf32 = {32 * 2 * B, 5 * kSms};  // 20 warps per SM
  c.chain_mma = {32 * 4 * B, 8 * kSms};
  c.fp8_chain = {32 * 2 * B, 3 * kSms};    // 2 CTAs per head, 12 warps per SM
  c.fp8_chain_mma = {32 * 2 * B, 3 * kSms};
  c.vlast_chain = {32 * 2 * B, 3 * kSms};  // 2 CTAs of 64 columns per head, 12 warps per SM
  return c;
}

RecurrentCall decode_call(DType state, DType input, int64_t B, StateLayout layout = StateLayout::kKLast) {
  RecurrentCall c;
  c.op = RecurrentOp::kDecode;
  c.layout = layout;
  c.state_dtype = state;
  c.input_dtype = input;
  c.batch = B;
  return c;
}

RecurrentKernel kernel_at(const RecurrentCall& c, const Overrides& o = {}) {
  return recurrent::choose_recurrent_kernel(c, h100_candidates(c.batch), o).kernel;
}

// The fp8 and V-last chain kernels' reach ends at a bf16 cache of an fp8 pool, trees, fp32 inputs, K = 256 and replay:
// the warp kernel there.
void expect_warp_kernel_past_chains(const RecurrentCall& c) {
  RecurrentCall other = c;
  other.caches_states = true, other.cache_dtype = DType::kBFloat16;
  EXPECT_EQ(kernel_at(other), RecurrentKernel::kWarpRegular);
  other = c, other.tree = true;
  EXPECT_EQ(kernel_at(other), RecurrentKernel::kWarpRegular);
  other = c, other.input_dtype = DType::kFloat32;
  EXPECT_EQ(kernel_at(other), RecurrentKernel::kWarpRegular);
  other = c, other.head_dim_k = other.head_dim_v = 256;
  EXPECT_EQ(kernel_at(other), RecurrentKernel::kWarpRegular);
  other = c, other.op = RecurrentOp::kRecompute;  // commit by recompute: the warp kernel (measured no faster there)
  EXPECT_EQ(kernel_at(other), RecurrentKernel::kWarpRegular);
}

TEST(RecurrentHeuristics, Bf16DecodeBySize) {
  // bf16 state and inputs: tensor cores while this grid and the next fit together (B <= 6), then the wide tile in
  // prefetch mode (B <= 12), then one-warp CTAs (of the wide tile) in prefetch mode; without those, the narrow tile
  // (B <= 16) and the regular tile.
  for (int64_t B : {1, 2, 6}) {
    const auto r = recurrent::choose_recurrent_kernel(decode_call(DType::kBFloat16, DType::kBFloat16, B),
                                                      h100_candidates(B), {});
    EXPECT_EQ(r.kernel, RecurrentKernel::kMmaDecode) << "B=" << B;
    EXPECT_TRUE(r.prefetch) << "B=" << B;
  }
  for (int64_t B : {7, 12}) EXPECT_EQ(kernel_at(decode_call(DType::kBFloat16, DType::kBFloat16, B)), RecurrentKernel::kWarpWide);
  for (int64_t B : {13, 16, 17, 32, 512}) {
    const auto r = recurrent::choose_recurrent_kernel(decode_call(DType::kBFloat16, DType::kBFloat16, B),
                                                      h100_candidates(B), {});
    EXPECT_EQ(r.kernel, RecurrentKernel::kWarpSolo) << "B=" << B;
    EXPECT_TRUE(r.prefetch) << "B=" << B;
  }
  Overrides no_solo;
  no_solo.decode_solo_min_batch = 0;
  for (int64_t B : {13, 16}) {
    const auto r = recurrent::choose_recurrent_kernel(decode_call(DType::kBFloat16, DType::kBFloat16, B),
                                                      h100_candidates(B), no_solo);
    EXPECT_EQ(r.kernel, RecurrentKernel::kWarpNarrow) << "B=" << B;
    EXPECT_FALSE(r.prefetch);
  }
  for (int64_t B : {17, 32, 512}) {
    const auto r = recurrent::choose_recurrent_kernel(decode_call(DType::kBFloat16, DType::kBFloat16, B),
                                                      h100_candidates(B), no_solo);
    EXPECT_EQ(r.kernel, RecurrentKernel::kWarpRegular) << "B=" << B;
    EXPECT_FALSE(r.prefetch) << "B=" << B;
  }
  // fp16 inputs have no tensor-core decode against bf16 state: the tiles from B = 1.
  EXPECT_EQ(kernel_at(decode_call(DType::kBFloat16, DType::kFloat16, 1)), RecurrentKernel::kWarpRegular);
  EXPECT_EQ(kernel_at(decode_call(DType::kBFloat16, DType::kFloat16, 4)), RecurrentKernel::kWarpWide);
  // fp16 pools as bf16 pools: tensor cores with fp16 or bf16 inputs (bf16 inputs on tf32 steps while that grid and the
  // next fit at 20 warps per SM, B <= 5, then brought to fp16 under a power of two).
  for (int64_t B : {1, 5}) {
    EXPECT_EQ(kernel_at(decode_call(DType::kFloat16, DType::kBFloat16, B)), RecurrentKernel::kMmaDecodeTf32);
    EXPECT_EQ(kernel_at(decode_call(DType::kFloat16, DType::kFloat16, B)), RecurrentKernel::kMmaDecode);
  }
  Overrides no_tf32;
  no_tf32.decode_mma_tf32 = false;
  EXPECT_EQ(kernel_at(decode_call(DType::kFloat16, DType::kBFloat16, 1), no_tf32), RecurrentKernel::kMmaDecode);
  Overrides no_mma;
  no_mma.decode_mma = false;
  EXPECT_EQ(kernel_at(decode_call(DType::kFloat16, DType::kBFloat16, 1), no_mma), RecurrentKernel::kWarpRegular);
  for (DType in : {DType::kBFloat16, DType::kFloat16}) {
    EXPECT_EQ(kernel_at(decode_call(DType::kFloat16, in, 6)), RecurrentKernel::kMmaDecode);
    EXPECT_EQ(kernel_at(decode_call(DType::kFloat16, in, 7)), RecurrentKernel::kWarpWide);
    EXPECT_EQ(kernel_at(decode_call(DType::kFloat16, in, 14)), RecurrentKernel::kWarpSolo);
    EXPECT_EQ(kernel_at(decode_call(DType::kFloat16, in, 14), no_solo), RecurrentKernel::kWarpNarrow);
  }
  EXPECT_EQ(kernel_at(decode_call(DType::kFloat16, DType::kFloat32, 1)), RecurrentKernel::kWarpRegular);
  EXPECT_EQ(kernel_at(decode_call(DType::kFloat16, DType::kBFloat16, 64)), RecurrentKernel::kWarpSolo);
  // One-warp CTAs from 400 heads (B HV): at HV = 8 (grids as qwen3-next's at B HV / 32) the regular tile up to B = 49.
  for (DType state : {DType::kBFloat16, DType::kFloat16})
    for (int64_t B : {32, 48, 49, 50, 56, 128}) {
      RecurrentCall n = decode_call(state, DType::kBFloat16, B);
      n.num_v_heads = 8;
      const auto r = recurrent::choose_recurrent_kernel(n, h100_candidates(B / 4), {});
      EXPECT_EQ(r.kernel, B >= 50 ? RecurrentKernel::kWarpSolo : RecurrentKernel::kWarpRegular) << "B=" << B;
    }
}

TEST(RecurrentHeuristics, Fp32DecodePinsTheSlotInPrefetchMode) {
  // fp32 K-last decode: prefetch mode while the grid is at most half the resident CTAs (B <= 4 here).
  for (int64_t B : {1, 4}) {
    const auto r = recurrent::choose_recurrent_kernel(decode_call(DType::kFloat32, DType::kBFloat16, B),
                                                      h100_candidates(B), {});
    EXPECT_EQ(r.kernel, RecurrentKernel::kWarpPinned) << "B=" << B;
    EXPECT_TRUE(r.prefetch);
  }
  const auto r = recurrent::choose_recurrent_kernel(decode_call(DType::kFloat32, DType::kBFloat16, 5),
                                                    h100_candidates(5), {});
  EXPECT_EQ(r.kernel, RecurrentKernel::kWarpRegular);
  EXPECT_FALSE(r.prefetch);
  // From B = 8 outside the regular tile's prefetch mode: the regular tile in one-warp CTAs, themselves in prefetch mode
  // from 1024 heads (B = 32); the override moves or turns off the limit.
  for (int64_t B : {8, 31, 32, 512}) {
    const auto s = recurrent::choose_recurrent_kernel(decode_call(DType::kFloat32, DType::kBFloat16, B),
                                                      h100_candidates(B), {});
    EXPECT_EQ(s.kernel, RecurrentKernel::kWarpSolo) << "B=" << B;
    EXPECT_EQ(s.prefetch, B >= 32) << "B=" << B;
  }
  RecurrentCall tp8 = decode_call(DType::kFloat32, DType::kBFloat16, 127);  // by heads: HV = 8 from B = 128
  tp8.num_v_heads = 8;
  EXPECT_FALSE(recurrent::choose_recurrent_kernel(tp8, h100_candidates(32), {}).prefetch);
  tp8.batch = 128;
  EXPECT_TRUE(recurrent::choose_recurrent_kernel(tp8, h100_candidates(32), {}).prefetch);
  Overrides off;
  off.state_prefetch = false;
  EXPECT_FALSE(recurrent::choose_recurrent_kernel(decode_call(DType::kFloat32, DType::kBFloat16, 512),
                                                  h100_candidates(512), off)
                   .prefetch);
  EXPECT_EQ(kernel_at(decode_call(DType::kFloat32, DType::kBFloat16, 7)), RecurrentKernel::kWarpRegular);
  Overrides never, from5;
  never.decode_solo_min_batch = 0;
  from5.decode_solo_min_batch = 5;
  EXPECT_EQ(kernel_at(decode_call(DType::kFloat32, DType::kBFloat16, 64), never), RecurrentKernel::kWarpRegular);
  EXPECT_EQ(kernel_at(decode_call(DType::kFloat32, DType::kBFloat16, 5), from5), RecurrentKernel::kWarpSolo);
  EXPECT_EQ(kernel_at(decode_call(DType::kFloat32, DType::kBFloat16, 4), from5), RecurrentKernel::kWarpPinned);
  // 16-bit pools: one-warp CTAs of the wide tile past its prefetch mode, from the same batch.
  EXPECT_EQ(kernel_at(decode_call(DType::kBFloat16, DType::kBFloat16, 64), never), RecurrentKernel::kWarpRegular);
  EXPECT_EQ(kernel_at(decode_call(DType::kBFloat16, DType::kBFloat16, 64), from5), RecurrentKernel::kWarpSolo);
  // K = 256 has no tile widths: the regular tile.
  auto c = decode_call(DType::kFloat32, DType::kBFloat16, 1);
  c.head_dim_k = c.head_dim_v = 256;
  EXPECT_EQ(kernel_at(c), RecurrentKernel::kWarpRegular);
}

TEST(RecurrentHeuristics, VLastDecodeHasItsKernel) {
  for (DType state : {DType::kFloat32, DType::kBFloat16}) {
    const auto r = recurrent::choose_recurrent_kernel(decode_call(state, DType::kBFloat16, 8, StateLayout::kVLast),
                                                      h100_candidates(8), {});
    EXPECT_EQ(r.kernel, RecurrentKernel::kVLastDecode);
    EXPECT_TRUE(r.prefetch);  // 1024 CTAs <= 1056 resident, share 1
    EXPECT_FALSE(recurrent::choose_recurrent_kernel(decode_call(state, DType::kBFloat16, 9, StateLayout::kVLast),
                                                    h100_candidates(9), {})
                     .prefetch);
  }
  auto c = decode_call(DType::kFloat32, DType::kBFloat16, 1, StateLayout::kVLast);
  c.head_dim_k = c.head_dim_v = 256;
  EXPECT_EQ(kernel_at(c), RecurrentKernel::kWarpRegular);
}

TEST(RecurrentHeuristics, ChainsOnTensorCoresFromThreeTokens) {
  RecurrentCall c = decode_call(DType::kFloat32, DType::kBFloat16, 128);
  c.op = RecurrentOp::kVerify;
  c.num_draft_tokens = 4;
  EXPECT_EQ(kernel_at(c), RecurrentKernel::kChainMma);
  c.num_draft_tokens = 2;
  EXPECT_EQ(kernel_at(c), RecurrentKernel::kWarpRegular);
  c.num_draft_tokens = 4;
  c.caches_states = true;  // the chain kernel stores no intermediate states
  EXPECT_EQ(kernel_at(c), RecurrentKernel::kWarpRegular);
  c.caches_states = false;
  c.tree = true;
  EXPECT_EQ(kernel_at(c), RecurrentKernel::kWarpRegular);
  c.tree = false;
  c.input_dtype = DType::kFloat16;  // built for bf16 inputs only
  EXPECT_EQ(kernel_at(c), RecurrentKernel::kWarpRegular);
  c.input_dtype = DType::kBFloat16;
  c.layout = StateLayout::kVLast;
  EXPECT_EQ(kernel_at(c), RecurrentKernel::kWarpRegular);
  // Commit by recompute and prefill's short sequences are chains.
  for (RecurrentOp op : {RecurrentOp::kRecompute, RecurrentOp::kPrefill}) {
    RecurrentCall r = decode_call(DType::kBFloat16, DType::kBFloat16, 64);
    r.op = op;
    r.num_draft_tokens = 8;
    EXPECT_EQ(kernel_at(r), RecurrentKernel::kChainMma);
  }
}

TEST(RecurrentHeuristics, VLastVerifyChainsOnTheirKernel) {
  RecurrentCall c = decode_call(DType::kFloat8E4M3, DType::kBFloat16, 64, StateLayout::kVLast);
  c.op = RecurrentOp::kVerify;
  c.num_draft_tokens = 4;
  c.caches_states = true, c.cache_dtype = DType::kFloat8E4M3;
  // With a cache from B = 6, without one from B = 32.
  for (int64_t B : {1, 4, 5, 6, 8, 64, 256}) {
    RecurrentCall n = c;
    n.batch = B;
    EXPECT_EQ(kernel_at(n), B >= 6 ? RecurrentKernel::kVLastChain : RecurrentKernel::kWarpRegular) << "B " << B;
    n.caches_states = false;
    EXPECT_EQ(kernel_at(n), B >= 32 ? RecurrentKernel::kVLastChain : RecurrentKernel::kWarpRegular) << "B " << B;
  }
  RecurrentCall other = c;
  other.input_dtype = DType::kFloat16;
  EXPECT_EQ(kernel_at(other), RecurrentKernel::kVLastChain);
  other = c, other.head_dim_k = other.head_dim_v = 64;
  EXPECT_EQ(kernel_at(other), RecurrentKernel::kVLastChain);
  // The warp kernel: other caches, trees, fp32 inputs, K = 256, other ops, or where asked.
  expect_warp_kernel_past_chains(c);
  other = c, other.state_dtype = DType::kBFloat16;
  EXPECT_NE(kernel_at(other), RecurrentKernel::kVLastChain);
  Overrides never, from_one;
  never.verify_vlast_chain_min_batch = 0;
  from_one.verify_vlast_chain_min_batch = 1;
  EXPECT_EQ(kernel_at(c, never), RecurrentKernel::kWarpRegular);
  other = c, other.batch = 1, other.caches_states = false;
  EXPECT_EQ(kernel_at(other, from_one), RecurrentKernel::kVLastChain);
  Candidates unknown = h100_candidates(c.batch);  // not built for the call
  unknown.vlast_chain = {};
  EXPECT_EQ(recurrent::choose_recurrent_kernel(c, unknown, Overrides{}).kernel, RecurrentKernel::kWarpRegular);
  // The other pools (the benchmark's fp32 cache): fp32 with a cache from B = 1, never without; bf16 and fp16 never
  // with a cache, from B = 16 without; a bf16 cache with a bf16 pool by override only (not measured).
  for (int64_t B : {1, 8, 16, 64}) {
    RecurrentCall n = c;
    n.batch = B, n.cache_dtype = DType::kFloat32;
    n.state_dtype = DType::kFloat32;
    EXPECT_EQ(kernel_at(n), RecurrentKernel::kVLastChain) << "B " << B;
    n.caches_states = false;
    EXPECT_EQ(kernel_at(n), RecurrentKernel::kWarpRegular) << "B " << B;
    for (DType s : {DType::kBFloat16, DType::kFloat16}) {
      n.state_dtype = s, n.caches_states = true;
      EXPECT_EQ(kernel_at(n), RecurrentKernel::kWarpRegular) << "B " << B;
      n.caches_states = false;
      EXPECT_EQ(kernel_at(n), B >= 16 ? RecurrentKernel::kVLastChain : RecurrentKernel::kWarpRegular) << "B " << B;
    }
  }
  other = c, other.state_dtype = DType::kBFloat16, other.cache_dtype = DType::kBFloat16;
  EXPECT_EQ(kernel_at(other, from_one), RecurrentKernel::kVLastChain);
  other.cache_dtype = DType::kFloat16;  // a cache of another 16-bit dtype: not built
  EXPECT_EQ(kernel_at(other, from_one), RecurrentKernel::kWarpRegular);
  // The boundaries count heads, B HV: at HV = 8 (qwen3.5-397b-tp8) fp8 with the cache from B = 24, without one from
  // B = 128, bf16 without a cache from B = 64, fp32 with its cache at any B; the override still counts sequences.
  for (int64_t B : {1, 23, 24, 63, 64, 127, 128}) {
    RecurrentCall n = c;
    n.batch = B, n.num_v_heads = 8;
    EXPECT_EQ(kernel_at(n), B >= 24 ? RecurrentKernel::kVLastChain : RecurrentKernel::kWarpRegular) << "B " << B;
    n.caches_states = false;
    EXPECT_EQ(kernel_at(n), B >= 128 ? RecurrentKernel::kVLastChain : RecurrentKernel::kWarpRegular) << "B " << B;
    EXPECT_EQ(kernel_at(n, from_one), RecurrentKernel::kVLastChain) << "B " << B;
    n.state_dtype = DType::kBFloat16;
    EXPECT_EQ(kernel_at(n), B >= 64 ? RecurrentKernel::kVLastChain : RecurrentKernel::kWarpRegular) << "B " << B;
    n.state_dtype = DType::kFloat32, n.caches_states = true, n.cache_dtype = DType::kFloat32;
    EXPECT_EQ(kernel_at(n), RecurrentKernel::kVLastChain) << "B " << B;
  }
}

TEST(RecurrentHeuristics, Fp8VerifyChainsOnTheirKernel) {
  RecurrentCall c = decode_call(DType::kFloat8E4M3, DType::kBFloat16, 64);
  c.op = RecurrentOp::kVerify;
  c.num_draft_tokens = 4;
  c.caches_states = true, c.cache_dtype = DType::kFloat8E4M3;
  EXPECT_EQ(kernel_at(c), RecurrentKernel::kFp8Chain);
  c.caches_states = false;  // no cache: its tensor-core form, unless asked
  EXPECT_EQ(kernel_at(c), RecurrentKernel::kFp8ChainMma);
  Overrides cuda_cores;
  cuda_cores.verify_fp8_chain_mma = false;
  EXPECT_EQ(kernel_at(c, cuda_cores), RecurrentKernel::kFp8Chain);
  Candidates unknown = h100_candidates(c.batch);  // no fit measured for the tensor-core form
  unknown.fp8_chain_mma = {};
  EXPECT_EQ(recurrent::choose_recurrent_kernel(c, unknown, Overrides{}).kernel, RecurrentKernel::kFp8Chain);
  c.input_dtype = DType::kFloat16;
  EXPECT_EQ(kernel_at(c), RecurrentKernel::kFp8ChainMma);
  {  // without a cache: B = 1 the warp kernel, B = 2 the CUDA-core form, from B = 3 the tensor-core one; K = 64 too
    RecurrentCall n = c;
    n.batch = 1;
    EXPECT_EQ(kernel_at(n), RecurrentKernel::kWarpRegular);
    n.batch = 2;
    EXPECT_EQ(kernel_at(n), RecurrentKernel::kFp8Chain);
    n.batch = 3;
    EXPECT_EQ(kernel_at(n), RecurrentKernel::kFp8ChainMma);
    n = c, n.head_dim_k = n.head_dim_v = 64;
    EXPECT_EQ(kernel_at(n), RecurrentKernel::kFp8ChainMma);
    Overrides never;
    never.verify_fp8_chain_min_batch = 0;
    EXPECT_EQ(kernel_at(c, never), RecurrentKernel::kWarpRegular);
  }
  c.caches_states = true;
  // The warp kernel: other caches, trees, fp32 inputs, K = 256, other ops, or where asked (V-last: its own kernel).
  expect_warp_kernel_past_chains(c);
  RecurrentCall other = c;
  other.head_dim_k = other.head_dim_v = 64;
  EXPECT_EQ(kernel_at(other), RecurrentKernel::kFp8Chain);
  other = c, other.layout = StateLayout::kVLast;
  EXPECT_EQ(kernel_at(other), RecurrentKernel::kVLastChain);
  other = c, other.op = RecurrentOp::kPrefill;
  EXPECT_NE(kernel_at(other), RecurrentKernel::kFp8Chain);
  other = c, other.state_dtype = DType::kBFloat16;
  EXPECT_NE(kernel_at(other), RecurrentKernel::kFp8Chain);
  // B = 1 keeps the warp kernel (twice the warps, each a shorter chain), B = 2 takes the fp8 chain kernel.
  other = c, other.batch = 1;
  EXPECT_EQ(kernel_at(other), RecurrentKernel::kWarpRegular);
  other.batch = 2;
  EXPECT_EQ(kernel_at(other), RecurrentKernel::kFp8Chain);
  Overrides o;
  o.verify_fp8_chain_min_batch = 0;  // never
  EXPECT_EQ(kernel_at(c, o), RecurrentKernel::kWarpRegular);
  o.verify_fp8_chain_min_batch = 1;
  other = c, other.batch = 1;
  EXPECT_EQ(kernel_at(other, o), RecurrentKernel::kFp8Chain);
  o.verify_fp8_chain_min_batch = 128;
  EXPECT_EQ(kernel_at(c, o), RecurrentKernel::kWarpRegular);
  const auto r = recurrent::choose_recurrent_kernel(c, h100_candidates(c.batch), Overrides{});
  EXPECT_FALSE(r.prefetch);
  // The boundary counts heads, B HV >= 48: at HV = 8 with the cache from B = 6; without one the tensor-core form from
  // B = 3 at any HV, and B = 2 the warp kernel there.
  for (int64_t B : {1, 2, 3, 5, 6, 16}) {
    RecurrentCall n = c;
    n.batch = B, n.num_v_heads = 8;
    EXPECT_EQ(kernel_at(n), B >= 6 ? RecurrentKernel::kFp8Chain : RecurrentKernel::kWarpRegular) << "B " << B;
    n.caches_states = false;
    EXPECT_EQ(kernel_at(n), B >= 3 ? RecurrentKernel::kFp8ChainMma : RecurrentKernel::kWarpRegular) << "B " << B;
    EXPECT_EQ(kernel_at(n, cuda_cores), B >= 6 ? RecurrentKernel::kFp8Chain : RecurrentKernel::kWarpRegular)
        << "B " << B;
  }
}

TEST(RecurrentHeuristics, Fp8DecodeColumnsBySize) {
  const Overrides o;
  // By heads, B HV: at K = 128 32 columns from 384 (HV = 32: B = 12; HV = 8: B = 48).
  struct Case {
    int64_t batch;
    int heads, K, columns;
  };
  const Case cases[] = {
      {1, 32, 128, 16},
      {11, 32, 128, 16},
      {12, 32, 128, 32},
      {47, 8, 128, 16},
      {48, 8, 128, 32},
      {1, 32, 64, 8},
      {8, 32, 64, 8},
      {9, 32, 64, 16},
      {32, 8, 64, 8},
      {33, 8, 64, 16},
      {2, 32, 256, 8},
      {3, 32, 256, 16},
      {512, 32, 64, 16},  // 32 columns built at K = 128 only
      {512, 32, 256, 16},
  };
  for (const Case& x : cases)
    EXPECT_EQ(recurrent::fp8_decode_columns(x.batch, x.heads, x.K, o), x.columns)
        << "B " << x.batch << ", HV " << x.heads << ", K " << x.K;
  Overrides forced;
  forced.decode_fp8_columns = 16;
  EXPECT_EQ(recurrent::fp8_decode_columns(1, 32, 128, forced), 16);
  forced.decode_fp8_columns = 32;
  EXPECT_EQ(recurrent::fp8_decode_columns(1, 32, 256, forced), 8);  // not built there: the heuristic
  forced.decode_fp8_columns = 12;
  EXPECT_EQ(recurrent::fp8_decode_columns(512, 32, 128, forced), 32);
}

// K-last fp8 decode in prefetch mode on every grid (qwen3-next at 16 columns a warp: 64 B CTAs of 4 warps, 4 of them
// per SM on 132 SMs): those that fit at once and those of many waves; none without prefetch mode.
TEST(RecurrentHeuristics, Fp8DecodePrefetchEveryGrid) {
  Overrides o;
  for (int64_t grid : {64, 128, 512, 528, 4096, 32768})
    EXPECT_TRUE(recurrent::fp8_decode_prefetch(grid, o)) << grid << " CTAs";
  EXPECT_FALSE(recurrent::fp8_decode_prefetch(0, o));
  o.state_prefetch = false;
  EXPECT_FALSE(recurrent::fp8_decode_prefetch(64, o));
  EXPECT_FALSE(recurrent::fp8_decode_prefetch(4096, o));
}

TEST(RecurrentHeuristics, VLastFp8DecodeColumnsBySize) {
  const Overrides o;
  // qwen3-next (HV = 32, V = 128) on 132 SMs: half-line CTAs up to 2 line CTAs per SM (B = 8)
  EXPECT_EQ(recurrent::vlast_fp8_decode_columns(1, 32, 128, 132, o), 64);
  EXPECT_EQ(recurrent::vlast_fp8_decode_columns(8, 32, 128, 132, o), 64);
  EXPECT_EQ(recurrent::vlast_fp8_decode_columns(9, 32, 128, 132, o), 128);
  EXPECT_EQ(recurrent::vlast_fp8_decode_columns(512, 32, 128, 132, o), 128);
  EXPECT_EQ(recurrent::vlast_fp8_decode_columns(4, 32, 256, 132, o), 64);  // two line CTAs a head
  EXPECT_EQ(recurrent::vlast_fp8_decode_columns(5, 32, 256, 132, o), 128);
  Overrides forced;
  forced.decode_vlast_fp8_columns = 128;
  EXPECT_EQ(recurrent::vlast_fp8_decode_columns(1, 32, 128, 132, forced), 128);
  forced.decode_vlast_fp8_columns = 64;
  EXPECT_EQ(recurrent::vlast_fp8_decode_columns(512, 32, 128, 132, forced), 64);
  forced.decode_vlast_fp8_columns = 96;  // not a piece: the heuristic
  EXPECT_EQ(recurrent::vlast_fp8_decode_columns(512, 32, 128, 132, forced), 128);
}

TEST(RecurrentHeuristics, OverridesMoveTheChoice) {
  RecurrentCall verify = decode_call(DType::kFloat32, DType::kBFloat16, 128);
  verify.op = RecurrentOp::kVerify;
  verify.num_draft_tokens = 2;
  Overrides o;
  o.chain_mma_min_tokens = 2;
  EXPECT_EQ(kernel_at(verify, o), RecurrentKernel::kChainMma);
  verify.num_draft_tokens = 8;
  o.chain_mma_min_tokens = 0;  // never
  EXPECT_EQ(kernel_at(verify, o), RecurrentKernel::kWarpRegular);

  Overrides no_mma;
  no_mma.decode_mma = false;
  EXPECT_EQ(kernel_at(decode_call(DType::kBFloat16, DType::kBFloat16, 4), no_mma), RecurrentKernel::kWarpWide);
  Overrides no_wide = no_mma;
  no_wide.decode_wide_max_batch = 0;
  EXPECT_EQ(kernel_at(decode_call(DType::kBFloat16, DType::kBFloat16, 4), no_wide), RecurrentKernel::kWarpNarrow);
  no_wide.decode_narrow_max_batch = 0;
  EXPECT_EQ(kernel_at(decode_call(DType::kBFloat16, DType::kBFloat16, 4), no_wide), RecurrentKernel::kWarpRegular);

  // Without prefetch mode no grid prefetches, and the kernels that need it are not taken.
  Overrides no_prefetch;
  no_prefetch.state_prefetch = false;
  const auto r = recurrent::choose_recurrent_kernel(decode_call(DType::kBFloat16, DType::kBFloat16, 4),
                                                    h100_candidates(4), no_prefetch);
  EXPECT_EQ(r.kernel, RecurrentKernel::kWarpNarrow);
  EXPECT_FALSE(r.prefetch);
  EXPECT_EQ(kernel_at(decode_call(DType::kFloat32, DType::kBFloat16, 1), no_prefetch), RecurrentKernel::kWarpRegular);
}

// ---- prefill ------------------------------------------------------------------------------------

// A qwen3-next prefill of the given sequence lengths: bf16 inputs in [T, heads, 128] rows, fp32 K-last pool. The
// heuristics read pointers only for alignment and the host copy of cu_seqlens.
struct PrefillCall {
  std::vector<int64_t> cu;
  PrefillParams p;
  explicit PrefillCall(const std::vector<int64_t>& lengths, int H = 16, int HV = 32, DType input = DType::kBFloat16) {
    cu.push_back(0);
    for (int64_t L : lengths) cu.push_back(cu.back() + L);
    auto* base = reinterpret_cast<char*>(uintptr_t(1) << 20);  // 16-byte aligned, never dereferenced
    p.heads = {.num_qk_heads = H, .num_v_heads = HV, .head_dim_k = 128, .head_dim_v = 128};
    p.num_seqs = int32_t(lengths.size());
    p.total_tokens = cu.back();
    p.q = {base, input, H * 128, 128};
    p.k = {base, input, H * 128, 128};
    p.v = {base, input, HV * 128, 128};
    p.o = {base, input, HV * 128, 128};
    p.state = {base, DType::kFloat32, StateLayout::kKLast, 64, int64_t(HV) * 128 * 128};
    p.cu_seqlens_host = cu.data();
  }
};

TEST(PrefillHeuristics, HeadPassWithPrepWarpgroupOnLongSequences) {
  PrefillCall call({8192, 8192, 8192, 8192, 8192, 8192, 8192, 8192});
  const auto c = chunked_prefill::choose_prefill(call.p, kSms, {});
  EXPECT_EQ(c.short_len, 0);
  EXPECT_FALSE(c.only_short);
  EXPECT_EQ(c.vtile, chunked_prefill::kVTileHead);
  EXPECT_EQ(c.head_split, 1);  // 256 (sequence, head) pairs: more than one CTA per SM already
  EXPECT_TRUE(c.wgmma_pass);
  EXPECT_TRUE(c.m_warpgroup);
  EXPECT_TRUE(c.m_in_pass);
  EXPECT_TRUE(c.early_state_pass);  // 256 CTAs <= 4 per SM
}

TEST(PrefillHeuristics, FewHeadsSplitTheHead) {
  // One sequence with 32 value heads (without context parallelism): 64 CTAs of half a head each still fit the SMs
  // once.
  PrefillCall call({8192});
  Overrides no_cp;
  no_cp.prefill_cp_segment_len = 0;
  const auto c = chunked_prefill::choose_prefill(call.p, kSms, no_cp);
  EXPECT_EQ(c.head_split, 2);
  EXPECT_TRUE(c.wgmma_pass);   // 64 columns per CTA: one warpgroup
  EXPECT_FALSE(c.m_warpgroup);  // needs two state warpgroups
  EXPECT_FALSE(c.m_in_pass);    // one warpgroup per CTA reads M from the workspace
  PrefillCall three({8192, 8192, 8192});  // 96 heads: 192 CTAs would not fit once
  EXPECT_EQ(chunked_prefill::choose_prefill(three.p, kSms, {}).head_split, 1);
}

// Context parallelism: segments so that the longest sequence's segments and heads give about one CTA per SM, where
// that sequence holds at least eight of them, or four to seven in a prompt of 16384 tokens or more. With four to seven,
// where the local pass (2 s - 3 CTAs a head) would take two waves, the first segment's final pass runs beside it and
// the sequence takes one segment more (the final pass's other segments still one wave).
TEST(PrefillHeuristics, ContextParallelSegmentsForLongSequencesAndFewHeads) {
  PrefillCall tp8({65536}, 2, 8);  // 16 segments of 4096 tokens x 8 heads = 128 CTAs
  const auto a = chunked_prefill::choose_prefill(tp8.p, kSms, {});
  EXPECT_EQ(a.cp_segment_len, 4096);
  EXPECT_FALSE(a.cp_first_final);  // 16 segments a wave: each is a sixteenth of the final pass
  EXPECT_EQ(a.head_split, 1);
  EXPECT_TRUE(a.wgmma_pass);
  EXPECT_TRUE(a.early_state_pass);  // the local pass: 2 x 17 states x 8 heads <= 4 CTAs per SM
  Overrides beside;
  beside.prefill_cp_first_final = 1;
  EXPECT_TRUE(chunked_prefill::choose_prefill(tp8.p, kSms, beside).cp_first_final);
  EXPECT_EQ(a.cp_scan_cols, 8);  // 8 heads x 16 CTAs of 8 columns
  PrefillCall tp8_32k({32768}, 2, 8);  // 16 segments of 2048
  EXPECT_EQ(chunked_prefill::choose_prefill(tp8_32k.p, kSms, {}).cp_segment_len, 2048);
  PrefillCall next_8k({8192});  // 32 heads: 4 segments per wave, too few to pay for three passes on short prompts
  EXPECT_EQ(chunked_prefill::choose_prefill(next_8k.p, kSms, {}).cp_segment_len, 0);
  PrefillCall next_16k({16384});  // ... from 16384 tokens they do: a local pass of 4 segments would take 160 CTAs, so
  const auto d = chunked_prefill::choose_prefill(next_16k.p, kSms, {});  // 5 segments, the first one's final early
  EXPECT_EQ(d.cp_segment_len, 3328);
  EXPECT_TRUE(d.cp_first_final);
  EXPECT_EQ(d.cp_scan_cols, 32);  // 32 heads x 4 CTAs of 32 columns
  Overrides narrow;
  narrow.prefill_cp_scan_cols = 8;
  EXPECT_EQ(chunked_prefill::choose_prefill(next_16k.p, kSms, narrow).cp_scan_cols, 8);
  narrow.prefill_cp_scan_cols = 16;
  EXPECT_THROW(chunked_prefill::choose_prefill(next_16k.p, kSms, narrow), Error);
  // a split's fold stores a V-last float8_e4m3 pool's 32-column blocks whole: 32 columns a CTA, 8 refused
  EXPECT_EQ(chunked_prefill::choose_split(tp8.p, kSms, {}).cp_scan_cols, 8);
  tp8.p.state.dtype = DType::kFloat8E4M3;
  EXPECT_EQ(chunked_prefill::choose_split(tp8.p, kSms, {}).cp_scan_cols, 8);  // K-last: a column's 32 rows
  tp8.p.state.layout = StateLayout::kVLast;
  EXPECT_EQ(chunked_prefill::choose_split(tp8.p, kSms, {}).cp_scan_cols, 32);
  EXPECT_EQ(chunked_prefill::choose_prefill(tp8.p, kSms, {}).cp_scan_cols, 8);  // the final pass stores them
  Overrides wide_scan;
  wide_scan.prefill_cp_scan_cols = 32;
  EXPECT_EQ(chunked_prefill::choose_split(tp8.p, kSms, wide_scan).cp_scan_cols, 32);
  narrow.prefill_cp_scan_cols = 8;
  EXPECT_THROW(chunked_prefill::choose_split(tp8.p, kSms, narrow), Error);
  // without a pool the fold stores no state: V-last float8_e4m3 checkpoints (the final pass's) leave the scan at 8
  tp8.p.checkpoints = {tp8.p.state.data, DType::kFloat8E4M3, StateLayout::kVLast, 8, 8, 8LL * 8 * 128 * 128};
  tp8.p.checkpoint_interval = 1024;
  tp8.p.state.data = nullptr;
  EXPECT_EQ(chunked_prefill::choose_split(tp8.p, kSms, {}).cp_scan_cols, 8);
  EXPECT_EQ(chunked_prefill::choose_split(tp8.p, kSms, narrow).cp_scan_cols, 8);
  Overrides after_scan;
  after_scan.prefill_cp_first_final = 0;  // the first segment's final pass after the scan: one wave of 4 segments
  const auto e = chunked_prefill::choose_prefill(next_16k.p, kSms, after_scan);
  EXPECT_EQ(e.cp_segment_len, 4096);
  EXPECT_FALSE(e.cp_first_final);
  PrefillCall next({32768});  // 5 segments of 6592
  EXPECT_EQ(chunked_prefill::choose_prefill(next.p, kSms, {}).cp_segment_len, 6592);
  PrefillCall next_131k({131072});  // 5 segments of 26240
  EXPECT_EQ(chunked_prefill::choose_prefill(next_131k.p, kSms, {}).cp_segment_len, 26240);
  PrefillCall next_two({32768, 32768});  // two such prompts: 2 segments each per wave, not cut
  EXPECT_EQ(chunked_prefill::choose_prefill(next_two.p, kSms, {}).cp_segment_len, 0);
  // Segments from the longest prompt's own length: any length (not only multiples of 256 tokens), and beside shorter
  // sequences that fit one segment each (they run whole in the final pass); not beside another that would be cut.
  PrefillCall next_20k({20000});  // 5 segments of 4032
  EXPECT_EQ(chunked_prefill::choose_prefill(next_20k.p, kSms, {}).cp_segment_len, 4032);
  PrefillCall next_40k({40000});
  EXPECT_EQ(chunked_prefill::choose_prefill(next_40k.p, kSms, {}).cp_segment_len, 8000);
  PrefillCall next_beside({512, 32768});
  EXPECT_EQ(chunked_prefill::choose_prefill(next_beside.p, kSms, {}).cp_segment_len, 6592);
  PrefillCall next_16k_beside({16384, 1024, 3000});
  EXPECT_EQ(chunked_prefill::choose_prefill(next_16k_beside.p, kSms, {}).cp_segment_len, 3328);
  PrefillCall next_second({32768, 16384});  // the second is longer than a segment of 6592 (or of 8192)
  EXPECT_EQ(chunked_prefill::choose_prefill(next_second.p, kSms, {}).cp_segment_len, 0);
  // Where another sequence would not fit one of the five segments, four (the first one's final pass still beside).
  PrefillCall next_16k_4k({16384, 4000});
  const auto f = chunked_prefill::choose_prefill(next_16k_4k.p, kSms, {});
  EXPECT_EQ(f.cp_segment_len, 4096);
  EXPECT_TRUE(f.cp_first_final);
  PrefillCall next_20k_5k({20000, 5000, 1000});
  EXPECT_EQ(chunked_prefill::choose_prefill(next_20k_5k.p, kSms, {}).cp_segment_len, 5056);
  PrefillCall next_32k_8k({32768, 8000});
  EXPECT_EQ(chunked_prefill::choose_prefill(next_32k_8k.p, kSms, {}).cp_segment_len, 8192);
  // The workspace's bound counts the other sequences' tokens: 4 of 3000 beside 16384 fit it, 8 do not (21 states).
  PrefillCall next_four({16384, 3000, 3000, 3000, 3000});
  EXPECT_EQ(chunked_prefill::choose_prefill(next_four.p, kSms, {}).cp_segment_len, 3328);
  PrefillCall next_eight({16384, 3000, 3000, 3000, 3000, 3000, 3000, 3000, 3000});
  EXPECT_EQ(chunked_prefill::choose_prefill(next_eight.p, kSms, {}).cp_segment_len, 0);
  next_beside.p.cu_seqlens_host = nullptr;  // two sequences of the mean length
  EXPECT_EQ(chunked_prefill::choose_prefill(next_beside.p, kSms, {}).cp_segment_len, 0);
  PrefillCall next_256k({262144});
  EXPECT_EQ(chunked_prefill::choose_prefill(next_256k.p, kSms, {}).cp_segment_len, 52480);
  PrefillCall next_1m({1048576});
  EXPECT_EQ(chunked_prefill::choose_prefill(next_1m.p, kSms, {}).cp_segment_len, 209728);
  PrefillCall wide_1m({1048576}, 16, 64);  // 64 heads: 2 segments per wave, not even then
  EXPECT_EQ(chunked_prefill::choose_prefill(wide_1m.p, kSms, {}).cp_segment_len, 0);
  PrefillCall batch(std::vector<int64_t>(8, 8192), 2, 8);  // 8 sequences of 2 segments each
  EXPECT_EQ(chunked_prefill::choose_prefill(batch.p, kSms, {}).cp_segment_len, 0);
  PrefillCall wide({32768}, 16, 64);  // 64 heads: 2 segments per wave
  EXPECT_EQ(chunked_prefill::choose_prefill(wide.p, kSms, {}).cp_segment_len, 0);
  PrefillCall shorter({3840}, 2, 8);  // 5 segments of kCpShortSegment, 4 of kCpMinSegment: whole
  EXPECT_EQ(chunked_prefill::choose_prefill(shorter.p, kSms, {}).cp_segment_len, 0);
  // A prompt of 6 to 9 segments of 768 tokens, alone or beside sequences of one such segment, both passes in one wave.
  for (const std::vector<int64_t>& lens : std::vector<std::vector<int64_t>>{
           {4096}, {4608}, {5120}, {5632}, {6144}, {6656}, {6912}, {512, 4608}, {768, 100, 6144}}) {
    PrefillCall call(lens, 2, 8);
    EXPECT_EQ(chunked_prefill::choose_prefill(call.p, kSms, {}).cp_segment_len, 768) << lens.back() << " tokens";
  }
  // Six or seven segments of 1024 tokens where both passes fit one wave: a prompt alone, or beside sequences of a
  // segment each; not two such prompts (a local pass of 144 CTAs), nor a prompt of five segments.
  for (const std::vector<int64_t>& lens : std::vector<std::vector<int64_t>>{
           {6913}, {7168}, {1024, 7168}, {512, 7680}, {2048, 6144}, {1024, 1024, 6144}}) {
    PrefillCall call(lens, 2, 8);
    EXPECT_EQ(chunked_prefill::choose_prefill(call.p, kSms, {}).cp_segment_len, 1024) << lens.size() << " sequences";
  }
  for (const std::vector<int64_t>& lens :
       std::vector<std::vector<int64_t>>{{6144, 6144}, {3072, 5120}, {4096, 4096}, {2048, 4608}, {1024, 5120}}) {
    PrefillCall call(lens, 2, 8);
    EXPECT_EQ(chunked_prefill::choose_prefill(call.p, kSms, {}).cp_segment_len, 0) << lens.size() << " sequences";
  }
  PrefillCall next_mixed({1024, 7168});  // 32 heads: the few-segment rule alone
  EXPECT_EQ(chunked_prefill::choose_prefill(next_mixed.p, kSms, {}).cp_segment_len, 0);
  // A long sequence beside a short one; without the host copy of cu_seqlens the mean length stands for the longest.
  PrefillCall two({60000, 100}, 2, 8);
  EXPECT_EQ(chunked_prefill::choose_prefill(two.p, kSms, {}).cp_segment_len, 3776);
  two.p.cu_seqlens_host = nullptr;
  EXPECT_EQ(chunked_prefill::choose_prefill(two.p, kSms, {}).cp_segment_len, 0);
  // One long prompt beside many short ones: the states cover the cut segments only, so the short sequences do not
  // count against the workspace's bound (8 heads x 216 entries would pass it).
  std::vector<int64_t> mixed(201, 100);
  mixed[0] = 60000;
  PrefillCall many(mixed, 2, 8);
  EXPECT_EQ(chunked_prefill::choose_prefill(many.p, kSms, {}).cp_segment_len, 5056);
  EXPECT_EQ(chunked_prefill::cp_max_states(many.p, 5056), 30);
  EXPECT_EQ(chunked_prefill::cp_max_segments(many.p, 5056), 216);
  // The workspace's parts: the table, the state and cut-sequence indices, three fp32 states per state and head.
  const chunked_prefill::CpLayout l = chunked_prefill::cp_layout(many.p, 216, 30);
  EXPECT_EQ(l.state_entry, (216 * sizeof(chunked_prefill::CpSegment) + 255) / 256 * 256);  // 216 x 40, 256-aligned
  EXPECT_EQ(l.cut_first, l.state_entry + 256);                          // 30 int32
  EXPECT_EQ(chunked_prefill::cp_max_cuts(30), 15);
  EXPECT_EQ(chunked_prefill::cp_max_cuts(1), 1);
  EXPECT_EQ(l.states, l.cut_first + 256);
  EXPECT_EQ(l.state_bytes, size_t(30) * 8 * 128 * 128 * 4);
  EXPECT_EQ(l.total, l.states + 3 * l.state_bytes);
  EXPECT_GE(chunked_prefill::cp_workspace_bytes(many.p, {}), l.total);
  PrefillCall one({65536}, 2, 8);
  one.p.cu_seqlens_host = nullptr;
  EXPECT_EQ(chunked_prefill::choose_prefill(one.p, kSms, {}).cp_segment_len, 4096);
  // Off where the path is not built: fp32 inputs, K != V.
  PrefillCall fp32({65536}, 2, 8, DType::kFloat32);
  EXPECT_EQ(chunked_prefill::choose_prefill(fp32.p, kSms, {}).cp_segment_len, 0);
  PrefillCall kv = tp8;
  kv.p.heads.head_dim_v = 64;
  EXPECT_EQ(chunked_prefill::choose_prefill(kv.p, kSms, {}).cp_segment_len, 0);
}

TEST(PrefillHeuristics, ContextParallelOverridesAndWorkspace) {
  PrefillCall call({1000, 64}, 1, 2);
  Overrides forced;
  forced.prefill_cp_segment_len = 128;
  EXPECT_EQ(chunked_prefill::choose_prefill(call.p, kSms, forced).cp_segment_len, 128);
  Overrides odd;
  odd.prefill_cp_segment_len = 100;  // not a multiple of the chunk
  EXPECT_THROW(chunked_prefill::choose_prefill(call.p, kSms, odd), Error);
  PrefillCall fp32({1000}, 1, 2, DType::kFloat32);
  EXPECT_THROW(chunked_prefill::choose_prefill(fp32.p, kSms, forced), Error);
  Overrides off;
  off.prefill_cp_segment_len = 0;
  PrefillCall tp8({65536}, 2, 8);
  EXPECT_EQ(chunked_prefill::choose_prefill(tp8.p, kSms, off).cp_segment_len, 0);
  EXPECT_EQ(chunked_prefill::cp_workspace_bytes(tp8.p, off), 0u);
  // The workspace holds the chosen segments' table and states, and grows with the tokens.
  const int64_t len = chunked_prefill::choose_prefill(tp8.p, kSms, {}).cp_segment_len;
  EXPECT_EQ(chunked_prefill::cp_max_states(tp8.p, len), 17);  // min(N + T / L, 2 T / L)
  const size_t states = size_t(chunked_prefill::cp_max_states(tp8.p, len)) * 8 * 128 * 128 * 4;
  EXPECT_GE(chunked_prefill::cp_workspace_bytes(tp8.p, {}), 3 * states + 17 * sizeof(chunked_prefill::CpSegment));
  PrefillCall longer({131072}, 2, 8);
  EXPECT_GE(chunked_prefill::cp_workspace_bytes(longer.p, {}), chunked_prefill::cp_workspace_bytes(tp8.p, {}));
  EXPECT_EQ(chunked_prefill::cp_max_states(call.p, 128), 10);  // min(2 + 1064 / 128, 2 x 8)
  EXPECT_GE(chunked_prefill::cp_workspace_bytes(call.p, forced),
            3 * size_t(chunked_prefill::cp_max_states(call.p, 128)) * 2 * 128 * 128 * 4);
  // Forced segments whose states would pass the bound are refused.
  PrefillCall big({65536}, 2, 8);
  Overrides tiny;
  tiny.prefill_cp_segment_len = 1024;  // 8 heads x 65 states
  EXPECT_THROW(chunked_prefill::choose_prefill(big.p, kSms, tiny), Error);
}

TEST(PrefillHeuristics, PrepWarpgroupWhereverItCanRun) {
  PrefillCall short_chunks(std::vector<int64_t>(64, 192));  // 3 chunks per sequence
  const auto a = chunked_prefill::choose_prefill(short_chunks.p, kSms, {});
  EXPECT_TRUE(a.m_warpgroup);
  EXPECT_TRUE(a.m_in_pass);
  PrefillCall one_chunk(std::vector<int64_t>(1024, 64));  // one chunk per sequence: its state by bulk copies
  EXPECT_TRUE(chunked_prefill::choose_prefill(one_chunk.p, kSms, {}).m_warpgroup);
  PrefillCall four(std::vector<int64_t>(64, 256));
  EXPECT_TRUE(chunked_prefill::choose_prefill(four.p, kSms, {}).m_warpgroup);
  Overrides off;
  off.prefill_m_warpgroup = 0;
  const auto b = chunked_prefill::choose_prefill(four.p, kSms, off);
  EXPECT_FALSE(b.m_warpgroup);
  EXPECT_TRUE(b.m_in_pass);  // two state warpgroups form M themselves
  Overrides on;
  on.prefill_m_warpgroup = 1;
  EXPECT_TRUE(chunked_prefill::choose_prefill(short_chunks.p, kSms, on).m_warpgroup);
  EXPECT_FALSE(chunked_prefill::choose_prefill(four.p, kSms, {}).fused_prep);
  EXPECT_FALSE(chunked_prefill::choose_prefill(four.p, kSms, on).fused_prep);
}

// The fused prep (the prep warpgroup forms the whole chunk prep): only where asked for, beside two state warpgroups,
// and on whole sequences (the context-parallel passes read the chunk prep's T').
TEST(PrefillHeuristics, FusedPrepWhereAskedOnWholeSequences) {
  Overrides fused;
  fused.prefill_m_warpgroup = 2;
  PrefillCall batch(std::vector<int64_t>(8, 8192));
  const auto a = chunked_prefill::choose_prefill(batch.p, kSms, fused);
  EXPECT_TRUE(a.m_warpgroup);
  EXPECT_TRUE(a.fused_prep);
  EXPECT_TRUE(a.m_in_pass);
  PrefillCall split({8192}, 2, 8);  // few heads: the head split, one state warpgroup a CTA
  Overrides unsplit = fused;
  unsplit.prefill_cp_segment_len = 0;
  EXPECT_EQ(chunked_prefill::choose_prefill(split.p, kSms, unsplit).head_split, 2);
  EXPECT_FALSE(chunked_prefill::choose_prefill(split.p, kSms, unsplit).fused_prep);
  Overrides cp = fused;
  cp.prefill_cp_segment_len = 1024;
  const auto b = chunked_prefill::choose_prefill(split.p, kSms, cp);
  EXPECT_EQ(b.cp_segment_len, 1024);
  EXPECT_FALSE(b.fused_prep);
}

// float8_e4m3 pools and checkpoints run on the head pass, or on the tiled pass at K >= 128 (whole scale blocks a
// warp): the choice takes both and refuses a tiled pass at K = 64, naming the pass.
TEST(PrefillHeuristics, Fp8PoolsOnTheHeadOrTiledPass) {
  const auto refusal = [](const PrefillParams& p) -> std::string {
    try {
      (void)chunked_prefill::choose_prefill(p, kSms, {});
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kNotImplemented) << e.what();
      return e.what();
    }
    ADD_FAILURE() << "no error";
    return "";
  };
  int32_t dummy = 0;
  StateCache ckpt;
  ckpt.data = &dummy, ckpt.dtype = DType::kFloat8E4M3, ckpt.num_slots = 8, ckpt.num_steps = 128;
  ckpt.slot_stride = int64_t(128) * 32 * 128 * 128;
  PrefillCall head({8192, 8192});
  head.p.state.dtype = DType::kFloat8E4M3;
  head.p.checkpoints = ckpt, head.p.checkpoint_interval = 64, head.p.checkpoint_indices = &dummy;
  EXPECT_TRUE(chunked_prefill::is_head_tile(chunked_prefill::choose_prefill(head.p, kSms, {}).vtile));
  PrefillCall tiled({8192, 8192}, 16, 32, DType::kFloat32);  // fp32 inputs: the tiled pass
  tiled.p.state.dtype = DType::kFloat8E4M3;
  tiled.p.checkpoints = ckpt, tiled.p.checkpoint_interval = 64, tiled.p.checkpoint_indices = &dummy;
  const int vtile = chunked_prefill::choose_prefill(tiled.p, kSms, {}).vtile;
  EXPECT_FALSE(chunked_prefill::is_head_tile(vtile));
  tiled.p.heads.head_dim_k = tiled.p.heads.head_dim_v = 64;  // a warp's 16 rows: half a block
  const int vtile64 = chunked_prefill::choose_vtile(tiled.p, kSms);
  EXPECT_EQ(refusal(tiled.p), "checkpoints: float8_e4m3 checkpoints are stored by the head state pass or, K-last, at "
                              "K >= 128 only, not by value tile " + std::to_string(vtile64));
  tiled.p.checkpoint_interval = 0;
  EXPECT_EQ(refusal(tiled.p), "state: float8_e4m3 pools are read and written by the head state pass or, K-last, at "
                              "K >= 128 only, not by value tile " + std::to_string(vtile64));
  // V-last: the head pass only (its warp pairs hold whole 32-column blocks), at K = 128 too
  tiled.p.heads.head_dim_k = tiled.p.heads.head_dim_v = 128;
  tiled.p.state.layout = StateLayout::kVLast;
  EXPECT_EQ(refusal(tiled.p), "state: float8_e4m3 pools are read and written by the head state pass or, K-last, at "
                              "K >= 128 only, not by value tile " + std::to_string(vtile));
  head.p.state.layout = StateLayout::kVLast;
  EXPECT_TRUE(chunked_prefill::is_head_tile(chunked_prefill::choose_prefill(head.p, kSms, {}).vtile));
  // without a pool the checkpoints' layout rules: V-last ones on a forced tiled pass are refused, K-last ones taken
  head.p.state.data = nullptr, head.p.state.layout = StateLayout::kKLast;
  head.p.checkpoints.layout = StateLayout::kVLast;
  Overrides tile64;
  tile64.prefill_vtile = 64;
  try {
    (void)chunked_prefill::choose_prefill(head.p, kSms, tile64);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "checkpoints: float8_e4m3 checkpoints are stored by the head state pass or, K-last, at K >= 128 only, "
              "not by value tile 64");
  }
  head.p.checkpoints.layout = StateLayout::kKLast;
  EXPECT_EQ(chunked_prefill::choose_prefill(head.p, kSms, tile64).vtile, 64);
}

// Where no pass takes a float8_e4m3 pool or checkpoint buffer in place (off the head pass: V-last, or K-last at K = 64)
// the call runs on staged K-last fp32 copies: a slot per sequence, a checkpoint entry every C tokens of the batch.
TEST(PrefillHeuristics, Fp8StatesStagedWhereNoPassTakesThemInPlace) {
  using chunked_prefill::staged_shape;
  using chunked_prefill::states_staged;
  int32_t dummy = 0;
  PrefillCall head({8192, 100, 0});
  head.p.state.dtype = DType::kFloat8E4M3;
  EXPECT_FALSE(states_staged(head.p));  // K-last on the head pass
  head.p.state.layout = StateLayout::kVLast;
  EXPECT_FALSE(states_staged(head.p));  // V-last on the head pass
  head.p.v.token_stride += 4;  // 8-byte rows: off the head pass
  EXPECT_TRUE(states_staged(head.p));
  PrefillCall call({8192, 100, 0}, 16, 32, DType::kFloat32);  // fp32 inputs: the tiled pass
  call.p.state.dtype = DType::kFloat8E4M3;
  EXPECT_FALSE(states_staged(call.p));  // K-last at K = 128: the tiled pass's
  call.p.state.layout = StateLayout::kVLast;
  EXPECT_TRUE(states_staged(call.p));
  const PrefillParams s = staged_shape(call.p);
  EXPECT_EQ(s.state.dtype, DType::kFloat32);
  EXPECT_EQ(s.state.layout, StateLayout::kKLast);
  EXPECT_EQ(s.state.num_slots, 3);
  EXPECT_EQ(s.state.slot_stride, int64_t(32) * 128 * 128);
  EXPECT_EQ(s.state.scales, nullptr);
  EXPECT_FALSE(states_staged(s));
  EXPECT_FALSE(chunked_prefill::is_head_tile(chunked_prefill::choose_prefill(s, kSms, {}).vtile));
  // float8_e4m3 V-last checkpoints beside a bf16 V-last pool: both staged off the head pass, in place on it
  call.p.state.dtype = DType::kBFloat16;
  EXPECT_FALSE(states_staged(call.p));
  StateCache ckpt;
  ckpt.data = &dummy, ckpt.dtype = DType::kFloat8E4M3, ckpt.layout = StateLayout::kVLast;
  ckpt.num_slots = 4, ckpt.num_steps = 8, ckpt.slot_stride = int64_t(8) * 32 * 128 * 128;
  call.p.checkpoints = ckpt, call.p.checkpoint_interval = 1024, call.p.checkpoint_indices = &dummy;
  EXPECT_TRUE(states_staged(call.p));
  head.p.v.token_stride -= 4;
  head.p.state.dtype = DType::kBFloat16;
  head.p.checkpoints = ckpt, head.p.checkpoint_interval = 1024, head.p.checkpoint_indices = &dummy;
  EXPECT_FALSE(states_staged(head.p));
  const PrefillParams c = staged_shape(call.p);
  EXPECT_EQ(c.checkpoints.dtype, DType::kFloat32);
  EXPECT_EQ(c.checkpoints.layout, StateLayout::kKLast);
  EXPECT_EQ(c.checkpoints.num_slots, 8292 / 1024 + 1);  // sequence n's entry j at floor(cu[n] / C) + j
  EXPECT_EQ(c.checkpoints.num_steps, 8);
  EXPECT_EQ(c.checkpoints.slot_stride, int64_t(32) * 128 * 128);
  // K-last float8_e4m3 at K = 64: in place on the head pass with bf16 inputs, staged with fp32 inputs or V = 256
  for (DType input : {DType::kBFloat16, DType::kFloat32})
    for (int V : {64, 256}) {
      PrefillCall k64({8192}, 16, 32, input);
      k64.p.heads.head_dim_k = 64, k64.p.heads.head_dim_v = V;
      k64.p.state.dtype = DType::kFloat8E4M3;
      EXPECT_EQ(states_staged(k64.p), input == DType::kFloat32 || V == 256) << dtype_name(input) << " V " << V;
    }
  // K-last rows off the head pass's 16-byte loads (validation refuses them on CUDA; the rule agrees with the choice
  // anyway): staged at K = 64, the tiled pass's at K = 128
  PrefillCall rows({8192});
  rows.p.state.dtype = DType::kFloat8E4M3;
  rows.p.v.token_stride += 4;
  EXPECT_FALSE(states_staged(rows.p));
  rows.p.heads.head_dim_k = 64;
  EXPECT_TRUE(states_staged(rows.p));
  // without a pool, the checkpoints' layout: V-last float8_e4m3 checkpoints on the tiled pass are staged
  call.p.state.data = nullptr, call.p.state.layout = StateLayout::kKLast;
  EXPECT_EQ(chunked_prefill::states_layout(call.p), StateLayout::kVLast);
  EXPECT_TRUE(states_staged(call.p));
  call.p.checkpoints.layout = StateLayout::kKLast;
  EXPECT_FALSE(states_staged(call.p));
}

// The head pass copies a pool's head slices in bulk where they are 16-byte aligned (base, slot stride and, for
// float8_e4m3, the block scales) and a CTA's share is contiguous (K-last, or V-last with the head on one CTA); anything
// else keeps the per-thread loads and stores.
TEST(PrefillHeuristics, StateBulkCopiesOnAlignedPools) {
  PrefillCall call({8192});
  StatePool& s = call.p.state;
  EXPECT_TRUE(chunked_prefill::state_bulk_copies(call.p, 1));  // fp32, 16-byte aligned
  EXPECT_TRUE(chunked_prefill::state_bulk_copies(call.p, 2));  // a CTA's value rows
  s.layout = StateLayout::kVLast;
  EXPECT_TRUE(chunked_prefill::state_bulk_copies(call.p, 1));  // the head's rows
  EXPECT_FALSE(chunked_prefill::state_bulk_copies(call.p, 2));  // half of each row
  s.layout = StateLayout::kKLast;
  s.data = static_cast<char*>(s.data) + 8;
  EXPECT_FALSE(chunked_prefill::state_bulk_copies(call.p, 1));
  s.data = static_cast<char*>(s.data) - 8;
  s.slot_stride += 2;  // 8 bytes: fp32 slots 8-byte aligned
  EXPECT_FALSE(chunked_prefill::state_bulk_copies(call.p, 1));
  s.dtype = DType::kBFloat16;
  EXPECT_FALSE(chunked_prefill::state_bulk_copies(call.p, 1));  // 4 bytes
  s.slot_stride += 6;  // 16 bytes more than a whole slot of bf16
  EXPECT_TRUE(chunked_prefill::state_bulk_copies(call.p, 1));
  s.dtype = DType::kFloat8E4M3;
  s.slot_stride -= 8;
  s.scales = reinterpret_cast<uint8_t*>(uintptr_t(1) << 21);
  EXPECT_TRUE(chunked_prefill::state_bulk_copies(call.p, 1));
  s.scales += 4;
  EXPECT_FALSE(chunked_prefill::state_bulk_copies(call.p, 1));
}

// The same rule for the checkpoint buffer, whose entries the kernels lay out as the pool: the pool's layout too.
TEST(PrefillHeuristics, CheckpointBulkCopiesOnAlignedBuffers) {
  PrefillCall call({8192});
  alignas(16) static float buffer[4];
  StateCache& c = call.p.checkpoints;
  EXPECT_FALSE(chunked_prefill::checkpoint_bulk_copies(call.p, 1));  // no buffer
  c.data = buffer, c.dtype = DType::kFloat32, c.num_slots = 1, c.num_steps = 8;
  c.slot_stride = int64_t(8) * 32 * 128 * 128;
  EXPECT_TRUE(chunked_prefill::checkpoint_bulk_copies(call.p, 1));
  call.p.state.layout = StateLayout::kVLast;
  c.layout = StateLayout::kVLast;
  EXPECT_TRUE(chunked_prefill::checkpoint_bulk_copies(call.p, 1));
  EXPECT_FALSE(chunked_prefill::checkpoint_bulk_copies(call.p, 2));
  call.p.state.layout = StateLayout::kKLast;
  EXPECT_FALSE(chunked_prefill::checkpoint_bulk_copies(call.p, 1));  // not the pool's layout
  call.p.state.layout = c.layout = StateLayout::kKLast;
  c.data = reinterpret_cast<char*>(buffer) + 8;
  EXPECT_FALSE(chunked_prefill::checkpoint_bulk_copies(call.p, 1));
  c.data = buffer;
  c.slot_stride += 2;  // 8 bytes
  EXPECT_FALSE(chunked_prefill::checkpoint_bulk_copies(call.p, 1));
  c.dtype = DType::kFloat8E4M3;  // 2 bytes
  EXPECT_FALSE(chunked_prefill::checkpoint_bulk_copies(call.p, 1));
  c.slot_stride += 14;
  c.scales = reinterpret_cast<uint8_t*>(buffer);
  EXPECT_TRUE(chunked_prefill::checkpoint_bulk_copies(call.p, 1));
  c.scales += 8;
  EXPECT_FALSE(chunked_prefill::checkpoint_bulk_copies(call.p, 1));
}

// The head pass's checkpoint clock against the rule it replaces in the chunk loop: after chunk c of a run from chunk
// `first`, entry j = done / C - 1 where done = offset + 64 (first + c + 1) tokens of the sequence is a multiple of C
// within its full chunks and j < steps; none where the piece's offset is negative or not a multiple of 64.
TEST(PrefillHeuristics, CheckpointClockMatchesTheRule) {
  std::mt19937 gen(11);
  for (int it = 0; it < 20000; ++it) {
    const int64_t C = 64 * int64_t(gen() % 6), len = int64_t(gen() % 1200), steps = int64_t(gen() % 8);
    const int64_t first = int64_t(gen() % 12), kinds = gen() % 4;
    const int64_t offset = kinds == 0 ? 0 : kinds == 1 ? 64 * int64_t(gen() % 10) : kinds == 2 ? -64 : 32;
    auto clock = chunked_prefill::checkpoint_clock(first, offset, len, steps, C);
    for (int64_t c = 0; c < 24; ++c) {
      const int64_t done = offset + 64 * (first + c + 1);
      const bool due = C > 0 && offset >= 0 && offset % 64 == 0 && done % C == 0 && done <= offset + len &&
                       done / C - 1 < steps;
      ASSERT_EQ(clock.tick(c), due ? done / C - 1 : -1)
          << "C " << C << " len " << len << " steps " << steps << " first " << first << " offset " << offset
          << " chunk " << c;
    }
  }
}

// The head pass's producer waits for each chunk's flag instead of the chunk prep's grid beside the prep warpgroup for
// sequences of a mean of at most 2048 tokens on one CTA per item (4x2048; not 4x8192, nor the head split's 1x8192,
// nor the persistent pass), wherever a producer can with the override (the head split too), never under context
// parallelism or without PDL; off by the override.
TEST(PrefillHeuristics, ChunkFlagsBesideAProducer) {
  PrefillCall four({2048, 2048, 2048, 2048});  // 128 items: one wave, one CTA per item
  Overrides per_item;  // one CTA per (sequence, value head)
  per_item.prefill_persistent = 0;
  auto c = chunked_prefill::choose_prefill(four.p, kSms, {});
  EXPECT_TRUE(c.m_warpgroup);
  EXPECT_FALSE(c.persistent_pass);
  EXPECT_TRUE(c.chunk_flags);
  PrefillCall short_ones(std::vector<int64_t>(1024, 128));  // the persistent pass waits for the prep's grid
  c = chunked_prefill::choose_prefill(short_ones.p, kSms, {});
  EXPECT_TRUE(c.persistent_pass);
  EXPECT_FALSE(c.chunk_flags);
  EXPECT_TRUE(c.early_state_pass);
  EXPECT_FALSE(chunked_prefill::choose_prefill(short_ones.p, kSms, per_item).early_state_pass);  // 32768 CTAs
  Overrides off = per_item;
  off.prefill_chunk_flags = 0;
  EXPECT_FALSE(chunked_prefill::choose_prefill(four.p, kSms, off).chunk_flags);
  PrefillCall longer({8192, 8192, 8192, 8192});
  c = chunked_prefill::choose_prefill(longer.p, kSms, {});
  EXPECT_TRUE(c.m_warpgroup);
  EXPECT_FALSE(c.persistent_pass);
  EXPECT_FALSE(c.chunk_flags);
  PrefillCall one({8192});
  c = chunked_prefill::choose_prefill(one.p, kSms, {});
  EXPECT_EQ(c.head_split, 2);
  EXPECT_FALSE(c.chunk_flags);
  Overrides on;
  on.prefill_chunk_flags = 1;
  EXPECT_TRUE(chunked_prefill::choose_prefill(one.p, kSms, on).chunk_flags);
  PrefillCall short_seqs(std::vector<int64_t>(64, 128));  // 2048 CTAs: the pass launches after the prep
  c = chunked_prefill::choose_prefill(short_seqs.p, kSms, per_item);
  EXPECT_TRUE(c.m_warpgroup);
  EXPECT_FALSE(c.early_state_pass);
  EXPECT_FALSE(c.chunk_flags);
  PrefillCall cp({65536}, 2, 8);
  c = chunked_prefill::choose_prefill(cp.p, kSms, {});
  EXPECT_GT(c.cp_segment_len, 0);
  EXPECT_FALSE(c.chunk_flags);
  PrefillCall many(std::vector<int64_t>(8192, 32));  // no PDL; persistent: PDL, the prep's grid
  EXPECT_FALSE(chunked_prefill::choose_prefill(many.p, kSms, per_item).chunk_flags);
  EXPECT_FALSE(chunked_prefill::choose_prefill(many.p, kSms, {}).chunk_flags);
}

// The prep warpgroup's pass runs persistent (one CTA per SM taking the items in turn) where its (sequence, value head)
// items outnumber the SMs (8192x32, 1024x64, 8x1024, 8x8192; not 4x2048's one wave), launched early behind the prep
// (its grid is one CTA per SM); by the override wherever that build runs on whole sequences: not beside the fused
// prep, under context parallelism, without the prep warpgroup, or where only the chunk prep runs.
TEST(PrefillHeuristics, PersistentPassBesideThePrepWarpgroup) {
  PrefillCall many(std::vector<int64_t>(8192, 32));
  auto c = chunked_prefill::choose_prefill(many.p, kSms, {});
  EXPECT_TRUE(c.m_warpgroup);
  EXPECT_TRUE(c.persistent_pass);
  EXPECT_EQ(c.pass_ctas, kSms);  // one CTA per SM
  EXPECT_TRUE(c.early_state_pass);
  EXPECT_TRUE(chunked_prefill::choose_prefill(PrefillCall(std::vector<int64_t>(1024, 64)).p, kSms, {}).persistent_pass);
  EXPECT_TRUE(chunked_prefill::choose_prefill(PrefillCall(std::vector<int64_t>(8, 1024)).p, kSms, {}).persistent_pass);
  EXPECT_TRUE(chunked_prefill::choose_prefill(PrefillCall(std::vector<int64_t>(8, 8192)).p, kSms, {}).persistent_pass);
  PrefillCall batch(std::vector<int64_t>(4, 2048));  // 128 items
  EXPECT_FALSE(chunked_prefill::choose_prefill(batch.p, kSms, {}).persistent_pass);
  // the choice for `call` under one override
  const auto persistent_with = [](const PrefillCall& call, int Overrides::*field, int value) {
    Overrides o;
    o.*field = value;
    return chunked_prefill::choose_prefill(call.p, kSms, o).persistent_pass;
  };
  EXPECT_TRUE(persistent_with(batch, &Overrides::prefill_persistent, 1));
  Overrides few;  // the override's grid, never more CTAs than items
  few.prefill_persistent_ctas = 3;
  EXPECT_EQ(chunked_prefill::choose_prefill(many.p, kSms, few).pass_ctas, 3);
  few.prefill_persistent = 1, few.prefill_persistent_ctas = 1000;
  EXPECT_EQ(chunked_prefill::choose_prefill(PrefillCall(std::vector<int64_t>(8, 64)).p, kSms, few).pass_ctas, 256);
  EXPECT_FALSE(persistent_with(many, &Overrides::prefill_persistent, 0));
  EXPECT_FALSE(persistent_with(many, &Overrides::prefill_m_warpgroup, 2));  // the fused prep
  EXPECT_FALSE(persistent_with(many, &Overrides::prefill_m_warpgroup, 0));  // no prep warpgroup
  EXPECT_FALSE(persistent_with(many, &Overrides::prefill_stages, chunked_prefill::kStagePrep));
  PrefillCall cp({65536}, 2, 8);
  c = chunked_prefill::choose_prefill(cp.p, kSms, {});
  EXPECT_GT(c.cp_segment_len, 0);
  EXPECT_FALSE(c.persistent_pass);
}

// The length classes (0 for no chunk, then one per power of two of 64-token chunks), and the head pass taking the
// sequences longest first (persistent, or one CTA per item in more than a wave) unless the host's cu_seqlens has them
// in that order already (all in one class included); without that copy it orders them; the override either way; not
// in one wave nor under context parallelism.
TEST(PrefillHeuristics, PersistentPassLongestFirstWhereLengthsDiffer) {
  using chunked_prefill::length_class;
  EXPECT_EQ(length_class(0, 0), 0);
  EXPECT_EQ(length_class(5, 3), 0);  // a bad span
  EXPECT_EQ(length_class(-1, 3), 0);
  EXPECT_EQ(length_class(0, 1), 1);
  EXPECT_EQ(length_class(0, 64), 1);
  EXPECT_EQ(length_class(0, 65), 2);
  EXPECT_EQ(length_class(0, 129), 2);  // 3 chunks
  EXPECT_EQ(length_class(0, 257), 3);  // 5 chunks
  EXPECT_EQ(length_class(100, 100 + 6144), 7);  // 96 chunks
  EXPECT_EQ(length_class(0, int64_t(1) << 40), chunked_prefill::kLengthClasses - 1);
  std::vector<int64_t> lens(64, 100);
  lens.push_back(6144);  // a long prompt after many short ones
  PrefillCall mixed(lens);
  auto c = chunked_prefill::choose_prefill(mixed.p, kSms, {});
  EXPECT_TRUE(c.persistent_pass);
  EXPECT_TRUE(c.longest_first);
  PrefillCall same(std::vector<int64_t>(8192, 32));
  c = chunked_prefill::choose_prefill(same.p, kSms, {});
  EXPECT_TRUE(c.persistent_pass);
  EXPECT_FALSE(c.longest_first);
  std::vector<int64_t> close;  // 100 and 120 tokens: two chunks each
  for (int i = 0; i < 1000; ++i) close.push_back(i % 2 ? 100 : 120);
  EXPECT_FALSE(chunked_prefill::choose_prefill(PrefillCall(close).p, kSms, {}).longest_first);
  std::vector<int64_t> sorted = {6144, 3000, 4000};  // classes 7, 6, 6 (96, 47 and 63 chunks)
  sorted.insert(sorted.end(), 64, 100);
  sorted.push_back(0);
  EXPECT_FALSE(chunked_prefill::choose_prefill(PrefillCall(sorted).p, kSms, {}).longest_first);
  sorted.push_back(300);  // a class-3 sequence after those of class 2
  EXPECT_TRUE(chunked_prefill::choose_prefill(PrefillCall(sorted).p, kSms, {}).longest_first);
  std::vector<int64_t> beside_short;  // sequences of 8 tokens, the short path's, between sorted ones: not the pass's
  for (int i = 0; i < 200; ++i) beside_short.insert(beside_short.end(), {i < 100 ? 300 : 100, 8});
  c = chunked_prefill::choose_prefill(PrefillCall(beside_short).p, kSms, {});
  EXPECT_EQ(c.short_len, 16);
  EXPECT_TRUE(c.persistent_pass);
  EXPECT_FALSE(c.longest_first);
  same.p.cu_seqlens_host = nullptr;
  EXPECT_TRUE(chunked_prefill::choose_prefill(same.p, kSms, {}).longest_first);
  Overrides o;
  o.prefill_longest_first = 0;
  EXPECT_FALSE(chunked_prefill::choose_prefill(mixed.p, kSms, o).longest_first);
  o.prefill_longest_first = 1;
  EXPECT_TRUE(chunked_prefill::choose_prefill(PrefillCall(close).p, kSms, o).longest_first);
  o.prefill_persistent = 0;  // one CTA per item, 2080 of them: more than a wave
  EXPECT_TRUE(chunked_prefill::choose_prefill(mixed.p, kSms, o).longest_first);
  EXPECT_FALSE(chunked_prefill::choose_prefill(PrefillCall({4096, 100, 2048, 300}).p, kSms, {}).longest_first);  // 128
  PrefillCall batch({100, 8192, 300, 8192, 200, 8192, 100, 8192});  // 256 items
  c = chunked_prefill::choose_prefill(batch.p, kSms, {});
  EXPECT_TRUE(c.persistent_pass);
  EXPECT_TRUE(c.longest_first);
  Overrides per_item;  // one CTA per item, 256 of them
  per_item.prefill_persistent = 0;
  c = chunked_prefill::choose_prefill(batch.p, kSms, per_item);
  EXPECT_FALSE(c.persistent_pass);
  EXPECT_TRUE(c.longest_first);
  PrefillCall cp({100, 65536}, 2, 8);  // context parallelism: no order
  c = chunked_prefill::choose_prefill(cp.p, kSms, {});
  EXPECT_GT(c.cp_segment_len, 0);
  EXPECT_FALSE(c.longest_first);
  Overrides prep_only = per_item;  // the chunk prep alone: no pass to order
  prep_only.prefill_stages = chunked_prefill::kStagePrep;
  EXPECT_FALSE(chunked_prefill::choose_prefill(batch.p, kSms, prep_only).longest_first);
  prep_only.prefill_persistent = -1;
  EXPECT_FALSE(chunked_prefill::choose_prefill(batch.p, kSms, prep_only).longest_first);
}

// The chunk prep takes several CTAs per (chunk, q/k head), each a share of the GVA group, where the grid then still
// fits in one wave (with M up to an eighth more): tp8's four value heads per q/k head in two parts up to about 8192
// tokens, four parts for short calls; qwen3-next's groups of two from 16 q/k heads only for calls of about 1024
// tokens; never past that.
TEST(PrefillHeuristics, ChunkPrepInPartsWhereTheGridIsShort) {
  // 37 KB of shared memory with M, 27 KB without; with M at K = 128 the register budget of four CTAs
  EXPECT_EQ(chunked_prefill::prep_ctas_per_sm(128, true), 4);
  EXPECT_EQ(chunked_prefill::prep_ctas_per_sm(128, false), 7);
  EXPECT_EQ(chunked_prefill::prep_ctas_per_sm(64, true), 5);
  PrefillCall tp8({8192}, 2, 8);  // context-parallel (no M): 130 slots x 2 q/k heads, 520 CTAs in two parts (924)
  auto c = chunked_prefill::choose_prefill(tp8.p, kSms, {});
  EXPECT_EQ(c.prep_parts, 2);
  PrefillCall tp8_batch({1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024}, 2, 8);  // M: 548 CTAs in two parts (594)
  EXPECT_EQ(chunked_prefill::choose_prefill(tp8_batch.p, kSms, {}).prep_parts, 2);
  PrefillCall tp8_short({2048}, 2, 8);  // 34 slots: 272 CTAs in four parts
  EXPECT_EQ(chunked_prefill::choose_prefill(tp8_short.p, kSms, {}).prep_parts, 4);
  PrefillCall tp8_long({8192, 8192, 8192, 8192, 8192, 8192, 8192, 8192}, 2, 8);
  EXPECT_EQ(chunked_prefill::choose_prefill(tp8_long.p, kSms, {}).prep_parts, 1);
  PrefillCall next({8192});  // 2080 CTAs already
  EXPECT_EQ(chunked_prefill::choose_prefill(next.p, kSms, {}).prep_parts, 1);
  PrefillCall next_short({1024});  // M: 18 slots x 16, 576 CTAs in two parts (528 resident, 594 with an eighth)
  EXPECT_EQ(chunked_prefill::choose_prefill(next_short.p, kSms, {}).prep_parts, 2);
  PrefillCall tp8_pair({2304, 2304}, 2, 8);  // M: 75 slots x 2, 600 CTAs in four parts would be past 594
  EXPECT_EQ(chunked_prefill::choose_prefill(tp8_pair.p, kSms, {}).prep_parts, 2);
  PrefillCall tp8_near({8064}, 2, 8);  // context-parallel (no M): 128 slots x 2, 1024 CTAs in four parts past 924
  c = chunked_prefill::choose_prefill(tp8_near.p, kSms, {});
  EXPECT_GT(c.cp_segment_len, 0);
  EXPECT_EQ(c.prep_parts, 2);
  PrefillCall cp({65536}, 2, 8);  // the context-parallel path's prep too: 1026 slots
  c = chunked_prefill::choose_prefill(cp.p, kSms, {});
  EXPECT_GT(c.cp_segment_len, 0);
  EXPECT_EQ(c.prep_parts, 1);
  Overrides four;
  four.prefill_prep_parts = 4;
  EXPECT_EQ(chunked_prefill::choose_prefill(tp8.p, kSms, four).prep_parts, 4);
  four.prefill_prep_parts = 3;  // not a divisor of the group of 4
  EXPECT_THROW(chunked_prefill::choose_prefill(tp8.p, kSms, four), Error);
  Overrides pass_only;
  pass_only.prefill_stages = chunked_prefill::kStageStatePass;  // no chunk prep: parts stay 1
  EXPECT_EQ(chunked_prefill::choose_prefill(tp8.p, kSms, pass_only).prep_parts, 1);
}

// A pass of one CTA per (sequence, value head) launches after the prep where its CTAs are many; the persistent pass
// (one CTA per SM) launches early behind it.
TEST(PrefillHeuristics, ManyCtasLaunchAfterThePrep) {
  PrefillCall call(std::vector<int64_t>(8192, 32));  // 262144 (sequence, head) CTAs
  Overrides per_item;
  per_item.prefill_persistent = 0;
  auto c = chunked_prefill::choose_prefill(call.p, kSms, per_item);
  EXPECT_FALSE(c.early_state_pass);
  EXPECT_EQ(c.short_len, 0);  // 32 tokens is past the reach (16)
  c = chunked_prefill::choose_prefill(call.p, kSms, {});
  EXPECT_TRUE(c.persistent_pass);
  EXPECT_TRUE(c.early_state_pass);
}

TEST(PrefillHeuristics, ShortSequencesOnTheRecurrentKernels) {
  PrefillCall all_short(std::vector<int64_t>(1024, 8));
  auto c = chunked_prefill::choose_prefill(all_short.p, kSms, {});
  EXPECT_EQ(c.short_len, 16);  // K-last, bf16 inputs, fp32 pool
  EXPECT_TRUE(c.only_short);
  PrefillCall mixed({8, 4096, 20});
  c = chunked_prefill::choose_prefill(mixed.p, kSms, {});
  EXPECT_EQ(c.short_len, 16);
  EXPECT_FALSE(c.only_short);
  // The reach per layout and pool dtype.
  all_short.p.state.dtype = DType::kBFloat16;
  EXPECT_EQ(chunked_prefill::short_len_default(all_short.p), 16);
  all_short.p.state.dtype = DType::kFloat8E4M3;
  EXPECT_EQ(chunked_prefill::short_len_default(all_short.p), 8);
  all_short.p.state.dtype = DType::kBFloat16;
  all_short.p.state.layout = StateLayout::kVLast;
  EXPECT_EQ(chunked_prefill::short_len_default(all_short.p), 16);
  all_short.p.state.dtype = DType::kFloat32;
  EXPECT_EQ(chunked_prefill::short_len_default(all_short.p), 8);
  // Without a host copy of cu_seqlens: by the mean length (16 x 32 rows would also be a small grid).
  PrefillCall no_host(std::vector<int64_t>(16, 10));
  no_host.p.cu_seqlens_host = nullptr;
  c = chunked_prefill::choose_prefill(no_host.p, kSms, {});
  EXPECT_EQ(c.short_len, 16);
  EXPECT_FALSE(c.only_short);  // the kernels skip per sequence on the device
  // The short path stores no checkpoints: only sequences shorter than the interval take it.
  PrefillCall ckpt(std::vector<int64_t>(8, 8));
  int32_t dummy = 0;
  ckpt.p.checkpoint_interval = 64;
  ckpt.p.checkpoints.data = &dummy;
  ckpt.p.checkpoint_indices = &dummy;
  EXPECT_EQ(chunked_prefill::choose_prefill(ckpt.p, kSms, {}).short_len, 16);
  Overrides reach;
  reach.prefill_short_max_len = 100;
  EXPECT_EQ(chunked_prefill::choose_prefill(ckpt.p, kSms, reach).short_len, 63);
  reach.prefill_short_max_len = 0;
  EXPECT_EQ(chunked_prefill::choose_prefill(all_short.p, kSms, reach).short_len, 0);
  // fp32 inputs have no short path, nor a head pass.
  PrefillCall fp32(std::vector<int64_t>(1024, 8), 16, 32, DType::kFloat32);
  c = chunked_prefill::choose_prefill(fp32.p, kSms, {});
  EXPECT_EQ(c.short_len, 0);
  EXPECT_EQ(c.vtile, 64);  // 32768 rows: the widest tile
}

TEST(PrefillHeuristics, TiledPassWidestTileWithTwoCtasPerSm) {
  PrefillCall one(std::vector<int64_t>{4096}, 2, 2, DType::kFloat32);  // 2 rows
  EXPECT_EQ(chunked_prefill::choose_vtile(one.p, kSms), 16);
  PrefillCall many(std::vector<int64_t>(4, 4096), 8, 32, DType::kFloat32);  // 128 rows x 2 tiles of 64 < 264
  EXPECT_EQ(chunked_prefill::choose_vtile(many.p, kSms), 32);
}

TEST(PrefillHeuristics, ForcedChoicesAreChecked) {
  PrefillCall call({4096});
  Overrides o;
  o.prefill_vtile = chunked_prefill::kVTileHeadWarp;
  o.prefill_head_split = 1;
  const auto c = chunked_prefill::choose_prefill(call.p, kSms, o);
  EXPECT_EQ(c.vtile, chunked_prefill::kVTileHeadWarp);
  EXPECT_FALSE(c.wgmma_pass);
  o.prefill_head_split = 4;
  EXPECT_THROW(chunked_prefill::choose_prefill(call.p, kSms, o), Error);
  o.prefill_head_split = 0;
  o.prefill_vtile = 48;
  EXPECT_THROW(chunked_prefill::choose_prefill(call.p, kSms, o), Error);
}

}  // namespace
}  // namespace gdnkit::cuda

// The prefill plan's host rules on the tests' random problems.
namespace gdnkit::test {
namespace {

ProblemConfig base(std::vector<int32_t> lens, int H = 2, int HV = 4, int K = 128, int V = 128) {
  ProblemConfig c;
  c.op = OpKind::kPrefill;
  c.seq_lens = std::move(lens);
  c.H = H, c.HV = HV, c.K = K, c.V = V;
  c.zero_initial_rows = 1;
  return c;
}

// Host-side planning, no kernel: chunk c of sequence n owns workspace slot floor(cu[n]/64) + n + c;
// the slots of all chunks are distinct and below num_chunk_slots for any non-decreasing cu_seqlens
// (the host sizes the workspace without reading them).
TEST(PrefillPlan, ChunkSlotsDistinctAndBounded) {
  std::mt19937_64 gen(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int N = 1 + int(gen() % 40);
    std::vector<int64_t> cu(N + 1, 0);
    for (int n = 0; n < N; ++n) {
      const uint64_t kind = gen() % 4;  // empty, short, around the chunk, long
      const int64_t len = kind == 0   ? 0
                          : kind == 1 ? int64_t(gen() % 8)
                          : kind == 2 ? 60 + int64_t(gen() % 10)
                                      : int64_t(gen() % 700);
      cu[n + 1] = cu[n] + len;
    }
    PrefillParams p;
    p.num_seqs = N;
    p.total_tokens = cu[N];
    const int64_t slots = cuda::chunked_prefill::num_chunk_slots(p);
    std::vector<char> used(size_t(slots), 0);
    for (int n = 0; n < N; ++n)
      for (int64_t c = 0; c * 64 < cu[n + 1] - cu[n]; ++c) {
        const int64_t s = cu[n] / 64 + n + c;
        ASSERT_LT(s, slots) << "trial " << trial << " n " << n << " c " << c;
        ASSERT_FALSE(used[size_t(s)]) << "slot " << s << " taken twice (trial " << trial << ")";
        used[size_t(s)] = 1;
      }
  }
}

// The state pass: the head pass where it can run, else the widest tile that still gives ~2 CTAs per
// SM (64 is not built for K = 256).
// The short path's reach per pool layout and dtype, and when it is taken: with a host copy of cu_seqlens
// whenever a sequence is short, without it when the mean length is within the reach or the grid over every
// sequence is small (on 132 SMs: at most 2112 (sequence, value head) rows).
TEST(PrefillPlan, ShortPathChoice) {
  auto choose = [](std::vector<int32_t> lens, StateLayout layout, DType state, DType in, bool host, int HV = 4) {
    ProblemConfig c = base(std::move(lens), 2, HV);
    c.layout = layout, c.state_dtype = state, c.in_dtype = in, c.pass_cu_seqlens_host = host;
    Problem p(c);
    const PrefillParams pp = p.prefill_params(PrefillAlgorithm::kAuto);
    EXPECT_TRUE(cuda::chunked_prefill::short_path_supported(pp));
    return cuda::chunked_prefill::choose_short_len(pp, {}, 132);
  };
  const auto kl = StateLayout::kKLast, vl = StateLayout::kVLast;
  const auto f32 = DType::kFloat32, bf16 = DType::kBFloat16, f16 = DType::kFloat16;
  const std::vector<int32_t> mixed = {3, 200, 17, 64}, all_short = {3, 8, 0, 20}, all_long = {100, 64};
  EXPECT_EQ(choose(mixed, kl, f32, bf16, true), 16);  // chain kernel
  EXPECT_EQ(choose(mixed, kl, bf16, bf16, true), 16);
  EXPECT_EQ(choose(mixed, vl, f32, bf16, true), 8);  // warp kernel
  EXPECT_EQ(choose(mixed, vl, bf16, bf16, true), 16);
  EXPECT_EQ(choose(mixed, kl, f32, f16, true), 8);
  EXPECT_EQ(choose(all_long, kl, f32, bf16, true), 0);
  EXPECT_EQ(choose(mixed, kl, f32, bf16, false), 16);  // mean 71 > 16, but 16 rows
  EXPECT_EQ(choose(all_short, kl, f32, bf16, false), 16);
  const std::vector<int32_t> many_long(80, 100);  // 80 x 32 = 2560 rows, mean 100
  EXPECT_EQ(choose(many_long, kl, f32, bf16, false, 32), 0);
  EXPECT_EQ(choose(many_long, kl, f32, bf16, true, 32), 0);
  const std::vector<int32_t> many_short(80, 10);
  EXPECT_EQ(choose(many_short, kl, f32, bf16, false, 32), 16);
}

TEST(PrefillPlan, ValueTileHeuristic) {
  auto tile = [](int N, int HV, int K, int V, DType dt) {
    PrefillParams p;
    p.q.dtype = p.k.dtype = p.v.dtype = p.o.dtype = dt;
    p.num_seqs = N;
    p.heads.num_qk_heads = 1, p.heads.num_v_heads = HV, p.heads.head_dim_k = K, p.heads.head_dim_v = V;
    return cuda::chunked_prefill::choose_vtile(p, 132);
  };
  constexpr int kHead = cuda::chunked_prefill::kVTileHead;
  // 16-bit inputs (the default view dtype), K <= 128, V in {64, 128}: the head state pass.
  EXPECT_EQ(tile(8, 32, 128, 128, DType::kBFloat16), kHead);
  EXPECT_EQ(tile(1, 32, 128, 128, DType::kFloat16), kHead);
  EXPECT_EQ(tile(1, 2, 64, 64, DType::kBFloat16), kHead);
  // fp32 inputs (converted on load) and K or V = 256: the tiled state pass.
  EXPECT_EQ(tile(8, 32, 128, 128, DType::kFloat32), 64);     // 8x8192: 512 CTAs at VT=64 (fastest measured)
  EXPECT_EQ(tile(1024, 32, 128, 128, DType::kFloat32), 64);  // 1024x8
  EXPECT_EQ(tile(1, 32, 128, 128, DType::kFloat32), 16);     // 1x32768, 1x8192: 256 CTAs at VT=16
  EXPECT_EQ(tile(4, 32, 128, 128, DType::kFloat32), 32);
  EXPECT_EQ(tile(64, 8, 256, 256, DType::kBFloat16), 32);  // K = 256 has no 64 tile
  EXPECT_EQ(tile(1, 2, 64, 256, DType::kBFloat16), 16);
  // The head pass splits a head's columns over 2 CTAs while that keeps one CTA per SM.
  auto split = [](int N, int HV, int V) {
    PrefillParams p;
    p.num_seqs = N;
    p.heads.num_qk_heads = 1, p.heads.num_v_heads = HV, p.heads.head_dim_k = 128, p.heads.head_dim_v = V;
    return cuda::chunked_prefill::choose_head_split(p, 132);
  };
  EXPECT_EQ(split(1, 32, 128), 2);  // 1x32768, 1x8192
  EXPECT_EQ(split(2, 32, 64), 2);
  EXPECT_EQ(split(8, 32, 128), 1);  // 8x8192
  EXPECT_EQ(split(3, 32, 128), 1);
  for (DType dt : {DType::kBFloat16, DType::kFloat32})
    for (int K : {64, 128, 256})
      for (int V : {64, 128, 256})
        for (int N : {1, 3, 100, 5000}) {
          const int vt = tile(N, 8, K, V, dt);
          EXPECT_TRUE(cuda::chunked_prefill::vtile_supported(K, vt) && vt <= V) << K << " " << V << " " << N;
        }
}

// The public entry that tools use to label a call: the reach the CUDA backend will use.
TEST(PrefillPlan, PublicPrefillPathReportsTheShortReach) {
  ProblemConfig c = base({8, 8, 300, 0}, 16, 32);
  c.in_dtype = DType::kBFloat16;
  Problem p(c);
  EXPECT_EQ(prefill_path(p.prefill_params(PrefillAlgorithm::kAuto)).short_max_len, 16);
  ProblemConfig l = base({300, 500}, 16, 32);
  Problem q(l);
  EXPECT_EQ(prefill_path(q.prefill_params(PrefillAlgorithm::kAuto)).short_max_len, 0);
}

}  // namespace
}  // namespace gdnkit::test
