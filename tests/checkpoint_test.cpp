// Checkpoint publication (train/checkpoint.h) without collectives, two ranks played by two
// threads of this process: rank 0 publishes once every rank's marker is there and the result
// reads back; a rank that fails, or never finishes, leaves nothing published and the previous
// checkpoint the newest; what a crash left in a .tmp directory, stale markers too, is cleared
// before the next attempt at that step.
#include "train/checkpoint.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tests/test_process.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

// A 2-rank world over a layout of 2 tensors, 10 parameters; rank r owns [5r, 5r + 5).
struct TwoRanks {
  ParamLayout layout;
  std::vector<float> master, m, v;
  std::string out = kiln::testing::make_temp_dir("kiln_ckpt_");

  TwoRanks() {
    LayoutBuilder b;
    b.add("a", Shape{2, 3}, true);
    b.add("b", Shape{4}, false);
    b.close_unit();
    layout = b.finish();
    for (int i = 0; i < 10; ++i) {
      master.push_back(static_cast<float>(i));
      m.push_back(0.5f * static_cast<float>(i));
      v.push_back(0.25f * static_cast<float>(i));
    }
  }
  std::vector<OptimizerShard> shards(int rank) const {
    const int64_t b = 5 * rank;
    return {{b, b + 5, master.data() + b, m.data() + b, v.data() + b}};
  }
  CheckpointManifest manifest(int step, int world_size) const {
    TrainingState state;
    state.step = step;
    state.rng_state = "rng";
    return checkpoint_manifest(state, layout, "model: {}\n", "zero1", world_size);
  }
  std::string dir(int step) const {
    char name[32];
    std::snprintf(name, sizeof name, "/checkpoints/step_%08d", step);
    return out + name;
  }
};

TEST(Checkpoint, RankZeroPublishesOnceEveryRanksMarkerIsThere) {
  TwoRanks w;
  begin_checkpoint(w.out, 4);
  // Rank 1 finishes well after rank 0 starts waiting for it.
  std::thread rank1([&] {
    std::this_thread::sleep_for(200ms);
    write_rank_files(w.out, 4, 1, w.shards(1));
  });
  write_rank_files(w.out, 4, 0, w.shards(0));
  const std::string dir = publish_checkpoint(w.out, w.manifest(4, 2), 2, 30.0);
  rank1.join();
  EXPECT_EQ(dir, w.dir(4));
  EXPECT_EQ(find_latest_checkpoint(w.out), w.dir(4));
  EXPECT_FALSE(fs::exists(w.dir(4) + ".tmp"));
  // The published directory holds what its manifest names, and no markers.
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"manifest.yaml", "rank_00000_000.bin",
                                             "rank_00001_000.bin"}));
  const CheckpointManifest read = read_manifest(dir);
  ASSERT_EQ(read.files.size(), 2u);
  EXPECT_EQ(read.files[0].begin, 0);
  EXPECT_EQ(read.files[1].begin, 5);
  std::vector<float> master(10), m(10), v(10);
  load_optimizer_range(read, w.layout, 0, 10, master.data(), m.data(), v.data());
  EXPECT_EQ(master, w.master);
  EXPECT_EQ(m, w.m);
  EXPECT_EQ(v, w.v);
}

TEST(Checkpoint, ARankThatFailsOrNeverFinishesLeavesThePreviousCheckpointNewest) {
  TwoRanks w;
  begin_checkpoint(w.out, 2);
  write_rank_files(w.out, 2, 0, w.shards(0));
  write_rank_files(w.out, 2, 1, w.shards(1));
  publish_checkpoint(w.out, w.manifest(2, 2), 5, 30.0);

  // Rank 1 fails (here: it is abandoned before its first file): rank 0 stops waiting at once.
  begin_checkpoint(w.out, 4);
  write_rank_files(w.out, 4, 0, w.shards(0));
  EXPECT_THROW(write_rank_files(w.out, 4, 1, w.shards(1), [] { return true; }), std::runtime_error);
  const auto begin = std::chrono::steady_clock::now();
  try {
    publish_checkpoint(w.out, w.manifest(4, 2), 5, 30.0);
    FAIL() << "published without rank 1";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 could not write its part"), std::string::npos)
        << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - begin, 10s);
  EXPECT_EQ(find_latest_checkpoint(w.out), w.dir(2));

  // Rank 1 never writes: rank 0 gives up after the timeout.
  begin_checkpoint(w.out, 6);
  write_rank_files(w.out, 6, 0, w.shards(0));
  try {
    publish_checkpoint(w.out, w.manifest(6, 2), 5, 0.3);
    FAIL() << "published without rank 1";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 did not finish writing"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("dist.timeout_s (0.3 s)"), std::string::npos) << e.what();
  }
  EXPECT_EQ(find_latest_checkpoint(w.out), w.dir(2));
  EXPECT_FALSE(fs::exists(w.dir(6)));
  std::vector<float> master(10), m(10), v(10);
  load_optimizer_range(read_manifest(w.dir(2)), w.layout, 0, 10, master.data(), m.data(), v.data());
  EXPECT_EQ(master, w.master);
}

TEST(Checkpoint, ACrashedAttemptsFilesAndMarkersAreClearedFirst) {
  TwoRanks w;
  // A crash left both ranks' markers of an earlier attempt at step 4: rank 0 must not take them
  // for this attempt's.
  begin_checkpoint(w.out, 4);
  write_rank_files(w.out, 4, 0, w.shards(0));
  write_rank_files(w.out, 4, 1, w.shards(1));
  begin_checkpoint(w.out, 4);
  EXPECT_TRUE(fs::is_empty(w.dir(4) + ".tmp"));
  write_rank_files(w.out, 4, 0, w.shards(0));
  EXPECT_THROW(publish_checkpoint(w.out, w.manifest(4, 2), 5, 0.2), std::runtime_error);
  EXPECT_EQ(find_latest_checkpoint(w.out), std::nullopt);
}

}  // namespace
}  // namespace kiln
