// RMSNorm over the last dim (LLaMA/Qwen3: no mean, no bias), forward, the residual-fused forward
// and backward. The row math lives in rmsnorm_row.h, shared with qk_norm.cpp: the mean square is
// summed in double, rstd saved as f32, and backward normalizes with exactly that saved rstd.
// Backward ACCUMULATES into dinp, the residual stream's gradient, and copies it into dinp_act when
// given (as layernorm_backward does).
// dweight is a column sum over all rows: threads split over column blocks, each summing rows in
// order (deterministic).

#include <algorithm>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/rmsnorm_row.h"

namespace kiln {

void CpuBackend::run_rmsnorm_forward(Tensor out, Tensor rstd, Tensor inp, Tensor weight,
                                     float eps) {
  const int64_t N = matrix_rows(inp), C = inp.dim(-1);
  const float* x = inp.ptr<float>();
  const float* w = weight.ptr<float>();
  float* o = out.ptr<float>();
  float* rs = rstd.ptr<float>();
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(N * C))
  for (int64_t n = 0; n < N; ++n) rs[n] = cpu::rmsnorm_row_forward(o + n * C, x + n * C, w, C, eps);
}

void CpuBackend::run_residual_rmsnorm_forward(Tensor residual, Tensor out, Tensor rstd, Tensor a,
                                              Tensor b, Tensor weight, float eps) {
  const int64_t N = matrix_rows(a), C = a.dim(-1);
  const float *ap = a.ptr<float>(), *bp = b.ptr<float>(), *w = weight.ptr<float>();
  float *res = residual.ptr<float>(), *o = out.ptr<float>(), *rs = rstd.ptr<float>();
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(N * C))
  for (int64_t n = 0; n < N; ++n) {
    float* r = res + n * C;
    for (int64_t i = 0; i < C; ++i) r[i] = ap[n * C + i] + bp[n * C + i];
    rs[n] = cpu::rmsnorm_row_forward(o + n * C, r, w, C, eps);
  }
}

void CpuBackend::run_rmsnorm_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp,
                                      Tensor weight, Tensor rstd, Tensor dinp_act) {
  const int64_t N = matrix_rows(inp), C = inp.dim(-1);

  const float* x = inp.ptr<float>();
  const float* dy = dout.ptr<float>();
  const float* w = weight.ptr<float>();
  const float* rs = rstd.ptr<float>();
  float* dx = dinp.ptr<float>();
  const bool parallel = cpu::worth_parallel(N * C);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t n = 0; n < N; ++n)
    cpu::rmsnorm_row_backward(dx + n * C, dy + n * C, x + n * C, w, rs[n], C, true);
  if (dinp_act.defined()) std::copy(dx, dx + N * C, dinp_act.ptr<float>());

  cpu::rmsnorm_weight_grad(dweight.ptr<float>(), N, C, parallel, [&](int64_t n) {
    return cpu::RmsRow{x + n * C, dy + n * C, rs[n]};
  });
}

}  // namespace kiln
