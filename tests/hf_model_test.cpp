// Hugging Face import and export (hf/hf_model.h): export -> import is bit-identical in f32 (and
// bf16-rounded in bf16, sharded or not) for GPT-2, LLaMA (GQA, untied), Qwen3 (QK-norm,
// head_dim != n_embd / n_head), Qwen3-MoE and Mixtral; the files follow HF's conventions
// (GPT-2's Conv1D [in, out], q/k/v, gate/up and each expert's projections as separate tensors,
// vocab rows unpadded); config.json is read the way
// transformers 4.x and 5.x write it; and wrong inputs are InputErrors naming the cause.
#include "hf/hf_model.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <random>

#include "base/error.h"
#include "hf/safetensors.h"
#include "kernels/bf16.h"
#include "tests/input_error.h"
#include "tests/test_process.h"

namespace kiln {
namespace {

ModelConfig tiny_gpt2(bool tied = true) {
  ModelConfig c;
  c.arch = "gpt2";
  c.n_layer = 2, c.n_head = 4, c.n_kv_head = 4, c.head_dim = 0, c.n_embd = 32, c.ffn_dim = 128;
  c.vocab_size = 200, c.padded_vocab_size = 256, c.seq_len = 16, c.tie_embeddings = tied;
  return c;  // the other fields are GPT-2's defaults
}

// LLaMA or Qwen3; "mixtral" and "qwen3_moe" are them with 4 routed experts (top-2), in every
// block (renormalized) and in every other block (not renormalized).
ModelConfig tiny_rope(const std::string& name) {
  const bool mixtral = name == "mixtral", qwen_moe = name == "qwen3_moe";
  const bool llama31 = name == "llama31";  // LLaMA with Llama 3.1's RoPE scaling
  const std::string arch = mixtral || llama31 ? "llama" : qwen_moe ? "qwen3" : name;
  ModelConfig c = arch_config(arch);  // the row's layers, eps, RoPE base and tied head
  if (mixtral || qwen_moe) {
    c.moe.n_experts = 4;
    c.moe.top_k = 2;
    c.moe.expert_ffn_dim = 24;
    c.moe.every = qwen_moe ? 2 : 1;
    c.moe.renormalize = mixtral;
    c.moe.aux_loss_coef = 0.001f;
  }
  c.n_layer = 2, c.n_head = 4, c.n_kv_head = 2, c.n_embd = 32, c.ffn_dim = 48;
  c.vocab_size = 300, c.padded_vocab_size = 384, c.seq_len = 64;
  c.head_dim = arch == "qwen3" ? 16 : 0;
  if (llama31) c.rope_scaling = {"llama3", 4.0f, 1.0f, 4.0f, 32};
  return c;
}

ParamLayout layout_of(const ModelConfig& c) {
  static std::unique_ptr<Backend> cpu = make_cpu_backend();
  return make_model(c, *cpu)->layout();
}

// Every parameter distinct and random, except the padded vocab rows (zero, as kiln keeps them).
std::vector<float> random_params(const ModelConfig& c, const ParamLayout& layout) {
  std::vector<float> p(static_cast<size_t>(layout.total));
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  for (float& v : p) v = normal(rng);
  for (const char* name : {"wte", "lm_head"}) {
    for (const ParamInfo& t : layout.tensors)
      if (t.name == name)
        std::fill(p.begin() + t.offset + int64_t{c.vocab_size} * c.n_embd,
                  p.begin() + t.offset + t.numel(), 0.0f);
  }
  return p;
}

std::string temp_dir() {
  return kiln::testing::make_temp_dir("kiln_hf_");
}

// A model of config `c` with random parameters (random_params), exported to a fresh directory.
struct Exported {
  ModelConfig config;
  ParamLayout layout;
  std::vector<float> params;
  std::string dir;
  std::vector<std::string> files;  // what export_hf wrote
};

Exported export_random(const ModelConfig& c, const std::string& dtype = "f32",
                       int64_t max_shard_bytes = HfExportOptions{}.max_shard_bytes) {
  Exported e{c, layout_of(c), {}, temp_dir(), {}};
  e.params = random_params(c, e.layout);
  HfExportOptions opts;
  opts.dtype = dtype;
  opts.max_shard_bytes = max_shard_bytes;
  e.files = export_hf(e.dir, c, e.layout, e.params.data(), opts);
  return e;
}

using kiln::testing::input_error;

void expect_same_model(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_TRUE(hf_config_mismatches(a, b, "dir").empty());
  EXPECT_EQ(a.seq_len, b.seq_len);
  EXPECT_EQ(a.padded_vocab_size, b.padded_vocab_size);
  EXPECT_EQ(a.arch, b.arch);
}

class HfRoundTrip : public ::testing::TestWithParam<std::string> {
 protected:
  ModelConfig config() const {
    const std::string& p = GetParam();
    return p == "gpt2" ? tiny_gpt2() : p == "gpt2_untied" ? tiny_gpt2(false) : tiny_rope(p);
  }
};

TEST_P(HfRoundTrip, F32ExportImportIsBitIdentical) {
  const Exported e = export_random(config());
  const ModelConfig& c = e.config;
  const ParamLayout& layout = e.layout;
  const std::vector<float>& params = e.params;
  const std::string& dir = e.dir;
  const ModelConfig back = read_hf_config(dir);
  expect_same_model(c, back);
  const std::vector<float> loaded = load_hf_weights(dir, back, layout_of(back));
  ASSERT_EQ(loaded.size(), params.size());
  EXPECT_EQ(std::memcmp(loaded.data(), params.data(), params.size() * 4), 0);

  // import -> export -> import: the same files again.
  const std::string again = temp_dir();
  HfExportOptions opts;
  opts.dtype = "f32";
  export_hf(again, back, layout, loaded.data(), opts);
  std::ifstream a(dir + "/model.safetensors", std::ios::binary), b(again + "/model.safetensors", std::ios::binary);
  const std::string bytes_a((std::istreambuf_iterator<char>(a)), {}), bytes_b((std::istreambuf_iterator<char>(b)), {});
  EXPECT_EQ(bytes_a, bytes_b);
}

TEST_P(HfRoundTrip, Bf16ShardedExportImportRoundsOnce) {
  const Exported e = export_random(config(), "bf16", 8192);
  EXPECT_GT(e.files.size(), 3u);  // several shards, the index and config.json
  EXPECT_TRUE(std::filesystem::exists(e.dir + "/model.safetensors.index.json"));
  EXPECT_FALSE(std::filesystem::exists(e.dir + "/model.safetensors"));
  const std::vector<float> loaded = load_hf_weights(e.dir, e.config, e.layout);
  for (size_t i = 0; i < e.params.size(); ++i)
    ASSERT_EQ(loaded[i], bf16_to_f32(f32_to_bf16(e.params[i]))) << i;
}

INSTANTIATE_TEST_SUITE_P(Archs, HfRoundTrip,
                         ::testing::Values("gpt2", "gpt2_untied", "llama", "llama31", "qwen3",
                                           "qwen3_moe", "mixtral"));

float at(const SafetensorsFile& f, const std::string& name, int64_t i) {
  const SafeTensorInfo* t = f.find(name);
  EXPECT_NE(t, nullptr) << name;
  if (!t) return 0;
  std::vector<float> v(static_cast<size_t>(t->numel()));
  f.read_f32(*t, v.data());
  return v[static_cast<size_t>(i)];
}

float kiln_at(const std::vector<float>& p, const ParamLayout& l, const std::string& name,
              int64_t row, int64_t col) {
  const ParamInfo& t = l.find(name);
  // Rows are the last dimension wide (an expert tensor [E, R, W] is E*R rows of W).
  return p[static_cast<size_t>(t.offset + row * (t.shape.ndim >= 2 ? t.shape[t.shape.ndim - 1] : 1) + col)];
}

// GPT-2's Conv1D computes x @ W with W [in, out]; kiln's Linear x @ W^T with W [out, in].
TEST(HfLayout, Gpt2Conv1DWeightsAreTransposedAndVocabUnpadded) {
  const Exported e = export_random(tiny_gpt2());
  const ModelConfig& c = e.config;
  const ParamLayout& l = e.layout;
  const std::vector<float>& p = e.params;
  const std::string& dir = e.dir;
  const SafetensorsFile f = SafetensorsFile::open(dir + "/model.safetensors");
  const int64_t C = c.n_embd;
  EXPECT_EQ(f.find("transformer.h.0.attn.c_attn.weight")->shape, (std::vector<int64_t>{C, 3 * C}));
  // c_attn[i][j]: input feature i, output j (q for j < C, then k, then v).
  for (int64_t i : {0, 5, 31})
    for (int64_t j : {0, 40, 95})
      EXPECT_EQ(at(f, "transformer.h.1.attn.c_attn.weight", i * 3 * C + j),
                kiln_at(p, l, "h.1.attn.qkv.weight", j, i));
  EXPECT_EQ(at(f, "transformer.h.0.mlp.c_fc.weight", 3 * c.ffn_dim + 100),
            kiln_at(p, l, "h.0.mlp.fc.weight", 100, 3));
  EXPECT_EQ(at(f, "transformer.h.0.mlp.c_proj.weight", 100 * C + 3),
            kiln_at(p, l, "h.0.mlp.proj.weight", 3, 100));
  EXPECT_EQ(f.find("transformer.wte.weight")->shape, (std::vector<int64_t>{c.vocab_size, C}));
  EXPECT_EQ(f.find("lm_head.weight"), nullptr);  // tied: saved once, as transformers does
}

// LLaMA/Qwen3: q, k, v stack into kiln's qkv rows; gate then up into SwiGLU's fc rows.
TEST(HfLayout, RopeModelsSplitQkvAndGateUp) {
  const Exported e = export_random(tiny_rope("qwen3"));
  const ModelConfig& c = e.config;
  const ParamLayout& l = e.layout;
  const std::vector<float>& p = e.params;
  const std::string& dir = e.dir;
  const SafetensorsFile f = SafetensorsFile::open(dir + "/model.safetensors");
  const int64_t C = c.n_embd, q = 4 * 16, kv = 2 * 16, F = c.ffn_dim;
  const std::string h = "model.layers.1.";
  EXPECT_EQ(f.find(h + "self_attn.q_proj.weight")->shape, (std::vector<int64_t>{q, C}));
  EXPECT_EQ(f.find(h + "self_attn.k_proj.weight")->shape, (std::vector<int64_t>{kv, C}));
  EXPECT_EQ(at(f, h + "self_attn.q_proj.weight", 3 * C + 7), kiln_at(p, l, "h.1.attn.qkv.weight", 3, 7));
  EXPECT_EQ(at(f, h + "self_attn.k_proj.weight", 3 * C + 7),
            kiln_at(p, l, "h.1.attn.qkv.weight", q + 3, 7));
  EXPECT_EQ(at(f, h + "self_attn.v_proj.weight", 3 * C + 7),
            kiln_at(p, l, "h.1.attn.qkv.weight", q + kv + 3, 7));
  EXPECT_EQ(at(f, h + "self_attn.o_proj.weight", 2 * q + 9), kiln_at(p, l, "h.1.attn.proj.weight", 2, 9));
  EXPECT_EQ(at(f, h + "mlp.gate_proj.weight", 5 * C + 1), kiln_at(p, l, "h.1.mlp.fc.weight", 5, 1));
  EXPECT_EQ(at(f, h + "mlp.up_proj.weight", 5 * C + 1), kiln_at(p, l, "h.1.mlp.fc.weight", F + 5, 1));
  EXPECT_EQ(at(f, h + "self_attn.k_norm.weight", 2), kiln_at(p, l, "h.1.attn.k_norm.weight", 2, 0));
  EXPECT_EQ(at(f, "model.norm.weight", 2), kiln_at(p, l, "lnf.weight", 2, 0));
}

// Expert e's gate and up are rows e*2F and e*2F+F of kiln's fc [E, 2F, C], its down rows e*C
// of proj [E, C, F]; the router is HF's gate. Qwen3-MoE's block 0 stays a dense MLP.
TEST(HfLayout, MoeModelsStackTheirExpertsByIndex) {
  for (const std::string name : {"qwen3_moe", "mixtral"}) {
    const Exported e = export_random(tiny_rope(name));
    const ParamLayout& l = e.layout;
    const std::vector<float>& p = e.params;
    const SafetensorsFile f = SafetensorsFile::open(e.dir + "/model.safetensors");
    const int64_t C = e.config.n_embd, F = e.config.moe.expert_ffn_dim;
    const bool qwen = name == "qwen3_moe";
    const std::string h = std::string("model.layers.1.") + (qwen ? "mlp." : "block_sparse_moe.");
    const std::string x = h + "experts.2.";
    EXPECT_EQ(f.find(x + (qwen ? "gate_proj" : "w1") + ".weight")->shape,
              (std::vector<int64_t>{F, C})) << name;
    EXPECT_EQ(at(f, h + "gate.weight", 3 * C + 5), kiln_at(p, l, "h.1.moe.router.weight", 3, 5));
    EXPECT_EQ(at(f, x + (qwen ? "gate_proj" : "w1") + ".weight", 4 * C + 1),
              kiln_at(p, l, "h.1.moe.experts.fc.weight", 2 * 2 * F + 4, 1)) << name;
    EXPECT_EQ(at(f, x + (qwen ? "up_proj" : "w3") + ".weight", 4 * C + 1),
              kiln_at(p, l, "h.1.moe.experts.fc.weight", 2 * 2 * F + F + 4, 1)) << name;
    EXPECT_EQ(at(f, x + (qwen ? "down_proj" : "w2") + ".weight", 7 * F + 3),
              kiln_at(p, l, "h.1.moe.experts.proj.weight", 2 * C + 7, 3)) << name;
    EXPECT_EQ(f.find("model.layers.0.mlp.gate_proj.weight") != nullptr, qwen) << name;
  }
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
}

// config.json as transformers 5.x writes it: rope_theta inside rope_parameters, no head_dim
// for LLaMA; Qwen3 without head_dim means 128.
TEST(HfConfig, ReadsBothTransformersGenerations) {
  const std::string dir = temp_dir();
  write_text(dir + "/config.json", R"({"model_type": "llama", "vocab_size": 32000,
    "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 3,
    "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-05, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
    "tie_word_embeddings": false, "hidden_act": "silu", "attention_bias": false})");
  ModelConfig c = read_hf_config(dir);
  EXPECT_EQ(c.rope_theta, 500000.0f);
  EXPECT_EQ(c.attention().n_kv_head, 4);
  EXPECT_EQ(c.attention().head_dim, 32);
  EXPECT_EQ(c.padded_vocab_size, 32000);
  EXPECT_FALSE(c.tie_embeddings);
  write_text(dir + "/config.json", R"({"model_type": "qwen3", "vocab_size": 1000,
    "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000, "tie_word_embeddings": true,
    "use_sliding_window": false, "rope_scaling": null})");
  c = read_hf_config(dir);
  EXPECT_EQ(c.attention().head_dim, 128);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_EQ(c.padded_vocab_size, 1024);
}

// Llama 3.1's config.json in both generations: rope_scaling beside rope_theta (4.x), and
// rope_parameters holding both (5.x).
TEST(HfConfig, ReadsLlama31RopeScalingInBothGenerations) {
  const std::string dir = temp_dir();
  const std::string base = R"("model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
    "tie_word_embeddings": false)";
  const RopeScaling want{"llama3", 8.0f, 1.0f, 4.0f, 8192};
  write_text(dir + "/config.json", "{" + base + R"(, "rope_theta": 500000.0, "rope_scaling":
    {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192, "rope_type": "llama3"}})");
  ModelConfig c = read_hf_config(dir);
  EXPECT_EQ(c.rope_theta, 500000.0f);
  EXPECT_EQ(c.rope_scaling, want);
  write_text(dir + "/config.json", "{" + base + R"(, "rope_parameters": {"rope_theta": 500000.0,
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192}})");
  c = read_hf_config(dir);
  EXPECT_EQ(c.rope_theta, 500000.0f);
  EXPECT_EQ(c.rope_scaling, want);
}

TEST(HfConfig, RefusesWhatKilnDoesNotImplement) {
  const std::string dir = temp_dir();
  const std::string base = R"("vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 128)";
  write_text(dir + "/config.json", R"({"model_type": "llama", "rope_scaling": {"rope_type": "yarn",
    "factor": 8.0}, )" + base + "}");
  std::string e = input_error([&] { read_hf_config(dir); });
  EXPECT_NE(e.find(dir + "/config.json: rope_scaling"), std::string::npos) << e;
  // llama3 without the numbers that define it
  write_text(dir + "/config.json", R"({"model_type": "llama", "rope_scaling": {"rope_type": "llama3",
    "factor": 8.0}, )" + base + "}");
  e = input_error([&] { read_hf_config(dir); });
  EXPECT_NE(e.find(dir + "/config.json: rope_scaling: llama3 scaling needs a number low_freq_factor"),
            std::string::npos)
      << e;
  write_text(dir + "/config.json", R"({"model_type": "llama", "rope_parameters": {"rope_type":
    "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
    "original_max_position_embeddings": 8192}, )" + base + "}");
  e = input_error([&] { read_hf_config(dir); });
  EXPECT_NE(e.find(dir + "/config.json: rope_parameters: llama3 scaling needs high_freq_factor"),
            std::string::npos)
      << e;
  // Numbers an op would fail on later are refused here, naming config.json's key.
  write_text(dir + "/config.json", R"({"model_type": "llama", "rms_norm_eps": -1e-5, )" + base + "}");
  e = input_error([&] { read_hf_config(dir); });
  EXPECT_NE(e.find(dir + "/config.json: rms_norm_eps: must be finite and > 0"), std::string::npos)
      << e;
  write_text(dir + "/config.json", R"({"model_type": "llama", "rope_theta": -10000, )" + base + "}");
  e = input_error([&] { read_hf_config(dir); });
  EXPECT_NE(e.find(dir + "/config.json: rope_theta: rope_theta must be finite and > 0"),
            std::string::npos)
      << e;
  write_text(dir + "/config.json", R"({"model_type": "mistral", )" + base + "}");
  e = input_error([&] { read_hf_config(dir); });
  EXPECT_NE(e.find("model_type: 'mistral' is not supported"), std::string::npos) << e;
  write_text(dir + "/config.json", R"({"model_type": "llama", "attention_bias": true, )" + base + "}");
  e = input_error([&] { read_hf_config(dir); });
  EXPECT_NE(e.find("attention_bias"), std::string::npos) << e;
  write_text(dir + "/config.json", R"({"model_type": "llama", "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2.5, "num_attention_heads": 4,
    "max_position_embeddings": 128})");
  e = input_error([&] { read_hf_config(dir); });
  EXPECT_NE(e.find("num_hidden_layers: expected a positive integer"), std::string::npos) << e;
  write_text(dir + "/config.json", R"({"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 8,
    "n_positions": 16, "vocab_size": 50, "activation_function": "relu"})");
  e = input_error([&] { read_hf_config(dir); });
  EXPECT_NE(e.find("activation_function: 'relu'"), std::string::npos) << e;
  // Shapes the decoder cannot build, and sizes past kiln's range, name the file, not a bug.
  write_text(dir + "/config.json", R"({"model_type": "llama", "head_dim": 15, )" + base + "}");
  e = input_error([&] { read_hf_config(dir); });
  EXPECT_NE(
      e.find(
          dir +
          "/config.json: model.head_dim: RoPE rotates pairs: the head width must be even, got 15"),
      std::string::npos)
      << e;
  write_text(dir + "/config.json", R"({"model_type": "gpt2", "n_layer": 1, "n_head": 3, "n_embd": 8,
    "n_positions": 16, "vocab_size": 50})");
  e = input_error([&] { read_hf_config(dir); });
  EXPECT_NE(e.find(dir + "/config.json: model.n_embd: must be divisible by model.n_head"),
            std::string::npos)
      << e;
  write_text(dir + "/config.json", R"({"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 8,
    "n_positions": 2147483647, "vocab_size": 50})");
  e = input_error([&] { read_hf_config(dir); });
  EXPECT_NE(e.find("n_positions: must be at most 1048576"), std::string::npos) << e;
  write_text(dir + "/config.json", R"({"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 8,
    "n_positions": 16, "vocab_size": 1000000000})");
  e = input_error([&] { read_hf_config(dir); });
  EXPECT_NE(e.find("vocab_size: must be at most 524288"), std::string::npos) << e;
  std::filesystem::remove(dir + "/config.json");
  std::filesystem::create_directory(dir + "/config.json");
  e = input_error([&] { read_hf_config(dir); });
  EXPECT_NE(e.find(dir + "/config.json: cannot read: not a file"), std::string::npos) << e;
}

TEST(HfConfig, MismatchesNameEveryKey) {
  ModelConfig run = tiny_rope("llama"), hf = run;
  hf.n_layer = 3;
  hf.rope_theta = 500000.0f;
  hf.seq_len = 4096;  // RoPE: the run picks its own context
  const std::vector<std::string> d = hf_config_mismatches(run, hf, "D");
  ASSERT_EQ(d.size(), 2u);
  EXPECT_EQ(d[0], "model.n_layer: 2 in the config, 3 in D/config.json");
  EXPECT_NE(d[1].find("model.rope_theta: 10000 in the config, 500000"), std::string::npos) << d[1];
  hf = run;
  hf.rope_scaling = {"llama3", 8.0f, 1.0f, 4.0f, 8192};
  const std::vector<std::string> s = hf_config_mismatches(run, hf, "D");
  ASSERT_EQ(s.size(), 1u);
  EXPECT_NE(s[0].find("model.rope_scaling: none in the config, llama3 (factor 8"), std::string::npos)
      << s[0];
  ModelConfig g = tiny_gpt2(), g2 = g;
  g2.seq_len = 32;  // learned positions: wpe's rows
  EXPECT_EQ(hf_config_mismatches(g, g2, "D").size(), 1u);
}

// Rewrites DIR/model.safetensors through `edit`, which may change the list of tensors.
template <class Edit>
void rewrite(const std::string& dir, Edit edit) {
  std::vector<std::vector<float>> data;
  std::vector<SafeTensorWrite> out;
  {
    const SafetensorsFile f = SafetensorsFile::open(dir + "/model.safetensors");
    for (const SafeTensorInfo& t : f.tensors()) {
      data.emplace_back(static_cast<size_t>(t.numel()));
      f.read_f32(t, data.back().data());
    }
    for (size_t i = 0; i < f.tensors().size(); ++i)
      out.push_back({f.tensors()[i].name, f.tensors()[i].shape, data[i].data()});
  }
  std::vector<float> extra(64, 1.0f);
  edit(out, extra.data());
  write_safetensors(dir + "/model.safetensors", out, "F32");
}

TEST(HfImport, MissingMisshapenAndUnexpectedTensorsAreNamed) {
  const Exported x = export_random(tiny_gpt2());
  const ModelConfig& c = x.config;
  const ParamLayout& l = x.layout;
  const std::string& dir = x.dir;

  // GPT-2's causal-mask buffer and a tied head saved anyway are not errors.
  rewrite(dir, [](std::vector<SafeTensorWrite>& t, const float* x) {
    t.push_back({"transformer.h.0.attn.bias", {1, 1, 8, 8}, x});
  });
  EXPECT_NO_THROW(load_hf_weights(dir, c, l));

  rewrite(dir, [](std::vector<SafeTensorWrite>& t, const float* x) {
    t.push_back({"transformer.h.9.mlp.c_fc.weight", {2, 2}, x});
  });
  std::string e = input_error([&] { load_hf_weights(dir, c, l); });
  EXPECT_NE(e.find("unexpected tensor 'transformer.h.9.mlp.c_fc.weight'"), std::string::npos) << e;

  rewrite(dir, [](std::vector<SafeTensorWrite>& t, const float*) {
    t.erase(std::remove_if(t.begin(), t.end(), [](const SafeTensorWrite& w) {
      return w.name == "transformer.h.9.mlp.c_fc.weight" || w.name == "transformer.h.1.ln_2.bias";
    }), t.end());
  });
  e = input_error([&] { load_hf_weights(dir, c, l); });
  EXPECT_NE(e.find("tensor 'transformer.h.1.ln_2.bias' (kiln's h.1.ln2.bias) is missing"),
            std::string::npos) << e;

  rewrite(dir, [](std::vector<SafeTensorWrite>& t, const float* x) {
    t.push_back({"transformer.h.1.ln_2.bias", {16}, x});
  });
  e = input_error([&] { load_hf_weights(dir, c, l); });
  EXPECT_NE(e.find("model.safetensors: tensor 'transformer.h.1.ln_2.bias' has shape [16], "
                   "config.json's sizes give [32]"),
            std::string::npos) << e;

  // A NaN or an infinity in a weight is refused at import, naming the tensor.
  std::vector<float> poisoned(32, 0.5f);
  poisoned[3] = std::nanf("");
  poisoned[7] = INFINITY;
  rewrite(dir, [&](std::vector<SafeTensorWrite>& t, const float*) {
    for (SafeTensorWrite& w : t)
      if (w.name == "transformer.h.1.ln_2.bias") w = {w.name, {32}, poisoned.data()};
  });
  e = input_error([&] { load_hf_weights(dir, c, l); });
  EXPECT_NE(e.find("tensor 'transformer.h.1.ln_2.bias' holds 2 NaN or infinite values of 32"),
            std::string::npos) << e;
}

TEST(HfImport, NoWeightsFileIsNamed) {
  const std::string dir = temp_dir();
  const std::string e = input_error([&] { load_hf_weights(dir, tiny_gpt2(), layout_of(tiny_gpt2())); });
  EXPECT_NE(e.find("no model.safetensors or model.safetensors.index.json"), std::string::npos) << e;
}

TEST(HfExport, RefusesLayersNoHfArchitectureHas) {
  ModelConfig c = tiny_rope("llama");
  c.norm = NormKind::layernorm;
  c.norm_eps = 1e-5f;
  const std::string e = input_error([&] { hf_model_type(c); });
  EXPECT_NE(e.find("no Hugging Face architecture"), std::string::npos) << e;
  EXPECT_EQ(hf_model_type(tiny_rope("qwen3_moe")), "qwen3_moe");
  EXPECT_EQ(hf_model_type(tiny_rope("mixtral")), "mixtral");
  // Experts neither Qwen3-MoE nor Mixtral has, each named.
  struct Case {
    std::string base, why;
    std::function<void(MoeConfig&)> change;
  };
  for (const Case& k :
       {Case{"mixtral", "moe.score=sigmoid", [](MoeConfig& m) { m.score = MoeScore::sigmoid; }},
        Case{"qwen3_moe", "moe.n_shared_experts", [](MoeConfig& m) { m.n_shared_experts = 1; }},
        Case{"qwen3_moe", "moe.balance=bias", [](MoeConfig& m) { m.balance = MoeBalance::bias; }},
        Case{"mixtral", "moe.every > 1", [](MoeConfig& m) { m.every = 2; }},
        Case{"mixtral", "moe.renormalize=false", [](MoeConfig& m) { m.renormalize = false; }}}) {
    ModelConfig m = tiny_rope(k.base);
    k.change(m.moe);
    const std::string what = input_error([&] { hf_model_type(m); });
    EXPECT_NE(what.find(k.why), std::string::npos) << what;
  }
}

// Qwen3-MoE and Mixtral configs as transformers writes them; routing kiln does not have is named.
TEST(HfConfig, ReadsAndRefusesMoeConfigs) {
  const std::string dir = temp_dir();
  const std::string base = R"("vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "max_position_embeddings": 128,
    "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001)";
  // transformers 4.x's Qwen3-MoE: num_experts.
  write_text(dir + "/config.json", R"({"model_type": "qwen3_moe", "num_experts": 8,
    "moe_intermediate_size": 32, "decoder_sparse_step": 2, "norm_topk_prob": true,
    "mlp_only_layers": [], )" + base + "}");
  ModelConfig c = read_hf_config(dir);
  EXPECT_EQ(c.arch, "qwen3");
  EXPECT_TRUE(c.qk_norm);
  EXPECT_EQ(c.moe.n_experts, 8);
  EXPECT_EQ(c.moe.expert_ffn_dim, 32);
  EXPECT_EQ(c.moe.every, 2);
  EXPECT_TRUE(c.moe.renormalize);
  EXPECT_EQ(c.ffn_dim, 128);  // the dense blocks' MLP
  write_text(dir + "/config.json", R"({"model_type": "mixtral", "num_local_experts": 8, )" + base + "}");
  c = read_hf_config(dir);
  EXPECT_EQ(c.arch, "llama");
  EXPECT_EQ(c.moe.expert_ffn_dim, 128);
  EXPECT_EQ(c.moe.every, 1);
  for (const auto& [extra, key] :
       {std::pair<std::string, std::string>{R"("model_type": "qwen3_moe", "num_experts": 8,
          "moe_intermediate_size": 32, "mlp_only_layers": [1], )", "mlp_only_layers"},
        {R"("model_type": "mixtral", "num_local_experts": 8, "router_jitter_noise": 0.1, )",
         "router_jitter_noise"},
        {R"("model_type": "mixtral", "num_local_experts": 8, "sliding_window": 4096, )",
         "sliding_window"},
        {R"("model_type": "mixtral", "num_local_experts": 1, )", "num_experts_per_tok"}}) {
    write_text(dir + "/config.json", "{" + extra + base + "}");
    const std::string e = input_error([&] { read_hf_config(dir); });
    EXPECT_NE(e.find(dir + "/config.json: " + key), std::string::npos) << e;
  }
}

// bos/eos ids as config.json gives them (a number, a list as LLaMA-3's instruct models have, or
// null) go back out the same way; a malformed one is named.
TEST(HfSpecialTokens, ConfigIdsReadAndWrittenAsGiven) {
  const std::string dir = temp_dir();
  write_text(dir + "/config.json", R"({"bos_token_id": 7, "eos_token_id": [8, 9]})");
  const HfSpecialTokens t = read_hf_special_tokens(dir, 200);
  EXPECT_EQ(t.bos, (std::vector<int64_t>{7}));
  EXPECT_EQ(t.eos, (std::vector<int64_t>{8, 9}));
  const ModelConfig c = tiny_gpt2();
  HfExportOptions opts;
  opts.special_tokens = t;
  const std::string out = temp_dir();
  const std::vector<float> p = random_params(c, layout_of(c));
  export_hf(out, c, layout_of(c), p.data(), opts);
  EXPECT_EQ(read_hf_special_tokens(out, 200).eos, t.eos);
  std::ifstream in(out + "/config.json");
  const std::string config((std::istreambuf_iterator<char>(in)), {});
  EXPECT_NE(config.find("\"bos_token_id\": 7,"), std::string::npos) << config;

  write_text(dir + "/config.json", R"({"eos_token_id": "</s>"})");
  const std::string e = input_error([&] { read_hf_special_tokens(dir, 200); });
  EXPECT_NE(e.find("config.json: eos_token_id: expected a token id"), std::string::npos) << e;
  EXPECT_TRUE(hf_tokenizer_files(dir).empty());
}

}  // namespace
}  // namespace kiln
