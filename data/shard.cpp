// TokenShard: mmap, format detection and validation; write_shard; expand_glob. See shard.h.
// The token-id scan is an OpenMP max-reduction (memory bound, one pass); only when it fails do
// we walk again serially to report the FIRST offending index.
#include "data/shard.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <new>
#include <utility>

#include "base/error.h"
#include "base/input_file.h"

namespace kiln {
namespace {

[[noreturn]] void fail_errno(const std::string& path, const char* what) {
  throw InputError(fmt::format("{}: {}: {}", path, what, std::strerror(errno)));
}

// Closes a file descriptor on every exit path.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

void write_all(int fd, const void* data, size_t bytes, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    ssize_t n = ::write(fd, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail_errno(path, "write failed");
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

template <class Token>
void check_token_ids(const TokenShard& shard, const Token* tokens, int vocab_size) {
  const int64_t n = shard.size();
  int64_t max_id = 0;
#pragma omp parallel for reduction(max : max_id) schedule(static)
  for (int64_t i = 0; i < n; ++i) max_id = std::max(max_id, static_cast<int64_t>(tokens[i]));
  if (max_id < vocab_size) return;
  for (int64_t i = 0; i < n; ++i) {
    if (static_cast<int64_t>(tokens[i]) >= vocab_size) {
      throw InputError(fmt::format("{}: token id {} at index {} is out of range for vocab_size {}",
                                   shard.path(), tokens[i], i, vocab_size));
    }
  }
}

}  // namespace

TokenShard TokenShard::open(const std::string& path, int vocab_size) {
  TokenShard shard;
  shard.path_ = path;
  const InputFile file(path, "shard");  // a FIFO, a directory: refused, not a hang
  const int64_t file_bytes = file.size();
  if (file_bytes == 0) throw InputError(fmt::format("{}: shard is empty (0 bytes)", path));

  void* map = ::mmap(nullptr, static_cast<size_t>(file_bytes), PROT_READ, MAP_SHARED, file.fd(), 0);
  if (map == MAP_FAILED) fail_errno(path, "mmap failed");
  shard.map_ = map;
  shard.map_bytes_ = static_cast<size_t>(file_bytes);

  const auto* header = static_cast<const int32_t*>(map);
  if (file_bytes >= kShardHeaderBytes &&
      (header[0] == kShardMagic || header[0] == kShardMagicU32)) {
    const bool wide = header[0] == kShardMagicU32;
    const int32_t version = wide ? kShardVersionU32 : kShardVersion;
    if (header[1] != version) {
      throw InputError(fmt::format("{}: llm.c shard (magic {}) has version {}, expected {}", path,
                                   header[0], header[1], version));
    }
    shard.token_bytes_ = wide ? 4 : 2;
    const int64_t count = header[2];
    const int64_t expect_bytes = count * shard.token_bytes_ + kShardHeaderBytes;
    if (count < 0 || expect_bytes != file_bytes) {
      throw InputError(fmt::format("{}: header declares {} tokens ({} bytes) but file has {} bytes",
                                   path, count, expect_bytes, file_bytes));
    }
    shard.llmc_format_ = true;
    shard.size_ = count;
    shard.tokens_ = header + kShardHeaderInts;
  } else {
    // A header that is llm.c's in every field but the magic (version 1, a token count that
    // matches the file size) is a damaged llm.c shard, not raw tokens that happen to fit.
    if (file_bytes >= kShardHeaderBytes && header[1] == kShardVersion && header[2] > 0 &&
        static_cast<int64_t>(header[2]) * 2 + kShardHeaderBytes == file_bytes) {
      throw InputError(fmt::format("{}: bad magic {} in an llm.c shard header (expected {})", path,
                                   header[0], kShardMagic));
    }
    if (file_bytes % 2 != 0) {
      throw InputError(
          fmt::format("{}: raw token file has an odd size ({} bytes); expected whole uint16 tokens",
                      path, file_bytes));
    }
    shard.size_ = file_bytes / 2;
    shard.tokens_ = map;
  }
  // Training walks the shard front to back, window by window.
  ::madvise(map, shard.map_bytes_, MADV_SEQUENTIAL);
  if (shard.token_bytes_ == 2)
    check_token_ids(shard, shard.tokens(), vocab_size);
  else
    check_token_ids(shard, shard.tokens32(), vocab_size);
  return shard;
}

TokenShard::TokenShard(TokenShard&& other) noexcept {
  *this = std::move(other);
}

TokenShard& TokenShard::operator=(TokenShard&& other) noexcept {
  if (this != &other) {
    unmap();
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    tokens_ = std::exchange(other.tokens_, nullptr);
    size_ = std::exchange(other.size_, 0);
    llmc_format_ = other.llmc_format_;
    token_bytes_ = other.token_bytes_;
  }
  return *this;
}

TokenShard::~TokenShard() {
  unmap();
}

void TokenShard::unmap() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
  map_ = nullptr;
  map_bytes_ = 0;
}

namespace {

template <class Token>
void write_llmc_shard(const std::string& path, const std::vector<Token>& tokens) {
  if (tokens.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    throw InputError(
        fmt::format("{}: {} tokens do not fit an llm.c header (int32 count)", path, tokens.size()));
  }
  int32_t header[kShardHeaderInts] = {};
  header[0] = sizeof(Token) == 2 ? kShardMagic : kShardMagicU32;
  header[1] = sizeof(Token) == 2 ? kShardVersion : kShardVersionU32;
  header[2] = static_cast<int32_t>(tokens.size());

  std::string tmp = path + ".tmp.XXXXXX";
  Fd file{::mkstemp(tmp.data())};
  if (file.fd < 0) fail_errno(path, "cannot create temp file");
  try {
    write_all(file.fd, header, sizeof(header), tmp);
    write_all(file.fd, tokens.data(), tokens.size() * sizeof(Token), tmp);
    if (::fchmod(file.fd, 0644) != 0) fail_errno(tmp, "chmod failed");
    if (::fsync(file.fd) != 0) fail_errno(tmp, "fsync failed");
    if (::close(std::exchange(file.fd, -1)) != 0) fail_errno(tmp, "close failed");
    if (::rename(tmp.c_str(), path.c_str()) != 0) fail_errno(path, "rename failed");
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  // Make the rename itself durable.
  const size_t slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash + 1);
  Fd dir_fd{::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
  if (dir_fd.fd >= 0) ::fsync(dir_fd.fd);
}

}  // namespace

void write_shard(const std::string& path, const std::vector<uint16_t>& tokens) {
  write_llmc_shard(path, tokens);
}

void write_shard32(const std::string& path, const std::vector<uint32_t>& tokens) {
  write_llmc_shard(path, tokens);
}

std::vector<std::string> expand_glob(const std::string& pattern) {
  glob_t g{};
  const int rc = ::glob(pattern.c_str(), 0, nullptr, &g);
  std::vector<std::string> paths;
  if (rc == 0) paths.assign(g.gl_pathv, g.gl_pathv + g.gl_pathc);
  ::globfree(&g);
  if (rc == GLOB_NOSPACE) throw std::bad_alloc();
  if (paths.empty()) throw InputError(fmt::format("no files match '{}'", pattern));
  std::sort(paths.begin(), paths.end());
  return paths;
}

}  // namespace kiln
