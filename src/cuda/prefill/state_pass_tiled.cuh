// Kernel 2, the tiled variant: per (sequence, value head, value tile) sequential state pass, for the calls the head
// pass (state_pass_head.cuh) does not take: fp32 inputs, K or V = 256, unaligned views (docs/design/prefill.md
// "Kernel 2, the other case: the tiled state pass"). One CTA of 4 warps per value tile S[:, v0 : v0 + VT]; S lives in
// registers as mma accumulators with an operand-dtype copy in shared memory feeding k S and q S; four barriers per
// chunk.
#pragma once

#include <cstdint>

#include "cuda/arch/fp8.cuh"
#include "cuda/prefill/io.cuh"
#include "cuda/prefill/mma.cuh"
#include "cuda/prefill/plan.h"
#include "gdnkit/params.h"

namespace gdnkit::cuda::chunked_prefill {

template <int K, int VT, class Op>
struct StateSmem {
  static constexpr int LDK = K + 8, LDV = VT + 8, LDT = kChunk + 8;
  Op ks[kChunk * LDK];  // raw k rows of the chunk
  Op qs[kChunk * LDK];  // raw q rows
  Op sb[K * LDV];       // S (Op copy), [k][v]
  Op ts[kChunk * LDT];  // T' of the chunk
  Op ms[kChunk * LDT];  // M of the chunk (masked decayed q k^T)
  Op vs[kChunk * LDV];  // v, then X in place
  Op vn[kChunk * LDV];  // v_new
  Op vd[kChunk * LDV];  // v_new_j rk_j exp(g_last - gcum_j): the state-update operand
  float ek[kChunk], eq[kChunk], dd[kChunk], eg;  // token factors (FactorRow)
};

// One thread's share of a chunk's inputs (uint4 = 8 operands): q and k rows, the v tile, T', M,
// and the per-token scalars.
template <int K, int VT>
struct ChunkRegs {
  static constexpr int kRow = kChunk * K / 8 / kThreads;     // per q (and per k)
  static constexpr int kV = kChunk * VT / 8 / kThreads;      // v tile
  static constexpr int kT = kChunk * kChunk / 8 / kThreads;  // T' (and M)
  uint4 k[kRow], q[kRow], v[kV], t[kT], m[kT];
  float ek = 0.0f, eq = 0.0f, dd = 0.0f, eg = 0.0f;  // token factors (FactorRow)
};

// One thread of a tiled state pass CTA (its value tile v0 .. v0 + VT - 1 of head h, its rows) and the parts of a
// chunk. The S tile in registers: element (k, v) of fragment s[mt][nt][e] is
//   k = krow0 + mt*16 + r + (e/2)*8,  v = v0 + nt*8 + q2 + (e%2),  krow0 = warp*K/4 (warp w owns rows w*K/4 .. +K/4).
// The kernel declares the register arrays each part fills, so that they are formed in its scope.
template <int K, int VT, class Op>
struct TiledStatePass {
  using Smem = StateSmem<K, VT, Op>;
  using Regs = ChunkRegs<K, VT>;
  static constexpr int LDK = Smem::LDK, LDV = Smem::LDV, LDT = Smem::LDT;
  static constexpr int MT = K / 64;  // m16 tiles of S rows per warp
  static constexpr int NT = VT / 8;  // n8 tiles of S columns
  static_assert(NT % 2 == 0, "value tiles are whole 16-column ldmatrix blocks");

  const PrefillParams& p;
  const Plan& plan;
  Smem& sm;
  int HV, V, h, hk, v0;
  int tid, warp, lane, r, q2, krow0;
  int64_t start, len;

  // Chunk c's inputs into registers (global -> ChunkRegs -> shared memory), slot0 the sequence's first chunk slot.
  __device__ __forceinline__ void fetch(Regs& f, int64_t c, int64_t slot0) const {
    const int64_t t0 = start + c * kChunk;
    const int L = int(min(int64_t(kChunk), len - c * kChunk));
    const int64_t ws = (slot0 + c) * HV + h;
#pragma unroll
    for (int u = 0; u < Regs::kV; ++u) {
      const int it = tid + u * kThreads, row = it / (VT / 8), cv = it % (VT / 8);
      f.v[u] = row < L ? load8<Op>(p.v.data, p.v.dtype,
                                   (t0 + row) * p.v.token_stride + h * p.v.head_stride + v0 + cv * 8, plan.qkv_vec)
                       : make_uint4(0, 0, 0, 0);
    }
    const uint4* tsrc =
        reinterpret_cast<const uint4*>(static_cast<const Op*>(plan.ws_tprime) + ws * (kChunk * kChunk));
    const uint4* msrc =
        reinterpret_cast<const uint4*>(static_cast<const Op*>(plan.ws_masked_qk) + ws * (kChunk * kChunk));
#pragma unroll
    for (int u = 0; u < Regs::kT; ++u) {
      f.t[u] = __ldg(tsrc + tid + u * kThreads);
      f.m[u] = __ldg(msrc + tid + u * kThreads);
    }
    if (tid < kChunk) {
      const float* src = plan.ws_factors + ws * (kFactorRows<false> * kChunk);
      f.ek = src[kDecayRk * kChunk + tid];
      f.eq = src[kDecayRq * kChunk + tid];
      f.dd = src[kTailDecayRk * kChunk + tid];
      f.eg = src[kChunkDecay * kChunk + tid];
    }
#pragma unroll
    for (int u = 0; u < Regs::kRow; ++u) {
      const int it = tid + u * kThreads, row = it / (K / 8), cv = it % (K / 8);
      const int64_t tk = (t0 + row) * p.k.token_stride + hk * p.k.head_stride + cv * 8;
      const int64_t tq = (t0 + row) * p.q.token_stride + hk * p.q.head_stride + cv * 8;
      f.k[u] = row < L ? load8<Op>(p.k.data, p.k.dtype, tk, plan.qkv_vec) : make_uint4(0, 0, 0, 0);
      f.q[u] = row < L ? load8<Op>(p.q.data, p.q.dtype, tq, plan.qkv_vec) : make_uint4(0, 0, 0, 0);
    }
  }
  // ... then to shared memory.
  __device__ __forceinline__ void commit(const Regs& f) const {
#pragma unroll
    for (int u = 0; u < Regs::kV; ++u) {
      const int it = tid + u * kThreads, row = it / (VT / 8), cv = it % (VT / 8);
      *reinterpret_cast<uint4*>(&sm.vs[row * LDV + cv * 8]) = f.v[u];
    }
#pragma unroll
    for (int u = 0; u < Regs::kT; ++u) {
      const int it = tid + u * kThreads;
      *reinterpret_cast<uint4*>(&sm.ts[(it >> 3) * LDT + (it & 7) * 8]) = f.t[u];
      *reinterpret_cast<uint4*>(&sm.ms[(it >> 3) * LDT + (it & 7) * 8]) = f.m[u];
    }
    if (tid < kChunk) {
      sm.ek[tid] = f.ek;
      sm.eq[tid] = f.eq;
      sm.dd[tid] = f.dd;
      if (tid == 0) sm.eg = f.eg;
    }
#pragma unroll
    for (int u = 0; u < Regs::kRow; ++u) {
      const int it = tid + u * kThreads, row = it / (K / 8), cv = it % (K / 8);
      *reinterpret_cast<uint4*>(&sm.ks[row * LDK + cv * 8]) = f.k[u];
      *reinterpret_cast<uint4*>(&sm.qs[row * LDK + cv * 8]) = f.q[u];
    }
  }
  // S's operand-dtype copy sb, which k S and q S read.
  __device__ __forceinline__ void write_sb(const float (&s)[MT][NT][4]) const {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int k = krow0 + mt * 16 + r + half * 8;
          *reinterpret_cast<uint32_t*>(&sm.sb[k * LDV + nt * 8 + q2]) =
              pack2<Op>(s[mt][nt][2 * half], s[mt][nt][2 * half + 1]);
        }
  }
  // S to the slot at `offset` of a state buffer (the pool or the checkpoints) of dtype dt.
  __device__ __forceinline__ void store_state(const float (&s)[MT][NT][4], void* base, DType dt,
                                              int64_t offset) const {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int k = krow0 + mt * 16 + r + (e >> 1) * 8, v = v0 + nt * 8 + q2 + (e & 1);
          store_state_elem(base, dt, offset + state_offset(p.state.layout, h, k, v, K, V), s[mt][nt][e]);
        }
  }
  // float8_e4m3 K-last entries (docs/semantics.md "float8_e4m3 states"; heuristics.cpp fp8_states_in_place takes
  // them here for K >= 128): a warp's K / 4 rows are whole 32-row blocks, block bb its tiles mt = 2 bb, 2 bb + 1 over
  // the 8 lanes r of one q2, so a block's amax is a thread's four values of one column and three shuffles; a thread's
  // rows k and k + 8 of a tile share the block. S to the entry at element `offset` of base, its block scales at `scales` (its first block).
  __device__ __forceinline__ void store_state_e4m3(const float (&s)[MT][NT][4], uint8_t* base, uint8_t* scales,
                                                   int64_t offset) const {
    static_assert(K >= 128 && MT % 2 == 0, "whole blocks a warp");
    uint8_t* const head = base + offset + int64_t(h) * K * V;
    uint8_t* const head_scales = scales + int64_t(h) * (K * V / kFp8Block);
#pragma unroll
    for (int bb = 0; bb < MT / 2; ++bb)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int v = v0 + nt * 8 + q2 + c;
          uint32_t m = 0;
#pragma unroll
          for (int mm = 0; mm < 2; ++mm)
            m = max(m, max(abs_bits(s[2 * bb + mm][nt][c]), abs_bits(s[2 * bb + mm][nt][2 + c])));
          m = max(m, __shfl_xor_sync(0xffffffffu, m, 4));
          m = max(m, __shfl_xor_sync(0xffffffffu, m, 8));
          m = max(m, __shfl_xor_sync(0xffffffffu, m, 16));
          const Fp8Scale sc = e4m3_block_scale(m);
#pragma unroll
          for (int mm = 0; mm < 2; ++mm) {
            const uint32_t pair = e4m3x2(s[2 * bb + mm][nt][c], s[2 * bb + mm][nt][2 + c], sc);  // rows k, k + 8
            uint8_t* const col = head + int64_t(v) * K + krow0 + (2 * bb + mm) * 16 + r;
            col[0] = uint8_t(pair);
            col[8] = uint8_t(pair >> 8);
          }
          if (r == 0) head_scales[v * (K / kFp8Block) + (krow0 + 32 * bb) / kFp8Block] = uint8_t(sc.byte);
        }
  }
  // S <- the float8_e4m3 K-last slot at `slot` (its first byte), its block scales at `scales` (its first block).
  __device__ __forceinline__ void load_state_e4m3(float (&s)[MT][NT][4], const uint8_t* slot,
                                                  const uint8_t* scales) const {
    const uint8_t* const head = slot + int64_t(h) * K * V;
    const uint8_t* const head_scales = scales + int64_t(h) * (K * V / kFp8Block);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int v = v0 + nt * 8 + q2 + c, k = krow0 + mt * 16 + r;
          const uint8_t* const col = head + int64_t(v) * K + k;
          const float2 f = e4m3x2_to_float2(uint32_t(col[0]) | (uint32_t(col[8]) << 8),
                                            e8m0_scale(head_scales[v * (K / kFp8Block) + k / kFp8Block]));
          s[mt][nt][c] = f.x, s[mt][nt][2 + c] = f.y;
        }
  }
  // ---- P = k S, O = q S for the warp's 16 tokens (rows i0, i1 of this thread); X = v - D rk P (in place);
  // O *= D rq
  __device__ __forceinline__ void pq_and_x(float (&o)[NT][4], float (&pk)[NT][4], int i0, int i1) const {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) pk[nt][e] = o[nt][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < K; kk += 16) {
      uint32_t ak[4], aq[4];
      ldmatrix_x4(ak, a_frag_ptr<LDK>(sm.ks, warp * 16, kk, lane));
      ldmatrix_x4(aq, a_frag_ptr<LDK>(sm.qs, warp * 16, kk, lane));
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, bk_frag_ptr<LDV>(sm.sb, kk, np * 16, lane));
        mma<Op>(pk[2 * np], ak, b[0], b[1]);
        mma<Op>(pk[2 * np + 1], ak, b[2], b[3]);
        mma<Op>(o[2 * np], aq, b[0], b[1]);
        mma<Op>(o[2 * np + 1], aq, b[2], b[3]);
      }
    }
    const float ek0 = sm.ek[i0], ek1 = sm.ek[i1];
    const float eq0 = sm.eq[i0], eq1 = sm.eq[i1];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int col = nt * 8 + q2;
      uint32_t* x0 = reinterpret_cast<uint32_t*>(&sm.vs[i0 * LDV + col]);
      uint32_t* x1 = reinterpret_cast<uint32_t*>(&sm.vs[i1 * LDV + col]);
      const float2 v0f = unpack2<Op>(*x0), v1f = unpack2<Op>(*x1);
      *x0 = pack2<Op>(v0f.x - ek0 * pk[nt][0], v0f.y - ek0 * pk[nt][1]);
      *x1 = pack2<Op>(v1f.x - ek1 * pk[nt][2], v1f.y - ek1 * pk[nt][3]);
      o[nt][0] *= eq0;
      o[nt][1] *= eq0;
      o[nt][2] *= eq1;
      o[nt][3] *= eq1;
    }
  }

  // ---- v_new = T' X (T' lower triangular: k-tiles 0..warp); also the decayed copy for the update
  __device__ __forceinline__ void new_values(float (&vn)[NT][4], int i0, int i1) const {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) vn[nt][0] = vn[nt][1] = vn[nt][2] = vn[nt][3] = 0.0f;
    causal_rows_mma<Op, LDT, LDV>(vn, sm.ts, sm.vs, warp, lane);
    const float dd0 = sm.dd[i0], dd1 = sm.dd[i1];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int col = nt * 8 + q2;
      *reinterpret_cast<uint32_t*>(&sm.vn[i0 * LDV + col]) = pack2<Op>(vn[nt][0], vn[nt][1]);
      *reinterpret_cast<uint32_t*>(&sm.vn[i1 * LDV + col]) = pack2<Op>(vn[nt][2], vn[nt][3]);
      *reinterpret_cast<uint32_t*>(&sm.vd[i0 * LDV + col]) = pack2<Op>(vn[nt][0] * dd0, vn[nt][1] * dd0);
      *reinterpret_cast<uint32_t*>(&sm.vd[i1 * LDV + col]) = pack2<Op>(vn[nt][2] * dd1, vn[nt][3] * dd1);
    }
  }

  // ---- o += M v_new, store the valid rows of the chunk at token t0
  __device__ __forceinline__ void output(float (&o)[NT][4], int64_t t0, int L, int i0, int i1) const {
    causal_rows_mma<Op, LDT, LDV>(o, sm.ms, sm.vn, warp, lane);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int col = v0 + nt * 8 + q2;
      if (i0 < L)
        store_pair(p.o.data, p.o.dtype, (t0 + i0) * p.o.token_stride + h * p.o.head_stride + col, o[nt][0], o[nt][1],
                   plan.o_pair);
      if (i1 < L)
        store_pair(p.o.data, p.o.dtype, (t0 + i1) * p.o.token_stride + h * p.o.head_stride + col, o[nt][2], o[nt][3],
                   plan.o_pair);
    }
  }

  // ---- S = exp(g_last) S + k^T vd   (A = k^T via transposed ldmatrix of the raw k rows)
  __device__ __forceinline__ void update_state(float (&s)[MT][NT][4], int L) const {
    const float eg = sm.eg;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] *= eg;
#pragma unroll
    for (int kt = 0; kt < 4; ++kt) {
      if (kt * 16 < L) {
        uint32_t b[NT / 2][4];
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) ldmatrix_x4_trans(b[np], bk_frag_ptr<LDV>(sm.vd, kt * 16, np * 16, lane));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          uint32_t a[4];
          ldmatrix_x4_trans(a, at_frag_ptr<LDK>(sm.ks, kt * 16, krow0 + mt * 16, lane));
#pragma unroll
          for (int np = 0; np < NT / 2; ++np) {
            mma<Op>(s[mt][2 * np], a, b[np][0], b[np][1]);
            mma<Op>(s[mt][2 * np + 1], a, b[np][2], b[np][3]);
          }
        }
      }
    }
  }
};

// kPrefetch: the loads of chunk c+1 are issued right after chunk c reached shared memory, so their
// latency hides behind chunk c's math (only for the narrow value tile: the loads in flight hold registers).
template <int K, int VT, class Op>
__global__ void __launch_bounds__(kThreads) state_pass_kernel(const PrefillParams p, const Plan plan) {
  constexpr bool kPrefetch = VT == 16 && K <= 128;
  using Pass = TiledStatePass<K, VT, Op>;
  constexpr int MT = Pass::MT, NT = Pass::NT;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  typename Pass::Smem& sm = *reinterpret_cast<typename Pass::Smem*>(smem_raw);

  // Flat grid, value tile fastest, then head: the CTAs that share a chunk's q/k rows (the value tiles
  // of one head, the heads of one GVA group) run together and find them in L2.
  const int HV = p.heads.num_v_heads, V = p.heads.head_dim_v, tiles = V / VT;
  const int vt = int(blockIdx.x % unsigned(tiles)), h = int(blockIdx.x / unsigned(tiles) % unsigned(HV));
  const int n = int(blockIdx.x / unsigned(tiles * HV)), v0 = vt * VT;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int r = lane >> 2, q2 = (lane & 3) * 2;
  const int hk = h / (HV / p.heads.num_qk_heads);
  SeqSlots sq;
  if (!begin_sequence<kThreads>(p, plan, n, h, v0, VT, h == 0 && vt == 0, sq)) return;
  const int64_t start = sq.start, len = sq.len;
  const int islot = sq.islot, fslot = sq.fslot, cslot = sq.cslot;

  // The S tile in registers (TiledStatePass)
  const int krow0 = warp * (K / 4);
  float s[MT][NT][4];
  const int64_t ibase = int64_t(islot) * p.state.slot_stride;
  const Pass pass{p, plan, sm, HV, V, h, hk, v0, tid, warp, lane, r, q2, krow0, start, len};
  // float8_e4m3 pools and checkpoints: K-last, K >= 128 (heuristics.cpp fp8_states_in_place)
  constexpr bool kFp8Built = K >= 128;
  const int64_t slot_blocks = int64_t(HV) * K * V / kFp8Block;
  if (kFp8Built && islot >= 0 && p.state.dtype == DType::kFloat8E4M3) {
    if constexpr (kFp8Built)
      pass.load_state_e4m3(s, static_cast<const uint8_t*>(p.state.data) + ibase, p.state.scales + islot * slot_blocks);
  } else {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int k = krow0 + mt * 16 + r + (e >> 1) * 8, v = v0 + nt * 8 + q2 + (e & 1);
          s[mt][nt][e] = islot >= 0 ? load_state_elem(p.state.data, p.state.dtype,
                                                      ibase + state_offset(p.state.layout, h, k, v, K, V))
                                    : 0.0f;
        }
  }

  const int64_t nchunks = (len + kChunk - 1) / kChunk;
  const int64_t slot0 = start / kChunk + n;
  const int64_t C = p.checkpoint_interval;

  typename Pass::Regs f;  // the chunk inputs on their way to shared memory
  if (kPrefetch && nchunks > 0) pass.fetch(f, 0, slot0);

  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t t0 = start + c * kChunk;
    const int L = int(min(int64_t(kChunk), len - c * kChunk));

    // ---- the chunk's inputs to shared memory (with kPrefetch, fetched while the previous chunk
    // computed)
    if constexpr (!kPrefetch) pass.fetch(f, c, slot0);
    pass.commit(f);
    if (c == 0) pass.write_sb(s);  // after the first chunk's loads were issued: the state load overlaps them
    __syncthreads();
    if constexpr (kPrefetch) {
      if (c + 1 < nchunks) pass.fetch(f, c + 1, slot0);
    }

    const int i0 = warp * 16 + r, i1 = i0 + 8;  // this thread's two token rows in the warp's m16 tile
    float o[NT][4];
    {
      float pk[NT][4];
      pass.pq_and_x(o, pk, i0, i1);
    }
    __syncthreads();
    {
      float vn[NT][4];
      pass.new_values(vn, i0, i1);
    }
    __syncthreads();
    pass.output(o, t0, L, i0, i1);
    pass.update_state(s, L);
    pass.write_sb(s);  // every warp passed the last read of sb (before the previous barrier)

    // ---- checkpoint: entry j holds the state after token (j+1)*C, for j < min(steps, len / C)
    if (cslot >= 0) {
      const int64_t done = (c + 1) * kChunk;
      if (done % C == 0 && done <= len && done / C - 1 < p.checkpoints.num_steps) {
        const int64_t j = done / C - 1;
        const int64_t entry = int64_t(cslot) * p.checkpoints.slot_stride + j * (int64_t(HV) * K * V);
        if (kFp8Built && p.checkpoints.dtype == DType::kFloat8E4M3) {
          if constexpr (kFp8Built)
            pass.store_state_e4m3(s, static_cast<uint8_t*>(p.checkpoints.data),
                                  p.checkpoints.scales + (int64_t(cslot) * p.checkpoints.num_steps + j) * slot_blocks,
                                  entry);
        } else {
          pass.store_state(s, p.checkpoints.data, p.checkpoints.dtype, entry);
        }
      }
    }
    __syncthreads();  // the next chunk overwrites ks, qs, vs, ts, ms, vn, vd, gc
  }

  if (fslot >= 0) {
    const int64_t fbase = int64_t(fslot) * p.state.slot_stride;
    if (kFp8Built && p.state.dtype == DType::kFloat8E4M3) {
      if constexpr (kFp8Built)
        pass.store_state_e4m3(s, static_cast<uint8_t*>(p.state.data), p.state.scales + fslot * slot_blocks, fbase);
    } else {
      pass.store_state(s, p.state.data, p.state.dtype, fbase);
    }
  }
}

}  // namespace gdnkit::cuda::chunked_prefill
