#include "support/compare.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

namespace gdnkit::test {

double output_tolerance(OpFamily op, DType out_dtype) {
  const bool fp32 = out_dtype == DType::kFloat32;
  if (op == OpFamily::kStep) return fp32 ? kStepOutFp32 : kStepOutBf16;
  return fp32 ? kPrefillOutFp32 : kPrefillOutBf16;
}

double state_tolerance(OpFamily op, DType state_dtype) {
  const bool step = op == OpFamily::kStep;
  if (state_dtype == DType::kFloat32) return step ? kStepStateFp32 : kPrefillStateFp32;
  if (state_dtype == DType::kFloat16) return step ? kStepStateFp16 : kPrefillStateFp16;
  if (state_dtype == DType::kFloat8E4M3) return step ? kStepStateFp8 : kPrefillStateFp8;
  return step ? kStepStateBf16 : kPrefillStateBf16;
}

double storage_floor(DType dtype) { return dtype == DType::kFloat16 ? 0x1p-24 : 0.0; }

ErrorStats error_stats(const std::vector<double>& x, const std::vector<double>& ref) {
  ErrorStats s;
  double diff2 = 0, ref2 = 0;
  const size_t n = std::min(x.size(), ref.size());
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i]) || !std::isfinite(ref[i])) {
      ++s.nan_count;
      continue;
    }
    const double d = x[i] - ref[i];
    diff2 += d * d;
    ref2 += ref[i] * ref[i];
    if (std::fabs(d) > s.max_abs) {
      s.max_abs = std::fabs(d);
      s.worst = int64_t(i);
    }
  }
  s.ref_norm = std::sqrt(ref2);
  s.rel = s.ref_norm > 0 ? std::sqrt(diff2) / s.ref_norm : std::sqrt(diff2);
  return s;
}

::testing::AssertionResult RelClose(const std::string& what, const std::vector<double>& x,
                                    const std::vector<double>& ref, double tol, double abs_floor) {
  if (x.size() != ref.size())
    return ::testing::AssertionFailure() << what << ": size " << x.size() << " vs reference " << ref.size();
  const ErrorStats s = error_stats(x, ref);
  std::ostringstream msg;
  msg << what << ": rel " << s.rel << " (tol " << tol;
  if (abs_floor > 0) msg << " + " << abs_floor << " per element";
  msg << "), max abs " << s.max_abs;
  if (s.worst >= 0) msg << " at " << s.worst << " (" << x[s.worst] << " vs " << ref[s.worst] << ")";
  msg << ", ||ref|| " << s.ref_norm << ", " << x.size() << " elements";
  if (s.nan_count > 0) {
    size_t first = 0;
    while (first < x.size() && std::isfinite(x[first]) && std::isfinite(ref[first])) ++first;
    return ::testing::AssertionFailure() << msg.str() << ", " << s.nan_count << " non-finite (first at " << first
                                         << ": " << x[first] << " vs " << ref[first] << ")";
  }
  const double allowed = tol * s.ref_norm + abs_floor * std::sqrt(double(x.size()));
  const bool close = s.ref_norm > 0 ? s.rel * s.ref_norm <= allowed : s.rel <= std::max(tol, allowed);
  if (!close) return ::testing::AssertionFailure() << msg.str();
  return ::testing::AssertionSuccess() << msg.str();
}

::testing::AssertionResult AllZero(const std::string& what, const std::vector<double>& x) {
  for (size_t i = 0; i < x.size(); ++i)
    if (!(x[i] == 0.0))
      return ::testing::AssertionFailure() << what << ": element " << i << " is " << x[i] << ", expected 0";
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult Identical(const std::string& what, const std::vector<double>& x,
                                     const std::vector<double>& ref) {
  if (x.size() != ref.size())
    return ::testing::AssertionFailure() << what << ": size " << x.size() << " vs " << ref.size();
  for (size_t i = 0; i < x.size(); ++i)
    if (!(x[i] == ref[i]))
      return ::testing::AssertionFailure() << what << ": element " << i << " is " << x[i] << ", expected " << ref[i];
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult BitwiseEqual(const std::string& what, const Buffer& x, const Buffer& ref) {
  if (x.bytes.size() != ref.bytes.size())
    return ::testing::AssertionFailure() << what << ": " << x.bytes.size() << " bytes vs " << ref.bytes.size();
  for (size_t i = 0; i < x.bytes.size(); ++i)
    if (x.bytes[i] != ref.bytes[i])
      return ::testing::AssertionFailure()
             << what << ": byte " << i << " differs (" << int(x.bytes[i]) << " vs " << int(ref.bytes[i]) << ")";
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult OutputPaddingUntouched(const Problem& before, const Problem& after) {
  const Buffer& a = after.buffer("o");
  const Buffer& b = before.buffer("o");
  if (a.bytes.size() != b.bytes.size())
    return ::testing::AssertionFailure() << "o: " << a.bytes.size() << " bytes vs " << b.bytes.size();
  const ProblemConfig& c = before.config();
  const int64_t esize = dtype_size(c.in_dtype), ts = before.token_stride("o"), hs = before.head_stride("o");
  const int64_t logical_end = before.total_tokens() * ts * esize;
  for (int64_t i = 0; i < int64_t(a.bytes.size()); ++i) {
    const int64_t e = i / esize % ts;
    const bool logical = i < logical_end && e < c.HV * hs && e % hs < c.V;
    if (!logical && a.bytes[size_t(i)] != b.bytes[size_t(i)])
      return ::testing::AssertionFailure() << "o: padding written at token " << i / esize / ts << ", element " << e
                                           << " of its row (byte " << i << ")";
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult UntouchedSlotsEqual(const Problem& before, const Problem& after, const std::string& name,
                                               const std::vector<int64_t>& written) {
  const Buffer& a = after.buffer(name);
  const Buffer& b = before.buffer(name);
  if (a.bytes.size() != b.bytes.size())
    return ::testing::AssertionFailure() << name << ": " << a.bytes.size() << " bytes vs " << b.bytes.size();
  const int64_t esize = dtype_size(before.config().state_dtype);
  std::vector<char> skip(a.bytes.size(), 0);
  for (int64_t slot : written) {
    const int64_t begin = slot * before.slot_stride() * esize, end = begin + before.state_elems() * esize;
    std::fill(skip.begin() + begin, skip.begin() + std::min<int64_t>(end, int64_t(skip.size())), 1);
  }
  for (size_t i = 0; i < a.bytes.size(); ++i)
    if (!skip[i] && a.bytes[i] != b.bytes[i]) {
      const int64_t elem = int64_t(i) / esize, slot = elem / before.slot_stride();
      return ::testing::AssertionFailure() << name << ": untouched slot " << slot << " changed at element "
                                           << elem - slot * before.slot_stride() << " (byte " << i << ")";
    }
  if (!before.has(name + "_scales")) return ::testing::AssertionSuccess();
  // float8_e4m3: the untouched slots' block scales too
  const auto& sa = after.buffer(name + "_scales").bytes;
  const auto& sb = before.buffer(name + "_scales").bytes;
  const int64_t blocks = before.state_elems() / kFp8Block;
  std::vector<char> sskip(sa.size(), 0);
  for (int64_t slot : written) std::fill_n(sskip.begin() + slot * blocks, blocks, 1);
  for (size_t i = 0; i < sa.size(); ++i)
    if (!sskip[i] && sa[i] != sb[i])
      return ::testing::AssertionFailure() << name << ": the scales of untouched slot " << int64_t(i) / blocks
                                           << " changed at block " << int64_t(i) % blocks;
  return ::testing::AssertionSuccess();
}

std::vector<double> token_rows(const std::vector<double>& x, int64_t row_elems, int64_t t0, int64_t t1) {
  return std::vector<double>(x.begin() + t0 * row_elems, x.begin() + t1 * row_elems);
}

}  // namespace gdnkit::test
