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
    if (project) proj.forward(k, w, a.out, a.act);
    return;
  }
  fc.forward(k, w, a.pre, inp);
  if (project && proj.fp8) {
    // SwiGLU writes proj's FP8 input in the same pass (the cast would read act back).
    const Fp8Linear& f = *proj.fp8;
    k.swiglu_forward_fp8(a.act, f.x8, a.pre, f.state, f.layout, f.index + kFp8X);
    proj.forward(k, w, a.out, a.act, Tensor{}, /*x8_made=*/true);
    return;
  }
  k.swiglu_forward(a.act, a.pre);
  if (project) proj.forward(k, w, a.out, a.act);
}

void Mlp::backward(Backend& k, const Params& w, const Params& g, const Scratch& s, Tensor dinp,
                   Tensor dout, Tensor inp, const Acts& a, bool accumulate) const {
  if (kind == MlpKind::gelu) {
    proj.backward(k, w, g, s.dpre, dout, a.act, accumulate, a.pre);
    fc.backward(k, w, g, dinp, s.dpre, inp, accumulate);
    return;
  }
  const int64_t N = inp.numel() / fc.in;
  if (fc.fp8 && fc.bias < 0 && k.fp8_backward_in_fp8(*fc.fp8, N, fc.in, fc.out)) {
    // fc's output gradient goes straight to FP8: its bf16 copy is never written or read back.
    proj.backward(k, w, g, s.dact, dout, a.act, accumulate);
    const Fp8Linear& f = *fc.fp8;
    k.swiglu_backward_fp8(f.g8, f.g8_t, s.dact, a.pre, f.state, f.layout, f.index + kFp8G);
    fc.backward(k, w, g, dinp, Tensor{}, inp, accumulate);
    return;
  }
  if (proj.fp8) {
    proj.backward(k, w, g, s.dact, dout, a.act, accumulate);
    k.swiglu_backward(s.dpre, s.dact, a.pre);
  } else {
    proj.backward_through_swiglu(k, w, g, s.dpre, dout, a.act, a.pre, s.dact, accumulate);
  }
  fc.backward(k, w, g, dinp, s.dpre, inp, accumulate);
}

}  // namespace kiln
