#include "base/test_faults.h"

#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "base/error.h"

namespace kiln {
namespace {

int field_int(const std::string& text, const std::string& key, const std::string& value) {
  char* end = nullptr;
  const long v = std::strtol(value.c_str(), &end, 10);
  if (value.empty() || *end != '\0' || v < 0 || v > 1 << 30)
    throw InputError("KILN_FAULT='" + text + "': " + key +
                     " must be a non-negative integer, got '" + value + "'");
  return static_cast<int>(v);
}

}  // namespace

Fault parse_fault(const std::string& text) {
  Fault f;
  bool rank = false, step = false;
  std::istringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    const size_t eq = item.find('=');
    const std::string key = item.substr(0, eq),
                      value = eq == std::string::npos ? "" : item.substr(eq + 1);
    if (key == "rank") {
      f.rank = field_int(text, key, value);
      rank = true;
    } else if (key == "step") {
      f.step = field_int(text, key, value);
      step = true;
    } else if (key == "restart") {
      f.generation = value == "any" ? -1 : field_int(text, key, value);
    } else {
      throw InputError("KILN_FAULT='" + text + "': unknown field '" + item +
                       "' (expected rank=R,step=S[,restart=G|any])");
    }
  }
  if (!rank || !step) throw InputError("KILN_FAULT='" + text + "': needs rank=R and step=S");
  return f;
}

namespace test_faults {

void after_step(int rank, int step) {
  static const std::optional<Fault> fault = []() -> std::optional<Fault> {
    const char* text = std::getenv("KILN_FAULT");
    if (text == nullptr || *text == '\0') return std::nullopt;
    return parse_fault(text);
  }();
  if (!fault || fault->rank != rank || fault->step != step) return;
  const char* g = std::getenv("KILN_RESTART_GENERATION");
  const int generation = g ? std::atoi(g) : 0;
  if (fault->generation >= 0 && fault->generation != generation) return;
  spdlog::error("KILN_FAULT: rank {} kills itself after step {} (generation {})", rank, step,
                generation);
  ::kill(::getpid(), SIGKILL);
}

void checkpoint_files_written(int step, int rank) {
  static const char* const spec = std::getenv("KILN_TEST_CHECKPOINT_CRASH");
  int at_step = -1, at_rank = -1;
  char mode[8] = "";
  if (!spec || std::sscanf(spec, "%d:%d:%7s", &at_step, &at_rank, mode) < 2 || at_step != step ||
      at_rank != rank)
    return;
  if (std::strcmp(mode, "fail") == 0)
    throw std::runtime_error("KILN_TEST_CHECKPOINT_CRASH: rank " + std::to_string(rank) +
                             "'s write failed");
  std::raise(SIGKILL);
}

bool break_capture() {
  static const bool on = std::getenv("KILN_TEST_BREAK_CAPTURE") != nullptr;
  return on;
}

}  // namespace test_faults
}  // namespace kiln
