// The CUDA prefill's choices (heuristics.h). The thresholds are H100 and H200 measurements on the qwen3-next heads;
// docs/design/prefill.md gives them.
#include "cuda/prefill/heuristics.h"

#include <algorithm>
#include <string>

#include "cuda/prefill/item_order.h"
#include "cuda/prefill/short_sequence.h"

namespace gdnkit::cuda::chunked_prefill {
namespace {

bool aligned(const void* ptr, size_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

// 16-byte loads of 8 contiguous elements need the base and both strides in whole 16-byte units.
template <class View>
bool vec_ok(const View& v) {
  const int64_t per = 16 / dtype_size(v.dtype);
  return aligned(v.data, 16) && v.token_stride % per == 0 && v.head_stride % per == 0;
}

// The prep warpgroup that forms M, wherever it can run (unless overridden): on long sequences its work overlaps the
// chain, and on short ones its build brings the pool's states by bulk copies (a producer warpgroup issues them), which
// the per-thread loads of the build without it wait behind (prefill.md "Short sequences on the chunked kernels").
bool m_warpgroup_wanted(const Overrides& o) { return o.prefill_m_warpgroup != 0; }
// The head pass waits for each chunk's flag beside the prep warpgroup up to this mean sequence length: a memset
// before the prep and the producer's polling cost more than the overlap gains on long sequences (8x8192 1% slower),
// and the head split's one-wave grids gain nothing (their other sequences' first chunks come late in the prep's
// slot order: tp8 8x1024 and 4x2048 3-4% slower).
constexpr int64_t kChunkFlagsMaxTokens = 2048;
// The state pass launches behind the chunk prep with PDL while the grid is at most this many CTAs per SM:
// with many short CTAs each one's wait costs more than the overlap saves.
constexpr int kEarlyPassMaxCtasPerSm = 4;

constexpr int32_t kMaxGridY = 65535;
// Without a host copy of cu_seqlens, the short path's grid may cover every sequence while at most this many
// (sequence, value head) rows per SM: its CTAs of long sequences exit at once, a few microseconds in all.
constexpr int kShortSkipRowsPerSm = 16;  // CUDA's limit on gridDim.y: the short path has one row per sequence

bool has_checkpoints(const PrefillParams& p) {
  return p.checkpoint_interval > 0 && p.checkpoints.data != nullptr && p.checkpoint_indices != nullptr;
}

}  // namespace

bool vtile_supported(int K, int vtile) {
  return vtile == 16 || vtile == 32 || (vtile == 64 && K <= 128) || (is_head_tile(vtile) && K <= 128);
}

bool head_split_supported(int V, int split) { return split == 1 || (split == 2 && V / 2 >= 32); }

bool qkv_vectorized(const PrefillParams& p) { return vec_ok(p.q) && vec_ok(p.k) && vec_ok(p.v); }

namespace {
// A state buffer whose head slices (and float8_e4m3 block scales) start on 16-byte boundaries, and whose pieces a CTA
// holds are contiguous: a K-last CTA's value rows, a V-last CTA's rows only where it holds every column.
bool bulk_buffer(StateLayout layout, const void* data, int64_t slot_stride, DType dt, const uint8_t* scales,
                 int head_split) {
  return (layout == StateLayout::kKLast || head_split == 1) && aligned(data, 16) &&
         slot_stride * dtype_size(dt) % 16 == 0 && (dt != DType::kFloat8E4M3 || aligned(scales, 16));
}
}  // namespace

bool state_bulk_copies(const PrefillParams& p, int head_split) {
  const StatePool& s = p.state;
  return bulk_buffer(s.layout, s.data, s.slot_stride, s.dtype, s.scales, head_split);
}

bool checkpoint_bulk_copies(const PrefillParams& p, int head_split) {
  const StateCache& c = p.checkpoints;
  return c.data != nullptr && c.layout == p.state.layout &&
         bulk_buffer(c.layout, c.data, c.slot_stride, c.dtype, c.scales, head_split);
}

bool head_pass_ok(const PrefillParams& p) {
  const int K = p.heads.head_dim_k, V = p.heads.head_dim_v;
  const DType dt = p.q.dtype;
  return K <= 128 && (V == 64 || V == 128) && (dt == DType::kBFloat16 || dt == DType::kFloat16) &&
         p.k.dtype == dt && p.v.dtype == dt && p.o.dtype == dt && vec_ok(p.q) && vec_ok(p.k) && vec_ok(p.v) &&
         vec_ok(p.o);
}

bool short_path_supported(const PrefillParams& p) {
  const int K = p.heads.head_dim_k;
  const int64_t slot_bytes = p.state.slot_stride * dtype_size(p.state.dtype);
  return head_pass_ok(p) && K == p.heads.head_dim_v && (K == 64 || K == 128) && aligned(p.state.data, 16) &&
         slot_bytes % 16 == 0 && p.num_seqs > 0 && p.num_seqs <= kMaxGridY && p.heads.num_v_heads > 0;
}

StateLayout states_layout(const PrefillParams& p) {
  return p.state.data != nullptr ? p.state.layout : p.checkpoints.layout;
}

bool fp8_states_in_place(const PrefillParams& p) {
  // the head pass's fragments hold whole 32-element blocks, a thread's (K-last) or a warp pair's (V-last:
  // head_state_io.cuh store_head_state_vlast_e4m3); K-last, the tiled pass's warps hold whole blocks at K >= 128
  return head_pass_ok(p) || (states_layout(p) == StateLayout::kKLast && p.heads.head_dim_k >= 128);
}

bool states_staged(const PrefillParams& p) {
  const bool pool = p.state.data != nullptr && p.state.dtype == DType::kFloat8E4M3;
  const bool checkpoints = p.checkpoint_interval > 0 && p.checkpoints.data != nullptr &&
                           p.checkpoints.dtype == DType::kFloat8E4M3;
  return (pool || checkpoints) && !fp8_states_in_place(p);
}

PrefillParams staged_shape(const PrefillParams& p) {
  PrefillParams s = p;
  const int64_t head_state = int64_t(p.heads.num_v_heads) * p.heads.head_dim_k * p.heads.head_dim_v;
  s.state.dtype = DType::kFloat32;
  s.state.layout = StateLayout::kKLast;
  s.state.num_slots = std::max<int64_t>(p.num_seqs, 1);
  s.state.slot_stride = head_state;
  s.state.scales = nullptr;
  if (p.checkpoint_interval > 0 && p.checkpoints.data != nullptr) {
    s.checkpoints.dtype = DType::kFloat32;
    s.checkpoints.layout = StateLayout::kKLast;
    s.checkpoints.num_slots = std::max<int64_t>(p.total_tokens, 0) / p.checkpoint_interval + 1;
    s.checkpoints.slot_stride = head_state;  // entries of one sequence are consecutive slots
    s.checkpoints.scales = nullptr;
  }
  return s;
}

PrefillParams pass_params(const PrefillParams& p) { return states_staged(p) ? staged_shape(p) : p; }

bool head_tensor_maps_ok(const PrefillParams& p) {
  constexpr int64_t kMax = int64_t(1) << 31;  // TMA coordinates are signed 32-bit
  return p.num_seqs > 0 && p.total_tokens > 0 && p.total_tokens + kChunk < kMax;
}

// The longest sequence on which the recurrent kernels beat the chunked ones (1024 sequences of L tokens): their
// math grows with the tokens (the chain kernel by steps of 8), the chunked kernels' time per sequence does not. The
// chain kernel on tensor cores (K-last, bf16 inputs) reaches 16 tokens on every pool it takes; the warp kernel 16 on a
// 16-bit pool (half the state bytes), 8 on fp32 and on float8_e4m3 (its block scales).
int short_len_default(const PrefillParams& p) {
  if (p.state.dtype == DType::kFloat8E4M3) return 8;
  if (p.state.layout == StateLayout::kKLast && p.q.dtype == DType::kBFloat16) return 16;
  return dtype_size(p.state.dtype) == 2 ? 16 : 8;
}

bool longest_first_already(const PrefillParams& p, int short_len) {
  if (p.cu_seqlens_host == nullptr) return false;
  int last = kLengthClasses;
  for (int32_t n = 0; n < p.num_seqs; ++n) {
    const int64_t start = p.cu_seqlens_host[n], end = p.cu_seqlens_host[n + 1];
    if (short_prefill_sequence(start, end, p.total_tokens, short_len)) continue;  // not the pass's
    const int c = length_class(start, end);
    if (c > last) return false;
    last = c;
  }
  return true;
}

int32_t count_short(const PrefillParams& p, int len) {
  int32_t count = 0;
  for (int32_t n = 0; n < p.num_seqs; ++n)
    count += short_prefill_sequence(p.cu_seqlens_host[n], p.cu_seqlens_host[n + 1], p.total_tokens, len);
  return count;
}

// Without a host copy of cu_seqlens the short path launches a grid over every sequence, whose CTAs of long
// sequences only read their span and exit. It runs when the mean length is within the reach, or when that grid
// is small (a few waves): then a short sequence of a mixed batch still takes it, and the precision of a sequence
// of a few tokens is the recurrence's, not that of a chunk's 16-bit operands (docs/design/prefill.md).
int choose_short_len(const PrefillParams& p, const Overrides& o, int num_sms) {
  if (o.prefill_short_max_len >= 0) return short_path_supported(p) ? o.prefill_short_max_len : 0;
  const int len = short_len_default(p);
  if (!short_path_supported(p)) return 0;
  if (p.cu_seqlens_host != nullptr) return count_short(p, len) > 0 ? len : 0;
  const bool small_grid = int64_t(p.num_seqs) * p.heads.num_v_heads <= int64_t(kShortSkipRowsPerSm) * num_sms;
  return small_grid || p.total_tokens <= int64_t(p.num_seqs) * len ? len : 0;
}

// The head pass when it can run. Otherwise the tiled pass, whose parallelism is N * HV * (V / VT) CTAs: the
// widest tile (least recomputation of the per-chunk q k^T and fewest q/k reloads) that still gives about two
// CTAs per SM, else the narrowest.
int choose_vtile(const PrefillParams& p, int num_sms) {
  if (head_pass_ok(p)) return kVTileHead;
  const int K = p.heads.head_dim_k, V = p.heads.head_dim_v;
  const int64_t rows = int64_t(p.num_seqs) * p.heads.num_v_heads;
  for (int vt : {64, 32, 16})
    if (vtile_supported(K, vt) && vt <= V && rows * (V / vt) >= 2 * int64_t(num_sms)) return vt;
  return 16;
}

// Two CTAs per (sequence, value head) while that still gives at most one CTA per SM: a sequential chain per CTA
// gains nothing from sharing an SM, and halving each CTA's columns shortens the chain's products.
int choose_head_split(const PrefillParams& p, int num_sms) {
  const int64_t heads = int64_t(p.num_seqs) * p.heads.num_v_heads;
  return head_split_supported(p.heads.head_dim_v, 2) && heads * 2 <= num_sms ? 2 : 1;
}

int choose_prep_parts(const PrefillParams& p, int num_sms, bool with_m, const Overrides& o) {
  const int H = p.heads.num_qk_heads, group = H > 0 ? p.heads.num_v_heads / H : 1;
  if (o.prefill_prep_parts > 0) {
    if (group % o.prefill_prep_parts != 0)
      throw Error(ErrorCode::kInvalidArgument, "prefill: chunk prep in " + std::to_string(o.prefill_prep_parts) +
                                                   " parts per q/k head: expected a divisor of HV / H = " +
                                                   std::to_string(group));
    return o.prefill_prep_parts;
  }
  // A prep CTA's time is a chain (the rows, the products, then each value head's solve in turn): where the grid is
  // short of a wave, sharing the value heads out shortens the chain at the price of the products formed again. With M
  // (four CTAs an SM by their registers, five by shared memory) a grid up to an eighth past one wave still gains.
  const int64_t resident = int64_t(prep_ctas_per_sm(p.heads.head_dim_k, with_m)) * num_sms;
  const int64_t capacity = with_m ? resident * 9 / 8 : resident;
  const int64_t ctas = num_chunk_slots(p) * H;
  int parts = 1;
  for (int d = 2; d <= group; ++d)
    if (group % d == 0 && ctas * d <= capacity) parts = d;
  return parts;
}

bool cp_supported(const PrefillParams& p) {
  const int K = p.heads.head_dim_k, V = p.heads.head_dim_v;
  return head_pass_ok(p) && K == V && (K == 64 || K == 128) && head_tensor_maps_ok(p) && p.heads.num_v_heads > 0;
}

int64_t cp_max_segments(const PrefillParams& p, int64_t seg_len) {
  return int64_t(std::max(p.num_seqs, 0)) + std::max<int64_t>(p.total_tokens, 0) / seg_len;
}

int64_t cp_max_states(const PrefillParams& p, int64_t seg_len) {
  return std::max<int64_t>(1, std::min(cp_max_segments(p, seg_len), 2 * (std::max<int64_t>(p.total_tokens, 0) / seg_len)));
}

namespace {
// Context parallelism runs a segment three times (its local pass, its transition, its final pass): it pays where
// the longest sequence holds at least this many segments of one wave (docs/design/prefill.md measures where).
constexpr int64_t kCpMinSegmentsPerSeq = 8;
// With 4 to 7 segments per wave (32 value heads on 132 SMs: 4) they pay on prompts of this many tokens and more, cut
// into one wave of segments and one more, the first one's final pass beside the local pass (docs/design/prefill.md
// measures it).
constexpr int64_t kCpFewSegmentsPerWave = 4;
constexpr int64_t kCpFewSegmentsMinLen = 16384;

// Sequence n's tokens by the host copy of cu_seqlens; without it the batch counts as N sequences of the mean length.
int64_t sequence_len(const PrefillParams& p, int32_t n) {
  return p.cu_seqlens_host != nullptr ? p.cu_seqlens_host[n + 1] - p.cu_seqlens_host[n] : p.total_tokens / p.num_seqs;
}

// The longest sequence and the longest of the others.
int64_t longest_sequence(const PrefillParams& p, int64_t* second = nullptr) {
  int64_t longest = 0, next = 0;
  for (int32_t n = 0; n < p.num_seqs; ++n) {
    const int64_t len = sequence_len(p, n);
    next = std::max(next, std::min(len, longest));
    longest = std::max(longest, len);
  }
  if (second != nullptr) *second = next;
  return longest;
}

// With 8 or more segments a wave (few value heads), a prompt of 6 or 7 segments pays too where the local and the final
// pass both fit one wave (docs/design/prefill.md measures where).
constexpr int64_t kCpOneWaveMinSegments = 6;
// ... and in segments of kCpShortSegment tokens up to this many (10 were slower than 7 of kCpMinSegment).
constexpr int64_t kCpShortSegmentsMax = 9;

// The local pass's CTAs (a cut sequence of s segments: its first from the initial state, L and P of the middle ones,
// none for the last: 2 s - 3) and the final pass's (every segment) fit one wave.
bool cp_passes_in_one_wave(const PrefillParams& p, int num_sms, int64_t seg_len) {
  int64_t local = 0, final_pass = 0;
  for (int32_t n = 0; n < p.num_seqs; ++n) {
    const int64_t s = std::max<int64_t>(1, (sequence_len(p, n) + seg_len - 1) / seg_len);
    final_pass += s;
    if (s > 1) local += 2 * s - 3;
  }
  const int64_t HV = p.heads.num_v_heads;
  return HV * local <= num_sms && HV * final_pass <= num_sms;
}

bool cp_fits(const PrefillParams& p, int64_t seg_len) {
  return int64_t(p.heads.num_v_heads) * cp_max_states(p, seg_len) <= kCpMaxSegmentHeads;
}

// Segments of about `tokens / count` tokens, whole chunks, at least kCpMinSegment.
int64_t cp_len_for(int64_t tokens, int64_t count) {
  const int64_t per = (tokens + count - 1) / count;
  return std::max(kCpMinSegment, (per + kChunk - 1) / kChunk * kChunk);
}

// The first segment's final pass beside the local pass pays where that pass takes a second wave anyway (every segment
// of the longest sequence but the last from zero and, but the first, on the identity: 2 s - 3 CTAs a value head) and
// a segment is a large part of the final pass: fewer than kCpMinSegmentsPerSeq a wave (at 8 value heads, 16 a wave,
// the final pass's segments shrink by a sixteenth and the op moved within +-2%).
bool cp_first_final_pays(const PrefillParams& p, int num_sms, int64_t seg_len) {
  const int64_t HV = std::max(p.heads.num_v_heads, 1);
  const int64_t segments = (longest_sequence(p) + seg_len - 1) / seg_len;
  return num_sms / HV < kCpMinSegmentsPerSeq && HV * std::max<int64_t>(2 * segments - 3, 1) > num_sms;
}
}  // namespace

int64_t choose_cp_segment_len(const PrefillParams& p, int num_sms, const Overrides& o) {
  if (o.prefill_cp_segment_len == 0 || p.num_seqs <= 0 || p.total_tokens <= 0) return 0;
  if (o.prefill_cp_segment_len > 0) {
    const int64_t len = o.prefill_cp_segment_len;
    if (len % kChunk != 0 || !cp_supported(p) || !cp_fits(p, len))
      throw Error(ErrorCode::kInvalidArgument, "prefill: context-parallel segments of " + std::to_string(len) +
                                                   " tokens are not supported for this call");
    return len;
  }
  if (!cp_supported(p)) return 0;
  const int64_t HV = p.heads.num_v_heads;
  const int64_t per_wave = num_sms / HV;  // segments of one sequence that give every value head one SM each
  int64_t second = 0;
  const int64_t longest = longest_sequence(p, &second);
  if (per_wave < kCpMinSegmentsPerSeq) {
    // Few segments a wave: only a long prompt, in one wave of segments of its own length (whatever the others'), the
    // batch's other sequences within a segment each (whole, in the final pass).
    if (per_wave < kCpFewSegmentsPerWave || longest < kCpFewSegmentsMinLen) return 0;
    int64_t len = cp_len_for(longest, per_wave);
    // With the first segment's final pass beside the local pass, the final pass runs one segment fewer per sequence:
    // one more segment keeps it at one wave, where the other sequences still fit one of them each.
    const int64_t more = cp_len_for(longest, per_wave + 1);
    if (o.prefill_cp_first_final != 0 && cp_first_final_pays(p, num_sms, len) && second <= more && cp_fits(p, more))
      len = more;
    return second <= len && cp_fits(p, len) ? len : 0;
  }
  // Many segments a wave: segments of the batch's tokens over one wave, where the longest holds at least eight of them,
  // or six where both passes then fit one wave beside the batch's other sequences.
  const int64_t len = cp_len_for(p.total_tokens, per_wave);
  // The longest sequence in kCpOneWaveMinSegments or more segments of seg_len, both passes in one wave.
  const auto one_wave = [&](int64_t seg_len) {
    return longest > (kCpOneWaveMinSegments - 1) * seg_len && cp_passes_in_one_wave(p, num_sms, seg_len);
  };
  // A prompt of 6 to 9 segments of kCpShortSegment tokens, alone or beside sequences of one such segment each, where
  // both passes fit one wave: those shorter segments (fewer than 7 of kCpMinSegment, or none).
  if (len == kCpMinSegment && longest <= kCpShortSegmentsMax * kCpShortSegment && second <= kCpShortSegment &&
      cp_fits(p, kCpShortSegment) && one_wave(kCpShortSegment))
    return kCpShortSegment;
  if (!cp_fits(p, len)) return 0;
  return longest >= kCpMinSegmentsPerSeq * len || one_wave(len) ? len : 0;
}

int cp_scan_cols(const PrefillParams& p, int num_sms, const Overrides& o) {
  if (o.prefill_cp_scan_cols != 0) {
    if (o.prefill_cp_scan_cols != 8 && o.prefill_cp_scan_cols != 32)
      throw Error(ErrorCode::kInvalidArgument, "prefill: context-parallel scan of " +
                                                   std::to_string(o.prefill_cp_scan_cols) +
                                                   " columns per CTA (8 or 32)");
    return o.prefill_cp_scan_cols;
  }
  return 2 * int64_t(p.heads.num_v_heads) * (p.heads.head_dim_v / 32) >= num_sms ? 32 : 8;
}

bool choose_cp_first_final(const PrefillParams& p, int num_sms, int64_t seg_len, const Overrides& o) {
  if (o.prefill_cp_first_final >= 0) return o.prefill_cp_first_final > 0;
  return cp_first_final_pays(p, num_sms, seg_len);
}

namespace {
size_t round_256(int64_t bytes) { return size_t((bytes + 255) / 256 * 256); }
}  // namespace

CpLayout cp_layout(const PrefillParams& p, int64_t segments, int64_t states, int64_t cuts) {
  CpLayout l;
  l.state_entry = round_256(segments * int64_t(sizeof(CpSegment)));
  l.cut_first = l.state_entry + round_256(states * 4);
  l.states = l.cut_first + round_256((cuts >= 0 ? cuts : cp_max_cuts(states)) * 4);
  l.state_bytes = round_256(states * p.heads.num_v_heads * int64_t(p.heads.head_dim_k) * p.heads.head_dim_v * 4);
  l.total = l.states + 3 * l.state_bytes;
  return l;
}

size_t cp_workspace_bytes(const PrefillParams& p, const Overrides& o) {
  if (!cp_supported(p) || o.prefill_cp_segment_len == 0 || p.num_seqs <= 0 || p.total_tokens <= 0) return 0;
  const int64_t shortest = o.prefill_cp_segment_len > 0 ? std::min<int64_t>(o.prefill_cp_segment_len, kCpShortSegment)
                                                         : kCpShortSegment;
  const int64_t states = std::min(cp_max_states(p, shortest), kCpMaxSegmentHeads / p.heads.num_v_heads);
  return cp_layout(p, cp_max_segments(p, shortest), states).total;
}

PrefillChoice choose_prefill(const PrefillParams& p, int num_sms, const Overrides& o) {
  PrefillChoice c;
  c.stages = o.prefill_stages;
  const int K = p.heads.head_dim_k, V = p.heads.head_dim_v;
  // Short sequences run on the recurrent kernels (the chunked kernels skip them). The short path stores no
  // checkpoint: it takes only sequences shorter than the interval.
  if (c.stages == kStagesAll) {
    c.short_len = choose_short_len(p, o, num_sms);
    if (has_checkpoints(p)) c.short_len = std::min(c.short_len, p.checkpoint_interval - 1);
    c.short_len = std::max(c.short_len, 0);
  }
  c.only_short = c.short_len > 0 && p.cu_seqlens_host != nullptr && count_short(p, c.short_len) == p.num_seqs;
  if (c.only_short) return c;

  // Context parallelism: segments give the parallelism, one CTA per (segment, value head) of the wgmma head pass;
  // a forced value tile or head split runs that pass instead.
  const bool forced_pass = o.prefill_vtile != 0 || o.prefill_head_split != 0;
  if (c.stages == kStagesAll && (o.prefill_cp_segment_len > 0 || !forced_pass))
    c.cp_segment_len = choose_cp_segment_len(p, num_sms, o);
  const bool cp = c.cp_segment_len > 0;
  c.cp_first_final = cp && choose_cp_first_final(p, num_sms, c.cp_segment_len, o);
  if (cp) c.cp_scan_cols = cp_scan_cols(p, num_sms, o);
  c.vtile = o.prefill_vtile != 0 && !cp ? o.prefill_vtile : choose_vtile(p, num_sms);
  c.head_split = cp ? 1 : o.prefill_head_split != 0 ? o.prefill_head_split : choose_head_split(p, num_sms);
  if (is_head_tile(c.vtile) && !head_split_supported(V, c.head_split))
    throw Error(ErrorCode::kInvalidArgument, "prefill: head split " + std::to_string(c.head_split) +
                                                 " is not supported for V=" + std::to_string(V));
  if (!vtile_supported(K, c.vtile) || c.vtile > V || (is_head_tile(c.vtile) && !head_pass_ok(p)))
    throw Error(ErrorCode::kInvalidArgument, "prefill: value tile " + std::to_string(c.vtile) +
                                                 " is not supported for K=" + std::to_string(K) +
                                                 ", V=" + std::to_string(V));
  // float8_e4m3 pools and checkpoints: the head pass (head_state_io.cuh) or, K-last, the tiled pass at K >= 128, whose
  // warps hold whole 32-row scale blocks (state_pass_tiled.cuh); fp8_states_in_place admits no other.
  const bool fp8_pass = is_head_tile(c.vtile) || (K >= 128 && states_layout(p) == StateLayout::kKLast);
  if (p.checkpoint_interval > 0 && p.checkpoints.data != nullptr && p.checkpoints.dtype == DType::kFloat8E4M3 &&
      !fp8_pass)
    throw Error(ErrorCode::kNotImplemented,
                "checkpoints: float8_e4m3 checkpoints are stored by the head state pass or, K-last, at K >= 128 only, "
                "not by value tile " + std::to_string(c.vtile));
  if (p.state.data != nullptr && p.state.dtype == DType::kFloat8E4M3 && !fp8_pass)
    throw Error(ErrorCode::kNotImplemented,
                "state: float8_e4m3 pools are read and written by the head state pass or, K-last, at K >= 128 only, "
                "not by value tile " + std::to_string(c.vtile));
  c.wgmma_pass = c.vtile == kVTileHead && K <= 128 && (V / c.head_split) % 64 == 0 && head_tensor_maps_ok(p);
  const bool m_warpgroup_possible = c.wgmma_pass && c.head_split == 1 && V == 128 && K % 64 == 0;
  if (m_warpgroup_possible) c.m_warpgroup = m_warpgroup_wanted(o);
  c.m_in_pass = c.m_warpgroup || head_pass_forms_m(c.wgmma_pass, V / c.head_split);
  // The whole prep in the warpgroup: whole sequences only (the context-parallel passes take the chunk prep's T')
  c.fused_prep = c.m_warpgroup && !cp && o.prefill_m_warpgroup == 2;
  const bool prep = (c.stages & kStagePrep) && p.num_seqs > 0 && p.total_tokens > 0;
  if (prep && !c.fused_prep) c.prep_parts = choose_prep_parts(p, num_sms, !c.m_in_pass, o);
  const int64_t items = int64_t(p.num_seqs) * p.heads.num_v_heads;
  const bool pass_runs = c.stages & kStageStatePass;
  // Persistent where the items outnumber the SMs: the next item's state and first chunks load while the current item
  // runs (8192x32 1.41x, 1024x64 1.38x, 32x768 1.09x, 16x2048 1.04x faster; 8x8192 and 32x8192 within spread); one
  // wave has no next item (4x2048 2% slower).
  const bool persistent_pays = items > num_sms;
  c.persistent_pass = c.m_warpgroup && !c.fused_prep && !cp && pass_runs &&
                      (o.prefill_persistent >= 0 ? o.prefill_persistent > 0 : persistent_pays);
  // (under context parallelism the pass behind the prep is the local pass: two CTAs per state and value head; the
  // persistent pass is one CTA per SM at most)
  const int64_t rows = cp ? 2 * cp_max_states(p, c.cp_segment_len) : int64_t(p.num_seqs) * c.head_split;
  if (c.persistent_pass)
    c.pass_ctas = int(std::min<int64_t>(items, o.prefill_persistent_ctas > 0 ? o.prefill_persistent_ctas : num_sms));
  const int64_t pass_ctas = c.persistent_pass ? c.pass_ctas : rows * p.heads.num_v_heads;
  // Its CTAs take the items longest first, so that a long prompt does not start last and run alone at the end, unless
  // the host's copy of cu_seqlens shows the pass's sequences in that order already (one length class included: the
  // order kernel would change nothing).
  // The same for one CTA per item where its CTAs take more than one wave: the hardware launches them in grid order.
  const bool orderable = c.persistent_pass || (pass_runs && is_head_tile(c.vtile) && !cp && pass_ctas > num_sms);
  if (orderable)
    c.longest_first =
        o.prefill_longest_first >= 0 ? o.prefill_longest_first > 0 : !longest_first_already(p, c.short_len);
  c.early_state_pass = prep && pass_ctas <= int64_t(kEarlyPassMaxCtasPerSm) * num_sms;
  // The pass's producer waits for each chunk's flag, so that the chunks the prep finished early run while its last
  // wave does: beside the prep warpgroup (HeadPass::kProducer), for sequences of a mean of at most
  // kChunkFlagsMaxTokens, one CTA per item (the persistent pass's CTAs wait better for the prep's grid: 8192x32 3.5%,
  // 1024x64 1.5%, 1024x128 2.5% faster); the override: wherever a producer can wait.
  const bool producer = c.m_warpgroup || head_pass_load_warp(c.wgmma_pass, c.m_warpgroup, K, V / c.head_split, cp);
  const bool flags_pay =
      c.m_warpgroup && !c.persistent_pass && p.total_tokens <= kChunkFlagsMaxTokens * int64_t(p.num_seqs);
  c.chunk_flags = c.early_state_pass && c.wgmma_pass && !cp && !c.fused_prep && producer &&
                  c.stages == kStagesAll && (o.prefill_chunk_flags >= 0 ? o.prefill_chunk_flags > 0 : flags_pay);
  return c;
}

bool split_supported(const PrefillParams& p) {
  const int K = p.heads.head_dim_k, V = p.heads.head_dim_v;
  constexpr int64_t kMax = int64_t(1) << 31;  // the head pass's TMA coordinates
  return head_pass_ok(p) && K == V && (K == 64 || K == 128) && p.heads.num_v_heads > 0 &&
         p.total_tokens + kChunk < kMax;
}

int64_t split_segment_len(const PrefillParams& p, int num_sms, const Overrides& o) {
  const int64_t whole = std::max<int64_t>(kChunk, (std::max<int64_t>(p.total_tokens, 0) + kChunk - 1) / kChunk * kChunk);
  if (o.prefill_cp_segment_len == 0) return whole;
  if (o.prefill_cp_segment_len > 0) {
    if (o.prefill_cp_segment_len % kChunk != 0)
      throw Error(ErrorCode::kInvalidArgument, "prefill: context-parallel segments of " +
                                                   std::to_string(o.prefill_cp_segment_len) +
                                                   " tokens are not a multiple of 64");
    return o.prefill_cp_segment_len;
  }
  // Every segment already runs twice before its final pass (from zero, and its transition): the rank's tokens in
  // about one wave of (segment, value head) CTAs, as the single-GPU path cuts one long sequence.
  const int64_t per_wave = std::max<int64_t>(1, num_sms / std::max(p.heads.num_v_heads, 1));
  const int64_t tokens = (std::max<int64_t>(p.total_tokens, 0) + per_wave - 1) / per_wave;
  return std::min(whole, std::max(kCpMinSegment, (tokens + kChunk - 1) / kChunk * kChunk));
}

PrefillChoice choose_split(const PrefillParams& p, int num_sms, const Overrides& o) {
  if (!split_supported(p))
    throw Error(ErrorCode::kNotImplemented,
                "prefill split: the CUDA backend runs a prefill split over ranks on its context-parallel passes: "
                "bf16 or fp16 q, k, v and o with 16-byte aligned rows, K == V in {64, 128}; got K=" +
                    std::to_string(p.heads.head_dim_k) + ", V=" + std::to_string(p.heads.head_dim_v) + ", q " +
                    dtype_name(p.q.dtype) + " (the CPU backend runs every call)");
  PrefillChoice c;
  c.stages = kStagesAll;
  c.cp_segment_len = split_segment_len(p, num_sms, o);
  c.cp_scan_cols = cp_scan_cols(p, num_sms, o);
  // The fold stores the last rank's final states, a V-last float8_e4m3 block (32 columns of one k) by one CTA
  // (context_parallel.cuh).
  if (p.state.data != nullptr && p.state.dtype == DType::kFloat8E4M3 && p.state.layout == StateLayout::kVLast) {
    if (o.prefill_cp_scan_cols == 8)
      throw Error(ErrorCode::kInvalidArgument,
                  "prefill split: a V-last float8_e4m3 pool needs the scan's 32 columns per CTA, not 8");
    c.cp_scan_cols = 32;
  }
  c.vtile = kVTileHead;
  c.head_split = 1;
  c.wgmma_pass = true;
  const int V = p.heads.head_dim_v;
  c.m_warpgroup = V == 128 && m_warpgroup_wanted(o);
  c.m_in_pass = c.m_warpgroup || head_pass_forms_m(true, V);
  if (p.total_tokens > 0) c.prep_parts = choose_prep_parts(p, num_sms, !c.m_in_pass, o);
  const int64_t rows = 2 * cp_max_segments(p, c.cp_segment_len);
  c.early_state_pass = p.total_tokens > 0 && rows * p.heads.num_v_heads <= int64_t(kEarlyPassMaxCtasPerSm) * num_sms;
  return c;
}

size_t split_cp_workspace_bytes(const PrefillParams& p, int num_sms, const Overrides& o) {
  if (p.num_seqs <= 0) return 0;
  const int64_t segments = cp_max_segments(p, split_segment_len(p, num_sms, o));
  return cp_layout(p, segments, segments, p.num_seqs).total;  // every piece is a cut sequence
}

}  // namespace gdnkit::cuda::chunked_prefill
