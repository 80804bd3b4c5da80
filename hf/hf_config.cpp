// config.json <-> ModelConfig: a Hugging Face model's config read into kiln's by its family's
// adapter (hf/hf_adapter.h: each key checked, what kiln does not implement refused by name) and
// held to kiln's shape rules, compared with a run's, and kiln's written as the config.json
// transformers loads.
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "base/error.h"
#include "hf/hf_adapter.h"
#include "hf/hf_files.h"
#include "hf/hf_model.h"
#include "model/model_rules.h"

namespace kiln {

namespace fs = std::filesystem;
using nlohmann::json;

bool HfConfigJson::has(const char* key) const {
  return j.contains(key) && !j[key].is_null();
}

void HfConfigJson::fail(const char* key, const std::string& what) const {
  throw InputError(path + ": " + key + ": " + what);
}

int HfConfigJson::get_int(const char* key) const {
  if (!has(key)) fail(key, "missing");
  if (!j[key].is_number_integer() || j[key].get<int64_t>() <= 0 ||
      j[key].get<int64_t>() > INT32_MAX)
    fail(key, "expected a positive integer, got " + j[key].dump());
  return j[key].get<int>();
}

int HfConfigJson::get_int(const char* key, int fallback) const {
  return has(key) ? get_int(key) : fallback;
}

double HfConfigJson::get_number(const char* key, double fallback) const {
  if (!has(key)) return fallback;
  if (!j[key].is_number()) fail(key, "expected a number, got " + j[key].dump());
  return j[key].get<double>();
}

bool HfConfigJson::get_bool(const char* key, bool fallback) const {
  if (!has(key)) return fallback;
  if (!j[key].is_boolean()) fail(key, "expected true or false, got " + j[key].dump());
  return j[key].get<bool>();
}

std::string HfConfigJson::get_string(const char* key, const std::string& fallback) const {
  if (!has(key)) return fallback;
  if (!j[key].is_string()) fail(key, "expected a string, got " + j[key].dump());
  return j[key].get<std::string>();
}

void HfConfigJson::require(const char* key, const json& expected, const std::string& why) const {
  if (has(key) && j[key] != expected) fail(key, j[key].dump() + " is not supported (" + why + ")");
}

void HfConfigJson::at_most(const char* key, int value, int most, const std::string& why) const {
  if (value > most)
    fail(key, "must be at most " + std::to_string(most) + (why.empty() ? "" : " (" + why + ")"));
}

ModelConfig read_hf_config(const std::string& dir) {
  const std::string path = dir + "/config.json";
  if (!fs::is_directory(dir))
    throw InputError(dir + ": not a directory (expected a Hugging Face model)");
  const HfConfigJson c{read_json(path), path};
  if (!c.j.is_object()) throw InputError(path + ": not a JSON object");
  const std::string type = c.get_string("model_type", "");
  const HfAdapter* family = find_hf_adapter(type);
  if (!family)
    c.fail("model_type", "'" + type + "' is not supported (kiln imports " + hf_model_types() + ")");
  ModelConfig m = family->read_config(c);
  // kiln's own padding, then the model's shape rules, each naming this file rather than
  // failing later as a bug.
  m.padded_vocab_size = 0;
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

void write_hf_config(const std::string& dir, const ModelConfig& cfg, const HfAdapter& family,
                     const HfExportOptions& opts) {
  nlohmann::ordered_json j = family.write_config(cfg, opts);
  auto ids_json = [](const std::vector<int64_t>& ids) -> nlohmann::ordered_json {
    if (ids.empty()) return nullptr;
    if (ids.size() == 1) return ids[0];
    return ids;
  };
  j["bos_token_id"] = ids_json(opts.special_tokens.bos);
  j["eos_token_id"] = ids_json(opts.special_tokens.eos);
  j["tie_word_embeddings"] = cfg.tie_embeddings;
  j["use_cache"] = true;
  j["torch_dtype"] = opts.dtype == "bf16" ? "bfloat16" : "float32";
  std::ofstream out(dir + "/config.json");
  out << j.dump(2) << "\n";
  if (!out) throw InputError(dir + "/config.json: cannot write");
}

}  // namespace kiln
