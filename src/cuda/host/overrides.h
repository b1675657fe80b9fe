// Internal switches of the CUDA backend for the tests and the benchmark's A/B runs. Every field's default
// lets the heuristics (recurrent/heuristics.h, prefill/heuristics.h) choose; nothing here is public API and
// the library reads no environment variable to set it. Pure C++: the CPU suite tests the heuristics with it.
#pragma once

namespace gdnkit::cuda {

struct Overrides {
  bool programmatic_launch = true;  // PDL for the kernels that support it
  bool state_prefetch = true;       // the recurrent kernels' prefetch mode (design/decode.md)
  // Recurrent kernel choice; -1: the heuristic.
  int chain_mma_min_tokens = -1;    // fewest draft tokens on the tensor-core chain kernel (0: never)
  int decode_wide_max_batch = -1;   // largest batch on the wide tile (0: never)
  int decode_narrow_max_batch = -1;  // largest batch on the narrow tile (0: never)
  int decode_solo_min_batch = -1;   // smallest batch of K-last decode on one-warp CTAs (0: never)
  bool decode_mma = true;           // the tensor-core bf16 decode kernel where the heuristic takes it
  bool decode_mma_tf32 = true;      // ... its tf32 steps for fp16 pools with bf16 inputs (false: its fp16 steps)
  int decode_fp8_columns = 0;       // columns per warp of the fp8 decode kernel: 8, 16 or 32 (0: the heuristic)
  int decode_vlast_fp8_columns = 0;  // columns per CTA of V-last fp8 decode: 64 or 128 (0: the heuristic)
  int verify_fp8_chain_min_batch = -1;  // smallest batch of verify of chains on float8_e4m3 pools on the fp8 chain
                                        // kernel, where it is built (0: never)
  bool verify_fp8_chain_mma = true;     // ... without a cache on its tensor-core kernel where the heuristic takes it
                                        // (false: the CUDA-core one)
  int verify_vlast_chain_min_batch = -1;  // smallest batch of verify of chains on V-last pools on their chain kernel,
                                          // with a cache or without, where built (0: never)
  // Prefill choice; -1 / 0: the heuristic.
  int prefill_short_max_len = -1;   // longest sequence on the short-sequence path (0: off)
  int prefill_m_warpgroup = -1;     // the prep warpgroup: 0 off, 1 forming M wherever it can run, 2 forming the
                                    // chunk prep but M (no chunk prep kernel; the state warpgroups form M) where it can
  int prefill_vtile = 0;            // state pass value tile: kVTileHead, kVTileHeadWarp, 16, 32 or 64
  int prefill_head_split = 0;       // head pass CTAs per (sequence, value head): 1 or 2
  int prefill_stages = 3;           // kernels a call launches: 1 chunk prep, 2 state pass, 3 both (timing)
  int prefill_cp_segment_len = -1;  // context-parallel segments of this many tokens (a multiple of 64); 0: off
  int prefill_cp_scan_cols = 0;     // context parallelism: value columns per CTA of the scan, 8 or 32
  int prefill_cp_first_final = -1;  // context parallelism: each cut sequence's first segment runs with o beside the
                                    // local pass (1) or after the scan (0)
  int prefill_prep_parts = 0;       // chunk prep CTAs per (chunk slot, q/k head), a divisor of HV / H
  int prefill_chunk_flags = -1;     // the head pass waits for each chunk's flag instead of the chunk prep's grid: 0 off,
                                    // 1 wherever its producer can
  int prefill_persistent = -1;      // the prep warpgroup's head pass as one CTA per SM taking (sequence, value head)
                                    // items in turn: 0 off (a CTA per item), 1 wherever that build runs
  int prefill_persistent_ctas = 0;  // ... its CTAs (0: one per SM)
  // the head pass (persistent, or one CTA per item past one wave) taking the sequences longest first (1) or in
  // their order (0)
  int prefill_longest_first = -1;
};

// The process-wide overrides the backend reads on every call (host/device.cpp). Tests and the bench set them
// through ScopedOverrides; nothing else writes them.
Overrides& overrides();

// Sets the overrides for a scope and restores the previous ones at its end.
class ScopedOverrides {
 public:
  explicit ScopedOverrides(const Overrides& o) : saved_(overrides()) { overrides() = o; }
  ~ScopedOverrides() { overrides() = saved_; }
  ScopedOverrides(const ScopedOverrides&) = delete;
  ScopedOverrides& operator=(const ScopedOverrides&) = delete;

 private:
  Overrides saved_;
};

}  // namespace gdnkit::cuda
