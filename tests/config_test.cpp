// Tests for train/config.cpp: defaults, parsing, overrides, derived fields, every error path
// (each must throw InputError naming the key), config_to_yaml round-trip, and docs/config.md.
#include "train/config.h"
#include "train/model_config.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "kernels/error.h"
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
            rope_theta: 500000}
data:      {train: "data/x/train_*.bin", val: "data/x/val_*.bin", shuffle: false, prefetch: false}
train:     {device: cpu, batch_size: 4, grad_accum: 2, max_steps: 50, eval_every: 10,
            eval_steps: 2, log_every: 5, seed: -7, out_dir: runs/x, checkpoint_every: 25,
            keep_checkpoints: 3, resume: none, sample_every: 0, sample_tokens: 16,
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
  EXPECT_EQ(g.model.norm, "layernorm");
  EXPECT_EQ(g.model.positions, "learned");
  EXPECT_EQ(g.model.mlp, "gelu");
  EXPECT_TRUE(g.model.bias);
  EXPECT_TRUE(g.model.tie_embeddings);
  EXPECT_EQ(g.model.ffn_dim, 4 * 768);

  const Config l = parse_config(kMinimal + "model: {arch: llama}\n", {});
  EXPECT_EQ(l.model.norm, "rmsnorm");
  EXPECT_EQ(l.model.positions, "rope");
  EXPECT_EQ(l.model.mlp, "swiglu");
  EXPECT_FALSE(l.model.bias);
  EXPECT_FALSE(l.model.qkv_bias);
  EXPECT_FALSE(l.model.qk_norm);
  EXPECT_FALSE(l.model.tie_embeddings);
  EXPECT_EQ(l.model.ffn_dim, 2048);  // 8/3 * 768, rounded up to a multiple of 256

  const Config q = parse_config(kMinimal + "model: {arch: qwen3, tie_embeddings: false}\n", {});
  EXPECT_TRUE(q.model.qk_norm);
  EXPECT_DOUBLE_EQ(q.model.norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(q.model.rope_theta, 1e6);
  EXPECT_FALSE(q.model.tie_embeddings);  // the file's key beats the arch's default

  // An override of the arch brings its defaults; an override of a choice beats them.
  const Config o = parse_config(kMinimal, {"--model.arch=llama", "--model.mlp=gelu"});
  EXPECT_EQ(o.model.norm, "rmsnorm");
  EXPECT_EQ(o.model.mlp, "gelu");
  // Llama 3.1's scaling: the keys reach ModelConfig.
  const Config r = parse_config(kMinimal + "model: {arch: llama, rope_theta: 500000, "
                                           "rope_scaling: llama3, rope_original_max_position: 4096}\n",
                                {});
  const ModelConfig rm = model_config(r.model);
  EXPECT_EQ(rm.rope_scaling, (RopeScaling{"llama3", 8.0f, 1.0f, 4.0f, 4096}));
  EXPECT_EQ(rm.rope_theta, 500000.0f);
  EXPECT_EQ(model_config(l.model).rope_scaling, RopeScaling{});
  EXPECT_TRUE(model_section(rm).rope_scaling == "llama3");
  EXPECT_EQ(model_section(rm).rope_original_max_position, 4096);
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
      {"model: {arch: llama, bias: true}",
       "model.qkv_bias: false contradicts model.bias: true"},
      {"model: {arch: llama, n_head: 4, n_embd: 20}", "model.n_embd: RoPE rotates pairs"},
      {"model: {arch: llama, head_dim: 7}", "model.head_dim: RoPE rotates pairs"},
      {"model: {n_embd: 100, head_dim: 64}", ""},  // head_dim set: n_embd need not divide
      {"model: {rope_scaling: llama3}", "model.rope_scaling: llama3 scales RoPE, but"},
      {"model: {arch: llama, rope_scaling: yarn}", "model.rope_scaling: must be one of none, llama3"},
      {"model: {arch: llama, rope_factor: 8}", ""},  // the default: nothing is changed
      {"model: {arch: llama, rope_factor: 16}",
       "model.rope_factor: is used only with model.rope_scaling: llama3"},
      {"model: {arch: llama, rope_original_max_position: 4096}",
       "model.rope_original_max_position: is used only with model.rope_scaling: llama3"},
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
        "llama-1.36b", "qwen3-1.7b", "moe-tiny", "moe-2.9b-a1b", "llama3-8b", "qwen3-8b"}) {
    const std::string path = std::string(KILN_SOURCE_DIR) + "/configs/" + name + ".yaml";
    EXPECT_NO_THROW(load_config(path, {})) << path;
  }
  const Config q = load_config(std::string(KILN_SOURCE_DIR) + "/configs/qwen3-1.7b.yaml", {});
  EXPECT_EQ(q.model.head_dim, 128);
  EXPECT_EQ(q.model.n_kv_head, 8);
  EXPECT_TRUE(q.model.qk_norm);
  // Llama-3.1-8B's RoPE: theta 5e5 and its llama3 scaling reach the model.
  const Config l = load_config(std::string(KILN_SOURCE_DIR) + "/configs/llama3-8b.yaml", {});
  const ModelConfig lm = model_config(l.model);
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
  EXPECT_EQ(c.moe.n_experts, 8);
  EXPECT_EQ(c.moe.top_k, 2);
  EXPECT_EQ(c.moe.expert_ffn_dim, 512);  // 0 -> model.ffn_dim
  EXPECT_EQ(c.moe.balance, "aux_loss");
  EXPECT_EQ(parse_config(moe, {"moe.expert_ffn_dim=64"}).moe.expert_ffn_dim, 64);
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

}  // namespace
}  // namespace kiln
