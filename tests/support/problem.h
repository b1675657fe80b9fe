// Random test problems for every op: named host buffers filled per docs/semantics.md "Tolerances", NaN-poisoned
// outputs and pools, and the op params built through a pointer resolver (host pointers by default; a
// GPU test mirrors every buffer on the device and passes a resolver that returns the device copy).
//
//   gdnkit::test::ProblemConfig cfg;  cfg.op = OpKind::kVerify;  cfg.draft_tokens = 4;
//   gdnkit::test::Problem ref(cfg), got = ref;          // two identical copies
//   gdnkit::cpu::verify(ref.verify_params());            // the reference
//   ... run the backend under test on `got` ...
//   EXPECT_TRUE(RelClose("o", got.read_tokens("o"), ref.read_tokens("o"), output_tolerance(...)));
//
// Buffer names (present when the config asks for them):
//   q k v o                      [T_total, H|HV, K|V] strided views (token_pad / head_pad elements of
//                                NaN between rows and heads, so a read of padding shows up as NaN)
//   g beta | a b A_log dt_bias   gates ([T_total, HV] strided by token_pad; A_log/dt_bias [HV] fp32)
//   state                        pool [P, HV, <layout>], slot stride HV*K*V + slot_pad
//   <state buffer>_scales        float8_e4m3 pools and caches: [P|Q*S, HV*K*V / 32] E8M0 block scales
//   state_indices                [B] int32 (decode/verify/commit)
//   cu_seqlens                   [B+1] int32 (varlen verify) or [N+1] int32/int64 (prefill)
//   parent                       [B, T] int32 (tree verify)
//   intermediate                 [Q, T, HV, <layout>] + intermediate_indices [B]
//   accepted accepted_path       [B], [B, T] int32 (commit)
//   initial_indices final_indices checkpoint_indices  [N] int32; checkpoints [Q, S, HV, <layout>]
//   state_t                      pool in the other layout (layout conversion target, when asked)
//   error_flag                   [1] int32, zeroed
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gdnkit/params.h"
#include "gdnkit/types.h"

namespace gdnkit::test {

// Which op's token layout the problem has; commit uses a verify problem.
enum class OpKind { kDecode, kVerify, kPrefill };

struct ProblemConfig {
  OpKind op = OpKind::kDecode;
  int32_t batch = 2;              // B rows (decode / verify); prefill: N = seq_lens.size()
  int32_t draft_tokens = 4;       // verify: T (T_max when varlen)
  std::vector<int32_t> seq_lens;  // prefill: the N lengths; verify: varlen lengths (each <= T) or empty
  int32_t H = 2, HV = 4, K = 64, V = 64;
  DType in_dtype = DType::kBFloat16;    // q, k, v (and o)
  DType gate_dtype = DType::kFloat32;   // a, b, beta (g and A_log/dt_bias are always fp32)
  DType state_dtype = DType::kFloat32;  // pool
  DType cache_dtype = DType::kFloat32;  // intermediate / checkpoints
  StateLayout layout = StateLayout::kKLast;
  GateMode gate_mode = GateMode::kFused;
  bool use_qk_l2norm = true;
  float scale = 0.0f;        // <= 0: 1/sqrt(K)
  int32_t token_pad = 0;     // extra elements after each token row (q/k/v/o and gates)
  int32_t head_pad = 0;      // extra elements after each head (q/k/v/o)
  int64_t slot_pad = 0;      // extra elements per pool / cache slot
  int32_t pool_slots = 0;    // P; 0: 2 * rows + 3 (so some slots are never touched)
  int32_t padding_rows = 0;  // decode/verify: rows whose state slot is -1
  bool long_memory = false;  // A_log = log U(1e-3, 1e-2) instead of log U(1, 16)
  bool correlated_keys = false;  // k rows from a rank-4 subspace per head (+ small noise), b + 3 (beta ~ 0.95):
                                 // chunks whose I + A is far from the identity (the prefill prep's solve)
  bool extreme_gates = false;  // half of the a and b values replaced by +-10: decay ~0 or ~1, beta ~0 or ~1
  bool unit_qk = false;        // q, k scaled by 1/sqrt(K) after the draw: unit-scale rows for runs without the
                               // in-kernel L2 norm (raw N(0, 1) keys make the recurrence diverge)
  int32_t out_of_range_rows = 0;  // rows whose slot is past its buffer: state_indices (decode/verify/commit), or
                                  // the initial, final or checkpoint slot in turn (prefill); never a padding row
  int32_t out_of_range_cache_rows = 0;  // verify/commit: rows whose intermediate slot is >= Q (never a padding row)
  double state_scale = 0.5;  // initial pool states ~ N(0, state_scale^2)
  double v_scale = 1.0;      // v times this after the draw (large updates, large states)
  uint64_t seed = 1;
  // verify / commit
  bool tree = false;          // random parent[] (each parent[t] in [-1, t-1])
  bool intermediate = true;   // allocate the intermediate cache (Q = B + 2 slots)
  bool update_state = false;  // VerifyParams::update_state (chain only)
  // prefill
  DType cu_seqlens_dtype = DType::kInt32;
  bool pass_cu_seqlens_host = true;  // PrefillParams::cu_seqlens_host (always a host pointer)
  bool same_slot = false;            // final_indices == initial_indices
  int32_t zero_initial_rows = 0;     // the first rows start from S = 0 (initial index -1)
  int32_t no_final_rows = 0;         // the last rows do not store a final state (final index -1)
  int32_t checkpoint_interval = 0;   // C (multiple of 64); 0: no checkpoint buffer
  int32_t checkpoint_steps = 0;      // S of the checkpoint buffer; 0: max(len) / C
  // layout conversion
  bool layout_target = false;  // allocate state_t, the pool in the other layout (same slot stride)
};

struct Buffer {
  std::string name;
  std::vector<std::byte> bytes;
  bool is_output = false;  // the op may write it (copy back after a device run)
  template <class T>
  T* as() {
    return reinterpret_cast<T*>(bytes.data());
  }
  template <class T>
  const T* as() const {
    return reinterpret_cast<const T*>(bytes.data());
  }
};

// Maps a buffer to the pointer the params should carry (e.g. its device mirror).
using Resolver = std::function<void*(const Buffer&)>;

class Problem {
 public:
  explicit Problem(const ProblemConfig& cfg);

  const ProblemConfig& config() const { return cfg_; }
  std::vector<Buffer>& buffers() { return buffers_; }
  const std::vector<Buffer>& buffers() const { return buffers_; }
  bool has(const std::string& name) const;
  Buffer& buffer(const std::string& name);
  const Buffer& buffer(const std::string& name) const;
  template <class T>
  T* as(const std::string& name) {
    return buffer(name).as<T>();
  }
  template <class T>
  const T* as(const std::string& name) const {
    return buffer(name).as<T>();
  }

  // Sizes.
  int32_t rows() const { return rows_; }           // B (decode/verify) or N (prefill)
  int64_t total_tokens() const { return total_; }  // T_total
  int64_t row_start(int32_t r) const { return starts_[r]; }
  int64_t row_len(int32_t r) const { return lens_[r]; }
  int64_t num_slots() const { return pool_slots_; }  // P
  int64_t state_elems() const;                       // HV*K*V
  int64_t slot_stride() const;                       // HV*K*V + slot_pad
  // The intermediate / checkpoint buffer: Q slots of S steps, slots S*HV*K*V + slot_pad apart.
  int64_t cache_slots() const { return cache_slots_; }
  int64_t cache_steps() const { return cache_steps_; }
  int64_t cache_slot_stride() const { return cache_steps_ * state_elems() + cfg_.slot_pad; }

  // Params (pointers through the resolver; nullptr resolver = host pointers).
  DecodeParams decode_params(const Resolver& r = nullptr);
  VerifyParams verify_params(const Resolver& r = nullptr);
  CommitParams commit_params(CommitSource source, const Resolver& r = nullptr);
  PrefillParams prefill_params(PrefillAlgorithm algo = PrefillAlgorithm::kAuto, const Resolver& r = nullptr);
  // src = state, dst = state_t (or state itself when in_place; needs K == V).
  LayoutParams layout_params(bool in_place, const Resolver& r = nullptr);

  // Logical reads as double.
  // q/k/v/o: [T_total][heads][dim]; g/beta/a/b: [T_total][HV].
  std::vector<double> read_tokens(const std::string& name) const;
  // A pool slot as S[h][k][v] (canonical orientation whatever the layout). name: "state" or "state_t".
  std::vector<double> read_state(const std::string& name, int64_t slot) const;
  // A cache entry (intermediate / checkpoints) as S[h][k][v].
  std::vector<double> read_cache(const std::string& name, int64_t slot, int64_t step) const;
  // Overwrite a pool slot from S[h][k][v] (rounded to the pool dtype).
  void write_state(const std::string& name, int64_t slot, const std::vector<double>& s);

  // Pool slots the op may write for these params (valid slot indices only).
  std::vector<int64_t> written_pool_slots_decode() const;
  std::vector<int64_t> written_pool_slots_verify() const;  // update_state rows
  // rows with a usable source (from the cache: a cache slot in range; the kept step is not checked)
  std::vector<int64_t> written_pool_slots_commit(CommitSource source) const;
  std::vector<int64_t> written_pool_slots_prefill() const;
  // Prefill: whether sequence r runs (no initial, final or checkpoint slot past its buffer), the final slots
  // of the sequences that run, and the checkpoint entries (slot, step) they store.
  bool prefill_row_runs(int32_t r) const;
  std::vector<int64_t> written_final_slots() const;
  std::vector<std::pair<int64_t, int64_t>> written_checkpoints() const;
  // Verify: the intermediate entries (slot, step) stored (rows with a valid pool slot and cache slot).
  std::vector<std::pair<int64_t, int64_t>> written_intermediate() const;
  // First byte of cache buffer `name` (intermediate / checkpoints) outside `entries` that differs from
  // `before`; -1 when there is none.
  int64_t first_changed_cache_byte(const Problem& before, const std::string& name,
                                   const std::vector<std::pair<int64_t, int64_t>>& entries) const;
  // Every pool slot of "state" filled with N(0, 1) states from `seed` (the builder fills only the slots the
  // rows start from), for the layout conversion.
  void fill_every_slot(uint64_t seed);

  // Geometry of the per-token views (elements).
  int64_t token_stride(const std::string& name) const;
  int64_t head_stride(const std::string& name) const;

 private:
  Buffer& add(const std::string& name, size_t bytes, bool is_output);
  // A state buffer (pool or cache) of `elems` elements, NaN-poisoned; a float8_e4m3 one with "<name>_scales",
  // one E8M0 byte per kFp8Block elements of its `states` unpadded states (NaN scales).
  Buffer& add_states(const std::string& name, DType dtype, int64_t elems, int64_t states);
  // One state of buffer `name` in storage order, its first element and its first scale block (float8_e4m3).
  std::vector<double> load_storage(const std::string& name, DType dtype, int64_t first, int64_t first_block) const;
  void store_storage(const std::string& name, DType dtype, int64_t first, int64_t first_block,
                     const std::vector<double>& x);
  // Storage order (layout) -> S[h][k][v].
  std::vector<double> canonical(const std::vector<double>& x, StateLayout layout) const;
  // N(0, state_scale^2) states in the pool slots the rows start from (slots[r] >= 0), in row order.
  void random_start_states(const int32_t* slots, std::mt19937_64& gen);
  void* ptr(const Resolver& r, const std::string& name);
  const void* ptr_or_null(const Resolver& r, const std::string& name);
  void build_tokens(std::mt19937_64& gen);
  void build_decode_verify();
  void build_prefill();
  void scale_unit_qk();
  void scale_v();
  void place_out_of_range_rows();
  Gating gating(const Resolver& r);
  StatePool pool(const Resolver& r, const std::string& name, StateLayout layout);
  StateCache cache(const Resolver& r, const std::string& name);

  ProblemConfig cfg_;
  std::vector<Buffer> buffers_;
  int32_t rows_ = 0;
  int64_t total_ = 0;
  int64_t pool_slots_ = 0;
  int64_t cache_slots_ = 0;  // Q
  int64_t cache_steps_ = 0;  // S
  std::vector<int64_t> starts_, lens_;
  std::vector<int64_t> cu_host_;  // host copy of cu_seqlens (prefill)
};

// Poison pattern: quiet NaN in each float dtype.
void fill_nan(void* data, DType dtype, int64_t count);

// g and beta the fused path computes (used to fill given gates; also handy in tests).
double fused_g(double A_log, double a, double dt_bias);
double fused_beta(double b);

}  // namespace gdnkit::test
