#include "state/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <spdlog/spdlog.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "base/durable_write.h"
#include "base/error.h"
#include "base/input_file.h"
#include "base/test_faults.h"
#include "state/checkpoint_format.h"

namespace kiln {

using namespace checkpoint_format;
namespace fs = std::filesystem;

namespace {

// The shard as its file describes it: a range is one run of end - begin.
OptimizerShard normalized(OptimizerShard s) {
  if (s.runs <= 1) s.run = s.stride = s.end - s.begin, s.runs = 1;
  return s;
}

// Returns the file's checksum. `s` is normalized.
uint64_t write_shard(const std::string& path, const OptimizerShard& s) {
  ShardHeader h{};
  std::memcpy(h.magic, kShardMagic, sizeof kShardMagic);
  h.version = kFormatVersion;
  h.begin = s.begin;
  h.end = s.end;
  h.run = s.run;
  h.runs = s.runs;
  h.stride = s.stride;
  const size_t n = static_cast<size_t>(s.run * s.runs) * sizeof(float);
  ShardChecksum checksum(kFormatVersion);
  checksum.update(&h, sizeof h);
  for (const float* array : {s.master, s.m, s.v}) checksum.update(array, n);
  const uint64_t sum = checksum.value();
  write_file_synced(path, {{&h, sizeof h}, {s.master, n}, {s.m, n}, {s.v, n}, {&sum, sizeof sum}});
  return sum;
}

// A .done marker: one line per file, "name begin end checksum run runs stride".
std::string marker_text(const std::vector<CheckpointFile>& files) {
  std::ostringstream out;
  for (const auto& f : files)
    out << f.file << ' ' << f.begin << ' ' << f.end << ' ' << f.checksum << ' ' << f.run << ' '
        << f.runs << ' ' << f.stride << '\n';
  return out.str();
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::vector<CheckpointFile> read_marker(const std::string& path) {
  std::istringstream in(read_text(path));
  std::vector<CheckpointFile> files;
  CheckpointFile f;
  while (in >> f.file >> f.begin >> f.end >> f.checksum >> f.run >> f.runs >> f.stride)
    files.push_back(f);
  if (!in.eof()) throw std::runtime_error(path + ": malformed checkpoint marker");
  return files;
}

std::string seconds(double s) {
  std::ostringstream out;
  out << s << " s";
  return out.str();
}

void check_abandoned(const std::function<bool()>& abandoned, const std::string& dir) {
  if (abandoned && abandoned()) throw std::runtime_error(dir + ": abandoned (the run is stopping)");
}

std::string manifest_yaml(const CheckpointManifest& m) {
  YAML::Emitter out;
  out << YAML::BeginMap;
  out << YAML::Key << "format" << YAML::Value << "kiln-checkpoint";
  out << YAML::Key << "version" << YAML::Value << kFormatVersion;
  out << YAML::Key << "step" << YAML::Value << m.state.step;
  out << YAML::Key << "loader_epoch" << YAML::Value << m.state.loader_epoch;
  out << YAML::Key << "loader_cursor" << YAML::Value << m.state.loader_cursor;
  if (!m.state.loader_sources.empty()) {
    out << YAML::Key << "loader_sources" << YAML::Value << YAML::BeginSeq;
    for (const SourcePosition& p : m.state.loader_sources) {
      out << YAML::Flow << YAML::BeginMap;
      out << YAML::Key << "name" << YAML::Value << p.name;
      // Exactly the double the run was given: a resume compares it to tell a weight change.
      out << YAML::Key << "weight" << YAML::Value << YAML::Precision(17) << p.weight;
      out << YAML::Key << "epoch" << YAML::Value << p.epoch;
      out << YAML::Key << "cursor" << YAML::Value << p.cursor;
      out << YAML::Key << "drawn" << YAML::Value << p.drawn;
      out << YAML::Key << "total" << YAML::Value << p.total;
      out << YAML::EndMap;
    }
    out << YAML::EndSeq;
  }
  out << YAML::Key << "rng_state" << YAML::Value << m.state.rng_state;
  if (!m.state.fp8.names.empty()) {
    out << YAML::Key << "fp8" << YAML::Value << YAML::BeginMap;
    out << YAML::Key << "file" << YAML::Value << kFp8File;
    out << YAML::Key << "history" << YAML::Value << m.state.fp8.history;
    out << YAML::Key << "floats" << YAML::Value << m.state.fp8.state.size();
    out << YAML::Key << "checksum" << YAML::Value
        << fnv1a(kFnvSeed, m.state.fp8.state.data(), m.state.fp8.state.size() * sizeof(float));
    out << YAML::Key << "tensors" << YAML::Value << YAML::Flow << m.state.fp8.names;
    out << YAML::EndMap;
  }
  if (!m.state.moe_bias.empty()) {
    out << YAML::Key << "moe_bias" << YAML::Value << YAML::BeginMap;
    out << YAML::Key << "file" << YAML::Value << kMoeBiasFile;
    out << YAML::Key << "floats" << YAML::Value << m.state.moe_bias.size();
    out << YAML::Key << "checksum" << YAML::Value
        << fnv1a(kFnvSeed, m.state.moe_bias.data(), m.state.moe_bias.size() * sizeof(float));
    out << YAML::EndMap;
  }
  out << YAML::Key << "world_size" << YAML::Value << m.world_size;
  out << YAML::Key << "strategy" << YAML::Value << m.strategy;
  out << YAML::Key << "param_count" << YAML::Value << m.param_count;
  out << YAML::Key << "files" << YAML::Value << YAML::BeginSeq;
  for (const auto& f : m.files) {
    out << YAML::Flow << YAML::BeginMap << YAML::Key << "file" << YAML::Value << f.file << YAML::Key
        << "begin" << YAML::Value << f.begin << YAML::Key << "end" << YAML::Value << f.end
        << YAML::Key << "checksum" << YAML::Value << f.checksum;
    if (f.runs > 1)
      out << YAML::Key << "run" << YAML::Value << f.run << YAML::Key << "runs" << YAML::Value
          << f.runs << YAML::Key << "stride" << YAML::Value << f.stride;
    out << YAML::EndMap;
  }
  out << YAML::EndSeq;
  out << YAML::Key << "tensors" << YAML::Value << YAML::BeginSeq;
  for (const auto& t : m.tensors) {
    out << YAML::Flow << YAML::BeginMap << YAML::Key << "name" << YAML::Value << t.name
        << YAML::Key << "offset" << YAML::Value << t.offset << YAML::Key << "shape"
        << YAML::Value << YAML::Flow << YAML::BeginSeq;
    for (int i = 0; i < t.shape.ndim; ++i) out << t.shape[i];
    out << YAML::EndSeq << YAML::EndMap;
  }
  out << YAML::EndSeq;
  out << YAML::Key << "config" << YAML::Value << YAML::Literal << m.config_yaml;
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

// The published checkpoints past the newest `keep`, removed. The new one is published by then, so
// a removal that fails is a warning, never the save's failure; files that vanish meanwhile
// (another process removing the same directory) are no failure at all.
void prune_checkpoints(const std::string& root, int keep) {
  std::vector<std::string> complete;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step_", 0) == 0 && name.find('.') == std::string::npos) complete.push_back(name);
  }
  std::sort(complete.begin(), complete.end());
  for (size_t i = 0; i + static_cast<size_t>(keep) < complete.size(); ++i) {
    const std::string dir = root + "/" + complete[i];
    // remove_all stops at an entry that vanished under it: go again until the directory is gone.
    for (int attempt = 0; attempt < 5; ++attempt) {
      ec.clear();
      fs::remove_all(dir, ec);
      std::error_code gone;
      if (!ec || !fs::exists(dir, gone)) break;
    }
    std::error_code gone;
    if (fs::exists(dir, gone))
      spdlog::warn("checkpoint: could not remove {} (train.keep_checkpoints={}): {}", dir, keep,
                   ec.message());
  }
}


}  // namespace

CheckpointManifest checkpoint_manifest(const TrainingState& state, const ParamLayout& layout,
                                       const std::string& config_yaml, const std::string& strategy,
                                       int world_size) {
  CheckpointManifest m;
  m.state = state;
  m.world_size = world_size;
  m.strategy = strategy;
  m.param_count = layout.total;
  m.config_yaml = config_yaml;
  m.tensors = layout.tensors;
  return m;
}

void begin_checkpoint(const std::string& out_dir, int step) {
  const std::string root = out_dir + "/checkpoints";
  fs::create_directories(root);
  // Every step_N.tmp a crash or a second Ctrl-C left mid-write, markers and all: this step's,
  // and any other step's, which no resume reads and no prune would remove. A published
  // checkpoint's name has no '.'.
  std::vector<fs::path> left;
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step_", 0) == 0 && name.size() > 9 &&
        name.compare(name.size() - 4, 4, ".tmp") == 0)
      left.push_back(e.path());
  }
  for (const fs::path& p : left) fs::remove_all(p);
  fs::create_directory(root + "/" + step_name(step) + ".tmp");
}

void write_rank_files(const std::string& out_dir, int step, int rank,
                      const std::vector<OptimizerShard>& shards,
                      const std::function<bool()>& abandoned) {
  const std::string tmp_dir = out_dir + "/checkpoints/" + step_name(step) + ".tmp";
  std::vector<CheckpointFile> files;
  std::string writing;
  try {
    for (size_t i = 0; i < shards.size(); ++i) {
      check_abandoned(abandoned, tmp_dir);
      const OptimizerShard s = normalized(shards[i]);
      if (s.end <= s.begin) continue;
      writing = shard_file(rank, i);
      files.push_back({writing, s.begin, s.end, write_shard(tmp_dir + "/" + writing, s), s.run,
                       s.runs, s.stride});
    }
    test_faults::checkpoint_files_written(step, rank);
    // Renamed into place whole, so rank 0 never reads half a marker.
    const std::string done = tmp_dir + "/" + rank_marker(rank, "done");
    const std::string text = marker_text(files);
    write_file_synced(done + ".tmp", {{text.data(), text.size()}});
    if (std::rename((done + ".tmp").c_str(), done.c_str()) != 0)
      fail_io("cannot rename into place", done);
    fsync_path(tmp_dir);
  } catch (const std::exception& e) {
    // This rank's files go (a full disk gets its room back); the marker says why.
    std::error_code ec;
    for (const CheckpointFile& f : files) fs::remove(tmp_dir + "/" + f.file, ec);
    if (!writing.empty()) fs::remove(tmp_dir + "/" + writing, ec);
    try {
      const std::string why = e.what();
      write_file_synced(tmp_dir + "/" + rank_marker(rank, "failed"), {{why.data(), why.size()}});
    } catch (const std::exception&) {
      // No room even for the marker: rank 0 waits out its timeout instead.
    }
    throw;
  }
}

std::string publish_checkpoint(const std::string& out_dir, CheckpointManifest m, int keep,
                               double timeout_s, const std::function<bool()>& abandoned) {
  const std::string root = out_dir + "/checkpoints";
  const std::string name = step_name(m.state.step);
  const std::string final_dir = root + "/" + name;
  const std::string tmp_dir = final_dir + ".tmp";
  using Clock = std::chrono::steady_clock;
  const Clock::time_point deadline =
      Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  m.files.clear();
  for (int r = 0; r < m.world_size; ++r) {
    const std::string done = tmp_dir + "/" + rank_marker(r, "done");
    const std::string failed = tmp_dir + "/" + rank_marker(r, "failed");
    std::chrono::milliseconds pause(1);
    while (!fs::exists(done)) {
      if (fs::exists(failed))
        throw std::runtime_error("checkpoint " + name + " not published: rank " +
                                 std::to_string(r) +
                                 " could not write its part: " + read_text(failed));
      check_abandoned(abandoned, tmp_dir);
      if (Clock::now() > deadline)
        throw std::runtime_error("checkpoint " + name + " not published: rank " +
                                 std::to_string(r) + " did not finish writing to " + tmp_dir +
                                 " within dist.timeout_s (" + seconds(timeout_s) + ")");
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(50));
    }
    for (const CheckpointFile& f : read_marker(done)) m.files.push_back(f);
  }
  std::sort(m.files.begin(), m.files.end(),
            [](const CheckpointFile& a, const CheckpointFile& b) { return a.file < b.file; });
  const TrainingState& state = m.state;
  if (!state.fp8.names.empty())
    write_file_synced(tmp_dir + "/" + kFp8File,
                      {{state.fp8.state.data(), state.fp8.state.size() * sizeof(float)}});
  if (!state.moe_bias.empty())
    write_file_synced(tmp_dir + "/" + kMoeBiasFile,
                      {{state.moe_bias.data(), state.moe_bias.size() * sizeof(float)}});
  const std::string text = manifest_yaml(m);
  write_file_synced(tmp_dir + "/manifest.yaml", {{text.data(), text.size()}});
  // The manifest lists every file: a published checkpoint holds what it names, no markers.
  for (int r = 0; r < m.world_size; ++r) fs::remove(tmp_dir + "/" + rank_marker(r, "done"));
  fsync_path(tmp_dir);
  if (fs::exists(final_dir)) fs::remove_all(final_dir);
  fs::rename(tmp_dir, final_dir);
  fsync_path(root);
  prune_checkpoints(root, keep);
  return final_dir;
}

std::string save_checkpoint(const std::string& out_dir, const TrainingState& state,
                            const ParamLayout& layout, const std::string& config_yaml,
                            const std::string& strategy, const std::vector<OptimizerShard>& shards,
                            int rank, int world_size, int keep, double timeout_s,
                            const std::function<void()>& barrier) {
  if (rank == 0) begin_checkpoint(out_dir, state.step);
  barrier();
  write_rank_files(out_dir, state.step, rank, shards);
  std::string dir = out_dir + "/checkpoints/" + step_name(state.step);
  if (rank == 0)
    dir = publish_checkpoint(out_dir,
                             checkpoint_manifest(state, layout, config_yaml, strategy, world_size),
                             keep, timeout_s);
  barrier();
  return dir;
}

std::optional<std::string> find_latest_checkpoint(const std::string& out_dir) {
  const std::string root = out_dir + "/checkpoints";
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return std::nullopt;
  std::string best;
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step_", 0) != 0 || name.find('.') != std::string::npos) continue;
    if (!fs::exists(e.path() / "manifest.yaml")) continue;
    if (name > best) best = name;
  }
  if (best.empty()) return std::nullopt;
  return root + "/" + best;
}

}  // namespace kiln
