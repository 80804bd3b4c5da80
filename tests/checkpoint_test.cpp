// Checkpoint publication (state/checkpoint.h) without collectives, two ranks played by two
// threads of this process: rank 0 publishes once every rank's marker is there and the result
// reads back; a rank that fails, or never finishes, leaves nothing published and the previous
// checkpoint the newest; what a crash left in a .tmp directory, stale markers too, is cleared
// before the next attempt at that step.
#include "state/checkpoint.h"

#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "base/error.h"
#include "model/param_layout.h"
#include "tests/input_error.h"
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

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}
void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// One rank's checkpoint of `n` parameters (1 tensor) published at `step`; master[i] = i.
std::string one_rank_checkpoint(const std::string& out, int64_t n, int step) {
  LayoutBuilder b;
  b.add("w", Shape{n}, true);
  b.close_unit();
  const ParamLayout layout = b.finish();
  std::vector<float> master(static_cast<size_t>(n)), m(master.size()), v(master.size());
  for (int64_t i = 0; i < n; ++i) {
    master[static_cast<size_t>(i)] = static_cast<float>(i);
    m[static_cast<size_t>(i)] = 0.5f * static_cast<float>(i % 1000);
    v[static_cast<size_t>(i)] = 0.25f * static_cast<float>(i % 777);
  }
  begin_checkpoint(out, step);
  write_rank_files(out, step, 0, {{0, n, master.data(), m.data(), v.data()}});
  TrainingState state;
  state.step = step;
  return publish_checkpoint(out, checkpoint_manifest(state, layout, "model: {}\n", "ddp", 1), 1,
                            30.0);
}

// train.keep_checkpoints removes the oldest checkpoint after publishing the new one. Another
// process removing it at the same moment (an operator, a script freeing disk) made remove_all
// throw, and the published save was reported failed. Whatever the interleaving, the save
// succeeds and the old directory is gone.
TEST(Checkpoint, PruningToleratesTheOldCheckpointVanishingMeanwhile) {
  const std::string out = kiln::testing::make_temp_dir("kiln_ckpt_prune_");
  const std::string old_dir = one_rank_checkpoint(out, 10, 1);
  for (int i = 0; i < 3000; ++i) write_bytes(old_dir + "/extra_" + std::to_string(i), "x");
  std::thread remover([&] {
    std::error_code ec;
    fs::remove_all(old_dir, ec);
  });
  std::string published;
  EXPECT_NO_THROW(published = one_rank_checkpoint(out, 10, 2));
  remover.join();
  EXPECT_EQ(find_latest_checkpoint(out), published);
  EXPECT_FALSE(fs::exists(old_dir));
}

ParamLayout one_tensor(int64_t n) {
  LayoutBuilder b;
  b.add("w", Shape{n}, true);
  b.close_unit();
  return b.finish();
}

// Weights alone (m and v not wanted) from a file of several read blocks (2.5M parameters a
// array), in pieces that cross the blocks: the same values, and the whole file still verified:
// a byte flipped in v, which is not copied anywhere, is a checksum mismatch.
TEST(Checkpoint, WeightsAloneAreReadInBlocksAndTheWholeFileIsVerified) {
  const std::string out = kiln::testing::make_temp_dir("kiln_ckpt_blocks_");
  const int64_t n = 2'500'000;
  const std::string dir = one_rank_checkpoint(out, n, 3);
  const CheckpointManifest manifest = read_manifest(dir);
  const ParamLayout layout = one_tensor(n);
  std::vector<float> all(static_cast<size_t>(n));
  load_optimizer_range(manifest, layout, 0, n, all.data(), nullptr, nullptr);
  for (int64_t i = 0; i < n; i += 99'991) ASSERT_EQ(all[static_cast<size_t>(i)], float(i)) << i;
  ASSERT_EQ(all.back(), float(n - 1));
  const int64_t lo = 1'048'000, hi = 2'100'000;  // across the first and second blocks' ends
  std::vector<float> master(static_cast<size_t>(hi - lo)), m(master.size());
  load_optimizer_range(manifest, layout, lo, hi, master.data(), m.data(), nullptr);
  for (int64_t i = lo; i < hi; ++i) {
    ASSERT_EQ(master[static_cast<size_t>(i - lo)], float(i)) << i;
    ASSERT_EQ(m[static_cast<size_t>(i - lo)], 0.5f * float(i % 1000)) << i;
  }
  const std::string file = dir + "/" + manifest.files[0].file;
  std::string bytes = read_bytes(file);
  bytes[bytes.size() - 8 - 1000] ^= 0x10;  // in v
  write_bytes(file, bytes);
  try {
    load_optimizer_range(manifest, layout, 0, n, all.data(), nullptr, nullptr);
    FAIL() << "a corrupt v went unnoticed";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("checksum mismatch"), std::string::npos) << e.what();
  }
}

// A checkpoint of format version 1, whose shards carry byte-wise FNV-1a checksums (what kiln
// wrote before version 2), still loads, and its corruption is still caught.
TEST(Checkpoint, VersionOneChecksumsAreStillRead) {
  const std::string out = kiln::testing::make_temp_dir("kiln_ckpt_v1_");
  const int64_t n = 1000;
  const std::string dir = one_rank_checkpoint(out, n, 5);
  // Rewrite it as version 1 wrote it: the 32-byte header (without version 3's run, runs and
  // stride), and FNV-1a over the header and the arrays, in the file and in the manifest.
  YAML::Node manifest = YAML::LoadFile(dir + "/manifest.yaml");
  manifest["version"] = 1;
  for (YAML::Node f : manifest["files"]) {
    const std::string path = dir + "/" + f["file"].as<std::string>();
    std::string bytes = read_bytes(path);
    bytes.erase(32, 24);
    const uint32_t version = 1;
    std::memcpy(&bytes[8], &version, 4);
    const uint64_t sum = fnv1a_bytes(bytes.data(), bytes.size() - 8);
    std::memcpy(&bytes[bytes.size() - 8], &sum, 8);
    write_bytes(path, bytes);
    f["checksum"] = sum;
  }
  YAML::Emitter e;
  e << manifest;
  write_bytes(dir + "/manifest.yaml", e.c_str());
  const CheckpointManifest read = read_manifest(dir);
  EXPECT_EQ(read.version, 1u);
  std::vector<float> master(static_cast<size_t>(n)), m(master.size()), v(master.size());
  load_optimizer_range(read, one_tensor(n), 0, n, master.data(), m.data(), v.data());
  EXPECT_EQ(master[999], 999.0f);
  EXPECT_EQ(v[800], 0.25f * 23);
  const std::string file = dir + "/" + read.files[0].file;
  std::string bytes = read_bytes(file);
  bytes[100] ^= 1;
  write_bytes(file, bytes);
  EXPECT_THROW(load_optimizer_range(read, one_tensor(n), 0, n, master.data(), m.data(), v.data()),
               InputError);
}

// A manifest whose fields are out of kiln's range is refused naming the file and the field,
// never read into memory it overruns (a shape of 6 dimensions wrote past Shape's 4) or a vector
// the size it claims: each case edits a good manifest in one place.
TEST(Checkpoint, AManifestOutOfRangeIsRefusedNamingTheField) {
  const std::string out = kiln::testing::make_temp_dir("kiln_ckpt_range_");
  const std::string dir = one_rank_checkpoint(out, 100, 5);
  const YAML::Node good = YAML::LoadFile(dir + "/manifest.yaml");
  const auto refused = [&](const std::function<void(YAML::Node&)>& edit, const std::string& what) {
    YAML::Node bad = YAML::Clone(good);
    edit(bad);
    YAML::Emitter e;
    e << bad;
    write_bytes(dir + "/manifest.yaml", e.c_str());
    const std::string msg = kiln::testing::input_error([&] { read_manifest(dir); });
    EXPECT_NE(msg.find(what), std::string::npos) << msg;
  };
  refused(
      [](YAML::Node& m) { m["tensors"][0]["shape"] = std::vector<int64_t>{1, 1, 1, 1, 100, 7}; },
      "tensor w: a shape of at most 4 dimensions");
  refused(
      [](YAML::Node& m) {
        m["tensors"][0]["shape"] = std::vector<int64_t>{100, 0};
      },
      "tensor w: dimension 0");
  refused([](YAML::Node& m) { m["step"] = -5; }, "step -5 < 0");
  refused([](YAML::Node& m) { m["step"] = 7; }, "step 7 in a directory named step_00000005");
  refused([](YAML::Node& m) { m["world_size"] = 0; }, "world_size 0 < 1");
  refused([](YAML::Node& m) { m["strategy"] = "bogus"; }, "strategy 'bogus'");
  refused(
      [&](YAML::Node& m) {
        m["moe_bias"]["file"] = good["files"][0]["file"];
        m["moe_bias"]["floats"] = uint64_t{2000000000};
        m["moe_bias"]["checksum"] = 0;
      },
      "missing, truncated or too long (MoE bias of 2000000000 floats)");
}

// The manifest's file ranges are what the files hold: each agrees with its file's header, and
// together they tile the buffer, no gap, no overlap (read_manifest refuses them otherwise). A sum
// of the lengths let two wrong ranges pass: rank 1's file listed at [4, 9) covers 5 of [0, 10)
// as [5, 10) does, and loaded its weights one element early.
TEST(Checkpoint, ManifestRangesMustBeTheFilesOwnAndTileTheLoad) {
  TwoRanks w;
  begin_checkpoint(w.out, 3);
  write_rank_files(w.out, 3, 0, w.shards(0));
  write_rank_files(w.out, 3, 1, w.shards(1));
  const std::string dir = publish_checkpoint(w.out, w.manifest(3, 2), 5, 30.0);
  const YAML::Node good = YAML::LoadFile(dir + "/manifest.yaml");
  std::vector<float> master(10), m(10), v(10);
  const auto refused = [&](const std::function<void(YAML::Node&)>& edit, const std::string& what) {
    YAML::Node bad = YAML::Clone(good);
    edit(bad);
    YAML::Emitter e;
    e << bad;
    write_bytes(dir + "/manifest.yaml", e.c_str());
    const std::string msg = kiln::testing::input_error([&] {
      load_optimizer_range(read_manifest(dir), w.layout, 0, 10, master.data(), m.data(), v.data());
    });
    EXPECT_NE(msg.find(what), std::string::npos) << msg;
  };
  refused(
      [](YAML::Node& n) {
        n["files"][1]["begin"] = 4;
        n["files"][1]["end"] = 9;
      },
      "files rank_00000_000.bin [0, 5) and rank_00001_000.bin [4, 9) overlap");
  // Both entries name rank 0's file: each agrees with its header, and together they cover 10.
  refused([&](YAML::Node& n) { n["files"][1] = YAML::Clone(good["files"][0]); },
          "files rank_00000_000.bin [0, 5) and rank_00000_000.bin [0, 5) overlap");
  // The ranges swapped: they tile [0, 10), but neither is what its file holds.
  refused(
      [](YAML::Node& n) {
        n["files"][0]["begin"] = 5;
        n["files"][0]["end"] = 10;
        n["files"][1]["begin"] = 0;
        n["files"][1]["end"] = 5;
      },
      dir + "/rank_00001_000.bin: holds [5, 10) by its header; the manifest says [0, 5)");
  refused([](YAML::Node& n) { n["files"][1]["end"] = 11; },
          "file rank_00001_000.bin [5, 11) is out of the 10 parameters");
  refused([](YAML::Node& n) { n["files"][0]["end"] = 4; }, "no file holds parameters [4, 5)");
  refused([](YAML::Node& n) { n["files"].remove(1); }, "no file holds parameters [5, 10)");
  // The good manifest back: it loads.
  write_bytes(dir + "/manifest.yaml", YAML::Dump(good));
  load_optimizer_range(read_manifest(dir), w.layout, 0, 10, master.data(), m.data(), v.data());
  EXPECT_EQ(master, w.master);
}

// A shard file holds its header, three arrays and the checksum, and nothing after them.
TEST(Checkpoint, AShardWithTrailingBytesIsRefused) {
  const std::string out = kiln::testing::make_temp_dir("kiln_ckpt_trailing_");
  const std::string dir = one_rank_checkpoint(out, 100, 2);
  const CheckpointManifest manifest = read_manifest(dir);
  const std::string file = dir + "/" + manifest.files[0].file;
  write_bytes(file, read_bytes(file) + std::string(4, '\0'));
  std::vector<float> all(100);
  const std::string msg = kiln::testing::input_error(
      [&] { load_optimizer_range(manifest, one_tensor(100), 0, 100, all.data(), nullptr, nullptr); });
  EXPECT_NE(msg.find(file + ": 1268 bytes, but its 100 parameters take 1264"), std::string::npos)
      << msg;
}

// A second Ctrl-C mid-save leaves step_N.tmp behind, which no later save of another step would
// clear: the next save removes every step_*.tmp, and never a published checkpoint.
TEST(Checkpoint, TheNextSaveRemovesEveryLeftoverTmpDirectory) {
  const std::string out = kiln::testing::make_temp_dir("kiln_ckpt_leftover_");
  const std::string published = one_rank_checkpoint(out, 10, 2);
  for (const char* left : {"step_00000003.tmp", "step_00000009.tmp"}) {
    fs::create_directories(out + "/checkpoints/" + left);
    write_bytes(out + "/checkpoints/" + left + "/rank_00000_000.bin", "partial");
  }
  begin_checkpoint(out, 4);
  EXPECT_FALSE(fs::exists(out + "/checkpoints/step_00000003.tmp"));
  EXPECT_FALSE(fs::exists(out + "/checkpoints/step_00000009.tmp"));
  EXPECT_TRUE(fs::is_empty(out + "/checkpoints/step_00000004.tmp"));
  EXPECT_TRUE(fs::exists(published + "/manifest.yaml"));
}

}  // namespace
}  // namespace kiln
