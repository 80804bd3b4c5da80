// The RMSNorm math of one row, shared by rmsnorm.cpp (rows of the residual stream) and
// qk_norm.cpp (each attention head of a packed qkv row), so both normalize with the same
// arithmetic. The mean square is summed in double; rstd is returned as f32, and backward
// normalizes with exactly that saved value (x_hat = x * rstd), so forward and backward agree bit
// for bit on x_hat. Backward is
//   dx = rstd * (dy*w - x_hat * mean(dy*w*x_hat)).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace kiln::cpu {

// out[i] = x[i] * rstd * w[i]; returns rstd = 1/sqrt(mean(x^2) + eps).
inline float rmsnorm_row_forward(float* out, const float* x, const float* w, int64_t n,
                                 double eps) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float r = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps));
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r * w[i];
  return r;
}

// The gradient w.r.t. x of one row, added to dx (accumulate) or written over it.
inline void rmsnorm_row_backward(float* dx, const float* dy, const float* x, const float* w,
                                 float rstd, int64_t n, bool accumulate) {
  double sum_dyw_xhat = 0.0;
  for (int64_t i = 0; i < n; ++i) sum_dyw_xhat += dy[i] * w[i] * (x[i] * rstd);
  const float mean_dyw_xhat = static_cast<float>(sum_dyw_xhat / static_cast<double>(n));
  for (int64_t i = 0; i < n; ++i) {
    const float g = rstd * (dy[i] * w[i] - (x[i] * rstd) * mean_dyw_xhat);
    dx[i] = accumulate ? dx[i] + g : g;
  }
}

// One normalized row as the weight gradient sees it.
struct RmsRow {
  const float* x;
  const float* dy;
  float rstd;
};

// dw[n] += sum over rows r = 0..n_rows-1 of dy * x * rstd, where row(r) returns an RmsRow.
// Threads split over column blocks; each column sums the rows in increasing order in double, so
// the result does not depend on the thread count (nor on the block width).
template <class RowAt>
void rmsnorm_weight_grad(float* dw, int64_t n_rows, int64_t n, bool parallel, RowAt row) {
  constexpr int64_t kColBlock = 16;
  const int64_t n_blocks = (n + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t blk = 0; blk < n_blocks; ++blk) {
    const int64_t c0 = blk * kColBlock, c1 = std::min(n, c0 + kColBlock);
    double acc[kColBlock] = {};
    for (int64_t r = 0; r < n_rows; ++r) {
      const RmsRow rr = row(r);
      for (int64_t i = c0; i < c1; ++i) acc[i - c0] += rr.dy[i] * (rr.x[i] * rr.rstd);
    }
    for (int64_t i = c0; i < c1; ++i) dw[i] += static_cast<float>(acc[i - c0]);
  }
}

}  // namespace kiln::cpu
