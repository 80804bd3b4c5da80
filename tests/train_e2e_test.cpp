// End to end through the real binaries: prepare_data shards a text, `train` trains on the CPU
// with loss clearly falling, resuming from a checkpoint (written synchronously or in the
// background) reproduces the uninterrupted run's losses bit for bit, and every kind of bad input
// exits with status 2 and a one-line error.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "state/checkpoint.h"
#include "tests/test_process.h"

namespace {

namespace fs = std::filesystem;

const std::string kBin = KILN_BIN_DIR;
const std::string kSrc = KILN_SOURCE_DIR;

using kiln::testing::read_losses;
using Result = kiln::testing::CommandResult;
Result run(const std::string& cmd) { return kiln::testing::run_command(cmd); }

class TrainE2E : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = kiln::testing::make_temp_dir("kiln_e2e_");
    const Result r = kiln::testing::prepare_corpus(kBin, kSrc, (dir_ / "data").string());
    ASSERT_EQ(r.status, 0) << r.output;
  }
  static std::string train_cmd(const std::string& out_dir, const std::string& extra) {
    const std::string data = (dir_ / "data").string();
    return kBin + "/train " + kSrc + "/configs/tiny.yaml --train.device=cpu" +
           " --data.train='" + data + "/train_*.bin' --data.val='" + data + "/val_*.bin'" +
           " --model.n_layer=2 --model.n_embd=64 --model.n_head=4 --model.seq_len=64" +
           " --train.batch_size=8 --train.eval_every=10 --train.eval_steps=2 --train.log_every=5" +
           " --optim.warmup_steps=5 --train.out_dir=" + out_dir + " " + extra;
  }
  static fs::path dir_;
};
fs::path TrainE2E::dir_;

TEST_F(TrainE2E, LossFallsAndMetricsAreWritten) {
  const std::string out = (dir_ / "run_falls").string();
  const Result r = run(train_cmd(out, "--train.max_steps=60"));
  ASSERT_EQ(r.status, 0) << r.output;
  const auto m = read_losses(out);
  ASSERT_EQ(m.size(), 60u);
  EXPECT_EQ(m.front().step, 1);
  EXPECT_EQ(m.back().step, 60);
  EXPECT_GT(m.front().value, 5.0);  // ~ln(256) at init
  EXPECT_LT(m.back().value, m.front().value - 2.0) << "loss did not fall";
  EXPECT_TRUE(fs::exists(out + "/config.yaml"));
  std::ifstream in(out + "/metrics.jsonl");
  std::string all((std::istreambuf_iterator<char>(in)), {});
  EXPECT_NE(all.find("\"val_loss\":"), std::string::npos);
  for (const char* key : {"\"lr\":", "\"grad_norm\":", "\"ms\":", "\"tok_s\":", "\"mfu\":"})
    EXPECT_NE(all.find(key), std::string::npos) << key;
  // Each step is timed as its own work, the last one too (the CPU does a step's work while it
  // is enqueued; timing it until its values are read would charge it the next step's work, and
  // the steps that finish on the host, evaluation every 10 and the last, would read ~0.1 ms).
  // The yardstick is the fastest ordinary step, this machine's speed with nothing beside it:
  // tests running alongside slow steps down by up to 40x (OpenMP threads spinning on shared
  // cores) and never speed one up, so a median can sit far above a step's own work.
  std::vector<double> ms;
  for (size_t at = all.find("\"ms\":"); at != std::string::npos; at = all.find("\"ms\":", at + 1))
    ms.push_back(std::stod(all.substr(at + 5)));
  ASSERT_EQ(ms.size(), 60u);
  double fastest_ordinary = ms[1];
  for (size_t i = 1; i < ms.size(); ++i)
    if ((i + 1) % 10 != 0) fastest_ordinary = std::min(fastest_ordinary, ms[i]);
  for (size_t i = 0; i < ms.size(); ++i)
    EXPECT_GT(ms[i], fastest_ordinary / 10) << "step " << i + 1;
}

// `model` picks the architecture (extra flags for every run); `tag` names the run directories.
using TrainCmd = std::string (*)(const std::string& out_dir, const std::string& extra);
void check_resume_is_bit_identical(const fs::path& dir, const std::string& tag,
                                   const std::string& model, TrainCmd train_cmd) {
  const std::string full = (dir / ("run_full" + tag)).string();
  Result r = run(train_cmd(full, model + " --train.max_steps=20 --train.checkpoint_every=10"
                                         " --train.keep_checkpoints=5"));
  ASSERT_EQ(r.status, 0) << r.output;
  // A second run starts from the step-10 checkpoint of the first and runs to 20.
  const std::string resumed = (dir / ("run_resumed" + tag)).string();
  fs::create_directories(resumed + "/checkpoints");
  fs::copy(full + "/checkpoints/step_00000010", resumed + "/checkpoints/step_00000010",
           fs::copy_options::recursive);
  r = run(train_cmd(resumed, model + " --train.max_steps=20 --train.checkpoint_every=10"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
  const auto a = read_losses(full);
  const auto b = read_losses(resumed);
  ASSERT_EQ(a.size(), 20u);
  ASSERT_EQ(b.size(), 10u);
  for (size_t i = 0; i < 10; ++i) {
    EXPECT_EQ(b[i].step, a[10 + i].step);
    EXPECT_EQ(b[i].text, a[10 + i].text) << "step " << b[i].step;
  }
}

TEST_F(TrainE2E, ResumeReproducesTheUninterruptedRunBitForBit) {
  check_resume_is_bit_identical(dir_, "", "", train_cmd);
}

// LLaMA (GQA, RMSNorm, RoPE, SwiGLU, untied) and Qwen3 (QK-norm, head_dim 32 != 64 / 4) from the
// same tiny shape: they learn, and resume bit for bit.
TEST_F(TrainE2E, LlamaAndQwen3TrainAndResumeBitForBit) {
  const std::string llama = "--model.arch=llama --model.n_kv_head=2";
  const std::string qwen3 = "--model.arch=qwen3 --model.n_kv_head=2 --model.head_dim=32";
  check_resume_is_bit_identical(dir_, "_llama", llama, train_cmd);
  check_resume_is_bit_identical(dir_, "_qwen3", qwen3, train_cmd);
  for (const auto& [tag, model] : {std::pair{"llama", llama}, std::pair{"qwen3", qwen3}}) {
    const auto m = read_losses((dir_ / (std::string("run_full_") + tag)).string());
    ASSERT_EQ(m.size(), 20u);
    EXPECT_LT(m.back().value, m.front().value - 1.0) << tag << ": loss did not fall";
  }
}

// Document masking end to end: a byte corpus of the licence texts, each a document after a 0
// byte (prepare_data --doc-separator 0), trained by a tiny LLaMA whose attention stays inside
// each document and whose RoPE positions restart with each. Its loss falls, the run says the
// mask is on, the mask changes the losses (so the keys reach the model), and a resume
// reproduces the uninterrupted run bit for bit (the document starts come from the tokens).
class TrainDocuments : public TrainE2E {
 protected:
  static void SetUpTestSuite() {
    TrainE2E::SetUpTestSuite();
    // Short documents (a licence's paragraphs, a few hundred bytes each), so that most
    // batches of 64-token windows hold a document boundary.
    std::string text_path = "/usr/share/common-licenses/GPL-3";
    if (!fs::exists(text_path)) text_path = kSrc + "/README.md";
    std::ifstream in(text_path);
    const std::string text((std::istreambuf_iterator<char>(in)), {});
    const fs::path parts = dir_ / "docs_text";
    fs::create_directories(parts);
    std::string cmd = kBin + "/prepare_data --out " + (dir_ / "docs").string() +
                      " --val-fraction 0.1 --doc-separator 0";
    int n = 0;
    for (size_t at = 0; at < text.size();) {
      size_t end = text.find("\n\n", at);
      end = end == std::string::npos ? text.size() : end + 2;
      const fs::path part = parts / ("p" + std::to_string(1000 + n++) + ".txt");
      std::ofstream(part) << text.substr(at, end - at);
      cmd += " " + part.string();
      at = end;
    }
    ASSERT_GT(n, 50) << text_path;
    const Result r = run(cmd);
    ASSERT_EQ(r.status, 0) << r.output;
  }
  static std::string docs_cmd(const std::string& out_dir, const std::string& extra) {
    const std::string data = (dir_ / "docs").string();
    return kBin + "/train " + kSrc + "/configs/tiny.yaml --train.device=cpu" + " --data.train='" +
           data + "/train_*.bin' --data.val='" + data + "/val_*.bin'" +
           " --model.arch=llama --model.n_kv_head=2 --model.n_layer=2 --model.n_embd=64" +
           " --model.n_head=4 --model.seq_len=64 --train.batch_size=8 --train.eval_every=10" +
           " --train.eval_steps=2 --train.log_every=5 --optim.warmup_steps=5" +
           " --train.out_dir=" + out_dir + " " + extra;
  }
};

TEST_F(TrainDocuments, MaskedRunLearnsAndResumesBitForBit) {
  const std::string mask = "--data.document_mask=true --data.document_separator=0";
  check_resume_is_bit_identical(dir_, "_docs", mask, docs_cmd);
  const std::string full = (dir_ / "run_full_docs").string();
  const auto masked = read_losses(full);
  ASSERT_EQ(masked.size(), 20u);
  EXPECT_LT(masked.back().value, masked.front().value - 1.0) << "loss did not fall";
  std::ifstream log(full + "/config.yaml");
  const std::string config((std::istreambuf_iterator<char>(log)), {});
  EXPECT_NE(config.find("document_mask: true"), std::string::npos) << config;

  const std::string plain = (dir_ / "run_docs_unmasked").string();
  Result r = run(docs_cmd(plain, "--train.max_steps=20"));
  ASSERT_EQ(r.status, 0) << r.output;
  const auto unmasked = read_losses(plain);
  ASSERT_EQ(unmasked.size(), 20u);
  int differ = 0;
  for (size_t i = 0; i < 20; ++i) differ += masked[i].text != unmasked[i].text;
  EXPECT_GT(differ, 10) << "the mask changed no loss";

  // The eval tool reads the run's document mask from its config: its loss over the val glob's
  // first two batches is the run's last val_loss (the same batches, weights and mask).
  std::ifstream metrics(full + "/metrics.jsonl");
  std::string line, last_val;
  while (std::getline(metrics, line))
    if (const size_t at = line.find("\"val_loss\":"); at != std::string::npos)
      last_val = line.substr(at + 11);
  ASSERT_FALSE(last_val.empty());
  r = run(kBin + "/eval " + full + " --device cpu --batches 2");
  ASSERT_EQ(r.status, 0) << r.output;
  const size_t loss_at = r.output.rfind("\"loss\":");
  ASSERT_NE(loss_at, std::string::npos) << r.output;
  EXPECT_NEAR(std::atof(r.output.c_str() + loss_at + 7), std::atof(last_val.c_str()), 2e-6)
      << r.output;

  // Positions over the window (the mask alone). RoPE's scores depend only on the difference of
  // two positions, and with the mask both lie in one document: restarting the positions changes
  // the run by the rounding of the f32 angles only (docs/data.md#document-masking).
  const std::string window = (dir_ / "run_docs_window_positions").string();
  r = run(docs_cmd(window, mask + " --data.document_positions=false --train.max_steps=20"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("document masking: on (documents begin at token 0; RoPE positions run "
                          "over the window)"),
            std::string::npos)
      << r.output;
  const auto window_losses = read_losses(window);
  ASSERT_EQ(window_losses.size(), 20u);
  for (size_t i = 0; i < 20; ++i)
    EXPECT_NEAR(window_losses[i].value, masked[i].value, 1e-3 * masked[i].value)
        << "step " << masked[i].step;
}

std::string file_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

// FP8 on the CPU (the emulation of the recipe): 20 steps straight and 10 + resume + 10 give the
// same losses, and the same FP8 state (scales, amax histories) and parameters at step 20, bit
// for bit. A history of 4 rolls over several times before the checkpoint, and the qkv of both
// blocks (bf16_edges off) are FP8 too.
TEST_F(TrainE2E, Fp8ResumesBitForBitWithItsScalingState) {
  const std::string fp8 = "--precision.fp8=true --fp8.amax_history_len=4 --fp8.bf16_edges=false";
  check_resume_is_bit_identical(dir_, "_fp8", fp8, train_cmd);
  const fs::path full = dir_ / "run_full_fp8" / "checkpoints" / "step_00000020";
  const fs::path resumed = dir_ / "run_resumed_fp8" / "checkpoints" / "step_00000020";
  ASSERT_TRUE(fs::exists(full / "fp8_state.bin")) << full;
  int compared = 0;
  for (const auto& e : fs::directory_iterator(full)) {
    const std::string name = e.path().filename().string();
    if (name == "manifest.yaml") continue;  // it holds the run's own out_dir
    ASSERT_TRUE(fs::exists(resumed / name)) << name;
    EXPECT_EQ(file_bytes(e.path()), file_bytes(resumed / name)) << name << " differs";
    ++compared;
  }
  EXPECT_GE(compared, 2);  // the parameters and optimizer state, and fp8_state.bin
  const auto losses = read_losses((dir_ / "run_full_fp8").string());
  ASSERT_EQ(losses.size(), 20u);
  EXPECT_LT(losses.back().value, losses.front().value - 1.0) << "FP8 loss did not fall";
}

// A resume whose FP8 state does not fit the run (another amax history length, or other FP8
// linear layers) is refused, exit 2, naming the cause; the checkpoint stays as it was.
TEST_F(TrainE2E, Fp8ResumeWithAnotherHistoryOrOtherFp8LayersIsRefused) {
  const std::string out = (dir_ / "run_fp8_mismatch").string();
  // Three blocks, so that bf16_edges leaves one of them in FP8.
  const std::string fp8 = "--model.n_layer=3 --precision.fp8=true --fp8.amax_history_len=4";
  const Result first = run(train_cmd(
      out, fp8 + " --fp8.bf16_edges=false --train.max_steps=4 --train.checkpoint_every=4"));
  ASSERT_EQ(first.status, 0) << first.output;
  const std::string manifest = out + "/checkpoints/step_00000004/manifest.yaml";
  const std::string before = file_bytes(manifest);
  struct Case {
    const char* name;
    std::string flags;
  };
  for (const Case& c : {Case{"another history length",
                             "--model.n_layer=3 --precision.fp8=true "
                             "--fp8.amax_history_len=8 --fp8.bf16_edges=false"},
                        Case{"other FP8 layers", fp8 + " --fp8.bf16_edges=true"}}) {
    const Result r = run(train_cmd(out, c.flags + " --train.max_steps=8"));
    EXPECT_EQ(r.status, 2) << c.name << ":\n" << r.output;
    EXPECT_NE(r.output.find("manifest.yaml: its FP8 state"), std::string::npos) << c.name << ":\n"
                                                                                << r.output;
    EXPECT_NE(r.output.find("fp8.amax_history_len"), std::string::npos) << c.name << ":\n"
                                                                        << r.output;
    EXPECT_EQ(r.output.find("fatal"), std::string::npos) << c.name << ":\n" << r.output;
  }
  EXPECT_EQ(file_bytes(manifest), before);
  EXPECT_EQ(read_losses(out).size(), 4u);
}

// The FP8 state is visible: the run says the CPU emulates FP8 and how many layers are FP8, the
// step line shows the worst tensor's clip fraction and amax, and every metrics line carries the
// FP8 fields (a bf16 run none). A run whose amaxes turn NaN says so naming the first tensor.
TEST_F(TrainE2E, Fp8StateIsInTheLogAndANonFiniteAmaxIsNamed) {
  const std::string out = (dir_ / "run_fp8_log").string();
  Result r = run(train_cmd(out, "--precision.fp8=true --train.max_steps=4 --train.log_every=2"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("precision.fp8: the CPU emulates FP8"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("precision.fp8: 8 linear layers in FP8 (hybrid format"),
            std::string::npos)
      << r.output;
  EXPECT_TRUE(std::regex_search(
      r.output, std::regex(R"(\| fp8 clip [0-9.]+% h\.[01]\.[a-z.]+\.[xwg] amax )")))
      << r.output;
  const std::string metrics = file_bytes(out + "/metrics.jsonl");
  for (const char* key : {"\"mfu_fp8\":", "\"fp8_clipped\":", "\"fp8_worst\":\"h.",
                          "\"fp8_amax\":", "\"fp8_scale_amax\":", "\"fp8_non_finite\":0"}) {
    size_t count = 0;
    for (size_t at = metrics.find(key); at != std::string::npos; at = metrics.find(key, at + 1))
      ++count;
    EXPECT_EQ(count, 4u) << key << "\n" << metrics;
  }
  const std::string bf16 = (dir_ / "run_fp8_off").string();
  ASSERT_EQ(run(train_cmd(bf16, "--train.max_steps=2")).status, 0);
  EXPECT_EQ(file_bytes(bf16 + "/metrics.jsonl").find("fp8"), std::string::npos);

  r = run(train_cmd((dir_ / "run_fp8_nan").string(),
                    "--precision.fp8=true --train.max_steps=6 --optim.lr=1e30 --optim.grad_clip=0"
                    " --optim.warmup_steps=0"));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_TRUE(std::regex_search(
      r.output,
      std::regex(R"(fp8: [0-9]+ tensor\(s\) had a NaN or infinite amax, the first h\.[01]\.)")))
      << r.output;
}

// The metrics.jsonl lines' values of `key` (a JSON array), in step order.
std::vector<std::string> json_arrays(const std::string& out_dir, const std::string& key) {
  std::vector<std::string> out;
  std::ifstream in(out_dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    const auto at = line.find("\"" + key + "\":[");
    if (at == std::string::npos) continue;
    const auto begin = at + key.size() + 3;
    int depth = 0;
    auto end = begin;
    for (; end < line.size(); ++end) {
      depth += line[end] == '[' ? 1 : line[end] == ']' ? -1 : 0;
      if (depth == 0) break;
    }
    out.push_back(line.substr(begin, end - begin + 1));
  }
  return out;
}

// MoE (LLaMA's layers; 4 experts of 64, top-2, a shared expert, the aux and z losses; and
// sigmoid scores with DeepSeek-V3's balancing bias, which the checkpoint keeps, in every other
// block): they learn, log the routing telemetry, and resume bit for bit, routing included.
TEST_F(TrainE2E, MoeTrainsLogsRoutingAndResumesBitForBit) {
  const std::string base =
      "--model.arch=llama --model.n_kv_head=2 --moe.n_experts=4 "
      "--moe.top_k=2 --moe.expert_ffn_dim=64 ";
  const std::string aux = base + "--moe.n_shared_experts=1 --moe.z_loss_coef=0.001";
  const std::string bias = base +
                           "--moe.score=sigmoid --moe.balance=bias --moe.aux_loss_coef=0 "
                           "--moe.bias_update_rate=0.01 --moe.every=2";
  check_resume_is_bit_identical(dir_, "_moe", aux, train_cmd);
  check_resume_is_bit_identical(dir_, "_moe_bias", bias, train_cmd);
  for (const char* tag : {"_moe", "_moe_bias"}) {
    SCOPED_TRACE(tag);
    const std::string full = (dir_ / (std::string("run_full") + tag)).string();
    const auto m = read_losses(full);
    ASSERT_EQ(m.size(), 20u);
    EXPECT_LT(m.back().value, m.front().value - 1.0) << "loss did not fall";
    // Every step logs each MoE block's load; a step routes B*T*k = 8*64*2 tokens.
    const auto load = json_arrays(full, "moe_load");
    ASSERT_EQ(load.size(), 20u);
    const std::vector<std::string> blocks = json_arrays(full, "moe_blocks");
    EXPECT_EQ(blocks.front(), std::string(tag) == "_moe" ? "[0,1]" : "[1]");
    for (const char* key :
         {"moe_tokens_min", "moe_tokens_max", "moe_gini", "moe_aux", "moe_z", "moe_entropy"})
      EXPECT_EQ(json_arrays(full, key).size(), 20u) << key;
    int64_t routed = 0;
    std::string first = load.front();
    for (char& ch : first)
      if (ch == '[' || ch == ']' || ch == ',') ch = ' ';
    std::istringstream numbers(first);
    for (int64_t v; numbers >> v;) routed += v;
    EXPECT_EQ(routed, static_cast<int64_t>(blocks.front() == "[0,1]" ? 2 : 1) * 8 * 64 * 2);
    // The resumed run routes exactly as the uninterrupted one (the bias came back too).
    const auto resumed =
        json_arrays((dir_ / (std::string("run_resumed") + tag)).string(), "moe_load");
    ASSERT_EQ(resumed.size(), 10u);
    for (size_t i = 0; i < 10; ++i) EXPECT_EQ(resumed[i], load[10 + i]) << "step " << 11 + i;
  }
}

// The shipped configs/moe-tiny.yaml trains as it is (a few small steps here) and logs its
// routing on the step line.
TEST_F(TrainE2E, MoeTinyConfigTrains) {
  const std::string data = (dir_ / "data").string();
  const std::string out = (dir_ / "run_moe_tiny").string();
  const Result r = run(kBin + "/train " + kSrc + "/configs/moe-tiny.yaml --train.device=cpu" +
                       " --data.train='" + data + "/train_*.bin' --data.val='" + data +
                       "/val_*.bin' --train.batch_size=2 --train.max_steps=4 --train.log_every=2" +
                       " --train.eval_every=4 --train.eval_steps=1 --train.out_dir=" + out);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(read_losses(out).size(), 4u);
  EXPECT_NE(r.output.find("moe: 4 of 4 blocks route each token to 2 of 8 experts"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find(" | moe tok "), std::string::npos) << r.output;
}

// precision.fp8 with MoE blocks (the CPU emulates FP8): attention, the dense blocks' MLPs and
// the shared experts run in FP8, the routers and routed experts in bf16, as the run says; it
// learns, and resumes bit for bit with the FP8 state and the routing.
TEST_F(TrainE2E, MoeWithFp8TrainsAndSaysWhatStaysBf16) {
  const std::string moe =
      "--model.arch=llama --model.n_kv_head=2 --moe.n_experts=4 --moe.expert_ffn_dim=64 "
      "--moe.every=2 --moe.n_shared_experts=1 --precision.fp8=true";
  check_resume_is_bit_identical(dir_, "_moe_fp8", moe, train_cmd);
  const std::string full = (dir_ / "run_full_moe_fp8").string();
  const auto m = read_losses(full);
  ASSERT_EQ(m.size(), 20u);
  EXPECT_LT(m.back().value, m.front().value - 1.0) << "loss did not fall";
  const Result r =
      run(train_cmd((dir_ / "run_moe_fp8_log").string(), moe + " --train.max_steps=1"));
  ASSERT_EQ(r.status, 0) << r.output;
  // 2 blocks: attention (2) in both, the dense MLP (2) of block 0, the shared expert (2) of
  // block 1.
  EXPECT_NE(r.output.find("precision.fp8: 8 linear layers in FP8 (the MoE routers and routed "
                          "experts stay bf16)"),
            std::string::npos)
      << r.output;
}

// train.recompute: the same losses bit for bit (CPU), and the memory plan says what it saves.
TEST_F(TrainE2E, RecomputeGivesTheSameLossesBitForBit) {
  const std::string llama = "--model.arch=llama --model.n_kv_head=2 --train.max_steps=8 ";
  // A MoE (the bias, so that the routing's history matters) recomputes the same too.
  const std::string moe = llama + "--moe.n_experts=4 --moe.expert_ffn_dim=64 --moe.every=2 " +
                          "--moe.balance=bias --moe.aux_loss_coef=0 --moe.bias_update_rate=0.01 ";
  for (const auto& [tag, model] : {std::pair{"", llama}, std::pair{"_moe", moe}}) {
    const std::string none = (dir_ / ("run_recompute_none" + std::string(tag))).string();
    ASSERT_EQ(run(train_cmd(none, model)).status, 0);
    for (const char* mode : {"light", "selective", "full"}) {
      const std::string out = (dir_ / (std::string("run_recompute_") + mode + tag)).string();
      const Result r = run(train_cmd(out, model + "--train.recompute=" + mode));
      ASSERT_EQ(r.status, 0) << r.output;
      EXPECT_NE(r.output.find(std::string("train.recompute=") + mode + " saves"), std::string::npos)
          << r.output;
      const auto a = read_losses(none), b = read_losses(out);
      ASSERT_EQ(a.size(), 8u);
      ASSERT_EQ(b.size(), a.size());
      for (size_t i = 0; i < a.size(); ++i)
        EXPECT_EQ(b[i].text, a[i].text) << tag << " " << mode << " step " << i + 1;
    }
  }
}

// The step line ends with the run's progress and, once a step after the first has been timed,
// an ETA from the recent step time: plain fields, so the line stays parseable.
// data.prefetch on (a loader thread, batches copied from pinned memory without waiting) and off
// (no thread, the host waits for each copy) feed the same batches: the same losses bit for bit,
// with accumulation (a step's micro-batches are staged together). train.cuda_graphs on the CPU
// is accepted, says once that it does not apply, and changes nothing.
TEST_F(TrainE2E, PrefetchAndCudaGraphsKeyChangeNothingOnTheCpu) {
  const std::string base = "--train.max_steps=12 --train.grad_accum=2 ";
  const std::string on = (dir_ / "run_prefetch_on").string();
  ASSERT_EQ(run(train_cmd(on, base + "--data.prefetch=true")).status, 0);
  const std::string off = (dir_ / "run_prefetch_off").string();
  ASSERT_EQ(run(train_cmd(off, base + "--data.prefetch=false")).status, 0);
  const std::string graphs = (dir_ / "run_graphs_cpu").string();
  const Result r = run(train_cmd(graphs, base + "--train.cuda_graphs=true"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("train.cuda_graphs: does not apply here"), std::string::npos) << r.output;
  const auto a = read_losses(on), b = read_losses(off), c = read_losses(graphs);
  ASSERT_EQ(a.size(), 12u);
  ASSERT_EQ(b.size(), a.size());
  ASSERT_EQ(c.size(), a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].value, b[i].value) << "step " << a[i].step;
    EXPECT_EQ(a[i].value, c[i].value) << "step " << a[i].step;
  }
}

TEST_F(TrainE2E, StepLinesShowProgressAndEta) {
  const std::string out = (dir_ / "run_progress").string();
  const Result r =
      run(train_cmd(out, "--train.max_steps=4 --train.log_every=1 --train.eval_every=0"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("step     1/4 |"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("| 25.0%\n"), std::string::npos) << "no ETA before a timed step\n"
                                                           << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex(R"(\| 50\.0% ETA [0-9]+s\n)"))) << r.output;
  EXPECT_NE(r.output.find("| 100.0% ETA 0s"), std::string::npos) << r.output;
  // No peak is known on the CPU: no MFU figure that reads like a measurement.
  EXPECT_NE(r.output.find("| MFU   n/a |"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("MFU   0.0%"), std::string::npos) << r.output;
}

// With train.log_every > 1 a step line carries the highest loss and grad norm since the previous
// line, so a spike between lines shows; a line right after another (log_every 1) does not.
TEST_F(TrainE2E, StepLinesShowTheMaxLossAndNormSinceThePreviousLine) {
  const std::string out = (dir_ / "run_max_since").string();
  const Result r =
      run(train_cmd(out, "--train.max_steps=6 --train.log_every=3 --train.eval_every=0"));
  ASSERT_EQ(r.status, 0) << r.output;
  const std::vector<double> loss = kiln::testing::read_metric(out, "loss");
  const std::vector<double> norm = kiln::testing::read_metric(out, "grad_norm");
  ASSERT_EQ(loss.size(), 6u);
  for (int first : {0, 3}) {
    const double max_loss = *std::max_element(loss.begin() + first, loss.begin() + first + 3);
    const double max_norm = *std::max_element(norm.begin() + first, norm.begin() + first + 3);
    char want[96];
    std::snprintf(want, sizeof want, "| max of 3: loss %.4f norm %.3f |", max_loss, max_norm);
    EXPECT_NE(r.output.find(want), std::string::npos) << want << "\n" << r.output;
  }
  EXPECT_EQ(r.output.find("step     1/6"), std::string::npos) << r.output;
}

// Power is read from GPUs through NVML: on the CPU the power fields are absent (not zero) from
// metrics.jsonl, the step lines and summary.json, and the run says why, once.
// (On a GPU host: tests/gpu/power_test.cpp.)
TEST_F(TrainE2E, PowerFieldsAreAbsentOnTheCpuAndTheRunSaysWhyOnce) {
  const std::string out = (dir_ / "run_power").string();
  const Result r = run(train_cmd(out, "--train.max_steps=3 --train.log_every=1"));
  ASSERT_EQ(r.status, 0) << r.output;
  const auto first = r.output.find("power: not measured: the cpu backend has no power reading");
  ASSERT_NE(first, std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("power:", first + 1), std::string::npos) << r.output;
  for (const char* file : {"/metrics.jsonl", "/summary.json"}) {
    std::ifstream in(out + file);
    const std::string text((std::istreambuf_iterator<char>(in)), {});
    ASSERT_FALSE(text.empty()) << file;
    for (const char* key : {"power_w", "energy_kj", "j_per_token", "tokens_per_joule"})
      EXPECT_EQ(text.find(key), std::string::npos) << file << ": " << key;
  }
  EXPECT_EQ(r.output.find(" J/tok"), std::string::npos) << r.output;
}

TEST_F(TrainE2E, CorruptCheckpointIsRefusedAndNothingIsOverwritten) {
  const std::string out = (dir_ / "run_corrupt").string();
  ASSERT_EQ(run(train_cmd(out, "--train.max_steps=4")).status, 0);
  const std::string shard = out + "/checkpoints/step_00000004/rank_00000_000.bin";
  ASSERT_TRUE(fs::exists(shard));
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x7f');
  }
  const auto size_before = fs::file_size(out + "/metrics.jsonl");
  const Result r = run(train_cmd(out, "--train.max_steps=8"));
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("checksum"), std::string::npos) << r.output;
  EXPECT_EQ(fs::file_size(out + "/metrics.jsonl"), size_before);
}

// A train.max_steps below the step the run resumes at is refused before the run's files are
// touched: there is no negative number of steps to train.
TEST_F(TrainE2E, AMaxStepsBelowTheResumedStepIsRefused) {
  const std::string out = (dir_ / "run_below").string();
  ASSERT_EQ(run(train_cmd(out, "--train.max_steps=4")).status, 0);
  const std::string metrics = kiln::testing::read_file(out + "/metrics.jsonl");
  const Result r = run(train_cmd(out, "--train.max_steps=2"));
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("train.max_steps=2 is below step 4, where the run resumes"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(kiln::testing::read_file(out + "/metrics.jsonl"), metrics);
  EXPECT_EQ(run(train_cmd(out, "--train.max_steps=4")).status, 0);  // nothing left to train
}

// A resume that cannot write (a full disk, here a file-size limit of 0 with SIGXFSZ ignored, so
// every write fails as on a full disk) fails without replacing config.yaml or metrics.jsonl.
TEST_F(TrainE2E, AResumeThatCannotWriteLosesNothing) {
  const std::string out = (dir_ / "run_full_disk").string();
  const std::string args = "--train.max_steps=4 --train.checkpoint_every=2 --train.keep_checkpoints=2";
  ASSERT_EQ(run(train_cmd(out, args)).status, 0);
  fs::remove_all(out + "/checkpoints/step_00000004");  // resume at 2: lines 3 and 4 would go
  auto slurp = [](const std::string& path) {
    std::ifstream in(path);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const std::string metrics = slurp(out + "/metrics.jsonl"), config = slurp(out + "/config.yaml");
  ASSERT_FALSE(metrics.empty());
  // The same command: config.yaml is unchanged (so not rewritten), metrics.jsonl must be cut.
  const Result r = run("trap '' XFSZ; ulimit -f 0; " + train_cmd(out, args));
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_EQ(slurp(out + "/metrics.jsonl"), metrics) << r.output;
  EXPECT_EQ(slurp(out + "/config.yaml"), config) << r.output;
  EXPECT_FALSE(fs::exists(out + "/config.yaml.tmp"));
  EXPECT_FALSE(fs::exists(out + "/metrics.jsonl.tmp"));
  // With room again, the resume goes on from step 2 as if nothing had happened.
  ASSERT_EQ(run(train_cmd(out, args)).status, 0);
  EXPECT_EQ(read_losses(out).size(), 4u);
}

// Every file of `dir` and below with its bytes: what a refused command must leave as it was.
std::map<std::string, std::string> tree_of(const std::string& dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    files[e.path().string()] = e.is_regular_file() ? kiln::testing::read_file(e.path()) : "";
  return files;
}

// A resume refused by the checkpoint (a model of another width) writes nothing: config.yaml still
// says what the checkpoint was trained with, not what the refused command asked for.
TEST_F(TrainE2E, ARefusedResumeLeavesTheRunDirectoryAsItWas) {
  const std::string out = (dir_ / "run_refused").string();
  ASSERT_EQ(run(train_cmd(out, "--train.max_steps=2")).status, 0);
  const auto before = tree_of(out);
  const Result r = run(train_cmd(out, "--train.max_steps=4 --model.n_embd=128"));
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("checkpoint has"), std::string::npos) << r.output;
  EXPECT_TRUE(tree_of(out) == before) << "the run directory changed:\n" << r.output;
  EXPECT_NE(kiln::testing::read_file(out + "/config.yaml").find("n_embd: 64"), std::string::npos);
}

// A checkpoint's manifest or shard that is a FIFO or a directory is refused, naming it, by
// `train` resuming and by `eval` reading it: never a hang on a FIFO no one writes, nor a stream
// error that names no file. `timeout` turns a hang into a failure of this test.
TEST_F(TrainE2E, ACheckpointFileThatIsNotAFileIsRefusedNotAHang) {
  const std::string out = (dir_ / "run_not_a_file").string();
  ASSERT_EQ(run(train_cmd(out, "--train.max_steps=2")).status, 0);
  const std::string ckpt = out + "/checkpoints/step_00000002";
  for (const char* name : {"manifest.yaml", "rank_00000_000.bin"}) {
    const std::string path = ckpt + "/" + name;
    fs::rename(path, path + ".good");
    for (const bool fifo : {true, false}) {
      if (fifo) {
        ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
      } else {
        fs::create_directory(path);
      }
      for (const std::string& cmd :
           {train_cmd(out, "--train.max_steps=4"), kBin + "/eval " + ckpt + " --device cpu"}) {
        const Result r = run("timeout 30 " + cmd);
        const char* kind = fifo ? "a FIFO" : "a directory";
        EXPECT_EQ(r.status, 2) << name << " " << kind << ": " << cmd << "\n" << r.output;
        EXPECT_NE(r.output.find(path + ": not a regular file"), std::string::npos)
            << name << " " << kind << ": " << cmd << "\n"
            << r.output;
      }
      fs::remove(path);
    }
    fs::rename(path + ".good", path);
  }
  EXPECT_EQ(run(train_cmd(out, "--train.max_steps=4")).status, 0);
}

// The steps whose metrics.jsonl line carries a field `key`.
std::vector<int> steps_with(const std::string& out_dir, const std::string& key) {
  std::vector<int> steps;
  std::ifstream in(out_dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line))
    if (line.find("\"" + key + "\":") != std::string::npos)
      steps.push_back(std::atoi(line.c_str() + line.find("\"step\":") + 7));
  return steps;
}

// train.checkpoint_async: the same losses as synchronous checkpoints and the same bytes in
// every checkpoint, the stall in metrics.jsonl and the log; a crash of the writer mid-write
// (after its shard file, before its marker and the manifest) leaves the previous checkpoint the
// newest, and the run resumed from it follows the uninterrupted run bit for bit.
TEST_F(TrainE2E, AsyncCheckpointsMatchSynchronousOnesAndSurviveACrashMidWrite) {
  const std::string args =
      "--train.max_steps=8 --train.checkpoint_every=4 --train.keep_checkpoints=5";
  const std::string async = " --train.checkpoint_async=true";
  const std::string sync_run = (dir_ / "ckpt_sync").string();
  const std::string async_run = (dir_ / "ckpt_async").string();
  const std::string crashed = (dir_ / "ckpt_crashed").string();
  Result r = run(train_cmd(sync_run, args));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("checkpoint step 4: stall "), std::string::npos) << r.output;
  r = run(train_cmd(async_run, args + async));
  ASSERT_EQ(r.status, 0) << r.output;
  for (const char* line :
       {"checkpoint step 4: stall ", "checkpoint step 4: writer ", "checkpoint step 8: stall ",
        "checkpoint step 8: writer ", "checkpoint snapshot      1.4 MiB of host memory"})
    EXPECT_NE(r.output.find(line), std::string::npos) << line << "\n" << r.output;
  const auto expected = read_losses(sync_run);
  ASSERT_EQ(expected.size(), 8u);
  const auto same_losses = [&](const std::string& out) {
    const auto got = read_losses(out);
    ASSERT_EQ(got.size(), expected.size()) << out;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].step, expected[i].step) << out;
      EXPECT_EQ(got[i].text, expected[i].text) << out << " step " << got[i].step;
    }
  };
  same_losses(async_run);
  for (const char* step : {"step_00000004", "step_00000008"}) {
    const fs::path file = fs::path("checkpoints") / step / "rank_00000_000.bin";
    ASSERT_TRUE(fs::exists(fs::path(async_run) / file)) << file;
    EXPECT_EQ(file_bytes(fs::path(async_run) / file), file_bytes(fs::path(sync_run) / file))
        << file;
  }
  EXPECT_EQ(steps_with(sync_run, "checkpoint_stall_ms"), (std::vector<int>{4, 8}));
  EXPECT_EQ(steps_with(async_run, "checkpoint_stall_ms"), (std::vector<int>{4, 8}));

  r = run("KILN_TEST_CHECKPOINT_CRASH=8:0 " + train_cmd(crashed, args + async));
  EXPECT_EQ(r.status, 128 + SIGKILL) << r.output;
  EXPECT_EQ(kiln::find_latest_checkpoint(crashed), crashed + "/checkpoints/step_00000004");
  EXPECT_TRUE(fs::exists(crashed + "/checkpoints/step_00000008.tmp/rank_00000_000.bin"));
  EXPECT_FALSE(fs::exists(crashed + "/checkpoints/step_00000008.tmp/manifest.yaml"));
  r = run(train_cmd(crashed, args + async));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from " + crashed + "/checkpoints/step_00000004 at step 4"),
            std::string::npos)
      << r.output;
  same_losses(crashed);
}

// An asynchronous checkpoint that cannot be written (a file-size limit below its shard's size,
// with SIGXFSZ ignored, so the write fails as on a full disk) stops the run at its next
// checkpoint step (here its last) with one line naming the step, the rank and the cause, non-zero; the previous checkpoint stays
// the newest and the lines already in metrics.jsonl stay as they were. With room again, the run
// resumes from it.
TEST_F(TrainE2E, AnAsyncCheckpointThatCannotBeWrittenStopsTheRun) {
  const std::string out = (dir_ / "ckpt_async_full_disk").string();
  const std::string args = " --train.checkpoint_every=2 --train.checkpoint_async=true";
  ASSERT_EQ(run(train_cmd(out, "--train.max_steps=4" + args)).status, 0);
  const std::string before = file_bytes(out + "/metrics.jsonl");
  // Room for config.yaml and metrics.jsonl, not for a 1.4 MiB shard.
  Result r = run("trap '' XFSZ; ulimit -f 256; " + train_cmd(out, "--train.max_steps=8" + args));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("train: fatal: checkpoint step 6 failed on rank 0 "
                          "(train.checkpoint_async): cannot write " +
                          out + "/checkpoints/step_00000006.tmp/rank_00000_000.bin"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(kiln::find_latest_checkpoint(out), out + "/checkpoints/step_00000004");
  EXPECT_FALSE(fs::exists(out + "/checkpoints/step_00000006"));
  EXPECT_FALSE(fs::exists(out + "/checkpoints/step_00000006.tmp/rank_00000_000.bin"))
      << "the failed shard still takes room";
  EXPECT_EQ(file_bytes(out + "/metrics.jsonl").substr(0, before.size()), before);
  const auto m = read_losses(out);
  ASSERT_GE(m.size(), 6u);
  for (size_t i = 0; i < m.size(); ++i) EXPECT_EQ(m[i].step, static_cast<int>(i) + 1);
  r = run(train_cmd(out, "--train.max_steps=8" + args));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from " + out + "/checkpoints/step_00000004"), std::string::npos)
      << r.output;
  EXPECT_EQ(read_losses(out).size(), 8u);
}

TEST_F(TrainE2E, AFreshRunSetsTheEarlierRunAsideInsteadOfMixingWithIt) {
  const std::string out = (dir_ / "run_reused").string();
  ASSERT_EQ(run(train_cmd(out, "--train.max_steps=8 --train.checkpoint_every=4 --train.keep_checkpoints=5")).status, 0);
  // A model of another shape found by resume=auto: a clear error that says how to start afresh.
  Result r = run(train_cmd(out, "--train.max_steps=8 --model.n_embd=32"));
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--train.resume=none"), std::string::npos) << r.output;
  // Starting afresh keeps the earlier run's files, moved aside, and its checkpoints out of ours.
  r = run(train_cmd(out, "--train.max_steps=2 --train.resume=none --train.keep_checkpoints=1"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(fs::exists(out + "/checkpoints.prev/step_00000008/manifest.yaml"));
  EXPECT_TRUE(fs::exists(out + "/checkpoints.prev/step_00000004/manifest.yaml"));
  EXPECT_TRUE(fs::exists(out + "/checkpoints/step_00000002/manifest.yaml"));
  std::ifstream prev(out + "/metrics.jsonl.prev");
  EXPECT_EQ(std::count(std::istreambuf_iterator<char>(prev), {}, '\n'), 8);
  EXPECT_EQ(read_losses(out).size(), 2u);
}

// The loss is read one step late (no host sync inside a step), so a divergence is seen while
// the next step runs: the run must still stop at once, non-zero, before it checkpoints or
// logs anything from the diverged state.
TEST_F(TrainE2E, DivergenceStopsTheRunBeforeItCheckpointsTheBadState) {
  const std::string out = (dir_ / "run_diverges").string();
  // lr=1e30 overflows on step 2, which is seen while step 3 (a checkpoint step) runs.
  const Result r = run(train_cmd(out, "--train.max_steps=12 --train.checkpoint_every=3 "
                                      "--train.keep_checkpoints=10 --optim.lr=1e30 "
                                      "--optim.grad_clip=0 --optim.warmup_steps=0"));
  EXPECT_EQ(r.status, 1) << r.output;
  const auto pos = r.output.find(": loss is ");
  ASSERT_NE(pos, std::string::npos) << r.output;
  const int bad_step = std::atoi(r.output.c_str() + r.output.rfind("step ", pos) + 5);
  ASSERT_GT(bad_step, 0) << r.output;
  const auto m = read_losses(out);
  ASSERT_EQ(m.size(), static_cast<size_t>(bad_step - 1)) << r.output;
  for (const auto& s : m) EXPECT_TRUE(std::isfinite(s.value)) << "step " << s.step;
  if (fs::exists(out + "/checkpoints")) {
    for (const auto& e : fs::directory_iterator(out + "/checkpoints"))
      EXPECT_LT(std::atoi(e.path().filename().string().c_str() + 5), bad_step) << e.path();
  }
}

// Each bad input: exit status 2, and an error line that names the cause.
// The shipped CPU configs, trained on make demo's corpus (every licence text, scripts/demo.sh)
// through their warm-up and peak learning rate: no step's loss after the first few may reach
// chance (ln 256), nor jump by 1 over the best loss so far: what a too-short warm-up does to
// these configs (docs/quality.md).
class ShippedCpuConfig : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() {
    dir_ = kiln::testing::make_temp_dir("kiln_shipped_");
    std::set<std::string> texts;  // as demo.sh: the licences, links resolved, each once
    for (const auto& e : fs::directory_iterator("/usr/share/common-licenses"))
      if (fs::is_regular_file(e.path())) texts.insert(fs::canonical(e.path()).string());
    std::string cmd =
        kBin + "/prepare_data --out " + (dir_ / "data").string() + " --val-fraction 0.1";
    for (const std::string& t : texts) cmd += " '" + t + "'";
    if (texts.empty()) cmd += " " + kSrc + "/README.md";
    const Result r = run(cmd);
    ASSERT_EQ(r.status, 0) << r.output;
  }
  static fs::path dir_;
};
fs::path ShippedCpuConfig::dir_;

TEST_P(ShippedCpuConfig, TrainsWithoutSpikes) {
  const std::string out = (dir_ / GetParam()).string();
  // 100 of the config's 200 steps: the warm-up (60) and the peak lr, where a recipe that is too
  // hot spikes (docs/quality.md).
  const Result r = run(kBin + "/train " + kSrc + "/configs/" + GetParam() + ".yaml" +
                       " --train.device=cpu --train.resume=none --train.max_steps=100" +
                       " --train.save_checkpoints=false --data.val= --train.log_every=1000" +
                       " --data.train='" + (dir_ / "data").string() + "/train_*.bin'" +
                       " --train.out_dir=" + out);
  ASSERT_EQ(r.status, 0) << r.output;
  const auto losses = read_losses(out);
  ASSERT_EQ(losses.size(), 100u);
  double best = 1e30;
  for (const auto& l : losses) {
    if (l.step > 5) {
      EXPECT_LT(l.value, std::log(256.0)) << GetParam() << " step " << l.step << ": above chance";
      EXPECT_LT(l.value, best + 1.0) << GetParam() << " step " << l.step << ": a spike (best "
                                     << best << ")";
    }
    best = std::min(best, l.value);
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, ShippedCpuConfig,
                         ::testing::Values("tiny", "llama-tiny", "qwen3-tiny", "moe-tiny"),
                         [](const auto& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

struct BadInput {
  const char* name;
  std::string args;
  const char* expect;
};

class TrainBadInput : public TrainE2E {};

TEST_F(TrainBadInput, ExitsWithStatus2AndNamesTheCause) {
  const fs::path bad = dir_ / "bad";
  fs::create_directories(bad);
  const std::string good = (dir_ / "data" / "train_000000.bin").string();
  // Truncated llm.c shard: header intact, tokens cut short.
  fs::copy_file(good, bad / "truncated.bin", fs::copy_options::overwrite_existing);
  fs::resize_file(bad / "truncated.bin", fs::file_size(good) - 100);
  // Wrong magic: a consistent llm.c header whose magic is off by one.
  fs::copy_file(good, bad / "magic.bin", fs::copy_options::overwrite_existing);
  {
    std::fstream f(bad / "magic.bin", std::ios::in | std::ios::out | std::ios::binary);
    int32_t magic = 20240521;
    f.write(reinterpret_cast<char*>(&magic), 4);
  }
  const std::string out = (dir_ / "run_bad").string();
  const std::string cfg = kSrc + "/configs/tiny.yaml --train.device=cpu --train.out_dir=" + out;
  const std::vector<BadInput> cases = {
      {"truncated shard", "--data.train=" + (bad / "truncated.bin").string(), "truncated.bin"},
      {"wrong magic", "--data.train=" + (bad / "magic.bin").string(), "magic"},
      {"token id >= vocab", "--data.train=" + good + " --model.vocab_size=100", "vocab"},
      {"glob matches nothing", "--data.train='" + (bad / "nothing_*.bin").string() + "'",
       "data.train: no files match '"},
      {"val glob matches nothing",
       "--data.train=" + good + " --data.val='" + (bad / "nothing_*.bin").string() + "'",
       "data.val: no files match '"},
      {"unknown key", "--train.batchsize=4", "train.batchsize"},
      {"negative batch size", "--train.batch_size=-4", "train.batch_size"},
      {"non-numeric value", "--optim.lr=fast", "optim.lr"},
      {"fp8 format", "--precision.fp8=true --fp8.format=e5m2", "fp8.format"},
      {"fp8 history out of range", "--precision.fp8=true --fp8.amax_history_len=0",
       "fp8.amax_history_len"},
      {"layernorm with another eps", "--model.norm_eps=1e-6", "model.norm_eps"},
      {"kv heads that do not divide", "--model.n_kv_head=3", "model.n_kv_head"},
      {"document mask without a separator", "--data.document_mask=true",
       "data.document_separator: is required"},
      {"document positions on learned positions",
       "--data.document_mask=true --data.document_separator=0", "data.document_positions"},
      {"context parallelism on learned positions", "--dist.context_parallel=2",
       "dist.context_parallel: needs rotary positions"},
      {"context parallelism that does not cut the sequence evenly",
       "--model.arch=llama --model.seq_len=66 --dist.context_parallel=2",
       "model.seq_len must be a multiple of 4"},
      {"a tensor split the world does not divide", "--dist.tensor_parallel=2",
       "dist.tensor_parallel=2 must divide the world size (1 ranks)"},
      {"copy-engine gathers under ddp", "--dist.copy_engine_gathers=true",
       "dist.copy_engine_gathers: is set, but dist.strategy is ddp (it gathers nothing"},
      {"copy-engine gathers on the CPU", "--dist.strategy=fsdp --dist.copy_engine_gathers=true",
       "dist.copy_engine_gathers: true needs NCCL, a CUDA run; this one is on cpu"},
      {"a CUDA attention kernel on the CPU", "--precision.attention=flash",
       "precision.attention=flash picks a CUDA attention kernel; this run is on cpu"},
      {"a micro-batch of over 2^31 tokens", "--plan --train.batch_size=2000000000",
       "train.batch_size: x model.seq_len = "},
      {"blocks past kiln's range", "--plan --model.n_layer=2000000000", "model.n_layer"},
      {"a plan for more ranks than an int holds", "--plan --nproc-per-node=65536 --nnodes=65536",
       "--plan: --nproc-per-node 65536 x --nnodes 65536"},
  };
  for (const auto& c : cases) {
    const Result r = run(kBin + "/train " + cfg + " " + c.args);
    EXPECT_EQ(r.status, 2) << c.name << ":\n" << r.output;
    EXPECT_NE(r.output.find(c.expect), std::string::npos) << c.name << ":\n" << r.output;
    EXPECT_EQ(r.output.find("fatal"), std::string::npos) << c.name << ":\n" << r.output;
  }
  // Data that cannot be read leaves a fresh out_dir untouched: no config.yaml behind.
  const fs::path fresh = dir_ / "run_bad_fresh";
  const Result r = run(kBin + "/train " + kSrc + "/configs/tiny.yaml --train.device=cpu " +
                       "--train.out_dir=" + fresh.string() + " --data.train='" +
                       (bad / "nothing_*.bin").string() + "'");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_FALSE(fs::exists(fresh / "config.yaml")) << r.output;
}

// Bad input as a new user meets it from outside: whole command lines, the same contract.
TEST_F(TrainBadInput, CommandLinesFromOutsideExitWithStatus2) {
  const fs::path bad = dir_ / "bad_outside";
  fs::create_directories(bad);
  std::ofstream(bad / "a_file") << "not a directory\n";
  std::ofstream(bad / "empty.yaml") << "# nothing but a comment\n";
  std::ofstream(bad / "newline.yaml") << "model: {arch: \"gpt2\\nline2\"}\n";
  const std::string good = (dir_ / "data" / "train_000000.bin").string();
  const std::string train = kBin + "/train " + kSrc + "/configs/tiny.yaml --train.device=cpu" +
                            " --data.train=" + good + " --train.max_steps=2";
  const std::string sample = kBin + "/sample " + (dir_ / "run_bad").string();
  const std::vector<BadInput> cases = {
      {"out_dir under a regular file",
       train + " --train.out_dir=" + (bad / "a_file" / "run").string(), "train.out_dir"},
      {"empty config file",
       kBin + "/train " + (bad / "empty.yaml").string() + " --data.train=" + good,
       "empty.yaml: the config file is empty"},
      {"sample --top-k -1", sample + " --top-k -1", "--top-k must be >= 0"},
      {"sample --top-k=-1", sample + " --top-k=-1", "--top-k must be >= 0"},
      {"sample --temperature -1", sample + " --temperature -1", "--temperature must be"},
      {"sample --temperature nan", sample + " --temperature nan", "--temperature must be"},
      {"a device as the config (it never ends)", kBin + "/train /dev/zero",
       "/dev/zero: cannot read config file: is a device"},
      {"a newline inside a value stays on the error's one line",
       kBin + "/train " + (bad / "newline.yaml").string(), "'gpt2\\nline2'"},
      // Issue 52: a key that is accepted does what it says (docs/config.md).
      {"a checkpoint interval where no checkpoint is written",
       kBin + "/train " + kSrc + "/configs/quality/gpt2-bytes.yaml --train.device=cpu" +
           " --train.checkpoint_every=200",
       "override 'train.checkpoint_every=200': train.checkpoint_every: is set, but "
       "train.save_checkpoints is false"},
  };
  for (const auto& c : cases) {
    const Result r = run(c.args);
    EXPECT_EQ(r.status, 2) << c.name << ":\n" << r.output;
    EXPECT_NE(r.output.find(c.expect), std::string::npos) << c.name << ":\n" << r.output;
    EXPECT_EQ(r.output.find("fatal"), std::string::npos) << c.name << ":\n" << r.output;
    const std::string last = r.output.substr(r.output.rfind('\n', r.output.size() - 2) + 1);
    EXPECT_NE(last.find(c.expect), std::string::npos) << c.name << ": not on one line:\n"
                                                      << r.output;
  }
}

}  // namespace
