// Tests for train/run_dir: metrics.jsonl across a resume, with what supervised restarts add to
// it: restart lines survive the cut and are written once, a checkpoint step's line that a crash
// took after the save comes back, a line cut short goes, and summary.json lists the restarts.
#include "telemetry/run_dir.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "dist/launcher.h"
#include "tests/test_process.h"

namespace kiln {
namespace {

std::string step_line(int step) {
  return "{\"step\":" + std::to_string(step) + ",\"loss\":" + std::to_string(5.0 - 0.1 * step) +
         "}";
}

std::vector<std::string> lines_of(const std::string& path) {
  std::vector<std::string> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) out.push_back(line);
  return out;
}

// KILN_RESTARTS as the launcher sets it for a restarted generation, for this scope.
class ScopedRestarts {
 public:
  explicit ScopedRestarts(const std::vector<RestartRecord>& r) {
    ::setenv("KILN_RESTARTS", encode_restarts(r).c_str(), 1);
  }
  ~ScopedRestarts() { ::unsetenv("KILN_RESTARTS"); }
};

TEST(RunDir, RestartLinesSurviveTheResumeCutAndAreWrittenOnce) {
  const std::string dir = testing::make_temp_dir("kiln_run_dir_");
  const std::string path = dir + "/metrics.jsonl";
  const std::string first =
      "{\"event\":\"restart\",\"restart\":1,\"cause\":\"node 0: rank 1 (pid 7) was killed by "
      "signal 9 (Killed)\",\"resumed_from_step\":2}";
  std::ofstream(path) << step_line(1) << "\n"
                      << step_line(2) << "\n"
                      << first << "\n"
                      << step_line(3) << "\n"
                      << step_line(4) << "\n"
                      << step_line(5) << "\n"
                      << "{\"step\":6,\"lo";  // cut short by the crash
  ScopedRestarts env({{1, "node 0: rank 1 (pid 7) was killed by signal 9 (Killed)"},
                      {2, "node 1's launcher is gone (its connection to the store closed)"}});
  open_metrics(dir, 4);
  const std::string second =
      "{\"event\":\"restart\",\"restart\":2,\"cause\":\"node 1's launcher is gone (its "
      "connection to the store closed)\",\"resumed_from_step\":4}";
  const std::vector<std::string> want = {step_line(1), step_line(2), first,
                                         step_line(3), step_line(4), second};
  EXPECT_EQ(lines_of(path), want);
  open_metrics(dir, 4);  // the same generation's rank 0 again: nothing twice
  EXPECT_EQ(lines_of(path), want);
  EXPECT_EQ(testing::read_losses(dir).size(), 4u);  // readers of steps skip the events
  const std::vector<std::string> recorded = recorded_restarts(dir);
  ASSERT_EQ(recorded.size(), 2u);
  EXPECT_EQ(recorded[1], "{" + second.substr(std::string("{\"event\":\"restart\",").size()));
  write_summary(dir, RunSummary{});
  const std::string summary = testing::read_file(dir + "/summary.json");
  EXPECT_NE(summary.find(",\"restart_count\":2,\"restarts\":[{\"restart\":1,\"cause\":"),
            std::string::npos)
      << summary;
  EXPECT_NE(summary.find("\"resumed_from_step\":4}]}"), std::string::npos) << summary;
}

// A restarted generation that found no checkpoint starts the same run at step 0: its log is cut,
// not moved aside, and keeps its restart lines.
TEST(RunDir, ARestartWithoutACheckpointKeepsTheRunsLog) {
  const std::string dir = testing::make_temp_dir("kiln_run_dir_");
  const std::string path = dir + "/metrics.jsonl";
  std::ofstream(path) << step_line(1) << "\n";
  ScopedRestarts env({{1, "node 0: rank 0 (pid 9) exited with status 1"}});
  open_metrics(dir, std::nullopt);
  EXPECT_FALSE(std::filesystem::exists(path + ".prev"));
  EXPECT_EQ(lines_of(path), (std::vector<std::string>{
                                "{\"event\":\"restart\",\"restart\":1,\"cause\":\"node 0: rank 0 "
                                "(pid 9) exited with status 1\",\"resumed_from_step\":0}"}));
}

// A checkpoint is published before its step's line is written (the line holds the save's
// stall): a crash in between must not leave the resumed run's log without that step.
TEST(RunDir, AStepLineLostAfterItsCheckpointComesBack) {
  const std::string dir = testing::make_temp_dir("kiln_run_dir_");
  const std::string path = dir + "/metrics.jsonl";
  {
    MetricsLog log(path);
    for (int step = 1; step <= 3; ++step) {
      StepMetrics m;
      m.step = step;
      m.loss = 5.0 - 0.1 * step;
      log.write(m);
    }
    StepMetrics m;
    m.step = 4;
    m.loss = 4.6;
    log.write_pending(m);  // then the save, then the crash
  }
  ASSERT_TRUE(std::filesystem::exists(path + ".pending"));
  open_metrics(dir, 4);
  const auto losses = testing::read_losses(dir);
  ASSERT_EQ(losses.size(), 4u) << testing::read_file(path);
  EXPECT_EQ(losses[3].step, 4);
  EXPECT_EQ(losses[3].text, "4.600000");
  EXPECT_FALSE(std::filesystem::exists(path + ".pending"));
  // A pending line of a step the run did not resume at is not the run's: it goes.
  {
    MetricsLog log(path);
    StepMetrics m;
    m.step = 6;
    log.write_pending(m);
  }
  open_metrics(dir, 4);
  EXPECT_EQ(testing::read_losses(dir).size(), 4u);
  EXPECT_FALSE(std::filesystem::exists(path + ".pending"));
  // Written in full, the line makes the pending copy go.
  MetricsLog log(path);
  StepMetrics m;
  m.step = 5;
  log.write_pending(m);
  log.write(m);
  EXPECT_FALSE(std::filesystem::exists(path + ".pending"));
}

}  // namespace
}  // namespace kiln
