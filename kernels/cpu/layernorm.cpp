// LayerNorm over the last dim (eps 1e-5, biased variance), forward and backward. Row statistics
// are summed in double and mean/rstd are saved as f32; backward normalizes with exactly those
// saved values, so forward and backward agree bit for bit on x_hat. Backward (llm.c's formula)
//   dx = rstd * (dy*w - mean(dy*w) - x_hat * mean(dy*w*x_hat))
// ACCUMULATES into dinp, the residual stream's gradient (and copies the result into dinp_act when
// given: f32 here, where activations are f32 too). dweight/dbias are column sums over all rows:
// threads split over column blocks, each summing rows in order (deterministic).
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/parallel.h"

namespace kiln {

namespace {

constexpr double kEps = 1e-5;
constexpr int64_t kColBlock = 64;  // columns per thread task in the dweight/dbias sums

void layernorm_row(float* out, float* mean, float* rstd, const float* x, const float* w,
                   const float* b, int64_t C) {
  double sum = 0.0;
  for (int64_t i = 0; i < C; ++i) sum += x[i];
  const double mu = sum / static_cast<double>(C);
  double ss = 0.0;
  for (int64_t i = 0; i < C; ++i) ss += (x[i] - mu) * (x[i] - mu);
  const float m = static_cast<float>(mu);
  const float r = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(C) + kEps));
  for (int64_t i = 0; i < C; ++i) out[i] = (x[i] - m) * r * w[i] + b[i];
  *mean = m;
  *rstd = r;
}

}  // namespace

void CpuBackend::run_layernorm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor inp,
                                       Tensor weight, Tensor bias) {
  const int64_t N = matrix_rows(inp), C = inp.dim(-1);
  const float *x = inp.ptr<float>(), *w = weight.ptr<float>(), *b = bias.ptr<float>();
  float *o = out.ptr<float>(), *mu = mean.ptr<float>(), *rs = rstd.ptr<float>();
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(N * C))
  for (int64_t n = 0; n < N; ++n) layernorm_row(o + n * C, mu + n, rs + n, x + n * C, w, b, C);
}

void CpuBackend::run_residual_layernorm_forward(Tensor residual, Tensor out, Tensor mean,
                                                Tensor rstd, Tensor a, Tensor b, Tensor weight,
                                                Tensor bias) {
  const int64_t N = matrix_rows(a), C = a.dim(-1);
  const float *ap = a.ptr<float>(), *bp = b.ptr<float>();
  const float *w = weight.ptr<float>(), *bi = bias.ptr<float>();
  float *res = residual.ptr<float>(), *o = out.ptr<float>();
  float *mu = mean.ptr<float>(), *rs = rstd.ptr<float>();
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(N * C))
  for (int64_t n = 0; n < N; ++n) {
    float* r = res + n * C;
    for (int64_t i = 0; i < C; ++i) r[i] = ap[n * C + i] + bp[n * C + i];
    layernorm_row(o + n * C, mu + n, rs + n, r, w, bi, C);
  }
}

void CpuBackend::run_layernorm_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout,
                                        Tensor inp, Tensor weight, Tensor mean, Tensor rstd,
                                        Tensor dinp_act) {
  const int64_t N = matrix_rows(inp), C = inp.dim(-1);

  const float *x = inp.ptr<float>(), *dy = dout.ptr<float>(), *w = weight.ptr<float>();
  float* copy = dinp_act.defined() ? dinp_act.ptr<float>() : nullptr;
  const float *mu = mean.ptr<float>(), *rs = rstd.ptr<float>();
  float* dx = dinp.ptr<float>();
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(N * C))
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = x + n * C;
    const float* dyr = dy + n * C;
    double sum_dyw = 0.0, sum_dyw_xhat = 0.0;
    for (int64_t i = 0; i < C; ++i) {
      const float xhat = (xr[i] - mu[n]) * rs[n];
      sum_dyw += dyr[i] * w[i];
      sum_dyw_xhat += dyr[i] * w[i] * xhat;
    }
    const float mean_dyw = static_cast<float>(sum_dyw / static_cast<double>(C));
    const float mean_dyw_xhat = static_cast<float>(sum_dyw_xhat / static_cast<double>(C));
    float* dxr = dx + n * C;
    for (int64_t i = 0; i < C; ++i) {
      const float xhat = (xr[i] - mu[n]) * rs[n];
      dxr[i] += rs[n] * (dyr[i] * w[i] - mean_dyw - xhat * mean_dyw_xhat);
    }
    if (copy) std::copy(dxr, dxr + C, copy + n * C);
  }

  float *dw = dweight.ptr<float>(), *db = dbias.ptr<float>();
  const int64_t n_blocks = (C + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(N * C))
  for (int64_t blk = 0; blk < n_blocks; ++blk) {
    const int64_t c0 = blk * kColBlock, c1 = std::min(C, c0 + kColBlock);
    double acc_w[kColBlock] = {}, acc_b[kColBlock] = {};
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = c0; i < c1; ++i) {
        const float xhat = (x[n * C + i] - mu[n]) * rs[n];
        acc_w[i - c0] += dy[n * C + i] * xhat;
        acc_b[i - c0] += dy[n * C + i];
      }
    for (int64_t i = c0; i < c1; ++i) {
      dw[i] += static_cast<float>(acc_w[i - c0]);
      db[i] += static_cast<float>(acc_b[i - c0]);
    }
  }
}

}  // namespace kiln
