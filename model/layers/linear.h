// Linear: out[N,out] = inp[N,in] @ weight[out,in]^T (+ bias), one cuBLASLt GEMM on CUDA. The
// GELU epilogue (pre_gelu) is the MLP's; decay applies to the weight only.
#pragma once

#include <string>

#include "model/layers/layer.h"
#include "model/param_layout.h"

namespace kiln {

struct Linear {
  int weight = -1, bias = -1;
  int64_t in = 0, out = 0;

  void declare(LayoutBuilder& b, const std::string& name, int64_t in_features, int64_t out_features,
               bool with_bias);
  void forward(Backend& k, const Params& w, Tensor out_t, Tensor inp, Tensor pre_gelu = {}) const {
    k.matmul_forward(out_t, inp, param(w, weight), param(w, bias), pre_gelu);
  }
  // dinp = dout @ weight (times gelu'(inp_pre_gelu) when given); grads += dout^T @ inp.
  void backward(Backend& k, const Params& w, const Params& g, Tensor dinp, Tensor dout, Tensor inp,
                Tensor inp_pre_gelu = {}) const {
    k.matmul_backward(dinp, param(g, weight), param(g, bias), dout, inp, param(w, weight),
                      inp_pre_gelu);
  }
};

}  // namespace kiln
