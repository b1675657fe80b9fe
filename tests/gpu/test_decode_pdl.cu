// Decode behind a kernel that rewrites state_indices while decode's CTAs are already running. Decode is
// launched with programmatic dependent launch: at small batches its CTAs start before the previous
// kernel ends, read the slot indices early to prefetch the states into L2, and must still use the
// indices as they are after that kernel (warp_kernel.cuh, "prefetch mode"). Here the previous kernel
// lets its dependents launch, waits 200 microseconds, then rotates the indices by one row: every row's
// slot changes after decode's early read. The result must equal the CPU reference on the rotated
// indices, and untouched slots must stay bit-identical.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cuda/host/overrides.h"
#include "support/compare.h"
#include "support/problem.h"
#include "gdnkit/gdnkit.h"
#include "gpu/gpu_harness.h"

namespace gdnkit::test {
namespace {

__device__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// One thread: dependents may launch now; after `wait_ns`, indices <- next.
__global__ void rewrite_indices_kernel(int32_t* indices, const int32_t* next, int n, unsigned long long wait_ns) {
  asm volatile("griddepcontrol.launch_dependents;");
  const unsigned long long t0 = global_ns();
  while (global_ns() - t0 < wait_ns) {
  }
  for (int i = 0; i < n; ++i) indices[i] = next[i];
}

TEST(DecodeGpu, IndicesRewrittenByThePreviousKernelUnderPdl) {
  for (StateLayout layout : {StateLayout::kKLast, StateLayout::kVLast})
    for (DType state : {DType::kFloat32, DType::kBFloat16, DType::kFloat8E4M3})
      // V-last float8_e4m3 in both CTA pieces: the library's (64 columns at this size) and 128 (whose update reads the
      // rows of the index's slot again)
      for (int columns : {0, 128}) {
        if (columns != 0 && !(layout == StateLayout::kVLast && state == DType::kFloat8E4M3)) continue;
        cuda::Overrides o;
        o.decode_vlast_fp8_columns = columns;
        const cuda::ScopedOverrides scoped(o);
        ProblemConfig c;
        c.op = OpKind::kDecode;
        // Small, so that decode runs in prefetch mode: K-last float8_e4m3 decode takes it for grids of at most an
        // eighth of the resident CTAs (heuristics.h fp8_decode_prefetch: 4 rows of 8 value heads, 64 CTAs).
        const bool fp8 = state == DType::kFloat8E4M3;
        c.batch = fp8 ? 3 : 4, c.padding_rows = 1;
        c.H = fp8 ? 4 : 16, c.HV = fp8 ? 8 : 32, c.K = 128, c.V = 128;
        c.layout = layout, c.state_dtype = state;
        c.seed = 4242 + 2 * int(layout) + int(state);
        const Problem before(c);
        const int32_t B = before.rows();
        std::vector<int32_t> rotated(static_cast<size_t>(B));
        for (int32_t r = 0; r < B; ++r) rotated[size_t(r)] = before.as<int32_t>("state_indices")[(r + 1) % B];

        Problem ref = before;
        for (int32_t r = 0; r < B; ++r) ref.as<int32_t>("state_indices")[r] = rotated[size_t(r)];
        decode(ref.decode_params(), {Backend::kCPU, nullptr});

        Problem got = before;
        DeviceProblem dev(got);
        int32_t* d_next = nullptr;
        GDNKIT_TEST_CUDA(cudaMalloc(&d_next, rotated.size() * sizeof(int32_t)));
        GDNKIT_TEST_CUDA(cudaMemcpy(d_next, rotated.data(), rotated.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
        rewrite_indices_kernel<<<1, 1, 0, dev.stream()>>>(static_cast<int32_t*>(dev.device("state_indices")), d_next, B,
                                                          200000ull);
        GDNKIT_TEST_CUDA(cudaGetLastError());
        decode(got.decode_params(dev.resolver()), {Backend::kCUDA, dev.stream()});
        // the indices as the rewrite left them on the device, which download() expects
        for (int32_t r = 0; r < B; ++r) got.as<int32_t>("state_indices")[r] = rotated[size_t(r)];
        dev.download(got);
        GDNKIT_TEST_CUDA(cudaFree(d_next));

        const std::string what = std::string(layout == StateLayout::kKLast ? "K-last" : "V-last") + " state " +
                                 dtype_name(state) + (columns != 0 ? ", 128 columns" : "");
        // ref's written slots are the rotated rows' slots: the same set as before's.
        const std::vector<int64_t> written = ref.written_pool_slots_decode();
        EXPECT_TRUE(OutputsClose(got, ref, output_tolerance(OpFamily::kStep, c.in_dtype))) << what;
        EXPECT_TRUE(SlotsClose(got, ref, written, state_tolerance(OpFamily::kStep, state))) << what;
        EXPECT_TRUE(UntouchedSlotsEqual(before, got, "state", written)) << what;
      }
}

}  // namespace
}  // namespace gdnkit::test
