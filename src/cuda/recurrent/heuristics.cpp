// The recurrent ops' kernel choice (heuristics.h). The thresholds are measurements on the qwen3-next heads (H100;
// the fp8 kernels' H200), those that count the batch's value heads (B HV) checked at HV = 8 too;
// docs/design/decode.md gives them.
#include "cuda/recurrent/heuristics.h"

namespace gdnkit::cuda::recurrent {
namespace {

constexpr int kChainMinTokens = 3;      // the chain kernel from T = 3 (T = 2 is faster on the warp kernel)
constexpr int kWideMaxBatch = 12;       // the wide tile for B = 2..12 in prefetch mode
constexpr int kNarrowMaxBatch = 16;     // the narrow tile for B = 3..16 outside prefetch mode
constexpr int kSoloMinBatch = 8;        // decode in one-warp CTAs from B = 8 outside prefetch mode (fp32 pools)
constexpr int64_t kSolo16MinHeads = 400;  // ... 16-bit pools from 400 heads, B HV (HV = 32: B = 13; HV = 8: B = 50)
// One-warp CTAs in prefetch mode (the next call's first CTAs ask L2 for their state during this call's last wave):
// 16-bit pools always, fp32 pools from 1024 heads (HV = 32: B = 32; at B = 8 and 16 slower).
constexpr int64_t kSolo32PrefetchMinHeads = 1024;
// The verify kernels' boundaries count value heads of the batch, B HV (their grids' size; H200, T = 4, set at HV = 32
// and measured again at HV = 8: docs/design/decode.md "How the kernel is chosen").
constexpr int64_t kFp8ChainMinHeads = 48;  // fp8 chain verify on its kernel from 48 heads (HV = 32: B = 2, HV = 8: 6)
constexpr int kFp8ChainMmaMinBatch = 3;    // ... without a cache on tensor cores from B = 3 (HV = 8 and 32 measured)
// V-last chain verify on its kernel from these heads, by pool dtype, with a cache / without one (0: never;
// docs/design/decode.md "Verify of chains on V-last pools"): fp8 192 / 1024 (HV = 32: B = 6 / 32), fp32 (an fp32 cache)
// any / never, bf16 and fp16 (an fp32 cache) never / 512 (HV = 32: B = 16).
int64_t vlast_chain_min_heads(const RecurrentCall& c) {
  switch (c.state_dtype) {
    case DType::kFloat8E4M3: return c.caches_states ? 192 : 1024;
    case DType::kFloat32: return c.caches_states ? 1 : 0;
    default: return c.caches_states ? 0 : 512;
  }
}

// An A/B override in sequences (>= 0: from that batch, 0 never) or the rule in heads (0: never).
bool from_batch_or_heads(int override_min_batch, int64_t min_heads, const RecurrentCall& c) {
  if (override_min_batch >= 0) return override_min_batch > 0 && c.batch >= override_min_batch;
  return min_heads > 0 && c.batch * c.num_v_heads >= min_heads;
}

bool klast_decode_k128(const RecurrentCall& c) {
  return c.layout == StateLayout::kKLast && c.op == RecurrentOp::kDecode && c.head_dim_k == 128;
}

int or_default(int override_value, int fallback) { return override_value >= 0 ? override_value : fallback; }

}  // namespace

const char* kernel_name(RecurrentKernel k) {
  switch (k) {
    case RecurrentKernel::kWarpRegular: return "warp (regular tile)";
    case RecurrentKernel::kWarpPinned: return "warp (regular tile, pinned slot)";
    case RecurrentKernel::kWarpWide: return "warp (wide tile)";
    case RecurrentKernel::kWarpNarrow: return "warp (narrow tile)";
    case RecurrentKernel::kWarpSolo: return "warp (one-warp CTAs)";
    case RecurrentKernel::kVLastDecode: return "V-last decode";
    case RecurrentKernel::kMmaDecode: return "tensor-core decode";
    case RecurrentKernel::kMmaDecodeTf32: return "tensor-core decode (tf32)";
    case RecurrentKernel::kChainMma: return "tensor-core chain";
    case RecurrentKernel::kFp8Chain: return "fp8 chain";
    case RecurrentKernel::kFp8ChainMma: return "fp8 chain (tensor cores)";
    case RecurrentKernel::kVLastChain: return "V-last chain";
  }
  return "?";
}

// fp8 decode widths (docs/design/decode.md "fp8 pools"), by value heads of the batch, B HV: 8 columns per warp where a
// tiny grid needs the warps (K = 64 up to 256 heads, K = 256 up to 64; measured at HV = 32 only); at K = 128 16, and 32
// from kFp8WideMinHeads (a warp's fixed work shared by more columns; HV = 32: B = 12, HV = 8: B = 48).
constexpr int64_t kFp8NarrowMaxHeadsK64 = 256, kFp8NarrowMaxHeadsK256 = 64;
constexpr int64_t kFp8WideMinHeads = 384;

int fp8_decode_columns(int64_t batch, int num_v_heads, int head_dim_k, const Overrides& o) {
  const bool wide_built = head_dim_k == 128;
  if (o.decode_fp8_columns == 8 || o.decode_fp8_columns == 16 || (o.decode_fp8_columns == 32 && wide_built))
    return o.decode_fp8_columns;
  const int64_t heads = batch * num_v_heads;
  if (wide_built) return heads >= kFp8WideMinHeads ? 32 : 16;
  return heads <= (head_dim_k == 64 ? kFp8NarrowMaxHeadsK64 : kFp8NarrowMaxHeadsK256) ? 8 : 16;
}

bool fp8_decode_prefetch(int64_t grid_ctas, const Overrides& o) { return o.state_prefetch && grid_ctas > 0; }

// V-last fp8 decode in half-line CTAs up to this many line CTAs per SM (docs/design/decode.md "V-last decode").
constexpr int64_t kVLastFp8HalfMaxCtasPerSm = 2;

int vlast_fp8_decode_columns(int64_t batch, int num_v_heads, int head_dim_v, int num_sms, const Overrides& o) {
  if (o.decode_vlast_fp8_columns == 64 || o.decode_vlast_fp8_columns == 128) return o.decode_vlast_fp8_columns;
  const int64_t line_ctas = batch * num_v_heads * (head_dim_v / 128);
  return line_ctas <= kVLastFp8HalfMaxCtasPerSm * int64_t(num_sms) ? 64 : 128;
}

bool chain_mma_built(const RecurrentCall& c) {
  return c.layout == StateLayout::kKLast && c.input_dtype == DType::kBFloat16 && c.head_dim_k <= 128 &&
         c.op != RecurrentOp::kDecode && c.state_dtype != DType::kFloat8E4M3;
}

bool mma_decode_built(const RecurrentCall& c) {
  const bool types = (c.state_dtype == DType::kBFloat16 && c.input_dtype == DType::kBFloat16) ||
                     (c.state_dtype == DType::kFloat16 &&
                      (c.input_dtype == DType::kFloat16 || c.input_dtype == DType::kBFloat16));
  return c.layout == StateLayout::kKLast && c.op == RecurrentOp::kDecode && types && c.head_dim_k <= 128 &&
         c.head_dim_v % 64 == 0;
}

bool mma_decode_tf32_built(const RecurrentCall& c) {
  return mma_decode_built(c) && c.state_dtype == DType::kFloat16 && c.input_dtype == DType::kBFloat16;
}

bool vlast_decode_built(const RecurrentCall& c) {
  return c.layout == StateLayout::kVLast && c.op == RecurrentOp::kDecode && c.head_dim_k <= 128;
}

bool tile_widths_built(const RecurrentCall& c) { return klast_decode_k128(c); }

bool fp8_chain_built(const RecurrentCall& c) {
  const bool inputs = c.input_dtype == DType::kBFloat16 || c.input_dtype == DType::kFloat16;
  const bool cache = !c.caches_states || c.cache_dtype == DType::kFloat8E4M3;
  return c.layout == StateLayout::kKLast && c.state_dtype == DType::kFloat8E4M3 && c.op == RecurrentOp::kVerify &&
         !c.tree && cache && inputs && (c.head_dim_k == 64 || c.head_dim_k == 128) && c.head_dim_v == c.head_dim_k;
}

bool vlast_chain_built(const RecurrentCall& c) {
  const bool inputs = c.input_dtype == DType::kBFloat16 || c.input_dtype == DType::kFloat16;
  // fp8 states: an fp8 cache; the others: a cache of their dtype or fp32
  const bool fp8 = c.state_dtype == DType::kFloat8E4M3;
  const bool cache = !c.caches_states || c.cache_dtype == c.state_dtype || (!fp8 && c.cache_dtype == DType::kFloat32);
  return c.layout == StateLayout::kVLast && c.op == RecurrentOp::kVerify && !c.tree && cache && inputs &&
         (c.head_dim_k == 64 || c.head_dim_k == 128) && c.head_dim_v == c.head_dim_k;
}

int prefetch_share(const RecurrentCall& c, RecurrentKernel k) {
  switch (k) {
    case RecurrentKernel::kWarpWide:
    case RecurrentKernel::kVLastDecode:
    case RecurrentKernel::kMmaDecode:
    case RecurrentKernel::kMmaDecodeTf32: return 1;
    case RecurrentKernel::kWarpRegular:
    case RecurrentKernel::kWarpPinned:
      return c.layout == StateLayout::kKLast && c.op == RecurrentOp::kDecode && dtype_size(c.state_dtype) == 2 ? 8
                                                                                                                 : 2;
    default: return 2;
  }
}

bool prefetch_mode(const KernelFit& fit, int share, const Overrides& o) {
  return o.state_prefetch && fit.grid_ctas > 0 && fit.grid_ctas <= fit.resident_ctas / share;
}

RecurrentLaunch& last_recurrent_launch() {
  thread_local RecurrentLaunch last;  // per thread: callers may drive several GPUs at once
  return last;
}

RecurrentChoice choose_recurrent_kernel(const RecurrentCall& c, const Candidates& k, const Overrides& o) {
  using K = RecurrentKernel;
  auto take = [&](K kernel, const KernelFit& fit) {
    return RecurrentChoice{kernel, prefetch_mode(fit, prefetch_share(c, kernel), o)};
  };
  // Chains on tensor cores: any recompute or short prefill, and verify of a chain that caches nothing.
  if (chain_mma_built(c) && k.chain_mma.grid_ctas > 0) {
    const int min_tokens = o.chain_mma_min_tokens == 0 ? -1 : or_default(o.chain_mma_min_tokens, kChainMinTokens);
    const bool chain = c.op == RecurrentOp::kRecompute || c.op == RecurrentOp::kPrefill || (!c.tree && !c.caches_states);
    if (min_tokens > 0 && c.num_draft_tokens >= min_tokens && chain) return take(K::kChainMma, k.chain_mma);
  }
  // Verify of chains on float8_e4m3 pools from 48 heads: 16 columns a warp share the token's fixed work (fewer heads:
  // the warp kernel's twice as many warps, each a shorter chain); without a cache on tensor cores from B = 3 at any
  // HV (with one, the CUDA-core kernel measured faster: docs/design/decode.md "fp8 pools").
  if (fp8_chain_built(c) && k.fp8_chain.grid_ctas > 0) {
    const bool mma = !c.caches_states && o.verify_fp8_chain_mma && k.fp8_chain_mma.grid_ctas > 0 &&
                     c.batch >= kFp8ChainMmaMinBatch;
    const bool chain = from_batch_or_heads(o.verify_fp8_chain_min_batch, kFp8ChainMinHeads, c) ||
                       (o.verify_fp8_chain_min_batch < 0 && mma);
    if (chain) return RecurrentChoice{mma ? K::kFp8ChainMma : K::kFp8Chain, false};
  }
  // Verify of chains on V-last pools on their chain kernel (whole 16-byte row pieces a lane, one barrier a token; the
  // warp kernel's V-last tile moves 32-byte pieces through shared memory) from the heads above (K = 128).
  if (vlast_chain_built(c) && k.vlast_chain.grid_ctas > 0 &&
      from_batch_or_heads(o.verify_vlast_chain_min_batch, vlast_chain_min_heads(c), c))
    return RecurrentChoice{K::kVLastChain, false};
  // 16-bit decode on tensor cores where this grid and the next fit the GPU together (fp16 state with bf16 inputs: the
  // tf32 steps, with fewer warps per SM, where they fit so, else the inputs scaled to fp16).
  if (mma_decode_tf32_built(c) && o.decode_mma && o.decode_mma_tf32 && k.mma_decode_tf32.grid_ctas > 0 &&
      2 * k.mma_decode_tf32.grid_ctas <= k.mma_decode_tf32.resident_ctas && prefetch_mode(k.mma_decode_tf32, 1, o))
    return take(K::kMmaDecodeTf32, k.mma_decode_tf32);
  if (mma_decode_built(c) && o.decode_mma && k.mma_decode.grid_ctas > 0 &&
      2 * k.mma_decode.grid_ctas <= k.mma_decode.resident_ctas && prefetch_mode(k.mma_decode, 1, o))
    return take(K::kMmaDecode, k.mma_decode);
  if (vlast_decode_built(c)) return take(K::kVLastDecode, k.vlast_decode);
  if (tile_widths_built(c)) {
    const bool regular_prefetch = prefetch_mode(k.regular, prefetch_share(c, K::kWarpRegular), o);
    const int solo_min = or_default(o.decode_solo_min_batch, kSoloMinBatch);
    const bool solo = solo_min > 0 && c.batch >= solo_min;  // one-warp CTAs, outside prefetch mode
    if (dtype_size(c.state_dtype) == 2) {  // 16-bit pools (the limits measured on bf16)
      if (c.batch >= 2 && c.batch <= or_default(o.decode_wide_max_batch, kWideMaxBatch) &&
          prefetch_mode(k.wide, 1, o))
        return take(K::kWarpWide, k.wide);
      if (from_batch_or_heads(o.decode_solo_min_batch, kSolo16MinHeads, c))
        return RecurrentChoice{K::kWarpSolo, o.state_prefetch};
      if (c.batch >= 3 && c.batch <= or_default(o.decode_narrow_max_batch, kNarrowMaxBatch) && !regular_prefetch &&
          k.narrow.grid_ctas > 0)
        return RecurrentChoice{K::kWarpNarrow, false};
    } else if (regular_prefetch) {
      return RecurrentChoice{K::kWarpPinned, true};
    } else if (solo) {
      return RecurrentChoice{K::kWarpSolo, o.state_prefetch && c.batch * c.num_v_heads >= kSolo32PrefetchMinHeads};
    }
  }
  return take(K::kWarpRegular, k.regular);
}

}  // namespace gdnkit::cuda::recurrent
