// Reading a checkpoint: its manifest, checked to tile the global buffer, and the optimizer state
// of any layout's pieces, each file read once (the format: state/checkpoint_format.h).
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <queue>
#include <thread>

#include "base/error.h"
#include "base/input_file.h"
#include "state/checkpoint.h"
#include "state/checkpoint_format.h"

namespace kiln {

using namespace checkpoint_format;
namespace fs = std::filesystem;

namespace {

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
      ParamInfo info{t["name"].as<std::string>(), t["offset"].as<int64_t>(), {}, 0, false, 0, {}, {}};
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
