#include "model/layers/mlp.h"

namespace kiln {

void Mlp::declare(LayoutBuilder& b, const std::string& name, int64_t C, bool bias) {
  fc.declare(b, name + ".fc", C, kind == MlpKind::swiglu ? 2 * ffn_dim : ffn_dim, bias);
  proj.declare(b, name + ".proj", ffn_dim, C, bias);
}

void Mlp::plan(const Planner& planner, const std::string& name, Acts& a, int64_t B, int64_t T,
               DType act) const {
  planner(&a.pre, name + "fch", {B, T, fc.out}, act);
  planner(&a.act, name + (kind == MlpKind::gelu ? "fch_gelu" : "fch_swiglu"), {B, T, ffn_dim}, act);
  planner(&a.out, name + "fcproj", {B, T, proj.out}, act);
}

void Mlp::plan_scratch(const Planner& planner, Scratch& s, int64_t B, int64_t T, DType act) const {
  planner(&s.dpre, "d.fch", {B, T, fc.out}, act);
  if (kind == MlpKind::swiglu) planner(&s.dact, "d.fch_swiglu", {B, T, ffn_dim}, act);
}

void Mlp::forward(Backend& k, const Params& w, const Acts& a, Tensor inp, bool project) const {
  if (kind == MlpKind::gelu) {
    fc.forward(k, w, a.act, inp, a.pre);
  } else {
    fc.forward(k, w, a.pre, inp);
    k.swiglu_forward(a.act, a.pre);
  }
  if (project) proj.forward(k, w, a.out, a.act);
}

void Mlp::backward(Backend& k, const Params& w, const Params& g, const Scratch& s, Tensor dinp,
                   Tensor dout, Tensor inp, const Acts& a) const {
  if (kind == MlpKind::gelu) {
    proj.backward(k, w, g, s.dpre, dout, a.act, a.pre);
  } else {
    proj.backward(k, w, g, s.dact, dout, a.act);
    k.swiglu_backward(s.dpre, s.dact, a.pre);
  }
  fc.backward(k, w, g, dinp, s.dpre, inp);
}

}  // namespace kiln
