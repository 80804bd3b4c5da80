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

namespace kiln {

namespace fs = std::filesystem;

namespace {

constexpr char kShardMagic[8] = {'K', 'I', 'L', 'N', 'S', 'H', 'R', 'D'};
// Version 2 (written): the optimizer shards' checksum is ShardChecksum's four lanes; version 1's
// byte-wise FNV-1a is still read.
constexpr uint32_t kFormatVersion = 2;

struct ShardHeader {
  char magic[8];
  uint32_t version;
  uint32_t reserved;
  int64_t begin;
  int64_t end;
};

// The files' checksum (model/param_layout.h), continuing from `h`.
uint64_t fnv1a(uint64_t h, const void* data, size_t n) {
  return fnv1a_bytes(data, n, h);
}
constexpr uint64_t kFnvSeed = 14695981039346656037ull;

// An optimizer shard file's checksum, streamed. Version 1: FNV-1a over the bytes, serial at
// ~0.5-0.7 GB/s, which made hashing most of an 8B checkpoint's write and read. Version 2: four
// independent lanes over 8-byte words, each step xxHash64's round (add the word times a prime,
// rotate, multiply), merged and avalanched at the end with the length and the odd bytes:
// ~9x faster (4.8 against 0.52 GB/s on one core of the 2-core build machine). It guards
// against corruption and truncation, not adversaries.
class ShardChecksum {
 public:
  explicit ShardChecksum(uint32_t version) : version_(version) {}
  void update(const void* data, size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    if (version_ == 1) {
      fnv_ = fnv1a(fnv_, p, n);
      return;
    }
    total_ += n;
    if (pending_ > 0) {
      const size_t take = std::min(n, kBlock - pending_);
      std::memcpy(tail_ + pending_, p, take);
      pending_ += take, p += take, n -= take;
      if (pending_ < kBlock) return;
      block(tail_);
      pending_ = 0;
    }
    for (; n >= kBlock; p += kBlock, n -= kBlock) block(p);
    std::memcpy(tail_, p, n);
    pending_ = n;
  }
  uint64_t value() const {
    if (version_ == 1) return fnv_;
    uint64_t h = rotl(lane_[0], 1) + rotl(lane_[1], 7) + rotl(lane_[2], 12) + rotl(lane_[3], 18);
    h ^= total_;
    for (size_t i = 0; i < pending_; ++i) h = (h ^ tail_[i]) * kP1;
    h ^= h >> 33;
    h *= kP2;
    h ^= h >> 29;
    h *= kP3;
    return h ^ (h >> 32);
  }

 private:
  static constexpr size_t kBlock = 32;
  static constexpr uint64_t kP1 = 11400714785074694791ull, kP2 = 14029467366897019727ull,
                            kP3 = 1609587929392839161ull;
  static uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
  void block(const unsigned char* p) {
    uint64_t w[4];
    std::memcpy(w, p, sizeof w);
    for (int l = 0; l < 4; ++l) lane_[l] = rotl(lane_[l] + w[l] * kP2, 31) * kP1;
  }
  uint32_t version_;
  uint64_t fnv_ = kFnvSeed;
  uint64_t lane_[4] = {kFnvSeed + kP1 + kP2, kFnvSeed + kP2, kFnvSeed, kFnvSeed - kP1};
  unsigned char tail_[kBlock] = {};
  size_t pending_ = 0;
  uint64_t total_ = 0;
};

constexpr const char* kFp8File = "fp8_state.bin";
constexpr const char* kMoeBiasFile = "moe_bias.bin";

std::string step_name(int step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08d", step);
  return buf;
}

std::string shard_file(int rank, size_t part) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "rank_%05d_%03zu.bin", rank, part);
  return buf;
}

// A rank's marker in the .tmp directory: `.done` lists its files, `.failed` says why there are
// none.
std::string rank_marker(int rank, const char* suffix) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "rank_%05d.%s", rank, suffix);
  return buf;
}

std::string range_text(int64_t begin, int64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + ")";
}
std::string file_range(const CheckpointFile& f) {
  return f.file + " " + range_text(f.begin, f.end);
}

[[noreturn]] void fail_io(const std::string& what, const std::string& path) {
  throw std::runtime_error(what + " " + path + ": " + std::strerror(errno));
}

}  // namespace

namespace {

// Returns the file's checksum.
uint64_t write_shard(const std::string& path, const OptimizerShard& s) {
  ShardHeader h{};
  std::memcpy(h.magic, kShardMagic, sizeof kShardMagic);
  h.version = kFormatVersion;
  h.begin = s.begin;
  h.end = s.end;
  const size_t n = static_cast<size_t>(s.end - s.begin) * sizeof(float);
  ShardChecksum checksum(kFormatVersion);
  checksum.update(&h, sizeof h);
  for (const float* array : {s.master, s.m, s.v}) checksum.update(array, n);
  const uint64_t sum = checksum.value();
  write_file_synced(path, {{&h, sizeof h}, {s.master, n}, {s.m, n}, {s.v, n}, {&sum, sizeof sum}});
  return sum;
}

// A .done marker: one line per file, "name begin end checksum".
std::string marker_text(const std::vector<CheckpointFile>& files) {
  std::ostringstream out;
  for (const auto& f : files)
    out << f.file << ' ' << f.begin << ' ' << f.end << ' ' << f.checksum << '\n';
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
  while (in >> f.file >> f.begin >> f.end >> f.checksum) files.push_back(f);
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
    out << YAML::Flow << YAML::BeginMap << YAML::Key << "file" << YAML::Value << f.file
        << YAML::Key << "begin" << YAML::Value << f.begin << YAML::Key << "end" << YAML::Value
        << f.end << YAML::Key << "checksum" << YAML::Value << f.checksum << YAML::EndMap;
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

// A state file the manifest names under `node` (file, floats, checksum), read and verified.
std::vector<float> read_floats(const std::string& dir, const YAML::Node& node, const char* what) {
  const std::string file = dir + "/" + node["file"].as<std::string>();
  const uint64_t floats = node["floats"].as<uint64_t>();
  InputFile in(file, what);
  if (static_cast<uint64_t>(in.size()) != floats * sizeof(float) || floats > (uint64_t{1} << 40))
    throw InputError(file + ": missing, truncated or too long (" + what + " of " +
                     std::to_string(floats) + " floats)");
  std::vector<float> values(static_cast<size_t>(floats));
  const size_t bytes = values.size() * sizeof(float);
  if (!in.read(values.data(), bytes))
    throw InputError(file + ": missing, truncated or too long (" + what + " of " +
                     std::to_string(values.size()) + " floats)");
  if (fnv1a(kFnvSeed, values.data(), bytes) != node["checksum"].as<uint64_t>())
    throw InputError(file + ": checksum mismatch (corrupt " + what + ")");
  return values;
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
      if (shards[i].end <= shards[i].begin) continue;
      writing = shard_file(rank, i);
      files.push_back({writing, shards[i].begin, shards[i].end,
                       write_shard(tmp_dir + "/" + writing, shards[i])});
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

CheckpointManifest read_manifest(const std::string& dir) {
  const std::string path = dir + "/manifest.yaml";
  if (!fs::exists(path)) throw InputError(path + ": no checkpoint manifest here");
  // Read here rather than by YAML::LoadFile, which hangs on a FIFO and names no file.
  const std::string text = InputFile(path, "checkpoint manifest").read_all();
  CheckpointManifest m;
  m.dir = dir;
  try {
    YAML::Node n = YAML::Load(text);
    if (n["format"].as<std::string>() != "kiln-checkpoint")
      throw InputError(path + ": not a kiln checkpoint manifest");
    m.version = n["version"].as<uint32_t>();
    if (m.version != 1 && m.version != kFormatVersion)
      throw InputError(path + ": unsupported checkpoint version " + n["version"].as<std::string>());
    m.state.step = n["step"].as<int>();
    if (m.state.step < 0)
      throw InputError(path + ": step " + std::to_string(m.state.step) + " < 0");
    // step_NNNNNNNN: the directory's name is the step its manifest must hold.
    const std::string name = fs::path(dir).lexically_normal().filename().string();
    if (name.rfind("step_", 0) == 0 &&
        name.find_first_not_of("0123456789", 5) == std::string::npos && name.size() > 5 &&
        std::stoll(name.substr(5)) != m.state.step)
      throw InputError(path + ": step " + std::to_string(m.state.step) + " in a directory named " +
                       name);
    m.state.loader_epoch = n["loader_epoch"].as<uint64_t>();
    m.state.loader_cursor = n["loader_cursor"].as<uint64_t>();
    for (const auto& p : n["loader_sources"])
      m.state.loader_sources.push_back({p["name"].as<std::string>(), p["weight"].as<double>(),
                                        p["epoch"].as<uint64_t>(), p["cursor"].as<uint64_t>(),
                                        p["drawn"].as<uint64_t>(), p["total"].as<uint64_t>()});
    m.state.rng_state = n["rng_state"].as<std::string>();
    m.world_size = n["world_size"].as<int>();
    if (m.world_size < 1)
      throw InputError(path + ": world_size " + std::to_string(m.world_size) + " < 1");
    m.strategy = n["strategy"].as<std::string>();
    if (m.strategy != "ddp" && m.strategy != "zero1" && m.strategy != "fsdp")
      throw InputError(path + ": strategy '" + m.strategy + "' is not ddp, zero1 or fsdp");
    m.param_count = n["param_count"].as<int64_t>();
    m.config_yaml = n["config"].as<std::string>();
    if (const YAML::Node f = n["fp8"]) {
      m.state.fp8.names = f["tensors"].as<std::vector<std::string>>();
      m.state.fp8.history = f["history"].as<int>();
      m.state.fp8.state = read_floats(dir, f, "FP8 state");
    }
    if (const YAML::Node f = n["moe_bias"]) m.state.moe_bias = read_floats(dir, f, "MoE bias");
    for (const auto& f : n["files"]) {
      m.files.push_back({f["file"].as<std::string>(), f["begin"].as<int64_t>(),
                         f["end"].as<int64_t>(), f["checksum"].as<uint64_t>()});
      const CheckpointFile& file = m.files.back();
      if (file.begin >= file.end)
        throw InputError(path + ": file " + file_range(file) + " is empty");
      if (file.begin < 0 || file.end > m.param_count)
        throw InputError(path + ": file " + file_range(file) + " is out of the " +
                         std::to_string(m.param_count) + " parameters");
    }
    for (const auto& t : n["tensors"]) {
      ParamInfo info{t["name"].as<std::string>(), t["offset"].as<int64_t>(), {}, 0, false};
      if (!t["shape"].IsSequence() || t["shape"].size() > static_cast<size_t>(kMaxDims))
        throw InputError(path + ": tensor " + info.name + ": a shape of at most " +
                         std::to_string(kMaxDims) + " dimensions expected");
      for (const auto& d : t["shape"]) {
        const int64_t dim = d.as<int64_t>();
        if (dim < 1)
          throw InputError(path + ": tensor " + info.name + ": dimension " + std::to_string(dim));
        info.shape.dims[static_cast<size_t>(info.shape.ndim++)] = dim;
      }
      m.tensors.push_back(info);
    }
  } catch (const YAML::Exception& e) {
    throw InputError(path + ": malformed checkpoint manifest: " + e.what());
  }
  return m;
}

namespace {

// File f's part of [begin, end) into master, m and v (each skipped where null), streamed in
// blocks so memory stays small whatever the file's size; its whole checksum verified. The file
// is what the manifest says it is: its header holds f's range, and after the header come the
// three arrays and the checksum, nothing more.
void load_shard(const CheckpointManifest& manifest, const CheckpointFile& f, int64_t begin,
                int64_t end, float* master, float* m, float* v) {
  const std::string path = manifest.dir + "/" + f.file;
  InputFile in(path, "checkpoint shard");
  const int64_t lo = std::max(begin, f.begin), hi = std::min(end, f.end), n = f.end - f.begin;
  ShardHeader h{};
  ShardChecksum checksum(manifest.version);
  if (!in.read(&h, sizeof h) || std::memcmp(h.magic, kShardMagic, sizeof kShardMagic) != 0)
    throw InputError(path + ": not a kiln checkpoint shard (no " +
                     std::string(kShardMagic, sizeof kShardMagic) + " header)");
  if (h.begin != f.begin || h.end != f.end)
    throw InputError(path + ": holds " + range_text(h.begin, h.end) +
                     " by its header; the manifest says " + range_text(f.begin, f.end));
  // Unsigned: a size computed from a range no file has wraps rather than overflows.
  const uint64_t bytes = sizeof h + 3 * static_cast<uint64_t>(n) * sizeof(float) + sizeof(uint64_t);
  if (static_cast<uint64_t>(in.size()) != bytes)
    throw InputError(path + ": " + std::to_string(in.size()) + " bytes, but its " +
                     std::to_string(n) + " parameters take " + std::to_string(bytes) +
                     " (a header, master weights, m, v and a checksum)");
  checksum.update(&h, sizeof h);
  constexpr int64_t kBlock = int64_t{1} << 20;  // floats: 4 MiB
  std::vector<float> buf(static_cast<size_t>(std::min(n, kBlock)));
  for (float* dst : {master, m, v})
    for (int64_t at = 0; at < n; at += kBlock) {
      const int64_t k = std::min(kBlock, n - at);
      if (!in.read(buf.data(), static_cast<size_t>(k) * 4))
        throw InputError(path + ": truncated checkpoint shard");
      checksum.update(buf.data(), static_cast<size_t>(k) * 4);
      const int64_t a = std::max(lo, f.begin + at), b = std::min(hi, f.begin + at + k);
      if (dst && a < b)
        std::copy(buf.begin() + (a - f.begin - at), buf.begin() + (b - f.begin - at),
                  dst + (a - begin));
    }
  uint64_t stored = 0;
  if (!in.read(&stored, sizeof stored) || stored != checksum.value() || stored != f.checksum)
    throw InputError(path + ": checksum mismatch (corrupt or truncated checkpoint shard)");
}

}  // namespace

void load_optimizer_range(const CheckpointManifest& manifest, const ParamLayout& layout,
                          int64_t begin, int64_t end, float* master, float* m, float* v) {
  const std::string where = manifest.dir + "/manifest.yaml";
  if (manifest.param_count != layout.total || manifest.tensors.size() != layout.tensors.size())
    throw InputError(where + ": checkpoint has " + std::to_string(manifest.param_count) +
                     " parameters in " + std::to_string(manifest.tensors.size()) +
                     " tensors; this model has " + std::to_string(layout.total) + " in " +
                     std::to_string(layout.tensors.size()));
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    const ParamInfo& a = manifest.tensors[i];
    const ParamInfo& b = layout.tensors[i];
    if (a.name != b.name || a.offset != b.offset || a.shape != b.shape)
      throw InputError(where + ": tensor " + a.name + a.shape.str() + " does not match model's " +
                       b.name + b.shape.str());
  }
  // The files that overlap [begin, end), read on threads of their own (each file's whole
  // checksum is verified, so every byte of it is read and hashed). In order they tile it, no
  // gap and no overlap: a sum of their lengths passed a range shifted into its neighbour's.
  std::vector<const CheckpointFile*> files;
  for (const auto& f : manifest.files)
    if (std::max(begin, f.begin) < std::min(end, f.end)) files.push_back(&f);
  std::stable_sort(
      files.begin(), files.end(),
      [](const CheckpointFile* a, const CheckpointFile* b) { return a->begin < b->begin; });
  int64_t at = begin;
  for (size_t i = 0; i < files.size(); ++i) {
    const CheckpointFile& f = *files[i];
    if (i > 0 && f.begin < files[i - 1]->end)
      throw InputError(where + ": files " + file_range(*files[i - 1]) + " and " + file_range(f) +
                       " overlap");
    if (f.begin > at)
      throw InputError(where + ": no file holds parameters " + range_text(at, f.begin));
    at = f.end;
  }
  if (at < end) throw InputError(where + ": no file holds parameters " + range_text(at, end));
  std::vector<std::string> errors(files.size());
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < files.size(); i = next++) {
      try {
        load_shard(manifest, *files[i], begin, end, master, m, v);
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    }
  };
  const size_t threads =
      std::min<size_t>(files.size(), std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  for (const std::string& e : errors)
    if (!e.empty()) throw InputError(e);
}

}  // namespace kiln
