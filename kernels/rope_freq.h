// RoPE's inverse frequencies, one per rotated pair, computed on the host once for every backend
// so that the CPU reference and the CUDA kernels rotate by the same f32 angles. The default is
// transformers' 1 / theta^(float(2i) / head_dim); Llama 3.1's "llama3" scaling (rope_type: llama3)
// then divides the low frequencies (wavelength past original_max_position / low_freq_factor) by
// `factor`, keeps the high ones (wavelength below original_max_position / high_freq_factor), and
// blends the band between, with transformers' f32 arithmetic operation for operation.
#pragma once

#include <string>
#include <vector>

namespace kiln {

struct RopeScaling {
  std::string type;  // "" (none) or "llama3"
  float factor = 8.0f;
  float low_freq_factor = 1.0f;
  float high_freq_factor = 4.0f;
  int original_max_position = 8192;
  bool operator==(const RopeScaling& o) const {
    return type == o.type && factor == o.factor && low_freq_factor == o.low_freq_factor &&
           high_freq_factor == o.high_freq_factor &&
           original_max_position == o.original_max_position;
  }
};

// What the rope ops rotate by: the base and the scaling of its frequencies.
struct Rope {
  float theta = 10000.0f;
  RopeScaling scaling;
  bool operator==(const Rope& o) const { return theta == o.theta && scaling == o.scaling; }
};

// Why `rope` cannot be used ("" if it can): theta not finite and positive, a scaling type other
// than "" and "llama3", or llama3 factors that are not finite and positive, high_freq_factor <=
// low_freq_factor, or original_max_position <= 0.
std::string rope_error(const Rope& rope);

// head_dim / 2 values. std::invalid_argument for an odd head_dim or what rope_error names.
std::vector<float> rope_inv_freq(int head_dim, const Rope& rope);

}  // namespace kiln
