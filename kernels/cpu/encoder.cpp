// Token + position embedding. Forward is a gather from the rows wte holds (a token outside them,
// in another rank's slice of the vocabulary, gives a zero row), backward a scatter-add. The
// scatter is made deterministic without atomics: positions are bucketed by token id (a counting
// sort), then each vocab row (of those dwte holds) sums its positions in increasing (b,t) order
// and is added to dwte once. Threads split over vocab rows (and over t for dwpe), never over the
// tokens that share a row. wpe/dwpe are optional: a model with rotary positions (RoPE) has no
// learned position table.
#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/parallel.h"

namespace kiln {

void CpuBackend::run_encoder_forward(Tensor out, Tensor tokens, Tensor wte, Tensor wpe,
                                     int64_t first_row) {
  const int64_t B = tokens.dim(0), T = tokens.dim(1), C = wte.dim(1), R = wte.dim(0);
  // Any id is a row of the table; those outside wte's rows read as zero (a vocabulary slice's).
  op_check("encoder_forward").indices("tokens", tokens, std::numeric_limits<int32_t>::max());

  const int32_t* tok = tokens.ptr<int32_t>();
  const float* wte_p = wte.ptr<float>();
  const float* wpe_p = wpe.ptr<float>();
  float* out_p = out.ptr<float>();
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(B * T * C))
  for (int64_t bt = 0; bt < B * T; ++bt) {
    const int64_t row = tok[bt] - first_row;
    const float* te = row >= 0 && row < R ? wte_p + row * C : nullptr;
    float* o = out_p + bt * C;
    const float* pe = wpe_p ? wpe_p + (bt % T) * C : nullptr;
    if (te && pe) {
      for (int64_t i = 0; i < C; ++i) o[i] = te[i] + pe[i];
    } else if (te) {
      std::copy(te, te + C, o);
    } else if (pe) {
      std::copy(pe, pe + C, o);
    } else {
      std::fill(o, o + C, 0.0f);
    }
  }
}

void CpuBackend::run_encoder_backward(Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens,
                                      int64_t first_row) {
  const int64_t B = tokens.dim(0), T = tokens.dim(1), C = dwte.dim(1), R = dwte.dim(0);
  // Any id is a row of the table; those outside dwte's rows are skipped.
  op_check("encoder_backward").indices("tokens", tokens, std::numeric_limits<int32_t>::max());

  const int32_t* tok = tokens.ptr<int32_t>();
  const float* g = dout.ptr<float>();
  auto row_of = [&](int64_t i) { return static_cast<int64_t>(tok[i]) - first_row; };
  auto held = [&](int64_t i) { return row_of(i) >= 0 && row_of(i) < R; };

  // Counting sort of positions by row; within a bucket positions stay in (b,t) order.
  const int64_t N = B * T;
  std::vector<int64_t> start(static_cast<size_t>(R + 1), 0);
  for (int64_t i = 0; i < N; ++i)
    if (held(i)) ++start[static_cast<size_t>(row_of(i)) + 1];
  for (int64_t v = 0; v < R; ++v) start[v + 1] += start[v];
  std::vector<int64_t> order(static_cast<size_t>(start[R]));
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < N; ++i)
    if (held(i)) order[fill[row_of(i)]++] = i;
  std::vector<int32_t> used;  // rows with a token, ascending
  for (int64_t v = 0; v < R; ++v)
    if (start[v + 1] > start[v]) used.push_back(static_cast<int32_t>(v));

  float* dwte_p = dwte.ptr<float>();
  const int64_t n_used = static_cast<int64_t>(used.size());
#pragma omp parallel if (cpu::worth_parallel(N * C))
  {
    std::vector<double> acc(static_cast<size_t>(C));
#pragma omp for schedule(static)
    for (int64_t u = 0; u < n_used; ++u) {
      const int32_t v = used[u];
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t k = start[v]; k < start[v + 1]; ++k) {
        const float* row = g + order[k] * C;
        for (int64_t i = 0; i < C; ++i) acc[i] += row[i];
      }
      float* d = dwte_p + v * C;
      for (int64_t i = 0; i < C; ++i) d[i] += static_cast<float>(acc[i]);
    }
  }

  if (!dwpe.defined()) return;
  float* dwpe_p = dwpe.ptr<float>();
#pragma omp parallel if (cpu::worth_parallel(N * C))
  {
    std::vector<double> acc(static_cast<size_t>(C));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t b = 0; b < B; ++b) {
        const float* row = g + (b * T + t) * C;
        for (int64_t i = 0; i < C; ++i) acc[i] += row[i];
      }
      float* d = dwpe_p + t * C;
      for (int64_t i = 0; i < C; ++i) d[i] += static_cast<float>(acc[i]);
    }
  }
}

}  // namespace kiln
