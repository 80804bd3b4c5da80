// Linear: out[N,out] = inp[N,in] @ weight[out,in]^T (+ bias), one cuBLASLt GEMM on CUDA. The
// GELU epilogue (pre_gelu) is the MLP's; decay applies to the weight only. With `fp8` set (the
// decoder points it at the layer's operands under precision.fp8), the input and, in backward,
// the output gradient are cast to FP8 first and the GEMMs run in FP8 (kernels/fp8.h).
#pragma once

#include <string>

#include "model/layers/layer.h"
#include "model/param_layout.h"

namespace kiln {

struct Linear {
  int weight = -1, bias = -1;
  int64_t in = 0, out = 0;
  const Fp8Linear* fp8 = nullptr;

  void declare(LayoutBuilder& b, const std::string& name, int64_t in_features, int64_t out_features,
               bool with_bias);
  // x8_made: the input's FP8 copy (fp8->x8) was made by the op that produced inp
  // (swiglu_forward_fp8), so the layer does not cast it.
  void forward(Backend& k, const Params& w, Tensor out_t, Tensor inp, Tensor pre_gelu = {},
               bool x8_made = false) const;
  // dinp = dout @ weight (times gelu'(inp_pre_gelu) when given); grads += dout^T @ inp, or =
  // where not `accumulate`. An undefined dout means the output gradient was made in FP8 only
  // (fp8->g8 and g8_t, by swiglu_backward_fp8), which the caller may do where the backend's
  // fp8_backward_in_fp8 holds.
  void backward(Backend& k, const Params& w, const Params& g, Tensor dinp, Tensor dout, Tensor inp,
                bool accumulate, Tensor inp_pre_gelu = {}) const;
  // The backward when inp = swiglu(pre) (the SwiGLU MLP's proj, bf16 or f32, not FP8):
  // dpre = swiglu_backward(dout @ weight, pre), grads (+)= dout^T @ inp; dact is [N,in] scratch
  // for a backend that does not fuse SwiGLU into the GEMM (Backend::swiglu_matmul_backward).
  void backward_through_swiglu(Backend& k, const Params& w, const Params& g, Tensor dpre,
                               Tensor dout, Tensor inp, Tensor pre, Tensor dact,
                               bool accumulate) const;
};

}  // namespace kiln
