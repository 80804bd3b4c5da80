#include "kernels/backend.h"

#include <algorithm>
#include <stdexcept>

namespace kiln {

OpCheck Backend::op_check(const char* op) const {
  return OpCheck{op, device(), activation_dtype()};
}

// Per matrix (m = min(rows, cols), k = max): the iterate and the next one (m x k each), the Gram
// matrix and its polynomial (m x m each), and the norm; a CUDA backend keeps them in bf16, in
// half of it, and aligns its pieces in the 256 values at the end.
int64_t newton_schulz_workspace(int64_t n, int64_t rows, int64_t cols) {
  const int64_t m = std::min(rows, cols), k = std::max(rows, cols);
  return n * (2 * m * k + 2 * m * m + 1) + 256;
}

#ifndef KILN_WITH_CUDA
std::unique_ptr<Backend> make_cuda_backend(int) {
  throw std::runtime_error("this kiln was built without CUDA (KILN_CUDA=OFF or no nvcc)");
}
bool cuda_available() { return false; }
int cuda_device_count() { return 0; }
bool cuda_device_memory(int, std::string*, size_t*) { return false; }
#endif

}  // namespace kiln
