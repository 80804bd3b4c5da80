// CpuBackend: the fp32 reference implementation of the Backend op set, the ground truth every
// CUDA kernel is checked against. Activations, parameters and gradients are all f32. The ops are
// defined one family per file (encoder.cpp, layernorm.cpp, rmsnorm.cpp, qk_norm.cpp, rope.cpp,
// matmul.cpp, grouped_matmul.cpp, fp8.cpp, swiglu.cpp, moe_router.cpp, moe_permute.cpp,
// moe_ep.cpp, attention.cpp, attention_cp.cpp (with copy_columns), classifier.cpp,
// optimizer.cpp) as run_<op>, called once the op's
// contract has checked the arguments (kernels/contracts.h); this class only gathers them.
//
// Determinism is part of what the reference promises: OpenMP splits work only over independent
// output rows or elements (static schedule), and every sum runs in a fixed order that does not
// depend on the thread count, so results are bit-identical run to run and for any
// OMP_NUM_THREADS.
#pragma once

#include "kernels/backend.h"

namespace kiln {

class CpuBackend final : public Backend {
 public:
  Device device() const override { return Device::cpu; }
  std::string name() const override { return "cpu"; }
  DType activation_dtype() const override { return DType::f32; }

  void* allocate(size_t bytes) override;
  void release(void* p) noexcept override;
  void copy_from_host(Tensor dst, const void* src) override;
  void copy_to_host(void* dst, Tensor src) override;
  void copy(Tensor dst, Tensor src) override;
  void fill_zero(Tensor t) override;
  void synchronize() override {}

  bool fp8_backward_in_fp8(const Fp8Linear& f, int64_t N, int64_t C, int64_t OC) override;

 protected:
#define KILN_OP KILN_OP_OVERRIDE
#include "kernels/ops.def"
};

}  // namespace kiln
