// Grouped GEMM, the reference: each expert's rows through its own weight, one matmul per
// non-empty group (the offsets are host memory here, as they are on CUDA by the time its GEMMs
// run). The per-group arithmetic is matmul.cpp's, so an MoE with one expert computes exactly
// what the dense layer does.
#include "kernels/cpu/cpu_backend.h"

namespace kiln {

namespace {

// The offsets' values (the contract checked their size); returns the group count E. They may
// end before the last row (moe_ep_group's worst-case buffers); rows past them are not touched.
int64_t check_offsets(const OpCheck& c, const Tensor& offsets, const Tensor& inp) {
  const int64_t E = offsets.numel() - 1;
  c.offsets("offsets", offsets, E, inp.dim(0), /*to_the_end=*/false);
  return E;
}

Tensor rows(const Tensor& t, int64_t begin, int64_t end) {
  return t.defined() ? t.rows(begin, end - begin) : Tensor{};
}

}  // namespace

void CpuBackend::run_grouped_matmul_forward(Tensor out, Tensor inp, Tensor weight, Tensor offsets,
                                            Tensor pre_gelu) {
  const int64_t E = check_offsets(op_check("grouped_matmul_forward"), offsets, inp);
  const int64_t OC = weight.dim(1), C = weight.dim(2);
  const int* off = offsets.ptr<int>();
  for (int64_t e = 0; e < E; ++e) {
    if (off[e + 1] == off[e]) continue;
    matmul_forward(rows(out, off[e], off[e + 1]), rows(inp, off[e], off[e + 1]),
                   weight.slice(e * OC * C, {OC, C}), Tensor{}, rows(pre_gelu, off[e], off[e + 1]));
  }
}

void CpuBackend::run_grouped_matmul_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp,
                                             Tensor weight, Tensor offsets, Tensor inp_pre_gelu) {
  const int64_t E = check_offsets(op_check("grouped_matmul_backward"), offsets, inp);
  const int64_t OC = weight.dim(1), C = weight.dim(2);
  const int* off = offsets.ptr<int>();
  for (int64_t e = 0; e < E; ++e) {
    if (off[e + 1] == off[e]) continue;
    matmul_backward(rows(dinp, off[e], off[e + 1]), dweight.slice(e * OC * C, {OC, C}), Tensor{},
                    rows(dout, off[e], off[e + 1]), rows(inp, off[e], off[e + 1]),
                    weight.slice(e * OC * C, {OC, C}), rows(inp_pre_gelu, off[e], off[e + 1]),
                    /*accumulate=*/true);
  }
}

}  // namespace kiln
