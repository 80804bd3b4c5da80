// Pre-norm: LayerNorm (weight and bias, eps 1e-5) or RMSNorm (weight only, eps chosen), with
// the residual add fused in front of it where a block's branch rejoins the stream. Its input and
// the sum are the residual stream (f32 or the activation dtype), its output an activation.
// Backward ACCUMULATES into dinp, the residual stream's gradient, so the skip connection costs
// nothing.
#pragma once

#include <string>

#include "model/arch.h"
#include "model/layers/layer.h"
#include "model/param_layout.h"

namespace kiln {

struct Norm {
  NormKind kind = NormKind::layernorm;
  float eps = 1e-5f;
  int weight = -1, bias = -1;

  struct Acts {
    Tensor out, mean, rstd;  // mean: LayerNorm only
  };

  void declare(LayoutBuilder& b, const std::string& name, int64_t C);
  void plan(const Planner& planner, const std::string& name, Acts& a, int64_t B, int64_t T,
            int64_t C, DType act) const;
  void forward(Backend& k, const Params& w, const Acts& a, Tensor inp) const;
  // residual = x + y, then a.out = norm(residual).
  void residual_forward(Backend& k, const Params& w, const Acts& a, Tensor residual, Tensor x,
                        Tensor y) const;
  // dinp += d/dinp; weight (and bias) grads +=, or = where not `accumulate`; dinp_act
  // (optional) = dinp in the activation dtype, for the branch below when the residual stream is
  // wider (Backend::layernorm_backward).
  void backward(Backend& k, const Params& w, const Params& g, Tensor dinp, Tensor dout, Tensor inp,
                const Acts& a, bool accumulate, Tensor dinp_act = {}) const;
};

}  // namespace kiln
