// Context-parallel attention on CUDA: not built yet.
#include <stdexcept>

#include "kernels/cuda/cuda_backend.h"

namespace kiln {

void CudaBackend::run_attention_cp_forward(Tensor, Tensor, Tensor, Tensor, const AttentionDims&,
                                           const QueryChunks&, Tensor) {
  throw std::invalid_argument("attention_cp_forward: not built for CUDA yet");
}

void CudaBackend::run_attention_cp_backward(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                            const AttentionDims&, const QueryChunks&, Tensor) {
  throw std::invalid_argument("attention_cp_backward: not built for CUDA yet");
}

}  // namespace kiln
