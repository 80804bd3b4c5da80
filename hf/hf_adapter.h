// A Hugging Face model family as kiln maps it, and the registry of families. One adapter per
// family (hf/hf_gpt2.cpp, hf/hf_llama.cpp, hf/hf_qwen3.cpp; hf/hf_moe.cpp for Qwen3-MoE and
// Mixtral) maps config.json and the weights both ways. The one design choice: everything that
// names a family (its config.json keys, its tensor names, which kiln models it can hold) is in
// its adapter, so read_hf_config, load_hf_weights and export_hf (hf/hf_model.h) look the family
// up here, by config.json's model_type on import and by the model's layer choices on export,
// and never branch on it. Adding a family is an adapter file and a line of the registry
// (hf/hf_adapter.cpp; docs/models.md, "Adding a model family").
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "hf/hf_model.h"

namespace kiln {

// kiln's ranges for the sizes an import reads (the config schema's, config/schema.cpp): past
// them a config.json is refused, naming its key.
constexpr int kHfMaxLayers = 4096;
constexpr int kHfMaxVocab = 524288;
constexpr int kHfMaxLearnedPositions = 1 << 20;

// config.json with typed access to its keys, each error naming the file and the key.
struct HfConfigJson {
  nlohmann::json j;
  std::string path;

  bool has(const char* key) const;
  [[noreturn]] void fail(const char* key, const std::string& what) const;
  // A positive integer: required, or `fallback` where the key is absent or null.
  int get_int(const char* key) const;
  int get_int(const char* key, int fallback) const;
  double get_number(const char* key, double fallback) const;
  bool get_bool(const char* key, bool fallback) const;
  std::string get_string(const char* key, const std::string& fallback) const;
  // Refuses a key whose value changes the model in a way kiln does not implement.
  void require(const char* key, const nlohmann::json& expected, const std::string& why) const;
  // Refuses `value`, read from `key`, past kiln's range ("must be at most 4096" and `why`).
  void at_most(const char* key, int value, int most, const std::string& why = "") const;
};

// What an adapter says of a kiln model it is asked to export.
struct HfFit {
  bool family = false;  // the model's layer choices are this family's
  std::string refusal;  // ... but it has an option the family has no place for, named
  bool exports() const { return family && refusal.empty(); }
};

// One family. Export asks the registered adapters in order and takes the first that fits.
class HfAdapter {
 public:
  virtual ~HfAdapter() = default;
  // config.json's model_type ("llama") and its architectures entry ("LlamaForCausalLM").
  virtual std::string model_type() const = 0;
  virtual std::string architecture() const = 0;
  // Whether kiln's model `cfg` is one of this family's (export).
  virtual HfFit fit(const ModelConfig& cfg) const = 0;
  // config.json's keys into a ModelConfig (import): the layer choices and sizes, each key
  // checked and what kiln does not implement refused by name (c.fail). read_hf_config then
  // derives padded_vocab_size and holds the model to the shape rules (model/model_rules.h).
  virtual ModelConfig read_config(const HfConfigJson& c) const = 0;
  // The family's keys of config.json for `cfg`, which read_config reads back as `cfg`; export_hf
  // adds what every family has (bos and eos ids, tie_word_embeddings, use_cache, torch_dtype).
  virtual nlohmann::ordered_json write_config(const ModelConfig& cfg,
                                              const HfExportOptions& opts) const = 0;
  // Every kiln tensor of `cfg` and the HF tensors that make it up (HfTensorMap, hf/hf_model.h),
  // in HF's order; `prefix` is one of weight_prefixes(), before the names that carry it.
  virtual std::vector<HfTensorMap> weight_map(const ModelConfig& cfg,
                                              const std::string& prefix) const = 0;
  // The prefixes a saved model's tensor names may carry. Import takes the first whose first
  // tensor the files hold (else the last, which the missing tensor's error then names); export
  // writes the first.
  virtual std::vector<std::string> weight_prefixes() const { return {""}; }
  // A tensor the family's files may carry that is no parameter (GPT-2's causal-mask buffers).
  virtual bool is_buffer(const std::string& /*name*/) const { return false; }
};

// The registered families in the order export asks them: the built-in ones, then any added by
// an HfAdapterRegistration.
std::vector<const HfAdapter*> hf_adapters();
// The family of config.json's model_type; nullptr for none.
const HfAdapter* find_hf_adapter(const std::string& model_type);
// The registered model_types, listed for a message ("gpt2, llama and qwen3").
std::string hf_model_types();
// The family kiln exports `cfg` as: the first that fits. InputError naming the option no family
// has a place for, or the layer choices where none has them.
const HfAdapter& hf_adapter_for(const ModelConfig& cfg);

// A family registered after the built-in ones for the registration's lifetime (a family kept
// outside hf/, or a test's). Register before any import or export runs: the registry is not
// guarded for threads.
class HfAdapterRegistration {
 public:
  explicit HfAdapterRegistration(const HfAdapter& adapter);
  ~HfAdapterRegistration();
  HfAdapterRegistration(const HfAdapterRegistration&) = delete;
  HfAdapterRegistration& operator=(const HfAdapterRegistration&) = delete;

 private:
  const HfAdapter* adapter_;
};

}  // namespace kiln
