// The LLaMA-style families' shared mapping (hf/hf_llama_style.h).
#include "hf/hf_llama_style.h"

#include <algorithm>
#include <cmath>

namespace kiln {

using nlohmann::json;

namespace {

// A rope_scaling (transformers 4.x) or rope_parameters (5.x) object: "default" is plain RoPE,
// "llama3" Llama 3.1's frequency scaling; any other type (YaRN, linear, dynamic) is refused.
RopeScaling read_rope_scaling_object(const HfConfigJson& c, const char* key) {
  const json& s = c.j[key];
  if (!s.is_object()) c.fail(key, "expected an object, got " + s.dump());
  const std::string type = s.value("rope_type", s.value("type", std::string("default")));
  if (type == "default") return {};
  if (type != "llama3")
    c.fail(key, s.dump() + " is not supported (rope_type default or llama3 only)");
  auto number = [&](const char* field) {
    if (!s.contains(field) || !s[field].is_number())
      c.fail(key, std::string("llama3 scaling needs a number ") + field + ", got " + s.dump());
    return s[field].get<double>();
  };
  RopeScaling r;
  r.type = "llama3";
  r.factor = static_cast<float>(number("factor"));
  r.low_freq_factor = static_cast<float>(number("low_freq_factor"));
  r.high_freq_factor = static_cast<float>(number("high_freq_factor"));
  const double orig = number("original_max_position_embeddings");
  if (orig != std::floor(orig) || orig < 1 || orig > 1e9)
    c.fail(key, "original_max_position_embeddings must be a positive integer, got " + s.dump());
  r.original_max_position = static_cast<int>(orig);
  const std::string why = rope_error({1.0f, r});
  if (!why.empty()) c.fail(key, why);
  return r;
}

// RoPE base and scaling: top-level rope_theta and rope_scaling (transformers 4.x), or
// rope_parameters holding both (5.x).
Rope read_rope(const HfConfigJson& c, double fallback_theta) {
  Rope r;
  r.theta = static_cast<float>(c.get_number("rope_theta", fallback_theta));
  if (c.has("rope_scaling") && !c.j["rope_scaling"].is_null())
    r.scaling = read_rope_scaling_object(c, "rope_scaling");
  if (c.has("rope_parameters")) {
    r.scaling = read_rope_scaling_object(c, "rope_parameters");
    const json& p = c.j["rope_parameters"];
    if (p.contains("rope_theta")) {
      if (!p["rope_theta"].is_number())
        c.fail("rope_parameters", "rope_theta must be a number, got " + p.dump());
      r.theta = static_cast<float>(p["rope_theta"].get<double>());
    }
  }
  if (!(r.theta > 0.0f) || !std::isfinite(r.theta))
    c.fail(c.has("rope_parameters") ? "rope_parameters" : "rope_theta",
           "rope_theta must be finite and > 0, got " + std::to_string(r.theta));
  return r;
}

}  // namespace

bool llama_style_layers(const ModelConfig& c) {
  return c.norm == NormKind::rmsnorm && c.positions == PositionKind::rope &&
         c.mlp == MlpKind::swiglu && !c.bias && !c.qkv_bias;
}

ModelConfig read_llama_style_config(const HfConfigJson& c, const HfAdapter& family,
                                    const std::string& arch, int default_head_dim,
                                    double default_theta) {
  const std::string type = family.model_type();
  ModelConfig m = arch_config(arch);
  m.vocab_size = c.get_int("vocab_size");
  c.at_most("vocab_size", m.vocab_size, kHfMaxVocab);
  m.n_layer = c.get_int("num_hidden_layers");
  c.at_most("num_hidden_layers", m.n_layer, kHfMaxLayers);
  m.n_head = c.get_int("num_attention_heads");
  m.n_embd = c.get_int("hidden_size");
  m.ffn_dim = c.get_int("intermediate_size");
  m.n_kv_head = c.get_int("num_key_value_heads", m.n_head);
  if (m.n_head % m.n_kv_head != 0)
    c.fail("num_key_value_heads", "must divide the number of attention heads");
  // Qwen3Config's head_dim defaults to 128, LlamaConfig's to hidden_size / heads.
  m.head_dim = c.get_int("head_dim", default_head_dim);
  if (m.head_dim * m.n_head == m.n_embd) m.head_dim = 0;  // kiln's "n_embd / n_head"
  m.seq_len = c.get_int("max_position_embeddings");
  m.norm_eps = static_cast<float>(c.get_number("rms_norm_eps", 1e-6));
  if (!(m.norm_eps > 0.0f) || !std::isfinite(m.norm_eps))
    c.fail("rms_norm_eps", "must be finite and > 0, got " + c.j["rms_norm_eps"].dump());
  const Rope rope = read_rope(c, default_theta);
  m.rope_theta = rope.theta;
  m.rope_scaling = rope.scaling;
  m.tie_embeddings = c.get_bool("tie_word_embeddings", false);
  const std::string act = c.get_string("hidden_act", "silu");
  if (act != "silu") c.fail("hidden_act", "'" + act + "' is not supported (SwiGLU uses silu)");
  c.require("attention_bias", false, "kiln's " + type + " has no attention biases");
  c.require("mlp_bias", false, "kiln's " + type + " has no MLP biases");
  c.require("use_sliding_window", false, "sliding-window attention is not implemented");
  if (c.has("layer_types"))
    for (const json& t : c.j["layer_types"])
      if (t != "full_attention")
        c.fail("layer_types", t.dump() + " is not supported (full attention only)");
  return m;
}

nlohmann::ordered_json llama_style_config_json(const ModelConfig& cfg, const HfAdapter& family,
                                               const HfExportOptions& opts) {
  const AttentionDims a = cfg.attention();
  nlohmann::ordered_json j = {{"architectures", {family.architecture()}},
                              {"model_type", family.model_type()},
                              {"vocab_size", cfg.vocab_size},
                              {"hidden_size", cfg.n_embd},
                              {"intermediate_size", cfg.ffn_dim},
                              {"num_hidden_layers", cfg.n_layer},
                              {"num_attention_heads", a.n_head},
                              {"num_key_value_heads", a.n_kv_head},
                              {"head_dim", a.head_dim},
                              {"max_position_embeddings", std::max(cfg.seq_len, opts.max_position)},
                              {"rms_norm_eps", float_as_written(cfg.norm_eps)},
                              {"rope_theta", float_as_written(cfg.rope_theta)},
                              {"rope_scaling", nullptr},
                              {"hidden_act", "silu"},
                              {"attention_bias", false},
                              {"attention_dropout", 0.0},
                              {"initializer_range", 0.02},
                              {"bos_token_id", nullptr},
                              {"eos_token_id", nullptr}};
  if (const RopeScaling& s = cfg.rope_scaling; !s.type.empty())
    j["rope_scaling"] = {{"rope_type", s.type},
                         {"factor", float_as_written(s.factor)},
                         {"low_freq_factor", float_as_written(s.low_freq_factor)},
                         {"high_freq_factor", float_as_written(s.high_freq_factor)},
                         {"original_max_position_embeddings", s.original_max_position}};
  return j;
}

std::vector<HfTensorMap> llama_style_weight_map(const ModelConfig& c,
                                                const HfMoeBlockMap& moe_block) {
  const AttentionDims a = c.attention();
  const int64_t C = c.n_embd, F = c.ffn_dim, V = c.vocab_size;
  const int64_t q = a.q_dim(), kv = static_cast<int64_t>(a.n_kv_head) * a.head_dim;
  std::vector<HfTensorMap> map;
  auto one = [&](const std::string& kiln, const std::string& hf, std::vector<int64_t> shape) {
    map.push_back({kiln, {{hf, std::move(shape), 0, false}}});
  };
  one("wte", "model.embed_tokens.weight", {V, C});
  for (int l = 0; l < c.n_layer; ++l) {
    const std::string k = "h." + std::to_string(l) + ".";
    const std::string h = "model.layers." + std::to_string(l) + ".";
    one(k + "ln1.weight", h + "input_layernorm.weight", {C});
    map.push_back({k + "attn.qkv.weight",
                   {{h + "self_attn.q_proj.weight", {q, C}, 0, false},
                    {h + "self_attn.k_proj.weight", {kv, C}, q, false},
                    {h + "self_attn.v_proj.weight", {kv, C}, q + kv, false}}});
    if (c.qk_norm) {
      one(k + "attn.q_norm.weight", h + "self_attn.q_norm.weight", {a.head_dim});
      one(k + "attn.k_norm.weight", h + "self_attn.k_norm.weight", {a.head_dim});
    }
    one(k + "attn.proj.weight", h + "self_attn.o_proj.weight", {C, q});
    one(k + "ln2.weight", h + "post_attention_layernorm.weight", {C});
    if (c.is_moe_block(l)) {
      moe_block(map, k, h);
      continue;
    }
    map.push_back({k + "mlp.fc.weight",
                   {{h + "mlp.gate_proj.weight", {F, C}, 0, false},
                    {h + "mlp.up_proj.weight", {F, C}, F, false}}});
    one(k + "mlp.proj.weight", h + "mlp.down_proj.weight", {C, F});
  }
  one("lnf.weight", "model.norm.weight", {C});
  if (!c.tie_embeddings) one("lm_head", "lm_head.weight", {V, C});
  return map;
}

bool llama_style_buffer(const std::string& name) {
  const std::string suffix = "rotary_emb.inv_freq";
  return name.size() >= suffix.size() &&
         name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace kiln
