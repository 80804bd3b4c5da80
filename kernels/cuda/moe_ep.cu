// MoE expert parallelism's data movement (reference: kernels/cpu/moe_ep.cpp) is not on the GPU
// yet: the trainer refuses dist.expert_parallel > 1 on CUDA before planning, and these say why
// if anything else calls them. Kernels come with a GPU session to test them against the CPU.
#include "kernels/cuda/cuda_backend.h"
#include "kernels/error.h"

namespace kiln {

namespace {

[[noreturn]] void not_on_cuda(const char* op) {
  throw InputError(std::string("cuda ") + op +
                   ": MoE expert parallelism (dist.expert_parallel > 1) runs on the CPU backend "
                   "only so far");
}

}  // namespace

void CudaBackend::moe_ep_split(Tensor, Tensor, Tensor, Tensor) { not_on_cuda("moe_ep_split"); }
void CudaBackend::moe_ep_join(Tensor, Tensor, Tensor) { not_on_cuda("moe_ep_join"); }
void CudaBackend::moe_ep_group(Tensor, Tensor, Tensor, Tensor) { not_on_cuda("moe_ep_group"); }
void CudaBackend::moe_ep_ungroup(Tensor, Tensor, Tensor) { not_on_cuda("moe_ep_ungroup"); }

}  // namespace kiln
