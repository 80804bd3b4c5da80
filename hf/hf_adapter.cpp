// The registry of Hugging Face families (hf/hf_adapter.h): the built-in adapters, one line each,
// and those registered beside them.
#include "hf/hf_adapter.h"

#include <algorithm>

#include "base/error.h"

namespace kiln {

// The built-in families, each defined in its own file, in the order export asks them.
const HfAdapter& hf_gpt2_adapter();       // hf/hf_gpt2.cpp
const HfAdapter& hf_llama_adapter();      // hf/hf_llama.cpp
const HfAdapter& hf_qwen3_adapter();      // hf/hf_qwen3.cpp
const HfAdapter& hf_qwen3_moe_adapter();  // hf/hf_moe.cpp
const HfAdapter& hf_mixtral_adapter();    // hf/hf_moe.cpp

namespace {

std::vector<const HfAdapter*>& registry() {
  static std::vector<const HfAdapter*> adapters = {
      &hf_gpt2_adapter(),      &hf_llama_adapter(),   &hf_qwen3_adapter(),
      &hf_qwen3_moe_adapter(), &hf_mixtral_adapter(),
  };
  return adapters;
}

// "a, b and c"
std::string listed(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i)
    out += (i == 0 ? "" : i + 1 == names.size() ? " and " : ", ") + names[i];
  return out;
}

}  // namespace

std::vector<const HfAdapter*> hf_adapters() {
  return registry();
}

const HfAdapter* find_hf_adapter(const std::string& model_type) {
  for (const HfAdapter* a : registry())
    if (a->model_type() == model_type) return a;
  return nullptr;
}

std::string hf_model_types() {
  std::vector<std::string> types;
  for (const HfAdapter* a : registry()) types.push_back(a->model_type());
  return listed(types);
}

const HfAdapter& hf_adapter_for(const ModelConfig& c) {
  std::vector<std::string> architectures;
  std::string refusal;
  for (const HfAdapter* a : registry()) {
    const HfFit fit = a->fit(c);
    if (fit.exports()) return *a;
    if (fit.family && refusal.empty()) refusal = fit.refusal;
    architectures.push_back(a->architecture());
  }
  // A family whose layers the model has names the option it has no place for.
  if (!refusal.empty()) throw InputError(refusal);
  auto str = [](bool b) { return b ? "true" : "false"; };
  throw InputError(std::string("no Hugging Face architecture has this model's layers (norm ") +
                   norm_name(c.norm) + ", positions " + position_name(c.positions) + ", mlp " +
                   mlp_name(c.mlp) + ", bias " + str(c.bias) + ", qkv_bias " + str(c.qkv_bias) +
                   ", qk_norm " + str(c.qk_norm) + ", moe.n_experts " +
                   std::to_string(c.moe.n_experts) + "); " + listed(architectures) +
                   " are exported");
}

HfAdapterRegistration::HfAdapterRegistration(const HfAdapter& adapter) : adapter_(&adapter) {
  if (find_hf_adapter(adapter.model_type()))
    throw std::invalid_argument("hf: model_type '" + adapter.model_type() +
                                "' is registered already");
  registry().push_back(adapter_);
}

HfAdapterRegistration::~HfAdapterRegistration() {
  std::vector<const HfAdapter*>& r = registry();
  r.erase(std::remove(r.begin(), r.end(), adapter_), r.end());
}

}  // namespace kiln
