#include "base/durable_write.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <utility>

#include "base/error.h"

namespace kiln {
namespace {

[[noreturn]] void fail_io(const std::string& what, const std::string& path) {
  throw std::runtime_error(what + " " + path + ": " + std::strerror(errno));
}

}  // namespace

void fsync_path(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) fail_io("cannot open", path);
  if (::fsync(fd) != 0) {
    ::close(fd);
    fail_io("cannot fsync", path);
  }
  ::close(fd);
}

void write_file_synced(const std::string& path,
                       const std::vector<std::pair<const void*, size_t>>& parts) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) fail_io("cannot create", path);
  for (const auto& [data, n] : parts) {
    if (n && std::fwrite(data, 1, n, f) != n) {
      std::fclose(f);
      fail_io("cannot write", path);
    }
  }
  if (std::fflush(f) != 0 || ::fsync(::fileno(f)) != 0) {
    std::fclose(f);
    fail_io("cannot flush", path);
  }
  std::fclose(f);
}

void replace_file_synced(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  try {
    write_file_synced(tmp, {{text.data(), text.size()}});
  } catch (...) {
    std::error_code ec;
    std::filesystem::remove(tmp, ec);
    throw;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) fail_io("cannot rename into place", path);
}

void replace_output_file(const std::string& flag, const std::string& path,
                         const std::string& text) {
  try {
    replace_file_synced(path, text);
  } catch (const std::exception& e) {
    throw InputError(flag + ": " + e.what());
  }
}

namespace {

// Writes all of `record` at `offset`; on failure cuts the file back to `offset` (so no part of
// the record stays) and returns the errno.
int write_whole(int fd, off_t offset, const std::string& record) {
  size_t done = 0;
  while (done < record.size()) {
    const ssize_t n =
        ::pwrite(fd, record.data() + done, record.size() - done, offset + static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : ENOSPC;
      while (::ftruncate(fd, offset) != 0 && errno == EINTR) {
      }
      return err;
    }
    done += static_cast<size_t>(n);
  }
  return 0;
}

}  // namespace

AppendLog::AppendLog(std::string path, std::string what, bool truncate)
    : path_(std::move(path)), what_(std::move(what)) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | (truncate ? O_TRUNC : 0), 0644);
  if (fd_ < 0)
    throw InputError(what_ + ": cannot open " + path_ + " for writing: " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    const int err = S_ISREG(st.st_mode) ? errno : 0;
    ::close(fd_);
    fd_ = -1;
    throw InputError(what_ + ": " + path_ + (err ? ": " + std::string(std::strerror(err)) : "") +
                     ": not a regular file");
  }
  size_ = st.st_size;
}

AppendLog::~AppendLog() {
  if (fd_ < 0) return;
  if ((!held_.empty() && !write_held()) || dropped_ > 0)
    spdlog::error("{}: {} records never reached {}: {}", what_, held_.size() + dropped_, path_,
                  std::strerror(error_));
  ::close(fd_);
}

bool AppendLog::write_held() {
  const size_t before = held_.size();
  while (!held_.empty()) {
    if ((error_ = write_whole(fd_, size_, held_.front())) != 0) return false;
    size_ += static_cast<off_t>(held_.front().size());
    held_bytes_ -= held_.front().size();
    held_.pop_front();
  }
  if (before) spdlog::info("{}: {} held records written to {}", what_, before, path_);
  return true;
}

void AppendLog::append(std::string record) {
  if (held_.empty() || write_held()) {
    if ((error_ = write_whole(fd_, size_, record)) == 0) {
      size_ += static_cast<off_t>(record.size());
      return;
    }
  }
  if (!warned_)
    spdlog::warn(
        "{}: writing {} failed ({}); its records are held in memory (up to {} MiB) "
        "and written once the disk takes them",
        what_, path_, std::strerror(error_), kMaxHeldBytes >> 20);
  warned_ = true;
  if (held_bytes_ + record.size() > kMaxHeldBytes) {
    ++dropped_;
    return;
  }
  held_bytes_ += record.size();
  held_.push_back(std::move(record));
}

void AppendLog::finish() {
  if (!held_.empty()) write_held();
  if (!held_.empty() || dropped_ > 0) {
    const std::string lost = std::to_string(held_.size() + dropped_);
    held_.clear();  // reported here, not again by the destructor
    dropped_ = held_bytes_ = 0;
    throw InputError(what_ + ": " + lost + " records not written to " + path_ + ": " +
                     std::strerror(error_));
  }
  if (::fsync(fd_) != 0 && errno != EINVAL)
    throw InputError(what_ + ": cannot fsync " + path_ + ": " + std::strerror(errno));
}

}  // namespace kiln
