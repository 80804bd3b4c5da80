// Qwen3's QK-norm: an RMSNorm over each head (head_dim wide) of the query heads (q_weight) and of
// the key heads (k_weight) inside a packed qkv row, applied before RoPE; the value heads pass
// through. It normalizes with the same row math as rmsnorm.cpp (rmsnorm_row.h). Per token, the
// NH query heads and the KV key heads are contiguous, so they are NH + KV rows of hs, with rstd
// saved per (token, head). Unlike rmsnorm_backward, backward OVERWRITES dinp (qkv is not a
// residual stream) and copies the value part of dout. dq_weight/dk_weight are column sums over
// all (token, head) rows in order, threads over column blocks (deterministic).
#include <algorithm>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/rmsnorm_row.h"

namespace kiln {

void CpuBackend::run_qk_norm_forward(Tensor out, Tensor rstd, Tensor inp, Tensor q_weight,
                                     Tensor k_weight, const AttentionDims& a, float eps) {
  const int64_t N = inp.dim(0) * inp.dim(1), heads = a.n_head + a.n_kv_head;

  const int64_t hs = a.head_dim, row = a.qkv_dim(), NH = a.n_head;
  const float* x = inp.ptr<float>();
  const float* qw = q_weight.ptr<float>();
  const float* kw = k_weight.ptr<float>();
  float* o = out.ptr<float>();
  float* rs = rstd.ptr<float>();
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(N * row))
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t h = 0; h < heads; ++h)
      rs[n * heads + h] = cpu::rmsnorm_row_forward(o + n * row + h * hs, x + n * row + h * hs,
                                                   h < NH ? qw : kw, hs, eps);
    std::copy(x + n * row + heads * hs, x + (n + 1) * row, o + n * row + heads * hs);
  }
}

void CpuBackend::run_qk_norm_backward(Tensor dinp, Tensor dq_weight, Tensor dk_weight, Tensor dout,
                                      Tensor inp, Tensor q_weight, Tensor k_weight, Tensor rstd,
                                      const AttentionDims& a) {
  const int64_t N = inp.dim(0) * inp.dim(1), heads = a.n_head + a.n_kv_head;

  const int64_t hs = a.head_dim, row = a.qkv_dim(), NH = a.n_head, KV = a.n_kv_head;
  const float* x = inp.ptr<float>();
  const float* dy = dout.ptr<float>();
  const float* rs = rstd.ptr<float>();
  const float* qw = q_weight.ptr<float>();
  const float* kw = k_weight.ptr<float>();
  float* dx = dinp.ptr<float>();
  const bool parallel = cpu::worth_parallel(N * row);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t off = n * row + h * hs;
      cpu::rmsnorm_row_backward(dx + off, dy + off, x + off, h < NH ? qw : kw, rs[n * heads + h],
                                hs, false);
    }
    std::copy(dy + n * row + heads * hs, dy + (n + 1) * row, dx + n * row + heads * hs);
  }

  // Rows r = (token n, head h) in order: n * per_token + h, the head counted from `first`.
  auto rows_of = [&](int64_t first, int64_t per_token) {
    return [=](int64_t r) {
      const int64_t n = r / per_token, h = first + r % per_token;
      return cpu::RmsRow{x + n * row + h * hs, dy + n * row + h * hs, rs[n * heads + h]};
    };
  };
  cpu::rmsnorm_weight_grad(dq_weight.ptr<float>(), N * NH, hs, parallel, rows_of(0, NH));
  cpu::rmsnorm_weight_grad(dk_weight.ptr<float>(), N * KV, hs, parallel, rows_of(NH, KV));
}

}  // namespace kiln
