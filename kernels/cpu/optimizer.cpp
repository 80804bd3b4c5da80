// Reductions (sum, sum of squares, grad-norm clip), the schedule scalars and AdamW.
// Sums run in double over fixed 64K-element chunks whose partials are added in chunk order, so
// the f32 result is the same for any thread count. AdamW is elementwise in f32, exactly the
// header's formula; the decay spans are walked once to split [offset, offset+n) into runs with
// and without weight decay. Per-step scalars (lr, step, gradient scale) are read from `sched`.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/parallel.h"

namespace kiln {

namespace {

constexpr int64_t kSumChunk = int64_t{1} << 16;

template <class Term>
double chunked_sum(const float* x, int64_t n, Term term) {
  const int64_t n_chunks = (n + kSumChunk - 1) / kSumChunk;
  std::vector<double> partial(static_cast<size_t>(n_chunks));
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(n))
  for (int64_t k = 0; k < n_chunks; ++k) {
    double s = 0.0;
    for (int64_t i = k * kSumChunk; i < std::min(n, (k + 1) * kSumChunk); ++i) s += term(x[i]);
    partial[static_cast<size_t>(k)] = s;
  }
  double total = 0.0;
  for (double s : partial) total += s;
  return total;
}

void store(Tensor out, double value, bool accumulate) {
  float* o = out.ptr<float>();
  o[0] = static_cast<float>(accumulate ? static_cast<double>(o[0]) + value : value);
}

// One run of elements sharing a weight decay: local [begin, end) of the update.
struct DecayRun {
  int64_t begin, end;
  bool decay;
};

std::vector<DecayRun> decay_runs(const OpCheck& c, Tensor spans, int64_t offset, int64_t n) {
  std::vector<DecayRun> runs;
  int64_t pos = 0;  // local index covered so far
  if (spans.defined()) {
    const int64_t* s = spans.ptr<int64_t>();
    int64_t prev_end = 0;
    for (int64_t k = 0; k < spans.dim(0); ++k) {
      const int64_t b = s[2 * k], e = s[2 * k + 1];
      if (b > e || b < prev_end)
        c.fail("decay_spans", "span " + std::to_string(k) + " [" + std::to_string(b) + "," +
                                  std::to_string(e) + ") is not sorted and disjoint");
      prev_end = e;
      const int64_t lb = std::clamp(b - offset, pos, n), le = std::clamp(e - offset, pos, n);
      if (le <= lb) continue;
      if (lb > pos) runs.push_back({pos, lb, false});
      runs.push_back({lb, le, true});
      pos = le;
    }
  }
  if (pos < n) runs.push_back({pos, n, false});
  return runs;
}

}  // namespace

void CpuBackend::run_reduce_sum(Tensor out, Tensor x, bool accumulate) {
  store(out, chunked_sum(x.ptr<float>(), x.numel(), [](float v) { return double{v}; }), accumulate);
}

void CpuBackend::run_sum_squares(Tensor out, Tensor x, bool accumulate) {
  store(out, chunked_sum(x.ptr<float>(), x.numel(), [](float v) { return double{v} * v; }),
        accumulate);
}

void CpuBackend::run_grad_norm_clip(Tensor sched, Tensor sumsq, float max_norm, float grad_scale) {
  float* s = sched.ptr<float>();
  const float norm = grad_scale * std::sqrt(sumsq.ptr<float>()[0]);
  s[kSchedGradNorm] = norm;
  s[kSchedGradScale] =
      grad_scale * (max_norm > 0.0f ? std::min(1.0f, max_norm / (norm + 1e-6f)) : 1.0f);
}

void CpuBackend::run_set_schedule(Tensor sched, float lr, int step) {
  sched.ptr<float>()[kSchedLr] = lr;
  sched.ptr<float>()[kSchedStep] = static_cast<float>(step);
}

void CpuBackend::run_adamw_update(Tensor master, Tensor grads, Tensor m, Tensor v, Tensor working,
                                  Tensor decay_spans, int64_t offset, Tensor sched,
                                  const AdamWHyper& hyper) {
  const OpCheck c = op_check("adamw_update");
  const int64_t n = master.numel();
  const std::vector<DecayRun> runs = decay_runs(c, decay_spans, offset, n);
  const float* s = sched.ptr<float>();
  const float lr = s[kSchedLr], step = s[kSchedStep], grad_scale = s[kSchedGradScale];
  if (!(step >= 1.0f)) c.fail("sched", "step must be >= 1; call set_schedule first");

  const float b1 = hyper.beta1, b2 = hyper.beta2, eps = hyper.eps;
  const float b1_corr = 1.0f - std::pow(b1, step), b2_corr = 1.0f - std::pow(b2, step);
  float *p = master.ptr<float>(), *mp = m.ptr<float>(), *vp = v.ptr<float>();
  const float* g = grads.ptr<float>();
  uint16_t* w16 =
      working.defined() && working.dtype == DType::bf16 ? working.ptr<uint16_t>() : nullptr;
  float* w32 = working.defined() && working.dtype == DType::f32 ? working.ptr<float>() : nullptr;
  for (const DecayRun& run : runs) {
    const float wd = run.decay ? hyper.weight_decay : 0.0f;
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(run.end - run.begin))
    for (int64_t i = run.begin; i < run.end; ++i) {
      const float gi = g[i] * grad_scale;
      const float mi = b1 * mp[i] + (1.0f - b1) * gi;
      const float vi = b2 * vp[i] + (1.0f - b2) * gi * gi;
      const float mhat = mi / b1_corr, vhat = vi / b2_corr;
      const float pi = p[i] - lr * (mhat / (std::sqrt(vhat) + eps) + wd * p[i]);
      mp[i] = mi;
      vp[i] = vi;
      p[i] = pi;
      if (w32) w32[i] = pi;
      if (w16) w16[i] = f32_to_bf16(pi);
    }
  }
}

void CpuBackend::run_add(Tensor dst, Tensor src) {
  float* d = dst.ptr<float>();
  const float* s = src.ptr<float>();
  const int64_t n = dst.numel();
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(n))
  for (int64_t i = 0; i < n; ++i) d[i] += s[i];
}

}  // namespace kiln
