#include "telemetry/run_dir.h"

#include <spdlog/spdlog.h>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>
#include <vector>

#include "base/durable_write.h"
#include "base/error.h"
#include "dist/launcher.h"

namespace kiln {

namespace fs = std::filesystem;

namespace {

// Renames `path` to the first free `path.prev`, `path.prev2`, ... if it exists.
void set_aside(const std::string& path) {
  if (!fs::exists(path)) return;
  std::string dest = path + ".prev";
  for (int i = 2; fs::exists(dest); ++i) dest = path + ".prev" + std::to_string(i);
  fs::rename(path, dest);
  spdlog::warn("starting afresh: moved the earlier run's {} to {}", path, dest);
}

// Moves an earlier run's TensorBoard event files (telemetry/tensorboard.h) into the first free
// `events.prev`, `events.prev2`, ... beside them: TensorBoard reads every event file of a
// directory as one run, and shows the moved ones as a run of their own.
void set_aside_events(const std::string& out_dir) {
  std::error_code ec;
  std::vector<fs::path> files;
  for (const fs::directory_entry& e : fs::directory_iterator(out_dir, ec))
    if (e.is_regular_file() && e.path().filename().string().rfind("events.out.tfevents.", 0) == 0)
      files.push_back(e.path());
  if (files.empty()) return;
  std::string dest = out_dir + "/events.prev";
  for (int i = 2; fs::exists(dest); ++i) dest = out_dir + "/events.prev" + std::to_string(i);
  fs::create_directory(dest);
  for (const fs::path& f : files) fs::rename(f, dest / f.filename());
  spdlog::warn("starting afresh: moved the earlier run's TensorBoard events to {}", dest);
}

// The step of a metrics line, -1 for a line that is not a step's.
int step_of(const std::string& line) {
  const auto pos = line.find("\"step\":");
  return pos == std::string::npos ? -1 : std::atoi(line.c_str() + pos + 7);
}

// Drops the step lines past `last_step`, so the log of a resumed run reads as one run; event
// lines stay. A line cut short by a crash mid-write is dropped too. The line of `last_step`
// itself, where a crash took it after its checkpoint was saved, comes back from path.pending
// (MetricsLog::write_pending).
void truncate_metrics(const std::string& path, int last_step) {
  std::ifstream in(path);
  std::string line, kept;
  bool has_last = last_step == 0;
  while (std::getline(in, line)) {
    if (line.empty() || line.front() != '{' || line.back() != '}') continue;
    if (step_of(line) > last_step) continue;
    has_last = has_last || step_of(line) == last_step;
    kept += line + "\n";
  }
  std::ifstream pending(path + ".pending");
  if (!has_last && std::getline(pending, line) && step_of(line) == last_step) {
    spdlog::warn("metrics.jsonl: step {}'s line restored from {}.pending (the run stopped after "
                 "saving its checkpoint, before logging it)",
                 last_step, path);
    kept += line + "\n";
  }
  if (in.is_open() || !kept.empty()) replace_file_synced(path, kept);
}

constexpr char kRestartEvent[] = "{\"event\":\"restart\",";

// The restart lines of metrics.jsonl, without their "event" field.
std::vector<std::string> restart_lines(const std::string& path) {
  std::vector<std::string> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(kRestartEvent, 0) == 0 && line.back() == '}')
      out.push_back("{" + line.substr(sizeof(kRestartEvent) - 1));
  return out;
}

// JSON string literal of s (quotes, backslashes and control characters escaped).
std::string json_quote(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20)
      out += ' ';
    else
      out += c;
  }
  return out + "\"";
}

// Writes the line of each restart in `restarts` that metrics.jsonl does not hold yet. Only the
// last is this generation's, so only its resumed step is known; an earlier one is missing only
// where its generation stopped before getting here.
void log_restarts(const std::string& path, MetricsLog& log,
                  const std::vector<RestartRecord>& restarts, int resumed_at) {
  std::set<int> logged;
  for (const std::string& l : restart_lines(path))
    logged.insert(std::atoi(l.c_str() + l.find("\"restart\":") + 10));
  for (const RestartRecord& r : restarts) {
    if (logged.count(r.restart)) continue;
    std::string line = kRestartEvent;
    line += "\"restart\":" + std::to_string(r.restart) + ",\"cause\":" + json_quote(r.cause);
    if (&r == &restarts.back()) line += ",\"resumed_from_step\":" + std::to_string(resumed_at);
    log.write_line(line + "}");
  }
  if (!restarts.empty())
    spdlog::warn("restart {}: resumed at step {} after: {}", restarts.back().restart, resumed_at,
                 restarts.back().cause);
}

}  // namespace

void check_run_dir(const Config& cfg) {
  const std::string& dir = cfg.train.out_dir;
  fs::path p = fs::absolute(dir);
  std::error_code ec;
  while (!fs::exists(p, ec) && p.has_parent_path() && p != p.parent_path()) p = p.parent_path();
  const char* why = !fs::is_directory(p, ec)             ? " is not a directory"
                    : ::access(p.c_str(), W_OK | X_OK) != 0 ? " is not writable"
                                                           : nullptr;
  if (why)
    throw InputError("train.out_dir=" + dir + ": cannot create the run directory: " +
                     p.string() + why);
}

void create_run_dir(const Config& cfg) {
  const std::string& dir = cfg.train.out_dir;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    throw InputError("train.out_dir=" + dir + ": cannot create the run directory: " + ec.message());
  // Written only when it changes: a resume with the same config writes nothing here.
  const std::string path = dir + "/config.yaml", text = config_to_yaml(cfg);
  std::ifstream in(path);
  if (in && std::string(std::istreambuf_iterator<char>(in), {}) == text) return;
  replace_file_synced(path, text);
}

std::unique_ptr<MetricsLog> open_metrics(const std::string& out_dir,
                                         std::optional<int> resumed_at) {
  const std::string path = out_dir + "/metrics.jsonl";
  const std::vector<RestartRecord> restarts = restarts_from_environment();
  if (!resumed_at && !restarts.empty()) resumed_at = 0;  // no checkpoint yet: the run anew
  if (resumed_at) {
    truncate_metrics(path, *resumed_at);
  } else {
    set_aside(path);
    set_aside(out_dir + "/checkpoints");
    set_aside_events(out_dir);
  }
  std::remove((path + ".pending").c_str());
  auto log = std::make_unique<MetricsLog>(path);
  log_restarts(path, *log, restarts, *resumed_at);
  return log;
}

std::vector<std::string> recorded_restarts(const std::string& out_dir) {
  return restart_lines(out_dir + "/metrics.jsonl");
}

void write_summary(const std::string& out_dir, const RunSummary& s) {
  std::ostringstream out;
  out << "{\"backend\":\"" << s.backend << "\",\"attention\":\"" << s.attention
      << "\",\"params\":" << s.params << ",\"memory_bytes\":" << s.memory_bytes
      << ",\"tokens_per_step\":" << s.tokens_per_step << ",\"world_size\":" << s.world_size
      << ",\"strategy\":\"" << s.strategy << "\",\"reduce_dtype\":\"" << s.reduce_dtype
      << "\",\"commit\":\"" << build_commit() << "\""
      << ",\"prefetch\":" << (s.prefetch ? "true" : "false")
      << ",\"cuda_graphs\":" << json_quote(s.cuda_graphs) << ",\"fp8\":" << json_quote(s.fp8);
  if (s.peak_flops > 0) out << ",\"peak_tflops\":" << s.peak_flops / 1e12;
  if (s.tokens_per_joule) out << ",\"tokens_per_joule\":" << *s.tokens_per_joule;
  if (s.device_memory_bytes >= 0) out << ",\"device_memory_bytes\":" << s.device_memory_bytes;
  if (!s.stop_signal.empty())
    out << ",\"stopped\":{\"signal\":" << json_quote(s.stop_signal)
        << ",\"step\":" << s.stopped_at_step
        << ",\"checkpoint\":" << (s.stop_checkpoint ? "true" : "false") << "}";
  const std::vector<std::string> restarts = recorded_restarts(out_dir);
  out << ",\"restart_count\":" << restarts.size() << ",\"restarts\":[";
  for (size_t i = 0; i < restarts.size(); ++i) out << (i ? "," : "") << restarts[i];
  out << "]}\n";
  replace_file_synced(out_dir + "/summary.json", out.str());
}

}  // namespace kiln
