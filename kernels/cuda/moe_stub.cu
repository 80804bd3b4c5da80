#include <stdexcept>
#include "kernels/cuda/cuda_backend.h"
namespace kiln {
#define STUB throw std::runtime_error("cuda moe: not yet")
void CudaBackend::moe_router_forward(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, const MoeRouting&) { STUB; }
void CudaBackend::moe_router_backward(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, const MoeRouting&, float) { STUB; }
void CudaBackend::moe_permute(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor) { STUB; }
void CudaBackend::moe_unpermute(Tensor, Tensor, Tensor, Tensor, bool) { STUB; }
void CudaBackend::moe_unpermute_backward(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor) { STUB; }
void CudaBackend::grouped_matmul_forward(Tensor, Tensor, Tensor, Tensor, Tensor) { STUB; }
void CudaBackend::grouped_matmul_backward(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor) { STUB; }
void CudaBackend::moe_bias_update(Tensor, Tensor, float) { STUB; }
}
