// tools/plot.py on runs the tests make: two CPU runs share the axes of loss.png and
// throughput.png, both non-empty PNGs of the stated 1200 x 450 pixels; a directory that is not a
// run exits 2 naming it.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "tests/test_process.h"

namespace {

namespace fs = std::filesystem;

const std::string kBin = KILN_BIN_DIR;
const std::string kSrc = KILN_SOURCE_DIR;

// Width and height from a PNG's IHDR chunk (big-endian, bytes 16-23), or 0 x 0.
std::pair<uint32_t, uint32_t> png_size(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  unsigned char h[24] = {};
  if (!in.read(reinterpret_cast<char*>(h), sizeof h) || h[1] != 'P' || h[2] != 'N' || h[3] != 'G')
    return {0, 0};
  auto be = [&](int at) {
    return uint32_t{h[at]} << 24 | uint32_t{h[at + 1]} << 16 | uint32_t{h[at + 2]} << 8 |
           uint32_t{h[at + 3]};
  };
  return {be(16), be(20)};
}

TEST(Plot, TwoRunsShareTheAxesOfNonEmptyPngs) {
  const fs::path dir = kiln::testing::make_temp_dir("kiln_plot_");
  const auto prepared = kiln::testing::prepare_corpus(kBin, kSrc, (dir / "data").string());
  ASSERT_EQ(prepared.status, 0) << prepared.output;
  for (const char* arch : {"gpt2", "llama"}) {
    const auto r = kiln::testing::run_command(
        kBin + "/train " + kSrc + "/configs/tiny.yaml --train.device=cpu --model.arch=" + arch +
        " --data.train='" + (dir / "data").string() + "/train_*.bin' --data.val='" +
        (dir / "data").string() + "/val_*.bin' --model.n_layer=1 --model.n_embd=32" +
        " --model.n_head=2 --model.seq_len=32 --train.batch_size=4 --train.max_steps=12" +
        " --train.eval_every=4 --train.eval_steps=1 --train.save_checkpoints=false" +
        " --train.out_dir=" + (dir / arch).string());
    ASSERT_EQ(r.status, 0) << r.output;
  }
  const auto r = kiln::testing::run_command("python3 " + kSrc + "/tools/plot.py " +
                                            (dir / "gpt2").string() + " " +
                                            (dir / "llama").string() + " --out " +
                                            (dir / "plots").string());
  ASSERT_EQ(r.status, 0) << r.output;
  for (const char* png : {"loss.png", "throughput.png"}) {
    const fs::path p = dir / "plots" / png;
    ASSERT_TRUE(fs::exists(p)) << p;
    EXPECT_GT(fs::file_size(p), 10000u) << p;
    EXPECT_EQ(png_size(p), std::make_pair(1200u, 450u)) << p;
  }
  // CPU runs measure no power: no power plot.
  EXPECT_FALSE(fs::exists(dir / "plots" / "power.png"));
  const auto bad = kiln::testing::run_command("python3 " + kSrc + "/tools/plot.py " +
                                              (dir / "data").string() + " --out " +
                                              (dir / "plots").string());
  EXPECT_EQ(bad.status, 2) << bad.output;
  EXPECT_NE(bad.output.find("no metrics.jsonl"), std::string::npos) << bad.output;
}

// A run that measured power (as a GPU run's metrics.jsonl has it) gets power.png beside the
// others; a run without power beside it is simply not on that plot. The GPU run was restarted
// once: its restart line (no step) is not a step of any plot.
TEST(Plot, PowerIsPlottedWhereARunMeasuredIt) {
  const fs::path dir = kiln::testing::make_temp_dir("kiln_plot_power_");
  fs::create_directories(dir / "gpu");
  fs::create_directories(dir / "cpu");
  std::ofstream gpu(dir / "gpu" / "metrics.jsonl"), cpu(dir / "cpu" / "metrics.jsonl");
  for (int step = 1; step <= 20; ++step) {
    const std::string common = "{\"step\":" + std::to_string(step) + ",\"loss\":" +
                               std::to_string(5.0 - 0.1 * step) +
                               ",\"lr\":1e-4,\"grad_norm\":1,\"ms\":100,\"tok_s\":1e5,\"mfu\":0.4";
    gpu << common << ",\"power_w\":" << 600 + step << ",\"energy_kj\":" << 0.06 * step
        << (step > 1 ? ",\"j_per_token\":0.0006" : "") << "}\n";
    if (step == 10)
      gpu << "{\"event\":\"restart\",\"restart\":1,\"cause\":\"node 0: rank 1 (pid 7) was killed "
             "by signal 9 (Killed)\",\"resumed_from_step\":10}\n";
    cpu << common << "}\n";
  }
  gpu.close();
  cpu.close();
  const auto r = kiln::testing::run_command("python3 " + kSrc + "/tools/plot.py " +
                                            (dir / "gpu").string() + " " + (dir / "cpu").string() +
                                            " --out " + (dir / "plots").string());
  ASSERT_EQ(r.status, 0) << r.output;
  const fs::path p = dir / "plots" / "power.png";
  ASSERT_TRUE(fs::exists(p)) << r.output;
  EXPECT_GT(fs::file_size(p), 10000u) << p;
  EXPECT_EQ(png_size(p), std::make_pair(1200u, 450u)) << p;
}

// A MoE run's routing telemetry gets experts.png; the dense run beside it is simply not on it.
TEST(Plot, ExpertLoadIsPlottedForAMoeRun) {
  const fs::path dir = kiln::testing::make_temp_dir("kiln_plot_moe_");
  fs::create_directories(dir / "moe");
  fs::create_directories(dir / "dense");
  std::ofstream moe(dir / "moe" / "metrics.jsonl"), dense(dir / "dense" / "metrics.jsonl");
  for (int step = 1; step <= 20; ++step) {
    const std::string common = "{\"step\":" + std::to_string(step) +
                               ",\"loss\":" + std::to_string(5.0 - 0.1 * step) +
                               ",\"lr\":1e-4,\"grad_norm\":1,\"ms\":100,\"tok_s\":1e5,\"mfu\":0.4";
    const int skew = 40 - step;  // the load evens out
    moe << common << ",\"moe_blocks\":[0,1],\"moe_tokens_min\":[10,20],\"moe_tokens_mean\":[25,25]"
        << ",\"moe_tokens_max\":[" << skew << ",30],\"moe_gini\":[" << 0.01 * skew
        << ",0.1],\"moe_aux\":[1.1,1.0],\"moe_z\":[3,3],\"moe_entropy\":[1.3,1.3]"
        << ",\"moe_load\":[[" << skew << ",10,25," << 60 - skew << "],[20,30,25,25]]}\n";
    dense << common << "}\n";
  }
  moe.close();
  dense.close();
  const auto r = kiln::testing::run_command(
      "python3 " + kSrc + "/tools/plot.py " + (dir / "moe").string() + " " +
      (dir / "dense").string() + " --out " + (dir / "plots").string());
  ASSERT_EQ(r.status, 0) << r.output;
  const fs::path p = dir / "plots" / "experts.png";
  ASSERT_TRUE(fs::exists(p)) << r.output;
  EXPECT_GT(fs::file_size(p), 10000u) << p;
  EXPECT_EQ(png_size(p), std::make_pair(1200u, 450u)) << p;
}

}  // namespace
