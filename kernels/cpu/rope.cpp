// Rotary position embedding on the query and key heads of a packed qkv, in Hugging Face's
// LLaMA/Qwen3 convention (rotate_half: element i pairs with i + hs/2, not with i + 1), the value
// heads passed through. The angles are computed in f32 exactly as transformers does,
//   inv_freq = rope_inv_freq(hs, rope) (kernels/rope_freq.h);  angle = float(t) * inv_freq[i]
// then cosf/sinf of that f32 angle, once per call into a [T, hs/2] table. At large t the f32
// angle is off from the exact one by ~t * 2^-24 rad: that rounding is part of the convention, so
// it is kept rather than computed in double. Backward is the inverse rotation (the transpose),
// the same code with sin negated. Every output element depends only on its own pair of inputs,
// so in place (out == inp) is safe.
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/rope_row.h"

namespace kiln {

namespace {

// Rotates the query and key heads of every token by +angle (forward) or -angle (backward).
void rope_apply(Tensor out, Tensor inp, const AttentionDims& a, const Rope& rope, bool inverse) {
  const int64_t B = inp.dim(0), T = inp.dim(1), half = a.head_dim / 2, row = a.qkv_dim();
  const std::vector<float> inv_freq = rope_inv_freq(a.head_dim, rope);
  std::vector<float> cos_t(static_cast<size_t>(T * half)), sin_t(cos_t.size());
  for (int64_t t = 0; t < T; ++t)
    cpu::rope_angles(t, inv_freq, inverse, cos_t.data() + t * half, sin_t.data() + t * half);

  const float* x = inp.ptr<float>();
  float* o = out.ptr<float>();
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(B * T * row))
  for (int64_t bt = 0; bt < B * T; ++bt)
    cpu::rope_row(o + bt * row, x + bt * row, a, cos_t.data() + (bt % T) * half,
                  sin_t.data() + (bt % T) * half);
}

}  // namespace

void CpuBackend::run_rope_forward(Tensor out, Tensor inp, const AttentionDims& a,
                                  const Rope& rope) {
  rope_apply(out, inp, a, rope, false);
}

void CpuBackend::run_rope_backward(Tensor dinp, Tensor dout, const AttentionDims& a,
                                   const Rope& rope) {
  rope_apply(dinp, dout, a, rope, true);
}

}  // namespace kiln
