// Rotary position embedding on the query and key heads of a packed qkv, in Hugging Face's
// LLaMA/Qwen3 convention (rotate_half: element i pairs with i + hs/2, not with i + 1), the value
// heads passed through. The angles are computed in f32 exactly as transformers does,
//   inv_freq = rope_inv_freq(hs, rope) (kernels/rope_freq.h);  angle = float(t) * inv_freq[i]
// then cosf/sinf of that f32 angle, once per call into a [T, hs/2] table. At large t the f32
// angle is off from the exact one by ~t * 2^-24 rad: that rounding is part of the convention, so
// it is kept rather than computed in double. Backward is the inverse rotation (the transpose),
// the same code with sin negated. Every output element depends only on its own pair of inputs,
// so in place (out == inp) is safe.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/parallel.h"

namespace kiln {

namespace {

// Rotates the query and key heads of every token by +angle (forward) or -angle (backward).
void rope_apply(Tensor out, Tensor inp, const AttentionDims& a, const Rope& rope, bool inverse) {
  const int64_t B = inp.dim(0), T = inp.dim(1), hs = a.head_dim, half = hs / 2;
  const int64_t row = a.qkv_dim(), rotated = (a.n_head + a.n_kv_head) * hs;
  std::vector<float> cos_t(static_cast<size_t>(T * half)), sin_t(cos_t.size());
  const std::vector<float> inv_freq = rope_inv_freq(a.head_dim, rope);
  for (int64_t i = 0; i < half; ++i) {
    for (int64_t t = 0; t < T; ++t) {
      const float angle = static_cast<float>(t) * inv_freq[i];
      cos_t[t * half + i] = std::cos(angle);
      sin_t[t * half + i] = inverse ? -std::sin(angle) : std::sin(angle);
    }
  }

  const float* x = inp.ptr<float>();
  float* o = out.ptr<float>();
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(B * T * row))
  for (int64_t bt = 0; bt < B * T; ++bt) {
    const float* cs = cos_t.data() + (bt % T) * half;
    const float* sn = sin_t.data() + (bt % T) * half;
    for (int64_t off = bt * row; off < bt * row + rotated; off += hs)
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = x[off + i], x2 = x[off + half + i];
        o[off + i] = x1 * cs[i] - x2 * sn[i];
        o[off + half + i] = x2 * cs[i] + x1 * sn[i];
      }
    if (o != x) std::copy(x + bt * row + rotated, x + (bt + 1) * row, o + bt * row + rotated);
  }
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
