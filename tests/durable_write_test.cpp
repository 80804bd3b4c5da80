// AppendLog on a full disk, simulated by RLIMIT_FSIZE (a write past the limit fails with EFBIG
// once SIGXFSZ is ignored; no root or tmpfs needed): a record is in the file whole or not at all,
// refused records are held and written in order once the disk takes them, and finish() names
// the file while any are still held.
#include "base/durable_write.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <csignal>
#include <string>

#include "tests/input_error.h"
#include "tests/test_process.h"

namespace kiln {
namespace {

using testing::make_temp_dir;
using testing::read_file;

// Files written while one is alive may grow to `bytes` and no further.
struct FileSizeLimit {
  rlimit before{};
  explicit FileSizeLimit(rlim_t bytes) {
    std::signal(SIGXFSZ, SIG_IGN);
    ::getrlimit(RLIMIT_FSIZE, &before);
    set(bytes);
  }
  void set(rlim_t bytes) const {
    rlimit l = before;
    l.rlim_cur = bytes;
    EXPECT_EQ(::setrlimit(RLIMIT_FSIZE, &l), 0);
  }
  ~FileSizeLimit() { ::setrlimit(RLIMIT_FSIZE, &before); }
};

std::string record(int i) {
  return "{\"step\":" + std::to_string(i) + ",\"pad\":\"" + std::string(40, 'x') + "\"}\n";
}

TEST(AppendLog, ARefusedRecordIsCutBackHeldAndWrittenInOrderOnceTheDiskTakesIt) {
  const std::string path = make_temp_dir("append_log") + "/metrics.jsonl";
  const size_t n = record(0).size();
  std::string all;
  {
    AppendLog log(path, "metrics");
    FileSizeLimit limit(3 * n + n / 2);  // the fourth record would be cut in half
    for (int i = 0; i < 6; ++i) {
      log.append(record(i));
      all += record(i);
    }
    EXPECT_EQ(log.held(), 3u);
    EXPECT_EQ(read_file(path), record(0) + record(1) + record(2));  // whole records only
    limit.set(RLIM_INFINITY);
    log.append(record(6));
    all += record(6);
    EXPECT_EQ(log.held(), 0u);
    log.finish();
  }
  EXPECT_EQ(read_file(path), all);
}

TEST(AppendLog, FinishNamesTheFileWhileRecordsAreStillRefused) {
  const std::string path = make_temp_dir("append_log") + "/events.out.tfevents";
  const size_t n = record(0).size();
  FileSizeLimit limit(2 * n);
  AppendLog log(path, "train.tensorboard", true);
  for (int i = 0; i < 5; ++i) log.append(record(i));
  const std::string msg = testing::input_error([&] { log.finish(); });
  EXPECT_NE(msg.find("train.tensorboard: 3 records not written to " + path), std::string::npos)
      << msg;
  EXPECT_EQ(read_file(path), record(0) + record(1));
}

TEST(AppendLog, AppendsToWhatIsThereOrEmptiesItFirst) {
  const std::string path = make_temp_dir("append_log") + "/history.jsonl";
  {
    AppendLog log(path, "--history");
    log.append(record(0));
    log.finish();
  }
  {
    AppendLog log(path, "--history");
    log.append(record(1));
    log.finish();
  }
  EXPECT_EQ(read_file(path), record(0) + record(1));
  {
    AppendLog log(path, "--history", true);
    log.append(record(2));
    log.finish();
  }
  EXPECT_EQ(read_file(path), record(2));
  const std::string msg =
      testing::input_error([&] { AppendLog("/nonexistent-dir/x.jsonl", "--history"); });
  EXPECT_NE(msg.find("--history: cannot open /nonexistent-dir/x.jsonl for writing"),
            std::string::npos)
      << msg;
}

}  // namespace
}  // namespace kiln
