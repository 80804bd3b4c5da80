// TokenShard: one file of uint16 token ids, memory-mapped read-only. Two formats are read,
// detected by header: llm.c's (256 x int32 header: magic 20240520, version 1, token count; then
// the tokens) and nanoGPT's raw .bin (tokens only). A file is llm.c format exactly when it is at
// least 1024 bytes long and its first int32 is the magic; anything else is raw. Every check
// (size, header, token id < vocab) happens once at open(), so a bad shard is an InputError that
// names the file, never a crash mid-training. write_shard() writes llm.c format atomically.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kiln {

constexpr int32_t kShardMagic = 20240520;
constexpr int32_t kShardVersion = 1;
constexpr int64_t kShardHeaderInts = 256;
constexpr int64_t kShardHeaderBytes = kShardHeaderInts * 4;

class TokenShard {
 public:
  // Maps `path` and checks its format and that every token id is < vocab_size.
  static TokenShard open(const std::string& path, int vocab_size);

  TokenShard(TokenShard&& other) noexcept;
  TokenShard& operator=(TokenShard&& other) noexcept;
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;
  ~TokenShard();

  const uint16_t* tokens() const { return tokens_; }
  int64_t size() const { return size_; }
  const std::string& path() const { return path_; }
  bool llmc_format() const { return llmc_format_; }

 private:
  TokenShard() = default;
  void unmap();

  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const uint16_t* tokens_ = nullptr;
  int64_t size_ = 0;
  bool llmc_format_ = false;
};

// Writes `tokens` to `path` in llm.c format: a temp file in the same directory, fsync, rename,
// so a reader never sees a half-written shard.
void write_shard(const std::string& path, const std::vector<uint16_t>& tokens);

// The files matching a glob(3) pattern, sorted. InputError when none match.
std::vector<std::string> expand_glob(const std::string& pattern);

}  // namespace kiln
