// InputError: bad input from the user (a config key, a flag, a shard, a checkpoint, a peer).
// `train` and the tools print its message on one line and exit with status 2; anything else
// that escapes is a bug (status 1). Messages name the thing at fault: the file, the key, the rank.
#pragma once

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>

namespace kiln {

struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

constexpr int kExitInputError = 2;

// `message` on one line: a newline or other control byte a user's input carried into it (a YAML
// value, a file name) is written as an escape, so an error stays one line a log can grep.
inline std::string one_line(const char* message) {
  const char* end = message + std::strlen(message);
  while (end > message && (end[-1] == '\n' || end[-1] == ' ')) --end;  // a trailing newline goes
  std::string out;
  for (const char* p = message; p < end; ++p) {
    const auto c = static_cast<unsigned char>(*p);
    if (c == '\n') {
      out += "\\n";
    } else if ((c < 0x20 && c != '\t') || c == 0x7f) {
      char escaped[5];
      std::snprintf(escaped, sizeof escaped, "\\x%02x", c);
      out += escaped;
    } else {
      out += *p;
    }
  }
  return out;
}

// The one way a kiln binary ends on an exception: bad input prints "TOOL: message" and exits 2;
// anything else is a bug, printed as "TOOL: fatal: message", exit 1. Output on stdout that did
// not reach its file (`sample > out.txt` on a full disk) is bad input too.
inline int run_tool(const char* tool, const std::function<int()>& body) {
  try {
    const int status = body();
    if (std::fflush(stdout) != 0 || std::ferror(stdout))
      throw InputError(std::string("cannot write standard output: ") + std::strerror(errno));
    return status;
  } catch (const InputError& e) {
    std::fprintf(stderr, "%s: %s\n", tool, one_line(e.what()).c_str());
    return kExitInputError;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: fatal: %s\n", tool, one_line(e.what()).c_str());
    return 1;
  }
}

}  // namespace kiln
