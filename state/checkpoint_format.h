// The optimizer shard files' format, shared by the writer (state/checkpoint.cpp) and the reader
// (state/checkpoint_read.cpp): the header, the checksum, the file names and how a file's part of
// the global buffer is named in errors. Not an interface: state/checkpoint.h is.
#pragma once

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

#include "state/checkpoint.h"

namespace kiln::checkpoint_format {

constexpr char kShardMagic[8] = {'K', 'I', 'L', 'N', 'S', 'H', 'R', 'D'};
// Version 3 (written): a shard file may hold a strided piece, and its header says so (run, runs,
// stride); a tensor-parallel rank writes a file per piece, not per run. Version 2: the optimizer
// shards' checksum is ShardChecksum's four lanes, every file a range. Version 1: byte-wise
// FNV-1a. All three are read.
constexpr uint32_t kFormatVersion = 3;

struct ShardHeader {
  char magic[8];
  uint32_t version;
  uint32_t reserved;
  int64_t begin;
  int64_t end;
  int64_t run, runs, stride;  // version 3 on
};

// The header as version `version` writes it: versions 1 and 2 end at `end`.
inline size_t header_bytes(uint32_t version) {
  return version >= 3 ? sizeof(ShardHeader) : offsetof(ShardHeader, run);
}

// The files' checksum (model/param_layout.h), continuing from `h`.
inline uint64_t fnv1a(uint64_t h, const void* data, size_t n) {
  return fnv1a_bytes(data, n, h);
}
constexpr uint64_t kFnvSeed = 14695981039346656037ull;

// An optimizer shard file's checksum, streamed. Version 1: FNV-1a over the bytes, serial at
// ~0.5-0.7 GB/s, which made hashing most of an 8B checkpoint's write and read. Version 2: four
// independent lanes over 8-byte words, each step xxHash64's round (add the word times a prime,
// rotate, multiply), merged and avalanched at the end with the length and the odd bytes:
// ~9x faster (4.8 against 0.52 GB/s on one core of the 2-core build machine). It guards
// against corruption and truncation, not adversaries.
class ShardChecksum {
 public:
  explicit ShardChecksum(uint32_t version) : version_(version) {}
  void update(const void* data, size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    if (version_ == 1) {
      fnv_ = fnv1a(fnv_, p, n);
      return;
    }
    total_ += n;
    if (pending_ > 0) {
      const size_t take = std::min(n, kBlock - pending_);
      std::memcpy(tail_ + pending_, p, take);
      pending_ += take, p += take, n -= take;
      if (pending_ < kBlock) return;
      block(tail_);
      pending_ = 0;
    }
    for (; n >= kBlock; p += kBlock, n -= kBlock) block(p);
    std::memcpy(tail_, p, n);
    pending_ = n;
  }
  uint64_t value() const {
    if (version_ == 1) return fnv_;
    uint64_t h = rotl(lane_[0], 1) + rotl(lane_[1], 7) + rotl(lane_[2], 12) + rotl(lane_[3], 18);
    h ^= total_;
    for (size_t i = 0; i < pending_; ++i) h = (h ^ tail_[i]) * kP1;
    h ^= h >> 33;
    h *= kP2;
    h ^= h >> 29;
    h *= kP3;
    return h ^ (h >> 32);
  }

 private:
  static constexpr size_t kBlock = 32;
  static constexpr uint64_t kP1 = 11400714785074694791ull, kP2 = 14029467366897019727ull,
                            kP3 = 1609587929392839161ull;
  static uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
  void block(const unsigned char* p) {
    uint64_t w[4];
    std::memcpy(w, p, sizeof w);
    for (int l = 0; l < 4; ++l) lane_[l] = rotl(lane_[l] + w[l] * kP2, 31) * kP1;
  }
  uint32_t version_;
  uint64_t fnv_ = kFnvSeed;
  uint64_t lane_[4] = {kFnvSeed + kP1 + kP2, kFnvSeed + kP2, kFnvSeed, kFnvSeed - kP1};
  unsigned char tail_[kBlock] = {};
  size_t pending_ = 0;
  uint64_t total_ = 0;
};

constexpr const char* kFp8File = "fp8_state.bin";
constexpr const char* kMoeBiasFile = "moe_bias.bin";

inline std::string step_name(int step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08d", step);
  return buf;
}

inline std::string shard_file(int rank, size_t part) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "rank_%05d_%03zu.bin", rank, part);
  return buf;
}

// A rank's marker in the .tmp directory: `.done` lists its files, `.failed` says why there are
// none.
inline std::string rank_marker(int rank, const char* suffix) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "rank_%05d.%s", rank, suffix);
  return buf;
}

inline std::string range_text(int64_t begin, int64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + ")";
}
// A file's part of the global buffer, as the manifest gives it.
inline std::string part_text(int64_t begin, int64_t end, int64_t run, int64_t runs,
                             int64_t stride) {
  std::string text = range_text(begin, end);
  if (runs > 1)
    text += " in " + std::to_string(runs) + " runs of " + std::to_string(run) + " every " +
            std::to_string(stride);
  return text;
}
inline std::string file_range(const CheckpointFile& f) {
  return f.file + " " + part_text(f.begin, f.end, f.run, f.runs, f.stride);
}

// Floor division for a positive divisor.
inline int64_t floor_div(int64_t a, int64_t b) {
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}

[[noreturn]] inline void fail_io(const std::string& what, const std::string& path) {
  throw std::runtime_error(what + " " + path + ": " + std::strerror(errno));
}


}  // namespace kiln::checkpoint_format
