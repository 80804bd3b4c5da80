// The RoPE math of one token's packed qkv row, shared by rope.cpp (every row of a sequence) and
// attention.cpp's decode step (the newest row of a KV cache), so a token rotated one row at a
// time gets exactly the bits of the whole-sequence rotation. The angle is
// float(t) * inv_freq[i] in f32 and its cos and sin come from std::cos/std::sin of that f32
// value, as transformers computes them (rope.cpp says why the f32 rounding is kept).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/backend.h"

namespace kiln::cpu {

// cos and sin (negated when `inverse`) of position t's hs/2 angles.
inline void rope_angles(int64_t t, const std::vector<float>& inv_freq, bool inverse, float* cs,
                        float* sn) {
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    const float angle = static_cast<float>(t) * inv_freq[i];
    cs[i] = std::cos(angle);
    sn[i] = inverse ? -std::sin(angle) : std::sin(angle);
  }
}

// Rotates the query and key heads of one token's row x into o (o may be x); the value heads
// are copied when o is not x.
inline void rope_row(float* o, const float* x, const AttentionDims& a, const float* cs,
                     const float* sn) {
  const int64_t hs = a.head_dim, half = hs / 2, rotated = (a.n_head + a.n_kv_head) * hs;
  for (int64_t off = 0; off < rotated; off += hs)
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = x[off + i], x2 = x[off + half + i];
      o[off + i] = x1 * cs[i] - x2 * sn[i];
      o[off + half + i] = x2 * cs[i] + x1 * sn[i];
    }
  if (o != x)
    for (int64_t i = rotated; i < a.qkv_dim(); ++i) o[i] = x[i];
}

}  // namespace kiln::cpu
