// CUDA entries whose kernels have not landed yet: they fail loudly instead of computing nothing.
// Each kernel issue removes its function from this file when its kernel lands.
#include "api/backends.h"

namespace gdnkit::cuda {
namespace {
[[noreturn]] void not_yet(const char* op) {
  throw Error(ErrorCode::kNotImplemented, std::string("cuda ") + op + ": not implemented yet");
}
}  // namespace


}  // namespace gdnkit::cuda
