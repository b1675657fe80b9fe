// The public entries on the CPU backend: validation accepts every problem the shared builder makes (all
// of the spec's axes: dtypes, layouts, gates, strided views, padding rows, trees, varlen, caches,
// checkpoints, int64 cu_seqlens), and the entry computes exactly what the backend computes when called
// directly: every buffer bit-identical. The CUDA rules are checked on the same params where the
// builder's padding keeps 16-byte multiples.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cpu/backend.h"
#include "support/compare.h"
#include "support/problem.h"
#include "gdnkit/gdnkit.h"

namespace gdnkit::test {
namespace {

// Host buffers come from operator new: 16-byte aligned here, as the CUDA rules need.
static_assert(__STDCPP_DEFAULT_NEW_ALIGNMENT__ >= 16);

const Context kCpu{Backend::kCPU, nullptr};

void expect_same_buffers(const Problem& entry, const Problem& direct) {
  ASSERT_EQ(entry.buffers().size(), direct.buffers().size());
  for (size_t i = 0; i < entry.buffers().size(); ++i)
    EXPECT_TRUE(BitwiseEqual(entry.buffers()[i].name, entry.buffers()[i], direct.buffers()[i]));
}

// The entry did work: buffer `name` changed (it starts NaN-poisoned or random).
void expect_written(const Problem& before, const Problem& after, const std::string& name) {
  EXPECT_NE(before.buffer(name).bytes, after.buffer(name).bytes) << name << " was not written";
}

// The pads of the builder are in elements; CUDA needs rows and slots on 16-byte boundaries.
bool cuda_aligned(const ProblemConfig& c) {
  const int in = dtype_size(c.in_dtype), st = dtype_size(c.state_dtype), ca = dtype_size(c.cache_dtype);
  return (c.token_pad * in) % 16 == 0 && (c.head_pad * in) % 16 == 0 && (c.slot_pad * st) % 16 == 0 &&
         (c.slot_pad * ca) % 16 == 0;
}

struct Case {
  std::string name;
  ProblemConfig cfg;
};

std::vector<Case> step_cases(OpKind op) {
  std::vector<Case> out;
  uint64_t seed = 100;
  for (DType in : {DType::kBFloat16, DType::kFloat16, DType::kFloat32})
    for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast})
      for (int variant = 0; variant < 3; ++variant) {
        ProblemConfig c;
        c.op = op;
        c.batch = 3;
        c.draft_tokens = 3;
        c.in_dtype = in;
        c.layout = layout;
        c.seed = seed++;
        std::string name = std::string(dtype_name(in)) + (layout == StateLayout::kKLast ? "_klast" : "_vlast");
        if (variant == 1) {  // given gates, bf16 state and cache, padding row, fused-projection views
          c.gate_mode = GateMode::kGiven;
          c.gate_dtype = DType::kBFloat16;
          c.state_dtype = c.cache_dtype = DType::kBFloat16;
          c.padding_rows = 1;
          c.token_pad = 24, c.head_pad = 8, c.slot_pad = 40;
          name += "_given_bf16state_strided";
        } else if (variant == 2) {  // odd pads: valid on the CPU backend, not for CUDA's vector loads
          c.K = 128, c.V = 64, c.H = 1, c.HV = 2;
          c.token_pad = 5, c.head_pad = 3, c.slot_pad = 7;
          name += "_K128V64_oddpads";
        }
        if (op == OpKind::kVerify && variant == 1) c.tree = true, name += "_tree";
        if (op == OpKind::kVerify && variant == 2) c.seq_lens = {3, 0, 2}, name += "_varlen";
        if (op == OpKind::kVerify && variant == 0) c.update_state = true, name += "_update";
        out.push_back({name, c});
      }
  return out;
}

std::vector<Case> prefill_cases() {
  std::vector<Case> out;
  uint64_t seed = 300;
  for (DType in : {DType::kBFloat16, DType::kFloat32})
    for (int variant = 0; variant < 3; ++variant) {
      ProblemConfig c;
      c.op = OpKind::kPrefill;
      c.in_dtype = in;
      c.seed = seed++;
      c.seq_lens = {70, 0, 129};
      std::string name = dtype_name(in);
      if (variant == 0) {
        c.checkpoint_interval = 64;
        name += "_checkpoints";
      } else if (variant == 1) {
        c.cu_seqlens_dtype = DType::kInt64;
        c.pass_cu_seqlens_host = false;
        c.same_slot = true;
        c.layout = StateLayout::kVLast;
        c.token_pad = 8, c.slot_pad = 16;
        name += "_int64cu_sameslot_vlast";
      } else {
        c.zero_initial_rows = 1, c.no_final_rows = 1;
        c.gate_mode = GateMode::kGiven;
        c.state_dtype = DType::kBFloat16;
        name += "_given_bf16state_noinit_nofinal";
      }
      out.push_back({name, c});
    }
  return out;
}

TEST(ApiEntries, DecodeEqualsBackend) {
  for (const Case& k : step_cases(OpKind::kDecode)) {
    SCOPED_TRACE(k.name);
    Problem entry(k.cfg), direct = entry;
    const Problem before = entry;
    if (cuda_aligned(k.cfg)) {
      EXPECT_NO_THROW(validate(entry.decode_params(), Backend::kCUDA));
    } else {
      EXPECT_THROW(validate(entry.decode_params(), Backend::kCUDA), Error);  // rows off 16-byte boundaries
    }
    ASSERT_NO_THROW(decode(entry.decode_params(), kCpu));
    cpu::decode(direct.decode_params());
    expect_same_buffers(entry, direct);
    expect_written(before, entry, "o");
    expect_written(before, entry, "state");
  }
}

TEST(ApiEntries, VerifyEqualsBackend) {
  for (const Case& k : step_cases(OpKind::kVerify)) {
    SCOPED_TRACE(k.name);
    Problem entry(k.cfg), direct = entry;
    const Problem before = entry;
    if (cuda_aligned(k.cfg)) EXPECT_NO_THROW(validate(entry.verify_params(), Backend::kCUDA));
    ASSERT_NO_THROW(verify(entry.verify_params(), kCpu));
    cpu::verify(direct.verify_params());
    expect_same_buffers(entry, direct);
    expect_written(before, entry, "o");
    expect_written(before, entry, "intermediate");
  }
}

TEST(ApiEntries, CommitEqualsBackend) {
  for (const Case& k : step_cases(OpKind::kVerify))
    for (CommitSource src : {CommitSource::kCache, CommitSource::kRecompute}) {
      SCOPED_TRACE(k.name + (src == CommitSource::kCache ? " cache" : " recompute"));
      ProblemConfig c = k.cfg;
      c.update_state = false;
      Problem entry(c);
      cpu::verify(entry.verify_params());
      Problem direct = entry;
      const Problem before = entry;
      if (cuda_aligned(c)) EXPECT_NO_THROW(validate(entry.commit_params(src), Backend::kCUDA));
      ASSERT_NO_THROW(commit(entry.commit_params(src), kCpu));
      cpu::commit(direct.commit_params(src));
      expect_same_buffers(entry, direct);
      if (!before.written_pool_slots_commit(src).empty()) expect_written(before, entry, "state");
    }
}

TEST(ApiEntries, PrefillEqualsBackend) {
  for (const Case& k : prefill_cases())
    for (PrefillAlgorithm algo : {PrefillAlgorithm::kRecurrent, PrefillAlgorithm::kChunked}) {
      SCOPED_TRACE(k.name + (algo == PrefillAlgorithm::kChunked ? " chunked" : " recurrent"));
      Problem entry(k.cfg), direct = entry;
      const Problem before = entry;
      if (cuda_aligned(k.cfg)) EXPECT_NO_THROW(validate(entry.prefill_params(algo), Backend::kCUDA));
      ASSERT_NO_THROW(prefill(entry.prefill_params(algo), kCpu));
      cpu::prefill(direct.prefill_params(algo));
      expect_same_buffers(entry, direct);
      expect_written(before, entry, "o");
      expect_written(before, entry, "state");
    }
}

TEST(ApiEntries, LayoutEqualsBackend) {
  for (bool in_place : {false, true})
    for (DType st : {DType::kFloat32, DType::kBFloat16}) {
      SCOPED_TRACE(std::string(in_place ? "in place " : "out of place ") + dtype_name(st));
      ProblemConfig c;
      c.state_dtype = st;
      c.layout_target = !in_place;
      c.slot_pad = 8;
      Problem entry(c), direct = entry;
      const Problem before = entry;
      EXPECT_NO_THROW(validate(entry.layout_params(in_place), Backend::kCUDA));
      ASSERT_NO_THROW(convert_layout(entry.layout_params(in_place), kCpu));
      cpu::convert_layout(direct.layout_params(in_place));
      expect_same_buffers(entry, direct);
      expect_written(before, entry, in_place ? "state" : "state_t");
    }
}

}  // namespace
}  // namespace gdnkit::test
