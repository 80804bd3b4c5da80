// telemetry/prometheus.h and telemetry/metrics_channel.h: a report survives the channel's encoding and a
// real socket pair; the endpoint's text exposition holds the run-wide series from the lowest
// rank and the per-rank ones labelled; a port in use or out of range is refused naming
// train.metrics_port.
// The real Prometheus scraping a 2-rank run: tests/prometheus_scrape_test.cpp.
#include "telemetry/prometheus.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <string>

#include "base/error.h"
#include "tests/http_get.h"
#include "tests/test_process.h"

namespace kiln {
namespace {

TEST(MetricsChannel, ReportsSurviveEncodingAndTheSocketPair) {
  const RankReport r{3, {{"loss", 2.25}, {"lr", 6e-4}, {"moe_gini/h.1", 0.125}, {"step", 17}}};
  const auto back = decode_report(encode_report(r));
  ASSERT_TRUE(back);
  EXPECT_EQ(back->rank, 3);
  EXPECT_EQ(back->values, r.values);
  EXPECT_FALSE(decode_report("hello"));
  EXPECT_FALSE(decode_report("rank 1\nloss two\n"));

  const MetricsSocketPair p = make_metrics_socket_pair();
  EXPECT_TRUE(receive_reports(p.launcher_fd).empty());  // nothing yet, and no wait
  send_report(p.worker_fd, r);
  send_report(p.worker_fd, RankReport{4, {{"step", 18}}});
  const auto got = receive_reports(p.launcher_fd);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].values, r.values);
  EXPECT_EQ(got[1].rank, 4);
  ::close(p.launcher_fd);
  ::close(p.worker_fd);
}

TEST(MetricsExporter, ServesTheTextExpositionOfTheReports) {
  MetricsExporter exporter(0);
  ASSERT_GT(exporter.port(), 0);
  exporter.update({1, {{"step", 5}, {"loss", 3.5}, {"memory_bytes", 1000}, {"data_wait_s", 0.5}}});
  exporter.update({0,
                   {{"step", 5},
                    {"loss", 3.25},
                    {"lr", 0.001},
                    {"tok_s", 12345},
                    {"ms", 250},
                    {"energy_kj", 2},
                    {"moe_gini/h.3", 0.25},
                    {"memory_bytes", 2000},
                    {"not_a_series", 1}}});
  const auto text = testing::http_get(exporter.port(), "/metrics");
  ASSERT_TRUE(text);
  for (const char* line :
       {"kiln_up 1", "kiln_step 5", "kiln_loss 3.25", "kiln_learning_rate 0.001",
        "kiln_tokens_per_second 12345", "kiln_step_seconds 0.25", "kiln_energy_joules 2000",
        "kiln_moe_gini{block=\"3\"} 0.25", "kiln_memory_bytes{rank=\"0\"} 2000",
        "kiln_memory_bytes{rank=\"1\"} 1000", "kiln_data_wait_seconds{rank=\"1\"} 0.5",
        "# TYPE kiln_loss gauge"})
    EXPECT_NE(text->find(std::string(line) + "\n"), std::string::npos) << line << "\n" << *text;
  // Rank 1's loss came before rank 0 reported: rank 0's, the lowest, is the run's.
  EXPECT_EQ(text->find("kiln_loss 3.5"), std::string::npos) << *text;
  EXPECT_EQ(text->find("not_a_series"), std::string::npos) << *text;
  EXPECT_NE(text->find("kiln_last_step_timestamp_seconds "), std::string::npos) << *text;
  exporter.set_up(false);
  EXPECT_NE(testing::http_get(exporter.port(), "/metrics")->find("kiln_up 0\n"), std::string::npos);
  for (const std::string& name : exported_series()) EXPECT_EQ(name.rfind("kiln_", 0), 0u) << name;
}

TEST(MetricsExporter, APortInUseIsRefusedNamingTheKey) {
  MetricsExporter first(0);
  try {
    MetricsExporter second(first.port());
    FAIL() << "a second exporter on port " << first.port();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("train.metrics_port=" + std::to_string(first.port())),
              std::string::npos)
        << e.what();
  }
}

// train.metrics_address: the loopback interface only; the restart count; a name is refused.
TEST(MetricsExporter, ListensOnTheAddressItIsGiven) {
  MetricsExporter exporter(0, "127.0.0.1");
  ASSERT_GT(exporter.port(), 0);
  exporter.set_restarts(2);
  const auto text = testing::http_get(exporter.port(), "/metrics");
  ASSERT_TRUE(text);
  EXPECT_NE(text->find("\nkiln_restarts 2\n"), std::string::npos) << *text;
  EXPECT_FALSE(testing::http_get(exporter.port(), "/other"));  // one path is served
  const auto r = testing::run_command(std::string(KILN_BIN_DIR) + "/train " + KILN_SOURCE_DIR +
                                      "/configs/tiny.yaml --train.metrics_address=localhost");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("train.metrics_address"), std::string::npos) << r.output;
}

// train.metrics_port outside [0, 65535] exits 2 naming the key, before anything starts.
TEST(MetricsExporter, APortOutOfRangeIsRefusedByTheConfig) {
  const auto r = testing::run_command(std::string(KILN_BIN_DIR) + "/train " + KILN_SOURCE_DIR +
                                      "/configs/tiny.yaml --train.metrics_port=70000");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("train.metrics_port"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace kiln
