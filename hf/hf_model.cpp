// Hugging Face config.json and weights <-> kiln ModelConfig and parameters. See hf_model.h.
#include "hf/hf_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "hf/safetensors.h"
#include "kernels/error.h"

namespace kiln {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

json read_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw InputError(path + ": cannot read");
  try {
    return json::parse(in);
  } catch (const json::parse_error& e) {
    throw InputError(path + ": malformed JSON: " + e.what());
  }
}

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

std::string join_shape(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? "," : "") + std::to_string(s[i]);
  return out + "]";
}

// The opened safetensors files of a directory and which file holds each tensor.
struct HfFiles {
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::map<std::string, std::pair<const SafetensorsFile*, const SafeTensorInfo*>> by_name;
};

HfFiles open_hf_files(const std::string& dir) {
  HfFiles out;
  const std::string index = dir + "/model.safetensors.index.json";
  const std::string single = dir + "/model.safetensors";
  std::map<std::string, std::string> weight_map;  // tensor -> file, from the index
  std::vector<std::string> names;
  if (fs::exists(single)) {
    names.push_back("model.safetensors");
  } else if (fs::exists(index)) {
    const json j = read_json(index);
    if (!j.contains("weight_map") || !j["weight_map"].is_object())
      throw InputError(index + ": no weight_map object");
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it->is_string()) throw InputError(index + ": weight_map['" + it.key() + "'] is not a file name");
      const std::string file = it->get<std::string>();
      if (file.find('/') != std::string::npos)
        throw InputError(index + ": weight_map['" + it.key() + "'] names '" + file +
                         "' outside the directory");
      weight_map[it.key()] = file;
      if (std::find(names.begin(), names.end(), file) == names.end()) names.push_back(file);
    }
  } else {
    throw InputError(dir + ": no model.safetensors or model.safetensors.index.json (only "
                           "safetensors weights are read, not pytorch_model.bin)");
  }
  for (const std::string& name : names) {
    out.files.push_back(std::make_unique<SafetensorsFile>(SafetensorsFile::open(dir + "/" + name)));
    const SafetensorsFile& f = *out.files.back();
    for (const SafeTensorInfo& t : f.tensors()) {
      auto [it, fresh] = out.by_name.emplace(t.name, std::make_pair(&f, &t));
      if (!fresh)
        throw InputError(f.path() + ": tensor '" + t.name + "' is also in " + it->second.first->path());
    }
  }
  for (const auto& [tensor, file] : weight_map) {
    auto it = out.by_name.find(tensor);
    if (it == out.by_name.end() || fs::path(it->second.first->path()).filename() != file)
      throw InputError(index + ": tensor '" + tensor + "' is not in " + dir + "/" + file);
  }
  return out;
}

// Tensors a checkpoint may carry that are not parameters: GPT-2's causal-mask buffers, old
// LLaMA's RoPE frequencies.
bool is_buffer(const std::string& name) {
  auto ends_with = [&](const char* s) {
    const size_t n = std::strlen(s);
    return name.size() >= n && name.compare(name.size() - n, n, s) == 0;
  };
  return ends_with(".attn.bias") || ends_with(".attn.masked_bias") ||
         ends_with("rotary_emb.inv_freq");
}

// A kiln tensor's rows as the weight map counts them: its last dimension wide (an expert
// tensor [E, R, W] is E*R rows of W), one value for a vector.
int64_t row_width(const ParamInfo& p) {
  return p.shape.ndim >= 2 ? p.shape[p.shape.ndim - 1] : 1;
}

// Qwen3-MoE's and Mixtral's experts: softmax routing to the top num_experts_per_tok, SwiGLU
// experts, no shared expert. Qwen3-MoE routes every decoder_sparse_step-th block
// (mlp_only_layers must be empty) and renormalizes as norm_topk_prob says; Mixtral routes every
// block and always renormalizes (its softmax over the top-k logits is the same thing).
MoeConfig read_hf_moe(const ConfigJson& c, const std::string& type, const ModelConfig& m) {
  MoeConfig moe;
  const bool qwen = type == "qwen3_moe";
  // transformers 4.x writes Qwen3-MoE's num_experts, 5.x num_local_experts, as Mixtral's.
  moe.n_experts = qwen && c.has("num_experts") ? c.get_int("num_experts")
                                               : c.get_int("num_local_experts");
  moe.top_k = c.get_int("num_experts_per_tok");
  if (moe.top_k > moe.n_experts)
    c.fail("num_experts_per_tok", "must be at most the number of experts");
  moe.expert_ffn_dim = qwen ? c.get_int("moe_intermediate_size") : m.ffn_dim;
  moe.every = qwen ? c.get_int("decoder_sparse_step", 1) : 1;
  moe.renormalize = qwen ? c.get_bool("norm_topk_prob", false) : true;
  moe.aux_loss_coef = static_cast<float>(c.get_number("router_aux_loss_coef", 0.001));
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

// The HF MoE model_type of a kiln MoE model whose blocks are otherwise `dense`'s (llama or
// qwen3): Qwen3-MoE (QK-norm) or Mixtral (LLaMA attention, every block routed, renormalized);
// InputError naming what neither has.
std::string hf_moe_model_type(const ModelConfig& c, const std::string& dense) {
  const MoeConfig& e = c.moe;
  auto refuse = [](const std::string& why) {
    throw InputError("no Hugging Face MoE architecture (Qwen3MoeForCausalLM, "
                     "MixtralForCausalLM) has this model's experts: " + why);
  };
  if (e.score != MoeScore::softmax) refuse("moe.score=sigmoid (both route by softmax)");
  if (e.n_shared_experts > 0) refuse("moe.n_shared_experts > 0 (neither has a shared expert)");
  if (e.bias_balance)
    refuse("moe.balance=bias (the routing bias it learned has no place in either; retrain with "
           "aux_loss or none)");
  if (dense == "qwen3") return "qwen3_moe";
  if (e.every != 1) refuse("moe.every > 1 without QK-norm (Mixtral routes every block)");
  if (!e.renormalize) refuse("moe.renormalize=false (Mixtral renormalizes the top-k weights)");
  return "mixtral";
}

// Block l's MoE tensors: the router, then expert e's gate and up stacked into kiln's fc
// [E, 2F, C] (rows e*2F and e*2F+F) and its down into proj [E, C, F] (rows e*C).
void add_moe_block(std::vector<HfTensorMap>& map, const ModelConfig& c, const std::string& type,
                   const std::string& k, const std::string& h) {
  const int64_t E = c.moe.n_experts, F = c.moe.expert_ffn_dim, C = c.n_embd;
  const bool qwen = type == "qwen3_moe";
  const std::string block = h + (qwen ? "mlp." : "block_sparse_moe.");
  map.push_back({k + "moe.router.weight", {{block + "gate.weight", {E, C}, 0, false}}});
  HfTensorMap fc{k + "moe.experts.fc.weight", {}}, proj{k + "moe.experts.proj.weight", {}};
  for (int64_t e = 0; e < E; ++e) {
    const std::string x = block + "experts." + std::to_string(e) + ".";
    fc.pieces.push_back({x + (qwen ? "gate_proj" : "w1") + ".weight", {F, C}, e * 2 * F, false});
    fc.pieces.push_back({x + (qwen ? "up_proj" : "w3") + ".weight", {F, C}, e * 2 * F + F, false});
    proj.pieces.push_back({x + (qwen ? "down_proj" : "w2") + ".weight", {C, F}, e * C, false});
  }
  map.push_back(std::move(fc));
  map.push_back(std::move(proj));
}

}  // namespace

std::optional<std::string> hf_dir_of(const std::string& spec) {
  if (spec.rfind("hf:", 0) != 0) return std::nullopt;
  std::string dir = spec.substr(3);
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  return dir;
}

ModelConfig read_hf_config(const std::string& dir) {
  const std::string path = dir + "/config.json";
  if (!fs::is_directory(dir)) throw InputError(dir + ": not a directory (expected a Hugging Face model)");
  const ConfigJson c{read_json(path), path};
  if (!c.j.is_object()) throw InputError(path + ": not a JSON object");
  const std::string type = c.get_string("model_type", "");
  // The MoE models are their dense architecture's decoder with routed experts.
  const bool moe = type == "qwen3_moe" || type == "mixtral";
  const std::string base = type == "qwen3_moe" ? "qwen3" : type == "mixtral" ? "llama" : type;
  if (!(moe || find_arch(type)))
    c.fail("model_type", "'" + type + "' is not supported (kiln imports gpt2, llama, qwen3, "
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
      c.fail("activation_function", "'" + act + "' is not supported (kiln's GELU is the tanh form, gelu_new)");
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
  m.padded_vocab_size = (m.vocab_size + 127) / 128 * 128;
  return m;
}

std::vector<std::string> hf_config_mismatches(const ModelConfig& run, const ModelConfig& hf,
                                              const std::string& dir) {
  std::vector<std::string> out;
  const std::string where = dir + "/config.json";
  auto check = [&](const char* key, const std::string& a, const std::string& b) {
    if (a != b) out.push_back(std::string("model.") + key + ": " + a + " in the config, " + b + " in " + where);
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
      return s.type.empty() ? std::string("none")
                            : s.type + " (factor " + num(s.factor) + ", low_freq_factor " +
                                  num(s.low_freq_factor) + ", high_freq_factor " +
                                  num(s.high_freq_factor) + ", original_max_position " +
                                  std::to_string(s.original_max_position) + ")";
    };
    check("rope_scaling", scaling(run.rope_scaling), scaling(hf.rope_scaling));
  }
  check("mlp", mlp_name(run.mlp), mlp_name(hf.mlp));
  check("bias", str(run.bias), str(hf.bias));
  check("qkv_bias", str(run.qkv_bias || run.bias), str(hf.qkv_bias || hf.bias));
  check("qk_norm", str(run.qk_norm), str(hf.qk_norm));
  // The experts' layout and routing; the balancing coefficients are the run's to choose.
  auto check_moe = [&](const char* key, const std::string& a, const std::string& b) {
    if (a != b) out.push_back(std::string("moe.") + key + ": " + a + " in the config, " + b + " in " + where);
  };
  const MoeConfig &x = run.moe, &y = hf.moe;
  check_moe("n_experts", std::to_string(x.n_experts), std::to_string(y.n_experts));
  if (x.n_experts > 0 && y.n_experts > 0) {
    check_moe("top_k", std::to_string(x.top_k), std::to_string(y.top_k));
    check_moe("expert_ffn_dim", std::to_string(x.expert_ffn_dim), std::to_string(y.expert_ffn_dim));
    check_moe("n_shared_experts", std::to_string(x.n_shared_experts),
              std::to_string(y.n_shared_experts));
    check_moe("every", std::to_string(x.every), std::to_string(y.every));
    check_moe("score", x.score == MoeScore::softmax ? "softmax" : "sigmoid",
              y.score == MoeScore::softmax ? "softmax" : "sigmoid");
    check_moe("renormalize", str(x.renormalize), str(y.renormalize));
  }
  return out;
}

std::string hf_model_type(const ModelConfig& c) {
  const AttentionDims a = c.attention();
  if (c.norm == NormKind::layernorm && c.positions == PositionKind::learned &&
      c.mlp == MlpKind::gelu && c.bias && !c.qk_norm && a.n_kv_head == a.n_head &&
      a.head_dim * a.n_head == c.n_embd && c.moe.n_experts == 0)
    return "gpt2";
  if (c.norm == NormKind::rmsnorm && c.positions == PositionKind::rope &&
      c.mlp == MlpKind::swiglu && !c.bias && !c.qkv_bias) {
    const std::string dense = c.qk_norm ? "qwen3" : "llama";
    return c.moe.n_experts > 0 ? hf_moe_model_type(c, dense) : dense;
  }
  throw InputError(std::string("no Hugging Face architecture has this model's layers (norm ") +
                   norm_name(c.norm) + ", positions " + position_name(c.positions) + ", mlp " +
                   mlp_name(c.mlp) + ", bias " + (c.bias ? "true" : "false") + ", qkv_bias " +
                   (c.qkv_bias ? "true" : "false") + ", qk_norm " + (c.qk_norm ? "true" : "false") +
                   "); GPT2LMHeadModel, LlamaForCausalLM, Qwen3ForCausalLM and their MoE kin "
                   "(Qwen3MoeForCausalLM, MixtralForCausalLM) are exported");
}

std::vector<HfTensorMap> hf_weight_map(const ModelConfig& c, const std::string& prefix) {
  const std::string type = hf_model_type(c);
  const AttentionDims a = c.attention();
  const int64_t C = c.n_embd, F = c.ffn_dim, V = c.vocab_size;
  const int64_t q = a.q_dim(), kv = static_cast<int64_t>(a.n_kv_head) * a.head_dim;
  std::vector<HfTensorMap> map;
  auto one = [&](const std::string& kiln, const std::string& hf, std::vector<int64_t> shape,
                 bool transpose = false) {
    map.push_back({kiln, {{hf, std::move(shape), 0, transpose}}});
  };
  if (type == "gpt2") {
    const std::string& p = prefix;
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
  } else {
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
        add_moe_block(map, c, type, k, h);
        continue;
      }
      map.push_back({k + "mlp.fc.weight",
                     {{h + "mlp.gate_proj.weight", {F, C}, 0, false},
                      {h + "mlp.up_proj.weight", {F, C}, F, false}}});
      one(k + "mlp.proj.weight", h + "mlp.down_proj.weight", {C, F});
    }
    one("lnf.weight", "model.norm.weight", {C});
  }
  if (!c.tie_embeddings) one("lm_head", "lm_head.weight", {V, C});
  return map;
}

std::vector<float> load_hf_weights(const std::string& dir, const ModelConfig& cfg,
                                   const ParamLayout& layout) {
  const HfFiles files = open_hf_files(dir);
  const std::string type = hf_model_type(cfg);
  // GPT2LMHeadModel.save_pretrained prefixes "transformer."; the original GPT-2 files do not.
  const std::string prefix =
      type == "gpt2" && files.by_name.count("transformer.wte.weight") ? "transformer." : "";
  std::vector<float> params(static_cast<size_t>(layout.total), 0.0f);
  std::set<std::string> used;
  std::vector<float> buf;
  for (const HfTensorMap& m : hf_weight_map(cfg, prefix)) {
    const ParamInfo& p = layout.find(m.kiln_name);
    const int64_t cols = row_width(p);
    for (const HfPiece& piece : m.pieces) {
      auto it = files.by_name.find(piece.name);
      if (it == files.by_name.end())
        throw InputError(dir + ": tensor '" + piece.name + "' (kiln's " + m.kiln_name +
                         ") is missing from the safetensors files");
      const auto [file, info] = it->second;
      if (info->shape != piece.shape)
        throw InputError(file->path() + ": tensor '" + piece.name + "' has shape " +
                         info->shape_str() + ", config.json's sizes give " + join_shape(piece.shape));
      buf.resize(static_cast<size_t>(info->numel()));
      file->read_f32(*info, buf.data());
      const int64_t bad =
          std::count_if(buf.begin(), buf.end(), [](float v) { return !std::isfinite(v); });
      if (bad > 0)
        throw InputError(file->path() + ": tensor '" + piece.name + "' holds " +
                         std::to_string(bad) + " NaN or infinite values of " +
                         std::to_string(buf.size()) + " (a weight must be finite)");
      float* dst = params.data() + p.offset + piece.row * cols;
      if (piece.transpose) {  // [in, out] -> rows of out, each `in` wide
        const int64_t in = piece.shape[0], out = piece.shape[1];
        for (int64_t o = 0; o < out; ++o)
          for (int64_t i = 0; i < in; ++i) dst[o * in + i] = buf[static_cast<size_t>(i * out + o)];
      } else {
        std::copy(buf.begin(), buf.end(), dst);
      }
      used.insert(piece.name);
    }
  }
  for (const auto& [name, where] : files.by_name) {
    if (used.count(name) || is_buffer(name)) continue;
    // transformers may save a tied head too: it is the embedding again.
    if (cfg.tie_embeddings && name == "lm_head.weight") continue;
    throw InputError(where.first->path() + ": unexpected tensor '" + name + "' (not part of a " +
                     type + " model of config.json's sizes)");
  }
  return params;
}

namespace {

constexpr const char* kTokenizerFiles[] = {
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt",     "tokenizer.model",       "added_tokens.json"};

// A token id as config.json writes it: a number or a list of numbers (null: none).
std::vector<int64_t> read_token_ids(const json& v, const std::string& where) {
  std::vector<int64_t> ids;
  if (v.is_null()) return ids;
  for (const json& id : v.is_array() ? v : json::array({v})) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0)
      throw InputError(where + ": expected a token id or a list of them, got " + v.dump());
    ids.push_back(id.get<int64_t>());
  }
  return ids;
}

// The content of a special token as tokenizer_config.json writes it: "<s>" or {"content": "<s>"}.
std::string token_content(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string())
    return v["content"].get<std::string>();
  return "";
}

// The special tokens named in tokenizer_config.json (else special_tokens_map.json), numbered
// by tokenizer.json's added tokens or its model's vocabulary.
HfSpecialTokens special_tokens_from_tokenizer(const std::string& dir) {
  HfSpecialTokens out;
  std::string names_path;
  for (const char* f : {"tokenizer_config.json", "special_tokens_map.json"})
    if (fs::exists(dir + "/" + f)) {
      names_path = dir + "/" + f;
      break;
    }
  const std::string tokenizer_path = dir + "/tokenizer.json";
  if (names_path.empty() || !fs::exists(tokenizer_path)) return out;
  const json names = read_json(names_path);
  const json tokenizer = read_json(tokenizer_path);
  auto id_of = [&](const std::string& content) -> std::optional<int64_t> {
    if (tokenizer.contains("added_tokens") && tokenizer["added_tokens"].is_array())
      for (const json& t : tokenizer["added_tokens"])
        if (t.is_object() && t.value("content", "") == content && t.contains("id") &&
            t["id"].is_number_integer())
          return t["id"].get<int64_t>();
    const json* vocab = tokenizer.contains("model") && tokenizer["model"].is_object() &&
                                tokenizer["model"].contains("vocab")
                            ? &tokenizer["model"]["vocab"]
                            : nullptr;
    if (vocab && vocab->is_object() && vocab->contains(content) &&
        (*vocab)[content].is_number_integer())
      return (*vocab)[content].get<int64_t>();
    return std::nullopt;
  };
  for (auto [key, ids] : {std::pair{"bos_token", &out.bos}, {"eos_token", &out.eos}}) {
    const std::string content = names.contains(key) ? token_content(names[key]) : "";
    if (content.empty()) continue;
    const std::optional<int64_t> id = id_of(content);
    if (!id)
      throw InputError(names_path + ": " + key + " '" + content + "' is not a token of " +
                       tokenizer_path);
    ids->push_back(*id);
  }
  return out;
}

}  // namespace

std::vector<std::string> hf_tokenizer_files(const std::string& dir) {
  std::vector<std::string> found;
  for (const char* f : kTokenizerFiles)
    if (fs::is_regular_file(dir + "/" + f)) found.push_back(f);
  return found;
}

HfSpecialTokens read_hf_special_tokens(const std::string& dir, int vocab_size) {
  HfSpecialTokens out;
  const std::string config_path = dir + "/config.json";
  if (fs::exists(config_path)) {
    const json config = read_json(config_path);
    for (auto [key, ids] : {std::pair{"bos_token_id", &out.bos}, {"eos_token_id", &out.eos}})
      if (config.contains(key)) *ids = read_token_ids(config[key], config_path + ": " + key);
  }
  if (out.bos.empty() && out.eos.empty()) out = special_tokens_from_tokenizer(dir);
  for (const std::vector<int64_t>* ids : {&out.bos, &out.eos})
    for (int64_t id : *ids)
      if (id >= vocab_size)
        throw InputError(dir + ": special token id " + std::to_string(id) +
                         " is not below the model's vocab_size " + std::to_string(vocab_size) +
                         " (a tokenizer of another model?)");
  return out;
}

std::vector<std::string> export_hf(const std::string& dir, const ModelConfig& cfg,
                                   const ParamLayout& layout, const float* params,
                                   const HfExportOptions& opts) {
  const std::string type = hf_model_type(cfg);
  if (opts.dtype != "bf16" && opts.dtype != "f32")
    throw InputError("export dtype must be bf16 or f32, got '" + opts.dtype + "'");
  const AttentionDims a = cfg.attention();
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw InputError(dir + ": cannot create directory: " + ec.message());
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("model", 0) == 0 && (e.path().extension() == ".safetensors" ||
                                        name == "model.safetensors.index.json"))
      fs::remove(e.path());
  }

  // The tensors in HF's shapes: rows of the flat buffer where they are rows, else transposed.
  struct Out {
    SafeTensorWrite t;
    std::vector<float> owned;
  };
  std::vector<Out> outs;
  for (const HfTensorMap& m : hf_weight_map(cfg, type == "gpt2" ? "transformer." : "")) {
    const ParamInfo& p = layout.find(m.kiln_name);
    const int64_t cols = row_width(p);
    for (const HfPiece& piece : m.pieces) {
      Out o;
      o.t.name = piece.name;
      o.t.shape = piece.shape;
      const float* src = params + p.offset + piece.row * cols;
      if (piece.transpose) {
        const int64_t in = piece.shape[0], out = piece.shape[1];
        o.owned.resize(static_cast<size_t>(in * out));
        for (int64_t i = 0; i < in; ++i)
          for (int64_t r = 0; r < out; ++r) o.owned[static_cast<size_t>(i * out + r)] = src[r * in + i];
      } else {
        o.t.data = src;
      }
      outs.push_back(std::move(o));
    }
  }
  for (Out& o : outs)
    if (!o.owned.empty()) o.t.data = o.owned.data();

  // Greedy shards of at most max_shard_bytes (a larger tensor gets one to itself).
  const int64_t elem = opts.dtype == "bf16" ? 2 : 4;
  std::vector<std::vector<SafeTensorWrite>> shards(1);
  int64_t shard_bytes = 0, total = 0;
  for (const Out& o : outs) {
    int64_t bytes = elem;
    for (int64_t d : o.t.shape) bytes *= d;
    if (shard_bytes > 0 && shard_bytes + bytes > opts.max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(o.t);
    shard_bytes += bytes;
    total += bytes;
  }
  const std::string st_dtype = opts.dtype == "bf16" ? "BF16" : "F32";
  std::vector<std::string> written;
  json weight_map = json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    char name[64];
    if (shards.size() == 1)
      std::snprintf(name, sizeof name, "model.safetensors");
    else
      std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
    write_safetensors(dir + "/" + name, shards[s], st_dtype, {{"format", "pt"}});
    written.push_back(name);
    for (const SafeTensorWrite& t : shards[s]) weight_map[t.name] = name;
  }
  if (shards.size() > 1) {
    const json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    std::ofstream(dir + "/model.safetensors.index.json") << index.dump(2) << "\n";
    written.push_back("model.safetensors.index.json");
  }

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
  written.push_back("config.json");
  return written;
}

}  // namespace kiln
