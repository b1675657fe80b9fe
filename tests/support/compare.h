// Comparisons for the test suites: relative error against a reference (NaN fails), zeros, and
// bit-identical pools outside the slots an op may write. Each returns ::testing::AssertionResult with
// the numbers in the message:  EXPECT_TRUE(RelClose("o", got, ref, kDecodeOutBf16));
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "support/problem.h"
#include "gdnkit/types.h"

namespace gdnkit::test {

// docs/semantics.md "Tolerances": rel = ||x - ref|| / ||ref|| against an fp64 reference.
// "Step" ops are decode, verify and commit; prefill is the chunked prefill.
inline constexpr double kStepOutBf16 = 4e-3;  // also used for fp16 outputs
inline constexpr double kStepOutFp32 = 5e-5;
inline constexpr double kStepStateFp32 = 1e-5;
inline constexpr double kStepStateBf16 = 8e-3;
inline constexpr double kStepStateFp16 = 1e-3;  // the store's rounding: 2^-11 relative against bf16's 2^-8
inline constexpr double kPrefillOutBf16 = 5e-3;
inline constexpr double kPrefillOutFp32 = 2e-3;
inline constexpr double kPrefillStateFp32 = 5e-3;
inline constexpr double kPrefillStateBf16 = 8e-3;
inline constexpr double kPrefillStateFp16 = 5e-3;  // the chunked passes' 16-bit operands dominate, as for fp32
// float8_e4m3 against a reference that stores e4m3 too (the same host quantization): an fp32 difference d moves a
// fraction of the elements across a rounding boundary, one code each, which grows about as sqrt(0.09 d) (d = 1e-3:
// 7e-3; 5e-3: 1.7e-2), far above d itself.
inline constexpr double kStepStateFp8 = 1e-2;
inline constexpr double kPrefillStateFp8 = 2e-2;

enum class OpFamily { kStep, kPrefill };
double output_tolerance(OpFamily op, DType out_dtype);
double state_tolerance(OpFamily op, DType state_dtype);
// Absolute error per element that storing in `dtype` allows whatever the relative tolerance: fp16 holds values
// below 2^-14 (a state decayed by extreme gates) as subnormals, in steps of 2^-24; 0 for bf16 and fp32.
double storage_floor(DType dtype);

struct ErrorStats {
  double rel = 0;         // ||x - ref|| / ||ref|| (||x - ref|| when ||ref|| == 0)
  double max_abs = 0;     // max |x - ref|
  int64_t worst = -1;     // index of max_abs
  int64_t nan_count = 0;  // non-finite values in x (or ref)
  double ref_norm = 0;
};
ErrorStats error_stats(const std::vector<double>& x, const std::vector<double>& ref);

// ||x - ref|| <= tol ||ref|| + abs_floor sqrt(n) and no NaN/Inf in x or ref.
::testing::AssertionResult RelClose(const std::string& what, const std::vector<double>& x,
                                    const std::vector<double>& ref, double tol, double abs_floor = 0.0);
// Every element exactly 0.
::testing::AssertionResult AllZero(const std::string& what, const std::vector<double>& x);
// Exactly equal values (NaN never equals).
::testing::AssertionResult Identical(const std::string& what, const std::vector<double>& x,
                                     const std::vector<double>& ref);
// Bit-identical bytes.
::testing::AssertionResult BitwiseEqual(const std::string& what, const Buffer& x, const Buffer& ref);
// The pool buffer `name` of `after` equals `before` bit for bit, except the state region
// [slot * slot_stride, slot * slot_stride + HV*K*V) of each slot in `written` (the slot padding is
// compared too).
::testing::AssertionResult UntouchedSlotsEqual(const Problem& before, const Problem& after, const std::string& name,
                                               const std::vector<int64_t>& written);

// o's padding (the elements between heads and past the last head of each token row, and past the last row) equals
// `before` bit for bit: a store past V or between heads shows.
::testing::AssertionResult OutputPaddingUntouched(const Problem& before, const Problem& after);
// Token rows of a [T_total][heads][dim] read (Problem::read_tokens) belonging to rows [t0, t1).
std::vector<double> token_rows(const std::vector<double>& x, int64_t row_elems, int64_t t0, int64_t t1);

}  // namespace gdnkit::test
