// The registry of Hugging Face families (hf/hf_adapter.h; docs/models.md, "Adding a model
// family"): a family defined here, in the test, and registered beside the built-in ones is
// imported and exported by read_hf_config, load_hf_weights and export_hf like those, its
// config.json and its weights round-tripping bit for bit, with nothing in hf/ knowing of it.
// Its model is one no built-in family holds (a GPT-2 without biases), its tensor names its own,
// with a split (q, k, v) and a transposed (fc) tensor so the map's pieces are exercised.
#include "hf/hf_adapter.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <random>

#include "base/error.h"
#include "hf/safetensors.h"
#include "tests/input_error.h"
#include "tests/test_process.h"

namespace kiln {
namespace {

class ToyAdapter final : public HfAdapter {
 public:
  std::string model_type() const override { return "kiln_toy"; }
  std::string architecture() const override { return "KilnToyForCausalLM"; }
  HfFit fit(const ModelConfig& c) const override {
    return {c.norm == NormKind::layernorm && c.positions == PositionKind::learned &&
                c.mlp == MlpKind::gelu && !c.bias && !c.qkv_bias && !c.qk_norm &&
                c.attention().n_kv_head == c.n_head && c.head_dim == 0 && c.moe.n_experts == 0,
            ""};
  }
  ModelConfig read_config(const HfConfigJson& c) const override {
    ModelConfig m = arch_config("gpt2");
    m.bias = m.qkv_bias = false;
    m.vocab_size = c.get_int("vocab");
    m.n_layer = c.get_int("layers");
    m.n_head = c.get_int("heads");
    m.n_kv_head = m.n_head;
    m.n_embd = c.get_int("width");
    m.ffn_dim = c.get_int("hidden");
    m.seq_len = c.get_int("context");
    m.tie_embeddings = c.get_bool("tie_word_embeddings", true);  // written by export_hf
    return m;
  }
  nlohmann::ordered_json write_config(const ModelConfig& m,
                                      const HfExportOptions& /*opts*/) const override {
    return {{"architectures", {architecture()}},
            {"model_type", model_type()},
            {"vocab", m.vocab_size},
            {"layers", m.n_layer},
            {"heads", m.n_head},
            {"width", m.n_embd},
            {"hidden", m.ffn_dim},
            {"context", m.seq_len}};
  }
  std::vector<HfTensorMap> weight_map(const ModelConfig& m,
                                      const std::string& /*prefix*/) const override {
    const int64_t C = m.n_embd, F = m.ffn_dim, V = m.vocab_size;
    std::vector<HfTensorMap> map;
    auto one = [&](const std::string& kiln, const std::string& hf, std::vector<int64_t> shape,
                   bool transpose = false) {
      map.push_back({kiln, {{hf, std::move(shape), 0, transpose}}});
    };
    one("wte", "tokens", {V, C});
    one("wpe", "positions", {m.seq_len, C});
    for (int l = 0; l < m.n_layer; ++l) {
      const std::string k = "h." + std::to_string(l) + ".", h = "block" + std::to_string(l) + ".";
      one(k + "ln1.weight", h + "norm1.scale", {C});
      one(k + "ln1.bias", h + "norm1.shift", {C});
      map.push_back({k + "attn.qkv.weight",
                     {{h + "q", {C, C}, 0, false},
                      {h + "k", {C, C}, C, false},
                      {h + "v", {C, C}, 2 * C, false}}});
      one(k + "attn.proj.weight", h + "out", {C, C});
      one(k + "ln2.weight", h + "norm2.scale", {C});
      one(k + "ln2.bias", h + "norm2.shift", {C});
      one(k + "mlp.fc.weight", h + "up", {C, F}, true);  // stored [in, out]
      one(k + "mlp.proj.weight", h + "down", {C, F});
    }
    one("lnf.weight", "final.scale", {C});
    one("lnf.bias", "final.shift", {C});
    if (!m.tie_embeddings) one("lm_head", "head", {V, C});
    return map;
  }
};

ModelConfig toy_model(bool tied) {
  ModelConfig m = arch_config("gpt2");
  m.bias = m.qkv_bias = false;
  m.n_layer = 2, m.n_head = 4, m.n_kv_head = 4, m.n_embd = 32, m.ffn_dim = 64;
  m.vocab_size = 100, m.padded_vocab_size = 128, m.seq_len = 16, m.tie_embeddings = tied;
  return m;
}

ParamLayout layout_of(const ModelConfig& c) {
  static const std::unique_ptr<Backend> cpu = make_cpu_backend();
  return make_model(c, *cpu)->layout();
}

// Random parameters but for the padded vocabulary rows, which kiln keeps zero.
std::vector<float> random_params(const ModelConfig& c, const ParamLayout& layout) {
  std::vector<float> p(static_cast<size_t>(layout.total));
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  for (float& v : p) v = normal(rng);
  for (const ParamInfo& t : layout.tensors)
    if (t.name == "wte" || t.name == "lm_head")
      std::fill(p.begin() + t.offset + int64_t{c.vocab_size} * c.n_embd,
                p.begin() + t.offset + t.numel(), 0.0f);
  return p;
}

using kiln::testing::input_error;

TEST(HfAdapter, AFamilyRegisteredOutsideHfRoundTripsConfigAndWeights) {
  const ToyAdapter toy;
  const ModelConfig tied = toy_model(true);
  // Unregistered, no family holds the model or reads its config.json.
  EXPECT_NE(input_error([&] { hf_model_type(tied); }).find("no Hugging Face architecture"),
            std::string::npos);
  {
    const HfAdapterRegistration registration(toy);
    EXPECT_EQ(hf_model_type(tied), "kiln_toy");
    for (const bool is_tied : {true, false}) {
      const ModelConfig m = toy_model(is_tied);
      const ParamLayout layout = layout_of(m);
      const std::vector<float> params = random_params(m, layout);
      const std::string dir = kiln::testing::make_temp_dir("kiln_hf_toy_");
      HfExportOptions opts;
      opts.dtype = "f32";
      export_hf(dir, m, layout, params.data(), opts);

      // config.json: the family's keys, then those every family gets.
      std::ifstream in(dir + "/config.json");
      const nlohmann::json j = nlohmann::json::parse(in);
      EXPECT_EQ(j["model_type"], "kiln_toy");
      EXPECT_EQ(j["hidden"], 64);
      EXPECT_EQ(j["tie_word_embeddings"], is_tied);
      const ModelConfig back = read_hf_config(dir);
      EXPECT_TRUE(hf_config_mismatches(m, back, dir).empty());
      EXPECT_EQ(back.padded_vocab_size, m.padded_vocab_size);
      EXPECT_FALSE(back.bias);

      // The weights under the family's names: v is rows 2C.. of qkv, up stored [in, out].
      const SafetensorsFile f = SafetensorsFile::open(dir + "/model.safetensors");
      EXPECT_EQ(f.find("head") != nullptr, !is_tied);
      EXPECT_EQ(f.find("block1.up")->shape, (std::vector<int64_t>{32, 64}));
      std::vector<float> v(32 * 32), up(32 * 64);
      f.read_f32(*f.find("block1.v"), v.data());
      f.read_f32(*f.find("block1.up"), up.data());
      const ParamInfo& qkv = layout.find("h.1.attn.qkv.weight");
      const ParamInfo& fc = layout.find("h.1.mlp.fc.weight");
      EXPECT_EQ(v[3 * 32 + 5], params[static_cast<size_t>(qkv.offset + (64 + 3) * 32 + 5)]);
      EXPECT_EQ(up[5 * 64 + 40], params[static_cast<size_t>(fc.offset + 40 * 32 + 5)]);

      const std::vector<float> loaded = load_hf_weights(dir, back, layout_of(back));
      ASSERT_EQ(loaded.size(), params.size());
      EXPECT_EQ(std::memcmp(loaded.data(), params.data(), params.size() * sizeof(float)), 0);
    }
    EXPECT_THROW(HfAdapterRegistration again(toy), std::invalid_argument);
  }
  // Its registration over, the family is gone again.
  EXPECT_NE(input_error([&] { hf_model_type(tied); }).find("no Hugging Face architecture"),
            std::string::npos);
  EXPECT_EQ(find_hf_adapter("kiln_toy"), nullptr);
}

// The built-in families, one per model_type, each exporting the model it reads.
TEST(HfAdapter, BuiltInFamiliesAreRegisteredByModelType) {
  std::vector<std::string> types;
  for (const HfAdapter* a : hf_adapters()) types.push_back(a->model_type());
  EXPECT_EQ(types, (std::vector<std::string>{"gpt2", "llama", "qwen3", "qwen3_moe", "mixtral"}));
  EXPECT_EQ(hf_model_types(), "gpt2, llama, qwen3, qwen3_moe and mixtral");
  EXPECT_EQ(find_hf_adapter("mistral"), nullptr);
  EXPECT_EQ(&hf_adapter_for(arch_config("qwen3")), find_hf_adapter("qwen3"));
}

}  // namespace
}  // namespace kiln
