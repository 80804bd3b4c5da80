#include "kernels/rope_freq.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace kiln {

std::string rope_error(const Rope& rope) {
  if (!std::isfinite(rope.theta) || !(rope.theta > 0.0f))
    return "theta must be finite and > 0, got " + std::to_string(rope.theta);
  const RopeScaling& s = rope.scaling;
  if (s.type.empty()) return "";
  if (s.type != "llama3") return "scaling type must be llama3, got '" + s.type + "'";
  for (float f : {s.factor, s.low_freq_factor, s.high_freq_factor})
    if (!std::isfinite(f) || !(f > 0.0f)) return "llama3 scaling's factors must be finite and > 0";
  if (!(s.high_freq_factor > s.low_freq_factor) || s.original_max_position <= 0)
    return "llama3 scaling needs high_freq_factor > low_freq_factor and original_max_position > 0";
  return "";
}

std::vector<float> rope_inv_freq(int head_dim, const Rope& rope) {
  if (head_dim <= 0 || head_dim % 2 != 0)
    throw std::invalid_argument("rope: head_dim must be even and positive, got " +
                                std::to_string(head_dim));
  const std::string why = rope_error(rope);
  if (!why.empty()) throw std::invalid_argument("rope: " + why);
  const float theta = rope.theta;
  const RopeScaling& s = rope.scaling;
  std::vector<float> inv(static_cast<size_t>(head_dim / 2));
  for (size_t i = 0; i < inv.size(); ++i)
    inv[i] = 1.0f / std::pow(theta, static_cast<float>(2 * i) / static_cast<float>(head_dim));
  if (s.type.empty()) return inv;
  // As torch evaluates transformers' expressions on f32 tensors: a scalar divided by a tensor is
  // the tensor's reciprocal times the scalar, and Python's double scalars enter as f32.
  const float old_len = static_cast<float>(s.original_max_position);
  const float low_wavelen = static_cast<float>(static_cast<double>(s.original_max_position) /
                                               static_cast<double>(s.low_freq_factor));
  const float high_wavelen = static_cast<float>(static_cast<double>(s.original_max_position) /
                                                static_cast<double>(s.high_freq_factor));
  const float two_pi = static_cast<float>(2.0 * M_PI);
  const float band = static_cast<float>(static_cast<double>(s.high_freq_factor) -
                                        static_cast<double>(s.low_freq_factor));
  for (float& f : inv) {
    const float wavelen = (1.0f / f) * two_pi;
    const float scaled = wavelen > low_wavelen ? f / s.factor : f;
    if (wavelen < high_wavelen || wavelen > low_wavelen) {
      f = scaled;
      continue;
    }
    const float smooth = ((1.0f / wavelen) * old_len - s.low_freq_factor) / band;
    f = (1.0f - smooth) * scaled / s.factor + smooth * scaled;
  }
  return inv;
}

}  // namespace kiln
