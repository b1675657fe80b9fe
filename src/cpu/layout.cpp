// CPU reference: pool layout conversion K-last <-> V-last (a per-head transpose; bit-exact copy, but for
// float8_e4m3, whose blocks run along the other dim afterwards: read with the old scales, stored with new ones).
#include <cstring>
#include <vector>

#include "cpu/backend.h"
#include "cpu/reference.h"

namespace gdnkit::cpu {

void convert_layout(const LayoutParams& p) {
  const int64_t K = p.head_dim_k, V = p.head_dim_v;
  if (p.src.dtype == DType::kFloat8E4M3) {
    std::vector<double> S(size_t(K * V));
    const int HV = int(p.num_v_heads);
    for (int64_t slot = 0; slot < p.src.num_slots; ++slot)
      for (int h = 0; h < HV; ++h) {
        detail::load_state(detail::pool_head(p.src, slot, HV, h, int(K), int(V)), int(K), int(V), S.data());
        detail::store_state(detail::pool_head(p.dst, slot, HV, h, int(K), int(V)), int(K), int(V), S.data());
      }
    return;
  }
  const int64_t esize = dtype_size(p.src.dtype);
  // Source block of one head: rows x cols, row-major. K-last stores [V][K], V-last [K][V].
  const int64_t rows = p.src.layout == StateLayout::kKLast ? V : K;
  const int64_t cols = p.src.layout == StateLayout::kKLast ? K : V;
  // Validation asks for opposite layouts; equal ones would be a plain copy, never a transpose.
  const bool transpose = p.src.layout != p.dst.layout;
  const int64_t block = K * V * esize;
  // Every head goes through a copy, so dst may alias src (in place, K == V): the transpose of a
  // block is computed from its saved copy before the block is overwritten.
  std::vector<std::byte> tmp(block);
  const auto* src = static_cast<const std::byte*>(p.src.data);
  auto* dst = static_cast<std::byte*>(p.dst.data);
  for (int64_t slot = 0; slot < p.src.num_slots; ++slot)
    for (int64_t h = 0; h < p.num_v_heads; ++h) {
      std::memcpy(tmp.data(), src + (slot * p.src.slot_stride + h * K * V) * esize, block);
      std::byte* out = dst + (slot * p.dst.slot_stride + h * K * V) * esize;
      if (!transpose) {
        std::memcpy(out, tmp.data(), block);
        continue;
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c)
          std::memcpy(out + (c * rows + r) * esize, tmp.data() + (r * cols + c) * esize, esize);
    }
}

}  // namespace gdnkit::cpu
