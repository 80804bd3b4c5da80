// GPT-2 (GPT2LMHeadModel, model_type gpt2) <-> kiln's gpt2 row: LayerNorm, learned positions,
// GELU (the tanh form) and biases everywhere. What the weight map encodes: GPT-2's Conv1D
// weights are stored [in, out], transposed into kiln's [out, in]; c_attn already holds q, k, v
// in kiln's order (q heads, k heads, v heads). Files saved from GPT2LMHeadModel prefix the
// tensor names with "transformer.", the original release does not.
#include "hf/hf_adapter.h"

namespace kiln {

namespace {

class Gpt2Adapter final : public HfAdapter {
 public:
  std::string model_type() const override { return "gpt2"; }
  std::string architecture() const override { return "GPT2LMHeadModel"; }

  HfFit fit(const ModelConfig& c) const override {
    const AttentionDims a = c.attention();
    return {c.norm == NormKind::layernorm && c.positions == PositionKind::learned &&
                c.mlp == MlpKind::gelu && c.bias && !c.qk_norm && a.n_kv_head == a.n_head &&
                a.head_dim * a.n_head == c.n_embd && c.moe.n_experts == 0,
            ""};
  }

  ModelConfig read_config(const HfConfigJson& c) const override {
    ModelConfig m = arch_config("gpt2");
    m.vocab_size = c.get_int("vocab_size");
    c.at_most("vocab_size", m.vocab_size, kHfMaxVocab);
    m.n_layer = c.get_int("n_layer");
    c.at_most("n_layer", m.n_layer, kHfMaxLayers);
    m.n_head = c.get_int("n_head");
    m.n_embd = c.get_int("n_embd");
    m.seq_len = c.get_int("n_positions");
    c.at_most("n_positions", m.seq_len, kHfMaxLearnedPositions, "a learned position table");
    m.ffn_dim = c.get_int("n_inner", 4 * m.n_embd);
    m.n_kv_head = m.n_head;
    m.head_dim = 0;
    m.norm_eps = static_cast<float>(c.get_number("layer_norm_epsilon", 1e-5));
    if (m.norm_eps != 1e-5f) c.fail("layer_norm_epsilon", "kiln's layernorm uses 1e-5 only");
    const std::string act = c.get_string("activation_function", "gelu_new");
    if (act != "gelu_new" && act != "gelu_pytorch_tanh")
      c.fail("activation_function",
             "'" + act + "' is not supported (kiln's GELU is the tanh form, gelu_new)");
    c.require("scale_attn_weights", true, "kiln scales attention by 1/sqrt(head_dim)");
    c.require("scale_attn_by_inverse_layer_idx", false, "not implemented");
    c.require("reorder_and_upcast_attn", false, "not implemented");
    m.tie_embeddings = c.get_bool("tie_word_embeddings", true);
    return m;
  }

  nlohmann::ordered_json write_config(const ModelConfig& cfg,
                                      const HfExportOptions& /*opts*/) const override {
    return {{"architectures", {architecture()}},
            {"model_type", model_type()},
            {"vocab_size", cfg.vocab_size},
            {"n_positions", cfg.seq_len},
            {"n_ctx", cfg.seq_len},
            {"n_embd", cfg.n_embd},
            {"n_layer", cfg.n_layer},
            {"n_head", cfg.n_head},
            {"n_inner", cfg.ffn_dim},
            {"activation_function", "gelu_new"},
            {"layer_norm_epsilon", 1e-5},
            {"resid_pdrop", 0.0},
            {"embd_pdrop", 0.0},
            {"attn_pdrop", 0.0},
            {"scale_attn_weights", true},
            {"initializer_range", 0.02},
            {"bos_token_id", nullptr},
            {"eos_token_id", nullptr}};
  }

  std::vector<HfTensorMap> weight_map(const ModelConfig& c, const std::string& p) const override {
    const int64_t C = c.n_embd, F = c.ffn_dim, V = c.vocab_size;
    std::vector<HfTensorMap> map;
    auto one = [&](const std::string& kiln, const std::string& hf, std::vector<int64_t> shape,
                   bool transpose = false) {
      map.push_back({kiln, {{hf, std::move(shape), 0, transpose}}});
    };
    one("wte", p + "wte.weight", {V, C});
    one("wpe", p + "wpe.weight", {c.seq_len, C});
    for (int l = 0; l < c.n_layer; ++l) {
      const std::string k = "h." + std::to_string(l) + ".", h = p + k;
      one(k + "ln1.weight", h + "ln_1.weight", {C});
      one(k + "ln1.bias", h + "ln_1.bias", {C});
      one(k + "attn.qkv.weight", h + "attn.c_attn.weight", {C, 3 * C}, true);
      one(k + "attn.qkv.bias", h + "attn.c_attn.bias", {3 * C});
      one(k + "attn.proj.weight", h + "attn.c_proj.weight", {C, C}, true);
      one(k + "attn.proj.bias", h + "attn.c_proj.bias", {C});
      one(k + "ln2.weight", h + "ln_2.weight", {C});
      one(k + "ln2.bias", h + "ln_2.bias", {C});
      one(k + "mlp.fc.weight", h + "mlp.c_fc.weight", {C, F}, true);
      one(k + "mlp.fc.bias", h + "mlp.c_fc.bias", {F});
      one(k + "mlp.proj.weight", h + "mlp.c_proj.weight", {F, C}, true);
      one(k + "mlp.proj.bias", h + "mlp.c_proj.bias", {C});
    }
    one("lnf.weight", p + "ln_f.weight", {C});
    one("lnf.bias", p + "ln_f.bias", {C});
    if (!c.tie_embeddings) one("lm_head", "lm_head.weight", {V, C});
    return map;
  }

  std::vector<std::string> weight_prefixes() const override { return {"transformer.", ""}; }

  // The causal-mask buffers older transformers saved beside the weights.
  bool is_buffer(const std::string& name) const override {
    auto ends_with = [&](const std::string& s) {
      return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
    };
    return ends_with(".attn.bias") || ends_with(".attn.masked_bias");
  }
};

}  // namespace

const HfAdapter& hf_gpt2_adapter() {
  static const Gpt2Adapter adapter;
  return adapter;
}

}  // namespace kiln
