// One decode step on a pool of recurrent states (CPU backend; Backend::kCUDA with device pointers and a
// stream runs the same params on the GPU). Built against an installed gdnkit by tools/test.sh.
#include <gdnkit/gdnkit.h>

#include <cmath>
#include <cstdio>
#include <vector>

int main() {
  const int B = 2, H = 2, HV = 4, K = 128, V = 128, P = 8;  // batch, q/k heads, v heads, head dims, slots
  std::vector<float> q(B * H * K, 0.1f), k(B * H * K, 0.2f), v(B * HV * V, 0.3f), o(B * HV * V);
  std::vector<float> a(B * HV, 0.5f), b(B * HV, 0.0f), A_log(HV, 0.0f), dt_bias(HV, 0.0f);
  std::vector<float> pool(size_t(P) * HV * K * V, 0.0f);  // [P, HV, V, K] (K-last), fp32
  std::vector<int32_t> slots = {5, 2};  // pool slot of each sequence; -1 would be a padding row

  using gdnkit::DType;
  gdnkit::DecodeParams p;
  p.heads = {.num_qk_heads = H, .num_v_heads = HV, .head_dim_k = K, .head_dim_v = V};
  p.batch = B;
  p.q = {q.data(), DType::kFloat32, H * K, K};  // {data, dtype, token stride, head stride}
  p.k = {k.data(), DType::kFloat32, H * K, K};
  p.v = {v.data(), DType::kFloat32, HV * V, V};
  p.o = {o.data(), DType::kFloat32, HV * V, V};
  p.gating.mode = gdnkit::GateMode::kFused;  // g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)
  p.gating.a = {a.data(), DType::kFloat32, HV, 1};
  p.gating.b = {b.data(), DType::kFloat32, HV, 1};
  p.gating.A_log = A_log.data();
  p.gating.dt_bias = dt_bias.data();
  p.state = {pool.data(), DType::kFloat32, gdnkit::StateLayout::kKLast, P, HV * K * V};
  p.state_indices = slots.data();

  try {
    gdnkit::decode(p, {gdnkit::Backend::kCPU});  // validates, then updates pool[5] and pool[2] in place
  } catch (const gdnkit::Error& e) {
    std::fprintf(stderr, "gdnkit: %s\n", e.what());
    return 1;
  }
  // From S = 0: o = beta * v * (k.q after L2 norm) * scale = 0.5 * 0.3 * 1 / sqrt(128).
  const float expected = 0.5f * 0.3f / std::sqrt(128.0f);
  std::printf("o[0] = %.6f (expected %.6f)\n", o[0], expected);
  return std::fabs(o[0] - expected) < 1e-4f ? 0 : 1;
}
