// The ops' argument contracts: what every op requires of its arguments (shapes, dtypes by role,
// sizes, scalars), checked by Backend before any backend runs the op, so a contract is written
// once and both backends refuse the same calls with the same message. Dtypes are roles (OpCheck):
// the activation dtype is f32 on the CPU and bf16 on CUDA. What one backend needs beyond this
// stays with it: the CPU reads index and offset values (its tensors are host memory), CUDA its
// alignment and the sizes its kernels take.
//
// kernels/backend.h declares one contract::<op> per entry of kernels/ops.def; they are defined
// by family, each file in ops.def's order: contracts_dense.cpp (embedding, norms, linear,
// attention, RoPE, SwiGLU, loss), contracts_moe.cpp (moe_*, grouped_matmul_*),
// contracts_fp8.cpp (fp8_*, swiglu_*_fp8) and contracts_optimizer.cpp (reductions, AdamW,
// Muon, add). This header holds the checks more than one family uses.
#pragma once

#include "kernels/backend.h"

namespace kiln::contract {

// A linear layer's backward but for its output gradient: weight [OC,C], inp [..., C], dweight
// like weight, and the optional dinp and inp_pre_gelu like inp.
void check_linear_grads(const OpCheck& c, const Tensor& dinp, const Tensor& dweight,
                        const Tensor& inp, const Tensor& weight, const Tensor& inp_pre_gelu);

// inp [..., 2F] (gate then up) of a SwiGLU; returns the shape of its output [..., F].
Shape check_swiglu_inp(const OpCheck& c, const char* name, const Tensor& inp);

}  // namespace kiln::contract
