#include "model/layers/linear.h"

namespace kiln {

void Linear::declare(LayoutBuilder& b, const std::string& name, int64_t in_features,
                     int64_t out_features, bool with_bias, LinearSplit how,
                     std::vector<int64_t> segments) {
  in = in_features;
  out = out_features;
  split = how;
  const TensorSplit by_columns{1, {}}, by_rows{0, segments};
  weight = b.add(name + ".weight", {out, in}, true, 0,
                 how == LinearSplit::column ? by_rows : how == LinearSplit::row ? by_columns
                                                                              : TensorSplit{});
  // A column split's bias splits with its rows; a row split's is whole on every rank.
  bias = with_bias ? b.add(name + ".bias", {out}, false, 0,
                           how == LinearSplit::column ? by_rows : TensorSplit{})
                   : -1;
}

void Linear::set_tensor_parallel(int ranks, int rank) {
  if (split == LinearSplit::column) out /= ranks;
  if (split == LinearSplit::row) {
    in /= ranks;
    owns_bias = rank == 0;
  }
}

void Linear::forward(Backend& k, const Params& w, Tensor out_t, Tensor inp, Tensor pre_gelu,
                     bool x8_made) const {
  const Tensor b = owns_bias ? param(w, bias) : Tensor{};
  if (!fp8) {
    k.matmul_forward(out_t, inp, param(w, weight), b, pre_gelu);
    return;
  }
  const Fp8Linear& f = *fp8;
  if (f.weights == Fp8WeightCopies::on_use)
    k.fp8_cast(f.weight8, Tensor{}, param(w, weight), f.state, f.layout, f.index + kFp8W);
  if (!x8_made) k.fp8_cast(f.x8, Tensor{}, inp, f.state, f.layout, f.index + kFp8X);
  k.fp8_matmul_forward(out_t, inp, param(w, weight), b, pre_gelu, f);
}

void Linear::forward_rows(Backend& k, const Params& w, Tensor out_t, Tensor inp, int64_t first,
                          int64_t n, Tensor pre_gelu, bool x8_made) const {
  const Tensor out_n = out_t.rows(first, n), inp_n = inp.rows(first, n);
  const Tensor pre_n = pre_gelu.defined() ? pre_gelu.rows(first, n) : Tensor{};
  if (!fp8) return forward(k, w, out_n, inp_n, pre_n, x8_made);
  Fp8Linear piece = *fp8;
  piece.x8 = fp8->x8.rows(first, n);
  if (first > 0 && piece.weights == Fp8WeightCopies::on_use)
    piece.weights = Fp8WeightCopies::per_step;  // made by the piece at row 0
  Linear self = *this;
  self.fp8 = &piece;
  self.forward(k, w, out_n, inp_n, pre_n, x8_made);
}

void Linear::backward(Backend& k, const Params& w, const Params& g, Tensor dinp, Tensor dout,
                      Tensor inp, bool accumulate, Tensor inp_pre_gelu) const {
  const Tensor dbias = own_bias_grad(k, g, accumulate);
  if (!fp8) {
    k.matmul_backward(dinp, param(g, weight), dbias, dout, inp, param(w, weight), inp_pre_gelu,
                      accumulate);
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
  k.fp8_matmul_backward(dinp, param(g, weight), dbias, dout, inp, param(w, weight), inp_pre_gelu,
                        f, accumulate);
}

void Linear::backward_through_swiglu(Backend& k, const Params& w, const Params& g, Tensor dpre,
                                     Tensor dout, Tensor inp, Tensor pre, Tensor dact,
                                     bool accumulate) const {
  k.swiglu_matmul_backward(dpre, param(g, weight), own_bias_grad(k, g, accumulate), dout, inp,
                           param(w, weight), pre, dact, accumulate);
}

}  // namespace kiln
