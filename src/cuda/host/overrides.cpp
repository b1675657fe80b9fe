// The process-wide overrides (overrides.h). Plain C++: the heuristics read them with or without CUDA.
#include "cuda/host/overrides.h"

namespace gdnkit::cuda {

Overrides& overrides() {
  static Overrides o;
  return o;
}

}  // namespace gdnkit::cuda
