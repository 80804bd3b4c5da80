// The contracts of the FP8 ops with delayed scaling (kernels/contracts.h says what a contract
// is), in kernels/ops.def's order: the casts, SwiGLU fused with its cast, the FP8 linear layer
// (matmul_forward's and matmul_backward's contracts and the casts it multiplies) and the scales'
// update.
#include <string>

#include "kernels/contracts.h"

namespace kiln::contract {

namespace {

// The FP8 state and the index of a tensor in it.
void check_fp8_state(const OpCheck& c, const Tensor& state, const Fp8StateLayout& l, int index) {
  c.f32("state", state);
  c.numel("state", state, l.total());
  if (index < 0 || index >= l.n)
    c.fail("index",
           std::to_string(index) + " is not one of the " + std::to_string(l.n) + " FP8 tensors");
}

// A cast's outputs, [R,C] and/or its transpose [C,R], in one FP8 format.
void check_cast_outputs(const OpCheck& c, const char* name, const Tensor& out, const char* t_name,
                        const Tensor& out_t, int64_t R, int64_t C) {
  if (!out.defined() && !out_t.defined())
    c.fail(name, std::string("neither ") + name + " nor " + t_name + " is given");
  if (out.defined()) c.fp8(name, out, {R, C});
  if (out_t.defined()) {
    c.fp8(t_name, out_t, {C, R});
    if (out.defined() && out.dtype != out_t.dtype)
      c.fail(t_name, std::string(name) + " and " + t_name + " differ in format");
  }
}

}  // namespace

void fp8_cast(const OpCheck& c, Tensor out, Tensor out_t, Tensor inp, Tensor state,
              const Fp8StateLayout& layout, int index) {
  if (inp.defined() && inp.dtype == DType::f32 && c.activation != DType::f32) {
    if (matrix_rows(inp) != 1 || out_t.defined())
      c.fail("inp", "in f32 must be a vector (one row) cast without a transpose");
  } else {
    c.activation_dtype("inp", inp);
  }
  c.min_ndim("inp", inp, 1);
  check_fp8_state(c, state, layout, index);
  check_cast_outputs(c, "out", out, "out_t", out_t, matrix_rows(inp), inp.dim(-1));
}

void fp8_transpose(const OpCheck& c, Tensor out_t, Tensor inp) {
  c.ndim("inp", inp, 2);
  c.fp8("inp", inp);
  c.dtype("out_t", out_t, inp.dtype, {inp.dim(1), inp.dim(0)});
}

void swiglu_forward_fp8(const OpCheck& c, Tensor out, Tensor x8, Tensor inp, Tensor state,
                        const Fp8StateLayout& layout, int index) {
  swiglu_forward(c, out, inp);
  check_fp8_state(c, state, layout, index);
  c.fp8("x8", x8, {matrix_rows(out), out.dim(-1)});
}

void swiglu_backward_fp8(const OpCheck& c, Tensor g8, Tensor g8_t, Tensor dout, Tensor inp,
                         Tensor state, const Fp8StateLayout& layout, int index) {
  const Shape half = check_swiglu_inp(c, "inp", inp);
  c.activation_dtype("dout", dout, half);
  check_fp8_state(c, state, layout, index);
  check_cast_outputs(c, "g8", g8, "g8_t", g8_t, matrix_rows(inp), inp.dim(-1));
}

// matmul_forward's contract, and the casts it multiplies: x8 [N,C] and weight8 [OC,C] in E4M3.
void fp8_matmul_forward(const OpCheck& c, Tensor out, Tensor inp, Tensor weight, Tensor bias,
                        Tensor pre_gelu, const Fp8Linear& f) {
  matmul_forward(c, out, inp, weight, bias, pre_gelu);
  check_fp8_state(c, f.state, f.layout, f.index);
  c.dtype("x8", f.x8, DType::fp8_e4m3, {matrix_rows(inp), inp.dim(-1)});
  c.dtype("weight8", f.weight8, DType::fp8_e4m3, weight.shape);
}

// matmul_backward's contract, save that dout may be missing (then dbias must be too), and the
// casts of both layouts: weight8 [OC,C] and weight8_t [C,OC], x8_t [C,N] in E4M3, g8 [N,OC]
// and g8_t [OC,N] in the gradient format.
void fp8_matmul_backward(const OpCheck& c, Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout,
                         Tensor inp, Tensor weight, Tensor inp_pre_gelu, const Fp8Linear& f,
                         bool accumulate) {
  if (dout.defined())
    matmul_backward(c, dinp, dweight, dbias, dout, inp, weight, inp_pre_gelu, accumulate);
  else if (dbias.defined())
    c.fail("dout", "is needed for dbias (the gradient exists only in FP8)");
  else
    check_linear_grads(c, dinp, dweight, inp, weight, inp_pre_gelu);
  const int64_t OC = weight.dim(0), C = weight.dim(1), N = matrix_rows(inp);
  check_fp8_state(c, f.state, f.layout, f.index);
  c.dtype("weight8", f.weight8, DType::fp8_e4m3, {OC, C});
  c.dtype("weight8_t", f.weight8_t, DType::fp8_e4m3, {C, OC});
  c.dtype("x8_t", f.x8_t, DType::fp8_e4m3, {C, N});
  c.fp8("g8", f.g8, {N, OC});
  c.fp8("g8_t", f.g8_t, {OC, N});
}

void fp8_update_scales(const OpCheck& c, Tensor state, const Fp8StateLayout& layout,
                       const Fp8Options& options) {
  c.f32("state", state);
  c.numel("state", state, layout.total());
}

}  // namespace kiln::contract
