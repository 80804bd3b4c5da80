// Fused softmax + cross-entropy over the (padded) logits. Each row's log-sum-exp runs over the
// real vocab only, in double; the per-token loss is lse - logit[target]. With write_dlogits the
// logits are overwritten IN PLACE with dloss_scale * (softmax - onehot) on real columns and 0 on
// padded ones, so the full-precision logits never outlive this call (the matmul backward reads
// dlogits from the same buffer). Rows are independent: threads split over rows.
#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/parallel.h"

namespace kiln {

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
    if (!write_dlogits) continue;
    for (int64_t i = 0; i < V; ++i) {
      const double p = std::exp(static_cast<double>(row[i]) - lse);
      row[i] = static_cast<float>(dloss_scale * (p - (i == tgt[n] ? 1.0 : 0.0)));
    }
    for (int64_t i = V; i < Vp; ++i) row[i] = 0.0f;
  }
}

}  // namespace kiln
