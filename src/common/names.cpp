#include "gdnkit/types.h"

namespace gdnkit {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kFloat8E4M3: return "float8_e4m3";
  }
  return "unknown-dtype";
}

int dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: case DType::kInt32: return 4;
    case DType::kBFloat16: case DType::kFloat16: return 2;
    case DType::kInt64: return 8;
    case DType::kFloat8E4M3: return 1;
  }
  return 0;
}

const char* layout_name(StateLayout layout) {
  return layout == StateLayout::kKLast ? "K-last [V,K]" : "V-last [K,V]";
}

const char* backend_name(Backend backend) { return backend == Backend::kCPU ? "cpu" : "cuda"; }

}  // namespace gdnkit
