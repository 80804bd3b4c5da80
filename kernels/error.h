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
    std::fprintf(stderr, "%s: %s\n", tool, e.what());
    return kExitInputError;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: fatal: %s\n", tool, e.what());
    return 1;
  }
}

}  // namespace kiln
