// prepare_data --tokenizer FILE.json: shards hold exactly the ids Hugging Face's tokenizers
// library gives (each file a document after the end-of-text token), uint16 for small
// vocabularies and llm.c's uint32 format above 65,536; a bad --eos or tokenizer exits 2. The
// tokenizer is a small byte-level BPE trained here on local text by tools/train_bpe.py, so
// nothing is downloaded. Skips where the Python package `tokenizers` is missing.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "data/shard.h"
#include "tests/test_process.h"

namespace kiln {
namespace {

using kiln::testing::run_command;

const std::string kBin = KILN_BIN_DIR;
const std::string kSrc = KILN_SOURCE_DIR;

std::vector<std::string> corpus() {
  std::vector<std::string> files;
  for (const char* f : {"/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0"})
    if (std::ifstream(f)) files.push_back(f);
  if (files.empty()) files = {kSrc + "/README.md", kSrc + "/docs/data.md"};
  return files;
}

std::string join(const std::vector<std::string>& files) {
  std::string s;
  for (const auto& f : files) s += " " + f;
  return s;
}

class PrepareDataHf : public ::testing::Test {
 protected:
  void SetUp() override {
    if (run_command("python3 -c 'import tokenizers'").status != 0)
      GTEST_SKIP() << "the Python package tokenizers is missing (scripts/install_deps.sh)";
    dir_ = kiln::testing::make_temp_dir("kiln_prepare_hf_");
  }
  // Trains a BPE of `vocab` merges-worth (+ `extra` special tokens) into dir_/name/.
  std::string train_tokenizer(const std::string& name, int vocab, int extra) {
    const std::string path = dir_ + "/" + name + "/tokenizer.json";
    run_command("mkdir -p " + dir_ + "/" + name);
    const auto r = run_command("python3 " + kSrc + "/tools/train_bpe.py --out " + path +
                               " --vocab-size " + std::to_string(vocab) + " --extra-special " +
                               std::to_string(extra) + join(corpus()));
    EXPECT_EQ(r.status, 0) << r.output;
    return path;
  }
  // The ids the library itself gives: <eos> + encode(file), per file, as uint32.
  std::vector<uint32_t> reference_ids(const std::string& tokenizer) {
    const std::string out = dir_ + "/reference.bin";
    const std::string script =
        "import sys, array\n"
        "from tokenizers import Tokenizer\n"
        "t = Tokenizer.from_file(sys.argv[1]); eos = t.token_to_id('<|endoftext|>')\n"
        "ids = array.array('I')\n"
        "for p in sys.argv[3:]:\n"
        "    ids.append(eos)\n"
        "    ids.extend(t.encode(open(p, encoding='utf-8', errors='replace').read(),"
        " add_special_tokens=False).ids)\n"
        "open(sys.argv[2], 'wb').write(ids.tobytes())\n";
    std::ofstream(dir_ + "/reference.py") << script;
    const auto r = run_command("python3 " + dir_ + "/reference.py " + tokenizer + " " + out + join(corpus()));
    EXPECT_EQ(r.status, 0) << r.output;
    std::ifstream in(out, std::ios::binary);
    std::vector<uint32_t> ids;
    uint32_t v;
    while (in.read(reinterpret_cast<char*>(&v), 4)) ids.push_back(v);
    return ids;
  }
  // val shards then train shards, widened to uint32.
  std::vector<uint32_t> shard_ids(const std::string& out, int vocab, int expect_bytes) {
    std::vector<uint32_t> ids;
    for (const char* split : {"val", "train"})
      for (const std::string& path : expand_glob(out + "/" + split + "_*.bin")) {
        const TokenShard s = TokenShard::open(path, vocab);
        EXPECT_EQ(s.token_bytes(), expect_bytes) << path;
        for (int64_t i = 0; i < s.size(); ++i)
          ids.push_back(expect_bytes == 2 ? s.tokens()[i] : s.tokens32()[i]);
      }
    return ids;
  }
  std::string dir_;
};

TEST_F(PrepareDataHf, ShardsHoldTheLibrarysIds) {
  const std::string tok = train_tokenizer("small", 512, 0);
  const std::string out = dir_ + "/shards";
  const auto r = run_command(kBin + "/prepare_data --out " + out + " --tokenizer " + tok +
                             " --val-fraction 0.1" + join(corpus()));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("set model.vocab_size: 513"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("16-bit shards"), std::string::npos) << r.output;
  const std::vector<uint32_t> expect = reference_ids(tok);
  ASSERT_GT(expect.size(), 1000u);
  EXPECT_EQ(shard_ids(out, 513, 2), expect);
}

// The end-of-text token before each document is document masking's separator: prepare_data
// names its id for data.document_separator, and warns, naming the file, when a document's own
// text encodes to it (a literal "<|endoftext|>" would begin a false document).
TEST_F(PrepareDataHf, NamesTheSeparatorAndWarnsOfItInsideADocument) {
  const std::string tok = train_tokenizer("small", 512, 0);
  const std::string doc = dir_ + "/quotes_the_token.txt";
  std::ofstream(doc) << "a document that quotes <|endoftext|> in its text\n";
  const auto r = run_command(kBin + "/prepare_data --out " + dir_ + "/sep --tokenizer " + tok +
                             " --val-fraction 0" + join(corpus()) + " " + doc);
  ASSERT_EQ(r.status, 0) << r.output;
  const std::vector<uint32_t> ids = reference_ids(tok);
  ASSERT_FALSE(ids.empty());
  const std::string sep = std::to_string(ids[0]);  // every document begins with it
  EXPECT_NE(r.output.find("documents begin with token " + sep +
                          " (for document masking: data.document_separator: " + sep + ")"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("1 document(s) hold the end-of-text token in their own text (the "
                          "first: " +
                          doc + ")"),
            std::string::npos)
      << r.output;
}

TEST_F(PrepareDataHf, VocabularyOver65536WritesUint32Shards) {
  const std::string tok = train_tokenizer("wide", 400, 70000);
  const std::string out = dir_ + "/wide_shards";
  const auto r = run_command(kBin + "/prepare_data --out " + out + " --tokenizer " + tok + join(corpus()));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("32-bit shards"), std::string::npos) << r.output;
  const std::vector<uint32_t> ids = shard_ids(out, 70401, 4);
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids[0], 70400u);  // <|endoftext|>, above 65,535, added after the reserved tokens
  EXPECT_EQ(ids, reference_ids(tok));
  // And a LLaMA trains on them on the CPU, its embedding 70,401 rows tall, with falling loss.
  const auto t = run_command(
      kBin + "/train " + kSrc + "/configs/llama-tiny.yaml --train.device=cpu" +
      " --model.vocab_size=70401 --data.train='" + out + "/train_*.bin' --data.val='" + out +
      "/val_*.bin' --train.max_steps=6 --train.eval_every=6 --train.eval_steps=1" +
      " --train.log_every=1 --train.batch_size=2 --model.seq_len=64 --optim.warmup_steps=0" +
      " --train.out_dir=" + dir_ + "/wide_run");
  ASSERT_EQ(t.status, 0) << t.output;
  const auto losses = kiln::testing::read_losses(dir_ + "/wide_run");
  ASSERT_EQ(losses.size(), 6u);
  EXPECT_GT(losses.front().value, 10.0);  // ~ln(70401) = 11.16 at the start
  EXPECT_LT(losses.back().value, losses.front().value);
}

TEST_F(PrepareDataHf, BadEosOrTokenizerExitsTwo) {
  const std::string tok = train_tokenizer("eos", 300, 0);
  auto r = run_command(kBin + "/prepare_data --out " + dir_ + "/x --tokenizer " + tok +
                       " --eos '<nope>'" + join(corpus()));
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--eos '<nope>' is not a token of"), std::string::npos) << r.output;
  r = run_command(kBin + "/prepare_data --out " + dir_ + "/x --tokenizer " + dir_ + "/none.json" +
                  join(corpus()));
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("none.json: no such file"), std::string::npos) << r.output;
  std::ofstream(dir_ + "/broken.json") << "{\"model\": 3}";
  r = run_command(kBin + "/prepare_data --out " + dir_ + "/x --tokenizer " + dir_ + "/broken.json" +
                  join(corpus()));
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("not a Hugging Face tokenizer.json"), std::string::npos) << r.output;
  // The tokenizer_config.json beside it: malformed, or naming an end-of-text token the
  // vocabulary lacks, is one line naming it: no traceback, no quiet fallback to another token.
  const std::string config = dir_ + "/eos/tokenizer_config.json";
  for (const auto& [text, expect] : std::vector<std::pair<std::string, std::string>>{
           {"{not json", "tokenizer_config.json: not a readable tokenizer_config.json"},
           {"[1, 2]", "not a tokenizer_config.json (a JSON object expected)"},
           {"{\"eos_token\": \"<absent>\"}", "eos_token '<absent>' is not a token of"}}) {
    std::ofstream(config) << text;
    r = run_command(kBin + "/prepare_data --out " + dir_ + "/x --tokenizer " + tok +
                    join(corpus()));
    EXPECT_EQ(r.status, 2) << r.output;
    EXPECT_NE(r.output.find(expect), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("Traceback"), std::string::npos) << r.output;
  }
  std::filesystem::remove(config);
}

// tools/train_bpe.py keeps what is there: a tokenizer.json or tokenizer_config.json already at
// --out's place is refused by name (a model's own tokenizer_config.json is not overwritten), as
// is an input it cannot read; each one line, exit status 2, the files untouched.
TEST_F(PrepareDataHf, TrainBpeKeepsExistingFilesAndNamesBadInput) {
  const std::string tok = train_tokenizer("keep", 300, 0);
  const std::string config = dir_ + "/keep/tokenizer_config.json";
  std::ofstream(config) << "{\"eos_token\": \"<|endoftext|>\", \"mine\": 1}";
  const std::string bpe = "python3 " + kSrc + "/tools/train_bpe.py --vocab-size 300 --out ";
  auto r = run_command(bpe + tok + join(corpus()) + " 2>&1");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_EQ(r.output, "train_bpe: " + tok + " exists; give --out a new directory\n");
  std::filesystem::remove(tok);
  r = run_command(bpe + tok + join(corpus()) + " 2>&1");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_EQ(r.output, "train_bpe: " + config + " exists; give --out a new directory\n");
  std::ifstream in(config);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}),
            "{\"eos_token\": \"<|endoftext|>\", \"mine\": 1}");
  EXPECT_FALSE(std::filesystem::exists(tok));
  r = run_command(bpe + dir_ + "/new/tokenizer.json " + dir_ + "/absent.txt 2>&1");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_EQ(r.output, "train_bpe: " + dir_ + "/absent.txt: not a readable file\n");
}

}  // namespace
}  // namespace kiln
