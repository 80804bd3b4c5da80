// One query row of attention, forward and backward, as the CPU reference computes it: the
// arithmetic attention_forward/backward (packed qkv) and attention_cp_forward/backward (keys
// and values gathered for context parallelism) share, so that a context-parallel run does the
// same float operations per query as one that holds the whole sequence.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace kiln::cpu {

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Query q[hs] over the keys j0..j1 (key j at k_base + j * stride, its value at v_base + j *
// stride): writes the output o[hs] and returns the row's log-sum-exp of the scaled scores.
// p: scratch for j1 + 1 scores.
inline float attend(float* o, const float* q, const float* k_base, const float* v_base,
                    int64_t stride, int64_t j0, int64_t j1, int64_t hs, float scale, float* p) {
  float max_s = -std::numeric_limits<float>::infinity();
  for (int64_t j = j0; j <= j1; ++j) {
    p[j] = dot(q, k_base + j * stride, hs) * scale;
    max_s = std::max(max_s, p[j]);
  }
  double sum = 0.0;
  for (int64_t j = j0; j <= j1; ++j) {
    p[j] = std::exp(p[j] - max_s);
    sum += p[j];
  }
  const float inv_sum = static_cast<float>(1.0 / sum);
  for (int64_t i = 0; i < hs; ++i) o[i] = 0.0f;
  for (int64_t j = j0; j <= j1; ++j) {
    const float pj = p[j] * inv_sum;
    const float* v = v_base + j * stride;
    for (int64_t i = 0; i < hs; ++i) o[i] += pj * v[i];
  }
  return max_s + static_cast<float>(std::log(sum));
}

// The backward of one query row over keys j0..j1 (layout as attend's; dk/dv at dk_base/dv_base
// + j * dstride): dq[hs] += ..., dk and dv of each key += .... dy: the output's gradient; D:
// dy . out; lse: the forward's. Probabilities are recomputed as exp(q.k * scale - lse).
inline void attend_backward(float* dq, const float* q, const float* dy, float D, float lse,
                            const float* k_base, const float* v_base, int64_t stride,
                            float* dk_base, float* dv_base, int64_t dstride, int64_t j0, int64_t j1,
                            int64_t hs, float scale) {
  for (int64_t j = j0; j <= j1; ++j) {
    const float* k = k_base + j * stride;
    const float* v = v_base + j * stride;
    const float p = std::exp(dot(q, k, hs) * scale - lse);
    const float ds = p * (dot(dy, v, hs) - D) * scale;  // d(loss)/d(q.k)
    float* dk = dk_base + j * dstride;
    float* dv = dv_base + j * dstride;
    for (int64_t i = 0; i < hs; ++i) {
      dq[i] += ds * k[i];
      dk[i] += ds * q[i];
      dv[i] += p * dy[i];
    }
  }
}

}  // namespace kiln::cpu
