// Muon's ops in f32: Nesterov momentum, the quintic Newton-Schulz iteration over a batch of
// same-shape matrices, and the update. Each matrix of a batch is iterated on its own, through the
// same loops whatever the batch holds, and every sum runs in a fixed order: a matrix's result is
// the same bits whichever rank iterates it, beside whichever others (what lets every strategy
// follow the single-process run).
#include <algorithm>
#include <cmath>

#include "kernels/bf16.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/parallel.h"

namespace kiln {

namespace {

constexpr float kNsA = 3.4445f, kNsB = -4.7750f, kNsC = 2.0315f, kNsEps = 1e-7f;

// out[m,n] = alpha * a[m,k] @ (b_t ? b[n,k]^T : b[k,n]) + beta * c[m,n] (c may be null).
void gemm(float* out, const float* a, const float* b, bool b_t, const float* c, int64_t m,
          int64_t n, int64_t k, float alpha, float beta) {
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(m * n * k))
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      float s = 0.0f;
      for (int64_t l = 0; l < k; ++l) s += a[i * k + l] * (b_t ? b[j * k + l] : b[l * n + j]);
      out[i * n + j] = alpha * s + (c ? beta * c[i * n + j] : 0.0f);
    }
}

}  // namespace

void CpuBackend::run_muon_momentum(Tensor momentum, Tensor nesterov, Tensor grads, Tensor sched,
                                   float mu) {
  const int64_t n = momentum.numel();
  const float grad_scale = sched.ptr<float>()[kSchedGradScale];
  float* buf = momentum.ptr<float>();
  float* nest = nesterov.defined() ? nesterov.ptr<float>() : nullptr;
  const float* g = grads.ptr<float>();
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(n))
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] * grad_scale;
    const float b = mu * buf[i] + (1.0f - mu) * gi;
    buf[i] = b;
    if (nest) nest[i] = (1.0f - mu) * gi + mu * b;
  }
}

void CpuBackend::run_newton_schulz(Tensor out, Tensor x, Tensor work, int steps) {
  const int64_t N = x.dim(0), rows = x.dim(1), cols = x.dim(2);
  const bool wide = rows <= cols;  // iterated as is; else transposed
  const int64_t m = std::min(rows, cols), k = std::max(rows, cols);
  float* X = work.ptr<float>();
  float* Xn = X + m * k;
  float* G = Xn + m * k;
  float* H = G + m * m;
  for (int64_t b = 0; b < N; ++b) {
    const float* in = x.ptr<float>() + b * rows * cols;
    double sumsq = 0.0;
    for (int64_t i = 0; i < rows * cols; ++i) sumsq += static_cast<double>(in[i]) * in[i];
    const float inv = 1.0f / std::max(static_cast<float>(std::sqrt(sumsq)), kNsEps);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        X[wide ? r * cols + c : c * rows + r] = in[r * cols + c] * inv;
    for (int s = 0; s < steps; ++s) {
      gemm(G, X, X, /*b_t=*/true, nullptr, m, m, k, 1.0f, 0.0f);  // G = X X^T
      gemm(H, G, G, false, G, m, m, m, kNsC, kNsB);               // H = b G + c G G
      gemm(Xn, H, X, false, X, m, k, m, 1.0f, kNsA);              // X = a X + H X
      std::swap(X, Xn);
    }
    float* o = out.ptr<float>() + b * rows * cols;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) o[r * cols + c] = X[wide ? r * cols + c : c * rows + r];
    if (steps % 2 == 1) std::swap(X, Xn);  // the scratch's first piece again
  }
}

void CpuBackend::run_muon_update(Tensor master, Tensor working, Tensor update, Tensor sched,
                                 float lr_scale, float weight_decay) {
  const int64_t n = master.numel();
  const float lr = sched.ptr<float>()[kSchedLr];
  const float keep = 1.0f - lr * weight_decay, step = lr * lr_scale;
  float* p = master.ptr<float>();
  const float* u = update.ptr<float>();
  uint16_t* w16 =
      working.defined() && working.dtype == DType::bf16 ? working.ptr<uint16_t>() : nullptr;
  float* w32 = working.defined() && working.dtype == DType::f32 ? working.ptr<float>() : nullptr;
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(n))
  for (int64_t i = 0; i < n; ++i) {
    const float pi = p[i] * keep - step * u[i];
    p[i] = pi;
    if (w32) w32[i] = pi;
    if (w16) w16[i] = f32_to_bf16(pi);
  }
}

}  // namespace kiln
