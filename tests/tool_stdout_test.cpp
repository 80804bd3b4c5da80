// stdout is data (base/log.h, issue 52): each tool run with stdout and stderr apart writes
// only its output to stdout (sample's text, eval's JSON, bench's table and JSON, comm_bench's
// table; prepare_data and convert nothing) and its log lines to stderr, so `tool > file` holds
// the output alone. train --print-config's stdout is the YAML, its warnings on stderr.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <yaml-cpp/yaml.h>

#include <cstdlib>
#include <regex>
#include <sstream>
#include <string>

#include "config/config.h"
#include "tests/test_process.h"

namespace kiln {
namespace {

const std::string kBin = KILN_BIN_DIR;
const std::string kSrc = KILN_SOURCE_DIR;

struct Split {
  int status;
  std::string out, err;
};

// `cmd` with its stdout and stderr in files of `dir`.
Split run_split(const std::string& cmd, const std::string& dir) {
  const std::string out = dir + "/stdout", err = dir + "/stderr";
  const int st = std::system((cmd + " >'" + out + "' 2>'" + err + "'").c_str());
  return {WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st), testing::read_file(out),
          testing::read_file(err)};
}

// kiln's log lines: "[12:34:56] info ..." (a worker's: "[12:34:56 rank 0] info ...").
const std::regex kLogLine(
    R"(\[\d\d:\d\d:\d\d( rank \d+)?\] (trace|debug|info|warning|error|critical) )");

bool has_log_line(const std::string& text) {
  return std::regex_search(text, kLogLine);
}

class ToolStdout : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = testing::make_temp_dir("kiln_tool_stdout_");
    // prepare_data: its summary is log lines; stdout stays empty.
    std::string corpus = "/usr/share/common-licenses/GPL-3";
    if (!std::filesystem::exists(corpus)) corpus = kSrc + "/README.md";
    const Split p = run_split(
        kBin + "/prepare_data --out " + dir_ + "/data --val-fraction 0.1 " + corpus, dir_);
    ASSERT_EQ(p.status, 0) << p.err;
    prepare_data_ = p;
    const auto r = testing::run_command(
        kBin + "/train " + kSrc + "/configs/tiny.yaml --train.device=cpu --train.max_steps=2" +
        " --train.batch_size=2 --train.eval_every=0 --data.train='" + dir_ +
        "/data/train_*.bin' --data.val='" + dir_ + "/data/val_*.bin' --train.out_dir=" + dir_ +
        "/run");
    ASSERT_EQ(r.status, 0) << r.output;
  }
  static std::string dir_;
  static Split prepare_data_;
};
std::string ToolStdout::dir_;
Split ToolStdout::prepare_data_;

TEST_F(ToolStdout, PrepareDataWritesNothingToStdout) {
  EXPECT_EQ(prepare_data_.out, "");
  EXPECT_TRUE(has_log_line(prepare_data_.err)) << prepare_data_.err;
}

// sample: the prompt and its continuation, nothing else.
TEST_F(ToolStdout, SampleStdoutIsTheTextAlone) {
  const Split s = run_split(
      kBin + "/sample " + dir_ + "/run --prompt 'The ' --tokens 8 --temperature 0 --device cpu",
      dir_);
  ASSERT_EQ(s.status, 0) << s.err;
  EXPECT_EQ(s.out.rfind("The ", 0), 0u) << s.out;
  EXPECT_EQ(s.out.back(), '\n') << s.out;
  EXPECT_FALSE(has_log_line(s.out)) << s.out;
}

// eval: one JSON object on stdout; its warning (fewer batches than asked) on stderr.
TEST_F(ToolStdout, EvalStdoutIsItsJson) {
  const Split e = run_split(kBin + "/eval " + dir_ + "/run --data '" + dir_ +
                                "/data/val_*.bin' --batches 100000 --batch-size 2 --seq-len 64",
                            dir_);
  ASSERT_EQ(e.status, 0) << e.err;
  const YAML::Node json = YAML::Load(e.out);  // JSON is YAML
  ASSERT_TRUE(json.IsMap()) << e.out;
  EXPECT_GT(json["loss"].as<double>(), 0.0) << e.out;
  EXPECT_EQ(e.out.find('\n'), e.out.size() - 1) << e.out;
  EXPECT_TRUE(has_log_line(e.err)) << e.err;
  EXPECT_NE(e.err.find("--batches 100000"), std::string::npos) << e.err;
}

TEST_F(ToolStdout, ConvertWritesNothingToStdout) {
  const Split c = run_split(kBin + "/convert " + dir_ + "/run --to hf " + dir_ + "/hf", dir_);
  ASSERT_EQ(c.status, 0) << c.err;
  EXPECT_EQ(c.out, "");
  EXPECT_TRUE(has_log_line(c.err)) << c.err;
}

// bench: its report and JSON line on stdout; the trainer's step lines, and the config's warning
// about the checkpoints bench turns off, on stderr.
TEST_F(ToolStdout, BenchStdoutIsItsReport) {
  const Split b = run_split("cd " + dir_ + " && " + kBin + "/bench " + kSrc +
                                "/configs/tiny.yaml --train.device=cpu" +
                                " --data.train=nothing_here_*.bin --warmup 1 --steps 2",
                            dir_);
  ASSERT_EQ(b.status, 0) << b.err;
  EXPECT_FALSE(has_log_line(b.out)) << b.out;
  std::istringstream lines(b.out);
  int json_lines = 0;
  for (std::string line; std::getline(lines, line);)
    if (line.rfind("{", 0) == 0) {
      EXPECT_TRUE(YAML::Load(line)["tok_s"].IsDefined()) << line;
      ++json_lines;
    }
  EXPECT_EQ(json_lines, 1) << b.out;
  EXPECT_NE(b.err.find("] info step"), std::string::npos) << b.err;
  EXPECT_NE(b.err.find("train.checkpoint_every: ignored"), std::string::npos) << b.err;
}

// comm_bench over two Gloo processes: rank 0's table on stdout, the launcher's lines on stderr.
TEST_F(ToolStdout, CommBenchStdoutIsItsTable) {
  const Split c = run_split(kBin + "/comm_bench --backend gloo --min-bytes 4K --max-bytes 8K" +
                                " --iters 1 --warmup 0 --nproc-per-node 2",
                            dir_);
  ASSERT_EQ(c.status, 0) << c.err;
  EXPECT_FALSE(has_log_line(c.out)) << c.out;
  EXPECT_EQ(c.out.rfind("# comm_bench: gloo", 0), 0u) << c.out;
  EXPECT_NE(c.out.find("  all_reduce "), std::string::npos) << c.out;
  EXPECT_TRUE(has_log_line(c.err)) << c.err;
}

// train --print-config: stdout reads back as the config; what it ignores is warned on stderr.
TEST_F(ToolStdout, TrainPrintConfigStdoutIsTheYaml) {
  const std::string config = kSrc + "/configs/tiny.yaml";
  const Split t =
      run_split(kBin + "/train " + config + " --train.save_checkpoints=false --print-config", dir_);
  ASSERT_EQ(t.status, 0) << t.err;
  EXPECT_EQ(parse_config(t.out, {}), load_config(config, {"train.save_checkpoints=false"}))
      << t.out;
  EXPECT_TRUE(has_log_line(t.err)) << t.err;
  EXPECT_NE(t.err.find("override 'train.save_checkpoints=false': train.checkpoint_every: "
                       "ignored"),
            std::string::npos)
      << t.err;
}

}  // namespace
}  // namespace kiln
