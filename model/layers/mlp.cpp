#include "model/layers/mlp.h"

#include <stdexcept>
#include <string>

namespace kiln {

void Mlp::declare(LayoutBuilder& b, const std::string& name, int64_t C, bool bias, bool split) {
  const bool gated = kind == MlpKind::swiglu;
  fc.declare(b, name + ".fc", C, gated ? 2 * ffn_dim : ffn_dim, bias,
             split ? LinearSplit::column : LinearSplit::none,
             gated ? std::vector<int64_t>{ffn_dim, ffn_dim} : std::vector<int64_t>{});
  proj.declare(b, name + ".proj", ffn_dim, C, bias, split ? LinearSplit::row : LinearSplit::none);
  // SwiGLU's gate and up are two matrices packed as one.
  b.hidden_matrix(fc.weight,
                  gated ? std::vector<int64_t>{ffn_dim, ffn_dim} : std::vector<int64_t>{});
  b.hidden_matrix(proj.weight);
}

void Mlp::set_tensor_parallel(const TensorParallel& t) {
  if (ffn_dim % t.ranks != 0)
    throw std::invalid_argument("the MLP's " + std::to_string(ffn_dim) +
                                " hidden units must split over " + std::to_string(t.ranks) +
                                " ranks (model.ffn_dim)");
  tp = t;
  ffn_dim /= t.ranks;
  fc.set_tensor_parallel(t.ranks, t.rank);
  proj.set_tensor_parallel(t.ranks, t.rank);
}

void Mlp::plan(const Planner& planner, const std::string& name, Acts& a, int64_t B, int64_t T,
               DType act) const {
  planner(&a.pre, name + "fch", {B, T, fc.out}, act);
  planner(&a.act, name + (kind == MlpKind::gelu ? "fch_gelu" : "fch_swiglu"), {B, T, ffn_dim}, act);
  planner(&a.out, name + "fcproj",
          tp.on() ? Shape{1, B * T / tp.ranks, proj.out} : Shape{B, T, proj.out}, act);
}

void Mlp::plan_scratch(const Planner& planner, Scratch& s, int64_t B, int64_t T, DType act) const {
  planner(&s.dpre, "d.fch", {B, T, fc.out}, act);
  if (kind == MlpKind::swiglu) planner(&s.dact, "d.fch_swiglu", {B, T, ffn_dim}, act);
}

void Mlp::forward(Backend& k, const Params& w, const Acts& a, const Scratch& s, Tensor inp,
                  bool project) const {
  const bool gelu = kind == MlpKind::gelu;
  // Under tp, every token's input, gathered piece by piece beside fc's GEMM on the piece before.
  if (tp.on())
    tp.gather_tokens(s.gathered, inp, [&](int64_t first, int64_t n) {
      fc.forward_rows(k, w, gelu ? a.act : a.pre, s.gathered, first, n,
                      gelu ? a.pre : Tensor{});
    });
  else
    fc.forward(k, w, gelu ? a.act : a.pre, inp, gelu ? a.pre : Tensor{});
  // SwiGLU writes proj's FP8 input in the same pass (the cast would read act back).
  const bool x8_made = !gelu && project && proj.fp8;
  if (x8_made) {
    const Fp8Linear& f = *proj.fp8;
    k.swiglu_forward_fp8(a.act, f.x8, a.pre, f.state, f.layout, f.index + kFp8X);
  } else if (!gelu) {
    k.swiglu_forward(a.act, a.pre);
  }
  if (!project) return;
  // proj's output under tp: the rank's partial sum of every token's, summed into its tokens
  // piece by piece beside proj's GEMM on the next piece.
  if (tp.on())
    tp.scatter_tokens(a.out, s.partial, [&](int64_t first, int64_t n) {
      proj.forward_rows(k, w, s.partial, a.act, first, n, Tensor{}, x8_made);
    });
  else
    proj.forward(k, w, a.out, a.act, Tensor{}, x8_made);
}

void Mlp::backward(Backend& k, const Params& w, const Params& g, const Scratch& s, Tensor dinp,
                   Tensor dout, Tensor inp, const Acts& a, bool accumulate) const {
  if (!tp.on()) return backward_local(k, w, g, s, dinp, dout, inp, a, accumulate);
  // Every token's output gradient for proj; every token's input for fc's weight gradient,
  // gathered beside proj's backward; fc's input gradient, a partial sum for every token (in the
  // first buffer again, once proj's backward has read it), summed into this rank's tokens.
  tp.gather_tokens(s.gathered, dout);
  const uint64_t inp_gathered = tp.start_gather_tokens(s.partial, inp);
  backward_local(k, w, g, s, s.gathered, s.gathered, inp, a, accumulate, [&] {
    tp.finish(inp_gathered);
    return s.partial;
  });
  tp.scatter_tokens(dinp, s.gathered);
}

void Mlp::backward_local(Backend& k, const Params& w, const Params& g, const Scratch& s,
                         Tensor dinp, Tensor dout, Tensor inp, const Acts& a, bool accumulate,
                         const std::function<Tensor()>& fc_input) const {
  // fc's input, once proj's backward is done with dout.
  auto input = [&] { return fc_input ? fc_input() : inp; };
  if (kind == MlpKind::gelu) {
    proj.backward(k, w, g, s.dpre, dout, a.act, accumulate, a.pre);
    fc.backward(k, w, g, dinp, s.dpre, input(), accumulate);
    return;
  }
  const int64_t N = a.pre.numel() / fc.out;
  if (fc.fp8 && fc.bias < 0 && k.fp8_backward_in_fp8(*fc.fp8, N, fc.in, fc.out)) {
    // fc's output gradient goes straight to FP8: its bf16 copy is never written or read back.
    proj.backward(k, w, g, s.dact, dout, a.act, accumulate);
    const Fp8Linear& f = *fc.fp8;
    k.swiglu_backward_fp8(f.g8, f.g8_t, s.dact, a.pre, f.state, f.layout, f.index + kFp8G);
    fc.backward(k, w, g, dinp, Tensor{}, input(), accumulate);
    return;
  }
  if (proj.fp8) {
    proj.backward(k, w, g, s.dact, dout, a.act, accumulate);
    k.swiglu_backward(s.dpre, s.dact, a.pre);
  } else {
    proj.backward_through_swiglu(k, w, g, s.dpre, dout, a.act, a.pre, s.dact, accumulate);
  }
  fc.backward(k, w, g, dinp, s.dpre, input(), accumulate);
}

}  // namespace kiln
