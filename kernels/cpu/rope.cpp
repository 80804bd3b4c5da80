// Rotary position embedding on the query and key heads of a packed qkv, in Hugging Face's
// LLaMA/Qwen3 convention (rotate_half: element i pairs with i + hs/2, not with i + 1), the value
// heads passed through. The angles are computed in f32 exactly as transformers does,
//   inv_freq = rope_inv_freq(hs, rope) (kernels/rope_freq.h);  angle = float(t) * inv_freq[i]
// then cosf/sinf of that f32 angle, once per call into a [T, hs/2] table. At large t the f32
// angle is off from the exact one by ~t * 2^-24 rad: that rounding is part of the convention, so
// it is kept rather than computed in double. Backward is the inverse rotation (the transpose),
// the same code with sin negated. Every output element depends only on its own pair of inputs,
// so in place (out == inp) is safe. With `positions` (document masking) a token's angles are
// those of its position, from the same table over positions 0..max: a token of a document
// rotated in a packed window gets exactly the bits it gets rotated alone.
#include <algorithm>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/rope_row.h"

namespace kiln {

namespace {

// Rotates the query and key heads of every token by +angle (forward) or -angle (backward), for
// position t, or positions[b,t] when given.
void rope_apply(const OpCheck& c, Tensor out, Tensor inp, const AttentionDims& a, const Rope& rope,
                bool inverse, Tensor positions) {
  const int64_t B = inp.dim(0), T = inp.dim(1), half = a.head_dim / 2, row = a.qkv_dim();
  const int32_t* pos = nullptr;
  int64_t table = T;  // positions in the cos/sin table: 0..table-1
  if (positions.defined()) {
    c.indices("positions", positions, int64_t{1} << 24);  // exact as the f32 angle's factor
    pos = positions.ptr<int32_t>();
    table = B * T > 0 ? 1 + *std::max_element(pos, pos + B * T) : 0;
    if (table > B * T) table = 0;  // far positions (a shifted chunk): angles per token instead
  }
  const std::vector<float> inv_freq = rope_inv_freq(a.head_dim, rope);
  std::vector<float> cos_t(static_cast<size_t>(table * half)), sin_t(cos_t.size());
  for (int64_t t = 0; t < table; ++t)
    cpu::rope_angles(t, inv_freq, inverse, cos_t.data() + t * half, sin_t.data() + t * half);

  const float* x = inp.ptr<float>();
  float* o = out.ptr<float>();
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(B * T * row))
  for (int64_t bt = 0; bt < B * T; ++bt) {
    const int64_t p = pos ? pos[bt] : bt % T;
    if (table > 0) {
      cpu::rope_row(o + bt * row, x + bt * row, a, cos_t.data() + p * half,
                    sin_t.data() + p * half);
    } else {
      std::vector<float> cs(static_cast<size_t>(half)), sn(cs.size());
      cpu::rope_angles(p, inv_freq, inverse, cs.data(), sn.data());
      cpu::rope_row(o + bt * row, x + bt * row, a, cs.data(), sn.data());
    }
  }
}

}  // namespace

void CpuBackend::run_rope_forward(Tensor out, Tensor inp, const AttentionDims& a, const Rope& rope,
                                  Tensor positions) {
  rope_apply(op_check("rope_forward"), out, inp, a, rope, false, positions);
}

void CpuBackend::run_rope_backward(Tensor dinp, Tensor dout, const AttentionDims& a,
                                   const Rope& rope, Tensor positions) {
  rope_apply(op_check("rope_backward"), dinp, dout, a, rope, true, positions);
}

}  // namespace kiln
