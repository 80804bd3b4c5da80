// Checkpoint files that hold strided pieces (state/checkpoint.h): tensor-parallel ranks write one
// file per piece of their owned ranges, a row-parallel weight's rows being the runs of one file,
// and the checkpoint stays in the global layout. Written by 2 tensor ranks (each cut in two owned
// ranges, as fsdp cuts them), it loads exactly under 1, 2 and 4 tensor ranks and other cuts,
// each file read once; a manifest whose strided files overlap, leave a gap or run past their
// tensor is refused in one line naming the file; a checkpoint of format version 2 (every file a
// range, the header without runs) still loads.
#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "base/error.h"
#include "model/param_layout.h"
#include "model/shard_layout.h"
#include "state/checkpoint.h"
#include "tests/input_error.h"
#include "tests/test_process.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;

// A block's worth of every kind of tensor: a vocabulary table split by rows, replicated norms and
// biases, and two row-parallel weights (split along dim 1: a run a row on each tensor rank).
ParamLayout global_layout() {
  LayoutBuilder b;
  b.add("wte", {16, 8}, true, 0, {0, {}});
  b.close_unit();
  b.add("ln", {8}, false);
  b.add("proj", {8, 12}, true, 0, {1, {}});
  b.add("proj_bias", {8}, false);
  b.add("down", {8, 24}, true, 0, {1, {}});
  b.close_unit();
  return b.finish();
}

struct GlobalState {
  std::vector<float> master, m, v;
  explicit GlobalState(int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      master.push_back(static_cast<float>(i));
      m.push_back(0.5f * static_cast<float>(i));
      v.push_back(-0.25f * static_cast<float>(i));
    }
  }
};

// The local buffer [lo, hi) of `ranges` equal cuts (the last shorter), as a strategy's owned
// ranges would be.
std::pair<int64_t, int64_t> cut(int64_t total, int ranges, int d) {
  const int64_t chunk = (total + ranges - 1) / ranges;
  return {std::min(total, d * chunk), std::min(total, (d + 1) * chunk)};
}

struct Written {
  std::string dir;
  size_t pieces = 0;  // the shards the ranks handed over
};

// The checkpoint of step `step` written by tensor_ranks x cuts ranks: rank (t, d) owns cut d of
// tensor rank t's local buffer and writes its pieces there that it alone holds (a replicated
// tensor: tensor rank 0's), as RankLayout::writes decides.
Written write_checkpoint(const std::string& out, const ParamLayout& global, const GlobalState& g,
                         int tensor_ranks, int cuts, int step) {
  Written w;
  begin_checkpoint(out, step);
  for (int t = 0; t < tensor_ranks; ++t) {
    const ShardCoords c{tensor_ranks, t, 1, 0};
    const ParamLayout local = shard_layout(global, c);
    const std::vector<float> master = to_local(global, local, c, g.master),
                             m = to_local(global, local, c, g.m),
                             v = to_local(global, local, c, g.v);
    for (int d = 0; d < cuts; ++d) {
      const auto [lo, hi] = cut(local.total, cuts, d);
      std::vector<OptimizerShard> shards;
      for (const LayoutPiece& p : local_to_global(global, local, c, lo, hi)) {
        if (!p.split && t != 0) continue;
        shards.push_back({p.global, p.global + (p.runs - 1) * p.stride + p.run,
                          master.data() + p.local, m.data() + p.local, v.data() + p.local, p.run,
                          p.runs, p.stride});
      }
      w.pieces += shards.size();
      write_rank_files(out, step, t * cuts + d, shards);
    }
  }
  TrainingState state;
  state.step = step;
  state.rng_state = "rng";
  w.dir = publish_checkpoint(
      out, checkpoint_manifest(state, global, "model: {}\n", "fsdp", tensor_ranks * cuts), 5, 30.0);
  return w;
}

TEST(CheckpointPieces, ATensorParallelCheckpointWritesAFilePerPieceAndLoadsUnderAnyLayout) {
  const ParamLayout global = global_layout();
  const GlobalState g(global.total);
  const std::string out = kiln::testing::make_temp_dir("kiln_ckpt_pieces_");
  const Written w = write_checkpoint(out, global, g, 2, 2, 6);
  const CheckpointManifest manifest = read_manifest(w.dir);
  EXPECT_EQ(manifest.version, 3u);

  // One file per piece, never one per run: at most 2 a tensor a rank (a cut may end mid-row),
  // where a file a run took one per row of proj and down on each tensor rank.
  EXPECT_EQ(manifest.files.size(), w.pieces);
  EXPECT_LE(manifest.files.size(), 2 * global.tensors.size() * 4);
  int64_t runs = 0, strided = 0;
  for (const CheckpointFile& f : manifest.files) {
    runs += f.runs;
    strided += f.runs > 1;
  }
  EXPECT_GE(strided, 4);  // proj and down, each on 2 tensor ranks
  EXPECT_GT(runs, 2 * static_cast<int64_t>(manifest.files.size()));
  size_t on_disk = 0;
  for (const auto& e : fs::directory_iterator(w.dir)) on_disk += e.path().extension() == ".bin";
  EXPECT_EQ(on_disk, manifest.files.size());
  // The manifest names run, runs and stride for a strided file alone.
  const YAML::Node yaml = YAML::LoadFile(w.dir + "/manifest.yaml");
  for (const YAML::Node& f : yaml["files"])
    EXPECT_TRUE(!f["runs"] || f["runs"].as<int64_t>() > 1) << f;

  // One rank's whole buffer, as a tensor-parallel size of 1 reads it.
  std::vector<float> master(static_cast<size_t>(global.total)), m(master.size()), v(master.size());
  load_optimizer_range(manifest, global, 0, global.total, master.data(), m.data(), v.data());
  EXPECT_EQ(master, g.master);
  EXPECT_EQ(m, g.m);
  EXPECT_EQ(v, g.v);

  // Every rank of 1, 2 and 4 tensor ranks, cut in 1 or 3 owned ranges, loads its pieces of the
  // global state: exactly the global tensors' parts its local buffer holds. Weights alone too.
  for (const int T : {1, 2, 4})
    for (const int cuts : {1, 3})
      for (int t = 0; t < T; ++t) {
        const ShardCoords c{T, t, 1, 0};
        const ParamLayout local = shard_layout(global, c);
        const std::vector<float> want = to_local(global, local, c, g.master),
                                 want_v = to_local(global, local, c, g.v);
        for (int d = 0; d < cuts; ++d) {
          const auto [lo, hi] = cut(local.total, cuts, d);
          const size_t n = static_cast<size_t>(hi - lo);
          std::vector<float> got(n), got_v(n), alone(n);
          std::vector<StateDestination> with_moments, weights_alone;
          for (const LayoutPiece& p : local_to_global(global, local, c, lo, hi)) {
            with_moments.push_back(
                {p, got.data() + (p.local - lo), nullptr, got_v.data() + (p.local - lo)});
            weights_alone.push_back({p, alone.data() + (p.local - lo), nullptr, nullptr});
          }
          load_optimizer_pieces(manifest, global, with_moments);
          load_optimizer_pieces(manifest, global, weights_alone);
          const std::string where = "tensor rank " + std::to_string(t) + " of " +
                                    std::to_string(T) + ", cut " + std::to_string(d) + " of " +
                                    std::to_string(cuts);
          EXPECT_TRUE(std::equal(got.begin(), got.end(), want.begin() + lo)) << where;
          EXPECT_TRUE(std::equal(got_v.begin(), got_v.end(), want_v.begin() + lo)) << where;
          EXPECT_EQ(alone, got) << where;
        }
      }
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// Each case edits one entry of a good tensor-parallel manifest: the load is refused with one line
// naming manifest.yaml and the file.
TEST(CheckpointPieces, AMalformedStridedManifestIsRefusedNamingTheFile) {
  const ParamLayout global = global_layout();
  const GlobalState g(global.total);
  const std::string out = kiln::testing::make_temp_dir("kiln_ckpt_pieces_bad_");
  const std::string dir = write_checkpoint(out, global, g, 2, 1, 3).dir;
  const YAML::Node good = YAML::LoadFile(dir + "/manifest.yaml");
  // proj [8, 12] on tensor rank 0 and 1: 8 runs of 6 every 12, the second 6 further on.
  const int64_t proj = global.find("proj").offset;
  int rank0 = -1, rank1 = -1;
  for (size_t i = 0; i < good["files"].size(); ++i) {
    if (good["files"][i]["begin"].as<int64_t>() == proj) rank0 = static_cast<int>(i);
    if (good["files"][i]["begin"].as<int64_t>() == proj + 6) rank1 = static_cast<int>(i);
  }
  ASSERT_GE(rank0, 0);
  ASSERT_GE(rank1, 0);
  ASSERT_EQ(good["files"][rank0]["runs"].as<int64_t>(), 8);
  ASSERT_EQ(good["files"][rank0]["stride"].as<int64_t>(), 12);
  const std::string name0 = good["files"][rank0]["file"].as<std::string>(),
                    name1 = good["files"][rank1]["file"].as<std::string>();
  const auto refused = [&](const std::function<void(YAML::Node&)>& edit, const std::string& what) {
    YAML::Node bad = YAML::Clone(good);
    edit(bad);
    YAML::Emitter e;
    e << bad;
    write_bytes(dir + "/manifest.yaml", e.c_str());
    const std::string msg = kiln::testing::input_error([&] { read_manifest(dir); });
    EXPECT_NE(msg.find(dir + "/manifest.yaml: "), std::string::npos) << msg;
    EXPECT_NE(msg.find(what), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  };
  const int64_t end0 = good["files"][rank0]["end"].as<int64_t>();
  // Runs of 7: each overlaps tensor rank 1's run of the same row.
  refused(
      [&](YAML::Node& n) {
        n["files"][rank0]["run"] = 7;
        n["files"][rank0]["end"] = end0 + 1;
      },
      "files " + name0 + " [" + std::to_string(proj) + ", " + std::to_string(end0 + 1) +
          ") in 8 runs of 7 every 12 and " + name1);
  refused([&](YAML::Node& n) { n["files"].remove(rank1); }, "no file holds parameters [" +
                                                                std::to_string(proj + 6) + ", " +
                                                                std::to_string(proj + 12) + ")");
  // A ninth row: past proj, into proj_bias and down.
  refused(
      [&](YAML::Node& n) {
        n["files"][rank0]["runs"] = 9;
        n["files"][rank0]["end"] = end0 + 12;
      },
      "file " + name0 + " [" + std::to_string(proj) + ", " + std::to_string(end0 + 12) +
          ") in 9 runs of 6 every 12 leaves tensor proj[8,12]");
  refused([&](YAML::Node& n) { n["files"][rank0]["runs"] = 9; },
          name0 + " [" + std::to_string(proj) + ", " + std::to_string(end0) +
              ") in 9 runs of 6 every 12: its last run does not end at its end");
  refused([&](YAML::Node& n) { n["files"][rank0]["stride"] = 5; },
          name0 + " [" + std::to_string(proj) + ", " + std::to_string(end0) +
              ") in 8 runs of 6 every 5: runs must be at least 1 element, and their stride at "
              "least a run");
  refused([&](YAML::Node& n) { n["version"] = 2; },
          "file " + name0 + " is strided (runs), which version 2 does not hold");
  // The good manifest back: it loads.
  write_bytes(dir + "/manifest.yaml", YAML::Dump(good));
  std::vector<float> master(static_cast<size_t>(global.total));
  load_optimizer_range(read_manifest(dir), global, 0, global.total, master.data(), nullptr,
                       nullptr);
  EXPECT_EQ(master, g.master);
}

// The manifest's entries swapped between tensor rank 0's and 1's files of proj: they still
// tile, but neither is what its file's header says it holds, and the load is refused naming it.
TEST(CheckpointPieces, AStridedFileMustHoldWhatTheManifestSays) {
  const ParamLayout global = global_layout();
  const GlobalState g(global.total);
  const std::string out = kiln::testing::make_temp_dir("kiln_ckpt_pieces_header_");
  const std::string dir = write_checkpoint(out, global, g, 2, 1, 3).dir;
  YAML::Node n = YAML::LoadFile(dir + "/manifest.yaml");
  const int64_t proj = global.find("proj").offset;
  YAML::Node rank0, rank1;
  for (YAML::Node f : n["files"]) {
    if (f["begin"].as<int64_t>() == proj) rank0 = f;
    if (f["begin"].as<int64_t>() == proj + 6) rank1 = f;
  }
  ASSERT_TRUE(rank0 && rank1);
  const std::string name0 = rank0["file"].as<std::string>(),
                    name1 = rank1["file"].as<std::string>();
  rank0["file"] = name1;
  rank1["file"] = name0;
  YAML::Emitter e;
  e << n;
  write_bytes(dir + "/manifest.yaml", e.c_str());
  const CheckpointManifest manifest = read_manifest(dir);
  std::vector<float> master(static_cast<size_t>(global.total));
  const std::string msg = kiln::testing::input_error([&] {
    load_optimizer_range(manifest, global, 0, global.total, master.data(), nullptr, nullptr);
  });
  const std::string p = std::to_string(proj), e0 = std::to_string(proj + 7 * 12 + 6),
                    p1 = std::to_string(proj + 6), e1 = std::to_string(proj + 7 * 12 + 12);
  const std::string a = dir + "/" + name0 + ": holds [" + p + ", " + e0 +
                        ") in 8 runs of 6 every 12 by its header; the manifest says [" + p1 + ", " +
                        e1 + ") in 8 runs of 6 every 12";
  const std::string b = dir + "/" + name1 + ": holds [" + p1 + ", " + e1 +
                        ") in 8 runs of 6 every 12 by its header; the manifest says [" + p + ", " +
                        e0 + ") in 8 runs of 6 every 12";
  EXPECT_TRUE(msg == a || msg == b) << msg;
}

// What kiln wrote before strided files (format version 2, at 85e2f10): two ranks' contiguous
// files of a 10-parameter layout, master[i] = i, m = i / 2, v = i / 4. It loads unchanged,
// whole and in pieces that cross its files, strided ones too.
TEST(CheckpointPieces, AVersionTwoCheckpointStillLoads) {
  const std::string dir =
      std::string(KILN_SOURCE_DIR) + "/tests/fixtures/checkpoint_v2/step_00000004";
  LayoutBuilder b;
  b.add("a", Shape{2, 3}, true);
  b.add("b", Shape{4}, false);
  b.close_unit();
  const ParamLayout layout = b.finish();
  const CheckpointManifest manifest = read_manifest(dir);
  EXPECT_EQ(manifest.version, 2u);
  ASSERT_EQ(manifest.files.size(), 2u);
  EXPECT_EQ(manifest.files[1].runs, 1);
  std::vector<float> master(10), m(10), v(10);
  load_optimizer_range(manifest, layout, 0, 10, master.data(), m.data(), v.data());
  for (int i = 0; i < 10; ++i) {
    EXPECT_EQ(master[static_cast<size_t>(i)], float(i));
    EXPECT_EQ(m[static_cast<size_t>(i)], 0.5f * float(i));
    EXPECT_EQ(v[static_cast<size_t>(i)], 0.25f * float(i));
  }
  // Columns 1 and 2 of a's 2 rows (the second run across both files), then [7, 10).
  std::vector<float> cols(4), tail(3);
  const LayoutPiece strided{0, 1, 2, 2, 3}, range{0, 7, 3, 1, 3};
  load_optimizer_pieces(manifest, layout,
                        {{strided, cols.data(), nullptr, nullptr}, {range, tail.data()}});
  EXPECT_EQ(cols, (std::vector<float>{1, 2, 4, 5}));
  EXPECT_EQ(tail, (std::vector<float>{7, 8, 9}));
}

}  // namespace
}  // namespace kiln
