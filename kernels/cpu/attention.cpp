// Causal multi-head self-attention, scale 1/sqrt(hs), in the flash-attention form: forward keeps
// only out and the per-row log-sum-exp (lse); backward recomputes every probability as
// p = exp(q.k * scale - lse) and uses D_t = dout_t . out_t for the softmax backward, so no
// [T,T] matrix is ever stored (a T-float row of scores per thread is the only scratch).
// Threads split over (batch, head) pairs: each writes a disjoint slice of out/lse/dqkv, and
// dk/dv sum over query rows t in increasing order, so results do not depend on thread count.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kernels/cpu/check.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/parallel.h"

namespace kiln {

using cpu::OpCheck;

namespace {

struct AttnDims {
  int64_t B, T, C, NH, hs;
};

AttnDims check_qkv(const OpCheck& c, Tensor qkv, int n_head) {
  c.f32("qkv", qkv);
  c.ndim("qkv", qkv, 3);
  const int64_t B = qkv.dim(0), T = qkv.dim(1), C3 = qkv.dim(2);
  if (C3 % 3 != 0) c.fail("qkv", "last dim must be 3*C, got " + qkv.str());
  const int64_t C = C3 / 3;
  if (n_head <= 0 || C % n_head != 0)
    c.fail("qkv",
           "C=" + std::to_string(C) + " is not divisible by n_head=" + std::to_string(n_head));
  return {B, T, C, n_head, C / n_head};
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

void CpuBackend::attention_forward(Tensor out, Tensor lse, Tensor qkv, int n_head) {
  OpCheck c{"attention_forward"};
  const AttnDims d = check_qkv(c, qkv, n_head);
  c.f32("out", out);
  c.shape("out", out, {d.B, d.T, d.C});
  c.f32("lse", lse);
  c.shape("lse", lse, {d.B, d.NH, d.T});

  const int64_t T = d.T, C = d.C, NH = d.NH, hs = d.hs, C3 = 3 * d.C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const float* qkv_p = qkv.ptr<float>();
  float *out_p = out.ptr<float>(), *lse_p = lse.ptr<float>();
#pragma omp parallel if (cpu::worth_parallel(d.B * NH * T * T * hs / 2))
  {
    std::vector<float> p(static_cast<size_t>(T));
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < d.B * NH; ++bh) {
      const int64_t b = bh / NH, h = bh % NH;
      const float* base = qkv_p + b * T * C3 + h * hs;  // q of token 0, head h
      for (int64_t t = 0; t < T; ++t) {
        const float* q = base + t * C3;
        float max_s = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j <= t; ++j) {
          p[j] = dot(q, base + j * C3 + C, hs) * scale;
          max_s = std::max(max_s, p[j]);
        }
        double sum = 0.0;
        for (int64_t j = 0; j <= t; ++j) {
          p[j] = std::exp(p[j] - max_s);
          sum += p[j];
        }
        const float inv_sum = static_cast<float>(1.0 / sum);
        float* o = out_p + (b * T + t) * C + h * hs;
        for (int64_t i = 0; i < hs; ++i) o[i] = 0.0f;
        for (int64_t j = 0; j <= t; ++j) {
          const float pj = p[j] * inv_sum;
          const float* v = base + j * C3 + 2 * C;
          for (int64_t i = 0; i < hs; ++i) o[i] += pj * v[i];
        }
        lse_p[bh * T + t] = max_s + static_cast<float>(std::log(sum));
      }
    }
  }
}

void CpuBackend::attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor lse,
                                    int n_head) {
  OpCheck c{"attention_backward"};
  const AttnDims d = check_qkv(c, qkv, n_head);
  c.f32("dqkv", dqkv);
  c.shape("dqkv", dqkv, qkv.shape);
  c.f32("dout", dout);
  c.shape("dout", dout, {d.B, d.T, d.C});
  c.f32("out", out);
  c.shape("out", out, {d.B, d.T, d.C});
  c.f32("lse", lse);
  c.shape("lse", lse, {d.B, d.NH, d.T});

  const int64_t T = d.T, C = d.C, NH = d.NH, hs = d.hs, C3 = 3 * d.C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const float *qkv_p = qkv.ptr<float>(), *dout_p = dout.ptr<float>(), *out_p = out.ptr<float>();
  const float* lse_p = lse.ptr<float>();
  float* dqkv_p = dqkv.ptr<float>();
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(d.B * NH * T * T * hs))
  for (int64_t bh = 0; bh < d.B * NH; ++bh) {
    const int64_t b = bh / NH, h = bh % NH;
    const float* base = qkv_p + b * T * C3 + h * hs;
    float* dbase = dqkv_p + b * T * C3 + h * hs;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t part = 0; part < 3; ++part)
        for (int64_t i = 0; i < hs; ++i) dbase[t * C3 + part * C + i] = 0.0f;

    for (int64_t t = 0; t < T; ++t) {
      const float* q = base + t * C3;
      const float* dy = dout_p + (b * T + t) * C + h * hs;
      const float D = dot(dy, out_p + (b * T + t) * C + h * hs, hs);
      const float row_lse = lse_p[bh * T + t];
      float* dq = dbase + t * C3;
      for (int64_t j = 0; j <= t; ++j) {
        const float* k = base + j * C3 + C;
        const float* v = base + j * C3 + 2 * C;
        const float p = std::exp(dot(q, k, hs) * scale - row_lse);
        const float ds = p * (dot(dy, v, hs) - D) * scale;  // d(loss)/d(q.k)
        float* dk = dbase + j * C3 + C;
        float* dv = dbase + j * C3 + 2 * C;
        for (int64_t i = 0; i < hs; ++i) {
          dq[i] += ds * k[i];
          dk[i] += ds * q[i];
          dv[i] += p * dy[i];
        }
      }
    }
  }
}

}  // namespace kiln
