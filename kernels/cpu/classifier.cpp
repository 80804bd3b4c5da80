// Fused softmax + cross-entropy over the (padded) logits. Each row's log-sum-exp runs over the
// real vocab only, in double; the per-token loss is lse - logit[target]. With write_dlogits the
// logits are overwritten IN PLACE with dloss_scale * (softmax - onehot) on real columns and 0 on
// padded ones, so the full-precision logits never outlive this call (the matmul backward reads
// dlogits from the same buffer). Rows are independent: threads split over rows.
// The vocabulary-parallel pair computes the same loss from P slices of the columns: each rank's
// (max, sum of exp, target logit) per row (stats), then, from every rank's, the log-sum-exp,
// the loss and the slice's dlogits (combine), so that the only exchange is f32[N,3] a rank.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/parallel.h"

namespace kiln {

namespace {

// row[0, Vp) = dloss_scale * (exp(row - lse) - (i == target)) on the columns i < V, 0 past them
// (a target outside [0, V) subtracts nothing).
void write_dlogits_row(float* row, int64_t Vp, int64_t V, int64_t target, double lse,
                       float dloss_scale) {
  for (int64_t i = 0; i < V; ++i) {
    const double p = std::exp(static_cast<double>(row[i]) - lse);
    row[i] = static_cast<float>(dloss_scale * (p - (i == target ? 1.0 : 0.0)));
  }
  for (int64_t i = V; i < Vp; ++i) row[i] = 0.0f;
}

// How many of a slice's Vl columns from first_col are real in a vocabulary of V.
int64_t real_columns(int64_t first_col, int64_t Vl, int64_t V) {
  return std::clamp<int64_t>(V - first_col, 0, Vl);
}

}  // namespace

void CpuBackend::run_softmax_cross_entropy(Tensor losses, Tensor logits, Tensor targets,
                                           int vocab_size, float dloss_scale, bool write_dlogits) {
  const int64_t N = matrix_rows(logits), Vp = logits.dim(-1), V = vocab_size;
  op_check("softmax_cross_entropy").indices("targets", targets, V);

  float* x = logits.ptr<float>();
  float* loss = losses.ptr<float>();
  const int32_t* tgt = targets.ptr<int32_t>();
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(N * Vp))
  for (int64_t n = 0; n < N; ++n) {
    float* row = x + n * Vp;
    float max_l = row[0];
    for (int64_t i = 1; i < V; ++i) max_l = std::max(max_l, row[i]);
    double sum = 0.0;
    for (int64_t i = 0; i < V; ++i) sum += std::exp(static_cast<double>(row[i]) - max_l);
    const double lse = max_l + std::log(sum);
    loss[n] = static_cast<float>(lse - row[tgt[n]]);
    if (write_dlogits) write_dlogits_row(row, Vp, V, tgt[n], lse, dloss_scale);
  }
}

void CpuBackend::run_softmax_cross_entropy_stats(Tensor stats, Tensor logits, Tensor targets,
                                                 int64_t first_col, int vocab_size) {
  const int64_t N = matrix_rows(logits), Vl = logits.dim(-1);
  const int64_t V_here = real_columns(first_col, Vl, vocab_size);
  op_check("softmax_cross_entropy_stats").indices("targets", targets, vocab_size);

  const float* x = logits.ptr<float>();
  float* out = stats.ptr<float>();
  const int32_t* tgt = targets.ptr<int32_t>();
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(N * Vl))
  for (int64_t n = 0; n < N; ++n) {
    const float* row = x + n * Vl;
    float max_l = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < V_here; ++i) max_l = std::max(max_l, row[i]);
    double sum = 0.0;
    for (int64_t i = 0; i < V_here; ++i) sum += std::exp(static_cast<double>(row[i]) - max_l);
    const int64_t t = tgt[n] - first_col;
    float* st = out + n * kCrossEntropyStats;
    st[kCeMax] = max_l;
    st[kCeSumExp] = static_cast<float>(sum);
    st[kCeTarget] = t >= 0 && t < V_here ? row[t] : 0.0f;
  }
}

void CpuBackend::run_softmax_cross_entropy_combine(Tensor losses, Tensor logits, Tensor stats_all,
                                                   Tensor targets, int64_t first_col,
                                                   int vocab_size, float dloss_scale,
                                                   bool write_dlogits) {
  const int64_t N = matrix_rows(logits), Vl = logits.dim(-1);
  const int64_t V_here = real_columns(first_col, Vl, vocab_size);
  op_check("softmax_cross_entropy_combine").indices("targets", targets, vocab_size);
  if (N == 0) return;
  const int64_t P = stats_all.numel() / (N * kCrossEntropyStats);

  float* x = logits.ptr<float>();
  float* loss = losses.ptr<float>();
  const float* all = stats_all.ptr<float>();
  const int32_t* tgt = targets.ptr<int32_t>();
  auto stat = [&](int64_t p, int64_t n, int k) {
    return all[(p * N + n) * kCrossEntropyStats + k];
  };
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(N * (write_dlogits ? Vl : P)))
  for (int64_t n = 0; n < N; ++n) {
    float max_l = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < P; ++p) max_l = std::max(max_l, stat(p, n, kCeMax));
    double sum = 0.0, target_logit = 0.0;
    for (int64_t p = 0; p < P; ++p) {
      const float m = stat(p, n, kCeMax);
      if (m != -std::numeric_limits<float>::infinity())
        sum += stat(p, n, kCeSumExp) * std::exp(static_cast<double>(m) - max_l);
      target_logit += stat(p, n, kCeTarget);
    }
    const double lse = max_l + std::log(sum);
    loss[n] = static_cast<float>(lse - target_logit);
    if (write_dlogits)
      write_dlogits_row(x + n * Vl, Vl, V_here, tgt[n] - first_col, lse, dloss_scale);
  }
}

}  // namespace kiln
