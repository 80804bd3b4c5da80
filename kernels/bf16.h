// bf16 <-> f32 on the host. f32 -> bf16 rounds to nearest, ties to even (what the GPU's
// __float2bfloat16_rn does), so the CPU backend, checkpoints and tests all round the same way;
// NaN stays a (quiet) NaN instead of rounding into infinity.
#pragma once

#include <cstdint>
#include <cstring>

namespace kiln {

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);  // round half to even on the 16 bits dropped
  return static_cast<uint16_t>(u >> 16);
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace kiln
