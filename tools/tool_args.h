// The command line that the model tools share (convert, eval): positional arguments, then flags
// as `--flag value` or `--flag=value`, and -h/--help for the usage. Each tool reads its flags by
// name afterwards, so one refusing an unknown flag, or a wrong value, names the flag.
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kernels/error.h"

namespace kiln {

struct ToolArgs {
  std::vector<std::string> positional;
  std::vector<std::pair<std::string, std::string>> flags;  // (--name, value) in the order given
};

// nullopt once -h/--help has printed `usage`. InputError for a positional argument past
// `max_positional` or a flag without its value.
inline std::optional<ToolArgs> parse_tool_args(int argc, char** argv, const char* usage,
                                               size_t max_positional) {
  ToolArgs args;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i], value;
    if (arg == "-h" || arg == "--help") {
      std::printf("%s", usage);
      return std::nullopt;
    }
    if (arg.rfind("--", 0) != 0) {
      if (args.positional.size() == max_positional)
        throw InputError("unexpected argument '" + arg + "'\n" + usage);
      args.positional.push_back(arg);
      continue;
    }
    const size_t eq = arg.find('=');
    if (eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      throw InputError(arg + ": missing value");
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
  throw InputError(flag + ": expected an integer >= " + std::to_string(lo) + ", got '" + text +
                   "'");
}

}  // namespace kiln
