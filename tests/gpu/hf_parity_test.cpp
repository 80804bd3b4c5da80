// Parity with transformers where torch and transformers are installed (the GPU host): fresh
// tiny random GPT-2, LLaMA, Qwen3, Qwen3-MoE and Mixtral are saved by save_pretrained
// (tests/fixtures/hf/make_hf_fixtures.py) and imported by kiln. On the same batch (sampled from each model, so a swapped tensor shows),
// kiln's loss matches transformers' in fp32 on the CPU backend (rel 1e-5) and on CUDA in bf16
// (rel 1e-2: bf16 activations); greedy decoding agrees for 32 tokens; and a kiln-trained
// checkpoint exported with `convert --to hf` loads in transformers and gives kiln's loss. Skips
// without transformers.
#include <gtest/gtest.h>

#include <filesystem>

#include "data/shard.h"
#include "tests/hf_parity.h"
#include "tests/test_process.h"

namespace kiln {
namespace {

using kiln::testing::run_command;

const std::string kBin = KILN_BIN_DIR;
const std::string kSrc = KILN_SOURCE_DIR;

class HfParity : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() {
    dir_ = kiln::testing::make_temp_dir("kiln_hf_parity_");
    const auto r =
        run_command("python3 " + kSrc + "/tests/fixtures/hf/make_hf_fixtures.py " + dir_);
    status_ = r.status;
    output_ = r.output;
  }
  void SetUp() override {
    if (status_ == 3) GTEST_SKIP() << "torch/transformers missing: " << output_;
    ASSERT_EQ(status_, 0) << output_;
  }
  kiln::testing::HfExpected expected() const {
    return kiln::testing::read_hf_expected(dir_, GetParam());
  }
  std::vector<std::vector<int>> rows() const { return expected().rows; }
  static std::string dir_, output_;
  static int status_;
};
std::string HfParity::dir_, HfParity::output_;
int HfParity::status_ = 0;

TEST_P(HfParity, CpuLossAndGreedyMatchTransformers) {
  const auto e = expected();
  const std::unique_ptr<Backend> cpu = make_cpu_backend();
  const auto kiln =
      kiln::testing::kiln_score(*cpu, dir_ + "/" + GetParam(), e.rows, e.prompt, e.new_tokens);
  kiln::testing::expect_matches_transformers(kiln, e, 1e-5, true, GetParam());
}

TEST_P(HfParity, CudaLossMatchesTransformers) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  const auto e = expected();
  const std::unique_ptr<Backend> gpu = make_cuda_backend(0);
  const auto kiln =
      kiln::testing::kiln_score(*gpu, dir_ + "/" + GetParam(), e.rows, e.prompt, e.new_tokens);
  // transformers scores in f32; kiln's CUDA backend keeps activations in bf16 (8 mantissa bits),
  // which moved the loss by 0.27% (gpt2), 0.40% (llama) and 0.13% (qwen3) on an H100. A wrong
  // mapping moves it by far more (expected.json's swapped_loss: over 100%); the CPU test holds
  // the f32 path to 1e-5.
  kiln::testing::expect_matches_transformers(kiln, e, 1e-2, false, GetParam());
}

// kiln trains the imported model one step, exports it, and transformers scores the export.
TEST_P(HfParity, ExportOfAKilnTrainedModelLoadsInTransformers) {
  const std::string arch = GetParam(), d = dir_ + "/train_" + arch;
  std::filesystem::create_directories(d);
  std::vector<uint16_t> stream;
  for (const auto& r : rows()) stream.insert(stream.end(), r.begin(), r.end());
  write_shard(d + "/train_000000.bin", stream);
  const LoadedModel m = load_model("hf:" + dir_ + "/" + arch);
  const ModelConfig& c = m.config;
  // The MoE models train from their dense architecture's tiny config with their experts.
  const std::string config = kSrc + "/configs/" + (arch == "gpt2" ? "tiny" : c.arch + "-tiny") + ".yaml";
  std::string moe;
  if (c.moe.n_experts > 0)
    moe = " --moe.n_experts=" + std::to_string(c.moe.n_experts) +
          " --moe.top_k=" + std::to_string(c.moe.top_k) +
          " --moe.expert_ffn_dim=" + std::to_string(c.moe.expert_ffn_dim) +
          " --moe.every=" + std::to_string(c.moe.every) +
          " --moe.renormalize=" + (c.moe.renormalize ? "true" : "false") +
          " --model.tie_embeddings=" + (c.tie_embeddings ? "true" : "false") +
          " --model.rope_theta=" + std::to_string(c.rope_theta);
  const RopeScaling& rs = c.rope_scaling;
  const std::string rope =
      rs.type.empty() ? ""
                      : " --model.rope_scaling=" + rs.type +
                            " --model.rope_factor=" + std::to_string(rs.factor) +
                            " --model.rope_low_freq_factor=" + std::to_string(rs.low_freq_factor) +
                            " --model.rope_high_freq_factor=" +
                            std::to_string(rs.high_freq_factor) +
                            " --model.rope_original_max_position=" +
                            std::to_string(rs.original_max_position);
  auto r = run_command(
      kBin + "/train " + config + " --train.device=cpu --train.max_steps=1 --train.batch_size=1" + rope +
      " --train.eval_every=0 --data.val= --data.train=" + d + "/train_000000.bin" +
      " --model.n_layer=" + std::to_string(c.n_layer) + " --model.n_head=" + std::to_string(c.n_head) +
      " --model.n_kv_head=" + std::to_string(c.attention().n_kv_head) +
      " --model.head_dim=" + std::to_string(c.head_dim) + " --model.n_embd=" + std::to_string(c.n_embd) +
      " --model.ffn_dim=" + std::to_string(c.ffn_dim) + " --model.vocab_size=" + std::to_string(c.vocab_size) +
      " --model.seq_len=" + std::to_string(arch == "gpt2" ? c.seq_len : 64) + " --init.from=hf:" + dir_ + "/" + arch + " --train.out_dir=" + d + "/run" + moe);
  ASSERT_EQ(r.status, 0) << r.output;
  r = run_command(kBin + "/convert " + d + "/run --to hf " + d + "/export --dtype f32");
  ASSERT_EQ(r.status, 0) << r.output;
  std::ofstream(d + "/rows.json") << nlohmann::json(rows()).dump();
  r = run_command("python3 " + kSrc + "/tests/fixtures/hf/make_hf_fixtures.py --score " + d +
                  "/export " + d + "/rows.json 2>/dev/null");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto hf = nlohmann::json::parse(r.output.substr(r.output.rfind('{')));
  const std::unique_ptr<Backend> cpu = make_cpu_backend();
  const auto kiln = kiln::testing::kiln_score(*cpu, d + "/export", rows(),
                                              hf["prompt"].get<std::vector<int>>(), 32);
  EXPECT_NEAR(kiln.loss, hf["loss"].get<double>(), 1e-5 * kiln.loss);
  EXPECT_EQ(kiln.greedy, hf["greedy"].get<std::vector<int>>());
}

INSTANTIATE_TEST_SUITE_P(Archs, HfParity,
                         ::testing::Values("gpt2", "llama", "llama31", "qwen3", "qwen3_moe",
                                           "mixtral"));

}  // namespace
}  // namespace kiln
