// Linear: out[N,out] = inp[N,in] @ weight[out,in]^T (+ bias), one cuBLASLt GEMM on CUDA. The
// GELU epilogue (pre_gelu) is the MLP's; decay applies to the weight only. With `fp8` set (the
// decoder points it at the layer's operands under precision.fp8), the input and, in backward,
// the output gradient are cast to FP8 first and the GEMMs run in FP8 (kernels/fp8.h).
// Under tensor parallelism (model/tensor_parallel.h) the layer is Megatron's column-parallel
// linear (its rows split: each rank computes its part of the output, `segments` of a packed
// output each split apart) or row-parallel one (its columns split: each rank computes a partial
// sum of the whole output, which the caller sums over the ranks): declare() records the split,
// set_tensor_parallel() makes in and out the rank's. A row-parallel layer's bias is added once,
// by the group's first rank (owns_bias), so that the sum holds it once.
#pragma once

#include <string>
#include <vector>

#include "model/layers/layer.h"
#include "model/param_layout.h"

namespace kiln {

enum class LinearSplit { none, column, row };

struct Linear {
  int weight = -1, bias = -1;
  int64_t in = 0, out = 0;
  const Fp8Linear* fp8 = nullptr;
  LinearSplit split = LinearSplit::none;
  bool owns_bias = true;  // row-parallel: the first rank of the tensor group alone adds the bias

  // `segments`: a column split's parts of the output (empty: one).
  void declare(LayoutBuilder& b, const std::string& name, int64_t in_features, int64_t out_features,
               bool with_bias, LinearSplit split = LinearSplit::none,
               std::vector<int64_t> segments = {});
  // This rank's part of the layer, of `ranks` (a column split divides out, a row split in).
  void set_tensor_parallel(int ranks, int rank);
  // x8_made: the input's FP8 copy (fp8->x8) was made by the op that produced inp
  // (swiglu_forward_fp8), so the layer does not cast it.
  void forward(Backend& k, const Params& w, Tensor out_t, Tensor inp, Tensor pre_gelu = {},
               bool x8_made = false) const;
  // forward() on rows [first, first + n) of inp, out_t and pre_gelu (and of the FP8 input
  // copy), for the pieces async TP runs beside its exchanges (model/tensor_parallel.h); the
  // weight's on-use FP8 copy is made by the piece at row 0.
  void forward_rows(Backend& k, const Params& w, Tensor out_t, Tensor inp, int64_t first,
                    int64_t n, Tensor pre_gelu = {}, bool x8_made = false) const;
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

 private:
  // The bias gradient this rank adds to, or undefined: a rank that does not own the bias leaves
  // it at zero (cleared here where the gradients are written rather than added to).
  Tensor own_bias_grad(Backend& k, const Params& g, bool accumulate) const {
    const Tensor db = param(g, bias);
    if (owns_bias || !db.defined()) return db;
    if (!accumulate) k.fill_zero(db);
    return Tensor{};
  }
};

}  // namespace kiln
