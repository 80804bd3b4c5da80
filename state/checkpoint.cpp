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
#include <queue>
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
// Version 3 (written): a shard file may hold a strided piece, and its header says so (run, runs,
// stride); a tensor-parallel rank writes a file per piece, not per run. Version 2: the optimizer
// shards' checksum is ShardChecksum's four lanes, every file a range. Version 1: byte-wise
// FNV-1a. All three are read.
constexpr uint32_t kFormatVersion = 3;

struct ShardHeader {
  char magic[8];
  uint32_t version;
  uint32_t reserved;
  int64_t begin;
  int64_t end;
  int64_t run, runs, stride;  // version 3 on
};

// The header as version `version` writes it: versions 1 and 2 end at `end`.
size_t header_bytes(uint32_t version) {
  return version >= 3 ? sizeof(ShardHeader) : offsetof(ShardHeader, run);
}

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
// A file's part of the global buffer, as the manifest gives it.
std::string part_text(int64_t begin, int64_t end, int64_t run, int64_t runs, int64_t stride) {
  std::string text = range_text(begin, end);
  if (runs > 1)
    text += " in " + std::to_string(runs) + " runs of " + std::to_string(run) + " every " +
            std::to_string(stride);
  return text;
}
std::string file_range(const CheckpointFile& f) {
  return f.file + " " + part_text(f.begin, f.end, f.run, f.runs, f.stride);
}

// Floor division for a positive divisor.
int64_t floor_div(int64_t a, int64_t b) {
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}

[[noreturn]] void fail_io(const std::string& what, const std::string& path) {
  throw std::runtime_error(what + " " + path + ": " + std::strerror(errno));
}

}  // namespace

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

namespace {

// The manifest's files, each within the buffer and, where strided, well formed and within one
// tensor; together they tile [0, param_count) exactly once. The tiling is a sweep of every run in
// global order, merged from the files' own (each in order) through a heap: O(runs log files),
// with a strided file's runs never expanded into memory.
void check_files(const std::string& path, const CheckpointManifest& m) {
  std::vector<const ParamInfo*> by_offset;
  for (const ParamInfo& t : m.tensors) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const ParamInfo* a, const ParamInfo* b) { return a->offset < b->offset; });
  for (const CheckpointFile& f : m.files) {
    const std::string where = path + ": file " + file_range(f);
    if (f.begin >= f.end) throw InputError(where + " is empty");
    if (f.begin < 0 || f.end > m.param_count)
      throw InputError(where + " is out of the " + std::to_string(m.param_count) + " parameters");
    if (f.runs < 1 || f.run < 1 || (f.runs > 1 && f.stride < f.run))
      throw InputError(where +
                       ": runs must be at least 1 element, and their stride at least a run");
    // end - begin = (runs - 1) x stride + run, checked without overflowing.
    const int64_t span = f.end - f.begin - f.run;
    if (f.runs == 1 ? span != 0 : span < 0 || span % f.stride != 0 || span / f.stride != f.runs - 1)
      throw InputError(where + ": its last run does not end at its end, " + std::to_string(f.end));
    if (f.runs == 1) continue;
    // A stride is a tensor's row: a strided file lies within one tensor.
    const auto after =
        std::upper_bound(by_offset.begin(), by_offset.end(), f.begin,
                         [](int64_t at, const ParamInfo* t) { return at < t->offset; });
    const ParamInfo* t = after == by_offset.begin() ? nullptr : *(after - 1);
    if (!t || f.end > t->offset + t->numel())
      throw InputError(where + " leaves " +
                       (t ? "tensor " + t->name + t->shape.str() + " " +
                                range_text(t->offset, t->offset + t->numel())
                          : std::string("the tensors")));
  }
  struct Run {
    int64_t begin;
    size_t file;
    int64_t k;
  };
  const auto later = [](const Run& a, const Run& b) {
    return a.begin != b.begin ? a.begin > b.begin : a.file > b.file;
  };
  std::priority_queue<Run, std::vector<Run>, decltype(later)> next(later);
  for (size_t i = 0; i < m.files.size(); ++i) next.push({m.files[i].begin, i, 0});
  int64_t covered = 0;  // [0, covered) is held by exactly one file
  size_t last = 0;
  while (!next.empty()) {
    Run r = next.top();
    next.pop();
    const CheckpointFile& f = m.files[r.file];
    if (r.begin < covered)
      throw InputError(path + ": files " + file_range(m.files[last]) + " and " + file_range(f) +
                       " overlap");
    if (r.begin > covered)
      throw InputError(path + ": no file holds parameters " + range_text(covered, r.begin));
    covered = r.begin + f.run;
    last = r.file;
    if (++r.k < f.runs) {
      r.begin += f.stride;
      next.push(r);
    }
  }
  if (covered < m.param_count)
    throw InputError(path + ": no file holds parameters " + range_text(covered, m.param_count));
}

}  // namespace

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
    if (m.version < 1 || m.version > kFormatVersion)
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
      CheckpointFile file{f["file"].as<std::string>(), f["begin"].as<int64_t>(),
                          f["end"].as<int64_t>(), f["checksum"].as<uint64_t>()};
      // Written only for a strided file (version 3 on); a range is one run.
      if (f["runs"]) {
        if (m.version < 3)
          throw InputError(path + ": file " + file.file + " is strided (runs), which version " +
                           std::to_string(m.version) + " does not hold");
        file.run = f["run"].as<int64_t>();
        file.runs = f["runs"].as<int64_t>();
        file.stride = file.runs == 1 ? file.run : f["stride"].as<int64_t>();
      } else {
        file.run = file.stride = file.end - file.begin;
      }
      m.files.push_back(file);
    }
    for (const auto& t : n["tensors"]) {
      ParamInfo info{t["name"].as<std::string>(), t["offset"].as<int64_t>(), {}, 0, false, 0, {}};
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
    check_files(path, m);
  } catch (const YAML::Exception& e) {
    throw InputError(path + ": malformed checkpoint manifest: " + e.what());
  }
  return m;
}

namespace {

// One copy out of a file: `n` elements from offset `from` of each of its arrays (master, m, v)
// to offset `at` of destination `to`'s.
struct RunCopy {
  int64_t from, n;
  size_t to;
  int64_t at;
};

// Where file f meets destination piece d (destination `to`), appended to `out`: the two sets of
// runs intersected arithmetically, visiting d's runs within f's span and, for each, the runs of
// f it meets.
void add_copies(const CheckpointFile& f, LayoutPiece d, size_t to, std::vector<RunCopy>& out) {
  if (d.runs <= 1) d.stride = d.run, d.runs = 1;
  const int64_t fstride = f.runs > 1 ? f.stride : f.run;
  const int64_t j0 = std::max<int64_t>(0, floor_div(f.begin - d.global - d.run, d.stride) + 1);
  const int64_t j1 = std::min(d.runs - 1, floor_div(f.end - 1 - d.global, d.stride));
  for (int64_t j = j0; j <= j1; ++j) {
    const int64_t x = d.global + j * d.stride, y = x + d.run;
    const int64_t k0 = std::max<int64_t>(0, floor_div(x - f.begin - f.run, fstride) + 1);
    const int64_t k1 = std::min(f.runs - 1, floor_div(y - 1 - f.begin, fstride));
    for (int64_t k = k0; k <= k1; ++k) {
      const int64_t a = f.begin + k * fstride, lo = std::max(x, a), hi = std::min(y, a + f.run);
      if (lo < hi) out.push_back({k * f.run + (lo - a), hi - lo, to, j * d.run + (lo - x)});
    }
  }
}

// File f read once, in blocks so memory stays small whatever its size, its whole checksum
// verified, and its elements copied where `copies` (sorted by `from`, disjoint) say. The file is
// what the manifest says it is: its header holds f's part, and after the header come the three
// arrays and the checksum, nothing more.
void load_shard(const CheckpointManifest& manifest, const CheckpointFile& f,
                const std::vector<RunCopy>& copies,
                const std::vector<StateDestination>& destinations) {
  const std::string path = manifest.dir + "/" + f.file;
  InputFile in(path, "checkpoint shard");
  const int64_t n = f.size();
  const size_t header = header_bytes(manifest.version);
  ShardHeader h{};
  ShardChecksum checksum(manifest.version);
  if (!in.read(&h, header) || std::memcmp(h.magic, kShardMagic, sizeof kShardMagic) != 0)
    throw InputError(path + ": not a kiln checkpoint shard (no " +
                     std::string(kShardMagic, sizeof kShardMagic) + " header)");
  if (manifest.version < 3) h.run = h.stride = h.end - h.begin, h.runs = 1;
  if (h.begin != f.begin || h.end != f.end || h.run != f.run || h.runs != f.runs ||
      (f.runs > 1 && h.stride != f.stride))
    throw InputError(path + ": holds " + part_text(h.begin, h.end, h.run, h.runs, h.stride) +
                     " by its header; the manifest says " +
                     part_text(f.begin, f.end, f.run, f.runs, f.stride));
  // Unsigned: a size computed from a part no file has wraps rather than overflows.
  const uint64_t bytes = header + 3 * static_cast<uint64_t>(n) * sizeof(float) + sizeof(uint64_t);
  if (static_cast<uint64_t>(in.size()) != bytes)
    throw InputError(path + ": " + std::to_string(in.size()) + " bytes, but its " +
                     std::to_string(n) + " parameters take " + std::to_string(bytes) +
                     " (a header, master weights, m, v and a checksum)");
  checksum.update(&h, header);
  constexpr int64_t kBlock = int64_t{1} << 20;  // floats: 4 MiB
  std::vector<float> buf(static_cast<size_t>(std::min(n, kBlock)));
  for (int array = 0; array < 3; ++array) {
    size_t c = 0;  // the first copy not yet done
    for (int64_t at = 0; at < n; at += kBlock) {
      const int64_t k = std::min(kBlock, n - at);
      if (!in.read(buf.data(), static_cast<size_t>(k) * 4))
        throw InputError(path + ": truncated checkpoint shard");
      checksum.update(buf.data(), static_cast<size_t>(k) * 4);
      for (; c < copies.size() && copies[c].from < at + k; ++c) {
        const RunCopy& rc = copies[c];
        const StateDestination& d = destinations[rc.to];
        float* dst = array == 0 ? d.master : array == 1 ? d.m : d.v;
        const int64_t a = std::max(rc.from, at), b = std::min(rc.from + rc.n, at + k);
        if (dst && a < b)
          std::copy(buf.begin() + (a - at), buf.begin() + (b - at), dst + rc.at + (a - rc.from));
        if (rc.from + rc.n > at + k) break;  // goes on in the next block
      }
    }
  }
  uint64_t stored = 0;
  if (!in.read(&stored, sizeof stored) || stored != checksum.value() || stored != f.checksum)
    throw InputError(path + ": checksum mismatch (corrupt or truncated checkpoint shard)");
}

}  // namespace

void load_optimizer_pieces(const CheckpointManifest& manifest, const ParamLayout& layout,
                           const std::vector<StateDestination>& destinations) {
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
  // The files by where they start, with the furthest end among those before each: the files a
  // destination's span [lo, hi) meets lie between the first whose furthest end passes lo and
  // the last that starts before hi.
  std::vector<const CheckpointFile*> files;
  for (const auto& f : manifest.files) files.push_back(&f);
  std::sort(files.begin(), files.end(),
            [](const CheckpointFile* a, const CheckpointFile* b) { return a->begin < b->begin; });
  std::vector<int64_t> furthest_end(files.size());
  for (size_t i = 0; i < files.size(); ++i)
    furthest_end[i] = std::max(i > 0 ? furthest_end[i - 1] : 0, files[i]->end);
  std::vector<std::vector<RunCopy>> copies(files.size());
  std::vector<int64_t> found(destinations.size(), 0);
  for (size_t d = 0; d < destinations.size(); ++d) {
    const LayoutPiece& p = destinations[d].piece;
    if (p.size() <= 0) continue;
    const int64_t lo = p.global, hi = p.global + (p.runs > 1 ? (p.runs - 1) * p.stride : 0) + p.run;
    const size_t first = static_cast<size_t>(
        std::upper_bound(furthest_end.begin(), furthest_end.end(), lo) - furthest_end.begin());
    for (size_t i = first; i < files.size() && files[i]->begin < hi; ++i) {
      if (files[i]->end <= lo) continue;
      const size_t before = copies[i].size();
      add_copies(*files[i], p, d, copies[i]);
      for (size_t c = before; c < copies[i].size(); ++c) found[d] += copies[i][c].n;
    }
  }
  // read_manifest holds the files to tiling the buffer once; a manifest built otherwise is
  // checked here too, by what each destination found.
  for (size_t d = 0; d < destinations.size(); ++d) {
    const LayoutPiece& p = destinations[d].piece;
    if (p.size() > 0 && found[d] != p.size())
      throw InputError(
          where + ": the files hold " + std::to_string(found[d]) + " of the " +
          std::to_string(p.size()) + " parameters at " +
          part_text(p.global, p.global + (p.runs - 1) * p.stride + p.run, p.run, p.runs, p.stride));
  }
  std::vector<size_t> needed;
  for (size_t i = 0; i < files.size(); ++i)
    if (!copies[i].empty()) {
      std::sort(copies[i].begin(), copies[i].end(),
                [](const RunCopy& a, const RunCopy& b) { return a.from < b.from; });
      needed.push_back(i);
    }
  std::vector<std::string> errors(needed.size());
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < needed.size(); i = next++) {
      try {
        load_shard(manifest, *files[needed[i]], copies[needed[i]], destinations);
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    }
  };
  const size_t threads =
      std::min<size_t>(needed.size(), std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  for (const std::string& e : errors)
    if (!e.empty()) throw InputError(e);
}

void load_optimizer_range(const CheckpointManifest& manifest, const ParamLayout& layout,
                          int64_t begin, int64_t end, float* master, float* m, float* v) {
  LayoutPiece range;
  range.local = range.global = begin;
  range.run = range.stride = std::max<int64_t>(0, end - begin);
  load_optimizer_pieces(manifest, layout, {{range, master, m, v}});
}

}  // namespace kiln
