// Helpers for tests that drive kiln's real binaries: run a command and collect its output and
// exit status (or start it in the background and wait for it), read the losses a run wrote to
// metrics.jsonl, shard a small English corpus, and make temp directories that are gone when the
// test process ends.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

namespace kiln::testing {

// A new directory `<test temp dir>/<prefix>XXXXXX`, removed with all it holds when this process
// exits normally (ctest runs each test in a process of its own, so a `make test` leaves nothing
// behind). A forked child that exits leaves it alone.
inline std::string make_temp_dir(const std::string& prefix) {
  struct RemoveAtExit {
    pid_t owner = ::getpid();
    std::vector<std::string> dirs;
    ~RemoveAtExit() {
      if (::getpid() != owner) return;
      std::error_code ec;
      for (const std::string& d : dirs) std::filesystem::remove_all(d, ec);
    }
  };
  static RemoveAtExit cleanup;
  std::string path = ::testing::TempDir() + prefix + "XXXXXX";
  if (::mkdtemp(path.data()) == nullptr) throw std::runtime_error("mkdtemp " + path + " failed");
  cleanup.dirs.push_back(path);
  return path;
}

struct CommandResult {
  int status;          // exit status, or 128 + signal
  std::string output;  // stdout and stderr together
};

inline CommandResult run_command(const std::string& cmd) {
  CommandResult r{-1, {}};
  std::FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, n);
  const int st = ::pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return r;
}

// A command running in the background, in a process group of its own, its stdout and stderr
// going to `log_path`: for tests that signal a run while it trains.
struct Background {
  pid_t pid = -1;
  std::string log_path;
};

inline Background start_command(const std::string& cmd, const std::string& log_path) {
  Background b{-1, log_path};
  const std::string line = "exec " + cmd + " >'" + log_path + "' 2>&1";  // before fork()
  b.pid = ::fork();
  if (b.pid == 0) {
    ::setpgid(0, 0);
    ::execl("/bin/sh", "sh", "-c", line.c_str(), nullptr);
    ::_exit(127);
  }
  return b;
}

// Waits up to `within` for it to exit and returns its status (128 + signal for a signal); at the
// deadline kills its process group and returns -1.
inline int wait_command(const Background& b, std::chrono::steady_clock::duration within) {
  const auto deadline = std::chrono::steady_clock::now() + within;
  int st = 0;
  pid_t done = 0;
  while ((done = ::waitpid(b.pid, &st, WNOHANG)) == 0 &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  if (done != b.pid) {
    ::kill(-b.pid, SIGKILL);
    ::waitpid(b.pid, &st, 0);
    return -1;
  }
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

// Its status (128 + signal for a signal) if it has exited, else -1 at once.
inline int poll_command(const Background& b) {
  int st = 0;
  if (::waitpid(b.pid, &st, WNOHANG) != b.pid) return -1;
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

// The processes whose parent is `parent` (from /proc).
inline std::vector<pid_t> children_of(pid_t parent) {
  std::vector<pid_t> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(e.path() / "stat");
    std::string text;
    std::getline(stat, text);
    const auto close = text.rfind(')');
    if (close == std::string::npos) continue;
    char state;
    int ppid = 0;
    if (std::sscanf(text.c_str() + close + 2, "%c %d", &state, &ppid) == 2 && ppid == parent)
      out.push_back(std::stoi(name));
  }
  return out;
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

struct StepLoss {
  int step;
  std::string text;  // as written, to compare bit for bit
  double value;
};

// The per-step losses in out_dir/metrics.jsonl, in file order.
inline std::vector<StepLoss> read_losses(const std::string& out_dir) {
  std::vector<StepLoss> out;
  std::ifstream in(out_dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    const auto s = line.find("\"step\":"), l = line.find("\"loss\":");
    if (s == std::string::npos || l == std::string::npos) continue;
    const std::string text = line.substr(l + 7, line.find(',', l) - l - 7);
    out.push_back({std::atoi(line.c_str() + s + 7), text, std::atof(text.c_str())});
  }
  return out;
}

// (step, loss as written) of each step in out_dir/metrics.jsonl: equal lists are equal runs, bit
// for bit.
inline std::vector<std::pair<int, std::string>> losses_as_written(const std::string& out_dir) {
  std::vector<std::pair<int, std::string>> v;
  for (const StepLoss& l : read_losses(out_dir)) v.emplace_back(l.step, l.text);
  return v;
}

// One number of each training step's line in `out_dir`/metrics.jsonl (e.g. "grad_norm").
inline std::vector<double> read_metric(const std::string& out_dir, const std::string& key) {
  std::vector<double> out;
  std::ifstream in(out_dir + "/metrics.jsonl");
  const std::string field = "\"" + key + "\":";
  std::string line;
  while (std::getline(in, line)) {
    const auto k = line.find(field);
    if (line.find("\"step\":") == std::string::npos || k == std::string::npos) continue;
    out.push_back(std::atof(line.c_str() + k + field.size()));
  }
  return out;
}

// prepare_data on the GPL text every Debian system ships (else this repo's README) into `dir`.
inline CommandResult prepare_corpus(const std::string& bin_dir, const std::string& source_dir,
                                    const std::string& dir) {
  std::string corpus = "/usr/share/common-licenses/GPL-3";
  if (!std::filesystem::exists(corpus)) corpus = source_dir + "/README.md";
  return run_command(bin_dir + "/prepare_data --out " + dir + " --val-fraction 0.1 " + corpus);
}

// The value of variable `name` in process `pid`'s environment ("" if absent).
inline std::string environment_of(pid_t pid, const std::string& name) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/environ");
  std::string entry;
  while (std::getline(in, entry, '\0'))
    if (entry.rfind(name + "=", 0) == 0) return entry.substr(name.size() + 1);
  return "";
}

}  // namespace kiln::testing
