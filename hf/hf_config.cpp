// config.json <-> ModelConfig: a Hugging Face model's config read into kiln's (each key checked,
// what kiln does not implement refused by name), compared with a run's, and kiln's written as
// the config.json transformers loads.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "base/error.h"
#include "hf/hf_files.h"
#include "hf/hf_model.h"
#include "model/model_rules.h"

namespace kiln {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// Typed access to config.json's keys, each error naming the file and the key.
struct ConfigJson {
  json j;
  std::string path;

  bool has(const char* key) const { return j.contains(key) && !j[key].is_null(); }
  [[noreturn]] void fail(const char* key, const std::string& what) const {
    throw InputError(path + ": " + key + ": " + what);
  }
  int get_int(const char* key) const {
    if (!has(key)) fail(key, "missing");
    if (!j[key].is_number_integer() || j[key].get<int64_t>() <= 0 ||
        j[key].get<int64_t>() > INT32_MAX)
      fail(key, "expected a positive integer, got " + j[key].dump());
    return j[key].get<int>();
  }
  int get_int(const char* key, int fallback) const { return has(key) ? get_int(key) : fallback; }
  double get_number(const char* key, double fallback) const {
    if (!has(key)) return fallback;
    if (!j[key].is_number()) fail(key, "expected a number, got " + j[key].dump());
    return j[key].get<double>();
  }
  bool get_bool(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    if (!j[key].is_boolean()) fail(key, "expected true or false, got " + j[key].dump());
    return j[key].get<bool>();
  }
  std::string get_string(const char* key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    if (!j[key].is_string()) fail(key, "expected a string, got " + j[key].dump());
    return j[key].get<std::string>();
  }
  // Refuses a key whose value changes the model in a way kiln does not implement.
  void require(const char* key, const json& expected, const std::string& why) const {
    if (has(key) && j[key] != expected)
      fail(key, j[key].dump() + " is not supported (" + why + ")");
  }
};

// A rope_scaling (transformers 4.x) or rope_parameters (5.x) object: "default" is plain RoPE,
// "llama3" Llama 3.1's frequency scaling; any other type (YaRN, linear, dynamic) is refused.
RopeScaling read_rope_scaling_object(const ConfigJson& c, const char* key) {
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
Rope read_rope(const ConfigJson& c, double fallback_theta) {
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

// Qwen3-MoE's and Mixtral's experts: softmax routing to the top num_experts_per_tok, SwiGLU
// experts, no shared expert. Qwen3-MoE routes every decoder_sparse_step-th block
// (mlp_only_layers must be empty) and renormalizes as norm_topk_prob says; Mixtral routes every
// block and always renormalizes (its softmax over the top-k logits is the same thing).
MoeConfig read_hf_moe(const ConfigJson& c, const std::string& type, const ModelConfig& m) {
  MoeConfig moe;
  const bool qwen = type == "qwen3_moe";
  // transformers 4.x writes Qwen3-MoE's num_experts, 5.x num_local_experts, as Mixtral's.
  moe.n_experts =
      qwen && c.has("num_experts") ? c.get_int("num_experts") : c.get_int("num_local_experts");
  moe.top_k = c.get_int("num_experts_per_tok");
  if (moe.top_k > moe.n_experts)
    c.fail("num_experts_per_tok", "must be at most the number of experts");
  moe.expert_ffn_dim = qwen ? c.get_int("moe_intermediate_size") : m.ffn_dim;
  moe.every = qwen ? c.get_int("decoder_sparse_step", 1) : 1;
  moe.renormalize = qwen ? c.get_bool("norm_topk_prob", false) : true;
  moe.aux_loss_coef = static_cast<float>(c.get_number("router_aux_loss_coef", 0.001));
  moe.balance = moe.aux_loss_coef > 0 ? MoeBalance::aux_loss : MoeBalance::none;
  if (qwen && c.has("mlp_only_layers") &&
      !(c.j["mlp_only_layers"].is_array() && c.j["mlp_only_layers"].empty()))
    c.fail("mlp_only_layers", c.j["mlp_only_layers"].dump() +
                                  " is not supported (kiln's MoE blocks are every "
                                  "decoder_sparse_step-th, with no exceptions)");
  if (!qwen && c.get_number("router_jitter_noise", 0.0) != 0.0)
    c.fail("router_jitter_noise", "is not supported (kiln's routing adds no noise)");
  if (moe.every > m.n_layer)
    c.fail("decoder_sparse_step", "is past num_hidden_layers: no block would be MoE");
  return moe;
}

}  // namespace

ModelConfig read_hf_config(const std::string& dir) {
  const std::string path = dir + "/config.json";
  if (!fs::is_directory(dir))
    throw InputError(dir + ": not a directory (expected a Hugging Face model)");
  const ConfigJson c{read_json(path), path};
  if (!c.j.is_object()) throw InputError(path + ": not a JSON object");
  const std::string type = c.get_string("model_type", "");
  // The MoE models are their dense architecture's decoder with routed experts.
  const bool moe = type == "qwen3_moe" || type == "mixtral";
  const std::string base = type == "qwen3_moe" ? "qwen3" : type == "mixtral" ? "llama" : type;
  if (!(moe || find_arch(type)))
    c.fail("model_type", "'" + type +
                             "' is not supported (kiln imports gpt2, llama, qwen3, "
                             "qwen3_moe and mixtral)");
  // The arch row's layer choices; config.json gives the sizes, eps, RoPE base and the head.
  ModelConfig m = arch_config(base);
  m.vocab_size = c.get_int("vocab_size");
  if (type == "gpt2") {
    m.n_layer = c.get_int("n_layer");
    m.n_head = c.get_int("n_head");
    m.n_embd = c.get_int("n_embd");
    m.seq_len = c.get_int("n_positions");
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
  } else {
    m.n_layer = c.get_int("num_hidden_layers");
    m.n_head = c.get_int("num_attention_heads");
    m.n_embd = c.get_int("hidden_size");
    m.ffn_dim = c.get_int("intermediate_size");
    m.n_kv_head = c.get_int("num_key_value_heads", m.n_head);
    // Qwen3Config's head_dim defaults to 128, LlamaConfig's to hidden_size / heads.
    m.head_dim = c.get_int("head_dim", base == "qwen3" ? 128 : 0);
    if (m.head_dim * m.n_head == m.n_embd) m.head_dim = 0;  // kiln's "n_embd / n_head"
    m.seq_len = c.get_int("max_position_embeddings");
    m.norm_eps = static_cast<float>(c.get_number("rms_norm_eps", 1e-6));
    if (!(m.norm_eps > 0.0f) || !std::isfinite(m.norm_eps))
      c.fail("rms_norm_eps", "must be finite and > 0, got " + c.j["rms_norm_eps"].dump());
    const Rope rope = read_rope(c, base == "qwen3" ? 1e6 : 1e4);
    m.rope_theta = rope.theta;
    m.rope_scaling = rope.scaling;
    m.tie_embeddings = c.get_bool("tie_word_embeddings", false);
    const std::string act = c.get_string("hidden_act", "silu");
    if (act != "silu") c.fail("hidden_act", "'" + act + "' is not supported (SwiGLU uses silu)");
    c.require("attention_bias", false, "kiln's " + type + " has no attention biases");
    c.require("mlp_bias", false, "kiln's " + type + " has no MLP biases");
    c.require("use_sliding_window", false, "sliding-window attention is not implemented");
    if (type == "mixtral")  // Mistral's attention is windowed where sliding_window is set
      c.require("sliding_window", nullptr, "sliding-window attention is not implemented");
    if (moe) m.moe = read_hf_moe(c, type, m);
    if (c.has("layer_types"))
      for (const json& t : c.j["layer_types"])
        if (t != "full_attention")
          c.fail("layer_types", t.dump() + " is not supported (full attention only)");
  }
  if (m.n_head % m.n_kv_head != 0)
    c.fail("num_key_value_heads", "must divide the number of attention heads");
  m.padded_vocab_size = 0;  // kiln's own padding: resolve_model_sizes()
  // kiln's own limits (config/schema.cpp's ranges for the same keys), then the model's shape
  // rules, each naming this file rather than failing later as a bug.
  if (m.vocab_size > 524288) c.fail("vocab_size", "must be at most 524288");
  if (m.n_layer > 4096)
    c.fail(type == "gpt2" ? "n_layer" : "num_hidden_layers", "must be at most 4096");
  if (m.positions == PositionKind::learned && m.seq_len > (1 << 20))
    c.fail("n_positions", "must be at most 1048576 (a learned position table)");
  ModelKeyError e = resolve_model_sizes(m);
  if (!e) e = model_config_error(m);
  if (e) throw InputError(path + ": " + e.key + ": " + e.what);
  return m;
}

std::vector<std::string> hf_config_mismatches(const ModelConfig& run, const ModelConfig& hf,
                                              const std::string& dir) {
  std::vector<std::string> out;
  const std::string where = dir + "/config.json";
  auto check = [&](const char* key, const std::string& a, const std::string& b) {
    if (a != b)
      out.push_back(std::string("model.") + key + ": " + a + " in the config, " + b + " in " +
                    where);
  };
  auto num = [](double v) {
    std::ostringstream s;
    s << v;
    return s.str();
  };
  auto str = [](bool b) { return std::string(b ? "true" : "false"); };
  const AttentionDims a = run.attention(), b = hf.attention();
  check("n_layer", std::to_string(run.n_layer), std::to_string(hf.n_layer));
  check("n_embd", std::to_string(run.n_embd), std::to_string(hf.n_embd));
  check("n_head", std::to_string(a.n_head), std::to_string(b.n_head));
  check("n_kv_head", std::to_string(a.n_kv_head), std::to_string(b.n_kv_head));
  check("head_dim", std::to_string(a.head_dim), std::to_string(b.head_dim));
  // A model whose every block is MoE has no dense MLP for ffn_dim to size.
  auto all_moe = [](const ModelConfig& m) { return m.moe.n_experts > 0 && m.moe.every == 1; };
  if (!(all_moe(run) && all_moe(hf)))
    check("ffn_dim", std::to_string(run.ffn_dim), std::to_string(hf.ffn_dim));
  check("vocab_size", std::to_string(run.vocab_size), std::to_string(hf.vocab_size));
  check("tie_embeddings", str(run.tie_embeddings), str(hf.tie_embeddings));
  check("norm", norm_name(run.norm), norm_name(hf.norm));
  check("norm_eps", num(run.norm_eps), num(hf.norm_eps));
  check("positions", position_name(run.positions), position_name(hf.positions));
  if (hf.positions == PositionKind::learned)
    check("seq_len", std::to_string(run.seq_len), std::to_string(hf.seq_len));
  else {
    check("rope_theta", num(run.rope_theta), num(hf.rope_theta));
    auto scaling = [&](const RopeScaling& s) {
      return s.type.empty()
                 ? std::string("none")
                 : s.type + " (factor " + num(s.factor) + ", low_freq_factor " +
                       num(s.low_freq_factor) + ", high_freq_factor " + num(s.high_freq_factor) +
                       ", original_max_position " + std::to_string(s.original_max_position) + ")";
    };
    check("rope_scaling", scaling(run.rope_scaling), scaling(hf.rope_scaling));
  }
  check("mlp", mlp_name(run.mlp), mlp_name(hf.mlp));
  check("bias", str(run.bias), str(hf.bias));
  check("qkv_bias", str(run.qkv_bias || run.bias), str(hf.qkv_bias || hf.bias));
  check("qk_norm", str(run.qk_norm), str(hf.qk_norm));
  // The experts' layout and routing; the balancing coefficients are the run's to choose.
  auto check_moe = [&](const char* key, const std::string& a, const std::string& b) {
    if (a != b)
      out.push_back(std::string("moe.") + key + ": " + a + " in the config, " + b + " in " + where);
  };
  const MoeConfig &x = run.moe, &y = hf.moe;
  check_moe("n_experts", std::to_string(x.n_experts), std::to_string(y.n_experts));
  if (x.n_experts > 0 && y.n_experts > 0) {
    check_moe("top_k", std::to_string(x.top_k), std::to_string(y.top_k));
    check_moe("expert_ffn_dim", std::to_string(x.expert_ffn_dim), std::to_string(y.expert_ffn_dim));
    check_moe("n_shared_experts", std::to_string(x.n_shared_experts),
              std::to_string(y.n_shared_experts));
    check_moe("every", std::to_string(x.every), std::to_string(y.every));
    check_moe("score", enum_name(x.score), enum_name(y.score));
    check_moe("renormalize", str(x.renormalize), str(y.renormalize));
  }
  return out;
}

void write_hf_config(const std::string& dir, const ModelConfig& cfg, const std::string& type,
                     const HfExportOptions& opts) {
  const AttentionDims a = cfg.attention();
  nlohmann::ordered_json j;
  const char* hf_dtype = opts.dtype == "bf16" ? "bfloat16" : "float32";
  if (type == "gpt2") {
    j = {{"architectures", {"GPT2LMHeadModel"}},
         {"model_type", "gpt2"},
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
  } else {
    const char* architecture = type == "qwen3"       ? "Qwen3ForCausalLM"
                               : type == "qwen3_moe" ? "Qwen3MoeForCausalLM"
                               : type == "mixtral"   ? "MixtralForCausalLM"
                                                     : "LlamaForCausalLM";
    j = {{"architectures", {architecture}},
         {"model_type", type},
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
    if (type == "llama" || type == "mixtral") j["mlp_bias"] = false;
    if (const RopeScaling& s = cfg.rope_scaling; !s.type.empty())
      j["rope_scaling"] = {{"rope_type", s.type},
                           {"factor", float_as_written(s.factor)},
                           {"low_freq_factor", float_as_written(s.low_freq_factor)},
                           {"high_freq_factor", float_as_written(s.high_freq_factor)},
                           {"original_max_position_embeddings", s.original_max_position}};
    if (type == "qwen3" || type == "qwen3_moe") {
      j["use_sliding_window"] = false;
      j["sliding_window"] = nullptr;
      j["max_window_layers"] = cfg.n_layer;
    }
    const MoeConfig& e = cfg.moe;
    if (type == "qwen3_moe") {
      j["num_experts"] = e.n_experts;
      j["num_experts_per_tok"] = e.top_k;
      j["moe_intermediate_size"] = e.expert_ffn_dim;
      j["decoder_sparse_step"] = e.every;
      j["mlp_only_layers"] = nlohmann::ordered_json::array();
      j["norm_topk_prob"] = e.renormalize;
    } else if (type == "mixtral") {
      j["intermediate_size"] = e.expert_ffn_dim;  // Mixtral's experts are its MLPs
      j["num_local_experts"] = e.n_experts;
      j["num_experts_per_tok"] = e.top_k;
      j["router_jitter_noise"] = 0.0;
      j["sliding_window"] = nullptr;
    }
    if (e.n_experts > 0) {
      j["router_aux_loss_coef"] = float_as_written(e.aux_loss_coef);
      j["output_router_logits"] = false;
    }
  }
  auto ids_json = [](const std::vector<int64_t>& ids) -> nlohmann::ordered_json {
    if (ids.empty()) return nullptr;
    if (ids.size() == 1) return ids[0];
    return ids;
  };
  j["bos_token_id"] = ids_json(opts.special_tokens.bos);
  j["eos_token_id"] = ids_json(opts.special_tokens.eos);
  j["tie_word_embeddings"] = cfg.tie_embeddings;
  j["use_cache"] = true;
  j["torch_dtype"] = hf_dtype;
  std::ofstream out(dir + "/config.json");
  out << j.dump(2) << "\n";
  if (!out) throw InputError(dir + "/config.json: cannot write");
}

}  // namespace kiln
