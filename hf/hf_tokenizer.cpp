// The tokenizer files transformers keeps beside a model, and the model's begin/end-of-sequence
// ids from config.json or the tokenizer's own files.
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>

#include "base/error.h"
#include "hf/hf_files.h"
#include "hf/hf_model.h"

namespace kiln {

namespace fs = std::filesystem;
using nlohmann::json;

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

}  // namespace kiln
