// train.metrics_port scraped by the real Prometheus (Debian's `prometheus`, installed by
// scripts/install_deps.sh): a 2-rank CPU run under kiln's launcher serves /metrics on
// 127.0.0.1; a Prometheus started here scrapes it every 500 ms, and its HTTP query API must
// return kiln_step past 1, kiln_tokens_per_second above 0, kiln_up 1 and both ranks'
// kiln_data_wait_seconds. Skipped, saying so, where no prometheus binary is installed.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "tests/http_get.h"
#include "tests/test_process.h"

namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

const std::string kBin = KILN_BIN_DIR;
const std::string kSrc = KILN_SOURCE_DIR;

// The samples of `query` in Prometheus at `port` now: (labels, value) pairs.
std::vector<std::pair<nlohmann::json, double>> query(int port, const std::string& q) {
  std::vector<std::pair<nlohmann::json, double>> out;
  const auto body = kiln::testing::http_get(port, "/api/v1/query?query=" + q);
  if (!body) return out;
  const auto j = nlohmann::json::parse(*body, nullptr, false);
  if (j.is_discarded() || j.value("status", "") != "success") return out;
  for (const auto& r : j["data"]["result"])
    out.emplace_back(r["metric"], std::stod(r["value"][1].get<std::string>()));
  return out;
}

TEST(PrometheusScrape, TheRealPrometheusScrapesATwoRankRun) {
  if (std::system("command -v prometheus >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "no prometheus binary: scripts/install_deps.sh installs Debian's prometheus";
  const fs::path dir = kiln::testing::make_temp_dir("kiln_prometheus_");
  const auto prepared = kiln::testing::prepare_corpus(kBin, kSrc, (dir / "data").string());
  ASSERT_EQ(prepared.status, 0) << prepared.output;
  const int metrics_port = kiln::testing::free_port();
  const int prometheus_port = kiln::testing::free_port();
  std::ofstream(dir / "prometheus.yml")
      << "global:\n  scrape_interval: 500ms\n  scrape_timeout: 500ms\n"
      << "scrape_configs:\n  - job_name: kiln\n    static_configs:\n"
      << "      - targets: ['127.0.0.1:" << metrics_port << "']\n";
  const auto train = kiln::testing::start_command(
      kBin + "/train " + kSrc + "/configs/tiny.yaml --nproc-per-node 2 --train.device=cpu" +
          " --data.train='" + (dir / "data").string() + "/train_*.bin' --model.n_layer=1" +
          " --model.n_embd=32 --model.n_head=2 --model.seq_len=32 --train.batch_size=4" +
          " --train.max_steps=100000 --train.eval_every=0 --train.save_checkpoints=false" +
          " --train.metrics_port=" + std::to_string(metrics_port) +
          " --train.out_dir=" + (dir / "run").string(),
      (dir / "train.log").string());
  const auto prometheus = kiln::testing::start_command(
      "prometheus --config.file=" + (dir / "prometheus.yml").string() +
          " --storage.tsdb.path=" + (dir / "tsdb").string() +
          " --web.listen-address=127.0.0.1:" + std::to_string(prometheus_port),
      (dir / "prometheus.log").string());

  double step = 0, tok_s = 0, up = 0;
  size_t ranks = 0;
  const auto deadline = std::chrono::steady_clock::now() + 90s;
  while (std::chrono::steady_clock::now() < deadline &&
         (step < 2 || tok_s <= 0 || up != 1 || ranks < 2)) {
    std::this_thread::sleep_for(500ms);
    for (const auto& [labels, v] : query(prometheus_port, "kiln_step")) step = v;
    for (const auto& [labels, v] : query(prometheus_port, "kiln_tokens_per_second")) tok_s = v;
    for (const auto& [labels, v] : query(prometheus_port, "kiln_up")) up = v;
    ranks = query(prometheus_port, "kiln_data_wait_seconds").size();
  }
  ::kill(-train.pid, SIGTERM);
  ::kill(-prometheus.pid, SIGTERM);
  kiln::testing::wait_command(train, 60s);
  kiln::testing::wait_command(prometheus, 30s);
  const std::string logs = "train:\n" + kiln::testing::read_file(train.log_path) +
                           "\nprometheus:\n" + kiln::testing::read_file(prometheus.log_path);
  EXPECT_GE(step, 2) << logs;
  EXPECT_GT(tok_s, 0) << logs;
  EXPECT_EQ(up, 1) << logs;
  EXPECT_EQ(ranks, 2u) << logs;
}

}  // namespace
