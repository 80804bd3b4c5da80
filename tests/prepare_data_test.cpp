// prepare_data: runs the built binary; its shards decode back to the joined text, bad input
// exits with status 2, and a new set replaces an earlier one whole or, on a full disk, not at all.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "data/shard.h"
#include "data/tokenizer.h"
#include "tests/test_process.h"

namespace kiln {
namespace {

std::string make_temp_dir() {
  return kiln::testing::make_temp_dir("kiln_prepare_");
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// Exit status of prepare_data run with `args` (output discarded).
int prepare_data(const std::string& args) {
  const std::string cmd = std::string(KILN_BIN_DIR) + "/prepare_data " + args + " >/dev/null 2>&1";
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

std::string decode_shards(const std::string& pattern) {
  std::string text;
  for (const std::string& path : expand_glob(pattern)) {
    TokenShard shard = TokenShard::open(path, kByteVocabSize);
    EXPECT_TRUE(shard.llmc_format()) << path;
    text += byte_decode(shard.tokens(), static_cast<size_t>(shard.size()));
  }
  return text;
}

TEST(PrepareDataTest, ShardsDecodeBackToText) {
  const std::string dir = make_temp_dir();
  const std::string a = "The quick brown fox\njumps over the lazy dog.\n";
  const std::string b = "caf\xc3\xa9 \x01\xff bytes, all 256 of them survive";
  write_text(dir + "/a.txt", a);
  write_text(dir + "/b.txt", b);
  const std::string joined = a + "\n" + b;
  ASSERT_EQ(prepare_data("--out " + dir + "/out --val-fraction 0.25 --shard-tokens 16 " + dir +
                         "/a.txt " + dir + "/b.txt"),
            0);
  const std::string val = decode_shards(dir + "/out/val_*.bin");
  const std::string train = decode_shards(dir + "/out/train_*.bin");
  EXPECT_EQ(val.size(), joined.size() / 4);
  EXPECT_EQ(val + train, joined);
  // Shards split evenly: no tail shard much shorter than the others.
  for (const std::string& path : expand_glob(dir + "/out/train_*.bin")) {
    const int64_t n = TokenShard::open(path, kByteVocabSize).size();
    EXPECT_GE(n, 8) << path;
    EXPECT_LE(n, 16) << path;
  }
}

TEST(PrepareDataTest, ZeroValFractionWritesOnlyTrain) {
  const std::string dir = make_temp_dir();
  write_text(dir + "/a.txt", "hello");
  ASSERT_EQ(prepare_data("--out=" + dir + "/out --val-fraction=0 " + dir + "/a.txt"), 0);
  EXPECT_EQ(decode_shards(dir + "/out/train_*.bin"), "hello");
  EXPECT_EQ(decode_shards(dir + "/out/*.bin"), "hello");
}

TEST(PrepareDataTest, BadInputExitsWithStatus2) {
  const std::string dir = make_temp_dir();
  write_text(dir + "/a.txt", "hello");
  const std::string in = dir + "/a.txt";
  const std::string out = " --out " + dir + "/out ";
  EXPECT_EQ(prepare_data("--bogus 1" + out + in), 2);
  EXPECT_EQ(prepare_data(out + dir + "/missing.txt"), 2);
  EXPECT_EQ(prepare_data(out + "--val-fraction 1 " + in), 2);
  EXPECT_EQ(prepare_data(out + "--val-fraction -0.1 " + in), 2);
  EXPECT_EQ(prepare_data(out + "--shard-tokens 0 " + in), 2);
  EXPECT_EQ(prepare_data(out + "--tokenizer nope " + in), 2);
  EXPECT_EQ(prepare_data(in), 2);   // no --out
  EXPECT_EQ(prepare_data(out), 2);  // no inputs
  EXPECT_EQ(prepare_data("--help"), 0);
  // Output that did not reach its file is an error too (kiln::run_tool, every tool).
  const auto full = kiln::testing::run_command("sh -c '" + std::string(KILN_BIN_DIR) +
                                               "/prepare_data --help >/dev/full'");
  EXPECT_EQ(full.status, 2) << full.output;
  EXPECT_NE(full.output.find("prepare_data: cannot write standard output"), std::string::npos)
      << full.output;
}

// --doc-separator: each file is a document preceded by the byte, so the shards hold exactly
// the separator before each document and no newline joins them; a file that holds the byte
// itself is refused, and so is the flag with a tokenizer.json.
TEST(PrepareDataTest, DocSeparatorPrecedesEachDocument) {
  const std::string dir = make_temp_dir();
  write_text(dir + "/a.txt", "first doc\n");
  write_text(dir + "/b.txt", "second");
  ASSERT_EQ(prepare_data("--out " + dir + "/out --val-fraction 0 --doc-separator 0 " + dir +
                         "/a.txt " + dir + "/b.txt"),
            0);
  EXPECT_EQ(decode_shards(dir + "/out/train_*.bin"), std::string("\0first doc\n\0second", 18));
  write_text(dir + "/nul.txt", std::string("has\0nul", 7));
  const std::string out = " --out " + dir + "/out2 ";
  EXPECT_EQ(prepare_data(out + "--doc-separator 0 " + dir + "/a.txt " + dir + "/nul.txt"), 2);
  EXPECT_EQ(prepare_data(out + "--doc-separator 256 " + dir + "/a.txt"), 2);
  EXPECT_EQ(prepare_data(out + "--doc-separator x " + dir + "/a.txt"), 2);
  write_text(dir + "/tokenizer.json", "{}");
  EXPECT_EQ(prepare_data(out + "--tokenizer " + dir + "/tokenizer.json --doc-separator 0 " + dir +
                         "/a.txt"),
            2);
}

// The names and bytes of every file in `dir`.
std::vector<std::pair<std::string, std::string>> files_in(const std::string& dir) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    out.emplace_back(e.path().filename().string(), kiln::testing::read_file(e.path().string()));
  std::sort(out.begin(), out.end());
  return out;
}

// A second run into the same --out leaves its own set alone: no shard of the earlier, larger set
// is left for train_*.bin to mix in. On a full disk (a file-size limit the shell sets) the run
// fails naming the shard, and the set before it is there byte for byte.
TEST(PrepareDataTest, ANewSetReplacesTheEarlierWholeOrNotAtAll) {
  const std::string dir = make_temp_dir();
  std::string big;
  for (int i = 0; i < 400; ++i) big += "line " + std::to_string(i) + " of the first corpus\n";
  write_text(dir + "/big.txt", big);
  write_text(dir + "/small.txt", "a second, smaller corpus\n");
  const std::string out = " --out " + dir + "/out --val-fraction 0.1 --shard-tokens 2000 ";
  ASSERT_EQ(prepare_data(out + dir + "/big.txt"), 0);
  EXPECT_EQ(expand_glob(dir + "/out/train_*.bin").size(), 6u);
  ASSERT_EQ(prepare_data(out + dir + "/small.txt"), 0);
  EXPECT_EQ(expand_glob(dir + "/out/train_*.bin").size(), 1u);
  EXPECT_EQ(decode_shards(dir + "/out/val_*.bin") + decode_shards(dir + "/out/train_*.bin"),
            "a second, smaller corpus\n");
  const auto before = files_in(dir + "/out");

  const auto r =
      kiln::testing::run_command("trap '' XFSZ; ulimit -f 4; " + std::string(KILN_BIN_DIR) +
                                 "/prepare_data" + out + dir + "/big.txt");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("write failed"), std::string::npos) << r.output;
  EXPECT_EQ(files_in(dir + "/out"), before);  // no staging directory left either
}

}  // namespace
}  // namespace kiln
