// The command line that the model tools share (convert, eval, sample): positional arguments, then
// flags as `--flag value` or `--flag=value` (a switch alone means true), and -h/--help for the
// usage. Each tool reads its flags by name afterwards, so one refusing an unknown flag, or a
// wrong value, names the flag. Errors are one line; the usage is printed only when asked for.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "base/error.h"

namespace kiln {

struct ToolArgs {
  std::vector<std::string> positional;
  std::vector<std::pair<std::string, std::string>> flags;  // (--name, value) in the order given
};

// nullopt once -h/--help has printed `usage`. InputError for a positional argument past
// `max_positional` or a flag without its value. `switches` take no value unless given one with =.
inline std::optional<ToolArgs> parse_tool_args(int argc, char** argv, const char* usage,
                                               size_t max_positional,
                                               std::initializer_list<const char*> switches = {}) {
  ToolArgs args;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i], value;
    if (arg == "-h" || arg == "--help") {
      std::printf("%s", usage);
      return std::nullopt;
    }
    if (arg.rfind("--", 0) != 0) {
      if (args.positional.size() == max_positional)
        throw InputError("unexpected argument '" + arg + "' (--help for the usage)");
      args.positional.push_back(arg);
      continue;
    }
    const size_t eq = arg.find('=');
    if (eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    } else if (std::find(switches.begin(), switches.end(), arg) != switches.end()) {
      value = "true";
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      // Flags are known only to the tool that reads them: a last `--flag` may be a typo.
      throw InputError(arg + ": missing value (or an unknown flag: --help lists them)");
    }
    args.flags.emplace_back(arg, value);
  }
  return args;
}

// A flag's integer value, at least `lo`.
inline int parse_int_flag(const std::string& flag, const std::string& text, int lo) {
  try {
    size_t used = 0;
    const long v = std::stol(text, &used);
    if (used == text.size() && v >= lo && v <= INT32_MAX) return static_cast<int>(v);
  } catch (const std::exception&) {
  }
  throw InputError(flag + " must be >= " + std::to_string(lo) + " and a whole number, got '" + text +
                   "'");
}

// A flag's unsigned 64-bit value (a seed): digits only, so "-1" and "2.5" are refused.
inline uint64_t parse_u64_flag(const std::string& flag, const std::string& text) {
  try {
    size_t used = 0;
    const unsigned long long v = std::stoull(text, &used);
    if (used == text.size() && text.find_first_not_of("0123456789") == std::string::npos)
      return static_cast<uint64_t>(v);
  } catch (const std::exception&) {
  }
  throw InputError(flag + " must be a whole number in [0, 2^64), got '" + text + "'");
}

// A flag's finite floating-point value.
inline double parse_float_flag(const std::string& flag, const std::string& text) {
  try {
    size_t used = 0;
    const double v = std::stod(text, &used);
    if (used == text.size() && std::isfinite(v)) return v;
  } catch (const std::exception&) {
  }
  throw InputError(flag + " must be a finite number, got '" + text + "'");
}

// Refuses an output path that cannot be written before a run spends time making the output: it
// is opened for appending (which changes nothing in a file that exists) and, if this made it,
// removed again.
inline void check_writable(const std::string& flag, const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw InputError(flag + " " + path + ": is a directory");
  const bool existed = std::filesystem::exists(path, ec);
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NONBLOCK, 0644);
  if (fd < 0)
    throw InputError(flag + " " + path + ": cannot be written (" + std::strerror(errno) + ")");
  ::close(fd);
  if (!existed) ::unlink(path.c_str());
}

}  // namespace kiln
