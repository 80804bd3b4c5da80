// Mixture-of-Experts dispatch and combine, the reference. Dispatch is a stable counting sort of
// the N*k (token, choice) slots by expert, so each expert's rows are contiguous (the grouped
// GEMM's groups) and ordered by token: dropless, every slot gets a row, M = N*k rows in all.
// Combine sums each token's k rows in choice order, weighted by the routing weights.
#include <algorithm>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/parallel.h"

namespace kiln {

void CpuBackend::run_moe_permute(Tensor xp, Tensor row_token, Tensor slot_row, Tensor offsets,
                                 Tensor x, Tensor topk_idx) {
  const int64_t N = matrix_rows(x), C = x.dim(-1), K = topk_idx.dim(1), M = N * K;
  const int64_t E = offsets.numel() - 1;
  op_check("moe_permute").indices("topk_idx", topk_idx, E);
  const int* idx = topk_idx.ptr<int>();
  int *off = offsets.ptr<int>(), *rt = row_token.ptr<int>(), *sr = slot_row.ptr<int>();
  std::fill(off, off + E + 1, 0);
  for (int64_t s = 0; s < M; ++s) ++off[idx[s] + 1];
  for (int64_t e = 0; e < E; ++e) off[e + 1] += off[e];
  std::vector<int> next(off, off + E);
  for (int64_t s = 0; s < M; ++s) {
    const int row = next[static_cast<size_t>(idx[s])]++;
    sr[s] = row;
    rt[row] = static_cast<int>(s / K);
  }
  const float* xs = x.ptr<float>();
  float* out = xp.ptr<float>();
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(M * C))
  for (int64_t m = 0; m < M; ++m) std::copy(xs + rt[m] * C, xs + (rt[m] + 1) * C, out + m * C);
}

void CpuBackend::run_moe_unpermute(Tensor out, Tensor yp, Tensor slot_row, Tensor topk_w,
                                   bool accumulate) {
  const int64_t N = matrix_rows(out), C = out.dim(-1), M = yp.dim(0), K = M / N;
  op_check("moe_unpermute").indices("slot_row", slot_row, M);
  const float* y = yp.ptr<float>();
  const float* w = topk_w.defined() ? topk_w.ptr<float>() : nullptr;
  const int* sr = slot_row.ptr<int>();
  float* o = out.ptr<float>();
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(M * C))
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t i = 0; i < C; ++i) {
      float sum = 0;
      for (int64_t j = 0; j < K; ++j)
        sum += (w ? w[n * K + j] : 1.0f) * y[static_cast<int64_t>(sr[n * K + j]) * C + i];
      o[n * C + i] = accumulate ? o[n * C + i] + sum : sum;
    }
  }
}

void CpuBackend::run_moe_unpermute_backward(Tensor dyp, Tensor dtopk_w, Tensor dout, Tensor yp,
                                            Tensor slot_row, Tensor topk_w) {
  const int64_t N = matrix_rows(dout), C = dout.dim(-1), M = yp.dim(0), K = M / N;
  op_check("moe_unpermute_backward").indices("slot_row", slot_row, M);
  const float *y = yp.ptr<float>(), *w = topk_w.ptr<float>(), *g = dout.ptr<float>();
  const int* sr = slot_row.ptr<int>();
  float *dy = dyp.ptr<float>(), *dw = dtopk_w.ptr<float>();
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(M * C))
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t j = 0; j < K; ++j) {
      const int64_t row = sr[n * K + j];
      float dot = 0;
      for (int64_t i = 0; i < C; ++i) {
        dy[row * C + i] = w[n * K + j] * g[n * C + i];
        dot += g[n * C + i] * y[row * C + i];
      }
      dw[n * K + j] = dot;
    }
  }
}

}  // namespace kiln
