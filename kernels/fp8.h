// FP8 with delayed scaling: the formats, the rounding, and the per-tensor scaling state, shared
// by the CPU emulation (kernels/cpu/fp8.cpp) and the CUDA kernels (kernels/cuda/fp8.cu), so both
// quantize to the same bytes and update the same scales.
//
// The recipe (docs/fp8.md): a tensor x is stored as q = fp8(x * scale), rounded to nearest even
// and saturated to the format's largest finite value; a GEMM over q multiplies by scale_inv =
// 1/scale. Each tensor's scale comes from the amaxes (max |x|) of earlier steps, not the current
// one (delayed scaling): every cast records its amax into the current window, and once per
// optimizer step fp8_update_scales pushes the window into a history and sets
//   scale = fp8_max / amax_from_history / 2^margin,
// keeping the previous scale where amax is 0 or not finite.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define KILN_HD __host__ __device__
#else
#define KILN_HD
#endif

namespace kiln {

// Largest finite values: E4M3 (the "fn" variant: no infinities, one NaN) and E5M2.
constexpr float kFp8E4M3Max = 448.0f;
constexpr float kFp8E5M2Max = 57344.0f;

// fp8.format: hybrid = E4M3 forward (weights, activations), E5M2 for the output gradients;
// e4m3 = E4M3 everywhere.
enum class Fp8Format { hybrid, e4m3 };
// fp8.amax_compute_algo: the history's max, or its newest entry.
enum class Fp8AmaxAlgo { max, most_recent };

struct Fp8Options {
  Fp8Format format = Fp8Format::hybrid;
  int amax_history_len = 1024;
  Fp8AmaxAlgo amax_compute_algo = Fp8AmaxAlgo::max;
  int margin = 0;
  bool bf16_edges = false;  // keep the first and last blocks in bf16
};

// Each FP8 linear layer owns three tensors, in this order: its input x, its weight w, and the
// gradient g of its output.
enum Fp8Role : int { kFp8X = 0, kFp8W = 1, kFp8G = 2 };
constexpr int kFp8Roles = 3;

// The state of n FP8 tensors, one f32 buffer at a fixed address (CUDA-graph capture relies on
// it): per-tensor arrays, then the summary, then the histories (newest first).
//   scale_inv          what the GEMMs multiply by, one per 16 bytes: cuBLASLt's FP8 kernels
//                      read it through a pointer per tensor, which must be 16-byte aligned
//   scale              what the casts multiply by
//   amax               max |x| cast since the last update (the window; all-reduced with MAX
//                      over data-parallel ranks before the update)
//   saturated, cast    how many values the window's casts clipped to fp8_max, and cast at all
//   last_amax          the window the last update consumed (for the log's trends)
//   summary            written by the update, for the log: see Fp8Summary
//   history[n][H]      amaxes of the last H windows, history[i][0] the newest
struct Fp8StateLayout {
  int n = 0;        // tensors
  int history = 0;  // H
  static constexpr int kInvStride = 4;
  KILN_HD int64_t scale_inv(int i) const { return static_cast<int64_t>(kInvStride) * i; }
  KILN_HD int64_t scale() const { return static_cast<int64_t>(kInvStride) * n; }
  KILN_HD int64_t amax() const { return scale() + n; }
  KILN_HD int64_t saturated() const { return scale() + 2LL * n; }
  KILN_HD int64_t cast() const { return scale() + 3LL * n; }
  KILN_HD int64_t last_amax() const { return scale() + 4LL * n; }
  KILN_HD int64_t summary() const { return scale() + 5LL * n; }
  KILN_HD int64_t histories() const { return summary() + kSummary; }
  KILN_HD int64_t total() const { return histories() + static_cast<int64_t>(n) * history; }
  static constexpr int kSummary = 6;
};

// What the update leaves in the summary slots, read by the trainer with the step's loss. The
// worst tensor is the one that clipped the largest fraction of its values in the window or, when
// none clipped, the one whose window amax outgrew its scale's amax the most (clipping to come).
enum Fp8Summary : int {
  kFp8WorstSaturation = 0,  // the largest fraction of a tensor's values clipped in the window
  kFp8WorstTensor = 1,      // which tensor (index); -1 when there are none
  kFp8WorstAmax = 2,        // that tensor's window amax
  kFp8WorstScaleAmax = 3,   // and the amax its scale was set for (fp8_max / scale / 2^margin)
  kFp8NonFinite = 4,        // tensors whose window amax was NaN or inf
  kFp8FirstNonFinite = 5,   // the first of them (index), -1 when none
};

KILN_HD inline float fp8_max(bool e5m2) { return e5m2 ? kFp8E5M2Max : kFp8E4M3Max; }

// The format a tensor of `role` uses under `format`.
KILN_HD inline bool fp8_role_is_e5m2(int role, Fp8Format format) {
  return role == kFp8G && format == Fp8Format::hybrid;
}

// The new scale from the amax the history yields, as TE's default recipe computes it: the
// previous scale stays where amax is 0 (nothing seen yet) or not finite (an overflow upstream,
// which the summary reports), or where the division overflows (amax below f32's range of use).
KILN_HD inline float fp8_next_scale(float amax, float previous, float max_value, int margin) {
  if (!(amax > 0.0f) || !(amax <= 3.0e38f)) return previous;
  const float s = max_value / amax / ldexpf(1.0f, margin);
  return (s <= 3.0e38f) ? s : previous;
}

// The amax a history yields: its largest finite entry (max) or its newest (most_recent). A
// non-finite window never moves a scale (the summary reports it instead).
KILN_HD inline float fp8_history_amax(const float* history, int len, Fp8AmaxAlgo algo) {
  if (algo == Fp8AmaxAlgo::most_recent) return history[0];
  float m = 0.0f;
  for (int j = 0; j < len; ++j)
    if (history[j] <= 3.0e38f && history[j] > m) m = history[j];
  return m;
}

// The summary of the window (before fp8_update_tensor resets it); serial over the tensors.
KILN_HD inline void fp8_summarize(float* s, const Fp8StateLayout& l, const Fp8Options& o) {
  float* sum = s + l.summary();
  float worst_sat = -1.0f, worst_growth = -1.0f;
  int worst = -1, non_finite = 0, first_non_finite = -1;
  for (int i = 0; i < l.n; ++i) {
    const float amax = s[l.amax() + i];
    if (!(amax <= 3.0e38f)) {
      if (non_finite++ == 0) first_non_finite = i;
      continue;
    }
    const float cast = s[l.cast() + i];
    const float sat = cast > 0.0f ? s[l.saturated() + i] / cast : 0.0f;
    const float scale_amax =
        fp8_max(fp8_role_is_e5m2(i % kFp8Roles, o.format)) / s[l.scale() + i] /
        ldexpf(1.0f, o.margin);
    const float growth = amax / scale_amax;
    if (sat > worst_sat || (sat == worst_sat && growth > worst_growth)) {
      worst_sat = sat;
      worst_growth = growth;
      worst = i;
    }
  }
  sum[kFp8WorstSaturation] = worst < 0 ? 0.0f : worst_sat;
  sum[kFp8WorstTensor] = static_cast<float>(worst);
  sum[kFp8WorstAmax] = worst < 0 ? 0.0f : s[l.amax() + worst];
  sum[kFp8WorstScaleAmax] =
      worst < 0 ? 0.0f
                : fp8_max(fp8_role_is_e5m2(worst % kFp8Roles, o.format)) / s[l.scale() + worst] /
                      ldexpf(1.0f, o.margin);
  sum[kFp8NonFinite] = static_cast<float>(non_finite);
  sum[kFp8FirstNonFinite] = static_cast<float>(first_non_finite);
}

// Tensor i's update: the window's amax becomes the newest history entry (the oldest drops
// out), the scale is set from the history, and the window is reset.
KILN_HD inline void fp8_update_tensor(float* s, const Fp8StateLayout& l, int i,
                                      const Fp8Options& o) {
  float* h = s + l.histories() + static_cast<int64_t>(i) * l.history;
  const float window = s[l.amax() + i];
  for (int j = l.history - 1; j > 0; --j) h[j] = h[j - 1];
  h[0] = window;
  const float amax = fp8_history_amax(h, l.history, o.amax_compute_algo);
  const float max_value = fp8_max(fp8_role_is_e5m2(i % kFp8Roles, o.format));
  const float scale = fp8_next_scale(amax, s[l.scale() + i], max_value, o.margin);
  s[l.scale() + i] = scale;
  s[l.scale_inv(i)] = 1.0f / scale;
  s[l.last_amax() + i] = window;
  s[l.amax() + i] = 0.0f;
  s[l.saturated() + i] = 0.0f;
  s[l.cast() + i] = 0.0f;
}

// x rounded to the nearest value of the format (ties to even), saturated to +-max (infinities
// too), NaN kept: what __nv_cvt_float_to_fp8(x, __NV_SATFINITE, ...) returns, bit for bit.
KILN_HD inline uint8_t fp8_encode(float x, bool e5m2) {
  const int mant_bits = e5m2 ? 2 : 3;
  const int bias = e5m2 ? 15 : 7;
  uint32_t bits;
  memcpy(&bits, &x, 4);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  if (x != x) return static_cast<uint8_t>(sign | 0x7F);
  const float a = fabsf(x);
  const float max_value = fp8_max(e5m2);
  const uint8_t max_code = e5m2 ? 0x7B : 0x7E;
  if (a >= max_value) return static_cast<uint8_t>(sign | max_code);
  if (a == 0.0f) return sign;
  // The spacing of the format's values around a: 2^(e - mant_bits) in binade e, the subnormal
  // spacing below the smallest normal 2^(1-bias). Dividing by a power of two is exact, so the
  // rounding happens once, in rintf (ties to even in the default mode).
  int e = static_cast<int>((bits >> 23) & 0xFF) - 127;
  if (e < 1 - bias) e = 1 - bias;
  const float quantum = ldexpf(1.0f, e - mant_bits);
  const float q = rintf(a / quantum);  // an integer below 2^(mant_bits+1), or exactly that
  if (q == 0.0f) return sign;
  // q * quantum may have carried into the next binade (q == 2^(mant_bits+1)).
  int qi = static_cast<int>(q);
  int exp_field = e + bias;
  if (qi >= (2 << mant_bits)) {
    qi >>= 1;
    ++exp_field;
  }
  uint8_t code;
  if (qi < (1 << mant_bits)) {
    code = static_cast<uint8_t>(qi);  // a subnormal: exponent field 0
  } else {
    code = static_cast<uint8_t>((exp_field << mant_bits) | (qi - (1 << mant_bits)));
  }
  if (code > max_code) code = max_code;  // rounded past the largest finite value
  return static_cast<uint8_t>(sign | code);
}

KILN_HD inline float fp8_decode(uint8_t code, bool e5m2) {
  const int mant_bits = e5m2 ? 2 : 3;
  const int bias = e5m2 ? 15 : 7;
  const float sign = (code & 0x80) ? -1.0f : 1.0f;
  const int exp_field = (code >> mant_bits) & (e5m2 ? 0x1F : 0x0F);
  const int mant = code & ((1 << mant_bits) - 1);
  if (e5m2 && exp_field == 0x1F) return mant ? NAN : sign * INFINITY;
  if (!e5m2 && (code & 0x7F) == 0x7F) return NAN;
  if (exp_field == 0) return sign * ldexpf(static_cast<float>(mant), 1 - bias - mant_bits);
  return sign * ldexpf(static_cast<float>((1 << mant_bits) | mant), exp_field - bias - mant_bits);
}

}  // namespace kiln
