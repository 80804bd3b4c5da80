// tools/twin_compare.py's report (--report-only, no GPU or torch: runs written here): the time to
// the reference's final val loss is read along each variant's mean curve, linear between
// evaluations, in training seconds; a kiln variant that trains past the reference's last step
// (trained until the target is reached) is read along all of its own evaluations, and one that
// never reaches the target has none; one that stops earlier is shown at its own last step, and
// compared seed by seed (--paired) with an earlier variant that stopped there too. timing.json
// (--time-alone) replaces the runs' clocks with steps x a step's time alone. With --retries, a run
// that fails is run again, its failed try's log kept; with --resume, only the runs that did not end
// run.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "tests/test_process.h"

namespace {

namespace fs = std::filesystem;

const std::string kSrc = KILN_SOURCE_DIR;
const std::string kBin = KILN_BIN_DIR;

// A kiln run: every step takes 100 ms; val_loss at the given steps.
void write_kiln_run(const fs::path& run, int steps, const std::map<int, double>& val) {
  fs::create_directories(run);
  std::ofstream(run / "summary.json") << R"({"tokens_per_step": 1000})";
  std::ofstream m(run / "metrics.jsonl");
  for (int s = 1; s <= steps; ++s) {
    nlohmann::json line = {{"step", s}, {"ms", 100.0}};
    if (val.count(s)) line["val_loss"] = val.at(s);
    m << line.dump() << "\n";
  }
}

// A twin run: val_loss and train_s at the given steps, 1000 tokens a step; and, unless it was cut
// short, the summary line it ends with.
void write_twin_run(const fs::path& path, const std::map<int, std::pair<double, double>>& val,
                    bool finished = true) {
  std::ofstream t(path);
  t << "compiling\n";
  for (const auto& [step, v] : val) {
    t << nlohmann::json{{"step", step},
                        {"val_loss", v.first},
                        {"train_s", v.second},
                        {"tokens", step * 1000}}
             .dump()
      << "\n";
  }
  if (finished) t << R"({"summary": {"steps": )" << val.rbegin()->first << "}}\n";
}

kiln::testing::CommandResult twin_compare(const fs::path& out, const std::string& args) {
  return kiln::testing::run_command("python3 " + kSrc +
                                    "/tools/twin_compare.py configs/quality/gpt2-bytes.yaml "
                                    "--report-only --seeds 1,2 --out " +
                                    out.string() + " " + args);
}

TEST(TwinCompare, ALongerKilnRunIsReadAlongItsOwnEvaluations) {
  const fs::path out = kiln::testing::make_temp_dir("kiln_twin_compare_");
  for (int seed : {1, 2}) {
    // The reference: 0.9 at its last step (100), reached at 20 s.
    write_twin_run(out / ("twin-s" + std::to_string(seed) + ".jsonl"),
                   {{50, {1.0, 10.0}}, {100, {0.9, 20.0}}});
    const std::string s = "-s" + std::to_string(seed);
    write_kiln_run(out / ("short" + s), 100, {{50, 1.0}, {100, 0.92}});
    // 0.95 at step 100 (10 s), 0.85 at step 150 (15 s): 0.9 halfway, at 12.5 s.
    write_kiln_run(out / ("long" + s), 150, {{50, 1.0}, {100, 0.95}, {150, 0.85}});
  }
  const auto r = twin_compare(out, "--twin twin --kiln short --kiln 'long=--train.max_steps=150'");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("long ran to step 150: val mean 0.8500, train s 15.0"), std::string::npos)
      << r.output;

  const auto summary = nlohmann::json::parse(std::ifstream(out / "summary.json"));
  EXPECT_DOUBLE_EQ(summary["target"].get<double>(), 0.9);
  const auto& v = summary["variants"];
  EXPECT_DOUBLE_EQ(v["twin"]["time_to_loss_s"].get<double>(), 20.0);
  EXPECT_TRUE(v["short"]["time_to_loss_s"].is_null()) << r.output;
  EXPECT_NEAR(v["long"]["time_to_loss_s"].get<double>(), 12.5, 1e-9) << r.output;
  EXPECT_NEAR(v["long"]["tokens_to_loss"].get<double>(), 125000.0, 1e-6);
  EXPECT_NEAR(v["long"]["speedup_vs_ref"].get<double>(), 1.6, 1e-9);
  // The final table stays at the reference's last step, where every variant evaluated.
  EXPECT_NEAR(v["long"]["mean"].get<double>(), 0.95, 1e-12);
}

TEST(TwinCompare, AShorterRunIsShownAtItsOwnLastStepAgainstTheReferencesFinal) {
  const fs::path out = kiln::testing::make_temp_dir("kiln_twin_compare_");
  for (int seed : {1, 2}) {
    const std::string s = "-s" + std::to_string(seed);
    write_twin_run(out / ("twin" + s + ".jsonl"), {{50, {1.0, 10.0}}, {100, {0.9, 20.0}}});
    // 1.0 at step 50 (5 s), 0.88 at step 60 (6 s): 0.9 at 5/6 of the way, 5.8333 s.
    write_kiln_run(out / ("short" + s), 60, {{50, 1.0}, {60, 0.88}});
  }
  const auto r = twin_compare(out, "--twin twin --kiln 'short=configs/quality/{name}-short.yaml'");
  ASSERT_EQ(r.status, 0) << r.output;
  // The curve is over every variant's steps, "-" where one did not evaluate.
  EXPECT_NE(r.output.find("    60                  -             0.8800"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("   100             0.9000                  -"), std::string::npos)
      << r.output;

  const auto summary = nlohmann::json::parse(std::ifstream(out / "summary.json"));
  EXPECT_DOUBLE_EQ(summary["target"].get<double>(), 0.9);
  const auto& v = summary["variants"];
  EXPECT_EQ(v["twin"]["step"].get<int>(), 100);
  EXPECT_EQ(v["short"]["step"].get<int>(), 60);
  EXPECT_NEAR(v["short"]["mean"].get<double>(), 0.88, 1e-12);
  EXPECT_NEAR(v["short"]["train_s"].get<double>(), 6.0, 1e-9);
  EXPECT_NEAR(v["short"]["time_to_loss_s"].get<double>(), 5.0 + 5.0 / 6.0, 1e-9) << r.output;
}

TEST(TwinCompare, TwoRunsEndingAtTheSameEarlierStepArePaired) {
  const fs::path out = kiln::testing::make_temp_dir("kiln_twin_compare_");
  // Per seed, kiln's Muon against the Muon twin: +3% and -1%, mean +1 +- 2 (standard error),
  // t = 0.5 on 1 degree of freedom: p = 1 - 2 atan(0.5) / pi = 0.7048, and the 95% interval
  // 1 +- 2 tan(0.475 pi) (t's 97.5% point on 1 degree of freedom: a Cauchy's).
  const std::map<int, std::pair<double, double>> at60 = {{1, {0.95, 0.95 * 1.03}},
                                                         {2, {0.90, 0.90 * 0.99}}};
  for (int seed : {1, 2}) {
    const std::string s = "-s" + std::to_string(seed);
    write_twin_run(out / ("twin" + s + ".jsonl"), {{50, {1.0, 10.0}}, {100, {0.9, 20.0}}});
    write_twin_run(out / ("twin-muon" + s + ".jsonl"),
                   {{50, {1.0, 10.0}}, {60, {at60.at(seed).first, 12.0}}});
    write_kiln_run(out / ("muon" + s), 60, {{50, 1.0}, {60, at60.at(seed).second}});
  }
  const auto r =
      twin_compare(out,
                   "--paired --twin twin --twin 'twin-muon=configs/quality/{name}-muon.yaml' "
                   "--kiln 'muon=configs/quality/{name}-muon.yaml'");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("muon +3.000 / -1.000  mean +1.000 +- 2.000 (t +0.50, p 0.705, 95% in "
                           "[-24.412, +26.412]) (vs twin-muon, step 60)"),
            std::string::npos)
      << r.output;

  const auto summary = nlohmann::json::parse(std::ifstream(out / "summary.json"));
  const auto& v = summary["variants"];
  const auto& vs = v["muon"]["paired_vs"]["twin-muon"];
  EXPECT_EQ(vs["step"].get<int>(), 60);
  EXPECT_NEAR(vs["per_seed"][0].get<double>(), 3.0, 1e-9);
  EXPECT_NEAR(vs["per_seed"][1].get<double>(), -1.0, 1e-9);
  EXPECT_NEAR(vs["mean"].get<double>(), 1.0, 1e-9);
  EXPECT_NEAR(vs["stderr"].get<double>(), 2.0, 1e-9);
  EXPECT_NEAR(vs["t"].get<double>(), 0.5, 1e-9);
  EXPECT_NEAR(vs["p"].get<double>(), 1.0 - 2.0 * std::atan(0.5) / M_PI, 1e-9);
  const double half = 2.0 * std::tan(0.475 * M_PI);
  EXPECT_NEAR(vs["ci95"][0].get<double>(), 1.0 - half, 1e-6);
  EXPECT_NEAR(vs["ci95"][1].get<double>(), 1.0 + half, 1e-6);
  // Neither reached the reference's final step: no comparison with it, and the reference is
  // never an "earlier variant".
  EXPECT_FALSE(v["muon"].contains("paired_pct"));
  EXPECT_FALSE(v["twin-muon"].contains("paired_pct"));
  EXPECT_FALSE(v["twin-muon"].contains("paired_vs"));
  EXPECT_EQ(v["muon"]["paired_vs"].size(), 1u);
}

TEST(TwinCompare, ATwinRunCutShortLeavesItsSeedOut) {
  const fs::path out = kiln::testing::make_temp_dir("kiln_twin_compare_");
  for (int seed : {1, 2}) {
    const std::string s = "-s" + std::to_string(seed);
    write_twin_run(out / ("twin" + s + ".jsonl"), {{50, {1.0, 10.0}}, {100, {0.9, 20.0}}});
    write_kiln_run(out / ("muon" + s), 60, {{50, 1.0}, {60, seed == 1 ? 0.95 : 0.85}});
    // Seed 2 of the Muon twin died after step 50: its curve is no 50-step recipe.
    write_twin_run(out / ("twin-muon" + s + ".jsonl"),
                   seed == 1 ? std::map<int, std::pair<double, double>>{{50, {1.0, 10.0}},
                                                                        {60, {0.95, 12.0}}}
                             : std::map<int, std::pair<double, double>>{{50, {1.2, 10.0}}},
                   seed == 1);
  }
  const auto r =
      twin_compare(out,
                   "--twin twin --twin 'twin-muon=configs/quality/{name}-muon.yaml' "
                   "--kiln 'muon=configs/quality/{name}-muon.yaml'");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("twin-muon seed 2 left out (the run did not finish"), std::string::npos)
      << r.output;
  const auto summary = nlohmann::json::parse(std::ifstream(out / "summary.json"));
  EXPECT_EQ(summary["seeds"], nlohmann::json::array({1}));
  const auto& v = summary["variants"];
  EXPECT_EQ(v["twin-muon"]["step"].get<int>(), 60);
  EXPECT_NEAR(v["muon"]["mean"].get<double>(), 0.95, 1e-12);
}

TEST(TwinCompare, TimingJsonReplacesTheRunsClocks) {
  const fs::path out = kiln::testing::make_temp_dir("kiln_twin_compare_");
  for (int seed : {1, 2}) {
    const std::string s = "-s" + std::to_string(seed);
    write_twin_run(out / ("twin" + s + ".jsonl"), {{50, {1.0, 10.0}}, {100, {0.9, 20.0}}});
    // 0.9 halfway between steps 100 and 150: step 125.
    write_kiln_run(out / ("kiln" + s), 150, {{50, 1.0}, {100, 0.95}, {150, 0.85}});
    write_kiln_run(out / ("other" + s), 100, {{50, 1.0}, {100, 0.92}});
  }
  std::ofstream(out / "timing.json") << R"({"twin": 0.3, "kiln": 0.04})";
  const auto r = twin_compare(out, "--twin twin --kiln 'kiln=--train.max_steps=150' --kiln other");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("times: steps x the per-step time of a run alone (--time-alone); their "
                          "own clocks: other"),
            std::string::npos)
      << r.output;

  const auto summary = nlohmann::json::parse(std::ifstream(out / "summary.json"));
  const auto& v = summary["variants"];
  EXPECT_NEAR(v["twin"]["train_s"].get<double>(), 30.0, 1e-9);
  EXPECT_NEAR(v["twin"]["time_to_loss_s"].get<double>(), 30.0, 1e-9);
  EXPECT_NEAR(v["kiln"]["time_to_loss_s"].get<double>(), 125 * 0.04, 1e-9) << r.output;
  EXPECT_NEAR(v["kiln"]["speedup_vs_ref"].get<double>(), 6.0, 1e-9);
  // Not in timing.json: its own clock, 100 steps of 100 ms.
  EXPECT_NEAR(v["other"]["train_s"].get<double>(), 10.0, 1e-9);
}

// A run that fails its first try (as on a launch failure while runs share a GPU) is run again
// under --retries 1, the failed try's log kept beside; without --retries it stays failed, and one
// that refused its input (exit status 2) is not run again.
TEST(TwinCompare, AFailedRunIsRunAgainUnderRetries) {
  const fs::path dir = kiln::testing::make_temp_dir("kiln_twin_compare_");
  // A stand-in for `train`: prints the config back to --print-config; a run fails the first time
  // its out_dir is given, then writes two steps and one evaluation.
  const fs::path fake = dir / "train.sh";
  std::ofstream(fake) << R"(#!/bin/sh
for a in "$@"; do [ "$a" = --print-config ] && { cat "$1"; exit 0; }; done
for a in "$@"; do case $a in --train.out_dir=*) run=${a#--train.out_dir=};; esac; done
for a in "$@"; do [ "$a" = --train.bogus=1 ] && { echo "train.bogus: unknown key"; exit 2; }; done
if [ ! -e "$run.tried" ]; then touch "$run.tried"; echo "unspecified launch failure"; exit 1; fi
mkdir -p "$run"
echo '{"tokens_per_step": 1000}' > "$run/summary.json"
printf '{"step": 1, "ms": 100}\n{"step": 2, "ms": 100, "val_loss": 1.0}\n' > "$run/metrics.jsonl"
)";
  fs::permissions(fake, fs::perms::owner_all);
  const auto run = [&](const fs::path& out, const std::string& args) {
    return kiln::testing::run_command("cd " + kSrc + " && python3 tools/twin_compare.py " +
                                      "configs/quality/gpt2-bytes.yaml --seeds 1 --train " +
                                      fake.string() + " --kiln kiln --out " + out.string() + " " +
                                      args);
  };

  const auto once = run(dir / "once", "");
  EXPECT_NE(once.output.find("failed (see their logs): " + (dir / "once" / "kiln-s1.log").string()),
            std::string::npos)
      << once.output;
  EXPECT_EQ(once.status, 1) << once.output;  // a comparison missing a run does not pass for whole

  const auto again = run(dir / "again", "--retries 1");
  ASSERT_EQ(again.status, 0) << again.output;
  const size_t retried = again.output.find("kiln-s1.log: GPU 0, rc 0, ");
  ASSERT_NE(retried, std::string::npos) << again.output;
  EXPECT_NE(again.output.find(" s (try 2)\n", retried), std::string::npos) << again.output;
  EXPECT_EQ(again.output.find("failed (see"), std::string::npos) << again.output;
  std::ifstream failed(dir / "again" / "kiln-s1.log.failed-1");
  std::string first((std::istreambuf_iterator<char>(failed)), {});
  EXPECT_EQ(first, "unspecified launch failure\n");
  const auto summary = nlohmann::json::parse(std::ifstream(dir / "again" / "summary.json"));
  EXPECT_DOUBLE_EQ(summary["variants"]["kiln"]["mean"].get<double>(), 1.0);

  // Exit status 2 is a refused input: it would fail again, so it is not run again.
  const auto refused = run(dir / "refused", "--retries 1 --kiln 'bogus=--train.bogus=1'");
  const size_t once_only = refused.output.find("bogus-s1.log: GPU 0, rc 2, ");
  ASSERT_NE(once_only, std::string::npos) << refused.output;
  EXPECT_EQ(refused.output.find("bogus-s1.log: GPU 0", once_only + 1), std::string::npos)
      << refused.output;
  EXPECT_NE(refused.output.find("train.bogus: unknown key"), std::string::npos) << refused.output;
  EXPECT_FALSE(fs::exists(dir / "refused" / "bogus-s1.log.failed-1"));
  EXPECT_NE(refused.output.find("failed (see their logs): " +
                                (dir / "refused" / "bogus-s1.log").string()),
            std::string::npos)
      << refused.output;
  EXPECT_EQ(refused.status, 2) << refused.output;

  // Flags that name no run are refused before any: one line, exit status 2.
  for (const auto& [flags, expect] : std::vector<std::pair<std::string, std::string>>{
           {"--seeds a", "--seeds 'a': a comma list of distinct whole numbers, 0 or more"},
           {"--seeds 1,1", "--seeds '1,1': a comma list of distinct whole numbers, 0 or more"},
           {"--seeds=-1", "--seeds '-1': a comma list of distinct whole numbers, 0 or more"},
           {"--gpus 0,", "--gpus '0,': a comma list of GPUs (CUDA_VISIBLE_DEVICES values) with "
                         "none empty"}}) {
    const auto bad = run(dir / "bad", flags);
    EXPECT_EQ(bad.status, 2) << flags << ": " << bad.output;
    EXPECT_NE(bad.output.find("twin_compare.py: error: " + expect + "\n"), std::string::npos)
        << flags << ": " << bad.output;
    EXPECT_FALSE(fs::exists(dir / "bad")) << flags;
  }

  const auto negative = run(dir / "negative", "--retries -1");
  EXPECT_EQ(negative.status, 2);
  EXPECT_NE(negative.output.find("--retries -1: the number of runs again after a failure is 0 or "
                                 "more"),
            std::string::npos)
      << negative.output;
}

// --paired starts every variant from the positional config's initial weights: a variant with a
// config of another model is refused before anything runs, by name, exit status 2.
TEST(TwinCompare, APairedVariantOfAnotherModelIsRefused) {
  const fs::path dir = kiln::testing::make_temp_dir("kiln_twin_compare_");
  const fs::path fake = dir / "train.sh";  // prints the config back to --print-config, else fails
  std::ofstream(fake) << R"(#!/bin/sh
for a in "$@"; do [ "$a" = --print-config ] && { cat "$1"; exit 0; }; done
exit 1
)";
  fs::permissions(fake, fs::perms::owner_all);
  const auto r = kiln::testing::run_command(
      "cd " + kSrc + " && python3 tools/twin_compare.py configs/quality/gpt2-bytes.yaml --seeds 1 " +
      "--paired --train " + fake.string() + " --kiln kiln --kiln " +
      "'llama=configs/quality/llama-bytes.yaml' --out " + (dir / "out").string() + " 2>&1");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--paired: llama's model (configs/quality/llama-bytes.yaml) differs "
                          "from configs/quality/gpt2-bytes.yaml's"),
            std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(dir / "out" / "kiln-s1.log")) << r.output;

  // A config that train refuses: its one line and its exit status, not a traceback.
  const auto bad = kiln::testing::run_command(
      "cd " + kSrc + " && python3 tools/twin_compare.py configs/quality/gpt2-bytes.yaml --seeds 1 " +
      "--train " + kBin + "/train --kiln kiln --set train.bogus=1 --out " + (dir / "bad").string() +
      " 2>&1");
  EXPECT_EQ(bad.status, 2) << bad.output;
  EXPECT_NE(bad.output.find("train.bogus"), std::string::npos) << bad.output;
  EXPECT_EQ(bad.output.find("Traceback"), std::string::npos) << bad.output;
}

// --resume reads the runs under --out that ended and runs the rest: a kiln run cut short (no
// summary.json) and a twin variant named only now run, the others not again, and timing.json keeps
// the times measured before beside the new variant's.
TEST(TwinCompare, AResumedComparisonRunsOnlyWhatDidNotEnd) {
  const fs::path dir = kiln::testing::make_temp_dir("kiln_twin_compare_");
  const fs::path calls = dir / "calls";
  // Stand-ins for `train` and for the twin's python, each logging its runs to `calls`.
  const fs::path train = dir / "train.sh", python = dir / "python.sh";
  std::ofstream(train) << R"sh(#!/bin/sh
for a in "$@"; do [ "$a" = --print-config ] && { cat "$1"; exit 0; }; done
for a in "$@"; do case $a in --train.out_dir=*) run=${a#--train.out_dir=};; esac; done
echo "kiln $(basename "$run")" >> )sh" << calls.string() << R"sh(
mkdir -p "$run"
echo '{"tokens_per_step": 1000}' > "$run/summary.json"
printf '{"step": 1, "ms": 100}\n{"step": 2, "ms": 100, "val_loss": 1.0}\n' > "$run/metrics.jsonl"
)sh";
  std::ofstream(python) << R"sh(#!/bin/sh
shift
echo "twin $*" >> )sh" << calls.string() << R"sh(
echo '{"step": 2, "val_loss": 1.1, "train_s": 0.3, "tokens": 2000}'
echo '{"summary": {"steps": 2, "train_s": 0.3}}'
)sh";
  fs::permissions(train, fs::perms::owner_all);
  fs::permissions(python, fs::perms::owner_all);
  const fs::path out = dir / "out";
  const auto run = [&](const std::string& args) {
    fs::remove(calls);
    const auto r = kiln::testing::run_command(
        "cd " + kSrc + " && python3 tools/twin_compare.py configs/quality/gpt2-bytes.yaml " +
        "--seeds 1 --time-alone 2 --train " + train.string() + " --python " + python.string() +
        " --out " + out.string() + " --kiln kiln --twin twin " + args);
    std::ifstream f(calls);
    return std::make_pair(r, std::string((std::istreambuf_iterator<char>(f)), {}));
  };

  const auto [first, all] = run("");
  ASSERT_EQ(first.status, 0) << first.output;
  EXPECT_EQ(all,
            "twin --config " + (out / "twin-config.yaml").string() + " --seed 1\n"
            "kiln kiln-s1\nkiln kiln-time\n"
            "twin --config " + (out / "twin-config.yaml").string() + " --seed 1 --steps 2\n")
      << first.output;

  fs::remove(out / "kiln-s1" / "summary.json");  // cut short
  const auto [resumed, rest] = run("--resume --twin 'other=--other'");
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  EXPECT_EQ(rest,
            "kiln kiln-s1\n"
            "twin --config " + (out / "twin-config.yaml").string() + " --seed 1 --other\n"
            "twin --config " + (out / "twin-config.yaml").string() + " --seed 1 --other --steps 2\n")
      << resumed.output;
  const auto timing = nlohmann::json::parse(std::ifstream(out / "timing.json"));
  EXPECT_DOUBLE_EQ(timing["twin"].get<double>(), 0.15);
  EXPECT_DOUBLE_EQ(timing["other"].get<double>(), 0.15);
  EXPECT_DOUBLE_EQ(timing["kiln"].get<double>(), 0.1);
  const auto summary = nlohmann::json::parse(std::ifstream(out / "summary.json"));
  EXPECT_DOUBLE_EQ(summary["variants"]["kiln"]["mean"].get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(summary["variants"]["other"]["mean"].get<double>(), 1.1);

  // A kiln run a signal stopped (a time limit's SIGTERM) writes a summary that says so: it did
  // not end, and runs again.
  std::ofstream(out / "kiln-s1" / "summary.json")
      << R"({"tokens_per_step": 1000, "stopped": {"signal": "SIGTERM", "step": 1}})";
  const auto [again, stopped] = run("--resume");
  ASSERT_EQ(again.status, 0) << again.output;
  EXPECT_EQ(stopped, "kiln kiln-s1\n") << again.output;
}

}  // namespace
