// rope_inv_freq against transformers 5.24's _compute_llama3_parameters / default RoPE, bit for bit
// (the expected words were printed by transformers' own ROPE_INIT_FUNCTIONS on the CPU).
#include "kernels/rope_freq.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

namespace kiln {
namespace {

std::vector<uint32_t> bits(const std::vector<float>& v) {
  std::vector<uint32_t> out(v.size());
  std::memcpy(out.data(), v.data(), v.size() * sizeof(float));
  return out;
}

// head_dim 16, theta 1e4, original context 64: wavelengths from 6.3 to ~2e4 cross both bounds
// (16 and 64), so the kept, blended and divided bands all appear.
TEST(RopeFreq, Llama3ScalingMatchesTransformersInEveryBand) {
  const RopeScaling s{"llama3", 8.0f, 1.0f, 4.0f, 64};
  const std::vector<uint32_t> want = {0x3f800000, 0x3e7a3ff4, 0x3c55af30, 0x3b8186e3,
                                      0x3aa3d70a, 0x39cf3e38, 0x3903126f, 0x3825cb60};
  EXPECT_EQ(bits(rope_inv_freq(16, Rope{10000.0f, s})), want);
}

// Llama-3.1-8B's own parameters: head_dim 128, theta 5e5, factor 8, 1 / 4, 8192.
TEST(RopeFreq, Llama31EightBMatchesTransformers) {
  const RopeScaling s{"llama3", 8.0f, 1.0f, 4.0f, 8192};
  const std::vector<uint32_t> want = {
      0x3f800000, 0x3f508ac1, 0x3f29e1c6, 0x3f0a6384, 0x3ee177bc, 0x3eb7ab7d, 0x3e959ee3,
      0x3e73c461, 0x3e4693b0, 0x3e21c3a0, 0x3e03c6a0, 0x3dd6b19c, 0x3daee4ad, 0x3d8e7898,
      0x3d681e67, 0x3d3d1684, 0x3d1a08c8, 0x3cfaf53f, 0x3ccc6f49, 0x3ca68939, 0x3c87a9c3,
      0x3c5d06ec, 0x3c340d6d, 0x3c12ac7f, 0x3beef74f, 0x3bc2aa76, 0x3b9e9402, 0x3b812e35,
      0x3b527720, 0x3b0dfd06, 0x3ab3d11d, 0x3a60979e, 0x3a0995d2, 0x39a3f108, 0x393b2dd2,
      0x38c86886, 0x38a3418d, 0x3884fdbf, 0x3858ac81, 0x38308199, 0x380fc8f8, 0x37ea426f,
      0x37bed4f4, 0x379b7475, 0x377d45c3, 0x374e51f5, 0x3728126b, 0x3708ea0f, 0x36df10c4,
      0x36b5b687, 0x369406cb, 0x36712b80, 0x36447610, 0x36200a69, 0x36025f34, 0x35d46808,
      0x35ad07a7, 0x358cf400, 0x3565a54d, 0x353b12c7, 0x351864a7, 0x34f848c2, 0x34ca41b0,
      0x34a4c2ff};
  EXPECT_EQ(bits(rope_inv_freq(128, Rope{500000.0f, s})), want);
}

TEST(RopeFreq, NoScalingIsTheDefaultFormula) {
  const std::vector<float> f = rope_inv_freq(8, Rope{10000.0f, {}});
  ASSERT_EQ(f.size(), 4u);
  EXPECT_EQ(f[0], 1.0f);
  EXPECT_EQ(f[2], 1.0f / std::pow(10000.0f, 0.5f));
}

TEST(RopeFreq, BadParametersAreRefused) {
  EXPECT_THROW(rope_inv_freq(7, Rope{10000.0f, {}}), std::invalid_argument);
  EXPECT_THROW(rope_inv_freq(8, Rope{0.0f, {}}), std::invalid_argument);
  EXPECT_THROW(rope_inv_freq(8, Rope{1e4f, {"yarn", 8, 1, 4, 64}}), std::invalid_argument);
  EXPECT_THROW(rope_inv_freq(8, Rope{1e4f, {"llama3", 8, 4, 1, 64}}), std::invalid_argument);
  EXPECT_THROW(rope_inv_freq(8, Rope{1e4f, {"llama3", -1, 1, 4, 64}}), std::invalid_argument);
  EXPECT_THROW(rope_inv_freq(8, Rope{1e4f, {"llama3", 8, 1, 4, 0}}), std::invalid_argument);
}

}  // namespace
}  // namespace kiln
