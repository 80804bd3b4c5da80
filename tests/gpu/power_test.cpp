// Power and energy on a GPU host (telemetry/power.h, NVML opened at run time): a ~20 s training run
// logs power (W), energy so far (kJ) and J/token on its lines and in metrics.jsonl, all present
// and positive; energy only grows, and its rise over the run is the integral of the logged power
// over the steps' time; summary.json holds tokens per joule. Skips without a GPU; where NVML
// cannot be read the run must say so instead, and the test fails naming the reason.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <regex>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "tests/test_process.h"

namespace {

namespace fs = std::filesystem;

const std::string kBin = KILN_BIN_DIR;
const std::string kSrc = KILN_SOURCE_DIR;

// The number after "key": in a JSON line, or NaN when the key is absent.
double field(const std::string& line, const std::string& key) {
  const auto at = line.find("\"" + key + "\":");
  return at == std::string::npos ? NAN : std::atof(line.c_str() + at + key.size() + 3);
}

TEST(GpuPowerRun, PowerAndEnergyArePresentPositiveAndEnergyIsThePowersIntegral) {
  if (!kiln::cuda_available()) GTEST_SKIP() << "no CUDA GPU";
  const fs::path dir = kiln::testing::make_temp_dir("kiln_gpu_power_");
  const auto prepared = kiln::testing::prepare_corpus(kBin, kSrc, (dir / "data").string());
  ASSERT_EQ(prepared.status, 0) << prepared.output;
  const std::string out = (dir / "run").string();
  // A GPT-2-shaped model that keeps the GPU busy (~85M parameters, 16k tokens a step): about
  // 20 s of steady load, so NVML's averaged power has settled.
  const auto r = kiln::testing::run_command(
      kBin + "/train " + kSrc + "/configs/tiny.yaml --train.device=cuda --data.train='" +
      (dir / "data").string() + "/train_*.bin' --data.val= --model.n_layer=12" +
      " --model.n_embd=768 --model.n_head=12 --model.seq_len=1024 --train.batch_size=16" +
      " --train.max_steps=600 --train.eval_every=0 --train.log_every=100" +
      " --train.save_checkpoints=false --train.out_dir=" + out);
  ASSERT_EQ(r.status, 0) << r.output;
  ASSERT_NE(r.output.find("power: reading each rank's GPU through NVML"), std::string::npos)
      << "power not measured on this GPU host:\n" << r.output;
  EXPECT_NE(r.output.find(" J/tok"), std::string::npos) << r.output;

  std::ifstream in(out + "/metrics.jsonl");
  std::vector<double> watts, energy_j, ms;
  std::string line;
  while (std::getline(in, line)) {
    watts.push_back(field(line, "power_w"));
    energy_j.push_back(1000.0 * field(line, "energy_kj"));
    ms.push_back(field(line, "ms"));
    const double jpt = field(line, "j_per_token");
    const size_t step = watts.size();
    EXPECT_GT(watts.back(), 0.0) << "step " << step << ": " << line;
    // Step 1's interval is the setup before it: its energy may round to 0, not be absent.
    EXPECT_GE(energy_j.back(), 0.0) << "step " << step << ": " << line;
    if (step > 1) {
      // Each step (~22 ms here) is shorter than the sampler's 100 ms period: it still gets
      // energy (telemetry/power.h: PowerSampler::take).
      EXPECT_GT(energy_j.back(), energy_j[step - 2]) << "step " << step << ": " << line;
      EXPECT_GT(jpt, 0.0) << "step " << step << ": " << line;
    }
  }
  ASSERT_EQ(watts.size(), 600u);
  // Each step's interval is one step of steady work, so the power integrated over the steps'
  // times must account for the energy the GPU's counter saw (past the first 100 steps' warm-up).
  const size_t from = 100;
  double integral = 0, seconds = 0;
  for (size_t i = from + 1; i < watts.size(); ++i) {
    integral += watts[i] * ms[i] / 1000.0;
    seconds += ms[i] / 1000.0;
  }
  const double rise = energy_j.back() - energy_j[from];
  std::cout << "  " << seconds << " s of steps: energy rose " << rise << " J, power integral "
            << integral << " J (mean " << integral / seconds << " W)\n";
  EXPECT_NEAR(rise, integral, 0.15 * integral);

  std::ifstream summary_in(out + "/summary.json");
  const std::string summary((std::istreambuf_iterator<char>(summary_in)), {});
  const double tokens_per_joule = field(summary, "tokens_per_joule");
  ASSERT_GT(tokens_per_joule, 0.0) << summary;
  // The whole run's tokens over its whole energy (the last step's interval is added at the end).
  const double tokens = 600.0 * 16 * 1024;
  EXPECT_NEAR(tokens_per_joule, tokens / energy_j.back(), 0.1 * tokens / energy_j.back());
}

// bench's JSON carries J/token where the GPU's power is read, and --baseline flags a J/token
// worse than the tolerance (a planted baseline 10x as frugal).
TEST(GpuPowerRun, BenchReportsJoulesPerTokenAndFlagsARegression) {
  if (!kiln::cuda_available()) GTEST_SKIP() << "no CUDA GPU";
  const fs::path dir = kiln::testing::make_temp_dir("kiln_gpu_bench_power_");
  const std::string bench = "cd " + dir.string() + " && " + kBin + "/bench " + kSrc +
                            "/configs/tiny.yaml --train.device=cuda --model.n_layer=12" +
                            " --model.n_embd=768 --model.n_head=12 --model.seq_len=1024" +
                            " --train.batch_size=16 --data.train=nothing_*.bin --warmup 10" +
                            " --steps 100 ";
  auto r = kiln::testing::run_command(bench + "--json now.json");
  ASSERT_EQ(r.status, 0) << r.output;
  std::ifstream in(dir / "now.json");
  const std::string now((std::istreambuf_iterator<char>(in)), {});
  const double j_per_token = field(now, "j_per_token");
  ASSERT_GT(j_per_token, 0.0) << now;
  std::ofstream(dir / "frugal.json") << std::regex_replace(
      now, std::regex("\"j_per_token\":[0-9.e+-]+"),
      "\"j_per_token\":" + std::to_string(j_per_token / 10));
  r = kiln::testing::run_command(bench + "--baseline frugal.json --tolerance 30%");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex("j_per_token .* REGRESSION"))) << r.output;
}

}  // namespace
