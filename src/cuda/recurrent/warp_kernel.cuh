// The warp kernel: decode, verify, commit by recompute and short prefill, every layout and dtype
// (docs/design/decode.md "The warp kernel"). Each warp owns (sequence b, value head hv, kRows columns of S) for
// all of the sequence's tokens (warp_tile.cuh says which state values each lane holds). K-last warps need no
// shared memory and no barrier: a warp's state loads go out as soon as its slot index arrives, and its token
// loop runs at its own pace while other warps of the SM wait on memory. The state stays in fp32 registers
// across the tokens (the wide tile: bf16 pairs): one state read, one write, plus the intermediate states
// verify is asked to store.
//
// The kernel in order: the CTA's place (sequence, value head, the warp's columns); prefetch mode before
// griddepcontrol.wait; the row's loads and checks (row.cuh, in the CPU reference's order); the state loads;
// then the tokens, each one WarpStep (warp_step.cuh: its loads, then its step on the state registers):
//   chains              the next token's loads issued ahead of the current token's math
//   replay_tree         verify with parents: reload the pool state and replay a token's ancestors
//   IntermediateStore   verify's state after each token, into the intermediate cache
//
// Trees (parent given): token t continues from the state after parent[t]. When parent[t] is the token the
// registers hold (a chain inside the tree), that is one step; otherwise the warp reloads the pool state and
// replays the ancestors of t in index order (a parent precedes its child), recomputing rather than reading
// the intermediate cache, which may be bf16 or absent: O(T * depth) steps, for T <= 64 draft tokens (the
// ancestor set is a 64-bit mask).
//
// The warps of a CTA (4 K-last, 4 or 8 V-last) take neighbouring columns of one head, so a CTA reads one
// contiguous range (K-last) or 128-byte row pieces (V-last, staged through shared memory). Decode, verify,
// replay and prefill are separate instantiations (kOp), so the token loop, the tree logic and the cache
// stores cost decode no registers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/arch/dtype.cuh"
#include "cuda/recurrent/row.cuh"
#include "cuda/recurrent/token.cuh"
#include "cuda/recurrent/warp_step.cuh"
#include "cuda/recurrent/warp_tile.cuh"
#include "gdnkit/params.h"

namespace gdnkit::cuda::recurrent {

// __launch_bounds__ target in resident warps per SM: the most that ptxas fits without spilling, or the count
// that runs fastest (registers per op: docs/design/decode.md "Registers").
template <StateLayout kLayout, int K, RecurrentOp kOp, TileWidth kWidth = TileWidth::kRegular>
constexpr int warp_kernel_min_warps() {
  // The wide tile needs 72 registers: at 64 ptxas spills and the calls run slower.
  if (kOp == RecurrentOp::kDecode && (kWidth == TileWidth::kWide || kWidth == TileWidth::kWideSolo)) return 28;
  if (kOp == RecurrentOp::kVerify && kLayout == StateLayout::kVLast) return 16;  // the staged stores spill at 20
  if (kOp == RecurrentOp::kRecompute) return 24;  // replay at 20 warps is latency-bound
  if (kOp == RecurrentOp::kPrefill && kLayout == StateLayout::kVLast) return 16;  // as verify
  // Verify and replay carry the token loop and the row checks: 96 registers, the most that does not spill.
  if (kOp != RecurrentOp::kDecode) return 20;
  return K <= 128 ? 32 : 28;  // decode: 64 registers at K <= 128
}

// Verify's intermediate state after token t into the row's cache slot (-1: none), from the kernel's locals.
// kFp8Cache: the cache is float8_e4m3 (a kernel of its own, so that the other caches' kernels carry none of its code).
template <class Tile, RecurrentOp kOp, int K, int V, bool kFp8Cache>
struct IntermediateStore {
  const RecurrentParams& p;
  const int& cache_slot;
  const int& num_v_heads;
  const int& hv;
  const int& v0;
  const typename Tile::Regs& s;
  const int& lane;
  typename Tile::Stage& stage;

  __device__ void operator()(int t) const {
    constexpr int64_t kHeadElems = int64_t(K) * V;
    if (kOp != RecurrentOp::kVerify || cache_slot < 0 || t >= p.intermediate.num_steps) return;
    const int64_t off = int64_t(cache_slot) * p.intermediate.slot_stride +
                        (int64_t(t) * num_v_heads + hv) * kHeadElems + Tile::origin(v0);
    if constexpr (kFp8Cache) {
      const int64_t blocks = kHeadElems / kFp8Block;
      uint8_t* const scales = p.intermediate.scales +
                              ((int64_t(cache_slot) * p.intermediate.num_steps + t) * num_v_heads + hv) * blocks +
                              Tile::origin(v0) / kFp8Block;
      Tile::store_e4m3(static_cast<uint8_t*>(p.intermediate.data) + off, scales, s, lane, stage);
      return;
    }
    if (p.intermediate.dtype == DType::kFloat32)
      Tile::store(static_cast<float*>(p.intermediate.data) + off, s, lane, stage);
    else if (p.intermediate.dtype == DType::kFloat16)
      Tile::store(static_cast<__half*>(p.intermediate.data) + off, s, lane, stage);
    else
      Tile::store(static_cast<__nv_bfloat16*>(p.intermediate.data) + off, s, lane, stage);
  }
};

// Verify of a tree: token t continues from the state after parent[t] (-1: the pool state, load_pool()).
template <class LoadPool, class Step, class StoreIntermediate>
__device__ __forceinline__ void replay_tree(const RecurrentParams& p, int b, int T, int len, const LoadPool& load_pool,
                                            const Step& step, const StoreIntermediate& store_intermediate) {
  const int32_t* parent = p.parent + int64_t(b) * T;  // checked above: -1 <= parent[t] < t
  int held = -1;  // the token whose state the registers hold; -1: the pool state
#pragma unroll 1
  for (int t = 0; t < len; ++t) {
    const int pt = parent[t];
    if (pt != held) {
      uint64_t ancestors = 0;
      for (int x = pt; x >= 0; x = parent[x]) ancestors |= uint64_t(1) << x;
      load_pool();
      while (ancestors != 0) {
        const int x = __ffsll(static_cast<long long>(ancestors)) - 1;
        ancestors &= ancestors - 1;
        step.load_and_apply(x, false);
      }
    }
    step.load_and_apply(t, true);
    held = t;
    store_intermediate(t);
  }
}

// kWidth: the tile's columns per warp (warp_tile.cuh). kPinSlot: decode reads the slot index as a volatile
// load (below). TState uint8_t: a float8_e4m3 pool (K-last; verify, commit by recompute, short prefill), block scales
// beside it.
template <StateLayout kLayout, class TState, class TInput, int K, int V, RecurrentOp kOp,
          TileWidth kWidth = TileWidth::kRegular, bool kPinSlot = false, bool kFp8Cache = false>
__global__ void __launch_bounds__(WarpTile<kLayout, TState, K, V, kWidth>::kCtaWarps * 32,
                                  warp_kernel_min_warps<kLayout, K, kOp, kWidth>() /
                                      WarpTile<kLayout, TState, K, V, kWidth>::kCtaWarps)
    warp_recurrent_kernel(const RecurrentParams p, const bool write_state, const bool prefetch) {
  using Tile = WarpTile<kLayout, TState, K, V, kWidth>;
  using Step = WarpStep<kLayout, TState, TInput, K, V, kOp, kWidth>;
  constexpr int kRows = Tile::kRows;
  constexpr bool kDecode = kOp == RecurrentOp::kDecode, kRecompute = kOp == RecurrentOp::kRecompute;
  constexpr bool kPrefill = kOp == RecurrentOp::kPrefill;
  constexpr bool kFp8State = std::is_same_v<TState, uint8_t>;
  static_assert(!kFp8State || !kDecode, "float8_e4m3 pools: all but decode (fp8_decode.cuh, vlast_decode.cuh)");
  constexpr int kColBlocks = V / kRows;  // column blocks per head
  constexpr int kCtaWarps = Tile::kCtaWarps;
  __shared__ typename Tile::Stage stage;
  constexpr int64_t kHeadElems = int64_t(K) * V;

  const int lane = threadIdx.x % 32;
  // CTA (x, y) -> sequence b = y, value head hv = x / kColCtas, and the kCtaWarps neighbouring column
  // blocks (x % kColCtas) of that head, one per warp: every early return below is taken by the whole CTA,
  // as V-last's staged loads (barriers) need. Only constant divisors on the way to the first load. The
  // CTAs of one sequence run together: the heads of a slot are one contiguous range
  // (docs/design/decode.md "CTAs and grid").
  constexpr int kColCtas = kColBlocks / kCtaWarps;
  const int num_v_heads = p.heads.num_v_heads;
  const int b = int(blockIdx.y), hv = int(blockIdx.x / unsigned(kColCtas));
  const int v0 = (int(blockIdx.x % unsigned(kColCtas)) * kCtaWarps + int(threadIdx.x) / 32) * kRows;
  const int hq = qk_head(p, hv);  // GVA
  const int T = kDecode ? 1 : p.num_draft_tokens;
  // Errors of a sequence are counted once: by lane 0 of the warp owning columns 0.. of head 0.
  const bool counts_errors = hv == 0 && v0 == 0 && lane == 0 && p.error_flag != nullptr;

  TState* const head_block = static_cast<TState*>(p.state.data) + int64_t(hv) * kHeadElems + Tile::origin(v0);
  // Before griddepcontrol.wait a CTA may only ask for data, not use it (docs/design/decode.md "Launch"). In
  // prefetch mode (heuristics.cpp, prefetch_mode) it asks L2 for the state tile of the slot index as it reads
  // now (an L2-only load, checked against the pool; a stale index only prefetches the wrong lines) and, for
  // decode, for the token's q, k, v and gate inputs.
  int early_slot = -1;  // the slot index as read before the wait, if a pool slot
  if (prefetch && (!kPrefill || p.state_indices != nullptr)) {  // prefill: initial slots may be absent
    early_slot = __ldcg(p.state_indices + b);
    if (early_slot >= 0 && early_slot < p.state.num_slots)
      Tile::prefetch(head_block + int64_t(early_slot) * p.state.slot_stride, lane);
    else
      early_slot = -1;
    if (kDecode) prefetch_token_inputs<TInput>(p, b, hq, hv, v0, K, kRows, lane);
  }
  pdl_wait_and_launch_dependents();

  // kPinSlot (fp32-state decode in prefetch mode): the slot index as a volatile load, which ptxas issues
  // first, so that the slot checks and the q/k norms run while the state arrives.
  const RowLoads row = load_row<kOp>(p, b, kPinSlot);
  const int slot = row.slot;  // the state loads wait on it
  typename Tile::Regs s;      // the tile (warp_tile.cuh)
  static_assert(!Tile::kPacked || kDecode, "16-bit values in registers round once per token: decode only");
  // Decode in prefetch mode loads the state of the early slot now, beside the index rather than after it
  // (after the wait: that slot's current state). If the index differs, the right slot's state is loaded
  // below and this one is dropped.
  if constexpr (kDecode)
    if (early_slot >= 0) Tile::load(head_block + int64_t(early_slot) * p.state.slot_stride, s, lane, stage);

  // ---- which tokens, which slots (the same checks, in the same order, as the CPU reference) -----
  int64_t tok0;
  int len;
  const bool placed = row_tokens<kOp>(p, row, b, T, tok0, len);  // decode: T = 1, token b
  const float scale = p.heads.scale > 0.0f ? p.heads.scale : 1.0f / sqrtf(float(K));
  HeadGates decode_head_gates{0.0f, 0.0f};  // loaded beside the token's inputs (WarpStep)
  if (kDecode) decode_head_gates = head_gates(p.gating, hv);
  float lane_decay = 1.0f, lane_beta = 0.0f;  // multi-token ops: the gates of token `lane`
  const Step step{p, lane, hv, hq, v0, tok0, scale, decode_head_gates, lane_decay, lane_beta, s};

  typename Step::Token cur;  // the next token to apply; decode: its loads go out before the slot arrives
  if constexpr (kDecode) cur = step.load_token(0);

  if (!placed) {  // a row the kernel cannot place: counted, nothing written (prefill: not this path's)
    if (counts_errors && !kPrefill) atomicAdd(p.error_flag, 1);
    return;
  }
  if (kRecompute && slot < 0) return;  // padding row: commit leaves it alone
  int n_replay, cache_slot;
  const bool bad = row_is_bad<kOp>(p, row, b, T, len, n_replay, cache_slot);

  // Padding row (prefill: no initial slot means S = 0), or one the kernel must not touch: o = 0, no state
  // traffic.
  if (bad || (slot < 0 && !kPrefill)) {
    if (bad && counts_errors) atomicAdd(p.error_flag, 1);
    if (!kRecompute && lane < kRows)
      for (int t = 0; t < len; ++t) step.out_row(tok0 + t)[lane] = from_float<TInput>(0.0f);
    return;
  }
  if (kRecompute && n_replay == 0) return;  // nothing kept: the pool state stays

  // ---- the tokens -------------------------------------------------------------------------------
  // Chains (decode, replay, verify without parent, prefill) run their tokens in order with the next token's
  // loads issued before the current token's math, so only the first token's load latency is exposed (and
  // that one overlaps the state loads). Trees take WarpStep::load_and_apply (loads, then math) per token.
  const int n_tokens = kDecode ? 1 : (kRecompute ? n_replay : len);
  const bool chain = kOp != RecurrentOp::kVerify || p.parent == nullptr;  // prefill: a chain
  const auto token_index = [&](int j) {
    return kRecompute && p.accepted_path != nullptr ? p.accepted_path[int64_t(b) * T + j] : j;
  };
  GateBits lane_gate{0u, 0u};  // raw gate inputs of token `lane`, loaded before the state
  if (!kDecode && lane < len) lane_gate = step.gate_inputs(lane);
  if (!kDecode && chain && n_tokens > 0) cur = step.load_token(token_index(0));

  TState* const tile = head_block + int64_t(slot) * p.state.slot_stride;
  // The scale blocks of the warp's columns in a slot (float8_e4m3 pools).
  const auto pool_scales = [&](int sl) {
    return p.state.scales + (int64_t(sl) * num_v_heads + hv) * (kHeadElems / kFp8Block) + Tile::origin(v0) / kFp8Block;
  };
  [[maybe_unused]] uint8_t* const tile_scales = kFp8State ? pool_scales(slot) : nullptr;
  const auto load_pool = [&] {  // every state load issued before any use
    if constexpr (kFp8State)
      Tile::load_e4m3(tile, tile_scales, s, lane, stage);
    else
      Tile::load(tile, s, lane, stage);
  };
  if (kPrefill && slot < 0) {  // prefill from S = 0
    s.set_zero();
  } else if (!kDecode || early_slot != slot) {
    load_pool();
  }
  if (!kDecode) step.gate_math(lane_gate, lane_decay, lane_beta);

  static_assert(!kFp8Cache || (Tile::kStoresE4m3 && kOp == RecurrentOp::kVerify), "fp8 caches: verify");
  const IntermediateStore<Tile, kOp, K, V, kFp8Cache> store_intermediate{p, cache_slot, num_v_heads, hv, v0, s, lane,
                                                                         stage};

  if (chain) {
#pragma unroll 1
    for (int j = 0; j < n_tokens; ++j) {
      typename Step::Token next;
      if (j + 1 < n_tokens) next = step.load_token(token_index(j + 1));
      step.apply(cur, !kRecompute);
      store_intermediate(j);
      cur = next;
    }
    if constexpr (kPrefill && kFp8State) {
      if (row.final_slot >= 0)
        Tile::store_e4m3(head_block + int64_t(row.final_slot) * p.state.slot_stride, pool_scales(row.final_slot), s,
                         lane, stage);
    } else if constexpr (kPrefill) {
      if (row.final_slot >= 0) Tile::store(head_block + int64_t(row.final_slot) * p.state.slot_stride, s, lane, stage);
    } else if (kOp != RecurrentOp::kVerify || write_state) {
      if constexpr (kFp8State)
        Tile::store_e4m3(tile, tile_scales, s, lane, stage);
      else
        Tile::store(tile, s, lane, stage);
    }
    return;
  }
  if constexpr (kOp == RecurrentOp::kVerify)
    replay_tree(p, b, T, len, load_pool, step, store_intermediate);
}

}  // namespace gdnkit::cuda::recurrent
