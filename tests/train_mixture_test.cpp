// A weighted mixture of two corpora (data.sources) through the real `train` binary on the CPU:
// the tokens each source got, as metrics.jsonl counts them, are the configured shares within
// 1%; val loss is logged per source; a resume from a checkpoint reproduces the uninterrupted
// run's losses bit for bit; a weight change on resume is taken and logged; a mixture's bad
// input exits 2 with one line.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tests/test_process.h"

namespace {

namespace fs = std::filesystem;

const std::string kBin = KILN_BIN_DIR;
const std::string kSrc = KILN_SOURCE_DIR;

using kiln::testing::read_losses;
using kiln::testing::read_metric;
using Result = kiln::testing::CommandResult;
Result run(const std::string& cmd) {
  return kiln::testing::run_command(cmd);
}

class TrainMixture : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = kiln::testing::make_temp_dir("kiln_mixture_e2e_");
    Result r = kiln::testing::prepare_corpus(kBin, kSrc, (dir_ / "web").string());
    ASSERT_EQ(r.status, 0) << r.output;
    r = run(kBin + "/prepare_data --out " + (dir_ / "code").string() + " --val-fraction 0.1 " +
            kSrc + "/docs/design.md " + kSrc + "/docs/data.md " + kSrc + "/docs/config.md");
    ASSERT_EQ(r.status, 0) << r.output;
  }
  static std::string sources(double web, double code) {
    const std::string w = (dir_ / "web").string(), c = (dir_ / "code").string();
    return "--data.sources='[{name: web, train: \"" + w + "/train_*.bin\", val: \"" + w +
           "/val_*.bin\", weight: " + std::to_string(web) + "}, {name: code, train: \"" + c +
           "/train_*.bin\", val: \"" + c + "/val_*.bin\", weight: " + std::to_string(code) + "}]'";
  }
  static std::string train_cmd(const std::string& out_dir, const std::string& extra) {
    return kBin + "/train " + kSrc + "/configs/tiny.yaml --train.device=cpu --data.train=" +
           " --data.val= --model.n_layer=2 --model.n_embd=64 --model.n_head=4" +
           " --model.seq_len=64 --train.batch_size=8 --train.eval_every=10" +
           " --train.eval_steps=2 --train.log_every=5 --optim.warmup_steps=5 --train.out_dir=" +
           out_dir + " " + extra;
  }
  static fs::path dir_;
};
fs::path TrainMixture::dir_;

TEST_F(TrainMixture, SharesFollowTheWeightsValIsPerSourceAndResumeIsBitForBit) {
  const std::string full = (dir_ / "full").string();
  Result r =
      run(train_cmd(full, sources(0.7, 0.3) + " --train.max_steps=20 --train.checkpoint_every=10"
                                              " --train.keep_checkpoints=5"));
  ASSERT_EQ(r.status, 0) << r.output;
  const std::vector<double> web = read_metric(full, "tokens_web"),
                            code = read_metric(full, "tokens_code");
  ASSERT_EQ(web.size(), 20u);
  ASSERT_EQ(code.size(), 20u);
  for (size_t i = 0; i < web.size(); ++i) {
    const double windows = 8.0 * static_cast<double>(i + 1);
    EXPECT_EQ(web[i] + code[i], windows * 64) << "step " << i + 1;
    EXPECT_LE(std::abs(web[i] / 64 - 0.7 * windows), 1.0) << "step " << i + 1;  // a window
  }
  EXPECT_NEAR(web.back() / (web.back() + code.back()), 0.7, 0.01);
  // Evaluated at steps 10 and 20: each source, and their mean by weight.
  const std::vector<double> val_web = read_metric(full, "val_loss_web"),
                            val_code = read_metric(full, "val_loss_code"),
                            val = read_metric(full, "val_loss");
  ASSERT_EQ(val_web.size(), 2u);
  ASSERT_EQ(val_code.size(), 2u);
  ASSERT_EQ(val.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_GT(val_web[i], 0);
    EXPECT_GT(val_code[i], 0);
    EXPECT_NEAR(val[i], 0.7 * val_web[i] + 0.3 * val_code[i], 1e-5);
  }
  EXPECT_NE(r.output.find("data source 'web'"), std::string::npos) << r.output;

  // A second run starts from the step-10 checkpoint of the first and runs to 20.
  const std::string resumed = (dir_ / "resumed").string();
  fs::create_directories(resumed + "/checkpoints");
  fs::copy(full + "/checkpoints/step_00000010", resumed + "/checkpoints/step_00000010",
           fs::copy_options::recursive);
  r = run(train_cmd(resumed, sources(0.7, 0.3) + " --train.max_steps=20"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
  const auto a = read_losses(full), b = read_losses(resumed);
  ASSERT_EQ(b.size(), 10u);
  for (size_t i = 0; i < 10; ++i) {
    EXPECT_EQ(b[i].step, a[10 + i].step);
    EXPECT_EQ(b[i].text, a[10 + i].text) << "step " << b[i].step;
  }
  EXPECT_EQ(read_metric(resumed, "tokens_web").back(), web.back());

  // Other weights on resume: taken from the checkpoint's step on, and said.
  const std::string reweighted = (dir_ / "reweighted").string();
  fs::create_directories(reweighted + "/checkpoints");
  fs::copy(full + "/checkpoints/step_00000010", reweighted + "/checkpoints/step_00000010",
           fs::copy_options::recursive);
  r = run(train_cmd(reweighted, sources(0.5, 0.5) + " --train.max_steps=20"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("weights changed since the checkpoint (web 0.7 -> 0.5, code 0.3 -> "
                          "0.5)"),
            std::string::npos)
      << r.output;
  const double web10 = web[9];
  const double added_web = read_metric(reweighted, "tokens_web").back() - web10;
  EXPECT_EQ(added_web, 0.5 * 10 * 8 * 64);
}

TEST_F(TrainMixture, BadMixturesExitWithStatus2AndOneLine) {
  const std::string out = (dir_ / "bad").string();
  const std::string w = (dir_ / "web").string();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {sources(0.7, 0.3) + " --data.train='" + w + "/train_*.bin'",
       "data.train: is set beside data.sources"},
      {sources(0.7, 0), "weight must be > 0"},
      {"--data.sources='[{name: web, train: \"" + w + "/nothing_*.bin\", val: \"" + w +
           "/val_*.bin\"}]'",
       "data.sources: source 'web'"},
      {"--data.sources='[{name: web, train: \"" + w + "/train_*.bin\", val: \"" + w +
           "/nothing_*.bin\"}]'",
       "data.sources web val"},
  };
  for (const auto& [args, expect] : cases) {
    const Result r = run(train_cmd(out, args + " --train.max_steps=2"));
    EXPECT_EQ(r.status, 2) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(expect), std::string::npos) << args << "\n" << r.output;
  }
  // Resuming a one-glob run's checkpoint as a mixture names both.
  const std::string plain = (dir_ / "plain").string();
  Result r = run(train_cmd(plain, "--data.train='" + w + "/train_*.bin' --data.val='" + w +
                                     "/val_*.bin' --train.max_steps=2"));
  ASSERT_EQ(r.status, 0) << r.output;
  r = run(train_cmd(plain, sources(0.7, 0.3) + " --train.max_steps=4"));
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("the saved position is of one glob (data.train), this run's sources "
                          "are (web, code)"),
            std::string::npos)
      << r.output;
}

// A resume the checkpoint refuses (a source renamed, or the mixture resumed as one glob) leaves
// config.yaml as the checkpoint's run wrote it.
TEST_F(TrainMixture, ARefusedResumeLeavesConfigYamlAsItWas) {
  const std::string out = (dir_ / "refused").string();
  Result r = run(train_cmd(out, sources(0.7, 0.3) + " --train.max_steps=2"));
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string config = kiln::testing::read_file(out + "/config.yaml");
  std::string renamed = sources(0.7, 0.3);
  renamed.replace(renamed.find("name: code"), 10, "name: books");
  const std::string w = (dir_ / "web").string();
  for (const std::string& args : {renamed, "--data.train='" + w + "/train_*.bin'"}) {
    r = run(train_cmd(out, args + " --train.max_steps=4"));
    EXPECT_EQ(r.status, 2) << args << "\n" << r.output;
    EXPECT_EQ(kiln::testing::read_file(out + "/config.yaml"), config) << args << "\n" << r.output;
  }
}

}  // namespace
