// TokenShard, write_shard, expand_glob: both formats round-trip, and every corrupt input is an
// InputError whose message names the file.
#include "data/shard.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "base/error.h"
#include "tests/input_error.h"
#include "tests/test_process.h"

namespace kiln {
namespace {

std::string make_temp_dir() {
  return kiln::testing::make_temp_dir("kiln_shard_");
}

void write_bytes(const std::string& path, const void* data, size_t bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
}

using kiln::testing::input_error;

std::vector<uint16_t> iota_tokens(size_t n, int vocab) {
  std::vector<uint16_t> t(n);
  for (size_t i = 0; i < n; ++i)
    t[i] = static_cast<uint16_t>((i * 7 + 3) % static_cast<size_t>(vocab));
  return t;
}

TEST(ShardTest, LlmcRoundTrip) {
  const std::string path = make_temp_dir() + "/a.bin";
  const std::vector<uint16_t> tokens = iota_tokens(5000, 50257);
  write_shard(path, tokens);
  TokenShard shard = TokenShard::open(path, 50257);
  EXPECT_TRUE(shard.llmc_format());
  EXPECT_EQ(shard.path(), path);
  ASSERT_EQ(shard.size(), 5000);
  EXPECT_EQ(std::vector<uint16_t>(shard.tokens(), shard.tokens() + shard.size()), tokens);
}

// tools/random_shard.py (throughput runs without a dataset) writes a shard TokenShard reads, every
// token below its vocabulary; a second call keeps the shard; a bad count is one line, exit 2.
TEST(ShardTest, RandomShardPyWritesAShardThatOpens) {
  if (kiln::testing::run_command("python3 -c 'import numpy'").status != 0) {
    GTEST_SKIP() << "numpy missing for python3";
  }
  const std::string dir = make_temp_dir(), path = dir + "/random/train_000000.bin";
  const std::string tool = "python3 " + std::string(KILN_SOURCE_DIR) + "/tools/random_shard.py ";
  auto r = kiln::testing::run_command(tool + path + " 5000 300");
  ASSERT_EQ(r.status, 0) << r.output;
  TokenShard shard = TokenShard::open(path, 300);
  EXPECT_TRUE(shard.llmc_format());
  ASSERT_EQ(shard.size(), 5000);
  r = kiln::testing::run_command(tool + path + " 10 7");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("exists, kept"), std::string::npos) << r.output;
  EXPECT_EQ(TokenShard::open(path, 300).size(), 5000);
  r = kiln::testing::run_command(tool + dir + "/b.bin 10 70000 2>&1");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_EQ(r.output, "random_shard: vocab '70000': a whole number from 1 to 65536\n");
  EXPECT_FALSE(std::filesystem::exists(dir + "/b.bin"));
  // A flag is never taken for the shard's path (it once wrote 48 MB to a file named --help).
  r = kiln::testing::run_command("cd " + dir + " && " + tool + "--help");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("usage"), std::string::npos) << r.output;
  r = kiln::testing::run_command("cd " + dir + " && " + tool + "--tokens 10 2>&1");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_EQ(r.output, "random_shard: unknown option '--tokens'; usage: random_shard.py PATH "
                      "[tokens] [vocab]\n");
  EXPECT_FALSE(std::filesystem::exists(dir + "/--help"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/--tokens"));
}

TEST(ShardTest, RawRoundTrip) {
  const std::string path = make_temp_dir() + "/raw.bin";
  const std::vector<uint16_t> tokens = iota_tokens(777, 256);
  write_bytes(path, tokens.data(), tokens.size() * 2);
  TokenShard shard = TokenShard::open(path, 256);
  EXPECT_FALSE(shard.llmc_format());
  ASSERT_EQ(shard.size(), 777);
  EXPECT_EQ(std::vector<uint16_t>(shard.tokens(), shard.tokens() + shard.size()), tokens);
}

TEST(ShardTest, MovedShardKeepsItsMapping) {
  const std::string path = make_temp_dir() + "/a.bin";
  write_shard(path, iota_tokens(100, 256));
  std::vector<TokenShard> shards;
  shards.push_back(TokenShard::open(path, 256));
  shards.push_back(TokenShard::open(path, 256));
  EXPECT_EQ(shards[0].tokens()[99], iota_tokens(100, 256)[99]);
}

TEST(ShardTest, ForeignMagicIsReadAsRaw) {
  // A raw file whose first int32 looks like a header of another format is just tokens.
  // (Not 20240801: llm.c's LLaMA-3 magic is a format of its own, uint32 shards.)
  const std::string path = make_temp_dir() + "/raw.bin";
  std::vector<int32_t> words(512, 0);
  words[0] = 20240901;
  words[1] = 1;
  write_bytes(path, words.data(), words.size() * 4);
  TokenShard shard = TokenShard::open(path, 65536);
  EXPECT_FALSE(shard.llmc_format());
  EXPECT_EQ(shard.size(), 1024);
}

TEST(ShardTest, WrongMagicInAConsistentHeaderIsInputError) {
  const std::string path = make_temp_dir() + "/magic.bin";
  write_shard(path, iota_tokens(100, 256));
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    const int32_t magic = kShardMagic + 1;
    f.write(reinterpret_cast<const char*>(&magic), 4);
  }
  const std::string msg = input_error([&] { TokenShard::open(path, 256); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("magic"), std::string::npos) << msg;
}

TEST(ShardTest, ShortFileWithMagicIsRaw) {
  const std::string path = make_temp_dir() + "/raw.bin";
  const int32_t words[4] = {kShardMagic, 1, 2, 0};
  write_bytes(path, words, sizeof(words));
  TokenShard shard = TokenShard::open(path, 65536);
  EXPECT_FALSE(shard.llmc_format());
  EXPECT_EQ(shard.size(), 8);
}

TEST(ShardTest, TruncatedLlmcShardIsInputError) {
  const std::string path = make_temp_dir() + "/trunc.bin";
  write_shard(path, iota_tokens(100, 256));
  ASSERT_EQ(::truncate(path.c_str(), 1024 + 150), 0);
  const std::string msg = input_error([&] { TokenShard::open(path, 256); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("header declares 100 tokens (1224 bytes) but file has 1174 bytes"),
            std::string::npos)
      << msg;
}

TEST(ShardTest, WrongVersionIsInputError) {
  const std::string path = make_temp_dir() + "/v2.bin";
  std::vector<int32_t> words(256 + 8, 0);
  words[0] = kShardMagic;
  words[1] = 2;
  words[2] = 16;
  write_bytes(path, words.data(), words.size() * 4);
  const std::string msg = input_error([&] { TokenShard::open(path, 256); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("version 2"), std::string::npos) << msg;
}

TEST(ShardTest, OddSizeRawFileIsInputError) {
  const std::string path = make_temp_dir() + "/odd.bin";
  write_bytes(path, "abc", 3);
  const std::string msg = input_error([&] { TokenShard::open(path, 256); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("odd size"), std::string::npos) << msg;
}

TEST(ShardTest, EmptyFileIsInputError) {
  const std::string path = make_temp_dir() + "/empty.bin";
  write_bytes(path, "", 0);
  const std::string msg = input_error([&] { TokenShard::open(path, 256); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("empty"), std::string::npos) << msg;
}

TEST(ShardTest, MissingFileIsInputError) {
  const std::string path = make_temp_dir() + "/nope.bin";
  const std::string msg = input_error([&] { TokenShard::open(path, 256); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
}

// A FIFO given as a shard is refused at once; opening it for reading would wait for a writer.
TEST(ShardTest, FifoIsInputErrorNotAHang) {
  const std::string path = make_temp_dir() + "/fifo.bin";
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  const std::string msg = input_error([&] { TokenShard::open(path, 256); });
  EXPECT_NE(msg.find(path + ": not a regular file"), std::string::npos) << msg;
}

TEST(ShardTest, TokenOutOfVocabIsInputError) {
  const std::string path = make_temp_dir() + "/big.bin";
  std::vector<uint16_t> tokens(3000, 5);
  tokens[2345] = 300;
  tokens[2900] = 400;
  write_shard(path, tokens);
  const std::string msg = input_error([&] { TokenShard::open(path, 256); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("token id 300 at index 2345"), std::string::npos) << msg;
  EXPECT_NO_THROW(TokenShard::open(path, 401));
}

TEST(ShardTest, WriteShardIntoMissingDirIsInputError) {
  const std::string path = make_temp_dir() + "/no/such/dir/a.bin";
  const std::string msg = input_error([&] { write_shard(path, {1, 2, 3}); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
}

TEST(ShardTest, GlobIsSorted) {
  const std::string dir = make_temp_dir();
  for (const char* name : {"c.bin", "a.bin", "b.bin", "other.txt"})
    write_shard(dir + "/" + name, {1});
  EXPECT_EQ(expand_glob(dir + "/*.bin"),
            (std::vector<std::string>{dir + "/a.bin", dir + "/b.bin", dir + "/c.bin"}));
}

TEST(ShardTest, GlobMatchingNothingIsInputError) {
  const std::string pattern = make_temp_dir() + "/*.bin";
  const std::string msg = input_error([&] { expand_glob(pattern); });
  EXPECT_EQ(msg, "no files match '" + pattern + "'");
}

// Vocabularies over 65,536 (Qwen3's 151,936): llm.c's uint32 shards, magic 20240801 version 7.
TEST(ShardTest, Uint32RoundTrip) {
  const std::string path = make_temp_dir() + "/wide.bin";
  std::vector<uint32_t> tokens(3000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>(i * 7919 % 151936);
  write_shard32(path, tokens);
  const TokenShard shard = TokenShard::open(path, 151936);
  EXPECT_TRUE(shard.llmc_format());
  EXPECT_EQ(shard.token_bytes(), 4);
  EXPECT_EQ(shard.tokens(), nullptr);
  ASSERT_EQ(shard.size(), 3000);
  EXPECT_EQ(std::vector<uint32_t>(shard.tokens32(), shard.tokens32() + shard.size()), tokens);
  std::ifstream in(path, std::ios::binary);
  int32_t header[3];
  in.read(reinterpret_cast<char*>(header), sizeof header);
  EXPECT_EQ(header[0], 20240801);
  EXPECT_EQ(header[1], 7);
  EXPECT_EQ(header[2], 3000);
  EXPECT_EQ(std::filesystem::file_size(path), 1024u + 3000u * 4u);
  const std::string msg = input_error([&] { TokenShard::open(path, 100000); });
  EXPECT_NE(msg.find("out of range for vocab_size 100000"), std::string::npos) << msg;
}

TEST(ShardTest, Uint32ShardWithUint16VersionIsInputError) {
  const std::string path = make_temp_dir() + "/wide_v1.bin";
  std::vector<int32_t> words(256 + 8, 0);
  words[0] = kShardMagicU32;
  words[1] = 1;
  words[2] = 8;
  write_bytes(path, words.data(), words.size() * 4);
  const std::string msg = input_error([&] { TokenShard::open(path, 256); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("has version 1, expected 7"), std::string::npos) << msg;
}

TEST(ShardTest, Uint32ShardSizeIsChecked) {
  const std::string path = make_temp_dir() + "/wide_short.bin";
  std::vector<int32_t> words(256 + 8, 0);
  words[0] = kShardMagicU32;
  words[1] = kShardVersionU32;
  words[2] = 16;  // 16 uint32 tokens need 64 bytes; 32 are there
  write_bytes(path, words.data(), words.size() * 4);
  const std::string msg = input_error([&] { TokenShard::open(path, 256); });
  EXPECT_NE(msg.find("header declares 16 tokens (1088 bytes) but file has 1056 bytes"),
            std::string::npos) << msg;
}

}  // namespace
}  // namespace kiln
