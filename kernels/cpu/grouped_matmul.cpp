// Grouped GEMM, the reference: each expert's rows through its own weight, one matmul per
// non-empty group (the offsets are host memory here, as they are on CUDA by the time its GEMMs
// run). The per-group arithmetic is matmul.cpp's, so an MoE with one expert computes exactly
// what the dense layer does.
#include "kernels/cpu/check.h"
#include "kernels/cpu/cpu_backend.h"

namespace kiln {

using cpu::OpCheck;

namespace {

// Checks the shared arguments; returns the group count E.
int64_t check_groups(const OpCheck& c, const Tensor& rows_in, const Tensor& weight,
                     const Tensor& offsets) {
  c.f32("inp", rows_in);
  c.ndim("inp", rows_in, 2);
  c.f32("weight", weight);
  c.ndim("weight", weight, 3);
  c.dim("weight", weight, 2, rows_in.dim(1));
  const int64_t E = weight.dim(0);
  // They may end before the last row (moe_ep_group's worst-case buffers); rows past them
  // are not touched.
  c.offsets("offsets", offsets, E, rows_in.dim(0), /*to_the_end=*/false);
  return E;
}

Tensor rows(const Tensor& t, int64_t begin, int64_t end) {
  return t.defined() ? t.slice(begin * t.dim(1), {end - begin, t.dim(1)}) : Tensor{};
}

}  // namespace

void CpuBackend::grouped_matmul_forward(Tensor out, Tensor inp, Tensor weight, Tensor offsets,
                                        Tensor pre_gelu) {
  OpCheck c{"grouped_matmul_forward"};
  const int64_t E = check_groups(c, inp, weight, offsets);
  const int64_t OC = weight.dim(1), C = weight.dim(2);
  c.f32("out", out);
  c.shape("out", out, {inp.dim(0), OC});
  const int* off = offsets.ptr<int>();
  for (int64_t e = 0; e < E; ++e) {
    if (off[e + 1] == off[e]) continue;
    matmul_forward(rows(out, off[e], off[e + 1]), rows(inp, off[e], off[e + 1]),
                   weight.slice(e * OC * C, {OC, C}), Tensor{}, rows(pre_gelu, off[e], off[e + 1]));
  }
}

void CpuBackend::grouped_matmul_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp,
                                         Tensor weight, Tensor offsets, Tensor inp_pre_gelu) {
  OpCheck c{"grouped_matmul_backward"};
  const int64_t E = check_groups(c, inp, weight, offsets);
  const int64_t OC = weight.dim(1), C = weight.dim(2);
  c.f32("dweight", dweight);
  c.shape("dweight", dweight, weight.shape);
  c.f32("dout", dout);
  c.shape("dout", dout, {inp.dim(0), OC});
  const int* off = offsets.ptr<int>();
  for (int64_t e = 0; e < E; ++e) {
    if (off[e + 1] == off[e]) continue;
    matmul_backward(rows(dinp, off[e], off[e + 1]), dweight.slice(e * OC * C, {OC, C}), Tensor{},
                    rows(dout, off[e], off[e + 1]), rows(inp, off[e], off[e + 1]),
                    weight.slice(e * OC * C, {OC, C}), rows(inp_pre_gelu, off[e], off[e + 1]));
  }
}

}  // namespace kiln
