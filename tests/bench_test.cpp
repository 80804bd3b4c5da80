// bench as a regression tracker, through the real binary on the CPU: --json and --history
// write the run's JSON, --baseline prints the deltas and exits 1 on a regression past the
// tolerance, and a baseline that is not a bench JSON exits 2 before anything runs; random
// tokens, cut into documents for a document-masked run.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

#include "tests/test_process.h"

namespace {

namespace fs = std::filesystem;

const std::string kBin = KILN_BIN_DIR;
const std::string kSrc = KILN_SOURCE_DIR;

// Two timed steps of the tiny CPU model (random tokens where its data is missing).
kiln::testing::CommandResult bench(const fs::path& dir, const std::string& extra) {
  return kiln::testing::run_command("cd " + dir.string() + " && " + kBin + "/bench " + kSrc +
                                    "/configs/tiny.yaml --train.device=cpu" +
                                    " --data.train=nothing_here_*.bin --warmup 1 --steps 2 " +
                                    extra);
}

std::string read(const fs::path& p) {
  std::ifstream in(p);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

TEST(BenchBaseline, DeltasHistoryAndRegressionExitStatus) {
  const fs::path dir = kiln::testing::make_temp_dir("kiln_bench_");

  auto r = bench(dir, "--json first.json --history history.jsonl");
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string first = read(dir / "first.json");
  ASSERT_NE(first.find("\"tok_s\":"), std::string::npos) << first;
  // No peak is known on the CPU: no MFU figure that reads like a measurement.
  EXPECT_NE(r.output.find("tokens/s, MFU n/a, memory"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("MFU 0.0%"), std::string::npos) << r.output;

  // Against itself with a wide tolerance: deltas printed, no regression, history grows.
  r = bench(dir, "--baseline first.json --tolerance 400% --history history.jsonl");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("against first.json"), std::string::npos) << r.output;
  for (const char* figure : {"tok_s", "ms", "mfu", "memory_bytes"})
    EXPECT_NE(r.output.find(std::string("  ") + figure), std::string::npos) << figure;
  EXPECT_NE(r.output.find("mfu           n/a (no peak FLOP/s known"), std::string::npos)
      << r.output;
  const std::string history = read(dir / "history.jsonl");
  EXPECT_EQ(std::count(history.begin(), history.end(), '\n'), 2) << history;

  // A baseline 1000x faster: tok/s regressed, exit 1, the figure named.
  std::ofstream(dir / "fast.json")
      << std::regex_replace(first, std::regex("\"tok_s\":[0-9]+"), "\"tok_s\":999999999");
  r = bench(dir, "--baseline fast.json");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("REGRESSION"), std::string::npos) << r.output;

  // The nightly form, one file as baseline and history: compared with its last line (here the
  // fast one), before this run's line is appended.
  std::ofstream(dir / "history.jsonl", std::ios::app) << read(dir / "fast.json");
  r = bench(dir, "--baseline history.jsonl --history history.jsonl");
  EXPECT_EQ(r.status, 1) << r.output;
  const std::string nightly = read(dir / "history.jsonl");
  EXPECT_EQ(std::count(nightly.begin(), nightly.end(), '\n'), 4) << nightly;

  // Not a bench JSON, a missing file, a bad tolerance: exit 2 naming the cause.
  std::ofstream(dir / "bad.json") << "{\"loss\": 3}\n";
  for (const auto& [args, expect] :
       {std::pair<std::string, std::string>{"--baseline bad.json", "no \"tok_s\""},
        {"--baseline missing.json", "cannot read missing.json"},
        {"--baseline first.json --tolerance lots", "--tolerance"}}) {
    r = bench(dir, args);
    EXPECT_EQ(r.status, 2) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(expect), std::string::npos) << args << "\n" << r.output;
  }
}

// J/token is in a bench JSON only where the GPU's power was read (never on the CPU); a baseline
// that has it against a run that does not is noted, not compared. (Both measured, a worse J/token
// is a regression: tests/gpu/power_test.cpp.)
TEST(BenchBaseline, JoulesPerTokenOnlyWhereMeasured) {
  const fs::path dir = kiln::testing::make_temp_dir("kiln_bench_energy_");
  auto r = bench(dir, "--json cpu.json");
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string cpu = read(dir / "cpu.json");
  EXPECT_EQ(cpu.find("j_per_token"), std::string::npos) << cpu;
  std::ofstream(dir / "gpu.json")
      << std::regex_replace(cpu, std::regex("\"loss_last\""), "\"j_per_token\":0.001,\"loss_last\"");
  r = bench(dir, "--baseline gpu.json --tolerance 400%");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("j_per_token   measured in the baseline only; not compared"),
            std::string::npos)
      << r.output;
}

// Random tokens for a vocabulary over 65,536 (Qwen3's 151,936) are uint32, as prepare_data
// writes them: a uint16 shard would fold every id above 65,535 onto a smaller one.
TEST(BenchRandomShard, WideVocabularyGetsUint32Tokens) {
  const fs::path dir = kiln::testing::make_temp_dir("kiln_bench_wide_");
  auto r = bench(dir,
                 "--model.vocab_size=70000 --model.n_layer=1 --train.batch_size=2 "
                 "--model.seq_len=32");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("random 32-bit tokens"), std::string::npos) << r.output;
  r = bench(dir, "");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("random 16-bit tokens"), std::string::npos) << r.output;
}

// With data.document_mask, the random shard is cut into documents by the separator (tiny.yaml is
// GPT-2: learned positions, so the mask alone), and the JSON says the run was masked.
TEST(BenchRandomShard, DocumentMaskCutsTheRandomTokensIntoDocuments) {
  const fs::path dir = kiln::testing::make_temp_dir("kiln_bench_docs_");
  auto r = bench(dir,
                 "--model.n_layer=1 --train.batch_size=2 --model.seq_len=32 "
                 "--data.document_mask=true --data.document_separator=0 "
                 "--data.document_positions=false --document-tokens 8 --json docs.json");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("documents of 8 tokens on average, each beginning with token 0"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("(document mask)"), std::string::npos) << r.output;
  EXPECT_NE(read(dir / "docs.json").find("\"document_mask\":true"), std::string::npos);
  EXPECT_EQ(bench(dir, "--document-tokens 0").status, 2);
}

}  // namespace

// The MFU tier ladder on the CPU: tiers 0-2 run (zero1, ddp, ddp + the async loader), each as
// the trainer ran it; 3 (CUDA graphs) and 4 (FP8) say they do not apply here. Table and JSON.
TEST(BenchTiers, TheLadderRunsTheTiersThatApplyAndMarksTheRest) {
  const fs::path dir = kiln::testing::make_temp_dir("kiln_tiers_");
  const auto r = bench(dir, "--tiers --model.n_layer=1 --json " + (dir / "tiers.jsonl").string());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("random tokens"), std::string::npos) << r.output;
  for (const char* row : {"0 zero1 ", "1 ddp ", "2 \\+ async loader"})
    EXPECT_TRUE(std::regex_search(r.output, std::regex(std::string(row) + " +[0-9.]+ +[0-9]+ +n/a")))
        << row << "\n" << r.output;
  EXPECT_NE(r.output.find("zero1, prefetch off"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("ddp, prefetch on"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("n/a: CUDA graphs need a GPU"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("n/a: FP8 GEMMs need a GPU"), std::string::npos) << r.output;
  const std::string json = read(dir / "tiers.jsonl");
  EXPECT_EQ(std::count(json.begin(), json.end(), '\n'), 5) << json;
  EXPECT_NE(json.find("\"tier\":2,\"name\":\"2 + async loader\",\"applies\":true"), std::string::npos)
      << json;
  EXPECT_NE(json.find("\"tier\":4,\"name\":\"4 + FP8\",\"applies\":false"), std::string::npos) << json;
  // --tiers is its own ladder: a single bench's regression flags do not mix with it.
  EXPECT_EQ(bench(dir, "--tiers --baseline x.json").status, 2);
  fs::remove_all(dir);
}

// Under --nproc-per-node each tier is `train --nproc-per-node 2` (Gloo ranks here): zero1 and
// ddp then differ in what they do, and the figures count both ranks' tokens.
TEST(BenchTiers, TheLadderRunsOverSeveralRanks) {
  const fs::path dir = kiln::testing::make_temp_dir("kiln_tiers_ranks_");
  const auto r = bench(dir, "--tiers --model.n_layer=1 --nproc-per-node 2 --json " +
                                (dir / "tiers.jsonl").string());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("(2 ranks, --nproc-per-node; random tokens"), std::string::npos)
      << r.output;
  for (const char* row : {"0 zero1 ", "1 ddp ", "2 \\+ async loader"})
    EXPECT_TRUE(std::regex_search(r.output, std::regex(std::string(row) + " +[0-9.]+ +[0-9]+ +n/a")))
        << row << "\n" << r.output;
  // tiny.yaml's batch of 16 x 128 tokens on each of 2 ranks.
  const std::string json = read(dir / "tiers.jsonl");
  EXPECT_NE(json.find("\"tokens_per_step\":4096"), std::string::npos) << json;
  EXPECT_NE(json.find("\"nproc\":2"), std::string::npos) << json;
  EXPECT_EQ(bench(dir, "--profile-ops --nproc-per-node 2").status, 2);
  fs::remove_all(dir);
}
