// Linear layer: out[N,OC] = inp[N,C] @ weight[OC,C]^T + bias, with an optional GELU epilogue
// (tanh form) and its backward. Every output element is one sum over a fixed order:
//  - forward: a dot product over C in kLanes interleaved partial sums (lane l takes c = l mod
//    kLanes), added in a fixed tree, so it vectorizes without -ffast-math; kRows weight rows
//    share each load of the input row.
//  - dinp[n,:] and dweight[o,:] are sums of rows (axpy over o, resp. over n, in order); dweight
//    and dbias are summed into scratch first, then added once (+=), so calling backward twice
//    gives exactly twice the gradient. Threads split over rows of the output being written, and
//    the arithmetic per element never depends on how rows are grouped.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/parallel.h"

namespace kiln {

namespace {

constexpr int kLanes = 8;
constexpr int kRows = 4;
constexpr int64_t kColBlock = 64;                  // columns per thread task in the dbias sum
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluCubic = 0.044715f;

inline float gelu(float x) {
  return 0.5f * x * (1.0f + std::tanh(kGeluScale * (x + kGeluCubic * x * x * x)));
}

// d gelu(x) / dx, with sech^2 = 1 - tanh^2.
inline float gelu_grad(float x) {
  const float t = std::tanh(kGeluScale * (x + kGeluCubic * x * x * x));
  return 0.5f * (1.0f + t) +
         0.5f * x * (1.0f - t * t) * kGeluScale * (1.0f + 3.0f * kGeluCubic * x * x);
}

// out[r] = dot(x, w + r*C) for R consecutive weight rows.
template <int R>
inline void dot_rows(const float* x, const float* w, int64_t C, float* out) {
  float acc[R][kLanes] = {};
  int64_t c = 0;
  for (; c + kLanes <= C; c += kLanes)
    for (int r = 0; r < R; ++r)
      for (int l = 0; l < kLanes; ++l) acc[r][l] += x[c + l] * w[r * C + c + l];
  for (int r = 0; r < R; ++r) {
    const float* a = acc[r];
    float s = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
    for (int64_t i = c; i < C; ++i) s += x[i] * w[r * C + i];
    out[r] = s;
  }
}

// dst row r += sum over k of coef[k*k_stride + r*r_stride] * src row k, for R rows of length C:
// each an in-order axpy over the K source rows, which are loaded once for all R.
template <int R>
inline void axpy_rows(float* __restrict dst, const float* __restrict coef, int64_t k_stride,
                      int64_t r_stride, const float* __restrict src, int64_t K, int64_t C) {
  for (int64_t k = 0; k < K; ++k) {
    const float* __restrict s = src + k * C;
    float a[R];
    for (int r = 0; r < R; ++r) a[r] = coef[k * k_stride + r * r_stride];
    for (int64_t i = 0; i < C; ++i)
      for (int r = 0; r < R; ++r) dst[r * C + i] += a[r] * s[i];
  }
}

}  // namespace

void CpuBackend::run_matmul_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias,
                                    Tensor pre_gelu) {
  const int64_t OC = weight.dim(0), C = weight.dim(1), N = matrix_rows(inp);

  const float *x = inp.ptr<float>(), *w = weight.ptr<float>();
  const float* b = bias.defined() ? bias.ptr<float>() : nullptr;
  float* y = out.ptr<float>();
  float* pre = pre_gelu.defined() ? pre_gelu.ptr<float>() : nullptr;
  // Threads split the rows: one row (a decoding step) leaves nothing to share, and a parallel
  // region would only add its barrier, which a loaded machine makes slow (threads.cpp).
#pragma omp parallel for schedule(static) if (N > 1 && cpu::worth_parallel(N * OC * C))
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = x + n * C;
    float* yr = y + n * OC;
    int64_t o = 0;
    for (; o + kRows <= OC; o += kRows) dot_rows<kRows>(xr, w + o * C, C, yr + o);
    for (; o < OC; ++o) dot_rows<1>(xr, w + o * C, C, yr + o);
    if (b)
      for (o = 0; o < OC; ++o) yr[o] += b[o];
    if (pre)
      for (o = 0; o < OC; ++o) {
        pre[n * OC + o] = yr[o];
        yr[o] = gelu(yr[o]);
      }
  }
}

void CpuBackend::run_matmul_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout,
                                     Tensor inp, Tensor weight, Tensor inp_pre_gelu,
                                     bool accumulate) {
  const int64_t OC = weight.dim(0), C = weight.dim(1), N = matrix_rows(inp);

  const float *x = inp.ptr<float>(), *w = weight.ptr<float>(), *g = dout.ptr<float>();

  // dinp[n,:] = sum_o dout[n,o] * weight[o,:], then * gelu'(pre) when the input was gelu(pre).
  if (dinp.defined()) {
    float* dx = dinp.ptr<float>();
    const float* pre = inp_pre_gelu.defined() ? inp_pre_gelu.ptr<float>() : nullptr;
    const int64_t n_blocks = (N + kRows - 1) / kRows;
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(N * OC * C))
    for (int64_t blk = 0; blk < n_blocks; ++blk) {
      const int64_t n0 = blk * kRows, rows = std::min<int64_t>(kRows, N - n0);
      float* d = dx + n0 * C;
      std::fill(d, d + rows * C, 0.0f);
      const float* coef = g + n0 * OC;  // coef for (o, r) is dout[n0+r, o]
      if (rows == kRows) {
        axpy_rows<kRows>(d, coef, 1, OC, w, OC, C);
      } else {
        for (int64_t r = 0; r < rows; ++r) axpy_rows<1>(d + r * C, coef + r * OC, 1, OC, w, OC, C);
      }
      if (pre)
        for (int64_t i = 0; i < rows * C; ++i) d[i] *= gelu_grad(pre[n0 * C + i]);
    }
  }

  // dweight[o,:] (+)= sum_n dout[n,o] * inp[n,:], kRows weight rows per pass over inp.
  float* dw = dweight.ptr<float>();
  const int64_t o_blocks = (OC + kRows - 1) / kRows;
#pragma omp parallel if (cpu::worth_parallel(N * OC * C))
  {
    std::vector<float> acc(static_cast<size_t>(kRows * C));
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < o_blocks; ++blk) {
      const int64_t o0 = blk * kRows, rows = std::min<int64_t>(kRows, OC - o0);
      std::fill(acc.begin(), acc.end(), 0.0f);
      if (rows == kRows) {
        axpy_rows<kRows>(acc.data(), g + o0, OC, 1, x, N, C);  // coef for (n, r): dout[n, o0+r]
      } else {
        for (int64_t r = 0; r < rows; ++r)
          axpy_rows<1>(acc.data() + r * C, g + o0 + r, OC, 1, x, N, C);
      }
      float* d = dw + o0 * C;
      for (int64_t i = 0; i < rows * C; ++i)
        d[i] = (accumulate ? d[i] : 0.0f) + acc[static_cast<size_t>(i)];
    }
  }

  // dbias[o] (+)= sum_n dout[n,o], in double, column blocks per thread.
  if (dbias.defined()) {
    float* db = dbias.ptr<float>();
    const int64_t c_blocks = (OC + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(N * OC))
    for (int64_t blk = 0; blk < c_blocks; ++blk) {
      const int64_t c0 = blk * kColBlock, c1 = std::min(OC, c0 + kColBlock);
      double acc[kColBlock] = {};
      for (int64_t n = 0; n < N; ++n)
        for (int64_t o = c0; o < c1; ++o) acc[o - c0] += g[n * OC + o];
      for (int64_t o = c0; o < c1; ++o)
        db[o] = (accumulate ? db[o] : 0.0f) + static_cast<float>(acc[o - c0]);
    }
  }
}

}  // namespace kiln
