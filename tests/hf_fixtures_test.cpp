// Parity with transformers in CI, without torch: the tiny random GPT-2, LLaMA (plain and with
// Llama 3.1's RoPE scaling), Qwen3, Qwen3-MoE
// (routed every other block) and Mixtral that make_hf_fixtures.py (beside them in
// tests/fixtures/hf/) saved with transformers load into kiln, whose fp32 CPU loss on the
// committed batch matches transformers' recorded loss (rel 1e-5) and whose greedy decoding gives
// transformers' 32 tokens. The batch was sampled from each model, so a
// swapped or mis-transposed tensor moves the loss far past the tolerance (expected.json records
// by how much). Skips until the fixtures are committed.
#include <gtest/gtest.h>

#include <filesystem>

#include "tests/hf_parity.h"

namespace kiln {
namespace {

const std::string kFixtures = std::string(KILN_SOURCE_DIR) + "/tests/fixtures/hf";

class HfFixtures : public ::testing::TestWithParam<std::string> {};

TEST_P(HfFixtures, KilnMatchesTransformersLossAndGreedyTokens) {
  if (!std::filesystem::exists(kFixtures + "/expected.json"))
    GTEST_SKIP() << kFixtures << " not committed yet: run tests/fixtures/hf/make_hf_fixtures.py "
                 << "on a host with torch and transformers";
  const std::string arch = GetParam();
  const auto expected = kiln::testing::read_hf_expected(kFixtures, arch);
  const std::unique_ptr<Backend> cpu = make_cpu_backend();
  const kiln::testing::KilnScore kiln = kiln::testing::kiln_score(
      *cpu, kFixtures + "/" + arch, expected.rows, expected.prompt, expected.new_tokens);
  kiln::testing::expect_matches_transformers(kiln, expected, 1e-5, true, arch);
}

INSTANTIATE_TEST_SUITE_P(Archs, HfFixtures,
                         ::testing::Values("gpt2", "llama", "llama31", "qwen3", "qwen3_moe",
                                           "mixtral"));

}  // namespace
}  // namespace kiln
