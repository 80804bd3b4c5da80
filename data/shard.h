// TokenShard: one file of token ids, memory-mapped read-only. Three formats are read, detected
// by header: llm.c's GPT-2 shards (256 x int32 header: magic 20240520, version 1, token count;
// then uint16 tokens), llm.c's LLaMA-3 shards (the same header with magic 20240801, version 7;
// then uint32 tokens: for vocabularies over 65,536) and nanoGPT's raw .bin (uint16 tokens only).
// A file is llm.c format exactly when it is at least 1024 bytes long and its first int32 is one
// of the magics; anything else is raw. Every check (size, header, token id < vocab) happens once
// at open(), so a bad shard is an InputError that names the file, never a crash mid-training.
// write_shard() and write_shard32() write llm.c's uint16 and uint32 formats atomically.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kiln {

constexpr int32_t kShardMagic = 20240520;
constexpr int32_t kShardVersion = 1;
constexpr int32_t kShardMagicU32 = 20240801;  // llm.c's LLaMA-3 shards: uint32 tokens
constexpr int32_t kShardVersionU32 = 7;
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

  // The ids: tokens() for 2-byte shards, tokens32() for 4-byte ones (the other is nullptr).
  const uint16_t* tokens() const { return token_bytes_ == 2 ? static_cast<const uint16_t*>(tokens_) : nullptr; }
  const uint32_t* tokens32() const { return token_bytes_ == 4 ? static_cast<const uint32_t*>(tokens_) : nullptr; }
  int token_bytes() const { return token_bytes_; }
  int64_t size() const { return size_; }
  const std::string& path() const { return path_; }
  bool llmc_format() const { return llmc_format_; }

 private:
  TokenShard() = default;
  void unmap();

  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const void* tokens_ = nullptr;
  int token_bytes_ = 2;
  int64_t size_ = 0;
  bool llmc_format_ = false;
};

// Writes `tokens` to `path` in llm.c format: a temp file in the same directory, fsync, rename,
// so a reader never sees a half-written shard.
void write_shard(const std::string& path, const std::vector<uint16_t>& tokens);
// The same in llm.c's uint32 format (magic 20240801, version 7), for vocabularies over 65,536.
void write_shard32(const std::string& path, const std::vector<uint32_t>& tokens);

// The files matching a glob(3) pattern, sorted. InputError when none match.
std::vector<std::string> expand_glob(const std::string& pattern);

}  // namespace kiln
