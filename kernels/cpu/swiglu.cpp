// SwiGLU, the gated MLP activation of LLaMA/Qwen3: out = silu(gate) * up. The gate and up
// projections arrive as one [N, 2F] matmul output (gate in the first F columns of a row, up in
// the last F), so the MLP runs one fused up-projection matmul instead of two. silu(x) =
// x * sigmoid(x), sigmoid = 1 / (1 + exp(-x)), all in f32; backward recomputes sigmoid from the
// saved input rather than keeping it:
//   dgate = dout * up * s * (1 + gate * (1 - s)),  dup = dout * gate * s.
#include <cmath>

#include "kernels/cpu/check.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/parallel.h"

namespace kiln {

using cpu::OpCheck;

namespace {

// The shape of out for inp [..., 2F]: [..., F]. Checks inp.
Shape check_swiglu_inp(const OpCheck& c, Tensor inp) {
  c.f32("inp", inp);
  if (inp.ndim() == 0 || inp.dim(-1) % 2 != 0)
    c.fail("inp", "last dim must be 2*F (gate then up), got " + inp.str());
  Shape half = inp.shape;
  half.dims[static_cast<size_t>(half.ndim - 1)] /= 2;
  return half;
}

inline float sigmoid(float x) {
  return 1.0f / (1.0f + std::exp(-x));
}

}  // namespace

void CpuBackend::swiglu_forward(Tensor out, Tensor inp) {
  OpCheck c{"swiglu_forward"};
  const Shape out_shape = check_swiglu_inp(c, inp);
  c.f32("out", out);
  c.shape("out", out, out_shape);
  const int64_t N = cpu::rows(inp), F = out_shape[-1];
  const float* x = inp.ptr<float>();
  float* o = out.ptr<float>();
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(N * F))
  for (int64_t n = 0; n < N; ++n) {
    const float *gate = x + n * 2 * F, *up = gate + F;
    for (int64_t i = 0; i < F; ++i) o[n * F + i] = gate[i] * sigmoid(gate[i]) * up[i];
  }
}

void CpuBackend::swiglu_backward(Tensor dinp, Tensor dout, Tensor inp) {
  OpCheck c{"swiglu_backward"};
  const Shape out_shape = check_swiglu_inp(c, inp);
  c.f32("dinp", dinp);
  c.shape("dinp", dinp, inp.shape);
  c.f32("dout", dout);
  c.shape("dout", dout, out_shape);
  const int64_t N = cpu::rows(inp), F = out_shape[-1];
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

// The reference is the two ops it stands for, in that order, so a CPU step is what it was
// before the op existed (dact holds dout @ weight afterwards).
void CpuBackend::swiglu_matmul_backward(Tensor dpre, Tensor dweight, Tensor dbias, Tensor dout,
                                        Tensor act, Tensor weight, Tensor pre, Tensor dact) {
  matmul_backward(dact, dweight, dbias, dout, act, weight, Tensor{});
  swiglu_backward(dpre, dact, pre);
}

}  // namespace kiln
