// The Hugging Face tools end to end, through the real binaries: convert kiln -> hf -> kiln -> hf
// is bit-identical and the hf copy evaluates to the run's loss; `train --init.from=hf:DIR`
// starts from those weights (its first loss is eval's on the same batch); a model that differs
// from the config, and a corrupt safetensors file, exit 2 naming the cause.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>

#include "kernels/backend.h"
#include "tests/test_process.h"

namespace kiln {
namespace {

using kiln::testing::run_command;

const std::string kBin = KILN_BIN_DIR;
const std::string kSrc = KILN_SOURCE_DIR;

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

// The "loss" of eval's JSON line.
double eval_loss(const std::string& output) {
  const size_t at = output.rfind("\"loss\":");
  return at == std::string::npos ? NAN : std::atof(output.c_str() + at + 7);
}

// One shared corpus and a 2-step llama-tiny run (GQA, untied head) to convert.
class HfTools : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = kiln::testing::make_temp_dir("kiln_hf_tools_");
    auto r = kiln::testing::prepare_corpus(kBin, kSrc, dir_ + "/data");
    ASSERT_EQ(r.status, 0) << r.output;
    r = run_command(kBin + "/train " + kSrc + "/configs/llama-tiny.yaml " + data_flags() +
                    " --train.device=cpu --train.max_steps=2 --train.batch_size=2"
                    " --train.eval_every=0 --train.out_dir=" + dir_ + "/run");
    ASSERT_EQ(r.status, 0) << r.output;
  }
  static std::string data_flags() {
    return "--data.train='" + dir_ + "/data/train_*.bin' --data.val='" + dir_ + "/data/val_*.bin'";
  }
  static std::string dir_;
};
std::string HfTools::dir_;

TEST_F(HfTools, ConvertRoundTripIsBitIdenticalAndKeepsTheLoss) {
  const std::string d = dir_;
  auto r = run_command(kBin + "/convert " + d + "/run --to hf " + d + "/hf32 --dtype f32");
  ASSERT_EQ(r.status, 0) << r.output;
  r = run_command(kBin + "/convert hf:" + d + "/hf32 --to kiln " + d + "/kiln");
  ASSERT_EQ(r.status, 0) << r.output;
  r = run_command(kBin + "/convert " + d + "/kiln --to hf " + d + "/hf32b --dtype f32");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(slurp(d + "/hf32/model.safetensors"), slurp(d + "/hf32b/model.safetensors"));
  EXPECT_EQ(slurp(d + "/hf32/config.json"), slurp(d + "/hf32b/config.json"));

  const std::string data = " --data '" + d + "/data/val_*.bin' --batches 2 --batch-size 2 --seq-len 64";
  const auto a = run_command(kBin + "/eval " + d + "/run" + data);
  const auto b = run_command(kBin + "/eval hf:" + d + "/hf32" + data + " --out " + d + "/eval.json");
  ASSERT_EQ(a.status, 0) << a.output;
  ASSERT_EQ(b.status, 0) << b.output;
  EXPECT_EQ(eval_loss(a.output), eval_loss(b.output)) << a.output << b.output;
  EXPECT_GT(eval_loss(a.output), 1.0);
  const std::string json = slurp(d + "/eval.json");
  EXPECT_NE(json.find("\"perplexity\":"), std::string::npos) << json;
  EXPECT_NE(json.find("\"tokens\":256"), std::string::npos) << json;
}

TEST_F(HfTools, InitFromHfStartsFromItsWeights) {
  const std::string d = dir_;
  auto r = run_command(kBin + "/convert " + d + "/run --to hf " + d + "/init --dtype f32");
  ASSERT_EQ(r.status, 0) << r.output;
  r = run_command(kBin + "/train " + kSrc + "/configs/llama-tiny.yaml " + data_flags() +
                  " --train.device=cpu --train.max_steps=1 --train.batch_size=2"
                  " --train.eval_every=0 --data.shuffle=false --init.from=hf:" + d +
                  "/init --train.out_dir=" + d + "/from_hf");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("weights from init.from=hf:"), std::string::npos) << r.output;
  const auto losses = kiln::testing::read_losses(d + "/from_hf");
  ASSERT_EQ(losses.size(), 1u);
  // The first step's loss is taken before its update: the imported model's, on batch 0.
  const auto e = run_command(kBin + "/eval hf:" + d + "/init --data '" + d +
                             "/data/train_*.bin' --batches 1 --batch-size 2 --seq-len 128");
  ASSERT_EQ(e.status, 0) << e.output;
  EXPECT_NEAR(losses[0].value, eval_loss(e.output), 1e-4 * eval_loss(e.output)) << e.output;
}

TEST_F(HfTools, MismatchedModelExitsTwoNamingTheKeys) {
  const std::string d = dir_;
  auto r = run_command(kBin + "/convert " + d + "/run --to hf " + d + "/mismatch");
  ASSERT_EQ(r.status, 0) << r.output;
  r = run_command(kBin + "/train " + kSrc + "/configs/llama-tiny.yaml " + data_flags() +
                  " --train.device=cpu --train.max_steps=1 --model.n_layer=3 --model.ffn_dim=256"
                  " --init.from=hf:" + d + "/mismatch --train.out_dir=" + d + "/mismatch_run");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("model.n_layer: 3 in the config, 4 in " + d + "/mismatch/config.json"),
            std::string::npos) << r.output;
  EXPECT_NE(r.output.find("model.ffn_dim: 256 in the config, 352"), std::string::npos) << r.output;
}

TEST_F(HfTools, CorruptSafetensorsExitsTwoNamingTheFile) {
  const std::string d = dir_;
  auto r = run_command(kBin + "/convert " + d + "/run --to hf " + d + "/corrupt");
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string path = d + "/corrupt/model.safetensors";
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 10);
  r = run_command(kBin + "/convert hf:" + d + "/corrupt --to kiln " + d + "/corrupt_kiln");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find(path + ": tensor 'lm_head.weight': data_offsets"), std::string::npos)
      << r.output;
}

// An export carries the tokenizer files of the model it came from (hf:DIR itself, or the hf:DIR
// a run started from, or --tokenizer DIR) and config.json gets their bos/eos ids; a tokenizer
// that is not there, names a token it lacks, or numbers one past the vocabulary exits 2.
TEST_F(HfTools, TokenizerFilesAndSpecialIdsTravelWithTheExport) {
  const std::string d = dir_;
  auto r = run_command(kBin + "/convert " + d + "/run --to hf " + d + "/tok_src --dtype f32");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("tokenizer: none known for"), std::string::npos) << r.output;
  EXPECT_NE(slurp(d + "/tok_src/config.json").find("\"eos_token_id\": null"), std::string::npos);
  const std::string tokenizer =
      R"({"version":"1.0","added_tokens":[{"id":255,"content":"<|endoftext|>","special":true}],)"
      R"("model":{"type":"BPE","vocab":{"<s>":1,"a":97}}})";
  std::ofstream(d + "/tok_src/tokenizer.json") << tokenizer;
  std::ofstream(d + "/tok_src/tokenizer_config.json")
      << R"({"bos_token":{"content":"<s>"},"eos_token":"<|endoftext|>"})";

  // hf -> hf: the files copied, the ids from the tokenizer (config.json has null).
  r = run_command(kBin + "/convert hf:" + d + "/tok_src --to hf " + d + "/tok_copy");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("tokenizer: 2 files from " + d +
                          "/tok_src; bos_token_id 1, "
                          "eos_token_id 255"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(slurp(d + "/tok_copy/tokenizer.json"), tokenizer);
  EXPECT_TRUE(std::filesystem::exists(d + "/tok_copy/tokenizer_config.json"));
  const std::string config = slurp(d + "/tok_copy/config.json");
  EXPECT_NE(config.find("\"bos_token_id\": 1,"), std::string::npos) << config;
  EXPECT_NE(config.find("\"eos_token_id\": 255,"), std::string::npos) << config;

  // A run that started from hf:tok_copy exports with its tokenizer, the ids this time from
  // config.json.
  r = run_command(kBin + "/train " + kSrc + "/configs/llama-tiny.yaml " + data_flags() +
                  " --train.device=cpu --train.max_steps=1 --train.batch_size=2"
                  " --train.eval_every=0 --init.from=hf:" +
                  d + "/tok_copy --train.out_dir=" + d + "/tok_run");
  ASSERT_EQ(r.status, 0) << r.output;
  r = run_command(kBin + "/convert " + d + "/tok_run --to hf " + d + "/tok_run_hf");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(slurp(d + "/tok_run_hf/tokenizer.json"), tokenizer);
  EXPECT_NE(slurp(d + "/tok_run_hf/config.json").find("\"eos_token_id\": 255,"), std::string::npos);

  // --tokenizer names the source explicitly, and must hold one. `expect` is in the output.
  auto convert_with = [&](const std::string& to, const std::string& tokenizer_dir, int status,
                          const std::string& expect) {
    const auto r = run_command(kBin + "/convert " + d + "/run --to " + to + " " + d +
                               "/tok_x --tokenizer " + d + "/" + tokenizer_dir);
    EXPECT_EQ(r.status, status) << r.output;
    EXPECT_NE(r.output.find(expect), std::string::npos) << r.output;
  };
  std::filesystem::create_directories(d + "/tok_empty");
  convert_with("hf", "tok_empty", 2, "--tokenizer " + d + "/tok_empty: no tokenizer files");
  convert_with("kiln", "tok_src", 2, "--tokenizer applies to --to hf");
  convert_with("hf", "tok_src", 0, "tokenizer: 2 files from " + d + "/tok_src");
  EXPECT_EQ(slurp(d + "/tok_x/tokenizer.json"), tokenizer);

  // A tokenizer of another model: an id past the vocabulary, or a token it does not have.
  std::filesystem::create_directories(d + "/tok_big");
  std::ofstream(d + "/tok_big/tokenizer.json")
      << R"({"added_tokens":[{"id":300,"content":"</s>"}],"model":{"vocab":{}}})";
  std::ofstream(d + "/tok_big/tokenizer_config.json") << R"({"eos_token":"</s>"})";
  convert_with("hf", "tok_big", 2, "special token id 300 is not below the model's vocab_size 256");
  std::ofstream(d + "/tok_big/tokenizer_config.json") << R"({"eos_token":"<eos>"})";
  convert_with("hf", "tok_big", 2, "tokenizer_config.json: eos_token '<eos>' is not a token of");
}

// hf -> kiln -> hf, and hf -> a training run -> hf, give back config.json's bos/eos ids and the
// declared context (max_position_embeddings 512, where the run trained at 128).
TEST_F(HfTools, AnHfRoundTripGivesBackWhatItWasGiven) {
  const std::string d = dir_;
  auto r = run_command(kBin + "/convert " + d + "/run --to hf " + d + "/rt_src --dtype f32");
  ASSERT_EQ(r.status, 0) << r.output;
  std::string config = slurp(d + "/rt_src/config.json");
  for (const auto& [from, to] :
       {std::pair<std::string, std::string>{"\"bos_token_id\": null", "\"bos_token_id\": 1"},
        {"\"eos_token_id\": null", "\"eos_token_id\": 2"},
        {"\"max_position_embeddings\": 128", "\"max_position_embeddings\": 512"}}) {
    const size_t at = config.find(from);
    ASSERT_NE(at, std::string::npos) << from << " in " << config;
    config.replace(at, from.size(), to);
  }
  std::ofstream(d + "/rt_src/config.json") << config;
  auto expect_kept = [&](const std::string& out) {
    const std::string back = slurp(out + "/config.json");
    EXPECT_NE(back.find("\"bos_token_id\": 1,"), std::string::npos) << out << ": " << back;
    EXPECT_NE(back.find("\"eos_token_id\": 2"), std::string::npos) << out << ": " << back;
    EXPECT_NE(back.find("\"max_position_embeddings\": 512,"), std::string::npos) << out << ": " << back;
  };
  r = run_command(kBin + "/convert hf:" + d + "/rt_src --to kiln " + d + "/rt_kiln");
  ASSERT_EQ(r.status, 0) << r.output;
  r = run_command(kBin + "/convert " + d + "/rt_kiln --to hf " + d + "/rt_back");
  ASSERT_EQ(r.status, 0) << r.output;
  expect_kept(d + "/rt_back");
  r = run_command(kBin + "/train " + kSrc + "/configs/llama-tiny.yaml " + data_flags() +
                  " --train.device=cpu --train.max_steps=1 --train.batch_size=2"
                  " --train.eval_every=0 --init.from=hf:" + d + "/rt_src --train.out_dir=" + d +
                  "/rt_run");
  ASSERT_EQ(r.status, 0) << r.output;
  r = run_command(kBin + "/convert " + d + "/rt_run --to hf " + d + "/rt_run_hf");
  ASSERT_EQ(r.status, 0) << r.output;
  expect_kept(d + "/rt_run_hf");
}

// sample reads a run and its hf export alike (the same greedy continuation, as text or as ids,
// and the same again recomputing the window for every token instead of keeping a KV cache),
// takes ids where the vocabulary is not byte-level, and refuses ids outside the vocabulary.
TEST_F(HfTools, SampleReadsRunsAndHfDirectoriesAlike) {
  const std::string d = dir_;
  auto r = run_command(kBin + "/convert " + d + "/run --to hf " + d + "/sample_hf --dtype f32");
  ASSERT_EQ(r.status, 0) << r.output;
  for (const std::string prompt : {"--prompt 'The '", "--prompt-ids 84,104,101,32"}) {
    const std::string flags = " " + prompt + " --tokens 12 --temperature 0 --device cpu";
    const auto run = run_command(kBin + "/sample " + d + "/run" + flags);
    const auto hf = run_command(kBin + "/sample hf:" + d + "/sample_hf" + flags);
    ASSERT_EQ(run.status, 0) << run.output;
    ASSERT_EQ(hf.status, 0) << hf.output;
    EXPECT_EQ(run.output, hf.output) << prompt;
    const auto recomputed = run_command(kBin + "/sample " + d + "/run" + flags + " --no-kv-cache");
    EXPECT_EQ(recomputed.output, run.output) << prompt;
    if (prompt.find("ids") != std::string::npos) {
      EXPECT_TRUE(std::regex_match(run.output, std::regex("84,104,101,32(,[0-9]+){12}\n")))
          << run.output;
    } else {
      EXPECT_EQ(run.output.rfind("The ", 0), 0u) << run.output;
    }
  }
  for (const auto& [ids, expect] : {std::pair<std::string, std::string>{"1,x", "'x' is not"},
                                    {"256", "'256' is not a token id in [0, 256)"},
                                    {"1,,2", "'' is not"}}) {
    r = run_command(kBin + "/sample " + d + "/run --prompt-ids " + ids);
    EXPECT_EQ(r.status, 2) << ids << ": " << r.output;
    EXPECT_NE(r.output.find("--prompt-ids: " + expect), std::string::npos) << r.output;
  }
  // A vocabulary past bytes: ids in, ids out; text is refused, naming the way.
  r = run_command(kBin + "/train " + kSrc + "/configs/qwen3-tiny.yaml " + data_flags() +
                  " --model.vocab_size=300 --train.device=cpu --train.max_steps=1"
                  " --train.batch_size=2 --train.eval_every=0 --train.out_dir=" +
                  d + "/wide");
  ASSERT_EQ(r.status, 0) << r.output;
  r = run_command(kBin + "/sample " + d + "/wide --prompt-ids 299,0 --tokens 3");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex("299,0(,[0-9]+){3}\n"))) << r.output;
  r = run_command(kBin + "/sample " + d + "/wide --prompt hello");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("a vocabulary of 300 is not byte-level: give the prompt as token ids"),
            std::string::npos)
      << r.output;
}

// The list of files under `dir` with each one's bytes: what must not change.
std::map<std::string, std::string> snapshot(const std::string& dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir))
    if (e.is_regular_file()) files[e.path().string()] = slurp(e.path().string());
  return files;
}

// convert writes OUT whole or not at all: an existing non-empty OUT (another run) is refused with
// nothing touched, unless --overwrite, which replaces it with exactly the new model; a path under a
// regular file is an input error.
TEST_F(HfTools, ConvertNeverOverwritesWhatItWasNotAskedTo) {
  const std::string d = dir_;
  auto r = run_command(kBin + "/train " + kSrc + "/configs/tiny.yaml " + data_flags() +
                       " --train.device=cpu --train.max_steps=2 --train.batch_size=2"
                       " --train.eval_every=0 --train.out_dir=" + d + "/other");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto before = snapshot(d + "/other");
  for (const std::string to : {"kiln", "hf"}) {
    r = run_command(kBin + "/convert " + d + "/run --to " + to + " " + d + "/other");
    EXPECT_EQ(r.status, 2) << r.output;
    EXPECT_NE(r.output.find(d + "/other: exists and is not empty (--overwrite replaces it)"),
              std::string::npos)
        << r.output;
    EXPECT_EQ(snapshot(d + "/other"), before) << to;
  }
  std::ofstream(d + "/a_file") << "x";
  r = run_command(kBin + "/convert " + d + "/run --to kiln " + d + "/a_file/run");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find(d + "/a_file/run: cannot be created: " + d + "/a_file is not a directory"),
            std::string::npos)
      << r.output;
  r = run_command(kBin + "/convert " + d + "/run --to hf " + d + "/a_file");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("a_file: exists and is not a directory"), std::string::npos) << r.output;

  r = run_command(kBin + "/convert " + d + "/run --to kiln " + d + "/other --overwrite");
  ASSERT_EQ(r.status, 0) << r.output;
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::recursive_directory_iterator(d + "/other"))
    names.push_back(e.path().lexically_relative(d + "/other").string());
  std::sort(names.begin(), names.end());
  ASSERT_GE(names.size(), 3u);
  EXPECT_EQ(names[0], "checkpoints");
  EXPECT_EQ(names[1], "checkpoints/step_00000000");
  EXPECT_EQ(names.back(), "config.yaml");
  EXPECT_NE(slurp(d + "/other/config.yaml").find("arch: llama"), std::string::npos);
  r = run_command(kBin + "/eval " + d + "/other --device cpu --batches 1");
  EXPECT_EQ(r.status, 0) << r.output;
  for (const auto& e : std::filesystem::directory_iterator(d))
    EXPECT_EQ(e.path().filename().string().rfind(".other", 0), std::string::npos)
        << "a temporary was left behind: " << e.path();
}

// The tools' numbers are parsed as what they are, and an output they cannot write is refused
// before any work; each error is one line.
TEST_F(HfTools, ToolsRefuseBadNumbersAndUnwritableOutputsAtOnce) {
  const std::string d = dir_;
  for (const auto& [flags, expect] : std::vector<std::pair<std::string, std::string>>{
           {"--tokens 2.5", "--tokens must be >= 1 and a whole number, got '2.5'"},
           {"--seed -1", "--seed must be a whole number in [0, 2^64), got '-1'"},
           {"--top-k 1e10", "--top-k must be >= 0 and a whole number, got '1e10'"},
           {"--temperature inf", "--temperature must be a finite number, got 'inf'"},
           {"--no-kv-cache=maybe", "--no-kv-cache: expected no value, true or false, got 'maybe'"},
           {"--bogus 1", "unknown flag '--bogus' (sample --help lists them)"},
           {"--bogus", "--bogus: missing value (or an unknown flag: --help lists them)"}}) {
    const auto r = run_command(kBin + "/sample " + d + "/run --device cpu " + flags);
    EXPECT_EQ(r.status, 2) << flags << ": " << r.output;
    EXPECT_EQ(r.output, "sample: " + expect + "\n") << flags;
  }
  auto r = run_command(kBin + "/sample");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_EQ(r.output, "sample: no run or checkpoint directory given (sample --help)\n");
  if (!cuda_available()) {
    r = run_command(kBin + "/sample " + d + "/run --device cuda");
    EXPECT_EQ(r.status, 2) << r.output;
    EXPECT_NE(r.output.find("--device=cuda: no usable GPU"), std::string::npos) << r.output;
  }
  r = run_command(kBin + "/eval " + d + "/run --device cpu --out " + d + "/no/such/dir/x.json");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--out " + d + "/no/such/dir/x.json: cannot be written"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("\"loss\""), std::string::npos) << "eval ran first: " << r.output;
  r = run_command(kBin + "/bench " + kSrc + "/configs/tiny.yaml --train.device=cpu --history " +
                  d + "/no/such/dir/h.jsonl");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--history " + d + "/no/such/dir/h.jsonl: cannot be written"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("step "), std::string::npos) << "bench ran first: " << r.output;
}

TEST_F(HfTools, BadFlagsExitTwo) {
  auto r = run_command(kBin + "/convert " + dir_ + "/run --to onnx x");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--to: expected hf or kiln"), std::string::npos) << r.output;
  r = run_command(kBin + "/eval hf:/nonexistent");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("/nonexistent: not a directory"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace kiln
