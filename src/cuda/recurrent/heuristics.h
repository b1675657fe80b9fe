// Which kernel runs a decode, verify, commit-by-recompute or short-prefill call, and whether its grid
// launches in prefetch mode: pure host code (no CUDA headers), a function of the call, of each candidate
// kernel's grid and residency on the device, and of the overrides. The CPU suite tests it; dispatch.cu
// launches what it returns. docs/design/decode.md explains each rule.
#pragma once

#include <cstdint>

#include "cuda/host/overrides.h"
#include "gdnkit/types.h"

namespace gdnkit::cuda::recurrent {

enum class RecurrentOp : int32_t {
  kDecode = 0,     // one token per sequence (token b), o, state written back
  kVerify = 1,     // T tokens (fixed or varlen, chain or tree): o per token, intermediate states when asked
  kRecompute = 2,  // commit by recompute: the kept tokens again (no q, no o), the state stored
  kPrefill = 3,    // prefill's short sequences (prefill/short_sequence.h): a chain from the initial slot
                   // (or zero) to the final slot (when one), o per token
};

enum class RecurrentKernel {
  kWarpRegular,  // warp_recurrent_kernel, regular tile (warp_tile.cuh)
  kWarpPinned,   // ... regular tile, the slot index loaded first (fp32 K-last decode in prefetch mode)
  kWarpWide,     // ... wide tile: bf16 K-last decode, K = 128, grids in prefetch mode
  kWarpNarrow,   // ... narrow tile: bf16 K-last decode, K = 128, small grids outside prefetch mode
  kWarpSolo,     // ... one-warp CTAs: K-last decode, K = 128, grids past prefetch mode (16-bit pools: the wide tile)
  kVLastDecode,  // vlast_decode_kernel (vlast_decode.cuh)
  kMmaDecode,    // mma_decode_kernel: K-last 16-bit state (bf16: bf16 inputs; fp16: fp16 or bf16), tensor cores
  kMmaDecodeTf32,  // ... its tf32 steps: fp16 state with bf16 inputs
  kChainMma,     // chain_mma_kernel: K-last chains of bf16 inputs on tensor cores
  kFp8Chain,     // fp8_chain_kernel: verify of chains on K-last float8_e4m3 pools, an fp8 cache (none: below the
                 // tensor-core form's batches, or where that form is off)
  kFp8ChainMma,  // fp8_chain_mma_kernel: ... without a cache, on tensor cores
  kVLastChain,   // vlast_chain_kernel: verify of chains on V-last pools, a cache of the state's dtype (fp32 too) or none
};
const char* kernel_name(RecurrentKernel k);

// Columns per warp of the fp8 decode kernel (fp8_decode.cuh: 8, 16, or 32 at K = 128) for a call of `batch`
// sequences of `num_v_heads` value heads: few columns where the grid is small (each warp's chain is the time), many
// where it is large (a warp's fixed work, k and q and the gates, is shared by more columns, and more bytes are in
// flight per SM).
int fp8_decode_columns(int64_t batch, int num_v_heads, int head_dim_k, const Overrides& o);

// Prefetch mode of K-last fp8 decode (fp8_decode.cuh) for a grid of `grid_ctas` CTAs: every grid. A small grid's
// state latency is the call; past a wave the next call's first CTAs ask L2 for their state during this call's last
// wave, which computes with the memory otherwise idle (docs/design/decode.md "fp8 pools").
bool fp8_decode_prefetch(int64_t grid_ctas, const Overrides& o);

// Columns per CTA of V-last fp8 decode (vlast_decode.cuh: 128, a line of each row, or 64, half of one) for a call
// of `batch` sequences: 64 where the 128-column grid is at most 2 CTAs per SM (each CTA's walk over its rows is the
// time there), else 128 (more bytes in flight per SM).
int vlast_fp8_decode_columns(int64_t batch, int num_v_heads, int head_dim_v, int num_sms, const Overrides& o);

// The facts of a call the choice depends on.
struct RecurrentCall {
  RecurrentOp op = RecurrentOp::kDecode;
  StateLayout layout = StateLayout::kKLast;
  DType state_dtype = DType::kFloat32;
  DType input_dtype = DType::kFloat32;  // q, k, v
  int head_dim_k = 128, head_dim_v = 128;
  int64_t batch = 0;
  int num_v_heads = 32;      // HV
  int num_draft_tokens = 1;  // T (prefill: the longest sequence the path takes)
  bool tree = false;         // verify with parent indices
  bool caches_states = false;  // verify stores intermediate states
  DType cache_dtype = DType::kFloat32;  // ... in this dtype
};

// A candidate kernel's grid for this call (CTAs) and the CTAs of it the device holds at once (occupancy
// times SMs); grid_ctas 0: the kernel is not built for the call.
struct KernelFit {
  int64_t grid_ctas = 0;
  int64_t resident_ctas = 0;
};
struct Candidates {
  KernelFit regular, wide, narrow, vlast_decode, mma_decode, mma_decode_tf32, chain_mma, fp8_chain, fp8_chain_mma,
      vlast_chain;
};

struct RecurrentChoice {
  RecurrentKernel kernel = RecurrentKernel::kWarpRegular;
  bool prefetch = false;  // loads the slot index and prefetches the state before griddepcontrol.wait
};

// Which kernels exist for a call (the template conditions of dispatch.cu, as values).
bool chain_mma_built(const RecurrentCall& c);
bool mma_decode_built(const RecurrentCall& c);
bool mma_decode_tf32_built(const RecurrentCall& c);  // fp16 state with bf16 inputs
bool vlast_decode_built(const RecurrentCall& c);
bool tile_widths_built(const RecurrentCall& c);  // the wide, narrow and solo tiles, and the pinned slot
bool fp8_chain_built(const RecurrentCall& c);
bool vlast_chain_built(const RecurrentCall& c);

// The largest grid in prefetch mode: resident / share, share 2 so that this grid and the next of its size
// are resident together (1 where the next needs only to start beside this one; 8 for the regular tile with
// bf16 K-last decode, whose small grids run the wide or tensor-core kernels instead).
int prefetch_share(const RecurrentCall& c, RecurrentKernel k);
bool prefetch_mode(const KernelFit& fit, int share, const Overrides& o);

RecurrentChoice choose_recurrent_kernel(const RecurrentCall& c, const Candidates& k, const Overrides& o);

// What the calling thread's last recurrent call chose to launch (kernel, prefetch mode, columns), written by the
// launchers before they enqueue it, so that the GPU tests can check that a forced choice took effect; graph replays
// do not update it, and nothing on the library's paths reads it.
inline constexpr char kFp8DecodeKernel[] = "fp8 decode";  // K-last float8_e4m3 decode (fp8_decode.cuh)
struct RecurrentLaunch {
  const char* kernel = "";  // kernel_name, or kFp8DecodeKernel
  bool prefetch = false;
  int columns = 0;  // float8_e4m3 decode: columns per warp (K-last) or per CTA (V-last)
};
RecurrentLaunch& last_recurrent_launch();

}  // namespace gdnkit::cuda::recurrent
