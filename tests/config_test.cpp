// Tests for config/config.cpp: defaults, parsing, overrides, derived fields, every error path
// (each must throw InputError naming the key), config_to_yaml round-trip, and docs/config.md.
#include "config/config.h"
#include "config/model_config.h"

#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include "base/error.h"
#include "tests/input_error.h"
#include "tests/test_process.h"

namespace kiln {
namespace {

const std::string kMinimal = "data:\n  train: data/x/train_*.bin\n";

using kiln::testing::input_error;

std::string parse_error(const std::string& yaml, const std::vector<std::string>& overrides = {}) {
  return input_error([&] { parse_config(yaml, overrides, "run.yaml"); });
}

std::string override_error(const std::string& override_text) {
  return parse_error(kMinimal, {override_text});
}

TEST(ConfigDefaults, MinimalFileGetsSchemaDefaultsAndDerivedFields) {
  Config c = parse_config(kMinimal, {});
  EXPECT_EQ(c.model.arch, "gpt2");
  EXPECT_EQ(c.model.n_layer, 12);
  EXPECT_EQ(c.model.n_kv_head, 12);             // 0 -> n_head
  EXPECT_EQ(c.model.ffn_dim, 4 * 768);          // 0 -> 4 * n_embd
  EXPECT_EQ(c.model.padded_vocab_size, 50304);  // 50257 up to a multiple of 128
  EXPECT_EQ(c.data.train, "data/x/train_*.bin");
  EXPECT_EQ(c.data.val, "");
  EXPECT_EQ(c.train.seed, 1337);
  EXPECT_EQ(c.train.resume, "auto");
  EXPECT_DOUBLE_EQ(c.optim.lr, 6.0e-4);
  EXPECT_EQ(c.precision.dtype, "bf16");
  EXPECT_FALSE(c.precision.deterministic);
  EXPECT_EQ(c.dist.strategy, "ddp");
  EXPECT_DOUBLE_EQ(c.dist.bucket_mb, 0.0);  // chosen by the link between the ranks
}

TEST(ConfigParse, FullFileParses) {
  Config c = parse_config(R"(
model:     {arch: gpt2, n_layer: 4, n_head: 8, n_kv_head: 2, n_embd: 256, ffn_dim: 1000,
            vocab_size: 256, padded_vocab_size: 512, seq_len: 128, tie_embeddings: false,
            positions: rope, rope_theta: 500000}
data:      {train: "data/x/train_*.bin", val: "data/x/val_*.bin", shuffle: false, prefetch: false}
train:     {device: cpu, batch_size: 4, grad_accum: 2, max_steps: 50, eval_every: 10,
            eval_steps: 2, log_every: 5, seed: -7, out_dir: runs/x, checkpoint_every: 25,
            keep_checkpoints: 3, resume: none, sample_every: 10, sample_tokens: 16,
            cuda_graphs: false, peak_tflops: 989.5}
optim:     {name: adamw, lr: 6.0e-4, min_lr: 6e-5, warmup_steps: 0, schedule: linear,
            weight_decay: 0, beta1: 0.8, beta2: 0.99, eps: 1.0e-8, grad_clip: 0.5}
precision: {dtype: fp32, fp8: true, attention: naive, deterministic: true}
dist:      {strategy: zero1, bucket_mb: 50, timeout_s: 60}
)",
                          {});
  EXPECT_EQ(c.model.n_layer, 4);
  EXPECT_EQ(c.model.n_kv_head, 2);
  EXPECT_EQ(c.model.ffn_dim, 1000);
  EXPECT_EQ(c.model.padded_vocab_size, 512);
  EXPECT_FALSE(c.model.tie_embeddings);
  EXPECT_DOUBLE_EQ(c.model.rope_theta, 500000.0);  // an int where a double is expected
  EXPECT_EQ(c.data.val, "data/x/val_*.bin");
  EXPECT_FALSE(c.data.shuffle);
  EXPECT_EQ(c.train.device, "cpu");
  EXPECT_EQ(c.train.seed, -7);
  EXPECT_EQ(c.train.resume, "none");
  EXPECT_DOUBLE_EQ(c.train.peak_tflops, 989.5);
  EXPECT_DOUBLE_EQ(c.optim.lr, 6.0e-4);
  EXPECT_DOUBLE_EQ(c.optim.min_lr, 6.0e-5);
  EXPECT_DOUBLE_EQ(c.optim.weight_decay, 0.0);
  EXPECT_EQ(c.optim.schedule, "linear");
  EXPECT_TRUE(c.precision.fp8);
  EXPECT_EQ(c.precision.attention, "naive");
  EXPECT_TRUE(c.precision.deterministic);
  EXPECT_EQ(c.dist.strategy, "zero1");
  EXPECT_DOUBLE_EQ(c.dist.bucket_mb, 50.0);
  EXPECT_EQ(c.dist.timeout_s, 60);
}

TEST(ConfigParse, LoadsFromFile) {
  const std::string path = kiln::testing::make_temp_dir("kiln_config_") + "/load.yaml";
  std::ofstream(path) << kMinimal << "train:\n  batch_size: 3\n";
  Config c = load_config(path, {"train.grad_accum=5"});
  EXPECT_EQ(c.train.batch_size, 3);
  EXPECT_EQ(c.train.grad_accum, 5);
}

TEST(ConfigParse, EmptySectionKeepsDefaults) {
  Config c = parse_config(kMinimal + "dist:\n", {});
  EXPECT_EQ(c.dist.strategy, "ddp");
}

TEST(ConfigDerived, ExplicitValuesAreKept) {
  Config c = parse_config(kMinimal + "model: {n_head: 12, n_kv_head: 4, ffn_dim: 2048}\n", {});
  EXPECT_EQ(c.model.n_kv_head, 4);
  EXPECT_EQ(c.model.ffn_dim, 2048);
}

TEST(ConfigDerived, PaddedVocabRoundsUpTo128) {
  EXPECT_EQ(parse_config(kMinimal, {"model.vocab_size=256"}).model.padded_vocab_size, 256);
  EXPECT_EQ(parse_config(kMinimal, {"model.vocab_size=257"}).model.padded_vocab_size, 384);
  EXPECT_EQ(parse_config(kMinimal, {"model.vocab_size=65536"}).model.padded_vocab_size, 65536);
}

TEST(ConfigDerived, FollowOverriddenBaseFields) {
  Config c = parse_config(kMinimal, {"model.n_head=4", "model.n_embd=128"});
  EXPECT_EQ(c.model.n_kv_head, 4);
  EXPECT_EQ(c.model.ffn_dim, 512);
}

TEST(ConfigOverrides, WinOverFileAndApplyInOrder) {
  Config c = parse_config(kMinimal + "train: {batch_size: 4}\noptim: {lr: 1.0e-3}\n",
                          {"--train.batch_size=16", "optim.lr=3e-4", "--optim.lr=2e-4",
                           "data.val=", "train.out_dir=runs/a=b"});
  EXPECT_EQ(c.train.batch_size, 16);
  EXPECT_DOUBLE_EQ(c.optim.lr, 2e-4);
  EXPECT_EQ(c.data.val, "");
  EXPECT_EQ(c.train.out_dir, "runs/a=b");  // only the first '=' splits
}

TEST(ConfigOverrides, StringValuesAreVerbatim) {
  Config c = parse_config(kMinimal, {"data.train=*.bin", "train.resume=runs/x/step_100"});
  EXPECT_EQ(c.data.train, "*.bin");  // not a YAML alias
  EXPECT_EQ(c.train.resume, "runs/x/step_100");
}

TEST(ConfigOverrides, MalformedAreErrors) {
  for (const char* bad : {"--train.batch_size", "train=3", "batch_size=3", "--=3"}) {
    std::string msg = override_error(bad);
    EXPECT_NE(msg.find(std::string("'") + bad + "'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("section.key=value"), std::string::npos) << msg;
  }
  std::string msg = override_error("--train.batchsize=3");
  EXPECT_NE(msg.find("override '--train.batchsize=3'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("did you mean 'train.batch_size'"), std::string::npos) << msg;
  EXPECT_NE(override_error("train.batch_size.x=3").find("unknown key"), std::string::npos);
}

TEST(ConfigOverrides, TypedLikeTheFile) {
  std::string msg = override_error("--train.batch_size=abc");
  EXPECT_NE(msg.find("train.batch_size: expected an integer, got 'abc'"), std::string::npos) << msg;
  EXPECT_NE(override_error("precision.fp8=1").find("precision.fp8: expected true or false"),
            std::string::npos);
  EXPECT_NE(override_error("train.batch_size=").find("got ''"), std::string::npos);
}

TEST(ConfigOverrides, RangeErrorNamesTheOverride) {
  std::string msg = override_error("train.batch_size=-1");
  EXPECT_NE(msg.find("override 'train.batch_size=-1': train.batch_size: must be > 0, got -1"),
            std::string::npos)
      << msg;
}

TEST(ConfigErrors, UnknownKeySuggestsTheNearestKey) {
  std::string msg = parse_error(kMinimal + "train:\n  batchsize: 8\n");
  EXPECT_NE(msg.find("run.yaml:4: unknown key 'train.batchsize' (did you mean "
                     "'train.batch_size'?)"),
            std::string::npos)
      << msg;
  msg = parse_error(kMinimal + "train:\n  lr: 1\n");  // right key, wrong section
  EXPECT_NE(msg.find("did you mean 'optim.lr'?"), std::string::npos) << msg;
  msg = parse_error(kMinimal + "train:\n  zzzzzzzzzz: 1\n");
  EXPECT_NE(msg.find("unknown key 'train.zzzzzzzzzz'"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("did you mean"), std::string::npos) << msg;
}

TEST(ConfigErrors, UnknownSection) {
  std::string msg = parse_error(kMinimal + "optimizer:\n  lr: 1\n");
  EXPECT_NE(msg.find("unknown section 'optimizer' (did you mean 'optim'?)"), std::string::npos)
      << msg;
}

TEST(ConfigErrors, WrongTypeForInt) {
  for (const char* v : {"3.5", "abc", "true", "1e3", "0x10", "99999999999"}) {
    std::string msg = parse_error(kMinimal + "train: {batch_size: " + v + "}\n");
    EXPECT_NE(msg.find("train.batch_size: expected"), std::string::npos) << v << ": " << msg;
    EXPECT_NE(msg.find(std::string("got '") + v + "'"), std::string::npos) << msg;
  }
}

TEST(ConfigErrors, WrongTypeForDouble) {
  for (const char* v : {"abc", "true", ".inf", "nan", "6e-4x"}) {
    std::string msg = parse_error(kMinimal + "optim: {lr: " + v + "}\n");
    EXPECT_NE(msg.find(std::string("optim.lr: expected a number, got '") + v + "'"),
              std::string::npos)
        << msg;
  }
}

TEST(ConfigErrors, WrongTypeForBool) {
  for (const char* v : {"yes", "1", "True", "on"}) {
    std::string msg = parse_error(kMinimal + "precision: {fp8: " + v + "}\n");
    EXPECT_NE(msg.find("precision.fp8: expected true or false"), std::string::npos) << msg;
  }
}

TEST(ConfigErrors, NonScalarWhereScalarExpected) {
  std::string msg = parse_error(kMinimal + "train: {batch_size: [1, 2]}\n");
  EXPECT_NE(msg.find("train.batch_size: expected an integer, got a sequence"), std::string::npos)
      << msg;
  msg = parse_error("data: {train: {a: b}}\n");
  EXPECT_NE(msg.find("data.train: expected a string, got a map"), std::string::npos) << msg;
  msg = parse_error("train: 3\n");
  EXPECT_NE(msg.find("train: expected a map of keys"), std::string::npos) << msg;
  msg = parse_error("- model\n");
  EXPECT_NE(msg.find("expected a map of sections"), std::string::npos) << msg;
}

TEST(ConfigErrors, OutOfRangeValuesNameKeyAndRange) {
  struct Case {
    std::string yaml, expected;
  };
  for (const Case& c : std::vector<Case>{
           {"train: {batch_size: -4}", "train.batch_size: must be > 0, got -4"},
           {"model: {n_layer: 0}", "model.n_layer: must be in (0, 4096], got 0"},
           {"model: {n_layer: 5000}", "model.n_layer: must be in (0, 4096], got 5000"},
           {"model: {n_embd: 100}", "model.n_embd: must be divisible by model.n_head (12)"},
           {"model: {n_kv_head: 5}", "model.n_kv_head: must divide model.n_head (12), got 5"},
           {"model: {vocab_size: 600000}", "model.vocab_size: must be in (0, 524288], got 600000"},
           {"model: {vocab_size: 300, padded_vocab_size: 256}",
            "model.padded_vocab_size: must be >= model.vocab_size (300), got 256"},
           {"optim: {lr: 0}", "optim.lr: must be > 0, got 0"},
           {"optim: {lr: 1.0e-4, min_lr: 1.0e-3}", "optim.min_lr: must be <= optim.lr"},
           {"optim: {beta2: 1}", "optim.beta2: must be in [0, 1), got 1"},
           {"optim: {eps: -1.0e-8}", "optim.eps: must be > 0, got -1e-08"},
           {"optim: {warmup_steps: -1}", "optim.warmup_steps: must be >= 0, got -1"},
           {"train: {keep_checkpoints: 0}", "train.keep_checkpoints: must be >= 1, got 0"},
           {"dist: {timeout_s: 0}", "dist.timeout_s: must be >= 1, got 0"},
           {"dist: {bucket_mb: -1}", "dist.bucket_mb: must be >= 0, got -1"},
           {"optim: {name: muon, muon_exchange_mb: -1}",
            "optim.muon_exchange_mb: must be >= 0, got -1"},
           {"dist: {reduce_dtype: fp16}",
            "dist.reduce_dtype: must be one of fp32, bf16, got 'fp16'"},
           {"dist: {overlap_ctas: 65}", "dist.overlap_ctas: must be in [0, 64], got 65"},
           {"dist: {overlap_ctas: 2.5}", "dist.overlap_ctas"},
       }) {
    std::string msg = parse_error(kMinimal + c.yaml + "\n");
    EXPECT_NE(msg.find(c.expected), std::string::npos) << c.yaml << " -> " << msg;
    EXPECT_EQ(msg.rfind("run.yaml:", 0), 0u) << msg;  // points at the file that set it
  }
}

TEST(ConfigErrors, BadEnumValueListsTheChoices) {
  std::string msg = parse_error(kMinimal + "train: {device: gpu}\n");
  EXPECT_NE(msg.find("train.device: must be one of auto, cpu, cuda, got 'gpu'"), std::string::npos)
      << msg;
  EXPECT_NE(parse_error(kMinimal + "model: {arch: mamba}\n").find("model.arch"), std::string::npos);
  EXPECT_NE(override_error("dist.strategy=zero3").find("dist.strategy: must be one of ddp"),
            std::string::npos);
}

TEST(ConfigErrors, MissingTrainGlob) {
  std::string msg = parse_error("train: {batch_size: 4}\n");
  EXPECT_NE(msg.find("data.train: must be non-empty"), std::string::npos) << msg;
}

TEST(ConfigErrors, DuplicateKey) {
  std::string msg = parse_error(kMinimal + "train:\n  batch_size: 4\n  batch_size: 8\n");
  EXPECT_NE(msg.find("'train.batch_size' appears twice"), std::string::npos) << msg;
}

TEST(ConfigErrors, MissingFileNamesThePath) {
  std::string msg = input_error([] { load_config("/nonexistent/kiln.yaml", {}); });
  EXPECT_NE(msg.find("/nonexistent/kiln.yaml: cannot read config file"), std::string::npos) << msg;
  msg = input_error([] { load_config(std::filesystem::temp_directory_path().string(), {}); });
  EXPECT_NE(msg.find("is a directory"), std::string::npos) << msg;
}

// An empty file is not "all defaults" (that trains GPT-2 124M): it is refused, naming the file.
TEST(ConfigErrors, EmptyFileIsRefusedNamingIt) {
  const std::string path = kiln::testing::make_temp_dir("kiln_config_") + "/empty.yaml";
  for (const char* text : {"", "\n  \n", "# only a comment\n---\n"}) {
    std::ofstream(path) << text;
    const std::string msg = input_error([&] { load_config(path, {"data.train=x"}); });
    EXPECT_NE(msg.find(path + ": the config file is empty"), std::string::npos) << msg;
  }
}

TEST(ConfigErrors, YamlSyntaxErrorNamesFileAndLine) {
  std::string msg = parse_error(kMinimal + "train:\n  batch_size: [1, 2\n");
  EXPECT_NE(msg.find("run.yaml:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("YAML syntax error"), std::string::npos) << msg;
  msg = parse_error("model:\n  n_layer: 4\n   n_head: 4\n");
  EXPECT_NE(msg.find("run.yaml:3:"), std::string::npos) << msg;
}

TEST(ConfigYaml, RoundTripsEveryKey) {
  Config c = parse_config(kMinimal, {"optim.lr=0.1", "optim.min_lr=0.030000000000000002",
                                     "optim.eps=1e-300", "train.peak_tflops=989.4999999999999",
                                     "train.seed=-9223372036854775808", "precision.fp8=true"});
  for (const char* odd : {"", "null", "~", "true", "123", "a: b", "#x", "- x", "say \"hi\"",
                          "back\\slash", "tab\there", " spaced ", "naïve", "*.bin", "'q'"}) {
    c.data.val = odd;
    c.train.resume = odd;
    std::string yaml = config_to_yaml(c);
    Config back = parse_config(yaml, {});
    EXPECT_EQ(back.data.val, odd) << yaml;
    EXPECT_TRUE(back == c) << yaml;
  }
}

TEST(ConfigYaml, ListsEverySectionInSchemaOrder) {
  std::string yaml = config_to_yaml(parse_config(kMinimal, {}));
  size_t last = 0;
  for (const char* section :
       {"\nmodel:\n", "\ndata:\n", "\ntrain:\n", "\noptim:\n", "\nprecision:\n", "\ndist:\n"}) {
    size_t at = yaml.find(section);
    ASSERT_NE(at, std::string::npos) << section << yaml;
    EXPECT_GT(at, last);
    last = at;
  }
  EXPECT_NE(yaml.find("  lr: 0.0006\n"), std::string::npos) << yaml;
  EXPECT_NE(yaml.find("  n_kv_head: 12\n"), std::string::npos) << yaml;
}

TEST(ConfigYaml, EqualityComparesEveryField) {
  Config a = parse_config(kMinimal, {});
  Config b = a;
  EXPECT_TRUE(a == b);
  b.dist.timeout_s += 1;
  EXPECT_TRUE(a != b);
}

// model.arch sets the layer-choice keys; keys given in the file or as overrides beat it.
TEST(ConfigArch, ArchSetsTheLayerChoicesAndKeysOverrideThem) {
  const Config g = parse_config(kMinimal, {});
  EXPECT_EQ(g.model.norm, NormKind::layernorm);
  EXPECT_EQ(g.model.positions, PositionKind::learned);
  EXPECT_EQ(g.model.mlp, MlpKind::gelu);
  EXPECT_TRUE(g.model.bias);
  EXPECT_TRUE(g.model.tie_embeddings);
  EXPECT_EQ(g.model.ffn_dim, 4 * 768);

  const Config l = parse_config(kMinimal + "model: {arch: llama}\n", {});
  EXPECT_EQ(l.model.norm, NormKind::rmsnorm);
  EXPECT_EQ(l.model.positions, PositionKind::rope);
  EXPECT_EQ(l.model.mlp, MlpKind::swiglu);
  EXPECT_FALSE(l.model.bias);
  EXPECT_FALSE(l.model.qkv_bias);
  EXPECT_FALSE(l.model.qk_norm);
  EXPECT_FALSE(l.model.tie_embeddings);
  EXPECT_EQ(l.model.ffn_dim, 2048);  // 8/3 * 768, rounded up to a multiple of 256

  const Config q = parse_config(kMinimal + "model: {arch: qwen3, tie_embeddings: false}\n", {});
  EXPECT_TRUE(q.model.qk_norm);
  EXPECT_FLOAT_EQ(q.model.norm_eps, 1e-6f);
  EXPECT_FLOAT_EQ(q.model.rope_theta, 1e6f);
  EXPECT_FALSE(q.model.tie_embeddings);  // the file's key beats the arch's default

  // An override of the arch brings its defaults; an override of a choice beats them.
  const Config o = parse_config(kMinimal, {"--model.arch=llama", "--model.mlp=gelu"});
  EXPECT_EQ(o.model.norm, NormKind::rmsnorm);
  EXPECT_EQ(o.model.mlp, MlpKind::gelu);
  // Llama 3.1's scaling: the keys are ModelConfig's (the model section is the model's config).
  const Config r = parse_config(kMinimal + "model: {arch: llama, rope_theta: 500000, "
                                           "rope_scaling: llama3, rope_original_max_position: 4096}\n",
                                {});
  const ModelConfig& rm = r.model;
  EXPECT_EQ(rm.rope_scaling, (RopeScaling{"llama3", 8.0f, 1.0f, 4.0f, 4096}));
  EXPECT_EQ(rm.rope_theta, 500000.0f);
  EXPECT_EQ(l.model.rope_scaling, RopeScaling{});
  EXPECT_TRUE(rm.rope_scaling.type == "llama3");
  EXPECT_EQ(rm.rope_scaling.original_max_position, 4096);
  // The resolved config reads back to itself.
  EXPECT_TRUE(parse_config(config_to_yaml(r), {}) == r);
  EXPECT_TRUE(parse_config(config_to_yaml(q), {}) == q);
  EXPECT_TRUE(parse_config(config_to_yaml(o), {}) == o);
}

TEST(ConfigArch, InconsistentChoicesAreRefusedNamingTheKey) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"model: {arch: mamba}", "model.arch: must be one of gpt2, llama, qwen3"},
      {"model: {norm: batchnorm}", "model.norm: must be one of layernorm, rmsnorm"},
      {"model: {norm_eps: 1.0e-6}", "model.norm_eps: layernorm's epsilon is fixed at 1e-5"},
      {"model: {arch: llama, bias: true}", "model.qkv_bias: false contradicts model.bias: true"},
      {"model: {arch: llama, n_head: 4, n_embd: 20}", "model.n_embd: RoPE rotates pairs"},
      {"model: {arch: llama, head_dim: 7}", "model.head_dim: RoPE rotates pairs"},
      {"model: {n_embd: 100, head_dim: 64}", ""},  // head_dim set: n_embd need not divide
      {"model: {rope_scaling: llama3}",
       "model.rope_scaling: is set, but model.positions is learned"},
      {"model: {arch: llama, rope_scaling: yarn}",
       "model.rope_scaling: must be one of none, llama3"},
      {"model: {arch: llama, rope_scaling: llama3, rope_factor: 8}", ""},  // with its enabler
      {"model: {arch: llama, rope_factor: 16}",
       "model.rope_factor: is set, but model.rope_scaling is none (only model.rope_scaling: "
       "llama3 reads it)"},
      {"model: {arch: llama, rope_original_max_position: 4096}",
       "model.rope_original_max_position: is set, but model.rope_scaling is none"},
      {"model: {arch: llama, rope_scaling: llama3, rope_low_freq_factor: 4}",
       "model.rope_high_freq_factor: must be > model.rope_low_freq_factor (4), got 4"},
      {"model: {arch: llama, rope_scaling: llama3, rope_factor: 0}", "model.rope_factor"},
  };
  for (const auto& [yaml, expect] : cases) {
    if (expect.empty()) {
      EXPECT_NO_THROW(parse_config(kMinimal + yaml + "\n", {})) << yaml;
      continue;
    }
    const std::string msg = parse_error(kMinimal + yaml + "\n");
    EXPECT_NE(msg.find(expect), std::string::npos) << yaml << ": " << msg;
  }
}

// dist.max_restarts resumes a failed run from its newest checkpoint: it needs resume=auto and
// checkpoints during the run, and says so naming the key (and the flag that sets it).
TEST(ConfigRestarts, RefusedWhereARestartCouldNotResume) {
  const std::string ok =
      "train: {checkpoint_every: 100}\ndist: {max_restarts: 3, "
      "restart_backoff_s: 0.5}\n";
  const Config c = parse_config(kMinimal + ok, {});
  EXPECT_EQ(c.dist.max_restarts, 3);
  EXPECT_EQ(c.dist.restart_backoff_s, 0.5);
  EXPECT_EQ(parse_config(kMinimal, {}).dist.max_restarts, 0);
  EXPECT_EQ(parse_config(kMinimal, {}).dist.restart_backoff_s, 1.0);
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"train.resume=none"},
       "run.yaml:4: dist.max_restarts: is 3 (--max-restarts sets it too), but a restart resumes "
       "from the newest checkpoint in train.out_dir, which needs train.resume=auto (this run's "
       "is none)"},
      {{"train.resume=runs/x/checkpoints/step_00000100"}, "needs train.resume=auto"},
      {{"train.save_checkpoints=false"},
       "train.save_checkpoints is false: a restart would start again from step 0"},
      {{"train.checkpoint_every=0"}, "train.checkpoint_every is 0"},
      {{"dist.max_restarts=-1"}, "dist.max_restarts"},
      {{"dist.restart_backoff_s=-1"}, "dist.restart_backoff_s"},
  };
  for (const auto& [overrides, expect] : cases) {
    const std::string msg = parse_error(kMinimal + ok, overrides);
    EXPECT_NE(msg.find(expect), std::string::npos) << overrides[0] << ": " << msg;
  }
  // Without restarts the same keys are fine.
  EXPECT_NO_THROW(parse_config(kMinimal, {"train.resume=none", "train.checkpoint_every=0"}));
}

// train.recompute_full_blocks and train.recompute_kept_blocks pick blocks of the model that
// exist, not the same ones; full blocks are refused where every block recomputes fully already.
// (Kept blocks under train.recompute=none keep what every block keeps: a config's kept blocks
// stay valid when a run turns recomputation off.)
TEST(ConfigRecompute, FullBlocksAreCheckedAgainstTheModel) {
  const Config c = parse_config(kMinimal, {"train.recompute=light", "train.recompute_full_blocks=2"});
  EXPECT_EQ(c.train.recompute_full_blocks, 2);
  EXPECT_EQ(parse_config(kMinimal, {}).train.recompute_full_blocks, 0);
  EXPECT_EQ(parse_config(kMinimal, {}).train.recompute_kept_blocks, 0);
  const Config kept = parse_config(kMinimal, {"train.recompute=light",
                                              "train.recompute_full_blocks=1",
                                              "train.recompute_kept_blocks=1"});
  EXPECT_EQ(kept.train.recompute_kept_blocks, 1);
  EXPECT_EQ(parse_config(config_to_yaml(kept), {}), kept);
  EXPECT_NO_THROW(parse_config(kMinimal, {"train.recompute_kept_blocks=1"}));
  EXPECT_EQ(parse_config(config_to_yaml(c), {}), c);
  const int layers = c.model.n_layer;
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"train.recompute_full_blocks=" + std::to_string(layers + 1)},
       "train.recompute_full_blocks: must be <= model.n_layer (" + std::to_string(layers) +
           "), got " + std::to_string(layers + 1)},
      {{"train.recompute=full", "train.recompute_full_blocks=1"},
       "train.recompute_full_blocks: is set, but train.recompute is full: every block "
       "recomputes fully already"},
      {{"train.recompute_full_blocks=-1"}, "train.recompute_full_blocks: must be >= 0"},
      {{"train.recompute=light", "train.recompute_full_blocks=1",
        "train.recompute_kept_blocks=" + std::to_string(layers)},
       "train.recompute_kept_blocks: and train.recompute_full_blocks (1) must add up to <= "
       "model.n_layer (" + std::to_string(layers) + "), got " + std::to_string(layers)},
      {{"train.recompute_kept_blocks=-1"}, "train.recompute_kept_blocks: must be >= 0"},
  };
  for (const auto& [overrides, expect] : cases) {
    const std::string msg = parse_error(kMinimal, overrides);
    EXPECT_NE(msg.find(expect), std::string::npos) << overrides[0] << ": " << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

// Every config the repository ships parses and validates.
TEST(ConfigArch, ShippedConfigsLoad) {
  for (const char* name :
       {"tiny", "gpt2-124m", "gpt2-350m", "llama-tiny", "llama-tiny-docs", "qwen3-tiny",
        "llama-1.36b", "qwen3-1.7b", "moe-tiny", "moe-2.9b-a1b", "llama3-8b", "llama3-70b", "qwen3-8b"}) {
    const std::string path = std::string(KILN_SOURCE_DIR) + "/configs/" + name + ".yaml";
    EXPECT_NO_THROW(load_config(path, {})) << path;
  }
  const Config q = load_config(std::string(KILN_SOURCE_DIR) + "/configs/qwen3-1.7b.yaml", {});
  EXPECT_EQ(q.model.head_dim, 128);
  EXPECT_EQ(q.model.n_kv_head, 8);
  EXPECT_TRUE(q.model.qk_norm);
  // Llama-3.1-8B's RoPE: theta 5e5 and its llama3 scaling reach the model.
  const Config l = load_config(std::string(KILN_SOURCE_DIR) + "/configs/llama3-8b.yaml", {});
  const ModelConfig& lm = l.model;
  EXPECT_EQ(lm.rope_theta, 500000.0f);
  EXPECT_EQ(lm.rope_scaling, (RopeScaling{"llama3", 8.0f, 1.0f, 4.0f, 8192}));
  EXPECT_EQ(lm.seq_len, 8192);
}

// docs/config.md embeds config_reference_markdown() between two markers. To regenerate after
// changing the schema: KILN_UPDATE_DOCS=1 ./build/bin/kiln_tests --gtest_filter=ConfigDocs.*
TEST(ConfigDocs, ReferenceMatchesSchema) {
  const std::string path = std::string(KILN_SOURCE_DIR) + "/docs/config.md";
  const std::string begin = "<!-- BEGIN config_reference_markdown() -->\n";
  const std::string end = "<!-- END config_reference_markdown() -->\n";
  std::ifstream in(path);
  ASSERT_TRUE(in) << path;
  std::stringstream text;
  text << in.rdbuf();
  std::string doc = text.str();
  size_t b = doc.find(begin), e = doc.find(end);
  ASSERT_NE(b, std::string::npos);
  ASSERT_NE(e, std::string::npos);
  b += begin.size();
  std::string generated = config_reference_markdown();
  if (std::getenv("KILN_UPDATE_DOCS")) {
    doc.replace(b, e - b, generated);
    std::ofstream(path) << doc;
    return;
  }
  EXPECT_EQ(doc.substr(b, e - b), generated)
      << "docs/config.md is stale: rerun this test with KILN_UPDATE_DOCS=1";
}

// The moe section: defaults, the derived expert width, and every rule relating its keys to
// others refused naming the key (a key that is accepted does what it says).
TEST(ConfigMoe, ParsesWithDefaultsAndRefusesWhatItCannotDo) {
  const std::string moe = kMinimal + "model: {arch: llama, ffn_dim: 512}\nmoe: {n_experts: 8}\n";
  Config c = parse_config(moe, {});
  EXPECT_EQ(c.model.moe.n_experts, 8);
  EXPECT_EQ(c.model.moe.top_k, 2);
  EXPECT_EQ(c.model.moe.expert_ffn_dim, 512);  // 0 -> model.ffn_dim
  EXPECT_EQ(c.model.moe.balance, MoeBalance::aux_loss);
  EXPECT_EQ(parse_config(moe, {"moe.expert_ffn_dim=64"}).model.moe.expert_ffn_dim, 64);
  EXPECT_EQ(parse_config(config_to_yaml(c), {}), c);
  struct Bad {
    std::string override_text, key;
  };
  for (const Bad& b :
       {Bad{"moe.top_k=9", "moe.top_k"}, Bad{"moe.n_experts=257", "moe.n_experts"},
        Bad{"moe.score=relu", "moe.score"}, Bad{"moe.balance=loss", "moe.balance"},
        Bad{"moe.aux_loss_coef=0", "moe.aux_loss_coef"},
        Bad{"dist.expert_parallel=3", "dist.expert_parallel"}, Bad{"model.bias=true", "model.bias"},
        Bad{"moe.every=0", "moe.every"}, Bad{"moe.every=13", "moe.every"}}) {
    const std::string what = input_error([&] { parse_config(moe, {b.override_text}); });
    EXPECT_NE(what.find(b.key), std::string::npos) << b.override_text << ": " << what;
  }
  EXPECT_NE(input_error([&] { parse_config(moe, {"moe.balance=none"}); }).find("moe.aux_loss_coef"),
            std::string::npos);
  EXPECT_NO_THROW(parse_config(moe, {"moe.balance=none", "moe.aux_loss_coef=0"}));
  EXPECT_NO_THROW(parse_config(moe, {"moe.balance=bias", "moe.aux_loss_coef=0"}));
  // A key nothing would read is refused: any moe key of a dense model, the bias rate without
  // the bias. A dense run's saved config (every key at its default) reads back.
  EXPECT_NE(input_error([&] { parse_config(kMinimal, {"moe.top_k=1"}); }).find("moe.top_k"),
            std::string::npos);
  EXPECT_NE(input_error([&] {
              parse_config(moe, {"moe.bias_update_rate=0.01"});
            }).find("moe.bias_update_rate"),
            std::string::npos);
  EXPECT_NO_THROW(parse_config(moe, {"moe.balance=bias", "moe.bias_update_rate=0.01"}));
  // Expert parallelism: over ranks that divide the experts, of a MoE model, on either backend.
  EXPECT_EQ(parse_config(moe, {"dist.expert_parallel=4"}).dist.expert_parallel, 4);
  EXPECT_EQ(parse_config(moe, {"dist.expert_parallel=2", "train.device=cuda"}).dist.expert_parallel,
            2);
  const std::string what = input_error(
      [&] { parse_config(kMinimal, {"dist.expert_parallel=2", "train.device=cpu"}); });  // dense
  EXPECT_NE(what.find("dist.expert_parallel"), std::string::npos) << what;
  const Config dense = parse_config(kMinimal, {});
  EXPECT_EQ(parse_config(config_to_yaml(dense), {}), dense);
}

// data.sources: a list of {train, val, weight, name} from the file or one override, names
// filled in, kept through config_to_yaml, and every bad combination refused naming the key.
TEST(ConfigSources, ParseFillNamesAndRoundTrip) {
  const std::string yaml =
      "data:\n  sources:\n    - {train: 'web/train_*.bin', val: 'web/val_*.bin', weight: 0.7, "
      "name: web}\n    - train: 'code/train_*.bin'\n      weight: 0.3\n";
  const Config c = parse_config(yaml, {});
  ASSERT_EQ(c.data.sources.size(), 2u);
  EXPECT_EQ(c.data.sources[0].name, "web");
  EXPECT_EQ(c.data.sources[0].val, "web/val_*.bin");
  EXPECT_EQ(c.data.sources[0].weight, 0.7);
  EXPECT_EQ(c.data.sources[1].name, "source1");  // unnamed: by its place
  EXPECT_EQ(c.data.sources[1].val, "");
  EXPECT_TRUE(c.data.train.empty());
  const std::string out = config_to_yaml(c);
  EXPECT_TRUE(parse_config(out, {}) == c) << out;
  const Config o =
      parse_config("", {"--data.sources=[{train: 'a/*.bin', weight: 2}, {train: b.bin}]"});
  ASSERT_EQ(o.data.sources.size(), 2u);
  EXPECT_EQ(o.data.sources[0].weight, 2.0);
  EXPECT_EQ(o.data.sources[1].weight, 1.0);
  EXPECT_TRUE(parse_config(config_to_yaml(o), {}) == o);
  const Config shipped =
      load_config(std::string(KILN_SOURCE_DIR) + "/configs/tiny-mixture.yaml", {});
  ASSERT_EQ(shipped.data.sources.size(), 2u);
  EXPECT_EQ(shipped.data.sources[1].name, "docs");
  EXPECT_EQ(shipped.data.sources[1].weight, 0.3);
}

TEST(ConfigSources, BadCombinationsAreRefusedNamingTheKey) {
  const std::string one = "data:\n  sources: [{train: a.bin}]\n";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"data:\n  train: x.bin\n  sources: [{train: a.bin}]\n",
       "data.train: is set beside data.sources"},
      {"data:\n  val: x.bin\n  sources: [{train: a.bin}]\n",
       "data.val: is set beside data.sources"},
      {"data:\n  sources: [{val: a.bin}]\n", "data.sources: entry 0 (source0): train must be"},
      {"data:\n  sources: [{train: a.bin, weight: 0}]\n", "weight must be > 0, got 0"},
      {"data:\n  sources: [{train: a.bin, weight: -1}]\n", "weight must be > 0"},
      {"data:\n  sources: [{train: a.bin, weight: heavy}]\n", "weight must be a number"},
      {"data:\n  sources: [{train: a.bin, wieght: 2}]\n", "unknown key 'wieght'"},
      {"data:\n  sources: [{train: a.bin, name: x}, {train: b.bin, name: x}]\n",
       "name 'x' appears twice"},
      {"data:\n  sources: [{train: a.bin, name: 'a b'}]\n", "name may hold only"},
      {"data:\n  sources: [a.bin]\n", "not a map"},
      {"data:\n  sources: a.bin\n", "data.sources: expected a list of"},
      {"data:\n  sources: []\n", "data.train: must be non-empty"},
  };
  for (const auto& [yaml, expect] : cases) {
    const std::string msg = parse_error(yaml);
    EXPECT_NE(msg.find(expect), std::string::npos) << yaml << "\n" << msg;
    EXPECT_EQ(msg.rfind("run.yaml", 0), 0u) << msg;  // where it is
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
  EXPECT_NE(parse_error(one, {"data.train=x.bin"}).find("data.train: is set beside"),
            std::string::npos);
  EXPECT_NE(
      parse_error(one, {"data.sources=[{train: a.bin"}).find("data.sources: expected a YAML list"),
      std::string::npos);
}

// Document masking: the separator is required with the mask, must be a token id, and no key
// is accepted that would do nothing (a separator or positions without the mask; restarting
// positions on learned positions, which are not restarted).
TEST(ConfigDocuments, BadCombinationsAreRefusedNamingTheKey) {
  const std::string rope = "model: {positions: rope, vocab_size: 256}\ndata: {train: x.bin, ";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {rope + "document_mask: true}\n",
       "data.document_separator: is required with data.document_mask: true"},
      {rope + "document_mask: true, document_separator: 256}\n",
       "data.document_separator: must be a token id below model.vocab_size (256), got 256"},
      {rope + "document_mask: true, document_separator: -2}\n",
       "data.document_separator: must be >= -1"},
      {rope + "document_separator: 0}\n",
       "data.document_separator: is set, but data.document_mask is false"},
      {rope + "document_positions: false}\n",
       "data.document_positions: is set, but data.document_mask is false"},
      {"model: {vocab_size: 256}\ndata: {train: x.bin, document_mask: true, "
       "document_separator: 0}\n",
       "data.document_positions: restarts RoPE positions with each document, but "
       "model.positions is learned"},
      {rope + "document_mask: maybe, document_separator: 0}\n", "data.document_mask"},
  };
  for (const auto& [yaml, expect] : cases) {
    const std::string msg = parse_error(yaml);
    EXPECT_NE(msg.find(expect), std::string::npos) << yaml << "\n" << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

TEST(ConfigDocuments, AcceptedCombinations) {
  const std::string base = "data: {train: x.bin, document_mask: true, document_separator: 0";
  Config c = parse_config("model: {positions: rope, vocab_size: 256}\n" + base + "}\n", {});
  EXPECT_TRUE(c.data.document_mask);
  EXPECT_EQ(c.data.document_separator, 0);
  EXPECT_TRUE(c.data.document_positions);  // the default with the mask
  // GPT-2's learned positions: the mask alone, positions running over the window.
  c = parse_config("model: {vocab_size: 256}\n" + base + ", document_positions: false}\n", {});
  EXPECT_FALSE(c.data.document_positions);
  // Overrides, and the resolved config reads back the same.
  c = parse_config("model: {positions: rope, vocab_size: 256}\ndata: {train: x.bin}\n",
                   {"--data.document_mask=true", "--data.document_separator=255"});
  EXPECT_EQ(c.data.document_separator, 255);
  EXPECT_EQ(parse_config(config_to_yaml(c), {}), c);
}

// ---- Keys that do nothing (docs/config.md; issue 52): refused, or warned once ----

// What spdlog logs while `body` runs.
std::string logged(const std::function<void()>& body) {
  std::ostringstream out;
  const auto saved = spdlog::default_logger();
  spdlog::set_default_logger(std::make_shared<spdlog::logger>(
      "capture", std::make_shared<spdlog::sinks::ostream_sink_mt>(out)));
  try {
    body();
  } catch (...) {
    spdlog::set_default_logger(saved);
    throw;
  }
  spdlog::set_default_logger(saved);
  return out.str();
}

// Each rule refuses its key where its enabler leaves it unread, naming the key, where it was
// given and the enabler's state, on one line. A key given at its default value counts too:
// given means given (in the file or an override), not "differs from the default".
TEST(ConfigKeyUse, RefusedKeyNamesItselfAndItsEnabler) {
  struct Case {
    std::string yaml;
    std::vector<std::string> overrides;
    std::string expect;
  };
  const std::string quality = kMinimal + "train: {save_checkpoints: false}\n";
  const std::vector<Case> cases = {
      {quality,
       {"--train.checkpoint_every=200"},
       "override '--train.checkpoint_every=200': train.checkpoint_every: is set, but "
       "train.save_checkpoints is false (no checkpoint is written)"},
      {quality,
       {"train.keep_checkpoints=2"},
       "train.keep_checkpoints: is set, but train.save_checkpoints is false"},
      {quality,
       {"train.checkpoint_async=true"},
       "train.checkpoint_async: is set, but train.save_checkpoints is false"},
      {kMinimal + "fp8: {margin: 2}\n",
       {},
       "run.yaml:3: fp8.margin: is set, but precision.fp8 is false"},
      {kMinimal,
       {"model.rope_theta=500000"},
       "model.rope_theta: is set, but model.positions is learned (only model.positions: rope "
       "reads the RoPE keys)"},
      {kMinimal, {"model.rope_theta=10000"}, "model.rope_theta: is set, but model.positions"},
      {kMinimal + "model: {arch: qwen3, positions: learned, rope_theta: 1000000}\n",
       {},
       "run.yaml:3: model.rope_theta: is set, but model.positions is learned"},
      {kMinimal,
       {"train.sample_tokens=64"},
       "train.sample_tokens: is set, but train.sample_every is 0"},
      {kMinimal,
       {"data.val=v.bin", "train.eval_every=0", "train.eval_steps=5"},
       "train.eval_steps: is set, but train.eval_every is 0"},
      {kMinimal, {"train.eval_every=10"}, "train.eval_every: is set, but data.val is empty"},
      {kMinimal,
       {"train.metrics_address=127.0.0.1"},
       "train.metrics_address: is set, but train.metrics_port is 0"},
      {kMinimal,
       {"optim.schedule=constant", "optim.min_lr=0"},
       "optim.min_lr: is set, but optim.schedule is constant"},
      {kMinimal,
       {"precision.fp8=true", "fp8.all_gather=false"},
       "fp8.all_gather: is set, but dist.strategy is ddp"},
      {kMinimal,
       {"dist.copy_engine_gathers=false"},
       "dist.copy_engine_gathers: is set, but dist.strategy is ddp"},
      {kMinimal,
       {"optim.muon_exchange_mb=64"},
       "optim.muon_exchange_mb: is set, but optim.name is adamw (only Muon reads it)"},
      {kMinimal,
       {"optim.name=muon", "optim.muon_exchange_mb=64"},
       "optim.muon_exchange_mb: is set, but dist.strategy is ddp"},
      {kMinimal, {"moe.every=1"}, "moe.every: is set, but moe.n_experts is 0"},
      {kMinimal, {"dist.expert_parallel=1"}, "dist.expert_parallel: is set, but moe.n_experts"},
  };
  for (const Case& c : cases) {
    const std::string msg = parse_error(c.yaml, c.overrides);
    EXPECT_NE(msg.find(c.expect), std::string::npos) << c.yaml << "\n" << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

// The same keys with what turns them on are accepted and reach the config.
TEST(ConfigKeyUse, KeyGivenWithItsEnablerIsAccepted) {
  const std::string quality = kMinimal + "train: {save_checkpoints: false}\n";
  Config c = parse_config(quality, {"--train.save_checkpoints=true", "--train.checkpoint_every=200",
                                    "train.keep_checkpoints=3", "train.checkpoint_async=true"});
  EXPECT_EQ(c.train.checkpoint_every, 200);
  EXPECT_EQ(c.train.keep_checkpoints, 3);
  c = parse_config(kMinimal + "precision: {fp8: true}\nfp8: {margin: 2, format: e4m3}\n", {});
  EXPECT_EQ(c.fp8.margin, 2);
  EXPECT_EQ(c.fp8.format, "e4m3");
  c = parse_config(kMinimal, {"model.positions=rope", "model.rope_theta=500000"});
  EXPECT_DOUBLE_EQ(c.model.rope_theta, 500000.0);
  c = parse_config(kMinimal,
                   {"train.sample_every=5", "train.sample_tokens=64", "data.val=v.bin",
                    "train.eval_every=10", "train.eval_steps=5", "train.metrics_port=9400",
                    "train.metrics_address=127.0.0.1", "optim.min_lr=0", "dist.strategy=fsdp",
                    "precision.fp8=true", "fp8.all_gather=false", "dist.copy_engine_gathers=true"});
  EXPECT_EQ(c.train.sample_tokens, 64);
  EXPECT_EQ(c.train.eval_steps, 5);
  EXPECT_EQ(c.train.metrics_address, "127.0.0.1");
  EXPECT_FALSE(c.fp8.all_gather);
  EXPECT_EQ(parse_config(config_to_yaml(c), {}), c);
}

// model.arch's row sets keys without giving them: qwen3's rope_theta is no user's, so learned
// positions do not refuse it, and the resolved config (where it is a comment) reads back.
TEST(ConfigKeyUse, ArchDefaultDoesNotCountAsSet) {
  std::vector<std::string> warnings;
  const Config q = parse_config(kMinimal + "model: {arch: qwen3, positions: learned}\n", {},
                                "run.yaml", &warnings);
  EXPECT_DOUBLE_EQ(q.model.rope_theta, 1e6);  // the row's, unread
  EXPECT_TRUE(warnings.empty()) << warnings[0];
  const Config l = parse_config(kMinimal, {"--model.arch=llama", "--model.positions=learned"},
                                "run.yaml", &warnings);
  EXPECT_TRUE(warnings.empty()) << warnings[0];
  const std::string yaml = config_to_yaml(q);
  EXPECT_NE(yaml.find("  # rope_theta: 1e+06  # unused: model.positions is learned"),
            std::string::npos)
      << yaml;
  EXPECT_EQ(parse_config(yaml, {}), q);
  EXPECT_EQ(parse_config(config_to_yaml(l), {}), l);
}

// Where an override switches off a feature keys given before it configure (--precision.fp8=false
// on an FP8 config: dev/fsdp_8b_side_by_side.sh's bf16 runs; a benchmark's
// --train.save_checkpoints=false), those keys are ignored with one warning line naming the
// override and every key, and reset to their defaults, so the run's config.yaml reads back the
// same. Logged once per process. The last word wins: a key given after the switch is refused.
TEST(ConfigKeyUse, OverrideThatSwitchesAFeatureOffWarnsOnce) {
  const std::string fp8 =
      kMinimal + "precision: {fp8: true}\nfp8: {margin: 3, amax_history_len: 7}\n";
  std::vector<std::string> warnings;
  const Config c = parse_config(fp8, {"--precision.fp8=false"}, "run.yaml", &warnings);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_EQ(warnings[0],
            "override '--precision.fp8=false': fp8.amax_history_len, fp8.margin: ignored, as "
            "precision.fp8 is false (only FP8 runs read the fp8 keys)");
  EXPECT_EQ(c.fp8.margin, 0);
  EXPECT_EQ(c.fp8.amax_history_len, 1024);
  EXPECT_EQ(parse_config(config_to_yaml(c), {}), c);
  // Without a list to fill, spdlog::warn says it, once however often the config is read.
  const std::string log = logged([&] {
    parse_config(fp8, {"--precision.fp8=false"}, "run.yaml");
    parse_config(fp8, {"--precision.fp8=false"}, "run.yaml");
  });
  EXPECT_EQ(std::count(log.begin(), log.end(), '\n'), 1) << log;
  EXPECT_NE(log.find("warning"), std::string::npos) << log;
  EXPECT_NE(log.find("fp8.margin: ignored"), std::string::npos) << log;
  // A key the same command line gives with the switch is a contradiction: refused.
  const std::string checkpoints = kMinimal + "train: {checkpoint_every: 100}\n";
  EXPECT_NO_THROW(
      parse_config(checkpoints, {"train.save_checkpoints=false"}, "run.yaml", &warnings));
  EXPECT_NE(parse_error(checkpoints, {"train.save_checkpoints=false", "train.keep_checkpoints=4"})
                .find("train.keep_checkpoints: is set, but train.save_checkpoints is false"),
            std::string::npos);
}

// dist.bucket_mb and dist.overlap_ctas under zero1 or fsdp: warned, not refused, and kept, as a
// sweep gives every strategy the same flags (dev/dist_scaling.sh's EXTRA).
TEST(ConfigKeyUse, WarnOnlyKeyIsKeptAndWarned) {
  std::vector<std::string> warnings;
  const Config c = parse_config(kMinimal + "dist: {strategy: zero1, bucket_mb: 50}\n",
                                {"dist.overlap_ctas=4"}, "run.yaml", &warnings);
  EXPECT_DOUBLE_EQ(c.dist.bucket_mb, 50.0);
  EXPECT_EQ(c.dist.overlap_ctas, 4);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_EQ(warnings[0],
            "run.yaml:3: dist.bucket_mb, dist.overlap_ctas: ignored, as dist.strategy is zero1 "
            "(only ddp all-reduces in buckets)");
  EXPECT_EQ(parse_config(config_to_yaml(c), {}), c);
}

// Every config the repository ships reads without a warning, and the documented commands that
// switch one of its features off are accepted (README, docs/PERF.md, dev/, tools/).
TEST(ConfigKeyUse, ShippedConfigsAndDocumentedSwitchesAreAccepted) {
  const std::string dir = std::string(KILN_SOURCE_DIR) + "/configs";
  int configs = 0;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir)) {
    if (entry.path().extension() != ".yaml") continue;
    std::vector<std::string> warnings;
    EXPECT_NO_THROW(load_config(entry.path().string(), {}, &warnings)) << entry.path();
    EXPECT_TRUE(warnings.empty()) << entry.path() << ": " << warnings[0];
    ++configs;
  }
  EXPECT_GE(configs, 15);
  const std::vector<std::pair<std::string, std::vector<std::string>>> commands = {
      {"llama3-8b", {"--precision.fp8=false"}},
      {"gpt2-124m", {"--train.save_checkpoints=false", "--train.eval_every=0"}},
      {"gpt2-124m", {"--nproc-per-node=2", "--dist.strategy=fsdp", "--data.val="}},
      {"moe-2.9b-a1b", {"--moe.n_experts=0", "--model.ffn_dim=4096"}},
      {"llama-tiny-docs", {"--data.document_mask=false"}},
      {"quality/gpt2-bytes", {"--train.save_checkpoints=false", "--train.resume=none"}},
      {"tiny",
       {"--train.save_checkpoints=false", "--train.eval_every=0", "--optim.lr=1e-30",
        "--optim.min_lr=0", "--train.save_checkpoints=true"}},
  };
  for (const auto& [name, overrides] : commands) {
    std::vector<std::string> flags;
    for (const std::string& o : overrides)
      if (o.rfind("--nproc", 0) != 0) flags.push_back(o);  // a launcher flag, not config
    EXPECT_NO_THROW(load_config(dir + "/" + name + ".yaml", flags, nullptr)) << name;
  }
}

// A checkpoint's stored config from before the rule holds every key, read or not: the tools and
// init.from still read it, while the same text as a user's config is refused.
TEST(ConfigKeyUse, StoredConfigWithEveryKeyStillReads) {
  const Config c = parse_config(kMinimal, {});
  std::string every_key;
  std::istringstream lines(config_to_yaml(c));
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("  # ", 0) == 0) line = "  " + line.substr(4, line.find("  # unused") - 4);
    every_key += line + "\n";
  }
  EXPECT_NE(every_key.find("\n  rope_theta: 10000\n"), std::string::npos) << every_key;
  EXPECT_EQ(parse_stored_config(every_key, "manifest.yaml"), c);
  EXPECT_NE(input_error([&] {
              parse_config(every_key, {}, "manifest.yaml");
            }).find("moe.top_k: is set, but moe.n_experts is 0"),
            std::string::npos);
}

}  // namespace
}  // namespace kiln
