// The one model schema (config/schema.cpp; docs/models.md, "Adding a model key"): a model or moe
// key is a field of ModelConfig (model/model.h) and one schema row pointing at it; the config's
// reading, the resolved YAML, equality, the run's model and a config written around a model
// from elsewhere all reach it through that row, with no code of their own per key. The tests
// hold that for every model and moe row, so a key added later is held to it too: its field and
// its row must be all the config needs (its line in kOverrides below gives it a value).
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "config/config.h"
#include "config/config_schema.h"
#include "config/model_config.h"
#include "tests/input_error.h"

namespace kiln {
namespace {

bool is_model_row(const Field& f) {
  return std::string(f.section) == "model" || std::string(f.section) == "moe";
}

// The address a row reads and writes.
const void* address(const FieldPtr& p) {
  if (const auto* e = std::get_if<EnumRef>(&p)) return e->field;
  return std::visit(
      [](auto x) -> const void* {
        if constexpr (std::is_pointer_v<decltype(x)>) return x;
        return nullptr;
      },
      p);
}

// The value of row `f` in `c`, as config.yaml writes it.
std::string value(const Field& f, const Config& c) {
  Config copy = c;  // the rows hand out mutable pointers
  return value_to_yaml(f.member(copy));
}

TEST(ModelSchema, EveryModelKeyIsAFieldOfModelConfigAndNoOtherKeyIs) {
  Config c;
  const char* begin = reinterpret_cast<const char*>(&c.model);
  const char* end = begin + sizeof(ModelConfig);
  std::set<const void*> seen;
  for (const Field& f : schema()) {
    const char* at = static_cast<const char*>(address(f.member(c)));
    EXPECT_EQ(at >= begin && at < end, is_model_row(f)) << f.path();
    EXPECT_TRUE(seen.insert(at).second) << f.path() << ": a second row for one field";
  }
}

// A config that reads every model and moe key: a LLaMA-style MoE model.
const std::string kBase =
    "data: {train: data/x/train_*.bin}\n"
    "model: {arch: llama, n_layer: 4, n_head: 4, n_embd: 64, vocab_size: 256, seq_len: 32}\n"
    "moe: {n_experts: 4}\n";

// Per key, overrides that give it a value other than kBase's (with the keys it needs beside it).
const std::map<std::string, std::vector<std::string>> kOverrides = {
    {"model.arch", {"model.arch=qwen3"}},
    {"model.n_layer", {"model.n_layer=6"}},
    {"model.n_head", {"model.n_head=8"}},
    {"model.n_kv_head", {"model.n_kv_head=2"}},
    {"model.head_dim", {"model.head_dim=32"}},
    {"model.n_embd", {"model.n_embd=128"}},
    {"model.ffn_dim", {"model.ffn_dim=96"}},
    {"model.vocab_size", {"model.vocab_size=300"}},
    {"model.padded_vocab_size", {"model.padded_vocab_size=512"}},
    {"model.seq_len", {"model.seq_len=64"}},
    {"model.tie_embeddings", {"model.tie_embeddings=true"}},
    {"model.norm", {"model.norm=layernorm"}},
    {"model.norm_eps", {"model.norm_eps=1e-6"}},
    {"model.positions", {"model.positions=learned"}},
    {"model.rope_theta", {"model.rope_theta=500000"}},
    {"model.rope_scaling", {"model.rope_scaling=llama3"}},
    {"model.rope_factor", {"model.rope_scaling=llama3", "model.rope_factor=2"}},
    {"model.rope_low_freq_factor", {"model.rope_scaling=llama3", "model.rope_low_freq_factor=2"}},
    {"model.rope_high_freq_factor", {"model.rope_scaling=llama3", "model.rope_high_freq_factor=8"}},
    {"model.rope_original_max_position",
     {"model.rope_scaling=llama3", "model.rope_original_max_position=16"}},
    {"model.mlp", {"model.mlp=gelu"}},
    {"model.bias", {"model.bias=true", "model.qkv_bias=true", "moe.n_experts=0"}},
    {"model.qkv_bias", {"model.qkv_bias=true"}},
    {"model.qk_norm", {"model.qk_norm=true"}},
    {"moe.n_experts", {"moe.n_experts=8"}},
    {"moe.top_k", {"moe.top_k=1"}},
    {"moe.expert_ffn_dim", {"moe.expert_ffn_dim=32"}},
    {"moe.n_shared_experts", {"moe.n_shared_experts=1"}},
    {"moe.every", {"moe.every=2"}},
    {"moe.score", {"moe.score=sigmoid"}},
    {"moe.renormalize", {"moe.renormalize=false"}},
    {"moe.balance", {"moe.balance=none", "moe.aux_loss_coef=0"}},
    {"moe.aux_loss_coef", {"moe.aux_loss_coef=0.02"}},
    {"moe.z_loss_coef", {"moe.z_loss_coef=0.001"}},
    {"moe.bias_update_rate", {"moe.balance=bias", "moe.bias_update_rate=0.01"}},
};

TEST(ModelSchema, AKeysValueReachesEveryReaderThroughItsRowAlone) {
  const Config base = parse_config(kBase, {});
  const std::unique_ptr<Backend> cpu = make_cpu_backend();
  for (const Field& f : schema()) {
    if (!is_model_row(f)) continue;
    const auto it = kOverrides.find(f.path());
    ASSERT_NE(it, kOverrides.end()) << f.path() << ": give the new key a value in kOverrides";
    const Config c = parse_config(kBase, it->second);
    const std::string v = value(f, c);
    ASSERT_NE(v, value(f, base)) << f.path();
    EXPECT_FALSE(c == base) << f.path();
    // The run's model, and the model built from it, carry the value.
    Config run = base;
    run.model = model_config(c, *cpu, false);
    EXPECT_EQ(value(f, run), v) << f.path();
    Config built = base;
    built.model = make_model(run.model, *cpu)->config();
    EXPECT_EQ(value(f, built), v) << f.path();
    // The resolved config.yaml reads back as the same config.
    const Config again = parse_stored_config(config_to_yaml(c), "config.yaml");
    EXPECT_EQ(value(f, again), v) << f.path();
    EXPECT_TRUE(again == c) << f.path();
    // A config written around the model (init.from=hf:DIR, convert) keeps it.
    Config around;
    around.data.train = "data/x/train_*.bin";
    set_model(around, c.model);
    EXPECT_EQ(value(f, parse_stored_config(config_to_yaml(around), "config.yaml")), v) << f.path();
  }
}

// The model's numbers are floats: a value a float cannot hold is refused as read, naming the key,
// rather than becoming infinity or 0.
TEST(ModelSchema, AFloatKeyRefusesWhatAFloatCannotHold) {
  for (const std::string value : {"1e39", "1e-50"}) {
    const std::string e =
        kiln::testing::input_error([&] { parse_config(kBase, {"model.rope_theta=" + value}); });
    EXPECT_NE(e.find("model.rope_theta: expected a number within a float's range, got '" + value),
              std::string::npos)
        << e;
  }
}

}  // namespace
}  // namespace kiln
