// The recurrent kernel behind decode, verify and commit-by-recompute, warp-independent: each warp owns
// (sequence b, value head hv, kRows columns of S) for all of the sequence's tokens (warp_tile.cuh says
// which state values each lane holds). No shared memory and no barrier: a warp's state loads go out as
// soon as its slot index arrives, and the token loop runs at the warp's own pace while other warps of
// the SM wait on memory. The state stays in fp32 registers across the tokens (decode's wide tile: bf16 pairs,
// warp_tile.cuh StateRegs): one state read, one write, plus the intermediate states verify is asked to store.
//
// One token (docs/semantics.md "The recurrence"), q and k normalized (q also scaled) in registers, per column v:
//   d_k = S[:, v] . k      d_q = S[:, v] . q          (before the decay, reduced together)
//   u_v = beta * (v_v - exp(g) * d_k)
//   o_v = exp(g) * d_q + (k . q) * u_v               (= S_new[:, v] . q)
//   S_new[:, v] = exp(g) * S[:, v] + k * u_v          (rounded to the storage dtype at a store)
//
// Trees (parent given): token t continues from the state after parent[t]. When parent[t] is the token
// the registers hold (a chain inside the tree), that is one step; otherwise the warp reloads the pool
// state and replays the ancestors of t in index order (a parent precedes its child), recomputing rather
// than reading the intermediate cache, which may be bf16 or absent. Cost O(T * depth) steps, for T <= 64
// draft tokens (the ancestor set is a 64-bit mask).
//
// NOTES: the tile (warp_tile.cuh: kRows columns per warp) keeps 32 fp32 state values per lane at K = 128 (16 on the
// narrow tile of bf16 decode, B = 3..16 where the wide tile does not run; 64 as bf16 pairs on the wide tile,
// B = 2..12 in prefetch mode): 64 registers for K-last decode, so 32 warps fit an SM (72 and 28 on the wide
// tile), each with kRows * K * sizeof(state) bytes of loads in flight (4 KB fp32: 128 KB per SM, several times
// what HBM latency needs).
// The warps of a CTA (4 K-last, 4 V-last) take neighbouring columns of one head, so a CTA reads one contiguous
// range (K-last) or 128-byte row pieces (V-last, staged through shared memory). Decode, verify and replay are
// separate instantiations (kOp), so the token loop, the tree logic and the cache stores cost decode no registers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/host/check.h"
#include "cuda/arch/dtype.cuh"
#include "cuda/recurrent/row.cuh"
#include "cuda/recurrent/token.cuh"
#include "cuda/recurrent/warp_tile.cuh"
#include "gdnkit/params.h"

namespace gdnkit::cuda::recurrent {

// __launch_bounds__ target in warps per SM (ptxas, CUDA 13.0, sm_90a, K = 128). Decode: 32 -> 64 registers, no
// spills for either layout (K = 256: 28 warps, 72-76 registers). Verify and replay carry the token loop and the
// row checks: unbounded they take 123 registers; 20 warps (96) is the most that does not spill.
template <StateLayout kLayout, int K, RecurrentOp kOp, TileWidth kWidth = TileWidth::kRegular>
constexpr int warp_kernel_min_warps() {
  // The wide tile (bf16 decode): 72 registers, no spills; at 32 warps (64 registers) ptxas spilled 68-96 bytes
  // and it measured 5-11% slower (results/H100/decode_ab15_wide.txt).
  if (kOp == RecurrentOp::kDecode && kWidth == TileWidth::kWide) return 28;
  if (kOp == RecurrentOp::kVerify && kLayout == StateLayout::kVLast) return 16;  // 20 spilled 124 bytes (staged stores)
  if (kOp == RecurrentOp::kRecompute) return 24;  // ncu: replay at 20 warps (85 registers) was latency-bound
  if (kOp == RecurrentOp::kPrefill && kLayout == StateLayout::kVLast) return 16;  // as verify
  if (kOp != RecurrentOp::kDecode) return 20;
  return K <= 128 ? 32 : 28;
}

// kWidth: the tile's columns per warp (warp_tile.cuh). kPinSlot: decode reads the slot index as a volatile load
// (below).
template <StateLayout kLayout, class TState, class TInput, int K, int V, RecurrentOp kOp,
          TileWidth kWidth = TileWidth::kRegular, bool kPinSlot = false>
__global__ void __launch_bounds__(WarpTile<kLayout, TState, K, V, kWidth>::kCtaWarps * 32,
                                  warp_kernel_min_warps<kLayout, K, kOp, kWidth>() /
                                      WarpTile<kLayout, TState, K, V, kWidth>::kCtaWarps)
    warp_recurrent_kernel(const RecurrentParams p, const bool write_state, const bool prefetch) {
  using Tile = WarpTile<kLayout, TState, K, V, kWidth>;
  constexpr int kRows = Tile::kRows, kKPer = Tile::kKPer;
  constexpr bool kDecode = kOp == RecurrentOp::kDecode, kRecompute = kOp == RecurrentOp::kRecompute;
  constexpr bool kPrefill = kOp == RecurrentOp::kPrefill;
  // Dot products per token: d_k of each column, and d_q unless replaying; each lands in kLanesPerSum lanes.
  constexpr int kSums = kRecompute ? kRows : 2 * kRows, kLanesPerSum = 32 / kSums;
  static_assert(kRecompute || kRows * kLanesPerSum == 16, "d_q of column i sits 16 lanes above its d_k");
  constexpr int kColBlocks = V / kRows;  // column blocks per head
  constexpr int kCtaWarps = Tile::kCtaWarps;
  __shared__ typename Tile::Stage stage;
  constexpr int64_t kHeadElems = int64_t(K) * V;

  const int lane = threadIdx.x % 32;
  // CTA (x, y) -> sequence b = y, value head hv = x / kColCtas, and the kCtaWarps neighbouring column
  // blocks (x % kColCtas) of that head, one per warp: every early return below is taken by the whole CTA,
  // as V-last's staged loads (barriers) need. Only constant divisors on the way to the first load. The
  // CTAs of one sequence run together: the heads of a slot are one contiguous range (2 MB at fp32), and
  // ordering by head first (the sequences' slots scattered over the pool) measured 5% slower on the H100.
  constexpr int kColCtas = kColBlocks / kCtaWarps;
  const int HV = p.heads.num_v_heads;
  const int b = int(blockIdx.y), hv = int(blockIdx.x / unsigned(kColCtas));
  const int v0 = (int(blockIdx.x % unsigned(kColCtas)) * kCtaWarps + int(threadIdx.x) / 32) * kRows;
  const int hq = qk_head(p, hv);  // GVA
  const int T = kDecode ? 1 : p.num_draft_tokens;
  // Errors of a sequence are counted once: by lane 0 of the warp owning columns 0.. of head 0.
  const bool counter = hv == 0 && v0 == 0 && lane == 0 && p.error_flag != nullptr;

  TState* const head_block = static_cast<TState*>(p.state.data) + int64_t(hv) * kHeadElems + Tile::origin(v0);
  // Programmatic dependent launch (the launcher asks for it): this kernel's CTAs may start before the
  // previous kernel of the stream finished, and wait (griddepcontrol.wait) before any read whose
  // result they use. Before the wait they only ask L2 for what they will read (`prefetch`, on unless
  // GDNKIT_PREFETCH=0): the state tile of the slot index as it reads now (an L2-only load, clamped to
  // the pool; a stale index only prefetches the wrong lines), and for decode the token's q, k, v and
  // gate inputs. L2 is coherent, so the loads after the wait see the previous kernel's writes. That
  // overlaps the DRAM latency of the state with the previous kernel's last wave (all of it at small B).
  // The next kernel may launch once every CTA of this one is past its wait: at most one kernel ahead.
  int spec = -1;  // the slot index as read before the wait, if a pool slot (prefetch mode)
  if (prefetch && (!kPrefill || p.state_indices != nullptr)) {  // prefill: initial slots may be absent
    spec = __ldcg(p.state_indices + b);
    if (spec >= 0 && spec < p.state.num_slots)
      Tile::prefetch(head_block + int64_t(spec) * p.state.slot_stride, lane);
    else
      spec = -1;
    if (kDecode) prefetch_token_inputs<TInput>(p, b, hq, hv, v0, K, kRows, lane);
  }
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;");

  // kPinSlot (fp32-state decode in prefetch mode, launcher below): the slot index as a volatile load, which
  // ptxas issues first; as a plain load it went out behind the state loads of slot `spec`, so the slot checks
  // and the q/k norms waited for the whole state rather than running while it arrives.
  const RowLoads rl = load_row<kOp>(p, b, kPinSlot);
  const int slot = rl.slot;  // the state loads wait on it
  typename Tile::Regs s;  // the tile (warp_tile.cuh)
  static_assert(!Tile::kPacked || kDecode, "bf16 values in registers round once per token: decode only");
  // Decode in prefetch mode loads the state of slot `spec` now, beside the index rather than after it
  // (after the wait: the current state of that slot). If the index read now differs, the state of the
  // right slot is loaded below and this one is dropped.
  if (kDecode && spec >= 0) Tile::load(head_block + int64_t(spec) * p.state.slot_stride, s, lane, stage);

  // ---- which tokens, which slots (the same checks, in the same order, as the CPU reference) -----
  int64_t tok0;
  int len;
  const bool placed = row_tokens<kOp>(p, rl, b, T, tok0, len);  // decode: T = 1, token b
  const auto out_ptr = [&](int64_t tok) {
    return static_cast<TInput*>(p.o.data) + tok * p.o.token_stride + int64_t(hv) * p.o.head_stride + v0;
  };
  const float scale = p.heads.scale > 0.0f ? p.heads.scale : 1.0f / sqrtf(float(K));
  const Gating& gt = p.gating;

  // The gates of local token x: the raw inputs (a, b of the fused form, or g, beta), then the math.
  // Multi-token ops compute them once per token, lane t for token t (t < 32, see `lane_gates` below),
  // rather than once per token in every lane: the gating is ~100 warp instructions, a sixth of a token.
  const auto gate_inputs = [&](int x) { return token_gate_bits(gt, tok0 + x, hv); };
  // Decode loads the head's A_log and dt_bias here, beside the token's inputs, rather than at the gate
  // math (after the state arrived: one more L2 round trip on the critical path).
  HeadGates hg_early{0.0f, 0.0f};
  if (kDecode) hg_early = head_gates(gt, hv);
  const auto gate_math = [&](GateBits x, float& decay, float& beta) {
    float g;
    gate_log_values(gt, kDecode ? hg_early : head_gates(gt, hv), x, g, beta);
    decay = expf(g);
  };
  float lane_decay = 1.0f, lane_beta = 0.0f;  // multi-token ops: the gates of token `lane`

  // One token x (local index) of this sequence: its loads, then its step (o when asked). The loads are
  // held as loaded and converted in apply: no conversion waits on them before the state loads go out.
  constexpr int kVec = Tile::kVec;
  struct Token {
    int x;  // local token index (o row)
    RawVec<TInput, kVec> k[kKPer / kVec], q[kKPer / kVec];  // this lane's k entries: runs of kVec (warp_tile.cuh)
    TInput v_lane;   // v of the column whose sums this lane ends with (see apply)
    GateBits g;  // decode: raw gate inputs
  };
  const auto load_token = [&](int x) {
    const int64_t tok = tok0 + x;
    const TInput* kp = static_cast<const TInput*>(p.k.data) + tok * p.k.token_stride + int64_t(hq) * p.k.head_stride;
    const TInput* qp = static_cast<const TInput*>(p.q.data) + tok * p.q.token_stride + int64_t(hq) * p.q.head_stride;
    const TInput* vp = static_cast<const TInput*>(p.v.data) + tok * p.v.token_stride + int64_t(hv) * p.v.head_stride + v0;
    Token d;
    d.x = x;
    // fp32-state decode's loads are pinned (volatile): as plain loads ptxas sank them under the slot checks
    // below, which wait for the index, one more L2 or DRAM round trip before the math (B = 1 3.155 -> 3.08
    // µs). With bf16 state pinning measured B = 1 unchanged and B = 2-4 2% slower (strong loads skip L1).
    constexpr bool kPin = kDecode && sizeof(TState) == 4;
#pragma unroll
    for (int j = 0; j < kKPer; j += kVec) {
      if (kPin) {
        d.k[j / kVec].load_pinned(kp + Tile::k_of(lane, j)), d.q[j / kVec].load_pinned(qp + Tile::k_of(lane, j));
      } else {
        d.k[j / kVec].load(kp + Tile::k_of(lane, j));
        if (!kRecompute) d.q[j / kVec].load(qp + Tile::k_of(lane, j));
      }
    }
    if (kPin) {
      RawVec<TInput, 1> v;
      v.load_pinned(vp + (lane / kLanesPerSum) % kRows);
      d.v_lane = v.element(0);
    } else {
      d.v_lane = vp[(lane / kLanesPerSum) % kRows];
    }
    if (kDecode) d.g = gate_inputs(x);
    return d;
  };
  const auto apply = [&](const Token& d, bool write_o) {
    float k[kKPer], q[kKPer];
#pragma unroll
    for (int j = 0; j < kKPer; j += kVec) {
      d.k[j / kVec].to_floats(&k[j]);
      if (!kRecompute) d.q[j / kVec].to_floats(&q[j]);
    }
    // q, k: L2 norms (eps inside the root), scale; k . q of the normalized vectors. The norms scale the
    // sums, not the vectors (S^T (rk k) = rk (S^T k); the update k_n u = k (rk u)), so their reduction
    // chain runs beside the dot products' instead of before them.
    float kk = 0.0f, qq = 0.0f, kq = 0.0f;
#pragma unroll
    for (int j = 0; j < kKPer; ++j) {
      kk = fmaf(k[j], k[j], kk);
      if (!kRecompute) qq = fmaf(q[j], q[j], qq), kq = fmaf(k[j], q[j], kq);
    }
    kk = warp_sum(kk);
    if (!kRecompute) qq = warp_sum(qq), kq = warp_sum(kq);
    // rsqrtf (MUFU.RSQ, ~1 ulp) instead of an IEEE sqrt and divide: ~30 fewer instructions a token.
    const float rk = p.heads.use_qk_l2norm ? rsqrtf(kk + 1e-6f) : 1.0f;
    const float rq = (p.heads.use_qk_l2norm ? rsqrtf(qq + 1e-6f) : 1.0f) * scale;
    const float kq_n = kq * rk * rq;
    float decay, beta;
    if (kDecode) {
      gate_math(d.g, decay, beta);
    } else if (d.x < 32) {
      decay = __shfl_sync(0xffffffffu, lane_decay, d.x);
      beta = __shfl_sync(0xffffffffu, lane_beta, d.x);
    } else {  // tree tokens past 32
      gate_math(gate_inputs(d.x), decay, beta);
    }

    // The kSums dot products of the warp's columns (d_k of column i at i, d_q at kRows + i), reduced
    // together: lane l ends with sum number l / kLanesPerSum. Scoring folds each column's (d_k, d_q) pair
    // into one value at once (the reduction's first step, across lanes l and l ^ 16: the lower half keeps
    // d_k), so only kRows partial sums are live at a time.
    float x[kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      float dk = 0.0f, dq = 0.0f;
#pragma unroll
      for (int j = 0; j < kKPer; ++j) {
        dk = fmaf(s.get(i, j), k[j], dk);
        if (!kRecompute) dq = fmaf(s.get(i, j), q[j], dq);
      }
      if (kRecompute) {
        x[i] = dk;
      } else {
        const bool upper = (lane & 16) != 0;
        x[i] = (upper ? dq : dk) + __shfl_xor_sync(0xffffffffu, upper ? dk : dq, 16);
      }
    }
    const int mine = kRecompute ? transpose_group_sum<kRows, 32>(x, lane)
                             : (lane & 16 ? kRows : 0) + transpose_group_sum<kRows, 16>(x, lane);
    // Lanes holding a d_k: u of that column (v_lane is that column's v).
    const float u_mine = beta * (to_float(d.v_lane) - decay * (x[0] * rk));
    if (!kRecompute && write_o) {
      // Lanes holding a d_q take u from the lane holding the same column's d_k (kRows * kLanesPerSum = 16
      // lanes below) and one lane per column writes o.
      const float u_col = __shfl_xor_sync(0xffffffffu, u_mine, 16);
      if (mine >= kRows && lane % kLanesPerSum == 0)
        out_ptr(tok0 + d.x)[mine - kRows] = from_float<TInput>(fmaf(kq_n, u_col, decay * (x[0] * rq)));
    }
    const float uk_mine = u_mine * rk;
    s.opaque();  // packed bf16 state: unpacked again for the update (StateRegs)
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const float uk = __shfl_sync(0xffffffffu, uk_mine, i * kLanesPerSum);
#pragma unroll
      for (int j = 0; j < kKPer; j += 2)
        s.set2(i, j, fmaf(k[j], uk, decay * s.get(i, j)), fmaf(k[j + 1], uk, decay * s.get(i, j + 1)));
    }
  };
  const auto step = [&](int x, bool write_o) {
    Token d = load_token(x);
    apply(d, write_o);
  };

  Token cur;  // the next token to apply; decode: its loads go out before the slot arrives
  if constexpr (kDecode) cur = load_token(0);

  if (!placed) {  // a row the kernel cannot place: counted, nothing written (prefill: not this path's)
    if (counter && !kPrefill) atomicAdd(p.error_flag, 1);
    return;
  }
  if (kRecompute && slot < 0) return;  // padding row: commit leaves it alone
  int n_replay, islot;
  const bool bad = row_is_bad<kOp>(p, rl, b, T, len, n_replay, islot);

  // Padding row (prefill: no initial slot means S = 0), or one the kernel must not touch: o = 0, no state
  // traffic.
  if (bad || (slot < 0 && !kPrefill)) {
    if (bad && counter) atomicAdd(p.error_flag, 1);
    if (!kRecompute && lane < kRows)
      for (int t = 0; t < len; ++t) out_ptr(tok0 + t)[lane] = from_float<TInput>(0.0f);
    return;
  }
  if (kRecompute && n_replay == 0) return;  // nothing kept: the pool state stays

  // ---- the tokens -------------------------------------------------------------------------------
  // Chains (decode, replay, verify without parent) run their tokens in order with the next token's
  // loads issued before the current token's math, so only the first token's load latency is exposed
  // (and that one overlaps the state loads). Trees take `step` (loads, then math) per token.
  const int n_tokens = kDecode ? 1 : (kRecompute ? n_replay : len);
  const bool chain = kOp != RecurrentOp::kVerify || p.parent == nullptr;  // prefill: a chain
  const auto token_index = [&](int j) {
    return kRecompute && p.accepted_path != nullptr ? p.accepted_path[int64_t(b) * T + j] : j;
  };
  GateBits lane_g{0u, 0u};  // raw gate inputs of token `lane`, loaded before the state
  if (!kDecode && lane < len) lane_g = gate_inputs(lane);
  if (!kDecode && chain && n_tokens > 0) cur = load_token(token_index(0));

  TState* const tile = head_block + int64_t(slot) * p.state.slot_stride;
  if (kPrefill && slot < 0) {  // prefill from S = 0
#pragma unroll
    for (int i = 0; i < kRows; ++i)
#pragma unroll
      for (int j = 0; j < kKPer; j += 2) s.set2(i, j, 0.0f, 0.0f);
  } else if (!kDecode || spec != slot) {
    Tile::load(tile, s, lane, stage);  // every state load issued before any use
  }
  if (!kDecode) gate_math(lane_g, lane_decay, lane_beta);

  // Verify's intermediate state after token t.
  const auto store_intermediate = [&](int t) {
    if (kOp != RecurrentOp::kVerify || islot < 0 || t >= p.intermediate.num_steps) return;
    const int64_t off = int64_t(islot) * p.intermediate.slot_stride + (int64_t(t) * HV + hv) * kHeadElems +
                        Tile::origin(v0);
    if (p.intermediate.dtype == DType::kFloat32)
      Tile::store(static_cast<float*>(p.intermediate.data) + off, s, lane, stage);
    else
      Tile::store(static_cast<__nv_bfloat16*>(p.intermediate.data) + off, s, lane, stage);
  };

  if (chain) {
#pragma unroll 1
    for (int j = 0; j < n_tokens; ++j) {
      Token next;
      if (j + 1 < n_tokens) next = load_token(token_index(j + 1));
      apply(cur, !kRecompute);
      store_intermediate(j);
      cur = next;
    }
    if constexpr (kPrefill) {
      if (rl.fslot >= 0) Tile::store(head_block + int64_t(rl.fslot) * p.state.slot_stride, s, lane, stage);
    } else if (kOp != RecurrentOp::kVerify || write_state) {
      Tile::store(tile, s, lane, stage);
    }
    return;
  }
  if constexpr (kOp == RecurrentOp::kVerify) {  // tree
    const int32_t* par = p.parent + int64_t(b) * T;  // checked above: -1 <= par[t] < t
    int held = -1;  // the token whose state the registers hold; -1: the pool state
#pragma unroll 1
    for (int t = 0; t < len; ++t) {
      const int pt = par[t];
      if (pt != held) {
        uint64_t ancestors = 0;
        for (int x = pt; x >= 0; x = par[x]) ancestors |= uint64_t(1) << x;
        Tile::load(tile, s, lane, stage);
        while (ancestors != 0) {
          const int x = __ffsll(static_cast<long long>(ancestors)) - 1;
          ancestors &= ancestors - 1;
          step(x, false);
        }
      }
      step(t, true);
      held = t;
      store_intermediate(t);
    }
  }
}

}  // namespace gdnkit::cuda::recurrent
