// GPU pool layout conversion K-last <-> V-last, out of place and in place (K == V): every slot of the
// converted pool must hold exactly the source states (bits move, nothing is rounded), slot padding
// stays untouched, and the source of an out-of-place conversion is unchanged.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "support/compare.h"
#include "support/problem.h"
#include "gdnkit/gdnkit.h"
#include "gpu/gpu_harness.h"

namespace gdnkit::test {
namespace {

struct LayoutCase {
  std::string name;
  ProblemConfig cfg;
  bool in_place;
};

std::vector<LayoutCase> layout_cases() {
  std::vector<LayoutCase> out;
  const std::pair<int, int> dims[] = {{64, 64}, {128, 128}, {256, 256}, {64, 128}, {256, 128}};
  uint64_t seed = 7000;
  for (auto [K, V] : dims)
    for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast})
      for (DType state : {DType::kFloat32, DType::kBFloat16, DType::kFloat16})
        for (bool in_place : {false, true}) {
          if (in_place && K != V) continue;
          ProblemConfig c;
          c.op = OpKind::kDecode;
          c.batch = 2, c.HV = 3, c.K = K, c.V = V;
          c.layout = layout, c.state_dtype = state, c.layout_target = true;
          c.slot_pad = (seed % 2) ? 24 : 0;
          c.seed = seed++;
          const bool small = K == 64 && V == 64;
          out.push_back({std::string(small ? "Sanitize_" : "") + (layout == StateLayout::kKLast ? "klast" : "vlast") +
                             "_to_other_" + (state == DType::kFloat32 ? "f32" : state == DType::kFloat16 ? "f16" : "bf16") + "_K" + std::to_string(K) +
                             "_V" + std::to_string(V) + (in_place ? "_in_place" : "") + (c.slot_pad ? "_slotpad" : ""),
                         c, in_place});
        }
  // float8_e4m3 pools: requantized into the other layout's blocks, the CPU backend's bytes.
  for (auto [K, V] : dims)
    for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast})
      for (bool in_place : {false, true}) {
        if (in_place && K != V) continue;
        ProblemConfig c;
        c.op = OpKind::kDecode;
        c.batch = 2, c.HV = 3, c.K = K, c.V = V;
        c.layout = layout, c.state_dtype = DType::kFloat8E4M3, c.layout_target = true;
        c.slot_pad = (seed % 2) ? 32 : 0;
        c.seed = seed++;
        out.push_back({std::string(K == 64 && V == 64 ? "Sanitize_" : "") +
                           (layout == StateLayout::kKLast ? "klast" : "vlast") + "_to_other_f8_K" + std::to_string(K) +
                           "_V" + std::to_string(V) + (in_place ? "_in_place" : "") + (c.slot_pad ? "_slotpad" : ""),
                       c, in_place});
      }
  return out;
}

class LayoutTest : public ::testing::TestWithParam<LayoutCase> {};

TEST_P(LayoutTest, MovesEveryStateExactly) {
  const LayoutCase& lc = GetParam();
  Problem before(lc.cfg);
  before.fill_every_slot(lc.cfg.seed);  // the builder fills only the slots decode reads
  Problem got = before;
  DeviceProblem dev(got);
  convert_layout(got.layout_params(lc.in_place, dev.resolver()), {Backend::kCUDA, dev.stream()});
  dev.download(got);
  check_layout_results(before, got, lc.in_place);
}

INSTANTIATE_TEST_SUITE_P(Dims, LayoutTest, ::testing::ValuesIn(layout_cases()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace gdnkit::test
