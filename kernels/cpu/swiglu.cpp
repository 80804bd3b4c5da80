// SwiGLU, the gated MLP activation of LLaMA/Qwen3: out = silu(gate) * up. The gate and up
// projections arrive as one [N, 2F] matmul output (gate in the first F columns of a row, up in
// the last F), so the MLP runs one fused up-projection matmul instead of two. silu(x) =
// x * sigmoid(x), sigmoid = 1 / (1 + exp(-x)), all in f32; backward recomputes sigmoid from the
// saved input rather than keeping it:
//   dgate = dout * up * s * (1 + gate * (1 - s)),  dup = dout * gate * s.
#include <cmath>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/parallel.h"

namespace kiln {

namespace {

inline float sigmoid(float x) {
  return 1.0f / (1.0f + std::exp(-x));
}

}  // namespace

void CpuBackend::run_swiglu_forward(Tensor out, Tensor inp) {
  const int64_t N = matrix_rows(inp), F = inp.dim(-1) / 2;
  const float* x = inp.ptr<float>();
  float* o = out.ptr<float>();
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(N * F))
  for (int64_t n = 0; n < N; ++n) {
    const float *gate = x + n * 2 * F, *up = gate + F;
    for (int64_t i = 0; i < F; ++i) o[n * F + i] = gate[i] * sigmoid(gate[i]) * up[i];
  }
}

void CpuBackend::run_swiglu_backward(Tensor dinp, Tensor dout, Tensor inp) {
  const int64_t N = matrix_rows(inp), F = inp.dim(-1) / 2;
  const float *x = inp.ptr<float>(), *dy = dout.ptr<float>();
  float* dx = dinp.ptr<float>();
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(N * F))
  for (int64_t n = 0; n < N; ++n) {
    const float *gate = x + n * 2 * F, *up = gate + F, *g = dy + n * F;
    float *dgate = dx + n * 2 * F, *dup = dgate + F;
    for (int64_t i = 0; i < F; ++i) {
      const float s = sigmoid(gate[i]);
      dgate[i] = g[i] * up[i] * s * (1.0f + gate[i] * (1.0f - s));
      dup[i] = g[i] * gate[i] * s;
    }
  }
}

// The reference is the two ops it stands for, in that order, so that it computes exactly what
// they do (dact holds dout @ weight afterwards).
void CpuBackend::run_swiglu_matmul_backward(Tensor dpre, Tensor dweight, Tensor dbias, Tensor dout,
                                            Tensor act, Tensor weight, Tensor pre, Tensor dact,
                                            bool accumulate) {
  matmul_backward(dact, dweight, dbias, dout, act, weight, Tensor{}, accumulate);
  swiglu_backward(dpre, dact, pre);
}

}  // namespace kiln
