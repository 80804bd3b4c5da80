#include "model/layers/linear.h"

namespace kiln {

void Linear::declare(LayoutBuilder& b, const std::string& name, int64_t in_features,
                     int64_t out_features, bool with_bias) {
  in = in_features;
  out = out_features;
  weight = b.add(name + ".weight", {out, in}, true);
  bias = with_bias ? b.add(name + ".bias", {out}, false) : -1;
}

void Linear::forward(Backend& k, const Params& w, Tensor out_t, Tensor inp, Tensor pre_gelu,
                     bool x8_made) const {
  if (!fp8) {
    k.matmul_forward(out_t, inp, param(w, weight), param(w, bias), pre_gelu);
    return;
  }
  const Fp8Linear& f = *fp8;
  if (f.weights == Fp8WeightCopies::on_use)
    k.fp8_cast(f.weight8, Tensor{}, param(w, weight), f.state, f.layout, f.index + kFp8W);
  if (!x8_made) k.fp8_cast(f.x8, Tensor{}, inp, f.state, f.layout, f.index + kFp8X);
  k.fp8_matmul_forward(out_t, inp, param(w, weight), param(w, bias), pre_gelu, f);
}

void Linear::backward(Backend& k, const Params& w, const Params& g, Tensor dinp, Tensor dout,
                      Tensor inp, bool accumulate, Tensor inp_pre_gelu) const {
  if (!fp8) {
    k.matmul_backward(dinp, param(g, weight), param(g, bias), dout, inp, param(w, weight),
                      inp_pre_gelu, accumulate);
    return;
  }
  const Fp8Linear& f = *fp8;
  // The weight's scale, like the input's, is the forward's: the same bytes again.
  if (f.weights == Fp8WeightCopies::on_use)
    k.fp8_cast(f.weight8, f.weight8_t, param(w, weight), f.state, f.layout, f.index + kFp8W);
  else if (f.weights == Fp8WeightCopies::gathered)
    k.fp8_transpose(f.weight8_t, f.weight8);
  if (dout.defined()) k.fp8_cast(f.g8, f.g8_t, dout, f.state, f.layout, f.index + kFp8G);
  // The forward's scale is still in place (scales change between optimizer steps only), so this
  // cast gives the forward's bytes, transposed for the weight gradient: no FP8 copy is kept.
  k.fp8_cast(Tensor{}, f.x8_t, inp, f.state, f.layout, f.index + kFp8X);
  k.fp8_matmul_backward(dinp, param(g, weight), param(g, bias), dout, inp, param(w, weight),
                        inp_pre_gelu, f, accumulate);
}

void Linear::backward_through_swiglu(Backend& k, const Params& w, const Params& g, Tensor dpre,
                                     Tensor dout, Tensor inp, Tensor pre, Tensor dact,
                                     bool accumulate) const {
  k.swiglu_matmul_backward(dpre, param(g, weight), param(g, bias), dout, inp, param(w, weight), pre,
                           dact, accumulate);
}

}  // namespace kiln
