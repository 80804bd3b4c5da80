// AppendLog: a file that grows by whole records (metrics.jsonl's lines, TensorBoard's events,
// bench's history), for logs a run must not lose to a full disk.
#pragma once

#include <sys/types.h>

#include <deque>
#include <string>

namespace kiln {

// A record is in the file whole or not at all: one that cannot be written (a full disk, EIO) is
// cut back off the file and held in memory, with every record after it, and written before the
// next record once the disk takes it again. The first failure is logged once (naming `what` and
// the file); finish() throws InputError naming the file if records are still held then.
// Held records are capped at kMaxHeldBytes: past that they are counted, not kept.
class AppendLog {
 public:
  // Opens (or creates) `path` for appending; `truncate`: empty it first. InputError naming
  // `what` and the path where it cannot.
  AppendLog(std::string path, std::string what, bool truncate = false);
  ~AppendLog();
  AppendLog(const AppendLog&) = delete;
  AppendLog& operator=(const AppendLog&) = delete;

  void append(std::string record);
  // Writes what is held, then fsyncs. InputError naming the file and the records not written.
  void finish();
  size_t held() const { return held_.size(); }
  const std::string& path() const { return path_; }

  static constexpr size_t kMaxHeldBytes = size_t{64} << 20;

 private:
  bool write_held();  // false: the first held record failed again

  std::string path_, what_;
  int fd_ = -1;
  off_t size_ = 0;  // the file's bytes: whole records only
  std::deque<std::string> held_;
  size_t held_bytes_ = 0;
  size_t dropped_ = 0;  // records past kMaxHeldBytes, lost
  int error_ = 0;       // errno of the last failed write
  bool warned_ = false;
};

}  // namespace kiln
