// Writes that a crash or a full disk cannot leave half done, the one way kiln writes a file it
// must not lose: a file replaced whole (written beside it, fsynced, renamed over it), and a log
// that grows by whole records (AppendLog: metrics.jsonl's lines, TensorBoard's events, bench's
// history).
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <deque>
#include <string>
#include <utility>
#include <vector>

namespace kiln {

// Writes `parts` to `path` (created or emptied) and fsyncs it; the caller renames it into place.
// std::runtime_error naming the file and the cause on any failure (a full disk).
void write_file_synced(const std::string& path,
                       const std::vector<std::pair<const void*, size_t>>& parts);
// fsync of a file or a directory (after a rename into it); std::runtime_error naming it.
void fsync_path(const std::string& path);
// Writes `text` to path.tmp, fsyncs it and renames it over `path`, so `path` holds either its
// old contents or the new ones, never a partial write: on a full disk it is left as it was and
// std::runtime_error names the file and the cause.
void replace_file_synced(const std::string& path, const std::string& text);
// The same for a file a tool's flag names (`flag`: "--json"), failing with InputError.
void replace_output_file(const std::string& flag, const std::string& path, const std::string& text);

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
