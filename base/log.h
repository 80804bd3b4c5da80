// kiln's log lines: one format for every binary, "[12:34:56] info message" (a training worker
// adds its rank). A tool's stdout is its data (sample's text, eval's JSON, bench's and
// comm_bench's tables), so its log lines go to stderr: `sample ... > out.txt` holds the text
// alone. train's step lines are its output and stay on stdout, except under --print-config,
// whose stdout is the YAML.
#pragma once

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <memory>
#include <utility>

namespace kiln {

inline constexpr const char* kLogPattern = "[%H:%M:%S] %^%l%$ %v";

// From here on, log lines go to stderr in kiln's format, at the level already set.
inline void log_to_stderr() {
  auto logger = std::make_shared<spdlog::logger>(
      "kiln", std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
  logger->set_level(spdlog::default_logger()->level());
  spdlog::set_default_logger(std::move(logger));
  spdlog::set_pattern(kLogPattern);
}

}  // namespace kiln
