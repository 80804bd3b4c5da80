#include "model/layers/norm.h"

namespace kiln {

void Norm::declare(LayoutBuilder& b, const std::string& name, int64_t C) {
  weight = b.add(name + ".weight", {C}, false);
  b.read_in_f32(weight);
  bias = kind == NormKind::layernorm ? b.add(name + ".bias", {C}, false) : -1;
  if (bias >= 0) b.read_in_f32(bias);
}

void Norm::plan(const Planner& planner, const std::string& name, Acts& a, int64_t B, int64_t T,
                int64_t C, DType act) const {
  planner(&a.out, name, {B, T, C}, act);
  if (kind == NormKind::layernorm) planner(&a.mean, name + "_mean", {B, T}, DType::f32);
  planner(&a.rstd, name + "_rstd", {B, T}, DType::f32);
}

void Norm::forward(Backend& k, const Params& w, const Acts& a, Tensor inp) const {
  if (kind == NormKind::layernorm)
    k.layernorm_forward(a.out, a.mean, a.rstd, inp, param(w, weight), param(w, bias));
  else
    k.rmsnorm_forward(a.out, a.rstd, inp, param(w, weight), eps);
}

void Norm::residual_forward(Backend& k, const Params& w, const Acts& a, Tensor residual, Tensor x,
                            Tensor y) const {
  if (kind == NormKind::layernorm)
    k.residual_layernorm_forward(residual, a.out, a.mean, a.rstd, x, y, param(w, weight),
                                 param(w, bias));
  else
    k.residual_rmsnorm_forward(residual, a.out, a.rstd, x, y, param(w, weight), eps);
}

void Norm::backward(Backend& k, const Params& w, const Params& g, Tensor dinp, Tensor dout,
                    Tensor inp, const Acts& a, bool accumulate, Tensor dinp_act) const {
  // The ops accumulate; a gain is a few kilobytes to clear.
  if (!accumulate) {
    k.fill_zero(param(g, weight));
    if (bias >= 0) k.fill_zero(param(g, bias));
  }
  if (kind == NormKind::layernorm)
    k.layernorm_backward(dinp, param(g, weight), param(g, bias), dout, inp, param(w, weight),
                         a.mean, a.rstd, dinp_act);
  else
    k.rmsnorm_backward(dinp, param(g, weight), dout, inp, param(w, weight), a.rstd, dinp_act);
}

}  // namespace kiln
