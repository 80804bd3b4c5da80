// train.tensorboard: a CPU run's event file, read back by TensorBoard's own reader
// (tests/tensorboard_check.py, PyPI's tensorboard), holds every number of metrics.jsonl at its
// step and the resolved config as text; a run resumed from an earlier checkpoint leaves no step
// twice (its SessionLog START supersedes the first file's later steps); a fresh run in the same
// directory moves the earlier events aside; on a full disk the run ends naming the log it could
// not finish, and both logs hold whole records. The framing and CRCs: tests/tfrecord_test.cpp.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>

#include "tests/test_process.h"

namespace {

namespace fs = std::filesystem;

const std::string kBin = KILN_BIN_DIR;
const std::string kSrc = KILN_SOURCE_DIR;

int event_files(const fs::path& dir) {
  int n = 0;
  for (const auto& e : fs::directory_iterator(dir))
    n += e.path().filename().string().rfind("events.out.tfevents.", 0) == 0;
  return n;
}

TEST(TensorBoard, TensorBoardsReaderAgreesWithMetricsJsonl) {
  const fs::path dir = kiln::testing::make_temp_dir("kiln_tensorboard_");
  const auto prepared = kiln::testing::prepare_corpus(kBin, kSrc, (dir / "data").string());
  ASSERT_EQ(prepared.status, 0) << prepared.output;
  const fs::path run = dir / "run";
  const std::string train =
      kBin + "/train " + kSrc + "/configs/tiny.yaml --train.device=cpu --data.train='" +
      (dir / "data").string() + "/train_*.bin' --data.val='" + (dir / "data").string() +
      "/val_*.bin' --model.n_layer=1 --model.n_embd=32 --model.n_head=2 --model.seq_len=32" +
      " --train.batch_size=4 --train.max_steps=8 --train.eval_every=4 --train.eval_steps=1" +
      " --train.checkpoint_every=4 --train.tensorboard=true --train.out_dir=" + run.string();
  const std::string check = "python3 " + kSrc + "/tests/tensorboard_check.py " + run.string();
  auto r = kiln::testing::run_command(train);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("TensorBoard events: " + run.string() + "/events.out.tfevents."),
            std::string::npos)
      << r.output;
  r = kiln::testing::run_command(check);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("at 8 steps"), std::string::npos) << r.output;

  // Resumed from step 4: steps 5 to 8 again, in a second file.
  r = kiln::testing::run_command(train + " --train.resume=" + (run / "checkpoints").string() +
                                 "/step_00000004");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(event_files(run), 2);
  r = kiln::testing::run_command(check);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("at 8 steps"), std::string::npos) << r.output;

  // Afresh in the same directory (resume none): the earlier events go aside.
  r = kiln::testing::run_command(train + " --train.resume=none --train.max_steps=3");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(event_files(run), 1);
  EXPECT_EQ(event_files(run / "events.prev"), 2);
  r = kiln::testing::run_command(check);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("at 3 steps"), std::string::npos) << r.output;
}

// Off by default: a run without the key writes no event file; a value that is not a bool is
// refused naming the key.
TEST(TensorBoard, OffByDefaultAndABadValueIsRefused) {
  const fs::path dir = kiln::testing::make_temp_dir("kiln_tensorboard_off_");
  const auto prepared = kiln::testing::prepare_corpus(kBin, kSrc, (dir / "data").string());
  ASSERT_EQ(prepared.status, 0) << prepared.output;
  const auto r = kiln::testing::run_command(
      kBin + "/train " + kSrc + "/configs/tiny.yaml --train.device=cpu --data.train='" +
      (dir / "data").string() + "/train_*.bin' --model.n_layer=1 --model.n_embd=32" +
      " --model.n_head=2 --model.seq_len=32 --train.batch_size=4 --train.max_steps=2" +
      " --train.eval_every=0 --train.save_checkpoints=false --train.out_dir=" +
      (dir / "run").string());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(event_files(dir / "run"), 0);
  const auto bad = kiln::testing::run_command(kBin + "/train " + kSrc +
                                              "/configs/tiny.yaml --train.tensorboard=maybe");
  EXPECT_EQ(bad.status, 2) << bad.output;
  EXPECT_NE(bad.output.find("train.tensorboard"), std::string::npos) << bad.output;
}

// Whether `bytes` is a sequence of whole TFRecords (length, its CRC, data, its CRC) to its end.
bool whole_records(const std::string& bytes, int* records) {
  size_t at = 0;
  *records = 0;
  while (at < bytes.size()) {
    if (bytes.size() - at < 12) return false;
    uint64_t len = 0;
    std::memcpy(&len, bytes.data() + at, 8);
    if (bytes.size() - at - 12 < len + 4) return false;
    at += 12 + len + 4;
    ++*records;
  }
  return true;
}

// A full disk (a file-size limit the shell sets, SIGXFSZ ignored) that refuses metrics.jsonl's
// and the events' later records: the run trains on, then ends with status 2 naming metrics.jsonl
// and how many lines never reached it; both files hold whole records and nothing cut short.
TEST(TensorBoard, AFullDiskEndsTheRunNamingTheLogAndLeavesWholeRecords) {
  const fs::path dir = kiln::testing::make_temp_dir("kiln_tensorboard_full_");
  const auto prepared = kiln::testing::prepare_corpus(kBin, kSrc, (dir / "data").string());
  ASSERT_EQ(prepared.status, 0) << prepared.output;
  const fs::path run = dir / "run";
  const std::string limit = "trap '' XFSZ; ulimit -f 16; ";  // 8 KiB a file (512-byte blocks)
  const auto r = kiln::testing::run_command(
      limit + kBin + "/train " + kSrc + "/configs/tiny.yaml --train.device=cpu --data.train='" +
      (dir / "data").string() + "/train_*.bin' --model.n_layer=1 --model.n_embd=32" +
      " --model.n_head=2 --model.seq_len=32 --train.batch_size=4 --train.max_steps=120" +
      " --train.eval_every=0 --train.save_checkpoints=false --train.tensorboard=true" +
      " --train.out_dir=" + run.string());
  ASSERT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("records not written to " + (run / "metrics.jsonl").string()),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("are held in memory"), std::string::npos) << r.output;

  const std::string metrics = kiln::testing::read_file((run / "metrics.jsonl").string());
  ASSERT_FALSE(metrics.empty());
  EXPECT_LE(metrics.size(), 8192u);
  EXPECT_EQ(metrics.back(), '\n');
  const auto losses = kiln::testing::read_losses(run.string());
  ASSERT_GT(losses.size(), 10u);
  EXPECT_LT(losses.size(), 120u);
  for (size_t i = 0; i < losses.size(); ++i) EXPECT_EQ(losses[i].step, static_cast<int>(i) + 1);

  std::string events;
  for (const auto& e : fs::directory_iterator(run))
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0)
      events = kiln::testing::read_file(e.path().string());
  int records = 0;
  EXPECT_TRUE(whole_records(events, &records)) << events.size() << " bytes";
  EXPECT_GT(records, 0);
  EXPECT_LE(events.size(), 8192u);
}

}  // namespace
