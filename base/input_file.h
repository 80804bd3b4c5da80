// A file that input names (a token shard, a safetensors file, a checkpoint's manifest, shards and
// state files), opened for reading. The open is O_NONBLOCK, so a FIFO cannot hang it waiting for
// a writer; then fstat refuses anything but a regular file (a FIFO, a directory, a device) with
// InputError "PATH: not a regular file". Every other failure is an InputError naming the path.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

#include "base/error.h"

namespace kiln {

class InputFile {
 public:
  // `what` names the file in the errors of open and stat ("cannot open shard: ...").
  InputFile(const std::string& path, const std::string& what) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd_ < 0) fail("cannot open " + what);
    struct stat st {};
    if (::fstat(fd_, &st) != 0) fail("cannot stat " + what);
    if (!S_ISREG(st.st_mode)) {
      ::close(fd_);
      throw InputError(path + ": not a regular file");
    }
    size_ = st.st_size;
  }
  ~InputFile() { ::close(fd_); }
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  int fd() const { return fd_; }
  int64_t size() const { return size_; }
  const std::string& path() const { return path_; }

  // The next `n` bytes into `dst`; false where the file ends first.
  bool read(void* dst, size_t n) {
    auto* p = static_cast<char*>(dst);
    while (n > 0) {
      const ssize_t got = ::read(fd_, p, n);
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) throw InputError(path_ + ": read failed: " + std::strerror(errno));
      if (got == 0) return false;
      p += got;
      n -= static_cast<size_t>(got);
    }
    return true;
  }
  // The rest of the file (its size at the open).
  std::string read_all() {
    std::string text(static_cast<size_t>(size_), '\0');
    if (!read(text.data(), text.size()))
      throw InputError(path_ + ": shorter than its size (changed while read)");
    return text;
  }

 private:
  [[noreturn]] void fail(const std::string& what) {
    const int err = errno;
    if (fd_ >= 0) ::close(fd_);
    throw InputError(path_ + ": " + what + ": " + std::strerror(err));
  }

  std::string path_;
  int fd_ = -1;
  int64_t size_ = 0;
};

}  // namespace kiln
