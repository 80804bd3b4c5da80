// InputError: bad input from the user (a config key, a flag, a shard, a checkpoint, a peer).
// `train` and the tools print its message on one line and exit with status 2; anything else
// that escapes is a bug (status 1). Messages name the thing at fault: the file, the key, the rank.
#pragma once

#include <stdexcept>
#include <string>

namespace kiln {

struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

constexpr int kExitInputError = 2;

}  // namespace kiln
